"""A Llama-style stack of fusible blocks trained with pipeline parallelism on two
processes (gloo on CPU, NCCL on GPUs), under a zero-bubble schedule, next to the same
stack in one process.

Each rank holds two of the four stages (``ScheduleZBVZeroBubble``'s V: rank 0 the first and
the last, rank 1 the middle two); ``fusible.pipeline_stage`` makes each a
``PipelineStage`` whose backward splits: the schedule's ``backward_input`` steps run the
dgrad lane, its ``backward_weight`` steps the deferred weight gradients, which fill the
pipeline's bubbles. The GEMMs run in FP8 under ``fusible.autocast()`` (the gradient's E5M2
cast done once for both backward GEMMs). The script prints the losses side by side.

    python examples/pipeline.py [--steps 10] [--schedule ZBVZeroBubble]
"""

import argparse

import torch
from torch import nn
from torch.distributed import pipelining

import fusible
from fusible import ops
from fusible.testing.distributed import run_distributed

HIDDEN, FFN, VOCAB, TOKENS, MICROBATCHES = 64, 128, 32, 256, 4
SCHEDULES = {"ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble,
             "InterleavedZeroBubble": pipelining.ScheduleInterleavedZeroBubble,
             "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B}


class Stage(nn.Module):
    """``x + ffn(x)``, a residual RMSNorm + SwiGLU feed-forward; the last stage then a
    norm and the head."""

    def __init__(self, last: bool):
        super().__init__()
        self.ffn = ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, 2 * FFN),
                                  ops.SwiGLU(), ops.BasicLinear(FFN, HIDDEN))
        self.head = (ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, VOCAB))
                     if last else None)

    def forward(self, x):
        x = x + self.ffn(x)
        return x if self.head is None else self.head(x)


def build(num_stages: int = 4) -> list:
    torch.manual_seed(0)  # the same initial stages on every rank
    return [Stage(s == num_stages - 1) for s in range(num_stages)]


def loss_fn(y, target):
    return nn.functional.cross_entropy(y.float(), target)


def worker(rank: int, world_size: int, steps: int, schedule_name: str) -> list:
    """Train this rank's two stages under the schedule and, on every rank, the whole stack
    in one process on the same data; return (pipelined loss, one-process loss) per step."""
    num_stages = 2 * world_size
    mine = [rank, 2 * world_size - 1 - rank] if schedule_name == "ZBVZeroBubble" \
        else [rank, rank + world_size]
    stages_here = build(num_stages)
    device = torch.device("cpu")
    stages = [fusible.pipeline_stage(stages_here[s], s, num_stages, device) for s in mine]
    schedule = SCHEDULES[schedule_name](stages, MICROBATCHES, loss_fn=loss_fn)
    params = [p for s in mine for p in stages_here[s].parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    alone = build(num_stages)
    opt_alone = torch.optim.Adam([p for m in alone for p in m.parameters()], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        target = x[:, :VOCAB].argmax(-1)  # a rule to learn: the largest of the first features
        losses = []
        with fusible.autocast():
            schedule.step(*([x] if 0 in mine else []),  # inputs: the first stage's
                          target=target if num_stages - 1 in mine else None,
                          losses=losses)
        opt.step()  # every deferred wgrad has run: the schedule's weight steps
        opt.zero_grad()
        pipelined = torch.stack(losses).mean() if losses else torch.zeros(())
        torch.distributed.all_reduce(pipelined)  # from the rank holding the last stage
        results.append((pipelined.item(), _step_alone(alone, opt_alone, x, target)))
    return results


def _step_alone(stages, opt, x, target) -> float:
    """The schedule's step in one process: each microbatch's loss, gradients averaged."""
    total = 0.0
    for xs, ts in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
        with fusible.autocast():
            y = xs
            for m in stages:
                y = m(y)
        loss = loss_fn(y, ts)
        (loss / MICROBATCHES).backward()
        total += loss.item() / MICROBATCHES
    opt.step()
    opt.zero_grad()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schedule", default="ZBVZeroBubble", choices=sorted(SCHEDULES))
    args = parser.parse_args()
    import pipeline  # the spawned processes import worker from this module by name

    losses = run_distributed(pipeline.worker, 2, args.steps, args.schedule)[0]
    print(f"step  {args.schedule} (2 ranks, 4 stages)  one process")
    for i, (pipelined, alone) in enumerate(losses):
        print(f"{i:4d}  {pipelined:31.4f}  {alone:11.4f}")


if __name__ == "__main__":
    main()
