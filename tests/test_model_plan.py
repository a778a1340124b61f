"""Model-level plans (fusible.plan_model): every fusible group of a whole model with its
module path, repeated blocks shown once, totals, a vertical diagram readable at 12 and 80
layers."""

import shutil
import struct

import pytest
import torch
from torch import nn

import fusible
from fusible import ops
import whole_models as wm


def tokens():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_a_12_layer_gpt_plans_as_one_block_shown_once():
    model = wm.FusibleGPT(layers=12)
    plan = fusible.plan_model(model, tokens())
    totals = plan.totals()
    assert totals["fusible groups"] == 37  # qkv, proj, mlp per layer, and the head
    assert totals["ordinary modules"] == 13  # the embedding and each layer's attention
    assert totals["fusions chosen"] == {"BackwardActivationBias": 12, "BackwardLinearBias": 37,
                                        "ForwardLinearBias": 25, "ForwardLinearBiasAdd": 24}
    assert [(b.label, b.count) for b in plan.blocks] == [("", 1), ("layers.0-11", 12),
                                                         ("", 1)]
    assert [i.path for i in plan.blocks[1].items] == ["qkv", "attend", "proj", "mlp"]
    text = plan.explain()
    assert "layers.0-11: identical plans, shown once" in text
    assert text.count("qkv: Sequential") == 1
    assert "attend: Attend (not fusible)" in text
    assert [p for p, _ in plan.plans][:3] == ["layers.0.qkv", "layers.0.proj", "layers.0.mlp"]
    assert all(not m._forward_pre_hooks for m in model.modules())  # the hooks are gone


def test_a_differing_layer_splits_the_run():
    model = wm.FusibleGPT(layers=6)
    model.layers[3].mlp[2].approximate = "none"  # its GELU: another plan
    blocks = fusible.plan_model(model, tokens()).blocks
    assert [(b.label, b.count) for b in blocks] == [("", 1), ("layers.0-2", 3),
                                                    ("layers.3", 1), ("layers.4-5", 2),
                                                    ("", 1)]


def test_a_layer_differing_only_in_its_backward_splits_the_run():
    """Frozen biases change layer 3's backward fusions, not its forward ones."""
    model = wm.FusibleGPT(layers=6)
    for name, p in model.layers[3].mlp.named_parameters():
        p.requires_grad_(not name.endswith("bias"))
    plan = fusible.plan_model(model, tokens())
    assert [(b.label, b.count) for b in plan.blocks] == [("", 1), ("layers.0-2", 3),
                                                         ("layers.3", 1), ("layers.4-5", 2),
                                                         ("", 1)]
    forward = {p: [s.name for s in fp.forward] for p, fp in plan.plans}
    assert forward["layers.3.mlp"] == forward["layers.2.mlp"]


def test_totals_count_fp8_gemms_and_the_wgrad_lane():
    model = wm.FusibleGPT(hidden=32, layers=2)
    x = tokens()
    with fusible.autocast():
        totals = fusible.plan_model(model, x).totals()
    assert totals["FP8 GEMMs"] == 4 * 2 + 1
    with fusible.split_backward():
        totals = fusible.plan_model(model, x).totals()
    assert totals["wgrad stages"] == 4 * 2 + 1
    fusible.run_deferred_wgrad()  # nothing ran backward: nothing queued
    assert fusible.pending_wgrad() == []


def test_a_model_without_fusible_modules_is_an_error():
    with pytest.raises(ValueError, match="Linear called no fusible module"):
        fusible.plan_model(nn.Linear(4, 4), torch.zeros(2, 4))


def _png_size(path) -> tuple:
    with open(path, "rb") as f:
        header = f.read(24)
    return struct.unpack(">II", header[16:24])


@pytest.mark.parametrize("layers", [12, 80])
def test_the_diagram_is_vertical_labelled_and_collapsed(layers, tmp_path):
    plan = fusible.plan_model(wm.FusibleGPT(layers=layers), tokens())
    dot = plan.to_dot()
    assert "rankdir=TB" in dot
    assert f'label="layers.0-{layers - 1}  (x{layers}, identical plans)"' in dot
    assert dot.count("qkv: Sequential") == 1
    if shutil.which("dot") is None:
        pytest.skip("rendering needs graphviz's dot binary")
    width, height = _png_size(plan.render(str(tmp_path / f"gpt{layers}"), "png"))
    # the same picture at any depth: one block drawn once, a page's size
    assert height < 1200 and width < 1200, (width, height)


class _AttentionBlock(nn.Module):
    """nn.MultiheadAttention computes with its out_proj child's weight, never calling it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = ops.Sequential(ops.Linear(16, 16), ops.GELU())

    def forward(self, x):
        return self.mlp(self.attn(x, x, x, need_weights=False)[0])


def test_a_module_computing_with_its_childrens_weights_is_shown():
    plan = fusible.plan_model(_AttentionBlock(), torch.randn(2, 4, 16))
    assert [(i.path, i.kind, i.fusible) for i in plan.items] == [
        ("attn", "MultiheadAttention", False), ("mlp", "Sequential", True)]
    assert "attn: MultiheadAttention (not fusible)" in plan.explain()
    assert "attn: MultiheadAttention" in plan.to_dot()


def test_a_repeated_fusible_block_is_labelled_as_the_block_with_its_fp8_ops():
    """Blocks that are themselves fusible groups (layers.N a Sequential) are named "(the
    block)", not "(the model)"; under FP8 each group says which of its ops run in FP8."""
    model = nn.Module()
    model.layers = nn.ModuleList(ops.Sequential(ops.Linear(16, 16), ops.GELU(),
                                                ops.Linear(16, 16)) for _ in range(3))
    model.forward = lambda x: model.layers[2](model.layers[1](model.layers[0](x)))
    x = torch.randn(16, 16)
    text = fusible.plan_model(model, x).explain()
    assert "layers.0-2: identical plans, shown once\n  (the block): Sequential" in text
    assert "(the model)" not in text and "FP8" not in text.split("\n", 1)[1]
    with fusible.autocast():
        plan = fusible.plan_model(model, x)
    assert "  FP8 (tensorwise): BasicLinear[0], BasicLinear[3]" in plan.explain()
    assert "FP8: BasicLinear[0], BasicLinear[3]" in plan.to_dot()
    assert plan.totals()["FP8 GEMMs"] == 6


def test_planning_does_not_train():
    """plan_model runs the model once: BatchNorm's running statistics, delayed scaling's
    amax histories and the random generator are as they were (a first plan's FP8 states
    at their initial zeros)."""
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.5),
                                fusible.ops.Sequential(fusible.ops.Linear(32, 32)))
    x = torch.randn(16, 32) * 3 + 1
    fusible.plan_model(model, x)  # plans made, FP8 states not yet
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    with fusible.autocast(recipe=fusible.DelayedScaling()):
        fusible.plan_model(model, x)
    assert torch.equal(torch.random.get_rng_state(), rng)
    state = model.state_dict()
    for key, value in stats.items():
        assert torch.equal(state[key], value), key
    fp8 = [k for k in state if "fp8_state" in k]
    assert fp8 and all(not state[k].any() for k in fp8), fp8
