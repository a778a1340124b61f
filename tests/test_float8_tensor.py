"""Float8Tensor, quantize/dequantize and the FP8 recipe, on CPU."""

import pytest
import torch

import fusible
from fusible.quantization import Float8CurrentScaling, Float8Tensor, autocast, fp8_recipe, quantize
from fusible.quantization.tensor.ops import HANDLERS
from fp8_formats import E4M3, E5M2, FP8_MAX, MANTISSA_BITS

aten = torch.ops.aten


def snr_db(approx, exact):
    """Signal-to-noise ratio of ``approx`` against ``exact``, in dB."""
    exact, approx = exact.double(), approx.double()
    return (10 * torch.log10(exact.square().sum() / (approx - exact).square().sum())).item()


# A uniform rounding error of half a unit in the last place, relative. Per-element SNR of
# round-to-nearest is about 6.02 * (mantissa bits + 1) + 10.8 dB for values spread over a
# binade; we ask for 6 dB less to allow values near the scale's edge.
SNR_FLOOR = {d: 6.02 * (MANTISSA_BITS[d] + 1) + 4.8 for d in (E4M3, E5M2)}


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


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom_op"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposed_copy_alone_and_a_given_amax(dtype, traced):
    """``rowwise=False`` keeps the transposed copy only (what dgrad reads of a weight), with
    the bits and scale of the full cast; an amax handed in scales as the tensor's own."""
    from fusible.quantization.casts import tensorwise
    from fusible.quantization.tensor.quantize import quantize_raw
    x = torch.randn(24, 40, dtype=dtype)
    full = tensorwise.cast_tensorwise_torch(x, E4M3, True)
    run = torch.ops.fusible.cast_to_fp8.default if traced else tensorwise.cast_tensorwise
    t_only, scale_inv = run(x, E4M3, True, tensorwise.tensor_amax(x), False)
    assert t_only.shape == (40, 24) and t_only.is_contiguous()
    assert torch.equal(t_only.view(torch.uint8), full[2].view(torch.uint8))
    assert torch.equal(scale_inv, full[1])
    q = quantize_raw(x, E4M3, columnwise=True, rowwise=False)
    assert q.shape == x.shape and q._transpose is not None
    assert torch.equal(q.dequantize(), Float8Tensor(full[0], full[1], dtype).dequantize())
    with pytest.raises(ValueError, match="rowwise=False needs columnwise=True"):
        tensorwise.cast_tensorwise(x, E4M3, False, None, False)
    x3 = torch.randn(3, 5, 8, dtype=dtype)  # more than two dimensions: the data keeps x's shape
    q3 = quantize_raw(x3, E4M3, columnwise=True, rowwise=False)
    assert q3.shape == x3.shape
    assert torch.equal(q3.dequantize(), quantize_raw(x3, E4M3).dequantize())


@pytest.mark.parametrize("shape", [(1, 16), (16, 1), (16,), ()])
def test_cast_op_on_a_row_a_column_and_fewer_dimensions(shape):
    """The custom op's outputs may not alias: with one row or column the transposed copy
    must still be a copy; its fake gives what it gives (a 0-d tensor keeps no copy)."""
    op = torch.ops.fusible.cast_to_fp8.default
    x = torch.randn(shape)
    columnwise = len(shape) > 0
    torch.library.opcheck(op, (x, E4M3, columnwise))
    if columnwise:
        torch.library.opcheck(op, (x, E4M3, True, None, False))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_current_scaling_maps_amax_to_the_format_max(fp8_dtype):
    """The scale comes from the format's largest value (the spec's, not the library's): a
    wrong constant moves both the data's maximum and ``scale_inv``."""
    x = torch.tensor([[-4.0, 1.0], [0.5, 3.0]])  # amax a power of two: amax / max is exact
    q = quantize(x, fp8_dtype)
    assert q._data.float()[0, 0].item() == -FP8_MAX[fp8_dtype]
    assert q._data.float().abs().max().item() == FP8_MAX[fp8_dtype]
    assert q.scale_inv.item() == (torch.tensor(4.0) / torch.tensor(FP8_MAX[fp8_dtype])).item()


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


