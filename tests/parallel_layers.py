"""Tensor-parallel linear layers and MLP blocks, checked on every rank against slices of
one full FP64 reference (run by tests/test_parallel.py in spawned processes).

Under FP8 the reference is emulated: every rank rebuilds what each rank quantizes (its own
shard with its own amax, or a gathered tensor with the group's amax), with the formats'
constants written in tests/fp8_emulation.py, multiplies in FP64 and forms the sums that the
collectives compute."""

import functools

import torch

import fusible
from fusible import ops
from fusible.testing import assert_close, exact_tensor, snr_db
from fp8_emulation import assert_snrs_above, quantize_dequantize

TOKENS, IN, OUT = 32, 32, 64  # FP8 GEMMs need shards in multiples of 16
DEVICE = ["cpu"]  # set per worker: "cuda" under NCCL
# The default "hybrid" recipe: inputs and weights in E4M3, gradients in E5M2.
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# bf16 FP8 runs against the emulated reference, where only accumulation order and the bf16
# rounding of results remain, reach 51.9-56.5 dB (linear layer; the lowest is a bias
# gradient, a sum rounded once) and 54.1-60.7 dB (MLP) on world sizes 1 and 2, or more
# (against plain FP64: 25-29 dB). A wrong format or amax on one rank costs 10 dB or more.
FP8_FLOOR_DB = {"linear": 50.5, "mlp": 52.5}


