"""Pipeline parallelism on CPU with gloo: fusible stages under torch.distributed.pipelining's
schedules (1F1B, interleaved 1F1B, the zero-bubble ones with their dgrad / wgrad split),
at 2 and 4 pipeline ranks, bf16 and FP8, eager and compiled, equal to one process bit for
bit. The checks are in parallel_pipeline.py."""

import pytest
import torch

from fusible.testing.distributed import failure_report, run_cases, run_distributed
import parallel_pipeline as pp


def pipeline_cases(rank, ws, device="cpu"):
    torch.set_num_threads(1)
    pp.DEVICE[0] = device
    cases = {}
    for name in pp.SCHEDULES:
        for fp8 in (False, True):
            cases[f"{name} fp8={fp8}"] = (
                lambda n=name, f=fp8: pp.check_schedule(rank, ws, n, torch.bfloat16, f))
    for name, fp8 in (("ZBVZeroBubble", False), ("InterleavedZeroBubble", True),
                      ("1F1B", True)):
        cases[f"{name} fp8={fp8} compiled"] = (
            lambda n=name, f=fp8: pp.check_schedule(rank, ws, n, torch.bfloat16, f, True))
    return run_cases(cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_schedules(world_size):
    results = run_distributed(pipeline_cases, world_size, timeout=180)
    _report(results, world_size)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_pipeline_schedules_nccl():
    _report(run_distributed(pipeline_cases, 2, "cuda", backend="nccl", timeout=300), 2)


def _report(results, world_size):
    report = failure_report(results)
    assert not report, report
    assert [len(r) for r in results] == [11] * world_size


def test_pipeline_example():
    """examples/pipeline.py: ZBV with FP8 on two ranks tracks the one-process stack and
    learns."""
    import pipeline  # examples/ is on the path (conftest)
    losses = run_distributed(pipeline.worker, 2, 3, "ZBVZeroBubble", timeout=120)[0]
    for pipelined, alone in losses:
        assert abs(pipelined - alone) < 1e-3 * alone, losses
    assert losses[-1][0] < losses[0][0], losses