def test_indexing_and_slicing_stay_fp8_with_the_same_bits():
    """One per-tensor scale holds for any subset: ``t[i]``, slices and advanced indexing
    keep FP8 (the transposed copy is dropped); their values are the whole tensor's."""
    q = quantize(torch.randn(6, 8, 10), columnwise=True)
    full = q.dequantize()
    for index in (2, -1, slice(1, 4), (slice(None), 3), (Ellipsis, slice(2, 9, 3)),
                  torch.tensor([0, 4, 4]), (slice(None), torch.tensor([1, 0]))):
        part = q[index]
        assert isinstance(part, Float8Tensor) and part._transpose is None, index
        assert part._scale_inv is q._scale_inv and part.fp8_dtype == q.fp8_dtype
        assert torch.equal(part.dequantize(), full[index]), index


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
    with pytest.raises(TypeError, match="recipe must be an instance of a registered recipe"):
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
    for fmt in (None, Float8Format(torch.float8_e4m3fn)):
        fwd = custom_ops.stage_op(ops.Quantize, "forward")
        bwd = custom_ops.stage_op(ops.Quantize, "backward")
        # no output format; results may be quantized
        y = fwd.overload(*fwd.flatten_call(QuantizeForwardArgs(x, fmt), None, True, "test"))
        dx = bwd.overload(*bwd.flatten_call(QuantizeBackwardArgs(x, fmt, True), None, True,
                                            "test"))
        for out in (y, dx):
            assert out[1].dim() == 0  # a Float8Tensor: data, scale_inv, transposed copy
            assert not ({t.untyped_storage().data_ptr() for t in out if t.numel()}
                        & _storages(x))
        eager = ops.Quantize.forward_compute(QuantizeForwardArgs(x, fmt)).output
        assert eager is x  # eagerly nothing is copied


# Every entry of Float8Tensor's dispatch table against the same op on the dequantized values.
# A case: (function of the inputs, whether it stays in FP8 (a Float8Tensor result; for a GEMM,
# torch._scaled_mm), makers of the inputs). Each maker gets the test's ``columnwise``, so every
# case runs with and without the transposed copy.

def _fp8(*shape, fp8_dtype=E4M3):
    return lambda columnwise: quantize(torch.randn(shape), fp8_dtype, columnwise=columnwise)


def _plain(*shape):
    return lambda columnwise: torch.randn(shape)


_VIEW_SHAPES = {  # from (16, 32); those that change the last dimension can't keep the copy as is
    "same": [16, 32], "split tokens": [4, 4, 32], "split last": [16, 2, 16],
    "to (32, 16)": [32, 16], "flat": [512], "flat -1": [-1],
}

