"""Run a function on several spawned processes joined by a process group (tests, examples).

    results = run_distributed(my_module.check, world_size=2)

``fn`` must be a module-level function (the children import it by name, with the
parent's ``sys.path``). It is called as ``fn(rank, world_size, *args)`` after
``torch.distributed.init_process_group`` (gloo on CPU, NCCL with ``backend="nccl"``),
rendezvous through a temporary file (no fixed ports). Each child's return value is
saved with ``torch.save`` and returned in rank order; a failing child raises in the
parent with its traceback, and the other children are terminated.

Collectives time out after ``timeout`` seconds (a minute by default rather than torch's
30 minutes), so a rank left waiting for a peer that will never join raises instead of
hanging the run.

Many checks in one spawn: ``fn`` calls :func:`run_cases` with ``{name: check}``; the
ranks agree after every case whether it passed everywhere and stop at the first
failure, and the parent turns the outcomes into a message with :func:`failure_report`.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import itertools
import os
import sys
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

DEFAULT_TIMEOUT = 60.0
"""Seconds a collective waits for its peers: far above the skew between ranks in the tests
(on 2 CPU cores the 49 cases of tests/test_parallel.py take 10 s together, 1 s at most)."""

NOT_RUN = "not run: "
"""How :func:`run_cases` marks the cases after a failure."""

_AFTER = "after rank {} failed this case: "  # a failure that came after another rank's
_timeout = DEFAULT_TIMEOUT  # this child's, for run_cases
_flag_groups = itertools.count()


def _child(rank, world_size, backend, timeout, init_file, path, module, name, args, out_dir):
    global _timeout
    sys.path[:] = path
    fn = getattr(importlib.import_module(module), name)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    _timeout = timeout
    # The rendezvous waits for the slowest child to start (seconds when the machine is busy).
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=max(timeout, DEFAULT_TIMEOUT)))
    if timeout < DEFAULT_TIMEOUT:
        dist.group.WORLD.set_timeout(datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():  # no rank tears gloo down while a peer's last collective
            dist.barrier()         # (a checkpoint's) still runs: a C++ abort otherwise
    finally:
        if dist.is_initialized():  # run_cases destroys it after a failure
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo",
                    timeout: float = DEFAULT_TIMEOUT) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Parameters
    ----------
    fn : callable
        A module-level function of an importable module.
    world_size : int
        How many processes (ranks).
    *args
        Passed to ``fn`` after the rank and the world size; they must pickle.
    backend : str
        ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
    timeout : float
        Seconds every collective waits for the other ranks before raising (the
        rendezvous waits at least :data:`DEFAULT_TIMEOUT`). It must cover the longest
        time one rank can legitimately spend before a collective that another rank
        already waits in.

    Returns
    -------
    list
        Each rank's return value, in rank order.

    Raises
    ------
    torch.multiprocessing.ProcessRaisedException
        When a child raises (a collective that timed out, for one), with its traceback;
        the other children are terminated.
    torch.multiprocessing.ProcessExitedException
        When a child dies without raising (a signal, ``os._exit``).
    """
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "." in name:
        raise ValueError(f"run_distributed needs a module-level function of an importable "
                         f"module, got {module}.{name}")
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "rendezvous")
        mp.spawn(_child, args=(world_size, backend, float(timeout), init_file, list(sys.path),
                               module, name, args, out_dir), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def no_nvlink_multicast() -> None:
    """Keep NVLink multicast (NVLS, symmetric-memory multicast) off for NCCL runs started
    from here, unless the environment says otherwise: the lent GPU machines need it off."""
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")


def run_cases(cases: dict[str, Callable[[], object]], timeout: float | None = None) -> dict:
    """Run named checks in order on this rank, in step with the other ranks.

    After every case the ranks exchange whether it passed, over a gloo group of their own
    (so that the exchange never completes a collective that a peer still waits in). At
    the first case that failed on any rank they all stop, since their collectives may no
    longer pair up. The rank that failed first destroys the default process group at
    once, so a peer left waiting in a collective of the case gets an error in
    milliseconds instead of at the timeout; every rank destroys it after a failure, so
    ``fn`` must not use it afterwards.

    Parameters
    ----------
    cases : dict of str to callable
        The same names, in the same order, on every rank; each check raises to fail.
    timeout : float, optional
        Seconds the exchange waits for the other ranks; by default that of
        :func:`run_distributed`, else :data:`DEFAULT_TIMEOUT`.

    Returns
    -------
    dict
        ``{name: outcome}`` for every case: ``None`` when it passed on this rank, the
        traceback when it failed (prefixed ``"after rank r failed this case: "`` when
        another rank failed it first), or ``NOT_RUN`` and the case and rank that stopped
        the run.

    Raises
    ------
    RuntimeError
        When the exchange itself fails (a peer hung outside any collective, or died),
        with this rank's outcome of the case.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    wait = datetime.timedelta(seconds=_timeout if timeout is None else timeout)
    # Not dist.new_group: destroying the default group would destroy that one too.
    flags = dist.ProcessGroupGloo(
        dist.PrefixStore(f"fusible_run_cases_{next(_flag_groups)}",
                         distributed_c10d._get_default_store()), rank, world_size, wait)
    outcomes: dict[str, str | None] = {}
    names = list(cases)
    for i, name in enumerate(names):
        failed_at = 0.0
        try:
            cases[name]()
            outcomes[name] = None
        except Exception:
            failed_at = time.time()
            outcomes[name] = traceback.format_exc(limit=-3)
            print(f"rank {rank}: case {name!r} failed\n{outcomes[name]}", file=sys.stderr,
                  flush=True)  # in the log even if this process is killed before it returns
            if dist.is_initialized():  # a peer waiting in a collective gets an error now
                dist.destroy_process_group()
        when = torch.zeros(world_size, dtype=torch.float64)  # when each rank failed, or 0
        when[rank] = failed_at
        try:
            flags.allreduce([when]).wait()  # type: ignore[attr-defined]  # not in torch's stub
        except Exception as error:
            raise RuntimeError(f"rank {rank}: the ranks could not agree whether case {name!r} "
                               f"passed; here it {_outcome(outcomes[name])}") from error
        if when.any():
            first = int(torch.where(when > 0, when, float("inf")).argmin())
            outcome = outcomes[name]
            if outcome is not None and first != rank:
                outcomes[name] = _AFTER.format(first) + outcome
            for later in names[i + 1:]:
                outcomes[later] = f"{NOT_RUN}case {name!r} failed on rank {first}"
            if dist.is_initialized():
                dist.destroy_process_group()
            break
    return outcomes


def _outcome(outcome: str | None) -> str:
    return "passed" if outcome is None else f"failed:\n{outcome}"


def failure_report(results: list[dict]) -> str:
    """The first failure in the ranks' :func:`run_cases` outcomes, as a message.

    Parameters
    ----------
    results : list of dict
        Each rank's outcomes, in rank order (what :func:`run_distributed` returns).

    Returns
    -------
    str
        ``""`` when every case passed on every rank; otherwise the first failed case, the
        rank it failed on first with its traceback, the other ranks it failed on, and how
        many cases were not run.
    """
    failed = [(name, rank, outcome) for name in results[0] for rank, ranks in enumerate(results)
              if (outcome := ranks.get(name)) is not None and not outcome.startswith(NOT_RUN)]
    if not failed:
        return ""
    case = failed[0][0]
    here = [(rank, outcome) for name, rank, outcome in failed if name == case]
    rank, outcome = next(((r, o) for r, o in here if not o.startswith("after rank ")), here[0])
    lines = [f"case {case!r} failed on rank {rank} (of {len(results)}):", outcome.rstrip()]
    lines += [f"also failed on rank {r}{', after' if o.startswith('after rank ') else ''}: "
              f"{o.rstrip().splitlines()[-1]}" for r, o in here if r != rank]
    lines += [f"also failed: case {name!r} on rank {r}" for name, r, _ in failed
              if name != case]
    not_run = sum(any((ranks.get(name) or "").startswith(NOT_RUN) for ranks in results)
                  for name in results[0])
    if not_run:
        lines.append(f"{not_run} later case{'s' if not_run > 1 else ''} not run")
    return "\n".join(lines)


@contextlib.contextmanager
def all_gather_bytes():
    """Count the bytes that tensor all-gathers write on this rank, FSDP2's among them.

    Yields a one-element list whose item grows by each all-gather's output size (the
    gathered tensor: world size times what each rank sends), whichever of
    ``all_gather_single`` / ``all_gather_into_tensor`` this torch version's FSDP2 calls
    (one calling the other counts once). One rank's FSDP2 copies instead of gathering:
    nothing is counted.

    Examples
    --------
    >>> with all_gather_bytes() as counted:
    ...     model(x).sum().backward()
    >>> counted[0]
    """
    counter, active = [0], [False]
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(fn):
        def wrapper(output, *args, **kwargs):
            outer = not active[0]
            if outer:
                counter[0] += output.numel() * output.element_size()
            active[0] = True
            try:
                return fn(output, *args, **kwargs)
            finally:
                active[0] = not outer
        return wrapper
    for n in names:
        setattr(dist, n, counting(originals[n]))
    try:
        yield counter
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
