"""The split backward (fusible.split_backward): the dgrad lane and the deferred wgrad lane.

Every split run is compared bit for bit with the unsplit backward of the same model:
high precision and FP8, eager and compiled, the wgrads run in any order. The plan shows
the lanes; a wgrad never run is an error at the next forward or optimizer step.
"""

import threading

import pytest
import torch

import fusible
from fusible import ops
from fusible.runtime import deferred
from fusible.runtime.wgrad import _Runner
from fusible.testing import exact_tensor

H = 32


def llama(dtype):
    """RMSNorm, SwiGLU FFN, a biased projection and a scaled one: BasicLinear,
    BackwardLinearBias and BackwardLinearScale split; RMSNorm and SwiGLU do not."""
    torch.manual_seed(0)
    return ops.Sequential(ops.RMSNorm(H), ops.BasicLinear(H, 4 * H), ops.SwiGLU(),
                          ops.BasicLinear(2 * H, H), ops.Bias(H), ops.BasicLinear(H, H),
                          ops.ConstantScale(0.5)).to(dtype)


def residual(dtype):
    """A branch whose dgrad accumulates into the branch's gradient (BackwardLinearAdd)."""
    torch.manual_seed(0)
    return ops.Sequential(ops.BasicLinear(H, H), ops.MakeExtraOutput(),
                          ops.BasicLinear(H, H), ops.GELU()).to(dtype)


MODELS = {"llama": llama, "residual": residual}


def inputs(dtype, grad=True):
    g = torch.Generator().manual_seed(1)
    x = exact_tensor((2, 16, H), dtype, generator=g).requires_grad_(grad)
    dy = exact_tensor((2, 16, H), dtype, generator=g)
    return x, dy


def run(make, dtype, split, *, fp8=False, backend=None, order=None, steps=1, grad=True):
    """Input and parameter gradients after ``steps`` backward passes."""
    model = make(dtype)
    f = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    x, dy = inputs(dtype, grad)
    for _ in range(steps):
        with fusible.autocast(enabled=fp8), fusible.split_backward(split):
            out = f(x)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [dy] * len(outs))
        if split:
            runners = [fusible.take_deferred_wgrad()]
            if order == "one by one":  # each stage's wgrad alone, last queued first
                runners = [_single(e) for e in runners[0].entries[::-1]]
            for r in runners:
                r()
    assert fusible.pending_wgrad() == []
    return [x.grad] + [p.grad for p in model.parameters()]


def _single(entry):
    return _Runner([entry])


def assert_same(a, b):
    assert len(a) == len(b)
    for k, (p, q) in enumerate(zip(a, b)):
        assert (p is None) == (q is None), k
        if p is not None:
            assert torch.equal(p, q), (k, (p.float() - q.float()).abs().max())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype,fp8", [(torch.float64, False), (torch.bfloat16, False),
                                       (torch.bfloat16, True)])
def test_split_equals_unsplit(name, dtype, fp8):
    make = MODELS[name]
    want = run(make, dtype, False, fp8=fp8)
    assert_same(run(make, dtype, True, fp8=fp8), want)
    assert_same(run(make, dtype, True, fp8=fp8, order="one by one"), want)


@pytest.mark.parametrize("fp8", [False, True])
def test_split_accumulates_over_steps(fp8):
    """Microbatches: deferred gradients add into param.grad as autograd's do."""
    want = run(llama, torch.bfloat16, False, fp8=fp8, steps=3)
    assert_same(run(llama, torch.bfloat16, True, fp8=fp8, steps=3), want)


@pytest.mark.parametrize("backend,fp8", [("aot_eager", False), ("aot_eager", True),
                                         ("inductor", True)])
def test_split_compiled_equals_eager(backend, fp8, fresh_dynamo):
    want = run(llama, torch.bfloat16, False, fp8=fp8)
    assert_same(run(llama, torch.bfloat16, True, fp8=fp8, backend=backend), want)
    assert_same(run(residual, torch.bfloat16, True, fp8=fp8, backend=backend),
                run(residual, torch.bfloat16, False, fp8=fp8))


def test_compiled_dgrad_kept_without_dx(fresh_dynamo):
    """The first layer's dgrad op computes nothing anyone reads (the input needs no
    gradient), yet queues its wgrad: the graph keeps it."""
    want = run(llama, torch.bfloat16, False, grad=False)
    got = run(llama, torch.bfloat16, True, grad=False, backend="aot_eager")
    assert_same(got, want)


