"""Data parallelism on CPU with gloo: FSDP2 and DDP at world sizes 1 and 2; FSDP2 x tensor
parallelism on a 2-D mesh and DCP checkpoints resharded from 2 ranks to 1 and 4.

Each spawned run goes through its cases with ``run_cases`` (the ranks stop together at the
first failure, and the parent reports it); the checks are in parallel_fsdp.py and
parallel_mesh.py.
"""

import pytest
import torch

from fusible.testing.distributed import failure_report, run_cases, run_distributed
import data_parallel_models as models
import parallel_fsdp as p
import parallel_mesh as m


def data_parallel_cases(rank, ws, device="cpu"):
    torch.set_num_threads(1)
    models.DEVICE[0] = device
    cases = {f"fsdp reshard={r}": (lambda r=r: p.check_fsdp_eager(rank, ws, r))
             for r in (True, False)}
    cases.update({f"fsdp compiled {how}": (lambda h=how: p.check_fsdp_compiled(rank, ws, h))
                  for how in ("block", "model", "inductor")})
    cases.update({
        "mixed precision": lambda: p.check_mixed_precision(rank, ws),
        "mixed precision compiled": lambda: p.check_mixed_precision(rank, ws, "block"),
        "fp8": lambda: p.check_fp8(rank, ws),
        "fp8 compiled": lambda: p.check_fp8(rank, ws, "block"),
        "gradient accumulation": lambda: p.check_gradient_accumulation(rank, ws),
        "activation checkpointing": lambda: p.check_activation_checkpointing(rank, ws),
        "activation checkpointing fp8 all-gather": (
            lambda: p.check_activation_checkpointing(rank, ws, True)),
        "fp8 gathered weight": lambda: p.check_gathered_weight_is_fp8(rank, ws),
        "plan of a sharded block": lambda: p.check_plan_of_sharded_block(rank, ws),
        "steps keep their plans": lambda: p.check_steps_keep_plans(rank, ws),
        "fp8 gather bytes": lambda: p.check_fp8_gather_bytes(rank, ws),
        "fp8 all-gather errors": lambda: p.check_fp8_all_gather_errors(rank, ws),
        "state dict from torch": lambda: p.check_state_dict_from_torch(rank, ws),
        "ddp": lambda: p.check_ddp(rank, ws),
        "ddp compiled": lambda: p.check_ddp(rank, ws, compiled=True),
        "ddp fp8": lambda: p.check_ddp(rank, ws, fp8=True),
    })
    for reshard, mp, compile in ((True, True, None), (False, False, None),
                                 (True, False, "block"), (False, True, "block")):
        cases[f"fp8 all-gather reshard={reshard} mp={mp} compile={compile}"] = (
            lambda a=reshard, b=mp, c=compile: p.check_fp8_all_gather(rank, ws, a, b, c))
    return run_cases(cases)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_data_parallel_nccl():
    _report(run_distributed(data_parallel_cases, 2, "cuda", backend="nccl", timeout=300), 25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_data_parallel_one_gpu():
    """The cases on one GPU (NCCL, FSDP2's CUDA streams, the FP8 hooks' Triton casts)."""
    _report(run_distributed(data_parallel_cases, 1, "cuda", backend="nccl", timeout=300), 25)


def _report(results, cases):
    report = failure_report(results)
    assert not report, report
    assert [len(outcomes) for outcomes in results] == [cases] * len(results)


@pytest.mark.parametrize("world_size", [1, 2])
def test_data_parallel(world_size):
    _report(run_distributed(data_parallel_cases, world_size, timeout=120), 25)


def uneven_cases(rank, ws):
    torch.set_num_threads(1)
    return run_cases({"fp8 all-gather of uneven shards":
                      lambda: p.check_fp8_all_gather_uneven(rank, ws)})


def test_fp8_all_gather_of_uneven_shards():
    """Three ranks: weight rows that do not divide by the ranks (every other test's do)."""
    _report(run_distributed(uneven_cases, 3, timeout=120), 1)


def mesh_cases(rank, ws, path, saved, after):
    torch.set_num_threads(1)
    cases = {"2-D": lambda: m.check_2d(rank, ws),
             "2-D fp8 all-gather": lambda: m.check_2d_fp8_all_gather(rank, ws),
             "2-D fp8 accuracy": lambda: m.check_2d_fp8_accuracy(rank, ws),
             "2-D state dict from torch": lambda: m.check_state_dict_from_torch_2d(rank, ws),
             "2-D delayed gather reduces over its group": (
                 lambda: m.check_2d_delayed_gather_reduces_over_its_group(rank, ws))}
    return run_cases({**cases, **_load_cases(rank, ws, path, saved, after)})


def load_cases(rank, ws, path, saved, after):
    torch.set_num_threads(1)
    return run_cases(_load_cases(rank, ws, path, saved, after))


def _load_cases(rank, ws, path, saved, after):
    return {f"dcp load 2 -> {ws} fp8 all-gather={f}": (
        lambda f=f: m.load_checkpoint(rank, ws, f"{path}/{f}", f, saved[f], after[f]))
        for f in (False, True)}


def save_cases(rank, ws, path):
    torch.set_num_threads(1)
    return {f: m.save_checkpoint(rank, ws, f"{path}/{f}", f) for f in (False, True)}


def test_mesh_and_resharded_checkpoints(tmp_path):
    """FSDP2 x TP on a (2, 2) mesh; DCP checkpoints of 2 ranks loaded by 1 and 4."""
    results = run_distributed(save_cases, 2, str(tmp_path), timeout=120)
    saved = {f: results[0][f][0] for f in (False, True)}  # full states: the same on each rank
    after = {f: results[0][f][1] for f in (False, True)}
    _report(run_distributed(load_cases, 1, str(tmp_path), saved, after, timeout=120), 2)
    _report(run_distributed(mesh_cases, 4, str(tmp_path), saved, after, timeout=180), 7)


def test_fsdp_example(tmp_path):
    """examples/fsdp.py: FSDP2 with FP8 all-gathers tracks the one-process stack, learns,
    and its checkpoint saves and loads."""
    import fsdp  # examples/ is on the path (conftest)
    losses = run_distributed(fsdp.worker, 2, 8, str(tmp_path / "ck"), timeout=120)[0]
    for sharded, alone in losses:
        assert abs(sharded - alone) < 0.01 * alone, losses
    assert losses[-1][0] < losses[0][0] - 0.1, losses
    assert (tmp_path / "ck" / ".metadata").exists()