def _part(n: int, rank: int, ws: int) -> slice:
    """This rank's slice of ``n`` entries split over ``ws`` ranks."""
    return slice(rank * n // ws, (rank + 1) * n // ws)


def _load_mlp_shards(col, row, full_col, full_row, cols) -> None:
    """A column + row ``ops.Linear`` pair gets this rank's shards of a full pair."""
    with torch.no_grad():
        col.weight.copy_(full_col.weight[cols])
        col.bias.copy_(full_col.bias[cols])
        row.weight.copy_(full_row.weight[:, cols])
        row.bias.copy_(full_row.bias)


def _uneven(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its quarters along each dimension scaled by 1, 3/4, 5/8, 3/8: shards
    along either dimension then have absolute maxima apart by other than a power of two,
    so a rank that quantizes with the wrong amax (its own instead of the group's, or the
    reverse) rounds to other FP8 values. Multiples of 1/8 in [-1, 1] stay exact in bf16
    (odd parts at most 7 * 5 * 5 < 2**8)."""
    for dim, n in enumerate(t.shape):
        quarter = torch.arange(n) * 4 // n
        factor = torch.tensor([1, 3 / 4, 5 / 8, 3 / 8], dtype=torch.float64)[quarter]
        t = t * factor.view(-1, *[1] * (t.dim() - dim - 1))
    return t


def _full_problem(bias: bool, out_features: int = OUT, fp8: bool = False):
    g = torch.Generator().manual_seed(1234)
    p = {"x": exact_tensor((TOKENS, IN), torch.float64, generator=g),
         "w": exact_tensor((out_features, IN), torch.float64, generator=g),
         "b": exact_tensor((out_features,), torch.float64, generator=g) if bias else None,
         "dy": exact_tensor((TOKENS, out_features), torch.float64, generator=g)}
    if fp8:
        p.update({k: _uneven(p[k]) for k in ("x", "w", "dy")})
    return p


def _reference_linear(p):
    x, w = p["x"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    b = p["b"].clone().requires_grad_() if p["b"] is not None else None
    y = x @ w.t() + (b if b is not None else 0)
    y.backward(p["dy"])
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad if b is not None else None}


# FP8 emulation ------------------------------------------------------------------------
# Tensors are full (all tokens, all features) in float64; ``ws`` ranks each hold part r of
# the split dimension (``_part``). A gathered tensor (FP8 all-gather, one scale from the
# group-wide amax) is quantized as a whole: the same bits as each rank casting its part
# with that scale. A replicated tensor has the same amax on every rank. Weights are
# quantized per shard, with the shard's own amax, in the forward and again for dgrad.

def _q(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``t`` quantized to ``fp8_dtype`` with its own amax (current scaling) and back."""
    return quantize_dequantize(t, fp8_dtype)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16: a result that a stage writes and the next one reads."""
    return t.to(torch.bfloat16).double()


def _parts(n: int, ws: int) -> list:
    return [_part(n, r, ws) for r in range(ws)]


def _summed(partials) -> torch.Tensor:
    """What an all-reduce or reduce-scatter of the ranks' partial GEMM results gives:
    each written in bf16 by its rank's GEMM, then summed (the sum's own rounding is left
    to the SNR, like every final result's)."""
    return sum(_bf16(t) for t in partials)


def _column_forward(x, w, ws):
    """``y`` of a column-parallel layer (no bias): rank r quantizes the whole input (it
    has all tokens, or all-gathers them in FP8 with the group amax: the amax of all of
    ``x`` either way) and its weight rows ``w[r]`` with their own amax; its output
    features are ``Q(x) @ Q(w[r]).T``."""
    xq = _q(x, E4M3)
    return torch.cat([xq @ _q(w[r], E4M3).t() for r in _parts(w.shape[0], ws)], 1)


def _column_backward(x, w, dy, ws):
    """``(dx, dw)`` of a column-parallel layer: rank r quantizes its gradient columns
    ``dy[:, r]`` with their own amax, and its weight rows again (for dgrad); dx is the
    sum over ranks (all-reduce, or reduce-scatter under sequence parallelism) of
    ``Q(dy[:, r]) @ Q(w[r])``; wgrad reads the input quantized as in the forward."""
    xq, parts = _q(x, E4M3), _parts(w.shape[0], ws)
    dyq = [_q(dy[:, r], E5M2) for r in parts]
    return (_summed(g @ _q(w[r], E4M3) for g, r in zip(dyq, parts)),
            torch.cat([g.t() @ xq for g in dyq], 0))


def _row_forward(x, w, ws):
    """``y`` of a row-parallel layer (no bias): rank r quantizes its input features
    ``x[:, r]`` and weight columns ``w[:, r]``, each with its own amax; the output is the
    sum over ranks (all-reduce, or reduce-scatter) of ``Q(x[:, r]) @ Q(w[:, r]).T``."""
    return _summed(_q(x[:, r], E4M3) @ _q(w[:, r], E4M3).t() for r in _parts(w.shape[1], ws))


def _row_backward(x, w, dy, ws):
    """``(dx, dw)`` of a row-parallel layer: every rank quantizes the whole ``dy`` (all
    tokens, or all-gathered in FP8 with the group amax under sequence parallelism); rank
    r's input features of dx are ``Q(dy) @ Q(w[:, r])``, its weight columns
    ``Q(dy).T @ Q(x[:, r])`` (input and weight quantized as in the forward)."""
    dyq, parts = _q(dy, E5M2), _parts(w.shape[1], ws)
    return (torch.cat([dyq @ _q(w[:, r], E4M3) for r in parts], 1),
            torch.cat([dyq.t() @ _q(x[:, r], E4M3) for r in parts], 1))


def _replicated_bias_grad(dy, sp, ws):
    """The gradient of a bias after a row-parallel layer, from the unquantized ``dy``:
    under sequence parallelism each rank sums its own tokens and the ranks' sums are
    all-reduced."""
    return _summed(dy[t].sum(0) for t in _parts(dy.shape[0], ws)) if sp else dy.sum(0)


def _emulated_linear(p, mode, sp, ws):
    """The full results of an FP8 column- or row-parallel linear layer over ``ws`` ranks;
    the bias added, and its gradient summed, in high precision."""
    forward, backward = ((_column_forward, _column_backward) if mode == "column"
                         else (_row_forward, _row_backward))
    x, w, b, dy = p["x"], p["w"], p["b"], p["dy"]
    dx, dw = backward(x, w, dy, ws)
    db = dy.sum(0) if mode == "column" else _replicated_bias_grad(dy, sp, ws)
    return {"y": forward(x, w, ws) + (b if b is not None else 0), "dx": dx, "dw": dw,
            "db": db if b is not None else None}


def _emulated_mlp(x, w1, b1, w2, b2, dy, sp, ws):
    """The full FP8 results (y, dx, dw1, db1, dw2, db2) of column Linear + GELU + row
    Linear over ``ws`` ranks. Rank r holds hidden features r: the row layer quantizes its
    GELU output, the column layer its GELU input gradient, each with that rank's own
    amax. Intermediate results are rounded to bf16 where the stages write them (the
    column layer's output, the GELU's, the row layer's dgrad, the GELU's backward): the
    next stage quantizes those, and a bf16 ulp can move an FP8 rounding."""
    h = _bf16(_column_forward(x, w1, ws) + b1)
    a = _bf16(torch.nn.functional.gelu(h))
    dh, dw2 = _row_backward(a, w2, dy, ws)
    da = _bf16(torch.ops.aten.gelu_backward(_bf16(dh), h))
    dx, dw1 = _column_backward(x, w1, da, ws)
    return [_row_forward(a, w2, ws) + b2, dx, dw1, da.sum(0), dw2,
            _replicated_bias_grad(dy, sp, ws)]


def _check_snrs(what: str, got: dict, want: dict, floor_db: float) -> dict:
    """SNR (dB) of every result against its emulated reference; all above ``floor_db``."""
    snrs = {k: snr_db(got[k], want[k]) for k in want if want[k] is not None}
    assert_snrs_above(snrs, floor_db, f"FP8 {what}")
    return snrs


def _slices(mode, sp, rank, ws):
    """(rows of the input, features of the input, rows of the output, output features)."""
    part, every = functools.partial(_part, rank=rank, ws=ws), slice(None)
    if mode == "column":
        return (part(TOKENS) if sp else every), every, every, part(OUT)
    return every, part(IN), (part(TOKENS) if sp else every), every


def _run_linear(rank, ws, mode, sp, bias, dtype, compiled, fp8=False):
    p = _full_problem(bias, fp8=fp8)
    ref = _emulated_linear(p, mode, sp, ws) if fp8 else _reference_linear(p)
    x_rows, x_cols, y_rows, y_cols = _slices(mode, sp, rank, ws)
    layer = ops.Linear(IN, OUT, bias=bias, tensor_parallel_mode=mode, sequence_parallel=sp,
                       dtype=dtype, device=DEVICE[0])
    w_rows, w_cols = (y_cols, slice(None)) if mode == "column" else (slice(None), x_cols)
    with torch.no_grad():
        layer.weight.copy_(p["w"][w_rows, w_cols])
        if bias:
            layer.bias.copy_(p["b"][y_cols])
    x = p["x"][x_rows, x_cols].to(DEVICE[0], dtype).requires_grad_()
    run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    with fusible.autocast(enabled=fp8):
        y = run(x)
    y.backward(p["dy"][y_rows, y_cols].to(DEVICE[0], dtype))
    got = {"y": y, "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad if bias else None}
    want = {"y": ref["y"][y_rows, y_cols], "dx": ref["dx"][x_rows, x_cols],
            "dw": ref["dw"][w_rows, w_cols], "db": ref["db"][y_cols] if bias else None}
    return got, want


def _check_linear(rank, ws, mode, sp, bias, dtype):
    eager, want = _run_linear(rank, ws, mode, sp, bias, dtype, compiled=False)
    compiled, _ = _run_linear(rank, ws, mode, sp, bias, dtype, compiled=True)
    for key, ref in want.items():
        if ref is None:
            continue
        assert_close(eager[key], ref, dtype, f"{key} eager", scale=2.0)
        if not torch.equal(eager[key], compiled[key]):
            raise AssertionError(f"{key}: compiled differs from eager")


def _check_linear_fp8(rank, ws, mode, sp, bias):
    """Output and every gradient (bias included) by SNR against the emulated reference;
    compiled bitwise equal to eager. Returns the SNRs (dB)."""
    runs = [_run_linear(rank, ws, mode, sp, bias, torch.bfloat16, c, fp8=True)
            for c in (False, True)]
    (eager, want), (compiled, _) = runs
    snrs = _check_snrs(f"linear {mode} sp={sp}", eager, want, FP8_FLOOR_DB["linear"])
    for key in snrs:
        if not torch.equal(eager[key], compiled[key]):
            raise AssertionError(f"FP8 {key}: compiled differs from eager")
    return snrs


def _check_fp8_gather(rank, ws):
    """An FP8 all-gather gives the bits of gathering in high precision, then quantizing."""
    from fusible.functional.linear_parallel import gather_fp8
    from fusible.functional.parallel import all_gather
    from fusible.quantization import Float8Format
    tp = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True).parallel
    g = torch.Generator().manual_seed(11)
    parts = [torch.randn(16, IN, generator=g, dtype=torch.float64) * 4 ** r for r in range(ws)]
    x = parts[rank].to(DEVICE[0], torch.bfloat16)
    ours = gather_fp8(x, tp, Float8Format(torch.float8_e4m3fn, columnwise=True))
    ref = fusible.quantize(all_gather(x, tp), torch.float8_e4m3fn, columnwise=True)
    for a, b in ((ours._data, ref._data), (ours._transpose, ref._transpose),
                 (ours._scale_inv, ref._scale_inv)):
        if not torch.equal(a.view(torch.uint8) if a.dim() else a,
                           b.view(torch.uint8) if b.dim() else b):
            raise AssertionError("FP8 all-gather differs from gather-then-quantize")


def _check_fp8_gather_scaled(rank, ws, granularity):
    """Row-local scalings (per token, per 1x128 or MX 1x32 tile): each rank casts its
    tokens and the data and scales are gathered, the transposed copy's per-feature (or
    per 128- / 32-token tile) scales from the group's maxima: the bits of gathering in
    high precision, then quantizing. Ranks hold 128 tokens, 4^rank apart in magnitude."""
    from fusible.functional.linear_parallel import gather_fp8
    from fusible.functional.parallel import all_gather
    from fusible.quantization import Float8Format
    from fusible.quantization.tensor.quantize import quantize_scaled
    tp = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True).parallel
    g = torch.Generator().manual_seed(12)
    parts = [torch.randn(128, 256, generator=g, dtype=torch.float64) * 4 ** r
             for r in range(ws)]
    x = parts[rank].to(DEVICE[0], torch.bfloat16)
    fmt = Float8Format(torch.float8_e4m3fn, True, granularity)
    ours = gather_fp8(x, tp, fmt)
    ref = quantize_scaled(all_gather(x, tp), fmt.scaling, fmt.fp8_dtype, True)
    for name in ("_data", "_scale_inv", "_transpose", "_transpose_scale_inv"):
        a, b = getattr(ours, name), getattr(ref, name)
        a, b = a.contiguous(), b.contiguous()
        if not (a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))):
            raise AssertionError(f"{granularity} FP8 all-gather: {name} differs from "
                                 f"gather-then-quantize")


