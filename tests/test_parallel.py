"""Tensor and sequence parallelism on CPU with gloo, world sizes 1 and 2 (spawned processes).

Every rank builds the same full FP64 reference from one seed, runs its shard of the layer,
and compares its outputs and gradients with the matching slices of the reference. Failures
are collected per case and reported together by the parent.
"""

import copy
import functools
import traceback

import pytest
import torch

import fusible
from fusible import ops
from fusible.testing.distributed import run_distributed
from fusible.testing import assert_close, exact_tensor, fp8_snr_floor, snr_db
from naive_plugins import GeluOfLinear

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


def _check_collectives(rank, ws):
    g = torch.Generator().manual_seed(3)
    parts = [exact_tensor((4, 3), torch.float64, generator=g) for _ in range(ws)]
    grads = [exact_tensor((4 * ws, 3), torch.float64, generator=g) for _ in range(ws)]
    mine = parts[rank]
    cases = {
        "AllReduce": (ops.AllReduce(), sum(parts), grads[rank][:4], lambda: grads[rank][:4]),
        "AllGather": (ops.AllGather(), torch.cat(parts), grads[rank],
                      lambda: grads[rank][rank * 4:(rank + 1) * 4]),
        "ReduceScatter": (ops.ReduceScatter(), None, None, None),
    }
    for name, (op, want_y, dy, want_dx) in cases.items():
        if name == "ReduceScatter":
            full = [exact_tensor((4 * ws, 3), torch.float64, generator=g) for _ in range(ws)]
            x_in, want_y = full[rank], sum(full)[rank * 4:(rank + 1) * 4]
            dys = [exact_tensor((4, 3), torch.float64, generator=g) for _ in range(ws)]
            dy, want = dys[rank], torch.cat(dys)
        else:
            x_in, want = mine, want_dx()
        for compiled in (False, True):
            x = x_in.to(DEVICE[0]).clone().requires_grad_()
            run = torch.compile(op, backend="aot_eager", fullgraph=True) if compiled else op
            y = run(x)
            y.backward(dy.to(DEVICE[0]))
            if not (torch.equal(y.cpu(), want_y) and torch.equal(x.grad.cpu(), want)):
                raise AssertionError(f"{name} compiled={compiled}: wrong output or gradient")


def _check_plan(rank, ws):
    """Collectives in explain() and to_dot(); the chosen and refused fusions."""
    model = ops.Sequential(
        ops.Linear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True), ops.GELU(),
        ops.Linear(OUT, IN, tensor_parallel_mode="row", sequence_parallel=True))
    plan = model.plan(torch.randn(8, IN, requires_grad=True))
    text, dot = plan.explain(), plan.to_dot()
    row = ["BasicLinear", "Bias"] if ws > 1 else ["ForwardLinearBias"]  # alone: no reduction
    assert [s.name for s in plan.forward] == ["ForwardLinearBias", "GELU", *row]
    if ws == 1:
        assert "communicates" not in text and "shape=cds" not in dot
        return
    for line in ("BasicLinear: all-gather input /2 (before its compute)",
                 "BasicLinear: reduce-scatter output /2 (after its compute)",
                 "Bias: all-reduce dbias /2 (after its compute)",
                 "BasicLinear: all-gather grad /2 (before its compute)",
                 "BasicLinear: reduce-scatter dgrad /2 (after its compute)",
                 "ForwardLinearBias              [3, 4]     refused: a row-parallel output "
                 "is summed over the group after the GEMM",
                 "ForwardLinearBiasActivation    [0, 1, 2]  refused: it covers BasicLinear("
                 "in_features=32, out_features=64, tensor_parallel_mode='column', "
                 "sequence_parallel=True), whose forward compute communicates",
                 "BackwardLinearBias             [3, 4]     chosen"):
        assert line in text, line
    for label in ("all-gather input /2", "reduce-scatter output /2", "all-reduce dbias /2"):
        assert f'[label="{label}", shape=cds' in dot, label
    frozen_input = model.plan(torch.randn(8, IN)).explain()  # no dgrad for the first layer
    assert "reduce-scatter dgrad" not in frozen_input and "all-gather grad" in frozen_input
    collectives = ops.Sequential(ops.AllGather(), ops.ReduceScatter()).plan(torch.randn(4, 2))
    assert collectives.to_dot().count("shape=cds") == 2
    assert "AllGather: all-gather /2" in collectives.explain()


def _check_size_errors(rank, ws):
    if ws == 1:
        return
    with pytest.raises(ValueError, match=r"out_features=3 does not divide by the "
                                         r"tensor-parallel world size 2"):
        ops.BasicLinear(4, 3, tensor_parallel_mode="column")
    with pytest.raises(ValueError, match=r"size=5 does not divide by the tensor-parallel"):
        ops.Bias(5, tensor_parallel=True)
    row = ops.BasicLinear(4, 4, tensor_parallel_mode="row", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"reduce-scatters its output along dim 0: got 3 rows, "
                                         r"which do not divide by the world size 2"):
        row(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"ReduceScatter\(world_size=2\) splits dim 0 over the "
                                         r"group, got input of shape \(3, 2\)"):
        ops.ReduceScatter()(torch.randn(3, 2))


