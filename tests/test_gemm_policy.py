"""The FP8 policy per GEMM (fusible.Fp8GemmPolicy): which GEMMs a recipe runs in FP8, by
their weight's shape, shown per GEMM in explain(), the diagram and plan_model's totals,
overridden per op, and a group whose every GEMM stays in high precision planned as
without a recipe. The policy decides on CUDA by default; here it is asked to decide on
the CPU (``devices=("cpu",)``), which the same planner code serves."""

import copy

import pytest
import torch
from torch import nn

import fusible
from fusible import ops
from fusible.quantization.gemm_policy import (Fp8GemmPolicy, default_gemm_policy,
                                              gemm_decision, set_default_gemm_policy)
from fusible.testing import stage_names

POLICY = Fp8GemmPolicy(devices=("cpu",))


def _recipe(policy=POLICY):
    return fusible.Float8CurrentScaling(gemm_policy=policy)


@pytest.mark.parametrize("shape,fp8", [
    ((4096, 14336), True), ((4096, 4096), True), ((4096, 128256), True),  # Llama-3-8B
    ((2048, 3072), True), ((2048, 2048), False), ((8192, 2048), True),    # Llama-3.2-1B
    ((256, 768), False), ((768, 256), False),                             # debugmodel
])
def test_the_cost_model_keeps_gemms_too_small_to_gain(shape, fp8):
    why = Fp8GemmPolicy().why_high_precision(*shape)
    assert (why is None) == fp8
    assert Fp8GemmPolicy().threshold == pytest.approx(1152, rel=1e-3)
    if not fp8:
        assert "FP8 would not pay: K N / (K + N)" in why


@pytest.mark.parametrize("experts,fp8", [
    ((64, 4096, 4096), False), ((64, 2048, 4096), False),    # DeepSeek-V3-like: 0.95x in FP8
    ((8, 4096, 28672), True), ((8, 14336, 4096), True),      # Mixtral-like: 1.23x in FP8
])
def test_grouped_gemms_decide_at_the_grouped_fp8_rate(experts, fp8):
    """Grouped GEMMs decide at the grouped FP8 rate (each expert's weight cast for its few
    tokens, PyTorch's grouped FP8 GEMM 1.2-1.5x its bf16 one): the measured layers' choices
    (FP8 slower on the DeepSeek-like experts, faster on the Mixtral-like), where a dense
    GEMM of the DeepSeek-like shapes runs in FP8."""
    groups, k, n = experts
    op = ops.GroupedLinear(groups, k, n, bias=False, device="meta")
    why = gemm_decision(_recipe(Fp8GemmPolicy()), op, "cuda")
    assert (why is None) == fp8, why
    if not fp8:
        assert why.endswith("<= 2419 (grouped) (fusible.Fp8GemmPolicy)"), why
        assert gemm_decision(_recipe(Fp8GemmPolicy()), ops.BasicLinear(k, n, device="meta"),
                             "cuda") is None
    op.fp8 = True  # asked for: FP8 whatever the policy
    assert gemm_decision(_recipe(Fp8GemmPolicy()), op, "cuda") is None


def test_the_grouped_rate_follows_a_policy_s_bf16_rate():
    """Another GPU's policy (its own bf16 and FP8 rates) keeps the grouped speedup: the
    grouped threshold scales with it instead of turning infinite past a fixed rate; a
    speedup of 1 or less keeps every grouped GEMM in high precision; the fields keep
    their positions."""
    h200, b200 = Fp8GemmPolicy(), Fp8GemmPolicy(2250.0, 4500.0, 8.0)
    assert h200.grouped_threshold == pytest.approx(2419, rel=1e-3)
    assert b200.grouped_threshold == pytest.approx(7 / (2 * 8e12 * (1 - 1 / 1.3) / 2250e12))
    assert b200.why_high_precision(8192, 28672, grouped=True) is None  # 6372 > 4266
    assert Fp8GemmPolicy(grouped_fp8_speedup=1.0).grouped_threshold == float("inf")
    assert b200.bandwidth_tbs == 8.0 and b200.devices == ("cuda",)


