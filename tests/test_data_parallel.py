"""Data parallelism on CPU with gloo: FSDP2 and DDP at world sizes 1 and 2; FSDP2 x tensor
parallelism on a 2-D mesh and DCP checkpoints resharded from 2 ranks to 1 and 4.

Each spawned run goes through its cases with ``run_cases`` (the ranks stop together at the
first failure, and the parent reports it); the checks are in parallel_fsdp.py and
parallel_mesh.py.
"""

import pytest
import torch

from fusible.testing.distributed import failure_report, run_cases, run_distributed
import parallel_fsdp as p
import parallel_mesh as m


def data_parallel_cases(rank, ws):
    torch.set_num_threads(1)
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


def _report(results, cases):
    report = failure_report(results)
    assert not report, report
    assert [len(outcomes) for outcomes in results] == [cases] * len(results)


@pytest.mark.parametrize("world_size", [1, 2])
def test_data_parallel(world_size):
    _report(run_distributed(data_parallel_cases, world_size, timeout=120), 23)
