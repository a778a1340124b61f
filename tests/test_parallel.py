"""Tensor and sequence parallelism on CPU with gloo, world sizes 1 and 2 (spawned processes).

Every rank builds the same full FP64 reference from one seed, runs its shard of the layer,
and compares its outputs and gradients with the matching slices of the reference. Failures
are checked case by case (``run_cases``): the ranks stop together at the first case that
failed on any of them, and the parent reports that failure.
"""

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from fusible.testing.distributed import NOT_RUN, failure_report, run_cases, run_distributed
from parallel_layers import (DEVICE, _check_dgrad_reduction_overlaps_wgrad, _check_fp8_gather,
                             _check_fp8_gather_scaled, _check_linear_recipe,
                             _check_fp8_gathered_tokens, _check_linear, _check_linear_fp8,
                             _check_mlp)
from parallel_ops import (_check_all_gather_then_column, _check_collectives,
                          _check_gated_after_column, _check_guards, check_ranks_agree,
                          _check_init, _check_norm_sp, _check_plan,
                          _check_recompute_norm_before_column, _check_size_errors,
                          _check_state_dict_from_torch, one_rank_fails_cases,
                          one_rank_hangs_cases)
from parallel_attention import (check_attention_heads_split,
                                check_split_backward_of_a_parallel_layer,
                                check_split_backward_sums_deferred_wgrads_of_plugins,
                                check_transformer_layer_tensor_parallel)
from parallel_delayed import check_fp8_gather_delayed, check_linear_delayed
from parallel_moe import (_check_expert_parallel, _check_expert_parallel_capacity,
                          _check_expert_parallel_plan)


def parallel_cases(rank, ws, device="cpu"):
    """Every case on this rank: ``{case: outcome}``, as ``run_cases`` gives them."""
    torch.set_num_threads(1)
    DEVICE[0] = device
    cases = {"collectives": lambda: _check_collectives(rank, ws),
             "plan": lambda: _check_plan(rank, ws),
             "size errors": lambda: _check_size_errors(rank, ws),
             "fp8 gather": lambda: _check_fp8_gather(rank, ws),
             **{f"fp8 gather {g}": (lambda g=g: _check_fp8_gather_scaled(rank, ws, g))
                for g in ("rowwise", "blockwise_1x128", "mx_1x32")},
             **{f"linear {m} sp {r}": (lambda m=m, r=r: _check_linear_recipe(rank, ws, m, r))
                for m in ("column", "row") for r in ("rowwise", "blockwise")},
             "fp8 gather delayed": lambda: check_fp8_gather_delayed(rank, ws),
             **{f"linear {m} sp delayed": (lambda m=m: check_linear_delayed(rank, ws, m))
                for m in ("column", "row")},
             "init": lambda: _check_init(rank, ws),
             "state dict from torch": lambda: _check_state_dict_from_torch(rank, ws),
             "norm sp": lambda: _check_norm_sp(rank, ws),
             "guards": lambda: _check_guards(rank, ws),
             "ranks agree": lambda: check_ranks_agree(rank, ws),
             "all-gather then column": lambda: _check_all_gather_then_column(rank, ws),
             "fp8 gathered tokens": lambda: _check_fp8_gathered_tokens(rank, ws),
             "gated unit after column": lambda: _check_gated_after_column(rank, ws),
             "recompute norm before column": lambda: _check_recompute_norm_before_column(
                 rank, ws),
             "expert parallel": lambda: _check_expert_parallel(rank, ws),
             "expert parallel fp8": lambda: _check_expert_parallel(rank, ws, fp8=True),
             "expert parallel plan": lambda: _check_expert_parallel_plan(rank, ws),
             "expert parallel capacity": lambda: _check_expert_parallel_capacity(rank, ws),
             "attention heads split": lambda: check_attention_heads_split(rank, ws),
             "split backward of a parallel layer": (
                 lambda: check_split_backward_of_a_parallel_layer(rank, ws)),
             "split backward sums deferred wgrads": (
                 lambda: check_split_backward_sums_deferred_wgrads_of_plugins(rank, ws)),
             **{f"transformer layer sp={sp}": (
                 lambda sp=sp: check_transformer_layer_tensor_parallel(rank, ws, sp))
                for sp in (False, True)}}
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
    return run_cases({name: _fresh_dynamo(check) for name, check in cases.items()})


def _fresh_dynamo(check):
    def run():
        torch._dynamo.reset()  # each case compiles afresh (no recompile limits across cases)
        check()
    return run


@pytest.mark.parametrize("world_size", [1, 2])
def test_tensor_parallel(world_size):
    _report(run_distributed(parallel_cases, world_size))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_tensor_parallel_nccl():
    _report(run_distributed(parallel_cases, 2, "cuda", backend="nccl"))


def _report(results):
    report = failure_report(results)
    assert not report, report
    assert [len(outcomes) for outcomes in results] == [71] * len(results)


def test_a_rank_that_fails_alone_stops_every_rank_at_once():
    """Rank 1 raises before an all-reduce that rank 0 waits in: rank 0 gets an error as
    soon as rank 1 gives up (not at the collective timeout), and both skip the rest."""
    results = run_distributed(one_rank_fails_cases, 2)
    assert [r["all-reduce"] for r in results] == [None, None]
    assert "RuntimeError: rank 1 fails before the all-reduce" in results[1]["one rank fails"]
    freed = results[0]["one rank fails"]  # by rank 1 leaving the group, not by the timeout
    assert freed.startswith("after rank 1 failed this case: ") and "Timed out" not in freed
    for outcomes in results:
        assert outcomes["next"] == f"{NOT_RUN}case 'one rank fails' failed on rank 1"
    report = failure_report(results)
    assert report.startswith("case 'one rank fails' failed on rank 1 (of 2):\n"), report
    assert "rank 1 fails before the all-reduce" in report, report
    assert "\nalso failed on rank 0, after: " in report, report
    assert report.endswith("\n1 later case not run"), report


def test_a_hung_rank_times_out():
    """Rank 1 hangs outside any collective: rank 0's all-reduce times out, the exchange
    after the case too, and the parent raises with rank 0's traceback."""
    with pytest.raises(ProcessRaisedException, match=r"(?s)rank 0: the ranks could not agree "
                       r"whether case 'one rank hangs' passed; here it failed:.*Timed out"):
        run_distributed(one_rank_hangs_cases, 2, timeout=3)


def test_tensor_parallel_example():
    """examples/tensor_parallel.py: the parallel block tracks the full one over SGD steps."""
    import tensor_parallel  # examples/ is on the path (conftest)
    diffs = run_distributed(tensor_parallel.worker, 2, 5, None)
    assert max(diffs) < 1e-5, diffs
