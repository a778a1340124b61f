"""fusible behaves like torch.nn where PyTorch users go (issue 11): one regression test (or
more) per point."""

import collections
import re
import threading

import attrs
import pytest
import torch

import fusible
from fusible import ops
from fusible.testing import check_fusion, stage_names
from fusible.testing.matrix import cases, expected_stages, operation_classes, single_rank_group


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_autocast_is_thread_local():
    model = ops.Sequential(ops.Linear(32, 32))
    x = torch.randn(16, 32)

    def recipe_seen():
        return model.plan(x).conditions.recipe_key, fusible.quantization.fp8_recipe()

    with fusible.autocast():
        assert recipe_seen()[1] is not None
        assert _in_thread(recipe_seen) == (None, None)  # another thread keeps its own state
        with torch.no_grad():
            fp8 = model(x)
            plain = _in_thread(lambda: model(x))
    with torch.no_grad():
        assert torch.equal(plain, model(x)) and not torch.equal(fp8, plain)
    assert recipe_seen() == (None, None)


def test_autocast_in_a_thread_recompiles_there_only(fresh_dynamo):
    model = ops.Sequential(ops.Linear(32, 32))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 32)
    with torch.no_grad():
        plain = compiled(x)

        def fp8_run():
            with fusible.autocast():
                return compiled(x)

        assert not torch.equal(_in_thread(fp8_run), plain)
        assert torch.equal(compiled(x), plain)
    assert stage_names(model.plan(x).forward) == ["ForwardLinearBias"]