def test_compiled_split_runs_the_lanes_custom_ops(fresh_dynamo):
    """Compiled, the dgrad and the wgrad stages are custom ops of their own, and the
    deferred records come from the dgrad ops."""
    model = llama(torch.bfloat16)
    f = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, dy = inputs(torch.bfloat16)
    seen = []
    from fusible.runtime import custom_ops
    custom_ops.recorder = seen
    try:
        with fusible.split_backward():
            y = f(x)
        y.backward(dy)
        queued = [entry[2] for entry in deferred.queue()]  # compiled or not
        # in high precision the bias's gradient waits with its weight's (BackwardLinearBias)
        assert [p.grad is None for p in model.parameters()] == [False, True, True, True, True]
        fusible.run_deferred_wgrad()
    finally:
        custom_ops.recorder = None
    assert queued == [True, True, True]
    names = [op._schema.name.removeprefix("fusible::") for op, _ in seen]
    split = ("BackwardLinearScale", "BackwardLinearBias", "BasicLinear")
    assert [n for n in names if n.endswith("_dgrad")] == [f"{n}_dgrad" for n in split]
    assert names[-3:] == [f"{n}_wgrad" for n in split]  # eagerly, after the backward
    assert not any(n.endswith("_bwd") and n.startswith(split) for n in names), names
    assert all(p.grad is not None for p in model.parameters())


def test_bias_gradient_lane_follows_the_precision():
    """BackwardLinearBias defers dbias in high precision (the wgrad lane keeps dy) and
    computes it with the dgrad under FP8 (the wgrad lane keeps only dy's E5M2 copy)."""
    for fp8, bias_waits in ((False, True), (True, False)):
        model = llama(torch.bfloat16)
        x, dy = inputs(torch.bfloat16)
        with fusible.split_backward(), fusible.autocast(enabled=fp8):
            y = model(x)
        y.backward(dy)
        assert (model[4].bias.grad is None) == bias_waits, fp8
        fusible.run_deferred_wgrad()


def test_a_frozen_weight_queues_no_wgrad():
    """Under FP8 BackwardLinearBias computes dbias with its dgrad: with the weight frozen
    the stage defers nothing, and nothing waits for a gradient nobody needs."""
    model = ops.Sequential(ops.BasicLinear(H, H), ops.Bias(H))
    model[0].weight.requires_grad_(False)
    x, dy = inputs(torch.float32)
    with fusible.split_backward(), fusible.autocast():
        assert model.plan(x).wgrad == ()
        model(x).backward(dy)
    assert fusible.pending_wgrad() == []
    assert model[0].weight.grad is None and model[1].bias.grad is not None


def test_plan_shows_two_lanes():
    model = llama(torch.bfloat16)
    x, _ = inputs(torch.bfloat16)
    with fusible.split_backward(), fusible.autocast():
        plan = model.plan(x)
    assert [(s.name, s.indices) for s in plan.wgrad] == [
        ("BackwardLinearScale", (5, 6)), ("BackwardLinearBias", (3, 4)),
        ("BasicLinear", (1,))]
    assert all(s.direction == "wgrad" for s in plan.wgrad)
    assert [(s.name, s.indices) for s, _ in plan.wgrad_kept] == [("RMSNorm", (0,))]
    text = plan.explain()
    assert "backward: dgrad lane (5 stages" in text
    assert "wgrad lane (3 stages, deferred" in text
    assert "RMSNorm: wgrad with its dgrad: RMSNorm defines no dgrad_compute" in text
    dot = plan.to_dot()
    assert "cluster_wgrad" in dot and "wgrad lane (3 stages" in dot
    assert "w1 [label=" in dot and "b1 -> w1 [style=dashed" in dot
    assert model.plan(x).wgrad == ()  # outside the block: one lane
    assert "dgrad lane" not in model.plan(x).explain()


def test_blocks_nest_and_each_restores_the_outer_state():
    """Leaving an inner block restores what the outer one set, in both directions."""
    model = llama(torch.bfloat16)
    x, _ = inputs(torch.bfloat16)
    with fusible.split_backward():
        with fusible.split_backward(False):
            assert model.plan(x).wgrad == ()
        assert len(model.plan(x).wgrad) == 3
        with fusible.split_backward():
            pass
        assert len(model.plan(x).wgrad) == 3
    with fusible.split_backward(False):
        with fusible.split_backward():
            assert len(model.plan(x).wgrad) == 3
        assert model.plan(x).wgrad == ()


def test_delayed_scaling_keeps_wgrad_with_dgrad():
    model = llama(torch.bfloat16)
    x, _ = inputs(torch.bfloat16)
    with fusible.split_backward(), fusible.autocast(recipe=fusible.DelayedScaling()):
        plan = model.plan(x)
    assert plan.wgrad == ()
    assert all("amax history" in why for _, why in plan.wgrad_kept)


