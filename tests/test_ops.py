"""Every basic op against plain-PyTorch FP64 references, in every dtype, inside pipelines."""

import pytest
import torch

import fusible

from fusible import Example, ops
from fusible.ops.collective import Collective
from fusible.testing import check_against_reference, exact_parameters_, exact_tensor, stage_names
from fusible.testing.matrix import operation_classes

def _single_op_examples() -> list:
    """(name, example, input feature size) from the registry: every exported op whose
    example is one op on one input (the rest run in tests/test_matrix.py), plus variants
    that an example does not show."""
    found = []
    for cls in operation_classes():
        if issubclass(cls, Collective):
            continue  # need a process group: tests/test_matrix.py, tests/test_parallel.py
        example = cls.example()
        if len(example.ops) == 1 and not example.extra_input_shapes and \
                not example.extra_input_values and not cls.num_extra_outputs:
            found.append((cls.__name__, cls.example, example.input_shape[-1]))
    return found + [("GELU", lambda: Example((ops.GELU(),), (32,)), 32)]


OPS = _single_op_examples()
LEADS = [(5,), (2, 3), (2, 1, 3)]
# every op with every leading shape its input may have (Attention's is (batch, seq))
OP_LEADS = [pytest.param(*op, lead, id=f"{op[0]}{i}-lead{len(lead)}")
            for i, op in enumerate(OPS) for lead in LEADS
            if op[1]().ops[0].input_dims in (None, len(lead) + 1)]


def _model(op, features, dtype):
    return exact_parameters_(ops.Sequential(ops.BasicLinear(6, features), ops.Identity(), op)
                             .to(dtype))


@pytest.mark.parametrize("name,example,features,lead", OP_LEADS)
def test_op_matches_fp64_reference(name, example, features, lead, dtype):
    """Each op after a BasicLinear (and an Identity, so that nothing fuses): its dgrad is
    exercised and reaches a parameter."""
    (op,) = example().ops
    model = _model(op, features, dtype)
    for p in op.parameters():  # non-zero parameters exercise their gradients
        p.data = exact_tensor(p.shape, dtype)
    x = exact_tensor((*lead, 6), dtype).requires_grad_()
    plan = model.plan(x)
    own = [] if op.left_out_of_plans() else [name]  # Dropout(p=0): planned away
    assert stage_names(plan.forward) == ["BasicLinear", "Identity", *own]
    assert stage_names(plan.backward) == [*own, "Identity", "BasicLinear"]
    assert plan.left_out == (() if own else (op,))
    check_against_reference(model, x)


def test_linear_composite_matches_reference(dtype):
    model = exact_parameters_(ops.Sequential(ops.Linear(6, 10), ops.Linear(10, 4, bias=False))
                              .to(dtype))
    x = exact_tensor((3, 6), dtype).requires_grad_()
    assert stage_names(model.plan(x).forward) == ["ForwardLinearBias", "BasicLinear"]
    check_against_reference(model, x)


def test_extra_input_and_output(dtype):
    model = exact_parameters_(ops.Sequential(
        ops.MakeExtraOutput(), ops.BasicLinear(6, 6), ops.ReLU(), ops.AddExtraInput(),
        ops.MakeExtraOutput(), ops.ConstantScale(2.0)).to(dtype))
    x = exact_tensor((2, 3, 6), dtype).requires_grad_()
    residual = exact_tensor((2, 3, 6), dtype).requires_grad_()
    y, branch1, branch2 = model(x, residual)
    assert branch1 is not None and branch2.shape == y.shape
    x.grad = None
    check_against_reference(model, x, residual)


def test_op_standalone_module_call():
    op = ops.BasicLinear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = op(x)
    torch.testing.assert_close(y, x @ op.weight.T, rtol=0, atol=0)
    y.sum().backward()
    assert op.weight.grad is not None and x.grad is not None


def test_l2_normalization_is_te_formula_and_refuses_a_scalar():
    """TransformerEngine's definition and default eps; a scale-invariant op: rescaling the
    input leaves the output (nearly) as it was."""
    op = ops.L2Normalization()
    assert op.eps == 1e-6 and "L2Normalization(eps=1e-06)" in op.describe()
    x = torch.randn(4, 7, 16, dtype=torch.float64)
    y = ops.Sequential(op)(x)
    torch.testing.assert_close(y, x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ops.Sequential(op)(1000 * x), y, rtol=1e-6, atol=1e-7)  # eps
    with pytest.raises(ValueError, match=r"L2Normalization\(eps=1e-06\) normalises the last "
                                         r"dimension; got a 0-d input"):
        ops.Sequential(op)(torch.tensor(2.0))
    with pytest.raises(ValueError, match="eps"):
        ops.L2Normalization(eps=-1.0)


