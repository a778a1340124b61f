"""Expert parallelism x FSDP2 (fusible.expert_sharding) on CPU with gloo: a small MoE
model on ("dp", "ep") meshes of 2 and 4 ranks against one process, and DCP checkpoints
saved on a (2, 2) mesh loaded into (1, 2) and (2, 1) meshes. The checks are in
parallel_expert_mesh.py."""

import torch

from fusible.testing.distributed import failure_report, run_cases, run_distributed
import parallel_expert_mesh as m


def training_cases(rank, ws):
    torch.set_num_threads(1)
    return run_cases({"training": lambda: m.check_training(rank, ws, 2),
                      "errors": lambda: m.check_shard_experts_errors(rank, ws)})


def save_cases(rank, ws, path):
    torch.set_num_threads(1)
    return run_cases({"save": lambda: m.save_checkpoint(rank, ws, path)})


def load_cases(rank, ws, path):
    torch.set_num_threads(1)
    return run_cases({f"load ({dp}, {ep})": (lambda dp=dp, ep=ep: m.check_load(rank, ws, path,
                                                                               dp, ep))
                      for dp, ep in ((1, 2), (2, 1))})


def _report(results, cases):
    report = failure_report(results)
    assert not report, report
    assert [len(outcomes) for outcomes in results] == [cases] * len(results)


def test_experts_over_a_mesh_train_as_one_process_at_two_ranks():
    _report(run_distributed(training_cases, 2, timeout=120), 2)


def test_experts_over_a_mesh_train_as_one_process_at_four_ranks_and_checkpoint(tmp_path):
    """(dp, ep) = (2, 2): training; its checkpoint loads at 2 ranks as (1, 2) and (2, 1)."""
    _report(run_distributed(training_cases, 4, timeout=180), 2)
    _report(run_distributed(save_cases, 4, str(tmp_path / "ck"), timeout=180), 1)
    _report(run_distributed(load_cases, 2, str(tmp_path / "ck"), timeout=180), 2)
