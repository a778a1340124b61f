"""Float8Tensor, quantize/dequantize and the FP8 recipe, on CPU."""

import pytest
import torch

import fusible
from fusible.quantization import Float8CurrentScaling, Float8Tensor, autocast, fp8_recipe, quantize
from fusible.quantization.cast import FP8_MAX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def snr_db(approx, exact):
    """Signal-to-noise ratio of ``approx`` against ``exact``, in dB."""
    exact, approx = exact.double(), approx.double()
    return (10 * torch.log10(exact.square().sum() / (approx - exact).square().sum())).item()


# A uniform rounding error of half a unit in the last place, relative: E4M3 keeps 3 mantissa
# bits, E5M2 2. Per-element SNR of round-to-nearest is about 6.02 * (bits + 1) + 10.8 dB for
# values spread over a binade; we ask for 6 dB less to allow values near the scale's edge.
SNR_FLOOR = {E4M3: 6.02 * 4 + 4.8, E5M2: 6.02 * 3 + 4.8}


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_round_trip(fp8_dtype, dtype):
    x = torch.randn(64, 32, dtype=dtype)
    q = quantize(x, fp8_dtype, columnwise=True)
    assert isinstance(q, Float8Tensor) and q.dtype == dtype and q.fp8_dtype == fp8_dtype
    assert q.shape == x.shape and q._data.dtype == fp8_dtype
    assert q._data.float().abs().max().item() == FP8_MAX[fp8_dtype]  # current scaling: amax hits max
    torch.testing.assert_close(q._transpose, q._data.t().contiguous(), rtol=0, atol=0)
    assert snr_db(q.dequantize(), x) > SNR_FLOOR[fp8_dtype]


def test_zero_tensor_gets_scale_one():
    q = quantize(torch.zeros(3, 4))
    assert q.scale_inv.item() == 1.0 and not q.dequantize().any()


def test_gradients_through_quantize_and_dequantize():
    x = torch.randn(8, 16, requires_grad=True)
    g = torch.randn(8, 16)
    quantize(x).dequantize().backward(g)
    # dequantize's backward sends E5M2; quantize's backward returns it in x's dtype
    assert snr_db(x.grad, g) > SNR_FLOOR[E5M2]
    grads = []
    q = quantize(x.detach()).requires_grad_()
    q.register_hook(lambda grad: grads.append(grad))
    q.dequantize().sum().backward()
    assert isinstance(grads[0], Float8Tensor) and grads[0].fp8_dtype == E5M2


def test_gemm_dispatches_to_scaled_mm_and_views_stay_fp8():
    a, b = torch.randn(16, 32), torch.randn(24, 32)
    qa, qb = quantize(a), quantize(b, columnwise=True)
    with torch.profiler.profile() as prof:
        y = qa @ qb.t()
    assert any(e.name == "aten::_scaled_mm" for e in prof.events())
    assert snr_db(y, a @ b.t()) > 20
    assert isinstance(qb.t(), Float8Tensor) and qb.t()._data.is_contiguous()  # the copy, swapped
    assert isinstance(qa.view(4, 4, 32), Float8Tensor) and isinstance(qa.detach(), Float8Tensor)
    assert type(qa * 2) is torch.Tensor  # anything else: dequantized, original dtype


def test_flatten_round_trip():
    q = quantize(torch.randn(4, 8), columnwise=True)
    names, meta = q.__tensor_flatten__()
    assert names == ["_data", "_scale_inv", "_transpose"]
    r = Float8Tensor.__tensor_unflatten__({n: getattr(q, n) for n in names}, meta, q.shape,
                                          q.stride())
    assert torch.equal(r.dequantize(), q.dequantize())


def test_tangent_coercion():
    q = quantize(torch.randn(4, 8), E5M2)
    plain = q.__coerce_same_metadata_as_tangent__(None, torch.Tensor)
    assert type(plain) is torch.Tensor
    as_e4m3 = q.__coerce_same_metadata_as_tangent__((torch.float32, E4M3, True))
    assert as_e4m3.fp8_dtype == E4M3 and as_e4m3._transpose is not None


def test_quantize_and_dequantize_compile_to_the_same_bits():
    torch._dynamo.reset()
    x = torch.randn(8, 16)

    def fn(t):
        return quantize(t, E4M3).dequantize() * 2

    assert torch.equal(torch.compile(fn, fullgraph=True, backend="inductor")(x), fn(x))


