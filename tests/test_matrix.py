"""The test matrix follows the registry: every op ``fusible.ops`` exports and every
registered fusion, through its own ``example()``, eagerly against FP64 in every dtype,
compiled bit for bit against eager, through ``opcheck``, and under FP8 against FP64."""

import pytest
import torch

import fusible
from fusible.testing import (check_compiled_matches_eager, check_fusion, fp8_snr_floor,
                             opcheck_stages, reference_forward, snr_db, stage_names)
from fusible.testing.matrix import build, cases, expected_stages, single_rank_group

CASES = cases()
IDS = [c.name for c in CASES]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_every_op_and_fusion_brings_an_example_and_a_reference():
    assert {"BasicLinear", "SwiGLU", "ForwardLinearBias", "BackwardLinearAdd"} <= set(IDS)
    with single_rank_group():
        lacking = [c.name for c in CASES if c.cls.example() is None]
        assert not lacking, f"no example(): {lacking}"
        for case in CASES:
            model, inputs, _ = build(case, torch.float64)
            reference_forward(model, *inputs)  # raises for an op without a reference


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_eager_against_fp64(case, dtype):
    with single_rank_group():
        model, inputs, _ = build(case, dtype)
        check_fusion(model, *inputs, **expected_stages(case), compiled=False,
                     strict=case.direction == "both")  # single ops: rounded once


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiled_bitwise_and_opcheck(case):
    with single_rank_group():
        model, inputs, _ = build(case, torch.float32)
        check_compiled_matches_eager(model, *inputs)
        opcheck_stages(model, *inputs)


with single_rank_group():  # the collectives' examples need a group to be built
    FP8_CASES = [c for c in CASES if c.cls.example().fp8]


@pytest.mark.parametrize("case", FP8_CASES, ids=[c.name for c in FP8_CASES])
def test_fp8_against_fp64(case):
    """Under FP8 the example keeps its stage, and every result is within the noise of the
    worst GEMM a linear layer runs (E5M2 gradient times E4M3 operand)."""
    floor = fp8_snr_floor(E5M2, E4M3)
    with single_rank_group():
        model, inputs, _ = build(case, torch.bfloat16)
        with fusible.autocast():
            plan = model.plan(*inputs)
            for direction, names in expected_stages(case).items():
                assert set(names) <= set(stage_names(getattr(plan, direction))), plan.explain()
            outputs = model(*inputs)
        ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        ref_outputs, ref_params = reference_forward(model, *ref_inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        ref_outputs = ref_outputs if isinstance(ref_outputs, tuple) else (ref_outputs,)
        gen = torch.Generator().manual_seed(3)
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outputs]
        torch.autograd.backward(outputs, grads)
        torch.autograd.backward(ref_outputs, [g.double() for g in grads])
        pairs = [(o, r) for o, r in zip(outputs, ref_outputs)]
        pairs += [(t.grad, r.grad) for t, r in zip(inputs, ref_inputs)]
        pairs += [(p.grad, ref_params[id(p)].grad) for p in model.parameters()]
        for i, (got, want) in enumerate(pairs):
            assert snr_db(got, want) > floor, (i, snr_db(got, want), floor)


def _variants(model, inputs) -> list:
    """Each parameter frozen in turn, each input not requiring grad in turn, with the
    unfrozen model between them: one model sees every change between calls (a plan cache
    that ignored one would hand a stale plan)."""
    params = [p for p in model.parameters() if p.requires_grad]
    inputs_rg = [i for i, t in enumerate(inputs) if t.requires_grad]
    variants = [((), ())]
    for p in params:
        variants += [((id(p),), ()), ((), ())]
    for i in inputs_rg:
        variants += [((), (i,)), ((), ())]
    return variants


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_freezing_any_parameter_or_input_between_calls(case):
    with single_rank_group():
        model, inputs, _ = build(case, torch.float64)
        ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        ref_outputs, ref_params = reference_forward(model, *ref_inputs)
        ref_outputs = ref_outputs if isinstance(ref_outputs, tuple) else (ref_outputs,)
        gen = torch.Generator().manual_seed(5)
        grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in ref_outputs]
        torch.autograd.backward(ref_outputs, grads)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for frozen_params, frozen_inputs in _variants(model, inputs):
            for p in trainable:
                p.requires_grad_(id(p) not in frozen_params)
                p.grad = None
            run_inputs = [t.detach().clone().requires_grad_(t.requires_grad
                                                           and i not in frozen_inputs)
                          for i, t in enumerate(inputs)]
            outputs = model(*run_inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            if not any(o.requires_grad for o in outputs):
                continue  # everything frozen: nothing to run backward through
            torch.autograd.backward([o for o in outputs if o.requires_grad],
                                    [g for g, o in zip(grads, outputs) if o.requires_grad])
            what = f"frozen params {len(frozen_params)}, inputs {frozen_inputs}"
            for i, (t, r) in enumerate(zip(run_inputs, ref_inputs)):
                if t.requires_grad:
                    torch.testing.assert_close(t.grad, r.grad, msg=f"input {i}, {what}")
                else:
                    assert t.grad is None
            for name, p in model.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, ref_params[id(p)].grad,
                                               msg=f"{name}, {what}")
                else:
                    assert p.grad is None, f"{name} frozen but got a gradient"