def _check_init(rank, ws):
    """With one seed, shards are slices of what a single-process layer gets."""
    torch.manual_seed(0)
    full = ops.Linear(IN, OUT)
    for mode, rows, cols in (("column", _part(OUT, rank, ws), slice(None)),
                             ("row", slice(None), _part(IN, rank, ws))):
        torch.manual_seed(0)
        layer = ops.Linear(IN, OUT, tensor_parallel_mode=mode)
        assert torch.equal(layer.weight, full.weight[rows, cols]), mode
        assert torch.equal(layer.bias, full.bias[rows]), mode


def _check_state_dict_from_torch(rank, ws):
    """A full torch checkpoint loads as each rank's shards."""
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.GELU(),
                              torch.nn.Linear(OUT, IN))
    model = ops.Sequential(ops.Linear(IN, OUT, tensor_parallel_mode="column"), ops.GELU(),
                           ops.Linear(OUT, IN, tensor_parallel_mode="row"))
    model.load_state_dict(fusible.state_dict_from_torch(model, ref))
    cols = _part(OUT, rank, ws)
    for got, want in ((model[0].weight, ref[0].weight[cols]), (model[0].bias, ref[0].bias[cols]),
                      (model[2].weight, ref[2].weight[:, cols]), (model[2].bias, ref[2].bias)):
        assert torch.equal(got, want)


def _check_norm_sp(rank, ws):
    """A pre-norm block: LayerNorm(sequence_parallel=True) gradients are summed over ranks."""
    g = torch.Generator().manual_seed(5)
    full = ops.Sequential(ops.LayerNorm(IN), ops.Linear(IN, OUT), ops.GELU(),
                          ops.Linear(OUT, IN)).double()
    fusible.testing.exact_parameters_(full, generator=g)
    x_full = exact_tensor((TOKENS, IN), torch.float64, generator=g)
    dy = exact_tensor((TOKENS, IN), torch.float64, generator=g)
    full(x_full).backward(dy)
    rows, cols = _part(TOKENS, rank, ws), _part(OUT, rank, ws)
    for compiled in (False, True):
        model = ops.Sequential(
            ops.LayerNorm(IN, sequence_parallel=True),
            ops.Linear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True),
            ops.GELU(),
            ops.Linear(OUT, IN, tensor_parallel_mode="row", sequence_parallel=True)
        ).to(DEVICE[0], torch.float64)
        with torch.no_grad():
            model[0].weight.copy_(full[0].weight)
            model[0].bias.copy_(full[0].bias)
        _load_mlp_shards(model[1], model[3], full[1], full[3], cols)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        run(x_full[rows].to(DEVICE[0])).backward(dy[rows].to(DEVICE[0]))
        for name, got, ref in (("LayerNorm weight", model[0].weight.grad, full[0].weight.grad),
                               ("LayerNorm bias", model[0].bias.grad, full[0].bias.grad),
                               ("row bias", model[3].bias.grad, full[3].bias.grad)):
            assert_close(got, ref, torch.float64, f"{name} compiled={compiled}")


