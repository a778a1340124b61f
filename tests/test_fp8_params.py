"""FP8 parameters: fusible.quantized_model_init keeps linear weights as Float8Tensor
parameters (no high-precision copy), read as they are by the FP8 GEMMs, dequantized
outside autocast, updated in place by optimizers; eager and compiled alike."""

import copy

import pytest
import torch

import fusible
from fusible import ops
from fusible.quantization import Float8Tensor
from fusible.testing import snr_db

DTYPE = torch.bfloat16


def _model(fp8_params: bool = True):
    torch.manual_seed(0)
    with fusible.quantized_model_init(enabled=fp8_params):
        model = ops.Sequential(ops.Linear(32, 64), ops.GELU(approximate="tanh"),
                               ops.BasicLinear(64, 32))
    return model.to(DTYPE)


def _dequantized_twin(model):
    """The same model with plain weights holding the FP8 weights' values."""
    twin = _model(False)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), model.parameters()):
            p.copy_(q.dequantize() if isinstance(q, Float8Tensor) else q)
    return twin


def test_weights_are_fp8_parameters():
    model = _model()
    w1, b1, w2 = model.parameters()
    for w in (w1, w2):
        assert isinstance(w, Float8Tensor) and isinstance(w, torch.nn.Parameter)
        assert w.fp8_dtype == torch.float8_e4m3fn and w.dtype == DTYPE and w.requires_grad
        assert torch.equal(w._transpose.view(torch.uint8), w._data.view(torch.uint8).t())
    assert type(b1) is torch.nn.Parameter  # biases stay in high precision
    assert all(type(p) is torch.nn.Parameter for p in _model(False).parameters())
    with fusible.quantized_model_init():
        with fusible.quantized_model_init(enabled=False):
            assert type(ops.BasicLinear(4, 4).weight) is torch.nn.Parameter
        assert isinstance(ops.BasicLinear(16, 16).weight, Float8Tensor)
    assert type(ops.BasicLinear(4, 4).weight) is torch.nn.Parameter


