"""The models and training loops of the data-parallel tests (FSDP2, DDP, 2-D meshes, DCP).

A stack of residual fusible blocks and a fusible head, run the torchtitan way: each block
and the root sharded by ``fully_shard``. ``train`` runs a few Adam steps and returns what
the checks compare: each step's local loss and full gradients, and the final parameters.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fusible
from fusible import ops
from fusible.testing import exact_tensor

H, F, V = 32, 64, 16  # FP8 GEMMs need multiples of 16, tensor-parallel shards included
TOKENS = 64  # the global batch of a step
STEPS = 2
DEVICE = ["cpu"]  # "cuda" for the NCCL run: set by the spawned cases


def llama_block() -> ops.Sequential:
    """RMSNorm and a SwiGLU feed-forward, no biases."""
    return ops.Sequential(ops.RMSNorm(H), ops.BasicLinear(H, 2 * F), ops.SwiGLU(),
                          ops.BasicLinear(F, H))


def gelu_block(tp_group=None) -> ops.Sequential:
    """LayerNorm and a GELU MLP with biases; column / row parallel over ``tp_group``."""
    mode = (lambda m: m) if tp_group is not None else (lambda m: None)
    return ops.Sequential(
        ops.LayerNorm(H),
        ops.Linear(H, F, tensor_parallel_mode=mode("column"), tensor_parallel_group=tp_group),
        ops.GELU(approximate="tanh"),
        ops.Linear(F, H, tensor_parallel_mode=mode("row"), tensor_parallel_group=tp_group))


class Stack(nn.Module):
    """``x + block(x)`` for each block, then the head."""

    def __init__(self, make_block, layers=2, dtype=torch.float64, seed=0):
        super().__init__()
        torch.manual_seed(seed)  # the same initial values on every rank and in the reference
        self.layers = nn.ModuleList(make_block() for _ in range(layers))
        self.head = ops.Sequential(ops.RMSNorm(H), ops.Linear(H, V))
        self.to(DEVICE[0], dtype)

    def forward(self, x, checkpointed=False):
        for block in self.layers:
            y = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                 if checkpointed else block(x))
            x = x + y
        return self.head(x)


def llama_stack(dtype=torch.float64, layers=2) -> Stack:
    return Stack(llama_block, layers, dtype)


def shard(model: Stack, mesh, **kwargs) -> Stack:
    """``fully_shard`` on each block, the head and the root (``kwargs`` for all)."""
    for block in (*model.layers, model.head):
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def batches(dtype=torch.float64, steps=STEPS, seed=1) -> list:
    """Each step's global batch, exactly representable."""
    g = torch.Generator().manual_seed(seed)
    return [exact_tensor((TOKENS, H), dtype, device=DEVICE[0], generator=g)
            for _ in range(steps)]


def local(x: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """This rank's rows of a global batch."""
    return x.chunk(ws)[rank]


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one tensor (a DTensor gathered)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def loss_of(model, x, fp8=False, **kwargs):
    with fusible.autocast(enabled=fp8):
        y = model(x, **kwargs)
    y = y if y.dtype == torch.float64 else y.float()  # a low-precision output's loss in float32
    return y.square().mean()


def train(model, inputs, fp8=False, run=None, micro=1, sync=None, **kwargs) -> list:
    """Adam steps on ``inputs``: ``[loss, *full grads]`` per step, then the full params.

    ``run`` is what is called (a compiled model); ``micro`` splits each batch into
    microbatches whose gradients accumulate, ``sync(flag)`` switching the gradient
    reduction off for all but the last one."""
    run = model if run is None else run
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = []
    for x in inputs:
        losses = []
        for i, xm in enumerate(x.chunk(micro)):
            if sync is not None:
                sync(i == micro - 1)
            loss = loss_of(run, xm, fp8, **kwargs) / micro
            loss.backward()
            losses.append(loss.detach())
        out += [sum(losses), *(full(p.grad) for p in model.parameters())]
        opt.step()
        opt.zero_grad()
    return out + [full(p) for p in model.parameters()]


def output_names(model: nn.Module, steps: int = STEPS) -> list:
    """What each item of ``train``'s output is: None for a step's loss, else the name of
    the parameter whose gradient (per step) or final value it is."""
    names = [n for n, _ in model.named_parameters()]
    return [None, *names] * steps + names


def mean_losses(out: list, names: list) -> None:
    """The rank-local losses in ``train``'s output (``names``: its ``output_names``)
    replaced, in place, by their mean over all ranks."""
    for i, name in enumerate(names):
        if name is None:
            dist.all_reduce(out[i])
            out[i] /= dist.get_world_size()


def emulated(model: nn.Module, inputs, ws: int, rank: int, fp8=False, param_dtype=None) -> list:
    """What ``train`` gives for ``model`` data-parallel over ``ws`` ranks, computed in one
    process: each rank's gradients in ``param_dtype`` (FSDP2's mixed precision), summed in
    the parameters' dtype and divided by ``ws`` as the gradient reduction does, the loss
    of ``rank``'s rows. Equal bit for bit where the reduction adds in the same order (two
    ranks: a sum of two is exact in either order)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = []
    for x in inputs:
        grads, losses = None, []
        for r in range(ws):
            replica = copy.deepcopy(model).to(param_dtype) if param_dtype else model
            replica.zero_grad()
            xr = local(x, r, ws)
            loss = loss_of(replica, xr.to(param_dtype) if param_dtype else xr, fp8)
            loss.backward()
            losses.append(loss.detach())
            g = [p.grad.to(q.dtype) for p, q in zip(replica.parameters(), model.parameters())]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / ws
        out += [losses[rank], *(p.grad.clone() for p in model.parameters())]
        opt.step()
        opt.zero_grad()
    return out + [p.detach().clone() for p in model.parameters()]


def assert_bitwise(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), (
            f"{what}: item {i} differs by {(a.double() - b.double()).abs().max().item():.3g}")


def assert_close(got: list, want: list, what: str, rtol=1e-12) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))
        assert err <= rtol, f"{what}: item {i} differs by {err.item():.3g} relative"