NORMS = {"LayerNorm": ops.LayerNorm, "RMSNorm": ops.RMSNorm}


@pytest.mark.parametrize("name", list(NORMS))
def test_zero_centered_gamma_against_fp64(name, dtype):
    """TransformerEngine's ``zero_centered_gamma``: the weight starts at zeros and the norm
    multiplies by ``1 + weight`` (in float32); against FP64, rounded once."""
    op = NORMS[name](32, zero_centered_gamma=True)
    assert not op.weight.any() and "zero_centered_gamma=True" in op.describe()
    model = ops.Sequential(op).to(dtype)
    x = exact_tensor((3, 5, 32), dtype).requires_grad_()
    torch.testing.assert_close(model(x), ops.Sequential(NORMS[name](32)).to(dtype)(x),
                               rtol=0, atol=0)  # 1 + 0: the plain norm's bits
    exact_parameters_(model)
    check_against_reference(model, x, strict=True)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", list(NORMS))
def test_zero_centered_gamma_compiled_bitwise(name):
    from fusible.testing import check_compiled_matches_eager
    model = ops.Sequential(NORMS[name](32, zero_centered_gamma=True), ops.BasicLinear(32, 16))
    exact_parameters_(model)
    x = exact_tensor((4, 32), torch.float32).requires_grad_()
    check_compiled_matches_eager(model, x)
    plain = ops.Sequential(NORMS[name](32), ops.BasicLinear(32, 16))
    plain.load_state_dict(model.state_dict())
    model[0].zero_centered_gamma = False  # an attribute the plan reads: re-planned
    assert torch.equal(model(x), plain(x))
    model[0].reset_parameters()
    assert (model[0].weight == 1).all()


def test_gated_units_gate_the_first_half_as_transformer_engine():
    """TransformerEngine's definitions: the gate acts on the first half (F.glu gates the
    second); GEGLU's GELU is the tanh approximation; QGELU's constant is 1.702."""
    import torch.nn.functional as F
    x = torch.randn(4, 6, 16, dtype=torch.float64)
    a, b = x.chunk(2, -1)
    expected = {
        ops.GLU: F.glu(torch.cat([b, a], -1), -1),
        ops.GEGLU: F.gelu(a, approximate="tanh") * b,
        ops.QGEGLU: a * torch.sigmoid(1.702 * a) * b,
        ops.ReGLU: torch.relu(a) * b,
        ops.SReGLU: torch.relu(a) ** 2 * b,
        ops.SwiGLU: F.silu(a) * b,
    }
    for cls, want in expected.items():
        torch.testing.assert_close(ops.Sequential(cls())(x), want, msg=cls.__name__)
    torch.testing.assert_close(ops.Sequential(ops.QGELU())(x), x * torch.sigmoid(1.702 * x))
    torch.testing.assert_close(ops.Sequential(ops.SReLU())(x), torch.relu(x) ** 2)
    with pytest.raises(ValueError, match=r"ReGLU\(\) needs an even last dimension, got input "
                                         r"shape \(2, 5\)"):
        ops.Sequential(ops.ReGLU())(torch.randn(2, 5))


def test_situ_glu_values_gradient_and_bounds():
    """SiTU-GLU (Kimi K3): ``s tanh(a/s) sigmoid(a) (l tanh(b/l) + offset)``; SwiGLU's to
    first order near the origin; bounded by ``s (l + |offset|)``; the linear half uncapped
    with ``linear_scale=None``; the gradient of that formula."""
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    unit = ops.SiTUGLU(gate_scale=2.0, linear_scale=3.0, linear_offset=0.5)
    a, b = x.detach().chunk(2, -1)
    want = 2 * torch.tanh(a / 2) * torch.sigmoid(a) * (3 * torch.tanh(b / 3) + 0.5)
    y = ops.Sequential(unit)(x)
    torch.testing.assert_close(y, want)
    y.backward(torch.ones_like(y))
    t, u, sig = torch.tanh(a / 2), torch.tanh(b / 3), torch.sigmoid(a)
    dgate = (1 - t * t) * sig + 2 * t * sig * (1 - sig)
    torch.testing.assert_close(x.grad, torch.cat([dgate * (3 * u + 0.5),
                                                  2 * t * sig * (1 - u * u)], -1))
    huge = torch.full((1, 2), 1e4, dtype=torch.float64)
    assert ops.Sequential(unit)(huge).item() == pytest.approx(2 * (3 + 0.5))
    small = torch.tensor([[1e-3, 2e-3]], dtype=torch.float64)
    swiglu = ops.Sequential(ops.SwiGLU())(small).item()
    assert ops.Sequential(ops.SiTUGLU(linear_scale=None))(small).item() == pytest.approx(
        swiglu, rel=1e-6)
    assert ops.SiTUGLU().describe() == ("SiTUGLU(gate_scale=4.0, linear_scale=25.0, "
                                        "linear_offset=0.0)")
    with pytest.raises(ValueError, match="SiTUGLU: gate_scale must be positive, got "
                                         "gate_scale=0.0"):
        ops.SiTUGLU(gate_scale=0.0)
    with pytest.raises(TypeError, match="linear_scale must be a real number"):
        ops.SiTUGLU(linear_scale="big")