def test_fp8_tiny_finite_inputs_stay_finite():
    x = torch.full((16, 32), 1e-38)
    x[0, :4] = 0.0
    q = fusible.quantize(x)
    assert torch.isfinite(q.scale_inv) and torch.isfinite(q.dequantize()).all()
    torch.testing.assert_close(q.dequantize(), x, rtol=0.07, atol=0)
    model = ops.Sequential(ops.Linear(32, 32))
    x = (torch.randn(16, 32) * 1e-37).requires_grad_()
    with fusible.autocast():
        y = model(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_fp8_nan_in_one_row_makes_the_output_nan_never_finite_and_wrong():
    model = ops.Sequential(ops.Linear(32, 32))
    x = torch.randn(16, 32)
    x[3, 7] = float("nan")
    with fusible.autocast(), torch.no_grad():
        assert model(x).isnan().all()
        x[3, 7] = float("inf")
        assert model(x).isnan().all()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_zero_tokens(fp8, compiled, fresh_dynamo):
    """An MoE expert may get no tokens: empty outputs, zero gradients."""
    model = ops.Sequential(ops.LayerNorm(32), ops.Linear(32, 64), ops.GELU(),
                           ops.Linear(64, 32)).to(torch.bfloat16)
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    x = torch.randn(0, 32, dtype=torch.bfloat16, requires_grad=True)
    with fusible.autocast(enabled=fp8):
        y = run(x)
    y.sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 32)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("make,error,message", [
    (lambda: ops.BasicLinear(4.7, 4), TypeError, "BasicLinear: in_features must be an int, "
                                                 "got 4.7 (float)"),
    (lambda: ops.BasicLinear(4, True), TypeError, "BasicLinear: out_features must be an int"),
    (lambda: ops.Linear(4, 4, bias="yes"), TypeError, "Linear: bias must be a bool"),
    (lambda: ops.Linear(4, -2), ValueError, "Linear: out_features must be positive"),
    (lambda: ops.Bias(3.0), TypeError, "Bias: size must be an int, got 3.0 (float)"),
    (lambda: ops.LayerNorm("12"), TypeError, "LayerNorm: normalized_shape must be an int or a "
                                             "sequence of ints, got '12' (str)"),
    (lambda: ops.RMSNorm(8, eps=-1e-5), ValueError, "RMSNorm: eps must be at least 0.0"),
    (lambda: ops.LayerNorm(8, eps=float("nan")), ValueError, "LayerNorm: eps must be at least"),
    (lambda: ops.RMSNorm(8, eps="small"), TypeError, "RMSNorm: eps must be a real number"),
    (lambda: ops.Reshape("ab"), TypeError, "Reshape: shape must be an int or a sequence"),
    (lambda: ops.Quantize(forward=1), TypeError, "Quantize: forward must be a bool"),
    (lambda: ops.GELU("bogus"), ValueError, "GELU: approximate must be one of"),
    # a group of the wrong type, at construction rather than at the first collective
    (lambda: ops.AllReduce(process_group="x"), TypeError, "AllReduce: its group must be a "
                                                         "torch.distributed ProcessGroup or a "
                                                         "one-dimensional DeviceMesh (such "
                                                         "as mesh['tp']), got str 'x'"),
    (lambda: ops.AllGather(process_group=3), TypeError, "AllGather: its group must be"),
    (lambda: ops.Linear(8, 8, tensor_parallel_mode="column", tensor_parallel_group="tp"),
     TypeError, "its group must be a torch.distributed ProcessGroup"),
    (lambda: ops.RMSNorm(8, sequence_parallel=True, tensor_parallel_group=object()), TypeError,
     "RMSNorm(normalized_shape=(8,)): its group must be"),
])
def test_constructor_arguments_are_checked_by_type_and_value(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_attributes_set_after_construction_are_checked_too():
    gelu = ops.GELU()
    with pytest.raises(ValueError, match="GELU: approximate must be one of"):
        gelu.approximate = "bogus"
    assert gelu.approximate == "none"
    norm = ops.LayerNorm(8)
    norm.eps = 1e-3  # a valid change is taken (and re-plans)
    assert norm.eps == 1e-3 and isinstance(norm.eps, float)
    with pytest.raises(TypeError, match="LayerNorm: eps must be a real number"):
        norm.eps = None


def _parameterised_ops():
    found = []
    with single_rank_group():
        for cls in operation_classes():
            example = cls.example()
            if any(list(op.parameters()) for op in example.ops):
                found.append(cls)
    return found + [ops.Linear]


@pytest.mark.parametrize("cls", _parameterised_ops(), ids=lambda c: c.__name__)
def test_meta_init_then_reset_parameters_matches_the_constructor(cls):
    """The deferred-init recipe: meta device, to_empty, reset_parameters on every module."""
    def make():
        if cls is ops.Linear:
            return ops.Sequential(ops.Linear(24, 40))
        return ops.Sequential(*cls.example().ops)

    torch.manual_seed(3)
    eager = make()
    with torch.device("meta"):
        deferred = make()
    deferred.to_empty(device="cpu")
    torch.manual_seed(3)
    for module in deferred.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for (name, a), (_, b) in zip(eager.named_parameters(), deferred.named_parameters()):
        assert torch.equal(a, b), name


def test_meta_tensors_flow_through():
    with torch.device("meta"):
        model = ops.Sequential(ops.LayerNorm(32), ops.Linear(32, 64), ops.SwiGLU(),
                               ops.Linear(32, 32), ops.RMSNorm(32))
    x = torch.empty(4, 7, 32, device="meta", requires_grad=True)
    y = model(x)
    y.sum().backward()
    assert y.device.type == "meta" and y.shape == (4, 7, 32) and x.grad.shape == x.shape


@attrs.define
class _ModeArgs:
    input: torch.Tensor
    factor: float


class _TrainOnlyScale(ops.BasicOperation):
    """Doubles its input in training, passes it in eval: a stand-in for Dropout."""

    fwd_args_type = bwd_args_type = _ModeArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return _ModeArgs(input, 2.0 if self.training else 1.0)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ops.ForwardResult(args.input * args.factor)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return _ModeArgs(grad_output, 2.0 if self.training else 1.0)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return ops.BackwardResult(args.input * args.factor)


def test_compiled_models_honour_train_and_eval(fresh_dynamo):
    model = ops.Sequential(ops.Linear(8, 8), _TrainOnlyScale())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 8)
    with torch.no_grad():
        for step in range(4):
            model.train(step % 2 == 0)
            assert torch.equal(compiled(x), model(x)), step
        model.train()
        model[1].eval()  # one op alone
        assert torch.equal(compiled(x), model(x))
        assert torch.equal(compiled(x), model[0](x))


def _mlp():
    torch.manual_seed(0)
    return ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16), ops.GELU(), ops.Linear(16, 8))


