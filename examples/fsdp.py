"""A Llama-style stack of fusible blocks trained with FSDP2 on two processes (gloo on CPU,
NCCL on GPUs), FP8 weights all-gathered in FP8, next to the same stack in one process.

Each rank holds half of every parameter (``fully_shard`` per block and on the root) and
half of each batch; bf16 compute with float32 parameters and gradient reduction
(``MixedPrecisionPolicy``), the GEMMs in FP8 under ``fusible.autocast()``. The script
trains both for a few Adam steps, prints the losses side by side, saves a sharded DCP
checkpoint and loads it back.

    python examples/fsdp.py [--steps 10] [--checkpoint out/fsdp_checkpoint]
"""

import argparse

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fusible
from fusible import ops
from fusible.testing.distributed import run_distributed

HIDDEN, FFN, VOCAB, TOKENS = 64, 128, 32, 256


class LlamaStack(nn.Module):
    """Residual RMSNorm + SwiGLU feed-forward blocks, then a norm and a head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, 2 * FFN), ops.SwiGLU(),
                           ops.BasicLinear(FFN, HIDDEN))
            for _ in range(layers))
        self.head = ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, VOCAB))

    def forward(self, x):
        for block in self.layers:
            x = x + block(x)
        return self.head(x)


def sharded(model: LlamaStack, world_size: int, device: str) -> LlamaStack:
    """FP8 weight all-gathers, then ``fully_shard`` per block, on the head and the root."""
    fusible.fsdp_float8_all_gather(model)  # before fully_shard
    mesh = init_device_mesh(device, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (*model.layers, model.head):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def step(model, opt, x, target) -> torch.Tensor:
    with fusible.autocast():
        y = model(x)
    loss = nn.functional.cross_entropy(y.float(), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def worker(rank: int, world_size: int, steps: int, checkpoint: str | None) -> list:
    """Train the sharded stack and, on every rank, the one-process stack (float32, FP8
    GEMMs) on the same data; return both losses per step (the sharded one's averaged over
    the ranks' rows: the batch's)."""
    device = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" \
        else "cpu"
    torch.manual_seed(0)  # the same initial stack on every rank
    alone = LlamaStack().to(device)
    model = sharded(_copy(alone), world_size, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_alone = torch.optim.Adam(alone.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    rows = slice(rank * TOKENS // world_size, (rank + 1) * TOKENS // world_size)
    losses = []
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device)
        target = x[:, :VOCAB].argmax(-1)  # a rule to learn: the largest of the first features
        loss = step(model, opt, x[rows], target[rows])
        torch.distributed.all_reduce(loss)
        losses.append((loss.item() / world_size, step(alone, opt_alone, x, target).item()))
    if checkpoint:
        save_and_load(model, opt, checkpoint)
    return losses


def _copy(model: LlamaStack) -> LlamaStack:
    twin = LlamaStack().to(next(model.parameters()).device)
    twin.load_state_dict(model.state_dict())
    return twin


def save_and_load(model, opt, path: str) -> None:
    """A sharded checkpoint of the model and optimizer, loaded back (DCP reshards it to
    whatever world size loads it)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint", default="out/fsdp_checkpoint")
    args = parser.parse_args()
    import fsdp  # the spawned processes import worker from this module by name

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    losses = run_distributed(fsdp.worker, 2, args.steps, args.checkpoint, backend=backend)[0]
    print("step  FSDP2 (2 ranks)  one process")
    for i, (sharded_loss, alone_loss) in enumerate(losses):
        print(f"{i:4d}  {sharded_loss:15.4f}  {alone_loss:11.4f}")
    print(f"checkpoint: {args.checkpoint}")


if __name__ == "__main__":
    main()
