"""FSDP2 x tensor parallelism on a ("dp", "tp") mesh, and DCP checkpoints saved by one
world size and loaded by another (tests/test_data_parallel.py)."""

from __future__ import annotations

import re

import torch
from torch.utils._pytree import tree_map_only
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusible
from fusible import ops
from data_parallel_models import (H, Stack, assert_bitwise, assert_close, batches, full,
                                  gelu_block, llama_stack, local, loss_of, mean_losses,
                                  output_names, shard, train)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _mesh_2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tp_part(name: str, value: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This tensor-parallel rank's part of a full gelu_block parameter: the column layer's
    rows (weight and bias), the row layer's weight columns, the rest whole."""
    if re.fullmatch(r"layers\.\d+\.1\.(weight|bias)", name):
        return value.chunk(2, 0)[tp_rank]
    if re.fullmatch(r"layers\.\d+\.3\.weight", name):
        return value.chunk(2, 1)[tp_rank]
    return value


def _run_2d(rank, dtype=torch.float64, fp8=False, gather_fp8=False):
    """``train`` of a gelu stack, tensor parallel over "tp" and sharded over "dp"."""
    mesh = _mesh_2d()
    model = Stack(lambda: gelu_block(mesh["tp"]), dtype=dtype)
    if gather_fp8:
        fusible.fsdp_float8_all_gather(model)
    shard(model, mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    return model, train(model, [local(x, dp_rank, 2) for x in batches(dtype)], fp8)


def check_2d(rank, ws):
    """The single process's losses, gradients and parameters: each rank's tensor-parallel
    part (the losses averaged over the ranks: every tp rank holds its dp rows' loss)."""
    got = _run_2d(rank)[1]
    ref = Stack(gelu_block)
    want = train(ref, batches())
    names = output_names(ref)
    tp_rank = _mesh_2d()["tp"].get_local_rank()
    mean_losses(got, names)
    want = [w if name is None else _tp_part(name, w, tp_rank) for name, w in zip(names, want)]
    assert_close(got, want, "FSDP2 x TP")


def check_2d_fp8_all_gather(rank, ws):
    """FP8 tensor-parallel shards gathered over dp in FP8: the bits of gathering them in
    high precision."""
    assert_bitwise(_run_2d(rank, torch.float32, True, True)[1],
                   _run_2d(rank, torch.float32, True)[1], "2-D FP8 all-gather")


def check_2d_fp8_accuracy(rank, ws):
    """FP8 on the 2-D mesh is as accurate as in one process: the first step's gradients'
    signal-to-noise ratio against float64 within 3 dB of the single-process FP8 run's
    (each above 10 dB; the smallest, a norm's, is near 18 dB on this block)."""
    got = _run_2d(rank, torch.float32, True, True)[1]
    want = train(Stack(gelu_block), batches(steps=1))
    single = train(Stack(gelu_block, dtype=torch.float32), batches(torch.float32, 1), True)
    names = [n for n, _ in Stack(gelu_block).named_parameters()]
    tp_rank = _mesh_2d()["tp"].get_local_rank()
    for i, name in enumerate(names):
        w = want[1 + i]
        parallel = _snr(got[1 + i], _tp_part(name, w, tp_rank))
        alone = _snr(single[1 + i], w)
        assert parallel > max(alone - 3, 10), f"{name}: {parallel:.1f} dB, alone {alone:.1f}"


def check_2d_delayed_gather_reduces_over_its_group(rank, ws):
    """Delayed scaling's FP8 gather under tensor parallelism, with ``amax_reduction_group``
    the whole mesh: each amax is the maximum over the mesh, not over the tensor-parallel
    pair only, so every rank's state is that of one process casting all four ranks' rows
    (the largest rows sit on the other dp row for ranks 0 and 1)."""
    from fusible.functional.linear_parallel import gather_fp8
    from fusible.quantization import to_format
    mesh = _mesh_2d()
    tp = ops.BasicLinear(32, 32, tensor_parallel_mode="column", sequence_parallel=True,
                         tensor_parallel_group=mesh["tp"].get_group()).parallel
    world = torch.distributed.group.WORLD
    fmt = fusible.DelayedScaling(amax_history_len=2, reduce_amax=True,
                                 amax_reduction_group=world).input_format(columnwise=True)
    alone = fusible.DelayedScaling(amax_history_len=2).input_format(columnwise=True)
    ours, ref = (torch.zeros(fmt.scaling.state_size) for _ in range(2))
    g = torch.Generator().manual_seed(15)
    for step in range(3):
        parts = [(torch.randn(16, 32, generator=g) * 4.0 ** (r - step)).bfloat16()
                 for r in range(ws)]
        gather_fp8(parts[rank], tp, fmt.bound(ours))
        to_format(torch.cat(parts), alone.bound(ref))
        assert torch.equal(ours, ref), f"step {step}, rank {rank}: state {ours} != {ref}"


def _snr(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want).square().sum()
    return 10 * torch.log10(want.square().sum() / noise).item()


def check_state_dict_from_torch_2d(rank, ws):
    """A torch.nn twin loads into a tensor-parallel block sharded over dp."""
    mesh = _mesh_2d()
    torch.manual_seed(3)
    twin = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, 64),
                               torch.nn.GELU(approximate="tanh"), torch.nn.Linear(64, H))
    block = gelu_block(mesh["tp"])
    fully_shard(block, mesh=mesh["dp"])
    block.load_state_dict(fusible.state_dict_from_torch(block, twin))
    tp_rank = mesh["tp"].get_local_rank()
    for (name, got), want in zip(block.named_parameters(), twin.parameters()):
        assert torch.equal(full(got), _tp_part("layers.0." + name, want.detach(), tp_rank)), name
    back = fusible.state_dict_to_torch(block, twin)  # dp's DTensors whole, tp's shards gathered
    assert all(torch.equal(back[k], v) for k, v in twin.state_dict().items())


