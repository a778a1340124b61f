"""Hugging Face mixture-of-experts models converted (Mixtral, Qwen3-MoE, DeepSeek-V3 from
small random configs): their expert banks run as fusible grouped GEMMs, the model's own
routing around them; against the unconverted twin (logits, loss with the load-balancing
loss, every gradient by name, 20 AdamW steps with the optimizer built before), compiled
without recompiling when the routing changes, FP8."""

import copy

import pytest
import torch

import fusible
from fusible import moe
from fusible.models.experts import FusedExpertsForward

transformers = pytest.importorskip("transformers")

VOCAB, B, S, STEPS, LR = 96, 2, 8, 20, 1e-3
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4)
FAMILIES = {
    "mixtral": lambda **k: transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **k),
    "qwen3_moe": lambda **k: transformers.Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        head_dim=8, **k),
    "deepseek_v3": lambda **k: transformers.DeepseekV3Config(  # grouped routing, shared
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,  # experts
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, **k),
}


def _model(family, **extra):
    config = FAMILIES[family](**_BASE, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _ids(seed=1):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def _banks(model) -> list:
    return [m for m in model.modules()
            if isinstance(m.__dict__.get("forward"), FusedExpertsForward)]


def _relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_banks_grouped_and_twenty_adamw_steps_match(family):
    """Every expert bank converted (its 3-D weights the same objects, state-dict keys
    unchanged); the first step within 1e-6 of the twin (each gradient within 1e-6 of the
    whole gradient's norm), then 20 AdamW steps with the optimizers built before the
    conversion, every weight within 5% of the most Adam can move it. Mixtral's loss
    includes its load-balancing loss (the router's logits are the model's own)."""
    extra = {"output_router_logits": True} if family == "mixtral" else {}
    model = _model(family, **extra)
    twin = copy.deepcopy(model)
    keys = list(model.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, twin)]
    report = fusible.convert(model)
    banks = [p for p, _, new in report.converted if new.startswith("GroupedLinear")]
    layers = model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)
    assert len(banks) == len(_banks(model)) == layers, str(report)
    assert list(model.state_dict()) == keys
    ids = _ids()
    for step in range(STEPS):
        results = []
        for m, opt in zip((model, twin), optimizers):
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            results.append((out.logits.detach(), out.loss.detach(),
                            {n: p.grad.clone() for n, p in m.named_parameters()
                             if p.grad is not None}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (logits, loss, grads), (want_logits, want_loss, want_grads) = results
        assert _relative(loss, want_loss) < (1e-6 if step == 0 else 1e-5), (step, loss)
        if step == 0:
            assert _relative(logits, want_logits) < 1e-6
            assert set(grads) == set(want_grads)
            total = torch.cat([g.flatten() for g in want_grads.values()]).norm()
            for name, grad in grads.items():
                error = (grad - want_grads[name]).norm() / total
                assert error < 1e-6, f"gradient of {name}: {error:.3g} of the whole gradient"
    if family == "mixtral":
        assert out.aux_loss is not None and out.aux_loss > 0
    twin_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        moved = (p - twin_params[name]).abs().max().item()
        assert moved <= 0.05 * LR * STEPS, f"{name} after {STEPS} steps: {moved:.3g} apart"


def test_no_expert_entries_contribute_nothing():
    """transformers marks "no expert" with the number of experts (its eager loop skips
    it): such an entry gives neither output nor gradient, as the same call with that
    entry's weight zero (and any expert) does."""
    model = _model("mixtral")
    fusible.convert(model)
    bank = model.model.layers[0].mlp.experts
    x = torch.randn(6, 32)
    index = torch.tensor([[0, 4], [1, 2], [4, 4], [3, 0], [2, 1], [4, 3]])
    weights = torch.rand(6, 2, requires_grad=True)
    got = bank(x, index, weights)
    none = index == 4
    zeroed = weights.detach().masked_fill(none, 0.0)
    want = bank(x, index.masked_fill(none, 1), zeroed)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)  # other groups: other sums
    assert not got[2].any()
    got.square().sum().backward()
    assert not weights.grad[none].any() and weights.grad[~none].all()


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_once_whatever_the_routing():
    """aot_eager: two batches routed differently reuse the graphs of the first (the
    counts per expert stay on the device), and compute what the eager model does."""
    model = _model("qwen3_moe")
    fusible.convert(model)
    compiled = torch.compile(model, backend="aot_eager")
    counters = torch._dynamo.utils.counters
    compiled(input_ids=_ids(1), use_cache=False)
    graphs = counters["stats"]["unique_graphs"]
    for seed in (2, 3):
        ids = _ids(seed)
        got = compiled(input_ids=ids, use_cache=False).logits
        want = model(input_ids=ids, use_cache=False).logits
        assert _relative(got, want) < 1e-6
    assert counters["stats"]["unique_graphs"] == graphs


def test_fp8_grouped_gemms():
    """bf16 under fusible.autocast(): each bank's two grouped GEMMs in FP8 (rows padded to
    16 per expert), the loss within FP8's reach of the bf16 twin's."""
    model = _model("qwen3_moe").to(torch.bfloat16)
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    linears = sum(new.startswith("Linear") for _, _, new in report.converted)
    ids = _ids()
    with fusible.autocast():
        totals = fusible.plan_model(model, input_ids=ids, labels=ids).totals()
        got = model(input_ids=ids, labels=ids).loss
    assert totals["FP8 GEMMs"] == linears + 2 * len(_banks(model)), totals
    want = twin(input_ids=ids, labels=ids).loss
    assert abs(got.item() - want.item()) < 0.05 * abs(want.item())


def test_experts_the_policy_keeps_in_bf16_route_without_fp8_padding(monkeypatch):
    """Under a recipe whose GEMM policy keeps the (small) experts in bf16, the bank's rows
    are not padded to 16 per expert (FP8's need); with every GEMM in FP8 they are."""
    model = _model("qwen3_moe").to(torch.bfloat16)
    fusible.convert(model)
    aligns = []
    permute = moe.permute_tokens

    def recording(*args, align=1, **kwargs):
        aligns.append(align)
        return permute(*args, align=align, **kwargs)
    monkeypatch.setattr(moe, "permute_tokens", recording)
    ids = _ids()
    kept = fusible.Float8CurrentScaling(gemm_policy=fusible.Fp8GemmPolicy(devices=("cpu",)))
    for recipe, align in ((kept, 1), (fusible.Float8CurrentScaling(gemm_policy=None), 16)):
        aligns.clear()
        with fusible.autocast(recipe=recipe):
            model(input_ids=ids, labels=ids).loss.backward()
        assert aligns and set(aligns) == {align}, (recipe, aligns)


def test_a_bank_computing_otherwise_is_left_with_the_reason():
    model = _model("mixtral", hidden_act="gelu")
    report = fusible.convert(model)
    left = dict((p, why) for p, _, why in report.left)
    assert "does not compute SiLU" in left["model.layers.0.mlp.experts"]
    assert not _banks(model)


def test_a_bank_with_more_state_is_left():
    """A bank carrying more than the two weights (DeepSeek-V4's SwiGLU clamp ``limit``, a
    bias layout flag) computes otherwise than the grouped pipeline: it stays."""
    from fusible.models.experts import fuse_experts
    model = _model("mixtral")
    bank = model.model.layers[0].mlp.experts
    bank.limit = 7.0
    assert "(limit)" in fuse_experts(bank)
    del bank.limit
    bank.has_bias = True
    assert "layout flags {'has_bias': True}" in fuse_experts(bank)
