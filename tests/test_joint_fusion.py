"""Joint forward-backward fusions: one fused op owning both passes of its ops, saving its
own record (RecomputeNormLinear: the norm's output recomputed instead of saved)."""

import attrs
import pytest
import torch

import fusible
from fusible import FusedOperation, Op, Pattern, ops
from fusible.ops import BackwardResult, ForwardResult
from fusible.testing import check_fusion, exact_parameters_, exact_tensor, stage_names

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _block(norm="rms", bias=False, recompute=True, residual=False):
    zero_centered = norm.endswith("zc")  # "rms_zc", "layer_zc": zero_centered_gamma
    norm_op = (ops.RMSNorm if norm.startswith("rms") else ops.LayerNorm)(
        16, recompute_output=recompute, zero_centered_gamma=zero_centered)
    layers = [ops.MakeExtraOutput()] if residual else []
    layers += [norm_op, ops.BasicLinear(16, 32)] + ([ops.Bias(32)] if bias else [])
    return ops.Sequential(*layers)


def _run(model, x, *extras):
    """Outputs, input gradients and parameter gradients of one step."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, *extras)]
    out = model(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(5)
    torch.autograd.backward(outs, [exact_tensor(o.shape, o.dtype, generator=gen) for o in outs])
    grads = [t.grad for t in inputs] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [o.detach() for o in outs] + grads


@pytest.mark.parametrize("norm", ["rms", "layer", "layer_zc"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_joint_stage_in_both_passes_and_the_basic_ops_bits(norm, bias, dtype):
    """The plan has one RecomputeNormLinear stage each way; outputs and every gradient
    equal the plan without it bit for bit (the recomputed output is the forward's)."""
    joint = exact_parameters_(_block(norm, bias).to(dtype))
    plain = _block(norm, bias, recompute=False).to(dtype)
    plain.load_state_dict(joint.state_dict())
    x = exact_tensor((3, 5, 16), dtype).requires_grad_()
    plan = joint.plan(x)
    assert stage_names(plan.forward) == stage_names(plan.backward) == ["RecomputeNormLinear"]
    assert "RecomputeNormLinear" not in stage_names(plain.plan(x).forward)
    for a, b in zip(_run(joint, x), _run(plain, x)):
        assert torch.equal(a, b)
    check_fusion(joint, x, forward=["RecomputeNormLinear"], backward=["RecomputeNormLinear"])


def test_the_norm_output_is_not_saved():
    """Between the passes the joint stage keeps the norm's input, statistics and the two
    weights; the basic ops would also keep the norm's output for the weight gradient."""
    x = torch.randn(4, 16, requires_grad=True)
    joint, plain = _block(), _block(recompute=False)
    ctxs = joint(x).grad_fn.fusible[1]
    saved = ctxs[0].saved
    assert type(saved).__name__ == "NormLinearSaved" and ctxs[1].saved is None
    kept = [t for t in attrs.astuple(saved, recurse=False) if t is not None]
    assert all(t is x or t.numel() < x.numel() or t.shape == (32, 16) for t in kept)
    plain_ctxs = plain(x).grad_fn.fusible[1]
    assert plain_ctxs[1].saved.input.shape == x.shape  # the norm's output, saved


def test_gradient_needs_frozen_norm_and_plain_input():
    """An input without gradient and a frozen norm: only the weight gradient, from the
    recomputed output; nothing of the norm's backward runs."""
    joint, plain = _block("layer", bias=True), _block("layer", bias=True, recompute=False)
    plain.load_state_dict(joint.state_dict())
    for m in (joint, plain):
        m[0].requires_grad_(False)
    x = torch.randn(4, 16)
    assert stage_names(joint.plan(x).backward) == ["RecomputeNormLinear"]
    for a, b in zip(_run(joint, x), _run(plain, x)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_refused_where_nothing_would_be_saved():
    model = _block()
    model[1].weight.requires_grad_(False)
    plan = model.plan(torch.randn(4, 16, requires_grad=True))
    assert stage_names(plan.forward) == ["RMSNorm", "BasicLinear"]
    (cand,) = [c for c in plan.candidates if c.fusion == "RecomputeNormLinear"]
    assert cand.status == "refused" and "needs no gradient" in cand.reason


@pytest.mark.parametrize("norm", ["rms", "layer", "rms_zc"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_same_bits_as_the_basic_ops(norm, bias):
    """Under FP8 the recomputation quantizes by the forward's scale: outputs and every
    gradient equal the plan without the joint fusion bit for bit, and the linear layer's
    transposed FP8 copy of the norm's output is not kept."""
    joint = exact_parameters_(_block(norm, bias).to(torch.bfloat16))
    plain = _block(norm, bias, recompute=False).to(torch.bfloat16)
    plain.load_state_dict(joint.state_dict())
    x = exact_tensor((2, 8, 16), torch.bfloat16).requires_grad_()
    with fusible.autocast(recipe=fusible.Float8CurrentScaling()):
        plan = joint.plan(x)
        assert stage_names(plan.forward) == ["RecomputeNormLinear"]
        assert joint(x).grad_fn.fusible[1][1].saved is None
        results = [_run(joint, x), _run(plain, x)]
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["rowwise", "blockwise", "mxfp8", "delayed"])
def test_refused_where_the_recomputation_could_not_give_the_forwards_bits(name):
    """Under a recipe casting the norm's output per row, per block or from an amax history
    the recomputation would not repeat the forward's cast: the joint fusion says so and
    the ops run as their own stages, the bits of the plan without recompute_output."""
    joint = exact_parameters_(_block().to(torch.bfloat16))
    plain = _block(recompute=False).to(torch.bfloat16)
    plain.load_state_dict(joint.state_dict())
    x = exact_tensor((2, 64, 16), torch.bfloat16).requires_grad_()
    with fusible.autocast(recipe=fusible.recipe_from_name(name)):
        plan = joint.plan(x)
        assert "RecomputeNormLinear" not in stage_names(plan.forward)
        (cand,) = [c for c in plan.candidates if c.fusion == "RecomputeNormLinear"]
        assert cand.status == "refused" and "needs per-tensor current scaling" in cand.reason
        results = [_run(joint, x), _run(plain, x)]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_directional_fusions_over_its_ops_are_refused_and_the_residual_add_stays_right():
    """BackwardAddRMSNorm would cover the norm: the joint stage owns it, so the planner
    refuses it (saying so) and MakeExtraOutput's backward adds the branch on its own."""
    model = exact_parameters_(_block(residual=True))
    plain = _block(residual=True, recompute=False)
    plain.load_state_dict(model.state_dict())
    x = exact_tensor((4, 16)).requires_grad_()
    plan = model.plan(x)
    assert stage_names(plan.backward) == ["RecomputeNormLinear", "MakeExtraOutput"]
    (cand,) = [c for c in plan.candidates if c.fusion == "BackwardAddRMSNorm"]
    assert cand.status == "refused" and "joint fusion RecomputeNormLinear" in cand.reason
    assert "BackwardAddRMSNorm" in stage_names(plain.plan(x).backward)
    torch.testing.assert_close(_run(model, x), _run(plain, x), rtol=0, atol=1e-6)


def test_the_plan_and_its_diagram_show_the_joint_stage():
    model = _block(residual=True)
    plan = model.plan(torch.randn(4, 16, requires_grad=True))
    assert "both     RecomputeNormLinear" in plan.explain()
    dot = plan.to_dot()
    assert dot.count("RecomputeNormLinear (joint: both passes)") == 2


def test_recompute_output_is_checked_and_shown():
    with pytest.raises(TypeError, match="recompute_output must be a bool"):
        ops.RMSNorm(16, recompute_output=1)
    norm = ops.LayerNorm(16, recompute_output=True)
    assert "recompute_output=True" in norm.describe() and "recompute_output=True" in repr(norm)


def test_compiled_bits_and_one_custom_op_per_pass():
    model = _block("layer", bias=True)
    x = torch.randn(2, 3, 16, requires_grad=True)
    fusible.testing.check_compiled_matches_eager(model, x)
    report = fusible.compile_report(model, x)
    fwd = [c.op for g in report.forward_graphs for c in g.fusible_ops]
    bwd = [c.op for g in report.backward_graphs for c in g.fusible_ops]
    assert fwd == ["fusible::RecomputeNormLinear_fwd"]
    assert bwd == ["fusible::RecomputeNormLinear_bwd"]


@attrs.define
class _Args:
    input: torch.Tensor


@attrs.define
class _Kept:
    input: torch.Tensor


class _DoubleTwice(FusedOperation):
    """A joint fusion over two ConstantScale(2) ops for the registry and record checks."""

    direction = "both"
    pattern = Pattern(Op(ops.ConstantScale, name="a"), Op(ops.ConstantScale, name="b"))
    fwd_args_type = bwd_args_type = _Args
    saved_type = _Kept
    into_second = False

    def forward_args(self, input, params, extra_inputs, ctxs):
        return _Args(input)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input * 4, (), ())

    def save_for_backward(self, args, result, ctxs):
        ctxs[1 if self.into_second else 0].saved = _Kept(args.input)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return _Args(grad_output)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.input * 4, ())


def test_a_joint_fusion_needs_a_saved_type_and_saves_in_its_first_context(plugins):
    no_record = type("NoRecord", (_DoubleTwice,), {"saved_type": None})
    with pytest.raises(TypeError, match="joint fusion NoRecord must set saved_type"):
        plugins.fusion(no_record)
    plugins.fusion(_DoubleTwice)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.ConstantScale(2.0))
    x = torch.ones(3, requires_grad=True)
    assert stage_names(model.plan(x).backward) == ["_DoubleTwice"]
    model(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 4.0))
    _DoubleTwice.into_second = True
    try:
        with pytest.raises(TypeError, match=r"saved a _Kept; the joint fusion _DoubleTwice "
                                            r"reads no record there"):
            model(x)
    finally:
        _DoubleTwice.into_second = False


def test_a_joint_fusion_in_an_fp8_plan_hands_its_output_on_quantized(plugins):
    """Under FP8 the joint stage's output is quantized for the linear layer after it, as
    any stage's: the same bits as the plan without the joint fusion."""
    def run():
        torch.manual_seed(0)
        model = ops.Sequential(ops.ConstantScale(2.0), ops.ConstantScale(2.0),
                               ops.BasicLinear(16, 16)).to(torch.bfloat16)
        x = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
        with fusible.autocast(recipe=fusible.Float8CurrentScaling()):
            names = stage_names(model.plan(x).backward)
            y = model(x)
        y.float().square().sum().backward()
        return names, [y.detach(), x.grad, model[2].weight.grad]

    plain_names, plain = run()
    plugins.fusion(_DoubleTwice)
    names, joint = run()
    assert names == ["BasicLinear", "_DoubleTwice"] and "_DoubleTwice" not in plain_names
    for a, b in zip(joint, plain):
        assert torch.equal(a, b)


def test_fp8_compiled_same_bits_as_eager():
    model = _block("layer", bias=True).to(torch.bfloat16)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    with fusible.autocast(recipe=fusible.Float8CurrentScaling()):
        fusible.testing.check_compiled_matches_eager(model, x)