_CASES = {
    aten.detach.default: {
        "2d": (aten.detach.default, True, _fp8(16, 32)),
        "3d": (aten.detach.default, True, _fp8(2, 8, 32)),
        "of t()": (lambda x: aten.detach.default(aten.t.default(x)), True, _fp8(16, 32)),
    },
    aten.clone.default: {
        "2d": (aten.clone.default, True, _fp8(16, 32)),
        "of t()": (lambda x: aten.clone.default(aten.t.default(x)), True, _fp8(16, 32)),
        "of t(), contiguous": (lambda x: aten.clone.default(
            aten.t.default(x), memory_format=torch.contiguous_format), True, _fp8(16, 32)),
    },
    **{op: {
        **{name: (lambda x, s=shape, op=op: op(x, s), True, _fp8(16, 32))
           for name, shape in _VIEW_SHAPES.items()},
        "3d to 2d": (lambda x, op=op: op(x, [16, 32]), True, _fp8(2, 8, 32)),
        "of t()": (lambda x, op=op: op(aten.t.default(x), [2, 16, 16]), True, _fp8(16, 32)),
    } for op in (aten.view.default, aten._unsafe_view.default)},
    aten.reshape.default: {  # reaches the subclass whole under tracing
        **{name: (lambda x, s=shape: aten.reshape.default(x, s), True, _fp8(16, 32))
           for name, shape in _VIEW_SHAPES.items()},
        "3d to 2d": (lambda x: aten.reshape.default(x, [16, 32]), True, _fp8(2, 8, 32)),
    },
    aten._to_copy.default: {  # another floating dtype: what it dequantizes to
        "to bfloat16": (lambda x: aten._to_copy.default(x, dtype=torch.bfloat16), True,
                        _fp8(16, 32)),
        "same dtype": (aten._to_copy.default, True, _fp8(16, 32)),
        "of t()": (lambda x: aten._to_copy.default(aten.t.default(x), dtype=torch.float64),
                   True, _fp8(16, 32)),
        "to int32": (lambda x: aten._to_copy.default(x, dtype=torch.int32), False,
                     _fp8(16, 32)),
    },
    aten.t.default: {
        "2d": (aten.t.default, True, _fp8(16, 32)),
        "twice": (lambda x: aten.t.default(aten.t.default(x)), True, _fp8(16, 32)),
        "1d": (aten.t.default, True, _fp8(32)),
        # a view that changes the last dimension, then the op that uses the transposed copy
        "of a view to (32, 16)": (lambda x: aten.t.default(aten.view.default(x, [32, 16])),
                                  True, _fp8(16, 32)),
        "of a view to (64, 8)": (lambda x: aten.t.default(aten.view.default(x, [64, 8])),
                                 True, _fp8(16, 32)),
    },
    aten.transpose.int: {
        "0 1": (lambda x: aten.transpose.int(x, 0, 1), True, _fp8(16, 32)),
        "-1 -2": (lambda x: aten.transpose.int(x, -1, -2), True, _fp8(16, 32)),
        "0 0": (lambda x: aten.transpose.int(x, 0, 0), False, _fp8(16, 32)),
        "3d": (lambda x: aten.transpose.int(x, 1, 2), False, _fp8(2, 8, 32)),
    },
    aten.as_strided.default: {  # the identity (FSDP2's gathered parameter) stays in FP8
        "identity": (lambda x: aten.as_strided.default(x, [16, 32], [32, 1], 0), True,
                     _fp8(16, 32)),
        "identity, no offset": (lambda x: aten.as_strided.default(x, [16, 32], [32, 1]), True,
                                _fp8(16, 32)),
        "fewer rows": (lambda x: aten.as_strided.default(x, [8, 32], [32, 1], 0), False,
                       _fp8(16, 32)),
        "transposed": (lambda x: aten.as_strided.default(x, [32, 16], [1, 32], 0), False,
                       _fp8(16, 32)),
    },
    aten.select.int: {  # indexing: a subset keeps the per-tensor scale
        "a row": (lambda x: aten.select.int(x, 0, 3), True, _fp8(16, 32)),
        "the last dim": (lambda x: aten.select.int(x, -1, 5), True, _fp8(2, 8, 32)),
    },
    aten.slice.Tensor: {
        "rows": (lambda x: aten.slice.Tensor(x, 0, 2, 9), True, _fp8(16, 32)),
        "columns, a step": (lambda x: aten.slice.Tensor(x, 1, 1, 30, 3), True, _fp8(16, 32)),
    },
    aten.index.Tensor: {
        "rows": (lambda x: aten.index.Tensor(x, [torch.tensor([0, 5, 5])]), True,
                 _fp8(16, 32)),
    },
    aten.mm.default: {  # the three GEMMs of a linear layer; the gradient in E5M2
        "x @ w.t()": (lambda x, w: aten.mm.default(x, aten.t.default(w)), True,
                      _fp8(16, 32), _fp8(24, 32)),
        "dy @ w": (aten.mm.default, True, _fp8(16, 24, fp8_dtype=E5M2), _fp8(24, 32)),
        "dy.t() @ x": (lambda dy, x: aten.mm.default(aten.t.default(dy), x), True,
                       _fp8(16, 24, fp8_dtype=E5M2), _fp8(16, 32)),
        "view @ w.t()": (lambda x, w: aten.mm.default(aten.view.default(x, [16, 32]),
                                                      aten.t.default(w)),
                         True, _fp8(2, 8, 32), _fp8(24, 32)),
        "view(32, 16).t() @ w.t()": (lambda x, w: aten.mm.default(
            aten.t.default(aten.view.default(x, [32, 16])), aten.t.default(w)),
            True, _fp8(16, 32), _fp8(24, 32)),
        "x @ plain": (aten.mm.default, False, _fp8(16, 32), _plain(32, 24)),
    },
    aten.addmm.default: {
        "bias": (lambda b, x, w: aten.addmm.default(b, x, aten.t.default(w)), True,
                 _plain(24), _fp8(16, 32), _fp8(24, 32)),
        "bias, beta, alpha": (lambda b, x, w: aten.addmm.default(
            b, x, aten.t.default(w), beta=0.5, alpha=2.0), False,
            _plain(24), _fp8(16, 32), _fp8(24, 32)),
        # each alone as well: a handler reading only one of them passes the pair above
        "bias, alpha": (lambda b, x, w: aten.addmm.default(b, x, aten.t.default(w), alpha=2.0),
                        False, _plain(24), _fp8(16, 32), _fp8(24, 32)),
        "bias, beta": (lambda b, x, w: aten.addmm.default(b, x, aten.t.default(w), beta=0.5),
                       False, _plain(24), _fp8(16, 32), _fp8(24, 32)),
        "2d bias": (lambda b, x, w: aten.addmm.default(b, x, aten.t.default(w)), False,
                    _plain(16, 24), _fp8(16, 32), _fp8(24, 32)),
    },
}