def _check_linear_recipe(rank, ws, mode, recipe_name):
    """A sequence-parallel linear layer (its input or output gradient gathered in FP8)
    under a recipe, against the same full layer in one process under that recipe. Where
    a rank's operands are the full layer's (the gathered tokens; per output feature or
    128x128 blocks of a 128-aligned shard), bit for bit; where a shard has scales of its
    own (row-wise: per output feature over a row shard's inputs, per input feature over a
    column shard's outputs) or partial sums are summed over the group, by SNR (about 29
    and 51 dB). Compiled bitwise eager."""
    recipe = fusible.recipe_from_name(recipe_name)
    g = torch.Generator().manual_seed(5)
    tokens, n_in, n_out = 128 * ws, 256, 256
    x = torch.randn(tokens, n_in, generator=g, dtype=torch.float64) * _uneven(
        torch.ones(tokens, 1, dtype=torch.float64))
    w = torch.randn(n_out, n_in, generator=g, dtype=torch.float64) / 16
    dy = torch.randn(tokens, n_out, generator=g, dtype=torch.float64)
    full = ops.Linear(n_in, n_out, bias=False, device=DEVICE[0], dtype=torch.bfloat16)
    layer = ops.Linear(n_in, n_out, bias=False, tensor_parallel_mode=mode, sequence_parallel=True,
                       device=DEVICE[0], dtype=torch.bfloat16)
    tok = _part(tokens, rank, ws)
    shard = (_part(n_out, rank, ws), slice(None)) if mode == "column" else \
        (slice(None), _part(n_in, rank, ws))
    with torch.no_grad():
        full.weight.copy_(w)
        layer.weight.copy_(w[shard])

    def run(model, xs, dys):
        return linear_step(model, xs, dys, recipe)

    want = run(full, x, dy)
    # column: tokens split in, features split out; row: features split in, tokens out
    x_in = x[tok] if mode == "column" else x[:, shard[1]]
    dy_in = dy[:, shard[0]] if mode == "column" else dy[tok]
    eager = run(layer, x_in, dy_in)
    compiled = run(torch.compile(layer, backend="aot_eager", fullgraph=True), x_in, dy_in)
    want = {"y": want["y"][:, shard[0]] if mode == "column" else want["y"][tok],
            "dx": want["dx"][tok] if mode == "column" else want["dx"][:, shard[1]],
            "dw": want["dw"][shard]}
    inexact = "dx" if mode == "column" else "y"  # the shard's own scales, or a group sum
    floor = 25.0 if recipe_name == "rowwise" else 45.0
    for key in want:
        exact = torch.equal(eager[key], want[key])
        if key != inexact and not exact:
            raise AssertionError(f"{recipe_name} {mode} {key}: differs from one process")
        if key == inexact and snr_db(eager[key], want[key]) < floor:
            raise AssertionError(f"{recipe_name} {mode} {key}: {snr_db(eager[key], want[key])}"
                                 f" dB against one process")
        if not torch.equal(eager[key], compiled[key]):
            raise AssertionError(f"{recipe_name} {mode} {key}: compiled differs from eager")


