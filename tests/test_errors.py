"""Bad input gets an error that names the op and the values."""

import pytest
import torch

import fusible
from fusible import FusedOperation, Op, Pattern, ops


def test_wrong_feature_size():
    model = ops.Sequential(ops.BasicLinear(16, 8))
    with pytest.raises(ValueError, match=r"BasicLinear\(in_features=16, out_features=8\) got "
                                         r"input with last dimension 15; expected 16"):
        model(torch.randn(2, 15))
    with pytest.raises(ValueError, match=r"Bias\(size=8\) got input with last dimension 4"):
        ops.Sequential(ops.BasicLinear(3, 4), ops.Bias(8))(torch.randn(2, 3))


def test_wrong_size_inside_a_fused_stage():
    """Validation covers every op of a fused stage, not only its first."""
    model = ops.Sequential(ops.BasicLinear(3, 4), ops.Bias(5), ops.ReLU())
    with pytest.raises(ValueError, match=r"Bias\(size=5\) got input with last dimension 4"):
        with torch.no_grad():
            model(torch.randn(2, 3))


def test_dtype_mix():
    model = ops.Sequential(ops.BasicLinear(4, 4))
    with pytest.raises(TypeError, match=r"BasicLinear\(in_features=4, out_features=4\) has "
                                        r"weight of dtype torch.float32 but got input of dtype "
                                        r"torch.bfloat16"):
        model(torch.randn(2, 4, dtype=torch.bfloat16))
    add = ops.Sequential(ops.AddExtraInput())
    with pytest.raises(TypeError, match="AddExtraInput got extra input of dtype torch.float64"):
        add(torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64))


def test_device_mismatch():
    model = ops.Sequential(ops.LayerNorm(4, device="meta"))
    with pytest.raises(ValueError, match="LayerNorm.*weight on device meta but got input on "
                                         "device cpu"):
        model(torch.randn(2, 4))


def test_wrong_number_of_extra_inputs():
    model = ops.Sequential(ops.BasicLinear(4, 4), ops.AddExtraInput())
    with pytest.raises(TypeError, match="expects 1 extra input.*got 0"):
        model(torch.randn(2, 4))
    with pytest.raises(TypeError, match="expects 1 extra input.*got 2"):
        model(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"AddExtraInput got extra input of shape \(2, 5\)"):
        model(torch.randn(2, 4), torch.randn(2, 5))


@pytest.mark.parametrize("make,message", [
    (lambda: ops.BasicLinear(0, 3), "BasicLinear: in_features must be positive, got in_features=0"),
    (lambda: ops.BasicLinear(4, 4, tensor_parallel_mode="column"),
     "BasicLinear(in_features=4, out_features=4) needs torch.distributed: call "
     "torch.distributed.init_process_group() first"),
    (lambda: ops.BasicLinear(4, 4, tensor_parallel_mode="diagonal"),
     "tensor_parallel_mode must be one of (None, 'column', 'row'), got 'diagonal'"),
    (lambda: ops.BasicLinear(4, 4, sequence_parallel=True),
     "sequence_parallel=True needs tensor_parallel_mode 'column' or 'row'"),
    (lambda: ops.AllReduce(), "AllReduce needs torch.distributed"),
    (lambda: ops.GELU(approximate="fast"),
     "GELU: approximate must be one of ('none', 'tanh'), got 'fast'"),
    (lambda: ops.Reshape((-1, -1)), "one -1"),
    (lambda: ops.ConstantScale("2"), "ConstantScale: scale must be a real number, got '2' (str)"),
    (lambda: ops.LayerNorm(0), "LayerNorm: normalized_shape must hold ints of at least 1"),
])
def test_bad_constructor_arguments(make, message):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message.replace(
            "(", r"\(").replace(")", r"\)")):
        make()


def test_bad_shapes_for_shape_ops():
    with pytest.raises(ValueError, match=r"SwiGLU\(\) needs an even last dimension, got input shape "
                                         r"\(2, 5\)"):
        ops.SwiGLU()(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"Reshape\(shape=\(3, -1\)\) cannot reshape input of "
                                         r"shape \(2, 5\)"):
        ops.Reshape((3, -1))(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"RMSNorm\(normalized_shape=\(4,\)\) got input of "
                                         r"shape \(2, 5\)"):
        ops.RMSNorm(4)(torch.randn(2, 5))


def test_non_tensor_input():
    with pytest.raises(TypeError, match="expects a tensor input, got list"):
        ops.Sequential(ops.Identity())([1.0])


