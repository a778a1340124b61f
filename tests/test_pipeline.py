"""Pipeline parallelism on CPU with gloo: fusible stages under torch.distributed.pipelining's
schedules (1F1B, interleaved 1F1B, the zero-bubble ones with their dgrad / wgrad split),
at 2 and 4 pipeline ranks, bf16 and FP8, eager and compiled, equal to one process bit for
bit. The checks are in parallel_pipeline.py."""

import pytest
import torch

from fusible.testing.distributed import failure_report, run_cases, run_distributed
import parallel_pipeline as pp


# torch 2.11's ZBV sends between the two stages of one rank over the group, which gloo
# cannot do (a rank's pair with itself is never connected); 2.13 passes them locally
ZBV_ON_GLOO = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def schedules(device):
    return [n for n in pp.SCHEDULES if ZBV_ON_GLOO or device != "cpu" or n != "ZBVZeroBubble"]


def pipeline_cases(rank, ws, device="cpu"):
    torch.set_num_threads(1)
    pp.DEVICE[0] = device
    return run_cases(_cases(rank, ws, device))


def _cases(rank, ws, device) -> dict:
    cases = {f"tensor parallel split sp={sp}": (
        lambda sp=sp: pp.check_tensor_parallel_split(rank, ws, sp)) for sp in (False, True)}
    for name in schedules(device):
        for fp8 in (False, True):
            cases[f"{name} fp8={fp8}"] = (
                lambda n=name, f=fp8: pp.check_schedule(rank, ws, n, torch.bfloat16, f))
    for name, fp8 in (("ZBVZeroBubble", False), ("InterleavedZeroBubble", True),
                      ("1F1B", True)):
        if name not in schedules(device):
            continue
        cases[f"{name} fp8={fp8} compiled"] = (
            lambda n=name, f=fp8: pp.check_schedule(rank, ws, n, torch.bfloat16, f, True))
    return cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_schedules(world_size):
    results = run_distributed(pipeline_cases, world_size, timeout=180)
    _report(results, world_size, "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_pipeline_schedules_nccl():
    _report(run_distributed(pipeline_cases, 2, "cuda", backend="nccl", timeout=300), 2, "cuda")


def _report(results, world_size, device):
    report = failure_report(results)
    assert not report, report
    assert [len(r) for r in results] == [len(_cases(0, world_size, device))] * world_size


def test_pipeline_example():
    """examples/pipeline.py: ZBV with FP8 on two ranks tracks the one-process stack and
    learns."""
    import pipeline  # examples/ is on the path (conftest)
    name = "ZBVZeroBubble" if ZBV_ON_GLOO else "InterleavedZeroBubble"
    losses = run_distributed(pipeline.worker, 2, 3, name, timeout=120)[0]
    for pipelined, alone in losses:
        assert abs(pipelined - alone) < 1e-3 * alone, losses
    assert losses[-1][0] < losses[0][0], losses