@pytest.mark.parametrize("cls", [ops.SiTUGLU, ops.ScaledSiTUGLU])
def test_situ_glu_takes_transformer_engines_beta_names(cls):
    """TransformerEngine's SiTUGLU(beta1=4.0, beta2=25.0): the same caps under its names."""
    te = cls(beta1=2.0, beta2=3.0)
    assert (te.gate_scale, te.linear_scale, te.beta1, te.beta2) == (2.0, 3.0, 2.0, 3.0)
    assert repr(te) == repr(cls(gate_scale=2.0, linear_scale=3.0))
    with pytest.raises(TypeError, match=f"{cls.__name__}: gate_scale and beta1 name the same "
                                        f"cap; got both \\(1.0, 2.0\\)"):
        cls(gate_scale=1.0, beta1=2.0)
    with pytest.raises(ValueError, match="linear_scale must be positive"):
        cls(beta2=-1.0)


def test_clamped_swiglu_and_interleaved_halves_as_transformer_engine():
    """ClampedSwiGLU (GPT-OSS): the gate half clamped from above, the linear half both
    ways, ``a sigmoid(alpha a) (b + offset)``, no gradient where a clamp bites (the bounds
    pass); ``glu_interleave_size`` reads the halves from alternating blocks."""
    x = torch.tensor([[-3.0, 0.5, 2.0, 1.0, -2.0, 3.0, 0.25, -1.0]], dtype=torch.float64,
                     requires_grad=True)
    unit = ops.ClampedSwiGLU(limit=1.0, alpha=2.0, glu_linear_offset=0.5)
    y = ops.Sequential(unit)(x)
    a = torch.tensor([-3.0, 0.5, 1.0, 1.0])  # 2.0 clamped to the limit
    b = torch.tensor([-1.0, 1.0, 0.25, -1.0])  # -2.0 and 3.0 clamped
    torch.testing.assert_close(y[0], (a * torch.sigmoid(2 * a) * (b + 0.5)).double())
    y.sum().backward()
    sig = torch.sigmoid(2 * a)
    dgate = (sig + 2 * a * sig * (1 - sig)) * (b + 0.5)
    want = torch.cat([dgate * torch.tensor([1.0, 1.0, 0.0, 1.0]),   # 2.0 > limit: none
                      a * sig * torch.tensor([0.0, 0.0, 1.0, 1.0])])  # -1.0 at the bound
    torch.testing.assert_close(x.grad[0], want.double())
    # GPT-OSS pairs the halves one by one: glu_interleave_size=1
    gpt_oss = ops.ClampedSwiGLU(glu_interleave_size=1)
    x = torch.randn(3, 16, dtype=torch.float64) * 5
    g, lin = x[..., ::2].clamp(max=7.0), x[..., 1::2].clamp(-7.0, 7.0)
    torch.testing.assert_close(ops.Sequential(gpt_oss)(x), g * torch.sigmoid(1.702 * g) * (lin + 1))
    # blocks of 2: [a1 a2 b1 b2 a3 a4 b3 b4]
    x = torch.randn(4, 8, dtype=torch.float64)
    a, b = x[:, [0, 1, 4, 5]], x[:, [2, 3, 6, 7]]
    torch.testing.assert_close(ops.Sequential(ops.GEGLU(glu_interleave_size=2))(x),
                               torch.nn.functional.gelu(a, approximate="tanh") * b)
    assert "glu_interleave_size=2" in ops.SwiGLU(glu_interleave_size=2).describe()
    with pytest.raises(ValueError, match=r"SwiGLU\(glu_interleave_size=4\) needs a last "
                                         r"dimension divisible by 2 \* glu_interleave_size = 8, "
                                         r"got input shape \(2, 12\)"):
        ops.Sequential(ops.SwiGLU(glu_interleave_size=4))(torch.randn(2, 12))
    with pytest.raises(ValueError, match="glu_interleave_size must be positive"):
        ops.SwiGLU(glu_interleave_size=0)
    with pytest.raises(ValueError, match=r"ClampedSwiGLU: limit must be at least 0.0"):
        ops.ClampedSwiGLU(limit=-1.0)
    w = torch.arange(12.0).view(6, 2)  # rows a0 a1 a2 b0 b1 b2
    assert fusible.interleave_glu_rows(w, 1)[:, 0].tolist() == [0, 6, 2, 8, 4, 10]
    with pytest.raises(ValueError, match=r"interleave_glu_rows: the rows of a \(6, 2\) tensor "
                                         r"must be a multiple of 2 \* glu_interleave_size = 4"):
        fusible.interleave_glu_rows(w, 2)


