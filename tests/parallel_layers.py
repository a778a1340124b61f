"""Tensor-parallel linear layers and MLP blocks, checked on every rank against slices of
one full FP64 reference (run by tests/test_parallel.py in spawned processes)."""

import functools

import torch

import fusible
from fusible import ops
from fusible.testing import assert_close, exact_tensor, fp8_snr_floor, snr_db

TOKENS, IN, OUT = 32, 32, 64  # FP8 GEMMs need shards in multiples of 16
DEVICE = ["cpu"]  # set per worker: "cuda" under NCCL


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


def _full_problem(bias: bool, out_features: int = OUT):
    g = torch.Generator().manual_seed(1234)
    return {"x": exact_tensor((TOKENS, IN), torch.float64, generator=g),
            "w": exact_tensor((out_features, IN), torch.float64, generator=g),
            "b": exact_tensor((out_features,), torch.float64, generator=g) if bias else None,
            "dy": exact_tensor((TOKENS, out_features), torch.float64, generator=g)}


def _reference_linear(p):
    x, w = p["x"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    b = p["b"].clone().requires_grad_() if p["b"] is not None else None
    y = x @ w.t() + (b if b is not None else 0)
    y.backward(p["dy"])
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad if b is not None else None}


def _slices(mode, sp, rank, ws):
    """(rows of the input, features of the input, rows of the output, output features)."""
    part, every = functools.partial(_part, rank=rank, ws=ws), slice(None)
    if mode == "column":
        return (part(TOKENS) if sp else every), every, every, part(OUT)
    return every, part(IN), (part(TOKENS) if sp else every), every


def _run_linear(rank, ws, mode, sp, bias, dtype, compiled, fp8=False):
    p, ref = _full_problem(bias), None
    ref = _reference_linear(p)
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
    """SNR against FP64; compiled bitwise equal to eager."""
    floor = fp8_snr_floor(torch.float8_e4m3fn, torch.float8_e5m2)
    runs = [_run_linear(rank, ws, mode, sp, bias, torch.bfloat16, c, fp8=True)
            for c in (False, True)]
    (eager, want), (compiled, _) = runs
    for key in ("y", "dx", "dw"):
        if snr_db(eager[key], want[key]) < floor:
            raise AssertionError(f"FP8 {key}: SNR {snr_db(eager[key], want[key]):.1f} dB "
                                 f"< {floor:.1f}")
        if not torch.equal(eager[key], compiled[key]):
            raise AssertionError(f"FP8 {key}: compiled differs from eager")


def _check_fp8_gather(rank, ws):
    """An FP8 all-gather gives the bits of gathering in high precision, then quantizing."""
    from fusible.functional.linear import gather_fp8
    from fusible.functional.parallel import all_gather
    from fusible.quantization import Float8Format
    tp = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True).tp
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


def _check_mlp(rank, ws, sp, dtype, fp8=False, backend="aot_eager"):
    """Column Linear + GELU + row Linear against FP64 (FP8: by SNR), eager and compiled
    bitwise."""
    hidden, ffn = IN, OUT
    g = torch.Generator().manual_seed(7)
    full = ops.Sequential(ops.Linear(hidden, ffn), ops.GELU(), ops.Linear(ffn, hidden))
    full.double()
    fusible.testing.exact_parameters_(full, generator=g)
    x_full = exact_tensor((TOKENS, hidden), torch.float64, generator=g)
    dy_full = exact_tensor((TOKENS, hidden), torch.float64, generator=g)
    xr = x_full.clone().requires_grad_()
    y_ref = full(xr)
    y_ref.backward(dy_full)
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
    refs = [y_ref[rows], xr.grad[rows], full[0].weight.grad[cols], full[0].bias.grad[cols],
            full[2].weight.grad[:, cols], full[2].bias.grad]
    names = ["y", "dx", "dw1", "db1", "dw2", "db2"]
    floor = fp8_snr_floor(torch.float8_e4m3fn, torch.float8_e5m2, margin_db=6.0)
    for name, got, again, ref in zip(names, results[0], results[1], refs):
        if not fp8:
            assert_close(got, ref, dtype, f"MLP {name}", scale=4.0)
        elif snr_db(got, ref) < floor:
            raise AssertionError(f"FP8 MLP {name}: SNR {snr_db(got, ref):.1f} dB < {floor:.1f}")
        if not torch.equal(got, again):
            raise AssertionError(f"MLP {name}: compiled differs from eager")


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