def linear_step(run, xs, dys, recipe, model=None):
    """One forward and backward of ``run`` (``model``, the one holding the weight, or its
    compiled self) under ``recipe`` in bf16: ``{"y", "dx", "dw"}``, the weight's gradient
    then cleared."""
    model = run if model is None else model
    xx = xs.to(DEVICE[0], torch.bfloat16).requires_grad_()
    with fusible.autocast(recipe=recipe):
        y = run(xx)
    y.backward(dys.to(DEVICE[0], torch.bfloat16))
    out = {"y": y.detach(), "dx": xx.grad, "dw": model.weight.grad.clone()}
    model.weight.grad = None
    return out


def _check_mlp(rank, ws, sp, dtype, fp8=False, backend="aot_eager"):
    """Column Linear + GELU + row Linear against FP64 (FP8: by SNR against the emulated
    reference), eager and compiled bitwise. Returns the FP8 SNRs (dB)."""
    hidden, ffn = IN, OUT
    g = torch.Generator().manual_seed(7)
    full = ops.Sequential(ops.Linear(hidden, ffn), ops.GELU(), ops.Linear(ffn, hidden))
    full.double()
    fusible.testing.exact_parameters_(full, generator=g)
    x_full = exact_tensor((TOKENS, hidden), torch.float64, generator=g)
    dy_full = exact_tensor((TOKENS, hidden), torch.float64, generator=g)
    if fp8:
        x_full, dy_full = _uneven(x_full), _uneven(dy_full)
        with torch.no_grad():
            for layer in (full[0], full[2]):
                layer.weight.copy_(_uneven(layer.weight))
    xr = x_full.clone().requires_grad_()
    y_ref = full(xr)
    y_ref.backward(dy_full)
    w1, b1, w2, b2 = (t.detach() for t in (full[0].weight, full[0].bias, full[2].weight,
                                            full[2].bias))
    emulated = _emulated_mlp(x_full, w1, b1, w2, b2, dy_full, sp, ws) if fp8 else None
    cols = _part(ffn, rank, ws)
    rows = _part(TOKENS, rank, ws) if sp else slice(None)
    results = []
    for compiled in (False, True):
        model = ops.Sequential(
            ops.Linear(hidden, ffn, tensor_parallel_mode="column", sequence_parallel=sp),
            ops.GELU(),
            ops.Linear(ffn, hidden, tensor_parallel_mode="row", sequence_parallel=sp)
        ).to(DEVICE[0], dtype)
        _load_mlp_shards(model[0], model[2], full[0], full[2], cols)
        x = x_full[rows].to(DEVICE[0], dtype).requires_grad_()
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        with fusible.autocast(enabled=fp8):
            y = run(x)
        y.backward(dy_full[rows].to(DEVICE[0], dtype))
        results.append([y, x.grad, model[0].weight.grad, model[0].bias.grad,
                        model[2].weight.grad, model[2].bias.grad])
    full_results = emulated or [y_ref, xr.grad, full[0].weight.grad, full[0].bias.grad,
                                full[2].weight.grad, full[2].bias.grad]
    where = [rows, rows, cols, cols, (slice(None), cols), slice(None)]
    refs = [t[i] for t, i in zip(full_results, where)]
    names = ["y", "dx", "dw1", "db1", "dw2", "db2"]
    snrs = None
    if fp8:
        snrs = _check_snrs(f"MLP sp={sp}", dict(zip(names, results[0])),
                           dict(zip(names, refs)), FP8_FLOOR_DB["mlp"])
    for name, got, again, ref in zip(names, results[0], results[1], refs):
        if not fp8:
            assert_close(got, ref, dtype, f"MLP {name}", scale=4.0)
        if not torch.equal(got, again):
            raise AssertionError(f"MLP {name}: compiled differs from eager")
    return snrs


