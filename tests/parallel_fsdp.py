"""FSDP2 and DDP on fusible models, each rank's run against one process
(tests/test_data_parallel.py).

High precision (FP64) against the single-process run of the same global batch, to the
tolerance the changed reduction order allows; FP8 and mixed precision bit for bit against
the per-rank computation emulated in one process (``emulated``: the same casts, GEMMs and
sums); compiled runs bit for bit against eager ones; FP8 all-gathers bit for bit against
gathering in high precision.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.parallel import DistributedDataParallel

import fusible
from fusible import Float8Tensor, ops
from fusible.core import epoch
from fusible.testing.distributed import all_gather_bytes
from data_parallel_models import (DEVICE, F, H, assert_bitwise, assert_close, batches, emulated,
                                  full, llama_block, llama_stack, local, mean_losses,
                                  output_names, shard, train)

BF16_MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh(ws):
    return init_device_mesh(DEVICE[0], (ws,))


def _fsdp_run(rank, ws, dtype=torch.float64, fp8=False, compile=None, gather_fp8=False,
              checkpointed=False, **shard_kwargs) -> list:
    """``train`` of a sharded llama stack on this rank's rows; ``compile``: "block" (each
    block compiled with fullgraph, the torchtitan way), "model" (the sharded root), or
    "inductor" (blocks, Inductor)."""
    torch._dynamo.reset()
    model = llama_stack(dtype)
    if gather_fp8:
        fusible.fsdp_float8_all_gather(model)
    shard(model, _mesh(ws), **shard_kwargs)
    run = model
    if compile in ("block", "inductor"):
        backend = "inductor" if compile == "inductor" else "aot_eager"
        for block in model.layers:
            block.compile(fullgraph=True, backend=backend)
    elif compile == "model":
        run = torch.compile(model, backend="aot_eager")  # FSDP2's hooks break the graph
    inputs = [local(x, rank, ws) for x in batches(dtype)]
    return train(model, inputs, fp8, run=run, checkpointed=checkpointed)


def check_fsdp_eager(rank, ws, reshard):
    got = _fsdp_run(rank, ws, reshard_after_forward=reshard)
    want = train(llama_stack(), batches())
    _all_mean_losses(got)
    if ws == 1:
        assert_bitwise(got, want, "one rank, as one process")
    assert_close(got, want, f"FSDP2 reshard_after_forward={reshard}")


def _all_mean_losses(out: list) -> None:
    """The rank-local losses in a llama stack's ``train`` output: their mean over ranks."""
    mean_losses(out, output_names(llama_stack()))


def check_fsdp_compiled(rank, ws, how):
    """Compiled (per block with fullgraph, or the whole sharded model), bitwise eager."""
    assert_bitwise(_fsdp_run(rank, ws, compile=how), _fsdp_run(rank, ws), f"compiled {how}")


def check_mixed_precision(rank, ws, compile=None):
    """bf16 parameters, float32 gradient reduction: the emulated ranks' bits."""
    got = _fsdp_run(rank, ws, torch.float32, compile=compile, mp_policy=BF16_MP)
    want = emulated(llama_stack(torch.float32), batches(torch.float32), ws, rank,
                    param_dtype=torch.bfloat16)
    assert_bitwise(got, want, "bf16 mixed precision")


def check_fp8(rank, ws, compile=None):
    """Under fusible.autocast, each rank's FP8 casts of its rows: the emulated bits."""
    got = _fsdp_run(rank, ws, torch.float32, fp8=True, compile=compile)
    want = emulated(llama_stack(torch.float32), batches(torch.float32), ws, rank, fp8=True)
    assert_bitwise(got, want, f"FP8 compile={compile}")


def check_gradient_accumulation(rank, ws):
    """Two microbatches, the reduction switched off for the first: the full batch's
    gradients, and no sharded gradient before the last microbatch."""
    model = shard(llama_stack(), _mesh(ws))
    seen = []

    def sync(flag):
        model.set_requires_gradient_sync(flag)
        seen.append([p.grad is None for p in model.parameters()])
    got = train(model, [local(x, rank, ws) for x in batches()], micro=2, sync=sync)
    assert seen[1] == [True] * len(seen[1]), "a gradient was reduced before the last microbatch"
    _all_mean_losses(got)
    assert_close(got, train(llama_stack(), batches()), "gradient accumulation")


