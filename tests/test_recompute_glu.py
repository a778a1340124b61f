"""RecomputeGluLinear: a gated unit's output recomputed in the backward for the weight
gradient of the linear layer after it, instead of saved (``recompute_output=True``, on by
default in TransformerLayer): the basic ops' bits, less memory between the passes, and
refused (with the reason in the plan) where it cannot give those bits."""

import pytest
import torch

import fusible
from fusible import ops
from fusible.layers import TransformerLayer
from fusible.testing import exact_parameters_, exact_tensor, stage_names

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

UNITS = {"swiglu": ops.SwiGLU, "geglu": ops.GEGLU, "clamped": ops.ClampedSwiGLU}


def _block(recompute=True, bias=False, add=False, unit="swiglu", **options):
    layers = [UNITS[unit](recompute_output=recompute, **options), ops.BasicLinear(32, 16)]
    layers += ([ops.Bias(16)] if bias else []) + ([ops.AddExtraInput()] if add else [])
    return ops.Sequential(*layers)


def _pair(dtype, **kw):
    joint = exact_parameters_(_block(True, **kw).to(dtype))
    plain = _block(False, **kw).to(dtype)
    plain.load_state_dict(joint.state_dict())
    return joint, plain


def _run(model, x, *extras):
    """Output, input gradients and parameter gradients of one step."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, *extras)]
    y = model(*inputs)
    y.backward(exact_tensor(y.shape, y.dtype, generator=torch.Generator().manual_seed(5)))
    grads = [t.grad for t in inputs] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach()] + grads


def _inputs(dtype, add):
    x = exact_tensor((3, 5, 64), dtype).requires_grad_()
    return (x, exact_tensor((3, 5, 16), dtype).requires_grad_()) if add else (x,)


@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("bias,add", [(False, False), (True, False), (False, True),
                                      (True, True)], ids=["plain", "bias", "add", "bias_add"])
def test_one_joint_stage_each_way_with_the_basic_ops_bits(unit, bias, add, dtype):
    """Output and every gradient equal the plan without it bit for bit: the backward's
    recomputed output is the forward's, and the GEMMs are BasicLinear's (the residual as
    the GEMM's C matrix, as ForwardLinearBiasAdd runs it)."""
    joint, plain = _pair(dtype, bias=bias, add=add, unit=unit)
    inputs = _inputs(dtype, add)
    plan = joint.plan(*inputs)
    assert stage_names(plan.forward) == stage_names(plan.backward) == ["RecomputeGluLinear"]
    assert "RecomputeGluLinear" not in stage_names(plain.plan(*inputs).forward)
    for a, b in zip(_run(joint, *inputs), _run(plain, *inputs)):
        assert torch.equal(a, b)


def test_the_units_output_is_not_saved():
    """Between the passes the joint stage keeps the unit's input and the weight; the
    basic ops would also keep the unit's output for the weight gradient."""
    x = torch.randn(4, 64, requires_grad=True)
    joint, plain = _pair(torch.float32)
    ctxs = joint(x).grad_fn.fusible[1]
    saved = ctxs[0].saved
    assert type(saved).__name__ == "GluLinearSaved" and ctxs[1].saved is None
    assert saved.input is x and saved.weight.shape == (16, 32)
    assert plain(x).grad_fn.fusible[1][1].saved.input.shape == (4, 32)  # the unit's output


def test_a_frozen_input_or_an_fp8_cached_input_keeps_the_basic_ops():
    """An input without gradient: the basic ops save only the unit's output (half its
    input's size), so the joint stage is refused; so is a unit caching its input in FP8
    (its gradient reads the FP8 copy). Both train as the basic ops."""
    joint, plain = _pair(torch.float64, bias=True)
    x = exact_tensor((4, 64), torch.float64)
    assert "input needs no gradient" in joint.plan(x).explain()
    assert stage_names(joint.plan(x).backward) == stage_names(plain.plan(x).backward)
    for a, b in zip(_run(joint, x), _run(plain, x)):
        assert (a is None and b is None) or torch.equal(a, b)
    cached = _block(cache_quantized_input=True).to(torch.bfloat16)
    xb = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    assert "cache_quantized_input" in cached.plan(xb).explain()
    assert "RecomputeGluLinear" not in stage_names(cached.plan(xb).forward)


def test_refused_with_the_reason_where_it_cannot_run():
    """FP8 (the linear saves a transposed FP8 copy of the output), a frozen weight
    (nothing would be saved), a split backward (the basic ops defer the weight gradient)
    and an in-place residual: the ops run as their own stages and explain() says why; a
    scaled unit refuses the option itself."""
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    model = _block().to(torch.bfloat16)
    with fusible.autocast(recipe=fusible.Float8CurrentScaling(gemm_policy=None)):
        text = model.plan(x).explain()
    assert "RecomputeGluLinear" in text and "runs in FP8" in text
    with fusible.autocast(recipe=fusible.Float8CurrentScaling(gemm_policy=None)):
        assert "RecomputeGluLinear" not in stage_names(model.plan(x).forward)
    model[1].weight.requires_grad_(False)
    assert "weight needs no gradient" in model.plan(x).explain()
    with fusible.split_backward():
        text = _block().plan(torch.randn(4, 64, requires_grad=True)).explain()
    assert "the backward is split" in text
    in_place = ops.Sequential(ops.SwiGLU(recompute_output=True), ops.BasicLinear(32, 16),
                              ops.AddExtraInput(in_place=True))
    text = in_place.plan(torch.randn(4, 64, requires_grad=True), torch.randn(4, 16)).explain()
    assert "adds in place" in text
    with pytest.raises(ValueError, match="recompute_output is not available for scaled"):
        ops.ScaledSwiGLU(recompute_output=True)
    with pytest.raises(TypeError, match="recompute_output must be a bool"):
        ops.SwiGLU(recompute_output=1)
    assert "recompute_output=True" in ops.GEGLU(recompute_output=True).describe()


def test_compiled_bits_and_one_custom_op_per_pass():
    model = exact_parameters_(_block(bias=True, add=True))
    x, r = torch.randn(2, 3, 64, requires_grad=True), torch.randn(2, 3, 16, requires_grad=True)
    fusible.testing.check_compiled_matches_eager(model, x, r)
    report = fusible.compile_report(model, x, r)
    assert [c.op for g in report.forward_graphs for c in g.fusible_ops] == \
        ["fusible::RecomputeGluLinear_fwd"]
    assert [c.op for g in report.backward_graphs for c in g.fusible_ops] == \
        ["fusible::RecomputeGluLinear_bwd"]


def test_transformer_layers_recompute_their_gated_activation_by_default():
    """A gated TransformerLayer plans the joint stage over its activation, fc2 and the
    residual add; ``recompute_activation=False`` keeps the basic stages; both give the same
    bits; an ungated activation has nothing to recompute."""
    torch.manual_seed(0)
    layer = TransformerLayer(32, 48, 4, num_kv_heads=2, backend="math")
    kept = TransformerLayer(32, 48, 4, num_kv_heads=2, backend="math",
                            recompute_activation=False)
    kept.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, 32)
    assert "RecomputeGluLinear" in stage_names(layer.plan(x).forward)
    assert "RecomputeGluLinear" not in stage_names(kept.plan(x).forward)
    for a, b in zip(_run(layer, x.requires_grad_()), _run(kept, x)):
        assert torch.equal(a, b)
    gelu = TransformerLayer(32, 48, 4, activation="gelu", backend="math")
    assert "RecomputeGluLinear" not in gelu.plan(x).explain()
    with pytest.raises(TypeError, match="recompute_activation must be a bool"):
        TransformerLayer(32, 48, 4, recompute_activation="yes")