def test_forward_hooks_on_an_op_run_with_its_tensors_and_stop_fusion():
    model = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    seen = []
    handle = model[0].register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    plan = model.plan(x)
    assert stage_names(plan.forward)[:2] == ["BasicLinear", "Bias"]  # no ForwardLinearBias
    assert "(hooks: own call)" in plan.explain()
    y = model(x)
    (inp, out), = seen
    assert inp is x and torch.equal(out, x @ model[0].weight.t())
    handle.remove()
    assert stage_names(model.plan(x).forward)[0] == "ForwardLinearBias"  # re-planned
    assert torch.equal(model(x), y)


def test_hook_return_values_and_pre_hooks_take_effect_like_nn_sequential():
    model = _mlp()
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    ref.load_state_dict({"0.weight": model[0].weight, "0.bias": model[1].bias,
                         "2.weight": model[3].weight, "2.bias": model[3].bias})
    model[2].register_forward_hook(lambda m, args, out: out * 0.5)
    ref[1].register_forward_hook(lambda m, args, out: out * 0.5)
    model[0].register_forward_pre_hook(lambda m, args: (args[0] + 1.0,))
    ref[0].register_forward_pre_hook(lambda m, args: (args[0] + 1.0,))
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), ref(x))


def test_backward_hooks_see_the_op_gradients():
    model = _mlp()
    grads = []
    model[2].register_full_backward_hook(lambda m, gin, gout: grads.append((gin[0], gout[0])))
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    (gin, gout), = grads
    h = x @ model[0].weight.t() + model[1].bias
    expected = torch.autograd.grad(torch.nn.functional.gelu(h), h, gout)[0]
    torch.testing.assert_close(gin, expected)


def test_a_backward_pre_hook_alone_runs_and_sees_the_op_output_gradient():
    model = _mlp()
    seen = []
    model[2].register_full_backward_pre_hook(lambda m, gout: seen.append(gout[0]))
    x = torch.randn(4, 8, requires_grad=True)
    y = model(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    (gout,) = seen
    torch.testing.assert_close(gout, dy @ model[3].weight)


def test_hooks_on_a_nested_sequential_and_global_hooks_run():
    inner = ops.Sequential(ops.Linear(8, 8), ops.ReLU())
    model = ops.Sequential(inner, ops.Linear(8, 4))
    calls = []
    inner.register_forward_hook(lambda m, a, o: calls.append("inner"))
    x = torch.randn(2, 8)
    model(x)
    assert calls == ["inner"]
    names = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: names.append(type(m).__name__))
    try:
        model(x)
    finally:
        handle.remove()
    # the global hook sees every module call as torch.nn would make them: the model, the
    # nested Sequential, each Linear (a module of the model, not only its BasicLinear and
    # Bias), each op, once each
    assert collections.Counter(names) == {"Sequential": 2, "Linear": 2, "BasicLinear": 2,
                                          "Bias": 2, "ReLU": 1}
    names.clear()
    model(x)  # removed: nothing sees the calls, and the pipeline is fused again
    assert names == [] and "ForwardLinearBias" in stage_names(model.plan(x).forward)