def check_activation_checkpointing(rank, ws, gather_fp8=False):
    """Each block checkpointed (recomputed in the backward): the bits of storing it."""
    kwargs = dict(dtype=torch.float32, fp8=gather_fp8, gather_fp8=gather_fp8)
    assert_bitwise(_fsdp_run(rank, ws, checkpointed=True, **kwargs), _fsdp_run(rank, ws, **kwargs),
                   "activation checkpointing")


def check_fp8_all_gather(rank, ws, reshard, mp, compile):
    """FP8 weights gathered: bitwise gathering in high precision then quantizing."""
    kwargs = dict(dtype=torch.float32, fp8=True, compile=compile, reshard_after_forward=reshard,
                  mp_policy=BF16_MP if mp else MixedPrecisionPolicy())
    assert_bitwise(_fsdp_run(rank, ws, gather_fp8=True, **kwargs), _fsdp_run(rank, ws, **kwargs),
                   "FP8 all-gather")


def check_fp8_all_gather_uneven(rank, ws):
    """Weights whose rows do not divide by the ranks (32 rows over 3: 11, 11, 10, FSDP2
    padding the last shard up): the FP8 gather gives the bits of gathering in high
    precision, outputs, input and weight gradients, two steps."""
    runs = []
    for gather_fp8 in (False, True):
        torch.manual_seed(0)
        model = ops.Sequential(ops.BasicLinear(H, 32), ops.GELU(), ops.BasicLinear(32, 48))
        model.to(DEVICE[0])
        if gather_fp8:
            fusible.fsdp_float8_all_gather(model)
        fully_shard(model, mesh=_mesh(ws))
        assert [p.to_local().shape[0] for p in model.parameters()] == [
            len(range(32)[rank::ws]), len(range(48)[rank::ws])], "not the uneven shards"
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        got = []
        for step in range(2):
            x = batches(torch.float32, 1, seed=step)[0][:16].requires_grad_()
            with fusible.autocast():
                y = model(x)
            y.square().sum().backward()
            got += [y.detach(), x.grad] + [full(p.grad) for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        runs.append(got)
    assert_bitwise(runs[1], runs[0], "FP8 all-gather of uneven shards")


def check_fp8_gather_bytes(rank, ws):
    """Linear layers alone, bf16 mixed precision: FP8 gathers half the bytes."""
    counts = []
    for gather_fp8 in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(ops.Sequential(ops.BasicLinear(H, 2 * F), ops.SwiGLU(),
                                                     ops.BasicLinear(F, H)) for _ in range(2)))
        model.to(DEVICE[0])
        if gather_fp8:
            fusible.fsdp_float8_all_gather(model)
        for block in model:
            fully_shard(block, mesh=_mesh(ws), mp_policy=BF16_MP)
        fully_shard(model, mesh=_mesh(ws), mp_policy=BF16_MP)
        with all_gather_bytes() as counter:
            with fusible.autocast():
                y = model(torch.ones(16, H, device=DEVICE[0]))
            y.float().sum().backward()
        counts.append(counter[0])
    if ws == 1:  # FSDP2 copies instead of gathering
        assert counts == [0, 0], counts
        return
    bf16, fp8 = counts
    weights = sum(p.numel() for p in model.parameters())
    assert bf16 == 2 * 2 * weights and fp8 * 2 == bf16, counts  # forward and backward


