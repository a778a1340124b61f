"""Expert parallelism x FSDP2 on a ("dp", "ep") mesh, run on every rank by
tests/test_expert_sharding.py: a small MoE model (a norm and a router, the experts, a head)
trained against one process on the global batch, and DCP checkpoints of that layout
loaded into other mesh shapes."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fusible import moe, ops
from fusible.expert_sharding import experts_to_global, experts_to_local, shard_experts
from fusible.testing import exact_tensor
from data_parallel_models import assert_close, full

EXPERTS, K, H, F = 4, 2, 16, 32
TOKENS = 32  # the global batch of a step


class MoEModel(nn.Module):
    """``head(x + experts(norm(x)))`` with top-2 routing; the experts split over
    ``ep_group`` (all of them here when None, no all-to-all)."""

    def __init__(self, ep_group=None, seed=0):
        super().__init__()
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.norm = ops.RMSNorm(H, dtype=torch.float64)
        self.router = nn.Linear(H, EXPERTS, bias=False, dtype=torch.float64)
        local = EXPERTS // ep
        grouped = [ops.GroupedLinear(local, H, 2 * F, dtype=torch.float64), ops.SwiGLU(),
                   ops.GroupedLinear(local, F, H, dtype=torch.float64)]
        self.experts = (ops.Sequential(*grouped) if ep_group is None else ops.Sequential(
            ops.AllToAll(ep_group), ops.PermuteRows(), *grouped, ops.PermuteRows(),
            ops.AllToAll(ep_group)))
        self.head = ops.Linear(H, H, dtype=torch.float64)
        self._fill(seed, ep_rank=dist.get_rank(ep_group) if ep_group is not None else 0,
                   local=local)

    def _fill(self, seed, ep_rank, local):
        """Exactly representable values, the same on every rank for the same seed; this
        ep rank's rows of the whole experts."""
        g = torch.Generator().manual_seed(seed)
        mine = slice(ep_rank * local, (ep_rank + 1) * local)
        with torch.no_grad():
            for name, p in self.named_parameters():
                shape = (EXPERTS, *p.shape[1:]) if "experts" in name else tuple(p.shape)
                value = exact_tensor(shape, torch.float64, generator=g) * 0.5
                p.copy_(value[mine] if "experts" in name else value)

    def forward(self, x):
        h = self.norm(x)
        chosen, weights = moe.route_top_k(self.router(h), K)
        rows, routing = moe.permute_tokens(h, chosen, EXPERTS, align=16)
        inputs = ((routing.splits, routing.splits) if self.ep_group is None
                  else moe.expert_parallel(routing.splits, self.ep_group).inputs())
        return self.head(x + moe.unpermute_tokens(self.experts(rows, *inputs), routing,
                                                  weights))


def _batches(steps=2):
    g = torch.Generator().manual_seed(1)
    return [exact_tensor((TOKENS, H), torch.float64, generator=g) for _ in range(steps)]


def _mesh(dp, ep):
    return init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))


def _sharded(dp, ep, seed=0):
    """The model on a (dp, ep) mesh: experts over "dp" (``shard_experts``), the rest
    over every rank."""
    mesh = _mesh(dp, ep)
    model = MoEModel(mesh["ep"].get_group(), seed)
    assert shard_experts(model, mesh) == ["experts"]
    fully_shard(model, mesh=init_device_mesh("cpu", (dp * ep,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), mesh


def _step(model, opt, x, rank, ws):
    loss = model(x.chunk(ws)[rank]).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _reference(steps):
    """The whole model in one process on each step's global batch (the mean of the
    ranks' mean losses: equal rows each): ``[(loss, {name: param}) per step]``."""
    model = MoEModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = []
    for x in _batches(steps):
        loss = _step(model, opt, x, 0, 1)
        out.append((loss, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _mine(name: str, value: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    """This ep rank's part of a whole reference parameter (the ep model's expert ops sit
    one index later, after the all-to-all)."""
    return value.chunk(ep)[ep_rank] if "experts" in name else value


def _reference_name(name: str) -> str:
    if not name.startswith("experts."):
        return name
    index, rest = name.split(".", 2)[1:]
    return f"experts.{int(index) - 2}.{rest}"


def _assert_params(model, want: dict, ep_rank, ep, what):
    names = [n for n, _ in model.named_parameters()]
    got = [full(p) for p in model.parameters()]
    assert_close(got, [_mine(n, want[_reference_name(n)], ep_rank, ep) for n in names], what,
                 rtol=1e-10)


def check_training(rank, ws, ep):
    """Two Adam steps on this rank's rows: the losses (averaged over the ranks) and every
    parameter (this ep rank's experts) those of one process on the global batch."""
    model, opt, mesh = _sharded(ws // ep, ep)
    ref = _reference(2)
    for x, (want_loss, want) in zip(_batches(2), ref):
        loss = _step(model, opt, x, rank, ws)
        dist.all_reduce(loss)
        assert_close([loss / ws], [want_loss], "loss", rtol=1e-12)
        _assert_params(model, want, mesh["ep"].get_local_rank(), ep, f"{ws} ranks, ep {ep}")


def check_shard_experts_errors(rank, ws):
    mesh = _mesh(ws // 2, 2)
    try:
        shard_experts(MoEModel(), mesh)
    except ValueError as error:
        assert "no expert-parallel block" in str(error), error
    else:
        raise AssertionError("a model without expert-parallel blocks was sharded")
    other = _mesh(ws, 1)
    try:
        shard_experts(MoEModel(mesh["ep"].get_group()), other)
    except ValueError as error:
        assert "experts: its all-to-alls span [2] ranks, not the mesh's ep size 1" in \
            str(error), error
    else:
        raise AssertionError("experts split over 2 ranks sharded as if over more")


def save_checkpoint(rank, ws, path):
    """One step on a (dp, ep) = (2, 2) mesh, then a DCP checkpoint with each expert saved
    once (``experts_to_global``)."""
    model, opt, mesh = _sharded(2, 2)
    _step(model, opt, _batches(1)[0], rank, ws)
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    dcp.save(experts_to_global(state, model, mesh), checkpoint_id=path)


def check_load(rank, ws, path, dp, ep):
    """A model of other values on a (dp, ep) mesh loads the checkpoint: its parameters
    are the one-process model's after the first step, and the next step (Adam's states
    loaded too) gives that model's second."""
    model, opt, mesh = _sharded(dp, ep, seed=7)
    state = experts_to_global(dict(zip(("model", "optim"), get_state_dict(model, opt))),
                              model, mesh)
    dcp.load(state, checkpoint_id=path)
    state = experts_to_local(state, model, mesh)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    (_, first), (_, second) = _reference(2)
    ep_rank = mesh["ep"].get_local_rank()
    _assert_params(model, first, ep_rank, ep, f"loaded at ({dp}, {ep})")
    _step(model, opt, _batches(2)[1], rank, ws)
    _assert_params(model, second, ep_rank, ep, f"the step after loading at ({dp}, {ep})")
