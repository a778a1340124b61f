"""fusible.convert: plain-PyTorch GPT- and Llama-style models converted in place: the same
parameters under the same names, the same outputs in float32, the same training curves,
an optimizer built before the conversion still working, and a report of what stayed."""

import copy

import pytest
import torch
from torch import nn

import fusible
from fusible import ops
import whole_models as wm

MODELS = {"gpt": wm.TorchGPT, "llama": wm.TorchLlama}


def data(steps=5):
    """Sequences counting up from a random start (mod 64): a rule to learn."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (2, 1), generator=g) + torch.arange(17)) % 64
            for _ in range(steps + 1)]


def train(model, opt, batches) -> list:
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", MODELS)
def test_converted_model_computes_and_trains_like_the_original(name):
    torch.manual_seed(0)
    original = MODELS[name]()
    model = copy.deepcopy(original)
    params_before = dict(model.named_parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before the conversion
    report = fusible.convert(model)
    assert dict(model.named_parameters()).keys() == params_before.keys()
    assert all(p is params_before[n] for n, p in model.named_parameters())  # same objects
    tokens = data()[0]
    torch.testing.assert_close(model(tokens), original(tokens), rtol=2e-6, atol=2e-6)
    want = train(original, torch.optim.Adam(original.parameters(), lr=1e-2), data())
    got = train(model, opt, data())
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert got[-1] < got[0]
    assert report.converted


def test_the_report_says_what_was_converted_and_what_stayed():
    model = wm.TorchGPT(layers=1)
    report = fusible.convert(model)
    converted = {p: (a, b) for p, a, b in report.converted}
    assert converted["h.0.mlp"] == ("Sequential", "Sequential")  # one pipeline: fusions
    assert converted["h.0.qkv"] == ("Linear", "Linear")
    assert converted["ln_f"] == ("LayerNorm", "LayerNorm")
    assert isinstance(model.h[0].mlp, ops.Sequential)
    stages = [s.name for s in model.h[0].mlp.plan(torch.zeros(2, 32)).forward]
    assert "ForwardLinearBias" in stages
    left = {p: why for p, _, why in report.left}
    assert "fusible has no embedding op" in left["wte"]
    assert "its forward is Python" in left["h.0"]
    text = str(report)
    assert "h.0.mlp: Sequential -> Sequential" in text and "wte: Embedding left" in text


def test_llama_mlp_converts_its_projections_one_by_one():
    model = wm.TorchLlama(layers=1)
    report = fusible.convert(model)
    assert isinstance(model.layers[0].mlp.gate_proj, ops.Linear)
    assert isinstance(model.layers[0].input_layernorm, ops.RMSNorm)
    left = {p: why for p, _, why in report.left}
    assert "merge_gated_mlps=True) merges its gate and up" in left["layers.0.mlp"]


def test_gated_mlps_merge_into_one_swiglu_block_with_the_same_checkpoints():
    torch.manual_seed(0)
    original = wm.TorchLlama()
    model = copy.deepcopy(original)
    report = fusible.convert(model, merge_gated_mlps=True)
    assert ("layers.0.mlp", "LlamaMLP", "Sequential") in report.converted
    mlp = model.layers[0].mlp
    assert [s.name for s in mlp.plan(torch.zeros(2, 32)).forward] == [
        "BasicLinear", "SwiGLU", "BasicLinear"]
    tokens = data()[0]
    torch.testing.assert_close(model(tokens), original(tokens), rtol=2e-6, atol=2e-6)
    assert model.state_dict().keys() == original.state_dict().keys()  # checkpoints keep names
    for name, value in model.state_dict().items():
        assert torch.equal(value, original.state_dict()[name]), name
    fresh = copy.deepcopy(original)
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    fusible.convert(fresh, merge_gated_mlps=True)
    fresh.load_state_dict(original.state_dict())  # an original checkpoint loads
    torch.testing.assert_close(fresh(tokens), original(tokens), rtol=2e-6, atol=2e-6)
    want = train(original, torch.optim.Adam(original.parameters(), lr=1e-2), data())
    got = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), data())
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_a_module_named_like_a_gated_mlp_but_computing_otherwise_is_not_merged():
    class NotGated(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
            self.w2 = nn.Linear(16, 8, bias=False)

        def forward(self, x):  # GELU, not SiLU
            return self.w2(nn.functional.gelu(self.w1(x)) * self.w3(x))

    holder = nn.Module()
    holder.mlp = NotGated()
    fusible.convert(holder, merge_gated_mlps=True)
    assert isinstance(holder.mlp, NotGated) and isinstance(holder.mlp.w1, ops.Linear)


def test_modules_without_a_fusible_equivalent_stay():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=False))
    holder = nn.Module()
    holder.body = model
    report = fusible.convert(holder)
    assert isinstance(holder.body, nn.Sequential)  # a child does not convert
    assert isinstance(holder.body[0], ops.Linear)
    assert [p for p, _, _ in report.left] == ["body", "body.1"]


def test_convert_module_replaces_a_root():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    want = mlp(x)
    new = fusible.convert_module(mlp)
    assert isinstance(new, ops.Sequential)
    assert new[0].weight is mlp[0].weight
    torch.testing.assert_close(new(x), want)
    assert fusible.convert_module(nn.Embedding(3, 4)) is None