def check_gathered_weight_is_fp8(rank, ws):
    """Inside the forward, a wrapped weight is the gathered Float8Tensor (E4M3, with its
    transposed copy, of the mixed-precision dtype)."""
    model = llama_stack(torch.float32)
    names = fusible.fsdp_float8_all_gather(model)
    assert names == [f"layers.{i}.{j}.weight" for i in (0, 1) for j in (1, 3)] + ["head.1.weight"]
    shard(model, _mesh(ws), mp_policy=BF16_MP)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, a: seen.extend((m[0].weight, m[1].weight)))
    with fusible.autocast():
        model(torch.ones(16, H, device=DEVICE[0]))
    norm, w = seen
    assert type(norm) is torch.nn.Parameter and norm.dtype == torch.bfloat16, type(norm)
    assert type(w) is Float8Tensor and w.fp8_dtype == torch.float8_e4m3fn, type(w)
    assert w.dtype == torch.bfloat16 and w.shape == (2 * F, H) and w._transpose is not None


def check_plan_of_sharded_block(rank, ws):
    """A sharded block plans (outside its forward: DTensor parameters) as before."""
    x = torch.ones(16, H, dtype=torch.float64, device=DEVICE[0])
    want = llama_block().to(x).plan(x).explain()
    block = llama_block().to(x)
    fully_shard(block, mesh=_mesh(ws))
    assert block.plan(x).explain() == want


def check_fp8_all_gather_errors(rank, ws):
    model = shard(llama_stack(torch.float32), _mesh(ws))
    with pytest.raises(ValueError, match=r"layers\.0\.1\.weight is a DTensor, not a plain "
                                         r"tensor; call it before fully_shard"):
        fusible.fsdp_float8_all_gather(model)
    with fusible.quantized_model_init():
        block = llama_block()
    with pytest.raises(ValueError, match=r"1\.weight is already an FP8 parameter"):
        fusible.fsdp_float8_all_gather(block)


def check_ddp(rank, ws, compiled=False, fp8=False):
    """DDP: the single process's gradients (FP8: the emulated bits); compiled: eager's."""
    dtype = torch.float32 if fp8 else torch.float64

    def ddp_run(compile):
        torch._dynamo.reset()
        model = DistributedDataParallel(llama_stack(dtype))
        run = torch.compile(model, backend="aot_eager") if compile else model
        return train(model, [local(x, rank, ws) for x in batches(dtype)], fp8, run=run)
    got = ddp_run(compiled)
    if compiled:
        assert_bitwise(got, ddp_run(False), "DDP compiled")
    elif fp8:
        assert_bitwise(got, emulated(llama_stack(dtype), batches(dtype), ws, rank, fp8=True),
                       "DDP FP8")
    else:
        _all_mean_losses(got)
        assert_close(got, train(llama_stack(), batches()), "DDP")


def check_state_dict_from_torch(rank, ws):
    """A torch.nn twin's parameters load into a sharded block (each rank its shard)."""
    torch.manual_seed(3)
    twin = torch.nn.Sequential(torch.nn.RMSNorm(H, eps=1e-5), torch.nn.Linear(H, 2 * F, bias=False),
                               torch.nn.Linear(F, H, bias=False)).double()
    twin.to(DEVICE[0])
    block = llama_block().to(DEVICE[0], torch.float64)
    fully_shard(block, mesh=_mesh(ws))
    block.load_state_dict(fusible.state_dict_from_torch(block, twin))
    for got, want in zip(block.parameters(), twin.parameters()):
        assert torch.equal(full(got), want.detach())
    back = fusible.state_dict_to_torch(block, twin)  # the DTensors made whole
    assert all(torch.equal(back[k], v) for k, v in twin.state_dict().items())


def check_steps_keep_plans(rank, ws):
    """FSDP2 swaps sharded and gathered parameters around every forward and backward: no
    replanning (the epoch stays) and, per-block compiled, no recompiling after step one."""
    torch._dynamo.reset()
    model = shard(llama_stack(torch.float32), _mesh(ws), mp_policy=BF16_MP)
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.layers:
        block.compile(fullgraph=True, backend=counter)
    x = torch.ones(16, H, device=DEVICE[0])
    seen = []
    for _ in range(4):
        with fusible.autocast():
            model(x).float().sum().backward()
        seen.append((epoch.current(), counter.frame_count))
    assert seen[1:] == [seen[1]] * 3, seen