def test_hooks_under_torch_compile(fresh_dynamo):
    model = _mlp()
    shapes = []
    model[2].register_forward_hook(lambda m, a, o: shapes.append(tuple(o.shape)))
    x = torch.randn(4, 8, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert torch.equal(y, model(x)) and shapes[0] == (4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_check_fusion_defaults_pass_for_every_builtin_on_random_values(dtype):
    """Plugin authors can trust check_fusion: every built-in op and fusion passes at the
    default tolerances on random (not exactly representable) values."""
    failures = []
    for case in cases():
        for seed in range(2):
            with single_rank_group():
                torch.manual_seed(seed)
                example = case.cls.example()
                model = ops.Sequential(*example.ops).to(dtype)
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(torch.randn_like(p))
                inputs = [torch.randn(s).to(dtype).requires_grad_()
                          for s in (example.input_shape, *example.extra_input_shapes)]
                inputs += list(example.extra_input_values)
                try:
                    check_fusion(model, *inputs, **expected_stages(case), compiled=False)
                except AssertionError as error:
                    failures.append(f"{case.name} seed {seed}: {error}")
    assert not failures, "\n".join(failures)


@attrs.define
class _ScaleBiasArgs:
    input: torch.Tensor
    bias: torch.Tensor
    scale: float


class _SlightlyWrongScaleBias(fusible.FusedOperation):
    """ConstantScale + Bias with the scale 3% off: what check_fusion must catch."""

    direction = "forward"
    pattern = fusible.Pattern(fusible.Op(ops.ConstantScale, name="scale"),
                              fusible.Op(ops.Bias))
    fwd_args_type = _ScaleBiasArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return _ScaleBiasArgs(input, params[0], self.match["scale"].scale)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ops.ForwardResult(torch.add(args.bias, args.input, alpha=args.scale * 1.03))

    def save_for_backward(self, args, result, ctxs):
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_check_fusion_catches_a_wrong_fusion(dtype, plugins):
    plugins.fusion(_SlightlyWrongScaleBias)
    model = ops.Sequential(ops.BasicLinear(16, 16), ops.ConstantScale(0.5), ops.Bias(16))
    model = model.to(dtype)
    x = torch.randn(8, 16).to(dtype).requires_grad_()
    with pytest.raises(AssertionError, match="output 0"):
        check_fusion(model, x, forward=["_SlightlyWrongScaleBias"], compiled=False)


def test_converter_refuses_settings_that_change_results():
    model = ops.Sequential(ops.Linear(8, 16), ops.GELU(), ops.Linear(16, 8), ops.RMSNorm(8))
    good = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                               torch.nn.RMSNorm(8, eps=1e-5))
    model.load_state_dict(fusible.state_dict_from_torch(model, good))
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), good(x))
    for bad, message in (
            (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate="tanh"),
                                 torch.nn.Linear(16, 8), torch.nn.RMSNorm(8, eps=1e-5)),
             r"GELU with \('tanh',\) expected, it has \('none',\)"),
            (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                                 torch.nn.RMSNorm(8)), "eps=None"),
            (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                                 torch.nn.RMSNorm(8, eps=1e-6)), r"\(\(8,\), 1e-06\) expected"),
            (torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8), torch.nn.RMSNorm(8, eps=1e-5)),
             "does not pair with Bias"),
            (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8), torch.nn.RMSNorm(8, eps=1e-5)),
             "Dropout.*no fusible counterpart")):
        with pytest.raises(ValueError, match=message):
            fusible.state_dict_from_torch(model, bad)
    ln = ops.Sequential(ops.LayerNorm(8))
    with pytest.raises(ValueError, match="LayerNorm.*has a weight and a bias"):
        fusible.state_dict_from_torch(ln, torch.nn.Sequential(torch.nn.LayerNorm(8, bias=False)))


class _OutOfOrder(torch.nn.Module):
    """Registers its layers in another order than it runs them (same shapes)."""

    def __init__(self):
        super().__init__()
        self.second = torch.nn.Linear(8, 8)
        self.first = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_converter_pairs_layers_in_the_order_they_run():
    torch.manual_seed(0)
    src = _OutOfOrder()
    model = ops.Sequential(ops.Linear(8, 8), ops.ReLU(), ops.Linear(8, 8))
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="not an nn.Sequential.*pass example_input"):
        fusible.state_dict_from_torch(model, src)
    model.load_state_dict(fusible.state_dict_from_torch(model, src, example_input=x))
    torch.testing.assert_close(model(x), src(x))


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.layer(self.layer(x))


def test_converter_refuses_ambiguous_pairings():
    model = ops.Sequential(ops.Linear(8, 8), ops.Linear(8, 8))
    with pytest.raises(ValueError, match="ambiguous.*run more than once"):
        fusible.state_dict_from_torch(model, _Twice(), example_input=torch.randn(2, 8))


def _block():
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(32), ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32))
    ref = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 32))
    ref.load_state_dict(model.state_dict())
    return model, ref


def _amp_step(run, model, x):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(x)
    y.float().square().sum().backward()
    return y, [x.grad] + [p.grad for p in model.parameters()]


def test_torch_autocast_with_float32_parameters_like_nn_linear(fresh_dynamo):
    model, ref = _block()
    x = torch.randn(16, 32, requires_grad=True)
    y, grads = _amp_step(model, model, x)
    y_ref, grads_ref = _amp_step(ref, ref, x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads)  # on the float32 parameters
    for got, want in zip([y] + grads, [y_ref] + grads_ref):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y2, grads2 = _amp_step(compiled, model, x)
    assert torch.equal(y2, y) and all(torch.equal(a, b) for a, b in zip(grads2, grads))


