"""Only needed gradients are computed, only needed tensors saved, and freed early."""

import weakref
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusible import ops


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _mlp():
    return ops.Sequential(ops.BasicLinear(4, 8), ops.GELU(), ops.BasicLinear(8, 4))


@pytest.mark.parametrize("input_grad,first_weight_grad,expected_backward_gemms,gelu_backward", [
    (True, True, 4, 1),     # dgrad + wgrad for both layers
    (False, True, 3, 1),    # no dgrad for the first layer
    (False, False, 1, 0),   # only the second layer's wgrad; GELU's backward is skipped
    (True, False, 3, 1),    # first layer: dgrad only
])
def test_only_needed_gradients_are_computed(input_grad, first_weight_grad,
                                            expected_backward_gemms, gelu_backward):
    model = _mlp()
    model[0].weight.requires_grad_(first_weight_grad)
    x = torch.randn(3, 4, requires_grad=input_grad)
    y = model(x)
    with CountOps() as counter:
        y.sum().backward()
    assert counter.counts["mm"] == expected_backward_gemms
    assert counter.counts["gelu_backward"] == gelu_backward
    assert (x.grad is not None) == input_grad
    assert (model[0].weight.grad is not None) == first_weight_grad


def test_no_autograd_node_when_nothing_requires_grad():
    model = _mlp().requires_grad_(False)
    y = model(torch.randn(3, 4))
    assert y.grad_fn is None and not y.requires_grad
    with torch.no_grad():
        assert model.requires_grad_(True)(torch.randn(3, 4)).grad_fn is None


def test_only_needed_tensors_are_saved():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    y = model(torch.randn(3, 4))
    ctxs = y.grad_fn.fusible[1]
    assert ctxs[0].saved is None or (ctxs[0].saved.input is None    # no input, no weight
                                     and ctxs[0].saved.weight is None)
    assert ctxs[1].saved.tensor is None                           # GELU: input needs no grad
    saved = ctxs[2].saved                                         # wgrad only: input, no weight
    assert saved.input is not None and saved.weight is None


def test_intermediates_are_freed_during_backward(monkeypatch):
    """When the first layer's backward starts (backward_args, where an FP8 recipe casts the
    weight), the GELU output saved by the second layer, the pre-activation saved by GELU and
    the gradient GELU received are already gone."""
    seen, refs = {}, {}
    real_args = ops.BasicLinear.backward_args
    real_gelu = ops.GELU.backward_compute.__func__

    def spy_args(self, grad_output, grad_extra_outputs, ctxs):
        if grad_output.shape[-1] == 8:  # the first layer
            seen["alive"] = {name: ref() is not None for name, ref in refs.items()}
        return real_args(self, grad_output, grad_extra_outputs, ctxs)

    def spy_gelu(cls, args, *, in_custom_op=False):
        refs["gelu_grad_output"] = weakref.ref(args.grad_output)
        return real_gelu(cls, args, in_custom_op=in_custom_op)

    monkeypatch.setattr(ops.BasicLinear, "backward_args", spy_args)
    monkeypatch.setattr(ops.GELU, "backward_compute", classmethod(spy_gelu))
    model = _mlp()
    x = torch.randn(3, 4, requires_grad=True)
    y = model(x)
    ctxs = y.grad_fn.fusible[1]
    refs["gelu_output"] = weakref.ref(ctxs[2].saved.input)
    refs["pre_activation"] = weakref.ref(ctxs[1].saved.tensor)
    y.sum().backward()
    assert seen["alive"] == {"gelu_output": False, "pre_activation": False,
                             "gelu_grad_output": False}
    assert x.grad is not None


def test_saved_input_is_version_checked():
    model = _mlp()
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 1.0
    y = model(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_is_a_clear_error():
    """Intermediates carry no autograd history: create_graph would drop terms silently."""
    model = ops.Sequential(ops.BasicLinear(4, 3), ops.GELU())
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"differentiable once: double backward "
                                           r"\(create_graph=True\) is not supported"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def test_saved_views_are_version_checked():
    model = ops.Sequential(ops.Reshape((-1, 4)), ops.BasicLinear(4, 3))
    x = torch.randn(2, 2, 4, requires_grad=True)
    h = x * 1.0
    y = model(h)
    h.add_(100.0)  # modifies the Reshape view that BasicLinear saved
    with pytest.raises(RuntimeError, match=r"saved for the backward of BasicLinear\(in_features=4"
                                           r".*modified by an inplace operation"):
        y.sum().backward()


def test_modified_extra_output_is_detected():
    model = ops.Sequential(ops.BasicLinear(4, 4), ops.MakeExtraOutput(), ops.Reshape((-1, 2)),
                           ops.Reshape((-1, 4)), ops.BasicLinear(4, 3))
    y, branch = model(torch.randn(2, 4))
    branch.add_(5.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_saved_view_of_an_output_does_not_keep_the_graph_alive():
    import gc
    model = ops.Sequential(ops.BasicLinear(4, 4), ops.MakeExtraOutput(), ops.Reshape((-1, 8)),
                           ops.BasicLinear(8, 2))
    gc.disable()
    try:
        y, branch = model(torch.randn(4, 4))
        ref = weakref.ref(y.grad_fn.fusible[1][3].saved.input)  # the view BasicLinear saved
        del y, branch
        assert ref() is None
    finally:
        gc.enable()


def test_branch_of_an_input_without_grad_is_not_differentiable():
    model = ops.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(4, 3))
    y, branch = model(torch.randn(2, 4))
    assert y.requires_grad and not branch.requires_grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_residual_alone_requiring_grad_gets_it_through_the_ops_after_it(compiled):
    """Frozen weights, an input without grad: only the residual added in the middle needs
    a gradient, which the ops after the add must still send back."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(8, 8), ops.AddExtraInput(), ops.Linear(8, 16),
                           ops.GELU(), ops.Linear(16, 8)).double().requires_grad_(False)
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    x = torch.randn(4, 8, dtype=torch.float64)
    r = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    run(x, r).sum().backward()
    r2 = r.detach().clone().requires_grad_()
    h = torch.nn.functional.linear(x, model[0].weight, model[0].bias) + r2
    h = torch.nn.functional.gelu(torch.nn.functional.linear(h, model[2].weight, model[2].bias))
    torch.nn.functional.linear(h, model[4].weight, model[4].bias).sum().backward()
    torch.testing.assert_close(r.grad, r2.grad, rtol=1e-12, atol=1e-12)