def _consumption(monkeypatch) -> list:
    """Per backward of the joint stage: ``(consume_input asked, dx written over the unit's
    input)``."""
    import fusible.fusions.recompute_glu_linear as module
    seen, real = [], module.glu_backward_with_output

    def spy(kind, dy, x, *args, consume_input=False, **kwargs):
        dx, y = real(kind, dy, x, *args, consume_input=consume_input, **kwargs)
        seen.append((consume_input, dx is x))
        return dx, y
    monkeypatch.setattr(module, "glu_backward_with_output", spy)
    return seen


def test_the_units_gradient_is_written_over_its_input_where_only_the_stage_holds_it(
        monkeypatch):
    """Inside a pipeline (a linear layer before the unit) the unit's input is an
    intermediate only the joint stage's record holds: its gradient is written over it (one
    tensor of that size less at the backward's peak), the bits those of the basic ops."""
    seen = _consumption(monkeypatch)
    layers = [ops.BasicLinear(16, 64), ops.SwiGLU(recompute_output=True),
              ops.BasicLinear(32, 16)]
    joint = exact_parameters_(ops.Sequential(*layers))
    plain = ops.Sequential(ops.BasicLinear(16, 64), ops.SwiGLU(), ops.BasicLinear(32, 16))
    plain.load_state_dict(joint.state_dict())
    x = exact_tensor((3, 5, 16), torch.float32).requires_grad_()
    for a, b in zip(_run(joint, x), _run(plain, x)):
        assert torch.equal(a, b)
    assert seen == [(True, True)]