def test_fp8_under_torch_autocast_quantizes_the_float32_weights_directly(monkeypatch):
    import fusible.functional.linear as linear
    seen = []
    real = linear.cast_tensorwise  # what the weights' casts call (forward and dgrad)
    monkeypatch.setattr(linear, "cast_tensorwise",
                        lambda t, *a, **k: seen.append(t.dtype) or real(t, *a, **k))
    model, _ = _block()
    x = torch.randn(16, 32, requires_grad=True)
    with fusible.autocast():
        y, grads = _amp_step(model, model, x)
    assert seen == [torch.float32] * 4  # the two weights as they are, forward and for dgrad
    assert y.dtype == torch.bfloat16 and all(torch.isfinite(g).all() for g in grads)


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return (w + w.t()) / 2


@pytest.mark.parametrize("make", [lambda: ops.BasicLinear(8, 8), lambda: ops.Linear(8, 8)],
                         ids=["BasicLinear", "Linear"])
def test_parametrizations_and_pruning_work(make):
    import torch.nn.utils.parametrize as parametrize
    import torch.nn.utils.prune as prune
    x = torch.randn(4, 8)

    def check(model, original):
        layer = model[0]
        bias = getattr(layer, "bias", None)
        y = model(x)
        torch.testing.assert_close(y, torch.relu(x @ layer.weight.t() + (0 if bias is None
                                                                          else bias)))
        y.sum().backward()
        assert original().grad is not None and original().grad.abs().sum() > 0

    model = ops.Sequential(make(), ops.ReLU())
    parametrize.register_parametrization(model[0], "weight", _Symmetric())
    check(model, lambda: model[0].parametrizations.weight.original)
    model = ops.Sequential(make(), ops.ReLU())
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    check(model, lambda: model[0].weight_orig)
    assert (model[0].weight == 0).sum() == 32
    prune.remove(model[0], "weight")
    assert model(x).shape == (4, 8)


def test_fsdp2_per_op_works(fresh_dynamo):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with single_rank_group():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = ops.Sequential(ops.Linear(8, 16), ops.GELU(), ops.Linear(16, 8))
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        ref.load_state_dict(model.state_dict())
        fully_shard(model[0], mesh=mesh)  # per op: its hooks gather its parameters
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(4, 8)
        y = model(x)
        y.sum().backward()
        ref(x).sum().backward()
        torch.testing.assert_close(y, ref(x))
        torch.testing.assert_close(model[0].weight.grad.full_tensor(), ref[0].weight.grad)


@pytest.mark.parametrize("run,message", [
    (lambda m, x: torch.func.grad(lambda t: m(t).sum())(x), "cannot run under torch.func"),
    (lambda m, x: torch.func.vmap(m)(x[:, None]), "cannot run under torch.func"),
    (lambda m, x: torch.jit.trace(m, x), "torch.jit.trace cannot record"),
], ids=["grad", "vmap", "jit.trace"])
def test_transforms_get_a_clear_error(run, message):
    model = ops.Sequential(ops.Linear(4, 4), ops.GELU())
    with pytest.raises(RuntimeError, match=f"fusible: .*{message}"):
        run(model, torch.randn(2, 4))


def test_forward_mode_ad_gets_a_clear_error():
    import torch.autograd.forward_ad as fw
    model = ops.Sequential(ops.Linear(4, 4), ops.GELU())
    x = torch.randn(2, 4)
    with fw.dual_level():
        with pytest.raises(RuntimeError, match="fusible: .* has no forward-mode AD"):
            model(fw.make_dual(x, torch.ones_like(x)))
        assert model(x).shape == (2, 4)  # no dual tensor: fine


LIFETIME_MODELS = {
    "lone basic op": lambda: ops.BasicLinear(8, 8),
    "lone composite op": lambda: ops.Linear(8, 8),
    "sequential": lambda: ops.Sequential(ops.Linear(8, 8), ops.GELU()),
}


