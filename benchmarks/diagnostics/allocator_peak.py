"""The CUDA caching allocator's blocks alive at a step's memory peak, each named by the
innermost frames of the code that allocated it: unlike :mod:`peak_tensors` (op outputs
through a dispatch mode), this sees a stage's temporaries and compiled code too, so the
same step of fusible and of torch.compile can be compared block by block.
For a decoder layer's peak (docs/benchmarks.md): ``layer.py --peak-breakdown``; the LM
head's: ``head_peak.py``."""

from __future__ import annotations

import os

import torch

_OWN = ("fusible", "fusions", "torch/_inductor", "torchinductor", "transformers")


def _where(frames: list) -> str:
    """The innermost frames in fusible, its fusions, Inductor's code or transformers (up to
    three), else the innermost frame."""
    own = [f for f in frames if any(part in f["filename"] for part in _OWN)]
    chosen = own[:3] or frames[:1]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
                      for f in chosen) or "?"


def live_at_peak(trace: list) -> tuple:
    """``(peak bytes, [(bytes, where)] alive then)`` from one device's allocator trace,
    counting only blocks allocated while recording (parameters and inputs made before
    are not in it)."""
    live: dict = {}
    total = peak = 0
    at_peak: list = []
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, sorted(at_peak, reverse=True)


def blocks_at_peak(step) -> tuple:
    """Run ``step()`` with the allocator's history recorded: :func:`live_at_peak` of it."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])


def allocator_peak(step, title: str, path: str, top: int = 14) -> None:
    """Run ``step()`` with the allocator's history recorded and append the largest blocks
    alive at its peak to ``path``."""
    peak, blocks = blocks_at_peak(step)
    with open(path, "a") as f:
        f.write(f"== {title}: {peak / 2**30:.3f} GiB allocated during the step alive at its "
                f"peak (parameters and inputs not counted)\n")
        for nbytes, where in blocks[:top]:
            f.write(f"  {nbytes / 2**20:10.1f} MiB  {where}\n")
        rest = sum(b for b, _ in blocks[top:])
        f.write(f"  {rest / 2**20:10.1f} MiB  in {max(len(blocks) - top, 0)} smaller blocks\n")