def test_a_tensor_the_caller_holds_is_never_written_over(monkeypatch):
    """The unit's input stays untouched where the caller passed it (the unit first in the
    pipeline, or after a reshape, a view of it), can read it (an extra output), under
    saved-tensors hooks (which may hand back the tensor itself), and in a compiled stage
    (which never writes over its inputs): the gradients are the basic ops' all the same."""
    seen = _consumption(monkeypatch)
    joint, plain = _pair(torch.float32)
    x = exact_tensor((4, 64), torch.float32).requires_grad_()
    before = x.detach().clone()
    joint(x).sum().backward()
    assert torch.equal(x.detach(), before) and x.grad is not None
    viewed = ops.Sequential(ops.Reshape((6, 64)), ops.SwiGLU(recompute_output=True),
                            ops.BasicLinear(32, 16))
    x = exact_tensor((3, 2, 64), torch.float32).requires_grad_()
    before = x.detach().clone()
    viewed(x).sum().backward()
    assert torch.equal(x.detach(), before)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        pipeline = ops.Sequential(ops.BasicLinear(16, 64), ops.SwiGLU(recompute_output=True),
                                  ops.BasicLinear(32, 16))
        _run(pipeline, torch.randn(3, 16, requires_grad=True))
    exposed = ops.Sequential(ops.BasicLinear(16, 64), ops.MakeExtraOutput(),
                             ops.SwiGLU(recompute_output=True), ops.BasicLinear(32, 16))
    assert "RecomputeGluLinear" in stage_names(exposed.plan(torch.randn(3, 16)).forward)
    y, h = exposed(torch.randn(3, 16, requires_grad=True))
    kept = h.detach().clone()
    (y.sum() + h.sum()).backward()
    assert torch.equal(h.detach(), kept)
    assert [asked for asked, _ in seen] == [False, False, False, False]
    seen.clear()
    compiled = torch.compile(ops.Sequential(*[m for m in pipeline]), backend="aot_eager",
                             fullgraph=True)
    compiled(torch.randn(3, 16, requires_grad=True)).sum().backward()
    assert seen and not any(written for _, written in seen)


def test_an_input_another_record_also_holds_is_never_written_over(monkeypatch):
    """A ReLU before the unit saves its output, the unit's input, and reads it in its own
    backward after the joint stage's: the unit's gradient goes to a tensor of its own, and
    every gradient is the basic ops'."""
    seen = _consumption(monkeypatch)

    def build(recompute):
        return ops.Sequential(ops.BasicLinear(16, 64), ops.ReLU(),
                              ops.SwiGLU(recompute_output=recompute), ops.BasicLinear(32, 16))
    joint, plain = exact_parameters_(build(True)), build(False)
    plain.load_state_dict(joint.state_dict())
    assert "RecomputeGluLinear" in stage_names(joint.plan(torch.randn(3, 16)).forward)
    x = exact_tensor((3, 5, 16), torch.float32).requires_grad_()
    for a, b in zip(_run(joint, x), _run(plain, x)):
        assert torch.equal(a, b)
    assert seen == [(False, False)]


def test_an_fp8_input_is_never_written_over(monkeypatch):
    """The unit's input handed over in FP8 (a Float8Tensor, whose storage is not its
    data's): writing the gradient into it would round the gradient to FP8; it gets a
    tensor of its own, and the gradients are the basic ops'."""
    seen = _consumption(monkeypatch)

    def build(recompute):
        return ops.Sequential(ops.BasicLinear(16, 64), ops.Quantize(forward=True),
                              ops.SwiGLU(recompute_output=recompute),
                              ops.BasicLinear(32, 16, fp8=False))
    joint, plain = exact_parameters_(build(True)), build(False)
    plain.load_state_dict(joint.state_dict())
    recipe = fusible.Float8CurrentScaling(gemm_policy=None)
    x0 = exact_tensor((32, 16), torch.float32)

    def grads(model):
        x = x0.clone().requires_grad_()
        with fusible.autocast(recipe=recipe):
            y = model(x)
        y.sum().backward()
        return [x.grad] + [p.grad for p in model.parameters()]
    with fusible.autocast(recipe=recipe):
        assert "RecomputeGluLinear" in stage_names(joint.plan(x0.clone().requires_grad_()).forward)
    for a, b in zip(grads(joint), grads(plain)):
        assert torch.equal(a, b)
    assert [written for _, written in seen] == [False]