def test_cache_quantized_input_saves_fp8_and_computes_the_backward_from_it():
    """``cache_quantized_input``: the saved input is its E4M3 cast (one byte a value) and
    the backward is the gradient at the dequantized input, bit for bit."""
    from fusible.functional.activations import glu_backward
    from fusible.quantization.casts.dequantize import dequantize
    from fusible.quantization.casts.tensorwise import cast_tensorwise
    torch.manual_seed(0)
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(6, 16, dtype=torch.bfloat16)
    model = ops.Sequential(ops.SwiGLU(cache_quantized_input=True))
    y = model(x)
    saved = y.grad_fn.fusible[1][0].saved
    assert saved.input is None and saved.input_fp8.dtype == torch.float8_e4m3fn
    assert saved.input_fp8.shape == x.shape and saved.input_scale_inv.dtype == torch.float32
    y.backward(dy)
    data, scale_inv = cast_tensorwise(x.detach(), torch.float8_e4m3fn)
    x_q = dequantize(data, scale_inv, torch.bfloat16)
    assert torch.equal(x.grad, glu_backward("swiglu", dy, x_q))
    assert torch.equal(y, ops.Sequential(ops.SwiGLU())(x))  # the forward is untouched


@pytest.mark.parametrize("cls", [ops.GELU, ops.ReLU, ops.SReLU, ops.QGELU, ops.SiLU])
def test_every_pointwise_activation_caches_its_saved_tensor_in_fp8(cls, fresh_dynamo):
    """As the gated units: what the backward reads (the input; ReLU's output) is kept as
    its E4M3 cast and the gradient is the one at the dequantized tensor, bit for bit,
    eager and compiled; the forward is untouched."""
    from fusible.functional.activations import activation_backward
    from fusible.quantization.casts.dequantize import dequantize
    from fusible.quantization.casts.tensorwise import cast_tensorwise
    torch.manual_seed(0)
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(6, 32, dtype=torch.bfloat16)
    act = cls(cache_quantized_input=True)
    assert "cache_quantized_input=True" in act.describe()
    model = ops.Sequential(act)
    y = model(x)
    saved = y.grad_fn.fusible[1][0].saved
    assert saved.tensor is None and saved.tensor_fp8.dtype == torch.float8_e4m3fn
    assert saved.tensor_fp8.shape == x.shape and saved.scale_inv.dtype == torch.float32
    y.backward(dy)
    kept = y.detach() if act.saves_output else x.detach()
    data, scale_inv = cast_tensorwise(kept, torch.float8_e4m3fn)
    want = activation_backward(act.kind, dy, dequantize(data, scale_inv, torch.bfloat16))
    assert torch.equal(x.grad, want)
    assert torch.equal(y, ops.Sequential(cls())(x))
    x2 = x.detach().clone().requires_grad_()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y2 = compiled(x2)
    y2.backward(dy)
    assert torch.equal(y2, y) and torch.equal(x2.grad, x.grad)


def test_fusions_reading_the_saved_activation_are_refused_with_a_cached_one():
    x = torch.randn(6, 32, requires_grad=True)
    for act in (ops.ReLU(cache_quantized_input=True), ops.GELU(cache_quantized_input=True)):
        plan = ops.Sequential(ops.BasicLinear(32, 32), ops.Bias(32), act).plan(x)
        reasons = {c.fusion: c.reason for c in plan.candidates if c.status == "refused"}
        assert "saves its tensor in FP8" in reasons.get("ForwardLinearBiasActivation",
                                                         "saves its tensor in FP8")
        assert "keeps its saved tensor in FP8" in reasons["BackwardActivationBias"]
    plan = ops.Sequential(ops.BasicLinear(32, 32), ops.Bias(32),
                          ops.ReLU(cache_quantized_input=True)).plan(x)
    assert "ForwardLinearBiasActivation" not in [s.name for s in plan.forward]