def _mlp():
    torch.manual_seed(0)
    return ops.Sequential(ops.RMSNorm(256), ops.Linear(256, 768, bias=False), ops.SwiGLU(),
                          ops.Linear(384, 4096, bias=False),
                          ops.Linear(4096, 4096, bias=False)).to(torch.bfloat16)


def _run(model, x, recipe):
    x = x.detach().clone().requires_grad_()
    with fusible.autocast(recipe=recipe):
        y = model(x)
    y.backward(torch.ones_like(y))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def test_each_gemm_decided_shown_and_run_as_decided():
    """The two small GEMMs in bf16, the 4096 x 4096 one in FP8: explain() and the diagram
    say so per GEMM, plan_model counts one FP8 GEMM, and the results are those of the
    same decisions taken by hand (the ops' fp8 attributes, no policy), bit for bit."""
    model = _mlp()
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    with fusible.autocast(recipe=_recipe()):
        plan = model.plan(x)
        totals = fusible.plan_model(model, x).totals()
    text = plan.explain()
    assert text.count("[high precision: FP8 would not pay") == 4  # forward and backward
    assert "BasicLinear(in_features=4096, out_features=4096) [FP8]" in text
    assert "high precision: FP8 would not pay" in plan.to_dot()
    assert totals["FP8 GEMMs"] == 1
    decided = _run(model, x, _recipe())
    model[1].fp8, model[3].fp8, model[4].fp8 = False, False, True
    by_hand = _run(model, x, _recipe(None))
    for a, b in zip(decided, by_hand):
        for t, u in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert torch.equal(t, u)
    model[1].fp8 = model[3].fp8 = model[4].fp8 = None
    all_fp8 = _run(model, x, _recipe(None))
    assert not torch.equal(all_fp8[0], decided[0])  # the small GEMMs did change


def test_a_group_whose_gemms_all_stay_plans_as_without_a_recipe():
    """Every GEMM kept in bf16: the plan is the bf16 one (its fusions, no casts) and so
    are the results, bit for bit."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(256, 768), ops.GELU(approximate="tanh"),
                           ops.Linear(768, 256)).to(torch.bfloat16)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    with fusible.autocast(recipe=_recipe()):
        kept = model.plan(x)
    plain = model.plan(x)
    assert stage_names(kept.forward) == stage_names(plain.forward)
    assert stage_names(kept.backward) == stage_names(plain.backward)
    with fusible.autocast(recipe=_recipe()):
        assert fusible.plan_model(model, x).totals()["FP8 GEMMs"] == 0
    got = _run(model, x, _recipe())
    x2 = x.clone().requires_grad_()
    y = model(x2)
    y.backward(torch.ones_like(y))
    assert torch.equal(got[0], y.detach()) and torch.equal(got[1], x2.grad)


def test_a_gemm_kept_in_high_precision_reads_its_input_and_gradient_unrounded():
    """A kept GEMM fused with an op that computes under the recipe (its bias) between two
    FP8 GEMMs: the stages around it hand it plain tensors, never FP8 ones it would
    dequantize (the FP8-rounded values a bf16 GEMM must not see, and three extra passes),
    so the one group gives the bits of the same ops run as three groups, which hand over
    plain tensors."""
    torch.manual_seed(0)
    layers = [ops.BasicLinear(64, 64, fp8=True), ops.RMSNorm(64),
              ops.Linear(64, 64, fp8=False), ops.BasicLinear(64, 64, fp8=True)]
    one = ops.Sequential(*copy.deepcopy(layers)).to(torch.bfloat16)
    three = nn.Sequential(ops.Sequential(copy.deepcopy(layers[0])),
                          ops.Sequential(*copy.deepcopy(layers[1:3])),
                          ops.Sequential(copy.deepcopy(layers[3]))).to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with fusible.autocast(recipe=_recipe()):
        assert "BasicLinear(in_features=64, out_features=64) [high precision: " \
               "BasicLinear(in_features=64, out_features=64).fp8 = False]" in \
               one.plan(x).explain()
    got, expected = _run(one, x, _recipe()), _run(three, x, _recipe())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for a, b in zip(got[2], expected[2]):
        assert torch.equal(a, b)


def test_the_stages_around_a_kept_gemm_hand_it_plain_tensors_both_ways():
    """A kept GEMM whose backward fuses with the residual branch (BackwardLinearAdd) and
    whose forward fuses with the add (ForwardLinearBiasAdd), between FP8 GEMMs: no stage
    hands it an FP8 input or gradient, while the FP8 GEMMs still get theirs."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.BasicLinear(64, 64, fp8=True),
                           ops.MakeExtraOutput(channel="r"),
                           ops.BasicLinear(64, 64, fp8=False), ops.AddExtraInput(channel="r"),
                           ops.BasicLinear(64, 64, fp8=True)).to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with fusible.autocast(recipe=_recipe()):
        plan = model(x).grad_fn.fusible[0]
    kept, fp8_hand_offs = 2, 0
    for stages in (plan.forward, plan.backward):
        for st, nxt in zip(stages, stages[1:]):
            if nxt.lo <= kept < nxt.hi:
                assert st.output_format is None, (st.provenance, nxt.provenance)
            fp8_hand_offs += st.output_format is not None
    assert fp8_hand_offs >= 1  # the FP8 GEMMs' hand-offs are still made
    names = [st.op.__class__.__name__ for st in plan.backward]
    assert "BackwardLinearAdd" in names, names


