"""A tensor- and sequence-parallel MLP block on two processes (gloo on CPU, NCCL on GPUs).

Each rank holds half of every weight and half of the tokens. The script copies the shards
of one full block into the parallel one, trains both for a few SGD steps on the same data,
prints how far apart they end up, and writes the parallel plan as a diagram.

    python examples/tensor_parallel.py [--steps 20] [--plan out/tp_mlp_plan]
"""

import argparse

import torch

from fusible import ops
from fusible.testing.distributed import run_distributed


def tp_block(hidden: int, ffn: int, dtype=torch.float32) -> ops.Sequential:
    """Column Linear + GELU + row Linear, tokens split over the group outside the block."""
    return ops.Sequential(
        ops.Linear(hidden, ffn, tensor_parallel_mode="column", sequence_parallel=True),
        ops.GELU(approximate="tanh"),
        ops.Linear(ffn, hidden, tensor_parallel_mode="row", sequence_parallel=True),
    ).to(dtype)


def load_shards(tp: ops.Sequential, full: ops.Sequential, rank: int, world_size: int) -> None:
    """Copy this rank's slices of ``full``'s parameters into ``tp``."""
    ffn = full[0].out_features
    cols = slice(rank * ffn // world_size, (rank + 1) * ffn // world_size)
    with torch.no_grad():
        tp[0].weight.copy_(full[0].weight[cols])
        tp[0].bias.copy_(full[0].bias[cols])
        tp[2].weight.copy_(full[2].weight[:, cols])
        tp[2].bias.copy_(full[2].bias)


def worker(rank: int, world_size: int, steps: int, plan_path: str | None) -> float:
    """Train the parallel and the full block side by side; return the largest difference
    between this rank's output rows after training."""
    hidden, ffn, tokens = 64, 256, 128
    torch.manual_seed(0)  # the same full block and data on every rank
    full = ops.Sequential(ops.Linear(hidden, ffn), ops.GELU(approximate="tanh"),
                          ops.Linear(ffn, hidden))
    tp = tp_block(hidden, ffn)
    load_shards(tp, full, rank, world_size)
    rows = slice(rank * tokens // world_size, (rank + 1) * tokens // world_size)
    opt_full = torch.optim.SGD(full.parameters(), lr=0.1)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.1)
    for _ in range(steps):
        x, target = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        for model, opt, inp, tgt in ((full, opt_full, x, target),
                                     (tp, opt_tp, x[rows], target[rows])):
            opt.zero_grad()
            # Each rank's loss is a mean over its own tokens: scale to the global mean.
            loss = torch.nn.functional.mse_loss(model(inp), tgt, reduction="sum")
            (loss / target.numel()).backward()
            opt.step()
    if rank == 0 and plan_path:
        plan = tp.plan(torch.randn(tokens // world_size, hidden, requires_grad=True))
        print(plan.explain())
        try:
            print("plan diagram:", plan.render(plan_path))
        except RuntimeError as error:  # no graphviz binary
            print(error)
    with torch.no_grad():
        x = torch.randn(tokens, hidden)
        return (tp(x[rows]) - full(x)[rows]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plan", default="out/tp_mlp_plan", help="diagram path (.svg added)")
    args = parser.parse_args()
    import tensor_parallel  # the spawned processes import worker from this module by name

    diffs = run_distributed(tensor_parallel.worker, 2, args.steps, args.plan)
    print(f"max |parallel - full| after {args.steps} steps, per rank: "
          + ", ".join(f"{d:.2e}" for d in diffs))


if __name__ == "__main__":
    main()
