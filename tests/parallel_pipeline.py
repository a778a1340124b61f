"""The pipeline-parallel checks (spawned by test_pipeline.py): a stack of residual
Llama-FFN stages, the last with a head, run by torch.distributed.pipelining's schedules
through ``fusible.pipeline_stage``, compared with the same stages run in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

import fusible
from fusible import ops
from fusible.testing import exact_tensor

H, F, V = 32, 64, 16
DEVICE = ["cpu"]  # "cuda" for the NCCL run: set by the spawned cases
MB_TOKENS = 16  # per microbatch: FP8 GEMMs need multiples of 16
SCHEDULES = {"1F1B": (pipelining.Schedule1F1B, "loop", 1),
             "Interleaved1F1B": (pipelining.ScheduleInterleaved1F1B, "loop", 2),
             "InterleavedZeroBubble": (pipelining.ScheduleInterleavedZeroBubble, "loop", 2),
             "ZBVZeroBubble": (pipelining.ScheduleZBVZeroBubble, "v", 2)}


class StageModule(nn.Module):
    """``x + ffn(x)``; the last stage then a head."""

    def __init__(self, last: bool):
        super().__init__()
        self.ffn = ops.Sequential(ops.RMSNorm(H), ops.BasicLinear(H, 2 * F), ops.SwiGLU(),
                                  ops.BasicLinear(F, H))
        self.head = ops.Sequential(ops.RMSNorm(H), ops.Linear(H, V)) if last else None

    def forward(self, x):
        x = x + self.ffn(x)
        return x if self.head is None else self.head(x)


def all_stages(num_stages: int, dtype) -> list:
    torch.manual_seed(0)
    return [StageModule(s == num_stages - 1).to(_device(), dtype) for s in range(num_stages)]


def _device() -> torch.device:
    if DEVICE[0] == "cpu":
        return torch.device("cpu")
    return torch.device(DEVICE[0], dist.get_rank() if dist.is_initialized() else 0)


def loss_fn(out, target):
    return ((out.float() - target) ** 2).sum()


def data(n_mb: int, dtype) -> tuple:
    g = torch.Generator().manual_seed(1)
    x = exact_tensor((n_mb * MB_TOKENS, H), dtype, generator=g)
    target = exact_tensor((n_mb * MB_TOKENS, V), torch.float32, generator=g)
    return x.to(_device()), target.to(_device())


def stage_indices(rank: int, ws: int, style: str, per_rank: int) -> list:
    if per_rank == 1:
        return [rank]
    return [rank, rank + ws] if style == "loop" else [rank, 2 * ws - 1 - rank]


def reference(num_stages: int, n_mb: int, dtype, fp8: bool) -> tuple:
    """One process: each microbatch forward and backward in turn, the gradients summed in
    microbatch order and divided by their number, as the schedules do."""
    stages = all_stages(num_stages, dtype)
    x, target = data(n_mb, dtype)
    losses = []
    for xs, ts in zip(x.chunk(n_mb), target.chunk(n_mb)):
        with fusible.autocast(enabled=fp8):
            y = xs
            for m in stages:
                y = m(y)
            loss = loss_fn(y, ts)
        loss.backward()
        losses.append(loss.detach())
    for m in stages:
        for p in m.parameters():
            p.grad.div_(n_mb)
    return losses, [[p.grad for p in m.parameters()] for m in stages]


def check_schedule(rank: int, ws: int, name: str, dtype, fp8: bool, compiled: bool = False):
    """The schedule's losses and every stage's gradients equal the one-process run's,
    bit for bit; zero-bubble schedules ran each deferred wgrad at a weight step."""
    schedule_cls, style, per_rank = SCHEDULES[name]
    num_stages, n_mb = ws * per_rank, 2 * ws
    mine = stage_indices(rank, ws, style, per_rank)
    modules = all_stages(num_stages, dtype)
    if compiled:
        torch._dynamo.reset()  # the stages of earlier cases share StageModule.forward's code
    weight_steps = []
    stages = []
    for s in mine:
        if compiled:
            modules[s].compile(backend="aot_eager", fullgraph=True)
        stage = fusible.pipeline_stage(modules[s], s, num_stages, _device(),
                                       group=dist.group.WORLD)
        stage.dw_builder = _counting(stage.dw_builder, weight_steps)
        stages.append(stage)
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], n_mb, loss_fn=loss_fn)
    x, target = data(n_mb, dtype)
    losses = []
    with fusible.autocast(enabled=fp8):
        schedule.step(*([x] if 0 in mine else []),  # inputs: the first stage's only
                           target=target if num_stages - 1 in mine
                      else None, losses=losses)
    assert fusible.pending_wgrad() == [], fusible.pending_wgrad()
    ref_losses, ref_grads = reference(num_stages, n_mb, dtype, fp8)
    if num_stages - 1 in mine:
        assert len(losses) == n_mb
        for a, b in zip(losses, ref_losses):
            assert torch.equal(a, b), (name, a, b)
    for s in mine:
        for (pname, p), ref in zip(modules[s].named_parameters(), ref_grads[s]):
            assert p.grad is not None, (name, s, pname)
            assert torch.equal(p.grad, ref), (name, s, pname, (p.grad - ref).abs().max())
    # every microbatch deferred each stage's two FFN weights, and the head's
    expected = n_mb * sum(2 + (s == num_stages - 1) for s in mine)
    assert sum(weight_steps) == expected, (name, weight_steps)


def _counting(builder, counts: list):
    """``builder`` noting how many deferred wgrads each runner it builds holds."""
    def build():
        runner = builder()
        counts.append(len(runner.entries))
        return runner
    return build


def check_tensor_parallel_split(rank: int, ws: int, sequence_parallel: bool):
    """Tensor-parallel layers under the split backward: bit for bit the one-lane gradients
    (a column layer's dgrad all-reduce in the dgrad lane, the replicated bias's gradient
    all-reduce in the wgrad lane); with sequence parallelism the row layer, which gathers
    dy for both GEMMs, keeps its wgrad with its dgrad, and says so."""
    torch.manual_seed(0)
    sp = dict(sequence_parallel=sequence_parallel)
    block = ops.Sequential(ops.Linear(H, F, tensor_parallel_mode="column", **sp), ops.GELU(),
                           ops.Linear(F, H, tensor_parallel_mode="row", **sp)).to(_device())
    tokens = MB_TOKENS // ws if sequence_parallel else MB_TOKENS
    g = torch.Generator().manual_seed(2 + rank)
    x = exact_tensor((tokens, H), torch.float64, generator=g).to(_device())
    dy = exact_tensor((tokens, H), torch.float64, generator=g).to(_device())
    block.double()
    results = []
    for split in (False, True):
        xs = x.clone().requires_grad_()
        with fusible.split_backward(split):
            y = block(xs)
            plan = block.plan(xs)
        y.backward(dy)
        fusible.run_deferred_wgrad()
        results.append([xs.grad] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.equal(a, b), (a - b).abs().max()
    kept = [s.name for s, _ in plan.wgrad_kept]
    assert [s.name for s in plan.wgrad][:1] == (["BasicLinear"] if sequence_parallel
                                                 else ["BackwardLinearBias"]), plan.explain()
    assert ("BackwardLinearBias" in kept or "BasicLinear" in kept) == sequence_parallel, kept
