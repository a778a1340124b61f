"""Collectives, plans, errors, initialisation, checkpoints, sequence-parallel norms and
fusion guards under tensor parallelism (run by tests/test_parallel.py on every rank), and
two sets of cases for the harness itself: a rank that fails alone, a rank that hangs."""

import copy
import time

import pytest
import torch
import torch.distributed as dist

import fusible
from fusible import ops
from fusible.functional.parallel import NOT_PARALLEL, TensorParallel
from fusible.testing import assert_close, exact_tensor
from fusible.testing.distributed import run_cases
from naive_plugins import GeluOfLinear
from parallel_layers import DEVICE, IN, OUT, TOKENS, _load_mlp_shards, _part


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
    back = fusible.state_dict_to_torch(model, ref)  # the shards gathered on every rank
    assert back.keys() == ref.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())


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
    _check_one_parallel_record(ws)
    group = torch.distributed.group.WORLD
    row = ops.Linear(IN, OUT, tensor_parallel_mode="row", tensor_parallel_group=group)
    assert row.weight.shape == (OUT, IN // ws)
    twin = copy.deepcopy(ops.Sequential(row, ops.AllReduce(group)))  # groups kept by name
    assert twin[0].basic_ops()[0].tensor_parallel_group is group
    assert twin[1].process_group is group


def check_ranks_agree(rank, ws):
    """Ranks configured differently (another parallel mode, size or recipe on one rank)
    fail when the plan is made, on every rank, naming the op and both values, instead of
    running collectives that pair up wrongly."""
    if ws == 1:
        return
    x = torch.randn(8, IN)
    mode = "column" if rank == 0 else "row"
    size = IN if mode == "column" else IN // ws
    odd = ops.Sequential(ops.BasicLinear(IN, OUT, tensor_parallel_mode=mode))
    with pytest.raises(RuntimeError, match=r"ranks of a process group disagree on op \[0\] "
                                           r"of the group: rank \d has BasicLinear\(.*"
                                           r"tensor_parallel_mode='(column|row)'"):
        odd(torch.randn(8, size))
    wide = ops.Sequential(ops.Linear(IN, OUT * (1 + rank), tensor_parallel_mode="column"))
    with pytest.raises(RuntimeError, match=r"disagree on op \[0\] of the group"):
        wide(x)
    same = ops.Sequential(ops.Linear(IN, OUT, tensor_parallel_mode="column"))
    with fusible.autocast(enabled=rank == 0):
        with pytest.raises(RuntimeError, match=r"disagree on the FP8 recipe: rank \d has"):
            same(torch.randn(16, IN))
    same(torch.randn(8, IN))  # agreeing ranks: planned and run


def _check_one_parallel_record(ws):
    """Every op keeps its parallel state in one record, ``parallel``, read-only after
    construction; the constructor's names are read-only views of it; None is "not split"."""
    linear = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=True)
    bias, norm = ops.Bias(IN, sequence_parallel=True), ops.RMSNorm(IN, sequence_parallel=True)
    column_bias, reduce = ops.Bias(OUT, tensor_parallel=True), ops.AllReduce()
    for op, name in ((linear, "parallel"), (linear, "tensor_parallel_mode"),
                     (linear, "tensor_parallel_group"), (bias, "tensor_parallel"),
                     (bias, "sequence_parallel"), (norm, "sequence_parallel"),
                     (reduce, "process_group"), (reduce, "parallel")):
        with pytest.raises(AttributeError, match=f"{name} is fixed at construction"):
            setattr(op, name, getattr(op, name))
    for op in (linear, bias, norm, column_bias, reduce):
        assert isinstance(op.parallel, TensorParallel) and op.parallel.world_size == ws
        assert not any(hasattr(op, old) for old in ("tp", "group", "sequence_parallel_group"))
    assert (linear.parallel.mode, linear.tensor_parallel_mode) == ("column", "column")
    assert (bias.parallel.mode, column_bias.parallel.mode, reduce.parallel.mode) == \
        (None, "column", None)
    assert ops.BasicLinear(IN, OUT).parallel == NOT_PARALLEL and NOT_PARALLEL.mode is None
    # one name for gradient reduction: the replicated ops' own hook, on their record
    assert (bias.grad_reduction() is bias.parallel, norm.grad_reduction() is norm.parallel) \
        == (ws > 1, ws > 1)
    assert linear.grad_reduction() is column_bias.grad_reduction() is None
    assert reduce.grad_reduction() is None


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


def one_rank_fails_cases(rank, ws):
    """Rank 1 fails a case before an all-reduce that rank 0 enters (an asymmetric bug)."""
    def one_rank_fails():
        if rank == 1:
            raise RuntimeError("rank 1 fails before the all-reduce")
        dist.all_reduce(torch.ones(1))

    return run_cases({"all-reduce": lambda: dist.all_reduce(torch.ones(1)),
                      "one rank fails": one_rank_fails,
                      "next": lambda: dist.all_reduce(torch.ones(1))})