def test_recipe_and_autocast():
    assert fp8_recipe() is None
    with autocast():
        assert fp8_recipe() == Float8CurrentScaling()
        with autocast(enabled=False):
            assert fp8_recipe() is None
        with autocast(recipe=Float8CurrentScaling("e4m3")):
            assert fp8_recipe().backward_dtype == E4M3
        assert fp8_recipe().backward_dtype == E5M2
    assert fp8_recipe() is None
    with pytest.raises(ValueError, match="fp8_format must be one of"):
        Float8CurrentScaling("e5m2")
    with pytest.raises(TypeError, match="recipe must be a Float8CurrentScaling"):
        with autocast(recipe="fp8"):
            pass
    assert fusible.Float8Tensor is Float8Tensor and fusible.quantize is quantize


def _custom_op_calls(fn) -> int:
    """How many fusible::cast_to_fp8 / fusible::dequantize calls a profiler sees."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages()
               if e.key in ("fusible::cast_to_fp8", "fusible::dequantize"))


def test_eager_casts_skip_the_custom_op_dispatch():
    """Eagerly the cast kernels are called directly (host time); traced, through the ops."""
    x = torch.randn(8, 4)
    assert _custom_op_calls(lambda: quantize(x, E4M3).dequantize()) == 0
    compiled = torch.compile(lambda t: quantize(t, E4M3).dequantize(), backend="aot_eager",
                             fullgraph=True)
    compiled(x)  # compile first, then count what the compiled graph calls
    assert _custom_op_calls(lambda: compiled(x)) == 2


def test_plain_eager_sees_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusible.kernels import plain_eager
    seen = []
    assert plain_eager(torch.ones(2))
    with FakeTensorMode() as mode:
        assert not plain_eager(mode.from_tensor(torch.ones(2)))
    make_fx(lambda t: seen.append(plain_eager(t)) or t + 1)(torch.ones(2))
    torch.vmap(lambda t: seen.append(plain_eager(t)) or t)(torch.ones(2, 2))
    assert seen == [False, False]
    assert not plain_eager(quantize(torch.ones(2), E4M3))  # a subclass: through the op
    assert plain_eager(torch.nn.Parameter(torch.ones(2)))  # weights are cast directly


def test_eager_fp8_training_step_skips_custom_op_dispatch():
    from fusible import ops
    model = ops.Sequential(ops.Linear(32, 32), ops.GELU(), ops.Linear(32, 32))
    x = torch.randn(16, 32, requires_grad=True)

    def step():
        with fusible.autocast():
            model(x).sum().backward()

    assert _custom_op_calls(step) == 0


def _storages(t: Float8Tensor) -> set:
    parts = (t._data, t._scale_inv) + ((t._transpose,) if t._transpose is not None else ())
    return {p.untyped_storage().data_ptr() for p in parts}


def test_clone_shares_no_storage_and_the_op_boundary_copies_what_passes():
    """A custom op may not return aliases of its inputs: a Float8Tensor that passes through
    ``ops.Quantize`` inside one (no recipe, or already in the format) comes out copied by
    the boundary, for every op; eagerly nothing is copied."""
    from fusible import ops
    from fusible.ops.quantize import QuantizeBackwardArgs, QuantizeForwardArgs
    from fusible.quantization import Float8Format
    from fusible.runtime import custom_ops
    x = quantize(torch.randn(16, 16), columnwise=True)
    clone = x.clone()
    assert not (_storages(clone) & _storages(x))
    assert torch.equal(clone._data.view(torch.uint8), x._data.view(torch.uint8))
    tail = [None, False, "", True, "test"]  # output format, quantized results, provenance
    for fmt in (None, Float8Format(torch.float8_e4m3fn)):
        fwd = custom_ops.stage_op(ops.Quantize, "forward")
        bwd = custom_ops.stage_op(ops.Quantize, "backward")
        y = fwd.overload(*fwd.flatten_args(QuantizeForwardArgs(x, fmt)), *tail)
        dx = bwd.overload(*bwd.flatten_args(QuantizeBackwardArgs(x, fmt, True)), *tail)
        for out in (y, dx):
            assert out[1].dim() == 0  # a Float8Tensor: data, scale_inv, transposed copy
            assert not ({t.untyped_storage().data_ptr() for t in out if t.numel()}
                        & _storages(x))
        eager = ops.Quantize.forward_compute(QuantizeForwardArgs(x, fmt)).output
        assert eager is x  # eagerly nothing is copied