def test_a_kept_gemm_s_bias_trains_under_a_split_backward():
    """A kept GEMM with its bias under a split backward: the deferral is planned for the
    stage's high-precision compute (dbias deferred with the weight's gradient), so the
    bias gets its gradient, the same bits as without the split."""
    def run(split):
        torch.manual_seed(0)
        model = ops.Sequential(ops.BasicLinear(64, 64, fp8=True),
                               ops.Linear(64, 64, fp8=False),
                               ops.BasicLinear(64, 64, fp8=True)).to(torch.bfloat16)
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        with fusible.split_backward(split), fusible.autocast(recipe=_recipe()):
            y = model(x)
        y.float().square().sum().backward()
        fusible.run_deferred_wgrad()
        return {name: p.grad for name, p in model.named_parameters()}

    split, whole = run(True), run(False)
    assert split["1.bias"] is not None
    for name, grad in whole.items():
        assert torch.equal(split[name], grad), name


def test_an_op_overrides_the_policy_and_a_change_replans():
    model = _mlp()
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    with fusible.autocast(recipe=_recipe()):
        model[1].fp8 = True  # small, in FP8 all the same
        assert "BasicLinear(in_features=256, out_features=768) [FP8]" in model.plan(x).explain()
        model[4].fp8 = False
        assert "out_features=4096) [high precision: BasicLinear(in_features=4096, " \
               "out_features=4096).fp8 = False]" in model.plan(x).explain()
        model[1].fp8 = model[4].fp8 = None
        assert "[FP8]" in model.plan(x).explain()
    with pytest.raises(TypeError, match="fp8"):
        ops.Linear(16, 16, fp8="yes")
    grouped = ops.GroupedLinear(4, 256, 768, fp8=False)
    assert grouped.fp8 is False and grouped.fp8_gemm_shape() == (256, 768)


def test_recipes_get_the_cost_model_unless_told_otherwise():
    """Recipes built without gemm_policy take the default (the cost model; this suite sets
    None in tests/conftest.py so that its FP8 checks cover every GEMM); the policy is part
    of the recipe's key, so a plan under another policy is another plan."""
    assert fusible.Float8CurrentScaling().gemm_policy == default_gemm_policy()
    previous = default_gemm_policy()
    set_default_gemm_policy(Fp8GemmPolicy())
    try:
        recipe = fusible.Float8CurrentScaling()
        assert recipe.gemm_policy == Fp8GemmPolicy() and recipe.gemm_policy.devices == ("cuda",)
        assert fusible.DelayedScaling().gemm_policy == Fp8GemmPolicy()
    finally:
        set_default_gemm_policy(previous)
    assert _recipe().key != _recipe(None).key


def test_fp8_weights_keep_their_gemms_in_fp8():
    """Weights made FP8 by quantized_model_init run FP8 GEMMs whatever their size: the
    policy would otherwise dequantize them on every call."""
    with fusible.quantized_model_init():
        model = ops.Sequential(ops.Linear(64, 64, bias=False)).to(torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with fusible.autocast(recipe=_recipe()):
        assert "BasicLinear(in_features=64, out_features=64) [FP8]" in model.plan(x).explain()