@pytest.fixture
def no_cyclic_gc():
    import gc
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("make", LIFETIME_MODELS.values(), ids=LIFETIME_MODELS.keys())
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "step"])
def test_a_dropped_model_is_freed_without_the_cyclic_gc(make, compiled, backward, no_cyclic_gc,
                                                          fresh_dynamo):
    """Like torch.nn: reference counting alone frees a model, its plan and its parameters
    (no reference cycle through the plan, the autograd node or dynamo's trace)."""
    import weakref
    model = make()
    weight = weakref.ref(next(model.parameters()))
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    y = run(torch.randn(4, 8, requires_grad=True))
    if backward:
        y.sum().backward()
    del model, run, y
    assert weight() is None


@pytest.mark.parametrize("make", LIFETIME_MODELS.values(), ids=LIFETIME_MODELS.keys())
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_backward_runs_after_the_model_is_dropped(make, compiled, fresh_dynamo):
    import copy
    model = make()
    twin = copy.deepcopy(model)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    x = torch.randn(4, 8, requires_grad=True)
    y = run(x)
    weights = list(model.parameters())
    del model, run
    y.sum().backward()
    twin(x.detach()).sum().backward()
    for weight, expected in zip(weights, twin.parameters(), strict=True):
        torch.testing.assert_close(weight.grad, expected.grad, rtol=0, atol=0)


def test_pipeline_of_a_lone_op_is_the_op_itself():
    op = ops.BasicLinear(4, 4)
    assert op.pipeline()[0] is op


def _fp8_grads(model, x, run, backward_inside: bool) -> list:
    for p in model.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with fusible.autocast():
        y = run(x)
        if backward_inside:
            y.square().sum().backward()
    if not backward_inside:  # where users often run it (outside the FP8 block)
        y.square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-outside",
                                                                "backward-inside"])
@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "compiled-checkpoint"])
def test_fp8_under_activation_checkpointing_recomputes_under_the_forward_recipe(
        how, backward_inside, fresh_dynamo):
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32))
    x = torch.randn(16, 32)
    expected = _fp8_grads(model, x, model, backward_inside)
    if how == "compiled-checkpoint":  # dynamo traces the checkpoint region itself
        run = torch.compile(lambda t: checkpoint(model, t, use_reentrant=False),
                            backend="aot_eager", fullgraph=True)
    else:
        def run(t):
            return checkpoint(model, t, use_reentrant=how == "reentrant")
    for got, want in zip(_fp8_grads(model, x, run, backward_inside), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_compiled_model_inside_an_eager_checkpoint_never_recomputes_silently_otherwise(
        reentrant, fresh_dynamo):
    """Its compiled code is picked by the recipe at backward time: the same recipe gives
    bitwise the run without checkpointing, another one a clear error."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 32)
    expected = _fp8_grads(model, x, model, backward_inside=True)

    def run(t):
        return checkpoint(compiled, t, use_reentrant=reentrant)
    for got, want in zip(_fp8_grads(model, x, run, backward_inside=True), expected, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="recomputes the compiled ForwardLinearBias stage "
                                           "without FP8, but its forward ran with it"):
        _fp8_grads(model, x, run, backward_inside=False)
    # the other way round: a forward without FP8 (which leaves no record) recomputed with it
    xx = x.clone().requires_grad_()
    y = run(xx)
    with fusible.autocast(), pytest.raises(RuntimeError, match="recomputes the compiled "
                                           "ForwardLinearBias stage with FP8, but its forward "
                                           "ran without it"):
        y.square().sum().backward()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_linear_bias_can_be_removed_and_added_like_nn_linear(compiled, fresh_dynamo):
    x = torch.randn(4, 8)
    model = ops.Sequential(ops.Linear(8, 6), ops.GELU())
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    run(x)
    linear = model[0]
    linear.bias = None
    torch.testing.assert_close(run(x), torch.nn.functional.gelu(x @ linear.weight.t()))
    assert "bias" not in model.state_dict().keys() - {"0.weight"}
    linear.bias = torch.nn.Parameter(torch.ones(6))
    torch.testing.assert_close(run(x), torch.nn.functional.gelu(x @ linear.weight.t() + 1))
    assert stage_names(model.plan(x).forward)[0] == "ForwardLinearBias"
    unbiased = ops.Linear(8, 6, bias=False)
    unbiased.bias = torch.nn.Parameter(torch.ones(6))
    torch.testing.assert_close(unbiased(x), x @ unbiased.weight.t() + 1)


def test_parameters_replaced_by_a_wrong_shape_or_none_get_a_clear_error():
    x = torch.randn(4, 8)
    linear = ops.Linear(8, 6)
    linear.bias = torch.nn.Parameter(torch.ones(5))
    with pytest.raises(ValueError, match=r"Bias\(size=6\) has bias of shape \(5,\); "
                                         r"expected \(6,\)"):
        linear(x)
    basic = ops.BasicLinear(8, 6)
    basic.weight = torch.nn.Parameter(torch.ones(6, 7))
    with pytest.raises(ValueError, match=r"has weight of shape \(6, 7\); expected \(6, 8\)"):
        basic(x)
    norm = ops.LayerNorm(8)
    norm.bias = None
    with pytest.raises(TypeError, match=r"LayerNorm\(normalized_shape=\(8,\)\) has no bias"):
        norm(x)


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_norms_over_several_dimensions_match_torch_nn(name):
    """A normalized_shape of two dimensions: output and every gradient as torch.nn's, in
    float64 (statistics over both dimensions, not the last one alone)."""
    torch.manual_seed(0)
    shape = (3, 8)
    ours, theirs = getattr(ops, name)(shape, dtype=torch.float64), \
        getattr(torch.nn, name)(shape, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    x = torch.randn(5, *shape, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ops.Sequential(ours)(x), theirs(x2)
    grad = torch.randn_like(y)
    y.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-10)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=n)


def test_torch_autocast_casts_extra_inputs_too(fresh_dynamo):
    """Under torch.autocast a residual given in float32 joins the computation in the
    autocast dtype, as the input does, and its gradient comes back in float32."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(32, 32), ops.AddExtraInput())
    x = torch.randn(16, 32, requires_grad=True)
    r = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, r)
        plan = model.plan(x, r)
    assert y.dtype == torch.bfloat16 and plan.forward[-1].name == "ForwardLinearBiasAdd"
    y.float().square().sum().backward()
    assert r.grad.dtype == torch.float32
    w, b = (p.detach().bfloat16().double() for p in (model[0].weight, model[0].bias))
    want = x.detach().bfloat16().double() @ w.t() + b + r.detach().bfloat16().double()
    torch.testing.assert_close(y.double(), want, rtol=0.01, atol=0.01)
    torch.testing.assert_close(r.grad.double(), 2 * y.double(), rtol=0, atol=0)


