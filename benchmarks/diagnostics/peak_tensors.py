"""Which tensors are alive at a step's memory peak: every op's output (through a dispatch
mode: fusible's stages then run as their custom ops, whose outputs are seen, not their
insides) is tracked by its storage until freed; at the highest total the live set is kept.
For the LM head's peak (docs/benchmarks.md): ``layer.py --peak-breakdown``."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensors(TorchDispatchMode):
    """Track the bytes of every op output's storage, alive while some tensor seen here
    holds it; ``peak`` is the live list ``(bytes, op, shape, dtype)`` at the highest
    total, ``peak_bytes`` that total."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.live: dict = {}  # storage data_ptr -> [bytes, op, shape, dtype, holders]
        self.total = self.peak_bytes = 0
        self.peak: list = []

    def _let_go(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[4] -= 1
        if entry[4] == 0:
            del self.live[key]
            self.total -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes:
                continue
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [nbytes, str(func), tuple(t.shape), str(t.dtype), 0]
                self.total += nbytes
            entry[4] += 1
            weakref.finalize(t, self._let_go, key)
            if self.total > self.peak_bytes:
                self.peak_bytes = self.total
                self.peak = sorted((tuple(e[:4]) for e in self.live.values()), reverse=True)
        return out


def peak_breakdown(step, title: str, path: str, top: int = 12) -> None:
    """Run ``step()`` under :class:`PeakTensors` and append the largest tensors alive at its
    peak (beyond what existed before the step) to ``path``."""
    mode = PeakTensors()
    with mode:
        step()
    torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"== {title}: {mode.peak_bytes / 2**30:.2f} GiB of op outputs alive at "
                f"the peak (parameters and inputs not counted)\n")
        for nbytes, op, shape, dtype in mode.peak[:top]:
            f.write(f"  {nbytes / 2**20:10.1f} MiB  {op}  {shape}  {dtype}\n")