def test_outside_autocast_the_values_of_the_dequantized_weights():
    """Without an FP8 recipe the weights are dequantized for the GEMMs: the bits of a
    plain model holding those values, output and every gradient."""
    model = _model()
    twin = _dequantized_twin(model)
    x = torch.randn(16, 32, dtype=DTYPE)
    dy = torch.randn(16, 32, dtype=DTYPE)
    grads = []
    for m in (model, twin):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy)
        grads.append([y, xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert type(a) is torch.Tensor and torch.equal(a, b)


def test_fp8_gemms_read_the_fp8_weights(monkeypatch):
    """Under fusible.autocast the GEMMs read the FP8 weights as they are (no amax pass, no
    second cast), and gradients are high precision."""
    from fusible.functional import linear
    model = _model()
    x = torch.randn(32, 32, dtype=DTYPE)

    def no_weight_amax(t):
        raise AssertionError(f"an FP8 weight's amax was taken again: {tuple(t.shape)}")
    monkeypatch.setattr(linear, "tensor_amax", no_weight_amax)
    with fusible.autocast():
        y = model(x)
    ref = _dequantized_twin(model).double()(x.double())
    assert snr_db(y, ref) > 25
    y.float().sum().backward()
    assert all(type(p.grad) is torch.Tensor and p.grad.dtype == DTYPE
               for p in model.parameters())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fp8_params_compiled_same_bits_as_eager(fp8, backend):
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model = _model()
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        torch.manual_seed(1)
        x = torch.randn(32, 32, dtype=DTYPE, requires_grad=True)
        with fusible.autocast(enabled=fp8):
            y = run(x)
        y.backward(torch.randn(32, 32, dtype=DTYPE))
        results.append([y, x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_optimizer_updates_the_fp8_weights_in_place():
    """An optimizer step runs on the weights' values and quantizes them again, into the
    same parameter (new scale, data and transposed copy)."""
    model = _model()
    w = model[0].weight
    before = w.dequantize().detach().clone()
    w.grad = torch.full_like(before, 0.25)
    torch.optim.SGD([w], lr=1.0).step()
    assert model[0].weight is w and isinstance(w, Float8Tensor)
    want = (before - 0.25).float()
    got = w.dequantize().detach().float()
    assert ((got - want).abs() <= 2.0 ** -3 * want.abs() + 2.0 ** -9).all()  # E4M3's step
    assert torch.equal(w._transpose.view(torch.uint8), w._data.view(torch.uint8).t())
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()  # foreach ops, zeros_like state
    assert isinstance(model[0].weight, Float8Tensor)


def test_to_state_dict_and_loading():
    model = _model()
    w = model[0].weight
    model.to(torch.float32)
    assert model[0].weight is w and w.dtype == torch.float32 and w.fp8_dtype == torch.float8_e4m3fn
    state = copy.deepcopy(model.state_dict())
    assert isinstance(state["0.weight"], Float8Tensor)
    plain = _model(False).float()
    plain.load_state_dict(state)  # an FP8 checkpoint into plain weights: dequantized
    assert torch.equal(plain[0].weight, w.dequantize().detach())
    ref = torch.nn.Linear(32, 64)
    model[0].load_state_dict(ref.state_dict())  # plain values into FP8 weights: quantized
    assert isinstance(model[0].weight, Float8Tensor)
    err = (model[0].weight.dequantize().detach() - ref.weight.detach()).abs()
    assert (err <= 2.0 ** -4 * ref.weight.detach().abs() + 1e-6).all()


@pytest.mark.parametrize("keep", [False, True], ids=["fp8 only", "high precision kept"])
def test_a_saved_state_dict_loads_with_torch_load_defaults(tmp_path, keep):
    """torch.load's default is weights_only=True: an FP8 checkpoint loads under it, every
    byte back (data, scale, transposed copy), and resumes a fresh FP8 model."""
    def build():
        torch.manual_seed(0)
        return ops.Sequential(ops.Linear(32, 64), ops.GELU(), ops.BasicLinear(64, 32))

    with fusible.quantized_model_init(preserve_high_precision_init_val=keep):
        model = build()
    torch.save(model.state_dict(), tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt")
    w, saved = model[0].weight, state["0.weight"]
    assert isinstance(saved, Float8Tensor) and saved.fp8_dtype == w.fp8_dtype
    for name in ("_data", "_scale_inv", "_transpose"):
        a, b = getattr(saved, name), getattr(w, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a,
            b.view(torch.uint8) if b.element_size() == 1 else b)), name
    with fusible.quantized_model_init():
        resumed = build()
    resumed.load_state_dict(state)
    assert torch.equal(resumed[0].weight.dequantize(), w.dequantize())


def test_preserve_high_precision_init_val():
    torch.manual_seed(0)
    want = ops.BasicLinear(16, 8).weight.detach()
    torch.manual_seed(0)
    with fusible.quantized_model_init(preserve_high_precision_init_val=True):
        w = ops.BasicLinear(16, 8).weight
    assert torch.equal(w.high_precision_init_val, want)
    assert w.high_precision_init_val.device.type == "cpu"


def test_master_weights_loop_of_the_docs():
    """docs/fp8.md's loop: float32 masters keep updates below E4M3's step, and copying
    them back quantizes them into the FP8 weights (the cast of the master's values)."""
    from fusible.quantization.tensor.quantize import quantize_raw
    model = _model()
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = torch.optim.SGD(masters, lr=1e-4)
    x = torch.randn(16, 32, dtype=DTYPE)
    with fusible.autocast():
        loss = model(x).float().square().mean()
    loss.backward()
    for m, p in zip(masters, params):
        m.grad, p.grad = p.grad.float(), None
    before = [m.detach().clone() for m in masters]
    opt.step()
    assert all(not torch.equal(m, b) for m, b in zip(masters, before))
    with torch.no_grad():
        for m, p in zip(masters, params):
            p.copy_(m)
    w, master = params[0], masters[0].detach()
    want = quantize_raw(master.to(DTYPE), torch.float8_e4m3fn)
    assert isinstance(w, Float8Tensor) and torch.equal(w._scale_inv, want._scale_inv)
    assert torch.equal(w._data.view(torch.uint8), want._data.view(torch.uint8))


def test_writing_into_part_of_a_float8_tensor_is_refused():
    """Its scale is shared by all of its values and its transposed copy by none of its
    views: a write into a slice or a view is an error naming the op (the review's case:
    ``w.view(-1).copy_(v)`` left dgrad's copy stale)."""
    w = _model()[0].weight
    with torch.no_grad(), pytest.raises(NotImplementedError, match="part of a Float8Tensor"):
        w[0].zero_()
    for view in (w.view(-1), w[:], w.flatten()):  # all of it, but not its transposed copy
        with torch.no_grad(), pytest.raises(NotImplementedError, match="a view or part"):
            view.copy_(torch.zeros(view.shape))
    with torch.no_grad():
        w.data.copy_(torch.zeros(w.shape))  # .data is the tensor itself, detached
    assert torch.equal(w._transpose.float(), w._data.float().t()) and w.dequantize().abs().max() == 0


@pytest.mark.parametrize("recipe, how", [
    (fusible.Float8RowwiseScaling(), "rowwise"),
    (fusible.Float8BlockScaling(), "blockwise_128x128"),
    (fusible.DelayedScaling(), "from an amax history")])
def test_a_recipe_scaling_weights_otherwise_is_refused(recipe, how):
    """An FP8 weight has one current scale: a recipe that scales weights per row, per
    block or from a history would silently not get what it asks for."""
    model = _model()
    with fusible.autocast(recipe=recipe), pytest.raises(
            ValueError, match=rf"BasicLinear\(in_features=32, out_features=64\): its weight "
                              rf"is FP8 .* but {type(recipe).__name__} scales weights {how}"):
        model(torch.randn(16, 32, dtype=DTYPE))
    with fusible.autocast(recipe=fusible.Float8CurrentScaling("e4m3")):
        model(torch.randn(16, 32, dtype=DTYPE))  # per-tensor current scaling: as it is
