"""Tensor and sequence parallelism on CPU with gloo, world sizes 1 and 2 (spawned processes).

Every rank builds the same full FP64 reference from one seed, runs its shard of the layer,
and compares its outputs and gradients with the matching slices of the reference. Failures
are collected per case and reported together by the parent.
"""

import traceback

import pytest
import torch

from fusible.testing.distributed import run_distributed
from parallel_layers import (DEVICE, _check_dgrad_reduction_overlaps_wgrad, _check_fp8_gather,
                             _check_fp8_gathered_tokens, _check_linear, _check_linear_fp8,
                             _check_mlp)
from parallel_ops import (_check_all_gather_then_column, _check_collectives, _check_guards,
                          _check_init, _check_norm_sp, _check_plan, _check_size_errors,
                          _check_state_dict_from_torch)


def parallel_cases(rank, ws, device="cpu"):
    """Every case on this rank: ``{case: None or the failure's traceback}``."""
    torch.set_num_threads(1)
    DEVICE[0] = device
    cases = {"collectives": lambda: _check_collectives(rank, ws),
             "plan": lambda: _check_plan(rank, ws),
             "size errors": lambda: _check_size_errors(rank, ws),
             "fp8 gather": lambda: _check_fp8_gather(rank, ws),
             "init": lambda: _check_init(rank, ws),
             "state dict from torch": lambda: _check_state_dict_from_torch(rank, ws),
             "norm sp": lambda: _check_norm_sp(rank, ws),
             "guards": lambda: _check_guards(rank, ws),
             "all-gather then column": lambda: _check_all_gather_then_column(rank, ws),
             "fp8 gathered tokens": lambda: _check_fp8_gathered_tokens(rank, ws)}
    for mode in ("column", "row"):
        for sp in (False, True):
            for bias in (False, True):
                for dtype in (torch.float64, torch.float32, torch.bfloat16):
                    cases[f"linear {mode} sp={sp} bias={bias} {dtype}"] = (
                        lambda m=mode, s=sp, b=bias, d=dtype: _check_linear(rank, ws, m, s, b, d))
        for sp in (False, True):
            cases[f"linear fp8 {mode} sp={sp}"] = (
                lambda m=mode, s=sp: _check_linear_fp8(rank, ws, m, s, True))
    for sp in (False, True):
        for fp8 in (False, True):
            cases[f"dgrad reduction overlaps wgrad sp={sp} fp8={fp8}"] = (
                lambda s=sp, f=fp8: _check_dgrad_reduction_overlaps_wgrad(rank, ws, s, f))
    for sp in (False, True):
        for dtype in (torch.float64, torch.bfloat16):
            cases[f"mlp sp={sp} {dtype}"] = lambda s=sp, d=dtype: _check_mlp(rank, ws, s, d)
        cases[f"mlp fp8 sp={sp}"] = lambda s=sp: _check_mlp(rank, ws, s, torch.bfloat16, True)
    cases["mlp inductor"] = lambda: _check_mlp(rank, ws, True, torch.float32, backend="inductor")
    failures = {}
    for name, check in cases.items():
        torch._dynamo.reset()  # each case compiles afresh (no recompile limits across cases)
        try:
            check()
            failures[name] = None
        except Exception:
            failures[name] = traceback.format_exc(limit=-3)
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_tensor_parallel(world_size):
    _report(run_distributed(parallel_cases, world_size))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_tensor_parallel_nccl():
    _report(run_distributed(parallel_cases, 2, "cuda", backend="nccl"))


def _report(results):
    failed = {f"rank {rank}: {name}": error for rank, result in enumerate(results)
              for name, error in result.items() if error is not None}
    assert not failed, "\n".join(f"{name}\n{error}" for name, error in failed.items())
    assert len(results[0]) == 49


def test_tensor_parallel_example():
    """examples/tensor_parallel.py: the parallel block tracks the full one over SGD steps."""
    import tensor_parallel  # examples/ is on the path (conftest)
    diffs = run_distributed(tensor_parallel.worker, 2, 5, None)
    assert max(diffs) < 1e-5, diffs