def test_layer_norm_default_eps_is_torch_nn_s():
    """Rows of nearly constant values, where eps decides the output."""
    x = 1 + 1e-4 * torch.randn(4, 8, dtype=torch.float64)
    ours, theirs = ops.LayerNorm(8, dtype=torch.float64), torch.nn.LayerNorm(8, dtype=torch.float64)
    assert ours.eps == theirs.eps
    torch.testing.assert_close(ops.Sequential(ours)(x), theirs(x), rtol=1e-12, atol=1e-12)


def _held_by_contexts(y) -> list:
    """The tensors the fusible node's op contexts hold between the passes (inputs and
    parameters aside)."""
    plan, ctxs = y.grad_fn.fusible[:2]
    held = []
    for c in ctxs:
        if c.saved is not None:
            held += [getattr(c.saved, f.name) for f in attrs.fields(type(c.saved))]
    return [t for t in held if isinstance(t, torch.Tensor)
            and not isinstance(t, torch.nn.Parameter)]


def test_non_reentrant_checkpointing_holds_no_intermediate():
    """Under torch.utils.checkpoint(use_reentrant=False) the saved intermediates go
    through its hooks, which drop them until the recomputation: the node holds none of
    them between the passes (it held them all, as without checkpointing), and the
    gradients are the same."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 256), ops.GELU(),
                           ops.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)
    y = model(x)
    assert len(_held_by_contexts(y)) > 1  # eagerly: the contexts hold them, freed stage by stage
    y.sum().backward()
    want, x.grad = x.grad, None
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    assert all(t is x for t in _held_by_contexts(y))  # only the checkpoint's own input
    y.sum().backward()
    assert len(calls) == 2 and torch.equal(x.grad, want)  # recomputed once, same gradient