# DCP ----------------------------------------------------------------------------------

def _sharded(ws, gather_fp8):
    model = llama_stack(torch.float64)
    if gather_fp8:
        fusible.fsdp_float8_all_gather(model)
    shard(model, init_device_mesh("cpu", (ws,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt, x, rank, ws):
    loss_of(model, local(x, rank, ws)).backward()
    opt.step()
    opt.zero_grad()


def save_checkpoint(rank, ws, path, gather_fp8):
    """One step, a DCP checkpoint, the full state then (rank 0's), and the parameters one
    step later."""
    model, opt = _sharded(ws, gather_fp8)
    x0, x1 = batches()
    _step(model, opt, x0, rank, ws)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = tree_map_only(torch.Tensor, torch.clone, get_state_dict(model, opt, options=FULL))
    _step(model, opt, x1, rank, ws)
    return saved, [full(p) for p in model.parameters()]


def load_checkpoint(rank, ws, path, gather_fp8, saved, after):
    """Loaded at another world size: the same full state, and the same next step."""
    model, opt = _sharded(ws, gather_fp8)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = get_state_dict(model, opt, options=FULL)  # on rank 0 only (cpu_offload)
    if rank == 0:
        _assert_same_state(loaded, saved)
    _step(model, opt, batches()[1], rank, ws)
    assert_close([full(p) for p in model.parameters()], after, f"the step after loading at {ws}",
                 rtol=1e-10)


def _assert_same_state(got, want) -> None:
    (gm, go), (wm, wo) = got, want
    assert gm.keys() == wm.keys(), (gm.keys(), wm.keys())
    for k in wm:
        assert torch.equal(gm[k], wm[k]), k
    assert go["state"].keys() == wo["state"].keys()
    for k, state in wo["state"].items():
        for name, value in state.items():
            assert torch.equal(go["state"][k][name], value), (k, name, go["state"][k][name], value)
