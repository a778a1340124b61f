"""Run a function on several spawned processes joined by a process group (tests, examples).

    results = run_distributed(my_module.check, world_size=2)

``fn`` must be a module-level function (the children import it by name, with the
parent's ``sys.path``). It is called as ``fn(rank, world_size, *args)`` after
``torch.distributed.init_process_group`` (gloo on CPU, NCCL with ``backend="nccl"``),
rendezvous through a temporary file (no fixed ports). Each child's return value is
saved with ``torch.save`` and returned in rank order; a failing child raises in the
parent with its traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank, world_size, backend, init_file, path, module, name, args, out_dir):
    sys.path[:] = path
    fn = getattr(importlib.import_module(module), name)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo") -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each run in its own process."""
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "." in name:
        raise ValueError(f"run_distributed needs a module-level function of an importable "
                         f"module, got {module}.{name}")
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "rendezvous")
        mp.spawn(_child, args=(world_size, backend, init_file, list(sys.path), module, name,
                               args, out_dir), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