def test_backward_twice_is_a_clear_error():
    model = ops.Sequential(ops.BasicLinear(4, 4), ops.GELU())
    y = model(torch.randn(2, 4)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True.*not supported"):
        y.backward()


class _NotAFusion:
    direction = "forward"


@pytest.mark.parametrize("body,message", [
    ({"direction": "sideways", "pattern": Pattern(Op(ops.Identity))}, "direction must be"),
    ({"direction": "forward", "pattern": (ops.Identity,)}, "pattern must be a fusible.Pattern"),
    ({"direction": "forward", "pattern": Pattern(Op(ops.Identity))},
     "must define fwd_args_type, forward_args, forward_compute, save_for_backward"),
    ({"direction": "backward", "pattern": Pattern(Op(ops.Identity)), "bwd_args_type": dict,
      "backward_args": lambda *a: None, "backward_compute": classmethod(lambda *a: None)},
     "args type must be an attrs class"),
])
def test_invalid_fusion_plugins(body, message, plugins):
    cls = type("BadFusion", (FusedOperation,), body)
    with pytest.raises((TypeError, ValueError), match=f"fusion BadFusion.*{message}"):
        plugins.fusion(cls)


def test_register_non_fusion_and_duplicate_name(plugins):
    with pytest.raises(TypeError, match="needs a subclass of fusible.FusedOperation"):
        plugins.fusion(_NotAFusion)
    from fusible.fusions.forward_linear_bias import ForwardLinearBias
    clone = type("ForwardLinearBias", (ForwardLinearBias,), {})
    with pytest.raises(ValueError, match="fusion name 'ForwardLinearBias' is taken"):
        plugins.fusion(clone)


@pytest.mark.parametrize("make,message", [
    (lambda: Pattern(), "at least one element"),
    (lambda: Pattern(ops.Identity), "Pattern elements must be"),
    (lambda: Pattern(Op(ops.Identity, optional=True)), "only optional elements"),
    (lambda: Op("BasicLinear"), "Op.. needs operation classes"),
    (lambda: Op(ops.Identity, where=lambda op: True), "must be a fusible.Check"),
])
def test_invalid_patterns(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


def test_non_tensor_extra_input():
    model = ops.Sequential(ops.BasicLinear(4, 4), ops.AddExtraInput())
    with pytest.raises(TypeError, match=r"expects tensor extra inputs, got \['float'\]"):
        model(torch.randn(2, 4), 3.0)


def test_wrong_number_of_extra_input_gradients_from_a_plugin(plugins):
    import attrs
    from fusible.ops import BackwardResult

    @attrs.define
    class Args:
        grad_output: torch.Tensor

    class ForgetfulAdd(FusedOperation):
        direction = "backward"
        pattern = Pattern(Op(ops.ConstantScale), Op(ops.AddExtraInput))
        bwd_args_type = Args

        def backward_args(self, grad_output, grad_extra_outputs, ctxs):
            return Args(grad_output)

        @classmethod
        def backward_compute(cls, args, *, in_custom_op=False):
            return BackwardResult(args.grad_output * 2)  # forgets the extra input's gradient

    plugins.fusion(ForgetfulAdd)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.AddExtraInput())
    y = model(torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True))
    with pytest.raises(RuntimeError, match="ForgetfulAdd returned 0 extra-input gradients"):
        y.sum().backward()


def test_failing_entry_point_plugin_is_reported(broken_plugin):
    import fusible.planning.registry as registry

    broken_plugin(registry._state, "fusible.fusions", "nowhere:Fusion")
    for _ in range(2):  # and again: nothing is skipped silently later
        with pytest.raises(RuntimeError, match="fusion plugin 'broken'.*failed to load"):
            ops.Sequential(ops.Identity()).plan()


def test_an_uninstalled_source_tree_says_so(monkeypatch):
    """The built-in fusions are entry points: without fusible's distribution the first
    planning explains, rather than planning without fusions."""
    import importlib.metadata

    import fusible.planning.registry as registry

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setitem(registry._state, "loaded", False)
    monkeypatch.setattr(registry.importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"not installed.*pip install -e \."):
        ops.Sequential(ops.Identity()).plan()


def test_make_graphed_callables_needs_cuda_tensors():
    model = ops.Sequential(ops.Linear(8, 8))
    with pytest.raises(ValueError, match=r"make_graphed_callables\(Sequential\): CUDA graphs need "
                                         r"CUDA tensor arguments, got \[\(\(4, 8\), torch.float32"):
        fusible.make_graphed_callables(model, (torch.randn(4, 8),))
    assert model.forward.__func__ is ops.Sequential.forward  # left as it was