def _dropout_run(model, x, dy, seed):
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad


def test_dropout_statistics_scale_and_the_backward_mask():
    model = ops.Sequential(ops.Dropout(0.25))
    x = torch.full((4000, 64), 3.0)
    dy = torch.randn(4000, 64)
    y, dx = _dropout_run(model, x, dy, seed=1)
    kept = y != 0
    assert abs(1 - kept.double().mean().item() - 0.25) < 0.01  # 256000 draws
    assert torch.equal(y[kept], torch.full_like(y[kept], 3.0 * (1 / 0.75)))
    assert torch.equal(dx, dy * kept * (1 / 0.75))  # the forward's mask, scaled alike
    zeros = ops.Sequential(ops.Dropout(1.0))(x.clone().requires_grad_())
    assert not zeros.any()


def test_dropout_is_reproducible_in_every_dtype_and_identity_in_eval():
    model = ops.Sequential(ops.Dropout(0.5))
    x, dy = torch.randn(64, 32), torch.randn(64, 32)
    first, again = _dropout_run(model, x, dy, 3), _dropout_run(model, x, dy, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], _dropout_run(model, x, dy, 4)[0])
    low = _dropout_run(model.to(torch.bfloat16), x.bfloat16(), dy.bfloat16(), 3)
    assert torch.equal(low[0] != 0, first[0] != 0)  # the same mask whatever the dtype
    model.eval()
    assert torch.equal(model(x.bfloat16()), x.bfloat16())
    with pytest.raises(ValueError, match=r"Dropout\(p=1.5\): p must be in \[0, 1\]"):
        ops.Dropout(1.5)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dropout_compiled_draws_the_eager_mask(backend):
    """The mask is drawn inside the stage's custom op from the global generator: with the
    same seed, compiled and eager runs agree bit for bit, forward and backward."""
    model = ops.Sequential(ops.BasicLinear(32, 48), ops.Dropout(0.3), ops.BasicLinear(48, 16))
    x, dy = torch.randn(40, 32), torch.randn(40, 16)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    eager = _dropout_run(model, x, dy, 5)
    for p in model.parameters():
        p.grad = None
    got = _dropout_run(compiled, x, dy, 5)
    assert all(torch.equal(a, b) for a, b in zip(eager, got))


def test_glu_gradient_keeps_float32_precision_where_the_sigmoid_saturates():
    """``sigmoid'(a)`` as ``sigmoid(a) sigmoid(-a)``: ``1 - sigmoid(a)`` would lose most
    of float32's digits for large ``a`` (the GPU test found 5e-4 relative errors)."""
    from fusible.functional.activations import glu_backward
    from fusible.testing import assert_close
    torch.manual_seed(0)
    x = torch.randn(64, 256) * 6
    dy = torch.randn(64, 128)
    assert_close(glu_backward("glu", dy, x), glu_backward("glu", dy.double(), x.double()),
                 torch.float32, "glu dx")


def test_the_feature_split_passes_through_ops_that_keep_features():
    """After a column-parallel layer the split runs through every op that maps each feature
    to itself (bias, activation, dropout, extra inputs and outputs, collectives along the
    tokens too, not built here: they need a process group): a chunked gated unit behind any
    of them is refused; an op that mixes features ends the split."""
    from fusible.functional.parallel import TensorParallel
    from fusible.planning.passes import check_gated_layouts

    class ColumnParallel:  # what the pass reads of a column-parallel layer on 2 ranks
        parallel = TensorParallel("column", False, "g", 2)
        keeps_features = False

        def describe(self):
            return "BasicLinear(column)"

        def check_split_features(self, producer, world_size):
            pass

    for between in ([], [ops.Bias(8)], [ops.MakeExtraOutput()], [ops.AddExtraInput()],
                    [ops.GELU(), ops.Dropout(0.1)]):
        with pytest.raises(ValueError, match=r"SwiGLU\(\) after the column-parallel "
                                             r"BasicLinear\(column\): each of the 2 ranks"):
            check_gated_layouts([ColumnParallel(), *between, ops.SwiGLU()])
        check_gated_layouts([ColumnParallel(), *between, ops.SwiGLU(glu_interleave_size=2)])
    check_gated_layouts([ColumnParallel(), ops.LayerNorm(8), ops.SwiGLU()])  # split ended