def _check_guards(rank, ws):
    """Plugin fusions over communicating ops are refused; split-token ops need
    sequence_parallel; parallel settings are fixed; explicit groups work."""
    fusible.register_fusion(GeluOfLinear)
    try:
        model = ops.Sequential(ops.BasicLinear(IN, OUT, tensor_parallel_mode="column",
                                               sequence_parallel=True), ops.GELU())
        verdicts = {c.fusion: (c.status, c.reason) for c in model.plan().candidates}
    finally:
        fusible.unregister_fusion(GeluOfLinear)
    if ws > 1:
        assert verdicts["GeluOfLinear"][0] == "refused", verdicts
        assert "handles_communication=False" in verdicts["GeluOfLinear"][1]
        bad = ops.Sequential(ops.BasicLinear(OUT, IN, tensor_parallel_mode="row",
                                             sequence_parallel=True), ops.Bias(IN))
        with pytest.raises(ValueError, match=r"Bias\(size=32\) sees tokens split over the "
                                             r"tensor-parallel group .* sequence_parallel=True"):
            bad(torch.randn(8, OUT // ws))
        with pytest.raises(ValueError, match=r"LayerNorm\(normalized_shape=\(32,\)\) sees "
                                             r"tokens split"):
            ops.Sequential(ops.LayerNorm(IN), model[0])(torch.randn(8, IN))
    with pytest.raises(AttributeError, match="sequence_parallel is fixed at construction"):
        model[0].sequence_parallel = False
    group = torch.distributed.group.WORLD
    row = ops.Linear(IN, OUT, tensor_parallel_mode="row", tensor_parallel_group=group)
    assert row.weight.shape == (OUT, IN // ws)
    twin = copy.deepcopy(ops.Sequential(row, ops.AllReduce(group)))  # groups kept by name
    assert twin[0].basic_ops()[0].tensor_parallel_group is group
    assert twin[1].process_group is group


def _check_all_gather_then_column(rank, ws):
    """AllGather + column layer == column layer with sequence parallelism."""
    g = torch.Generator().manual_seed(9)
    w = exact_tensor((OUT // ws, IN), torch.float64, generator=g)
    x0 = exact_tensor((8, IN), torch.float64, generator=g) * (rank + 1)
    dy = exact_tensor((8 * ws, OUT // ws), torch.float64, generator=g)
    results = []
    for model in (ops.Sequential(ops.AllGather(), ops.BasicLinear(
                      IN, OUT, tensor_parallel_mode="column")),
                  ops.Sequential(ops.BasicLinear(IN, OUT, tensor_parallel_mode="column",
                                                 sequence_parallel=True))):
        model.to(DEVICE[0], torch.float64)
        with torch.no_grad():
            model[-1].weight.copy_(w)
        x = x0.to(DEVICE[0]).clone().requires_grad_()
        y = model(x)
        y.backward(dy.to(DEVICE[0]))
        results.append((y, x.grad, model[-1].weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


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


def parallel_cases(rank, ws, device="cpu"):
    """Every case on this rank: ``{case: None or the failure's traceback}``."""
    torch.set_num_threads(1)
    DEVICE[0] = device
    cases = {"collectives": lambda: _check_collectives(rank, ws),
             "plan": lambda: _check_plan(rank, ws),
             "size errors": lambda: _check_size_errors(rank, ws),
             "fp8 gather": lambda: _check_fp8_gather(rank, ws),
             "init": lambda: _check_init(rank, ws),
             "state dict from torch": lambda: _check_state_dict_from_torch(rank, ws),
             "norm sp": lambda: _check_norm_sp(rank, ws),
             "guards": lambda: _check_guards(rank, ws),
             "all-gather then column": lambda: _check_all_gather_then_column(rank, ws),
             "fp8 gathered tokens": lambda: _check_fp8_gathered_tokens(rank, ws)}
    for mode in ("column", "row"):
        for sp in (False, True):
            for bias in (False, True):
                for dtype in (torch.float64, torch.float32, torch.bfloat16):
                    cases[f"linear {mode} sp={sp} bias={bias} {dtype}"] = (
                        lambda m=mode, s=sp, b=bias, d=dtype: _check_linear(rank, ws, m, s, b, d))
        for sp in (False, True):
            cases[f"linear fp8 {mode} sp={sp}"] = (
                lambda m=mode, s=sp: _check_linear_fp8(rank, ws, m, s, True))
    for sp in (False, True):
        for fp8 in (False, True):
            cases[f"dgrad reduction overlaps wgrad sp={sp} fp8={fp8}"] = (
                lambda s=sp, f=fp8: _check_dgrad_reduction_overlaps_wgrad(rank, ws, s, f))
    for sp in (False, True):
        for dtype in (torch.float64, torch.bfloat16):
            cases[f"mlp sp={sp} {dtype}"] = lambda s=sp, d=dtype: _check_mlp(rank, ws, s, d)
        cases[f"mlp fp8 sp={sp}"] = lambda s=sp: _check_mlp(rank, ws, s, torch.bfloat16, True)
    cases["mlp inductor"] = lambda: _check_mlp(rank, ws, True, torch.float32, backend="inductor")
    failures = {}
    for name, check in cases.items():
        torch._dynamo.reset()  # each case compiles afresh (no recompile limits across cases)
        try:
            check()
            failures[name] = None
        except Exception:
            failures[name] = traceback.format_exc(limit=-3)
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_tensor_parallel(world_size):
    _report(run_distributed(parallel_cases, world_size))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_tensor_parallel_nccl():
    _report(run_distributed(parallel_cases, 2, "cuda", backend="nccl"))


def _report(results):
    failed = {f"rank {rank}: {name}": error for rank, result in enumerate(results)
              for name, error in result.items() if error is not None}
    assert not failed, "\n".join(f"{name}\n{error}" for name, error in failed.items())
    assert len(results[0]) == 49


def test_tensor_parallel_example():
    """examples/tensor_parallel.py: the parallel block tracks the full one over SGD steps."""
    import tensor_parallel  # examples/ is on the path (conftest)
    diffs = run_distributed(tensor_parallel.worker, 2, 5, None)
    assert max(diffs) < 1e-5, diffs