def _check_fp8_gathered_tokens(rank, ws):
    """FP8 shape rules count a column + SP layer's gathered tokens."""
    layer = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True,
                            device=DEVICE[0], dtype=torch.bfloat16)
    with fusible.autocast():
        assert layer(torch.randn(16 // ws, IN, device=DEVICE[0], dtype=torch.bfloat16)).shape \
            == (16, OUT // ws)


class _OpOrder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every aten / c10d op that runs."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _check_dgrad_reduction_overlaps_wgrad(rank, ws, sp, fp8):
    """A column layer's dgrad reduction is in flight while its wgrad GEMM is issued."""
    layer = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=sp,
                            device=DEVICE[0], dtype=torch.bfloat16)
    x = torch.randn(16, IN, device=DEVICE[0], dtype=torch.bfloat16, requires_grad=True)
    with fusible.autocast(enabled=fp8):
        y = layer(x)
    order = _OpOrder()
    with order:
        y.backward(torch.randn_like(y))
    if ws == 1:
        return
    names = order.names
    start = names.index("reduce_scatter_tensor" if sp else "all_reduce")
    gemm = "_scaled_mm" if fp8 else "mm"
    assert gemm in names[start:names.index("wait_tensor", start)], names
    assert layer.weight.grad is not None and x.grad is not None