def test_forward_with_pending_wgrad_is_an_error():
    model = llama(torch.float64)
    x, dy = inputs(torch.float64)
    with fusible.split_backward():
        model(x).backward(dy)
        model(x)  # inside the block: a schedule's next forward, allowed
    with pytest.raises(RuntimeError, match=r"outside fusible.split_backward\(\) while 3 "
                                           r"deferred weight gradient"):
        model(x)
    fusible.run_deferred_wgrad()
    model(x)


def test_optimizer_step_with_pending_wgrad_is_an_error():
    model = llama(torch.float64)
    other = torch.nn.Parameter(torch.zeros(3))
    x, dy = inputs(torch.float64)
    with fusible.split_backward():
        model(x).backward(dy)
    runner = fusible.take_deferred_wgrad()  # taken, not yet run: still pending
    unrelated = torch.optim.SGD([other], lr=0.1)
    other.grad = torch.ones(3)
    unrelated.step()  # its parameters wait for nothing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): the deferred weight gradient of "
                                           r"BackwardLinearScale \[5, 6\]"):
        opt.step()
    runner()
    opt.step()
    assert fusible.pending_wgrad() == []


def test_wgrad_into_main_grad_and_under_torch_autocast():
    """Deferred gradients go where autograd's would: main_grad, and under torch.autocast
    the float32 parameter's own gradient (cast back)."""
    def make(dtype):
        torch.manual_seed(0)
        return ops.Sequential(ops.BasicLinear(H, H, accumulate_into_main_grad=True),
                              ops.GELU(), ops.BasicLinear(H, H)).to(dtype)

    results = []
    for split in (False, True):
        model = make(torch.float32)
        model[0].weight.main_grad = torch.zeros(H, H)
        x, dy = inputs(torch.float32)
        with torch.autocast("cpu", torch.bfloat16), fusible.split_backward(split):
            y = model(x)
        y.backward(dy.bfloat16())
        fusible.run_deferred_wgrad()
        results.append([model[0].weight.main_grad, model[0].weight.grad, model[2].weight.grad,
                        x.grad])
    assert results[1][1] is None and results[0][1] is None
    assert results[1][2].dtype == torch.float32
    assert_same(results[1], results[0])


def test_wgrads_queued_on_another_thread_are_taken_here():
    """Autograd runs a CUDA backward on a worker thread of its own: what the dgrad stages
    queue there is this thread's to take."""
    want = run(llama, torch.float64, False)
    model = llama(torch.float64)
    x, dy = inputs(torch.float64)
    with fusible.split_backward():
        y = model(x)
    worker = threading.Thread(target=y.backward, args=(dy,))
    worker.start()
    worker.join()
    assert len(fusible.pending_wgrad()) == 3
    fusible.run_deferred_wgrad()
    assert_same([x.grad] + [p.grad for p in model.parameters()], want)


def test_each_thread_owns_its_deferred_wgrads():
    """The queue is per thread, like autocast's state: a thread that never split a
    backward is not refused while another's wgrads wait, nor sees or takes them; the
    thread that queued them is refused until it runs them."""
    model, other = llama(torch.float64), llama(torch.float64)
    x, dy = inputs(torch.float64)
    with fusible.split_backward():
        model(x).backward(dy)
    assert len(fusible.pending_wgrad()) == 3
    seen = {}

    def elsewhere():
        other(x).backward(dy)  # not refused: nothing of this thread waits
        seen["pending"] = fusible.pending_wgrad()
        fusible.run_deferred_wgrad()  # runs none of the other thread's
        seen["grads"] = [p.grad is not None for p in other.parameters()]

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert seen == {"pending": [], "grads": [True] * 5}
    assert len(fusible.pending_wgrad()) == 3  # still this thread's
    with pytest.raises(RuntimeError, match="a forward ran outside fusible.split_backward"):
        model(x)
    fusible.run_deferred_wgrad()
    assert fusible.pending_wgrad() == [] and model(x) is not None


def test_one_compiled_model_switches_lanes(fresh_dynamo):
    """The split is a plan condition: a compiled model guards on it, and runs whichever
    backward the block asks for, call after call."""
    model = llama(torch.bfloat16)
    f = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, dy = inputs(torch.bfloat16)
    for split in (False, True, False, True):
        with fusible.split_backward(split):
            y = f(x)
        y.backward(dy)
        assert (model[1].weight.grad is None) == split
        assert len(fusible.pending_wgrad()) == (3 if split else 0)
        fusible.run_deferred_wgrad()
        model.zero_grad(set_to_none=True)