_GEMMS = {aten.mm.default, aten.addmm.default}


def _params(gemms: bool):
    return [pytest.param(fn, stays_fp8, makers, id=f"{op.__name__}: {name}")
            for op, cases in _CASES.items() if (op in _GEMMS) == gemms
            for name, (fn, stays_fp8, *makers) in cases.items()]


def _dequantized(t):
    return t.dequantize() if isinstance(t, Float8Tensor) else t


def _assert_consistent(t: Float8Tensor):
    """What GEMMs and later ops rely on: data of the outer shape and strides, and a kept
    transposed copy that is the data seen as (tokens, last dim), transposed, row-major."""
    assert t._data.shape == t.shape and t._data.stride() == t.stride()
    if t._transpose is not None:
        expected = t._data.reshape(-1, t.shape[-1]).t().contiguous()
        assert t._transpose.shape == expected.shape and t._transpose.is_contiguous()
        assert torch.equal(t._transpose.view(torch.uint8), expected.view(torch.uint8))


def test_every_dispatch_table_entry_has_cases():
    assert set(_CASES) == set(HANDLERS)


columnwise = pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])


@columnwise
@pytest.mark.parametrize("fn, stays_fp8, makers", _params(gemms=False))
def test_fp8_view_like_op_matches_the_op_on_dequantized_values(fn, stays_fp8, makers,
                                                               columnwise):
    """Views, transposes, detach and clone move FP8 bytes: the result, dequantized, is the
    op's result on the dequantized input bit for bit."""
    inputs = [make(columnwise) for make in makers]
    out, ref = fn(*inputs), fn(*map(_dequantized, inputs))
    assert isinstance(out, Float8Tensor) == stays_fp8
    if stays_fp8:
        _assert_consistent(out)
        assert out.dtype == ref.dtype
        out = out.dequantize()
    assert out.shape == ref.shape and torch.equal(out, ref)


@columnwise
@pytest.mark.parametrize("fn, stays_fp8, makers", _params(gemms=True))
def test_fp8_gemm_matches_the_fp64_product_of_dequantized_operands(fn, stays_fp8, makers,
                                                                   columnwise):
    """FP8 products are exact in float32; what is left is float32 accumulation over K and the
    scaling: a relative error of (K + 4) float32 units of the sum of absolute terms."""
    inputs = [make(columnwise) for make in makers]
    with torch.profiler.profile() as prof:
        out = fn(*inputs)
    assert any(e.name == "aten::_scaled_mm" for e in prof.events()) == stays_fp8
    ref = fn(*[_dequantized(t).double() for t in inputs])
    magnitude = fn(*[_dequantized(t).double().abs() for t in inputs])  # beta, alpha > 0
    k = inputs[-1].shape[0]  # mm(a, b) and addmm(bias, a, b) take the same size from b
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out.double() - ref).abs() <= (k + 4) * 2.0 ** -24 * magnitude).all()


@pytest.mark.parametrize("shape", [[4, 4, 32], [-1, 32], [2, 8, 32]])
def test_views_that_keep_the_last_dimension_keep_the_transposed_copy(shape):
    """Dropping it would cost another cast for the GEMM that needs the other layout."""
    q = quantize(torch.randn(16, 32), columnwise=True)
    assert aten.view.default(q, shape)._transpose is not None