def one_rank_hangs_cases(rank, ws):
    """Rank 1 hangs (outside any collective) while rank 0 waits in an all-reduce."""
    def one_rank_hangs():
        if rank == 1:
            time.sleep(600)  # terminated by the parent once rank 0 raises
        dist.all_reduce(torch.ones(1))

    return run_cases({"one rank hangs": one_rank_hangs})


def _check_gated_after_column(rank, ws):
    """A gated unit after a column-parallel layer: the chunked layout is refused (each
    rank's slice would pair the wrong halves); with the layer's rows interleaved
    (``fusible.interleave_glu_rows``) and ``glu_interleave_size``, each rank computes its
    slice of the unsplit block's result, eagerly and compiled."""
    g = torch.Generator().manual_seed(11)
    ffn = OUT // 2
    w1 = exact_tensor((OUT, IN), torch.float64, generator=g)
    b1 = exact_tensor((OUT,), torch.float64, generator=g)
    w2 = exact_tensor((IN, ffn), torch.float64, generator=g)
    x = exact_tensor((TOKENS, IN), torch.float64, generator=g)
    dy = exact_tensor((TOKENS, IN), torch.float64, generator=g)
    full = ops.Sequential(ops.Linear(IN, OUT), ops.SwiGLU(), ops.BasicLinear(ffn, IN)).double()
    full.load_state_dict({"0.weight": w1, "0.bias": b1, "2.weight": w2})
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.backward(dy)

    def block(unit):
        return ops.Sequential(ops.Linear(IN, OUT, tensor_parallel_mode="column"), unit,
                              ops.Linear(ffn, IN, bias=False, tensor_parallel_mode="row")
                              ).double()

    if ws > 1:
        with pytest.raises(ValueError, match=r"SwiGLU\(\) after the column-parallel "
                                             r"BasicLinear\(.*\): each of the 2 ranks .* "
                                             r"glu_interleave_size"):
            block(ops.SwiGLU())(x)
    rows, cols = _part(OUT, rank, ws), _part(ffn, rank, ws)
    for size in (ffn // ws, 4):
        model = block(ops.SwiGLU(glu_interleave_size=size))
        with torch.no_grad():
            model[0].weight.copy_(fusible.interleave_glu_rows(w1, size)[rows])
            model[0].bias.copy_(fusible.interleave_glu_rows(b1, size)[rows])
            model[2].weight.copy_(w2[:, cols])
        for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
            xr = x.clone().requires_grad_()
            y = run(xr)
            y.backward(dy)
            assert_close(y, y_ref, torch.float64, f"y, interleave {size}")
            assert_close(xr.grad, x_ref.grad, torch.float64, f"dx, interleave {size}")
            want = fusible.interleave_glu_rows(full[0].weight.grad, size)[rows]
            assert_close(model[0].weight.grad, want, torch.float64, f"dw1, {size}")
            model.zero_grad()


def _check_recompute_norm_before_column(rank, ws):
    """RecomputeNormLinear over a column-parallel layer: planned (a sequence-parallel one
    refused, saying why), and the same bits as the plan without it, eagerly and compiled;
    its dgrad summed over the group."""
    g = torch.Generator().manual_seed(12)
    x = exact_tensor((TOKENS, IN), torch.float64, generator=g)
    dy = exact_tensor((TOKENS, IN), torch.float64, generator=g)

    def block(recompute, sp=False):
        torch.manual_seed(0)
        return ops.Sequential(
            ops.RMSNorm(IN, recompute_output=recompute, sequence_parallel=sp),
            ops.Linear(IN, OUT, tensor_parallel_mode="column", sequence_parallel=sp),
            ops.GELU(), ops.Linear(OUT, IN, tensor_parallel_mode="row", sequence_parallel=sp)
        ).double()

    plan = block(True, sp=True).plan(x.requires_grad_())
    cands = [c for c in plan.candidates if c.fusion == "RecomputeNormLinear"]
    assert cands and all(c.status == "refused" and "sequence-parallel" in c.reason
                         for c in cands), cands
    joint, plain = block(True), block(False)
    plain.load_state_dict(joint.state_dict())
    assert "RecomputeNormLinear" in [s.name for s in joint.plan(x).backward]
    results = []
    for run in (plain, joint, torch.compile(joint, backend="aot_eager", fullgraph=True)):
        xr = x.detach().clone().requires_grad_()
        y = run(xr)
        y.backward(dy)
        results.append([y.detach(), xr.grad] + [p.grad for p in joint.parameters()
                                                if run is not plain]
                       + [p.grad for p in plain.parameters() if run is plain])
        joint.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert torch.equal(a, b)
