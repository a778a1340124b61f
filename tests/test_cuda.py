"""GPU checks, run on the device machine (skipped without CUDA)."""

import math

import pytest
import torch

import fusible
from fusible import ops
from fusible.functional import attention as attn
from fusible.functional.activations import dact_dbias_torch
from fusible.kernels.dact_dbias import dact_dbias_triton
from fusible.testing import (assert_close, check_fusion, exact_parameters_, exact_tensor,
                             same_bits, snr_db, stage_names)
from fp8_emulation import check_against_emulation
from fp8_formats import FP8_MAX

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cuda(model, dtype):
    return exact_parameters_(model.to(device="cuda", dtype=dtype))


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_mlp_block_on_gpu(dtype):
    model = _cuda(ops.Sequential(ops.MakeExtraOutput(), ops.LayerNorm(16), ops.Linear(16, 32),
                                 ops.GELU(approximate="tanh"), ops.Linear(32, 16),
                                 ops.AddExtraInput()), dtype)
    x = exact_tensor((4, 32, 16), dtype, device="cuda").requires_grad_()
    residual = exact_tensor((4, 32, 16), dtype, device="cuda").requires_grad_()
    # Six ops in a row: 16-bit rounding of every intermediate adds up (see assert_close).
    check_fusion(model, x, residual, forward=["ForwardLinearBias", "ForwardLinearBiasAdd"],
                 backward=["BackwardActivationBias"], tolerance_scale=4)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("act", ["relu", "gelu_tanh"])
def test_gemm_activation_epilogue_on_gpu(dtype, act):
    """CUDA's epilogue is GELU(tanh): the plan fuses it, and the numbers say it is tanh."""
    act_op = ops.ReLU() if act == "relu" else ops.GELU(approximate="tanh")
    model = _cuda(ops.Sequential(ops.BasicLinear(64, 128), ops.Bias(128), act_op), dtype)
    x = exact_tensor((256, 64), dtype, device="cuda")
    with torch.no_grad():
        if act == "gelu_tanh" and dtype == torch.float32:
            plan = model.plan(x)
            assert stage_names(plan.forward) == ["ForwardLinearBias", "GELU"]
            assert any("short of float32" in c.reason for c in plan.candidates)
            return
        check_fusion(model, x, forward=["ForwardLinearBiasActivation"])
    exact = ops.Sequential(ops.BasicLinear(64, 128), ops.Bias(128), ops.GELU()).cuda()
    with torch.no_grad():
        plan = exact.plan()
    assert stage_names(plan.forward) == ["ForwardLinearBias", "GELU"]


def test_cuda_gemm_gelu_epilogue_is_the_tanh_form():
    """The fact the fusion relies on, in float32 where the two GELUs differ measurably."""
    torch.manual_seed(0)
    x, w, b = (torch.randn(256, 64, device="cuda"), torch.randn(128, 64, device="cuda") / 8,
               torch.randn(128, device="cuda"))
    y = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    pre = torch.addmm(b, x, w.t()).double()
    err_tanh = (y - torch.nn.functional.gelu(pre, approximate="tanh")).abs().max().item()
    err_exact = (y - torch.nn.functional.gelu(pre)).abs().max().item()
    assert err_tanh < err_exact / 3, (err_tanh, err_exact)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "relu", "silu"])
def test_dact_dbias_triton_on_gpu(dtype, kind):
    dy = torch.randn(3000, 1000, device="cuda").to(dtype)
    saved = (3 * torch.randn(3000, 1000, device="cuda")).to(dtype)
    if kind == "relu":
        saved = saved.relu()
    dact, dbias = dact_dbias_triton(kind, dy, saved)
    ref_dact, ref_dbias = dact_dbias_torch(kind, dy.double(), saved.double())
    assert_close(dact, ref_dact, dtype, "dact")
    assert_close(dbias, ref_dbias, dtype, "dbias")


def test_backward_activation_bias_uses_triton_on_gpu(monkeypatch):
    import fusible.kernels.dact_dbias as kernels
    calls = []
    real = kernels.dact_dbias_triton
    monkeypatch.setattr(kernels, "dact_dbias_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = ops.Sequential(ops.Linear(64, 4096), ops.GELU(), ops.Linear(4096, 64)).cuda()
    model(torch.randn(32, 64, device="cuda")).sum().backward()       # small: PyTorch ops
    model(torch.randn(4096, 64, device="cuda")).sum().backward()     # 2**24 elements: Triton
    assert calls == [1]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_block_same_bits_as_eager_on_gpu(mode, cuda_graph_recordings):
    """Inductor, and Inductor with CUDA graphs, over optimizer steps: with CUDA graphs the
    forward and the backward are recorded once each (a warm-up step, a recording, then
    replays), never again."""
    import copy
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(256), ops.Linear(256, 1024), ops.GELU(approximate="tanh"),
                           ops.Linear(1024, 256), ops.AddExtraInput()).to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, mode=mode)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, twin))
    for step in range(3):
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        y = model(x, x)
        y.backward(dy)
        if mode:
            torch.compiler.cudagraph_mark_step_begin()
        y2 = compiled(x, x)
        assert torch.equal(y, y2), f"step {step}: outputs differ"
        y2.backward(dy)
        for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, p2.grad), f"step {step}: gradient of {n} differs"
        opt.step(), twin_opt.step()
        opt.zero_grad(), twin_opt.zero_grad()
    assert len(cuda_graph_recordings) == (2 if mode else 0), cuda_graph_recordings


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_make_graphed_callables_same_bits_as_eager(fp8):
    """fusible.make_graphed_callables: whole-step CUDA graphs for eager training, bitwise
    equal to eager over optimizer steps; a call the graph was not captured for raises."""
    import contextlib
    import copy
    import fusible
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(256), ops.Linear(256, 1024), ops.GELU(approximate="tanh"),
                           ops.Linear(1024, 256)).to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    state = fusible.autocast if fp8 else contextlib.nullcontext
    sample = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with state():
        graphed = fusible.make_graphed_callables(twin, (sample,))
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, twin))
    for step in range(3):
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        with state():
            y, y2 = model(x1), graphed(x2)
        assert torch.equal(y, y2), f"step {step}: outputs differ"
        y.backward(dy), y2.backward(dy)
        assert torch.equal(x1.grad, x2.grad), f"step {step}: input gradients differ"
        for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, p2.grad), f"step {step}: gradient of {n} differs"
        opt.step(), twin_opt.step()
        opt.zero_grad(), twin_opt.zero_grad()
    other = contextlib.nullcontext if fp8 else fusible.autocast
    with other(), pytest.raises(RuntimeError, match="captured (without FP8|under the FP8)"):
        graphed(x2)
    with state(), pytest.raises(ValueError, match="argument 0 is"):
        graphed(x2[:-1])


def test_fp8_transposed_copy_by_triton_same_bytes_as_pytorch(monkeypatch):
    from fusible.kernels import fp8_cast
    calls = []
    kernel = fp8_cast.transpose_bytes_triton
    monkeypatch.setattr(fp8_cast, "transpose_bytes_triton",
                        lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    for shape in ((16384, 8192), (3, 77, 200), (1, 129)):
        data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        ref = data.reshape(-1, shape[-1]).t().contiguous()
        for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for out in (fp8_cast.transposed_copy(data.view(fp8_dtype)),
                        kernel(data.view(fp8_dtype).reshape(-1, shape[-1]))):
                assert out.dtype == fp8_dtype and out.is_contiguous()
                assert torch.equal(out.view(torch.uint8), ref), shape
    assert calls == [(16384, 8192)] * 2  # only the large one is worth a launch


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_cast_triton_same_bits_as_pytorch(dtype, fp8_dtype):
    """Subnormal, saturating and special values included; odd shapes for the masks."""
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    torch.manual_seed(0)
    for shape in ((4096, 1024), (3, 77, 200)):
        x = torch.randn(shape, device="cuda") * torch.logspace(-9, 3, shape[-1], device="cuda")
        x.view(-1)[:2] = torch.tensor([0.0, -0.0])
        x = x.to(dtype)
        for columnwise in (False, True):
            ours = cast_to_fp8_triton(x, fp8_dtype, FP8_MAX[fp8_dtype], columnwise)
            ref = cast_tensorwise_torch(x, fp8_dtype, columnwise)
            assert torch.equal(ours[1], ref[1])
            for a, b in zip(ours[::2], ref[::2]):  # data and transposed copy
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (shape, columnwise)
        t_only, t_scale_inv = cast_to_fp8_triton(x, fp8_dtype, FP8_MAX[fp8_dtype], True,
                                                 rowwise=False)  # the copy alone
        assert torch.equal(t_scale_inv, ref[1])
        assert torch.equal(t_only.view(torch.uint8), ref[2].view(torch.uint8)), shape
    for special in (float("inf"), float("nan"), 1e-38):  # 1e-38: a tiny tensor, clamped scale
        x = torch.randn(64, 64, device="cuda", dtype=dtype)
        x = x * 1e-38 if special == 1e-38 else x
        x[1, 2] = special
        ours = cast_to_fp8_triton(x, fp8_dtype, FP8_MAX[fp8_dtype], True)
        ref = cast_tensorwise_torch(x, fp8_dtype, True)
        torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=0, equal_nan=True)
        same_or_both_nan = ((ours[0].view(torch.uint8) == ref[0].view(torch.uint8))
                            | (ours[0].float().isnan() & ref[0].float().isnan()))
        assert same_or_both_nan.all(), special


@pytest.mark.parametrize("kind", ["gelu_tanh", "silu"])
def test_dact_dbias_fp8_triton_same_bits_as_dact_then_cast(kind):
    from fusible.kernels.dact_dbias import dact_dbias_fp8_triton
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    dy = torch.randn(3000, 1024, device="cuda").to(torch.bfloat16)
    saved = (3 * torch.randn(3000, 1024, device="cuda")).to(torch.bfloat16)
    q_data, q_scale_inv, q_t, dbias = dact_dbias_fp8_triton(kind, dy, saved, torch.float8_e5m2,
                                                            57344.0, True)
    ref_dact, ref_dbias = dact_dbias_triton(kind, dy, saved)
    data, scale_inv, transpose = cast_to_fp8_triton(ref_dact, torch.float8_e5m2, 57344.0, True)
    assert torch.equal(q_scale_inv, scale_inv)
    assert torch.equal(q_data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), transpose.view(torch.uint8))
    # Same per-chunk sums; only the tile reduction's order may differ.
    assert_close(dbias, ref_dbias.double(), torch.bfloat16, "dbias")


def test_backward_activation_bias_writes_fp8_directly_on_gpu(monkeypatch):
    import fusible
    import fusible.kernels.dact_dbias as kernels
    calls = []
    real = kernels.dact_dbias_fp8_triton
    monkeypatch.setattr(kernels, "dact_dbias_fp8_triton",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(64, 4096), ops.GELU(), ops.Linear(4096, 64)).to(
        "cuda", torch.bfloat16)
    x = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # 48.2 dB on an H200: bf16 results of Hopper's FP8 GEMMs, one re-quantized (tests/test_fp8.py)
    check_against_emulation(model, [x], model, fusible.Float8CurrentScaling(), 46.5)
    assert calls == [torch.float8_e5m2]


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_norms_and_swiglu_triton_on_gpu(dtype):
    from fusible.functional.activations import swiglu_backward, swiglu_forward
    from fusible.functional.norms import layer_norm_backward, layer_norm_forward
    from fusible.functional.norms import rms_norm_backward, rms_norm_forward
    from fusible.kernels.norms import norm_backward_triton, norm_forward_triton
    from fusible.kernels.swiglu import swiglu_backward_triton, swiglu_forward_triton
    torch.manual_seed(0)
    for shape in ((1000, 4096), (3, 77, 3000), (5, 20000)):  # whole rows; wider than 16384
        x = (3 * torch.randn(shape, device="cuda") + 2).to(dtype)
        dy = torch.randn(shape, device="cuda").to(dtype)
        w, b = (torch.randn(shape[-1], device="cuda").to(dtype) for _ in range(2))
        ns = [shape[-1]]
        y, mean, rstd = norm_forward_triton(x, w, b, 1e-5, True)
        ref_y, ref_mean, ref_rstd = layer_norm_forward(x.double(), w.double(), b.double(), ns,
                                                       1e-5)
        assert_close(y, ref_y, dtype, "layer_norm y")
        assert_close(mean, ref_mean, torch.float32, "mean")
        assert_close(rstd, ref_rstd, torch.float32, "layer_norm rstd")
        grads = norm_backward_triton(dy, x, mean, rstd, w, True, True, True, True)
        refs = layer_norm_backward(dy.double(), x.double(), ref_mean, ref_rstd, w.double(),
                                   b.double(), ns, [True, True, True])
        for got, want, what in zip(grads, refs, ("dx", "dweight", "dbias")):
            assert_close(got, want, dtype, f"layer_norm {what}")
        y, _, rstd = norm_forward_triton(x, w, None, 1e-5, False)
        ref_y, ref_rstd = rms_norm_forward(x.double(), w.double(), ns, 1e-5)
        assert_close(y, ref_y, dtype, "rms_norm y")
        assert_close(rstd, ref_rstd, torch.float32, "rstd")
        dx, dw, _ = norm_backward_triton(dy, x, None, rstd, w, False, True, True)
        ref_dx, ref_dw = rms_norm_backward(dy.double(), x.double(), ref_rstd, w.double(), ns,
                                           True, True)
        assert_close(dx, ref_dx, dtype, "rms_norm dx")
        assert_close(dw, ref_dw, dtype, "rms_norm dweight")
        half = dy[..., : shape[-1] // 2]
        assert_close(swiglu_forward_triton(x), swiglu_forward(x.double()), dtype, "swiglu")
        assert_close(swiglu_backward_triton(half.contiguous(), x),
                     swiglu_backward(half.double(), x.double()), dtype, "swiglu dx")
        from fusible.functional.activations import glu_backward, glu_forward
        from fusible.kernels.swiglu import KINDS
        for kind in KINDS:  # the other gated units share the kernels
            assert_close(swiglu_forward_triton(x, kind=kind), glu_forward(kind, x.double()),
                         dtype, kind)
            assert_close(swiglu_backward_triton(half.contiguous(), x, kind=kind),
                         glu_backward(kind, half.double(), x.double()), dtype, f"{kind} dx")
        w32 = w.float() + 1  # a zero-centred gamma's weight beside a 16-bit input
        y, _, rstd = norm_forward_triton(x, w32, None, 1e-5, False)
        ref_y, ref_rstd = rms_norm_forward(x.double(), w32.double(), ns, 1e-5)
        assert_close(y, ref_y, dtype, "rms_norm y, float32 weight")
        dx, dw, _ = norm_backward_triton(dy, x, None, rstd, w32, False, True, True)
        ref_dx, ref_dw = rms_norm_backward(dy.double(), x.double(), ref_rstd, w32.double(), ns,
                                           True, True)
        assert dw.dtype == torch.float32
        assert_close(dx, ref_dx, dtype, "rms_norm dx, float32 weight")
        assert_close(dw, ref_dw, dtype, "rms_norm dweight, float32 weight")


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fused_fp8_outputs_same_bits_as_kernel_then_cast_on_gpu(fp8_dtype, columnwise):
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fusible.kernels.norms import norm_forward_fp8_triton, norm_forward_triton
    from fusible.kernels.swiglu import (swiglu_backward_fp8_triton, swiglu_backward_triton,
                                        swiglu_forward_fp8_triton, swiglu_forward_triton)
    torch.manual_seed(0)
    args = (fp8_dtype, FP8_MAX[fp8_dtype], columnwise)

    def same(fused, plain):
        ref = cast_to_fp8_triton(plain, *args)
        assert len(fused) == len(ref)
        for got, want in zip(fused, ref):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert same_bits(got, want)
    for shape in ((2048, 4096), (3, 77, 640)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=torch.bfloat16)
        same(swiglu_forward_fp8_triton(x, *args), swiglu_forward_triton(x))
        same(swiglu_backward_fp8_triton(dy, x, *args), swiglu_backward_triton(dy, x))
        for kind in ("geglu", "sreglu"):
            same(swiglu_forward_fp8_triton(x, *args, kind=kind),
                 swiglu_forward_triton(x, kind=kind))
            same(swiglu_backward_fp8_triton(dy, x, *args, kind=kind),
                 swiglu_backward_triton(dy, x, kind=kind))
        for ns in (shape[-1:], shape[-2:]):  # the copy is transposed over the last dim alone
            w, b = (torch.randn(ns, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for center in (True, False):
                bias = b if center else None
                parts, mean, rstd = norm_forward_fp8_triton(x, w, bias, 1e-5, center, *args)
                y, ref_mean, ref_rstd = norm_forward_triton(x, w, bias, 1e-5, center)
                assert torch.equal(rstd, ref_rstd)
                assert (mean is None) == (ref_mean is None)
                assert mean is None or torch.equal(mean, ref_mean)
                same(parts, y)


def _llama_ffn(hidden, ffn):
    """``x + W2(SwiGLU(W13(RMSNorm(x))))``, called as ``model(x, x)``."""
    return ops.Sequential(ops.RMSNorm(hidden), ops.BasicLinear(hidden, 2 * ffn), ops.SwiGLU(),
                          ops.BasicLinear(ffn, hidden), ops.AddExtraInput())


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_llama_ffn_block_on_gpu(dtype):
    model = _cuda(_llama_ffn(64, 96), dtype)
    x = exact_tensor((4, 32, 64), dtype, device="cuda").requires_grad_()
    residual = exact_tensor((4, 32, 64), dtype, device="cuda").requires_grad_()
    check_fusion(model, x, residual, forward=["ForwardLinearBiasAdd"], tolerance_scale=4)


def test_llama_ffn_block_fp8_writes_fp8_in_the_norm_and_swiglu_kernels(monkeypatch):
    """Under FP8 the RMSNorm and SwiGLU kernels write the GEMM inputs, and SwiGLU's
    backward the first GEMM's output gradient, in FP8 themselves; every result matches
    the emulated reference; compiled is bitwise eager."""
    import copy

    import fusible
    from fusible.kernels import norms, swiglu
    calls = []
    for module, name in ((norms, "norm_forward_fp8_triton"),
                         (swiglu, "swiglu_forward_fp8_triton"),
                         (swiglu, "swiglu_backward_fp8_triton")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k:
                            calls.append((_name, a[-3])) or _real(*a, **k))
    torch.manual_seed(0)
    model = _llama_ffn(256, 512).to("cuda", torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # 42.3 dB on an H200, the same with the fused kernels off
    # (benchmarks/diagnostics/fp8_snr_sources.py): Hopper's FP8 accumulation in a chain of
    # re-quantized GEMMs, as in tests/test_fp8.py
    check_against_emulation(model, [x, r], model, fusible.Float8CurrentScaling(), 41)
    assert calls == [("norm_forward_fp8_triton", torch.float8_e4m3fn),
                     ("swiglu_forward_fp8_triton", torch.float8_e4m3fn),
                     ("swiglu_backward_fp8_triton", torch.float8_e5m2)]
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)  # deepcopy leaves a Parameter's .grad behind
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True)
    dy = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    x1, x2 = (x.detach().clone().requires_grad_() for _ in range(2))
    with fusible.autocast():
        y1, y2 = model(x1, x1), compiled(x2, x2)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, p2.grad), n


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_writing_fp8_on_gpu(kind, dtype):
    """Its activation against FP64, its FP8 bits against that activation then the cast."""
    from fusible.functional.activations import activation_forward
    from fusible.kernels.activation_cast import activation_fp8_triton, activation_triton
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    x = (3 * torch.randn(3000, 1000, device="cuda")).to(dtype)
    y = activation_triton(kind, x)
    assert_close(y, activation_forward(kind, x.double()), dtype, kind)
    for fp8 in FP8_MAX:
        fused = activation_fp8_triton(kind, x, fp8, FP8_MAX[fp8], True)
        ref = cast_to_fp8_triton(y, fp8, FP8_MAX[fp8], True)
        assert torch.equal(fused[1], ref[1])
        for got, want in (fused[0], ref[0]), (fused[2], ref[2]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_interleaved_and_clamped_gated_units_on_gpu(dtype):
    """The kernels' interleaved halves, clamped SwiGLU and SiTU-GLU against FP64, and
    their FP8 outputs as the plain kernel followed by the cast (bits)."""
    from fusible.functional.activations import glu_backward, glu_forward
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fusible.kernels.swiglu import (swiglu_backward_fp8_triton, swiglu_backward_triton,
                                        swiglu_forward_fp8_triton, swiglu_forward_triton)
    torch.manual_seed(0)
    x = torch.randn(300, 512, device="cuda").to(dtype)
    dy = torch.randn(300, 256, device="cuda").to(dtype)
    for layout in (dict(kind="clamped_swiglu", clamp=(1.0, 1.702, 1.0)),
                   dict(kind="clamped_swiglu", interleave=1),
                   dict(kind="situ_glu", clamp=(1.5, 0.75, 0.25)),
                   dict(kind="situ_glu", clamp=(0.3, 0.0, -0.5), interleave=2),
                   dict(kind="swiglu", interleave=64), dict(kind="geglu", interleave=8)):
        what = f"{layout} {dtype}"
        assert_close(swiglu_forward_triton(x, **layout), glu_forward(x=x.double(), **layout),
                     dtype, what)
        assert_close(swiglu_backward_triton(dy, x, **layout),
                     glu_backward(grad_output=dy.double(), x=x.double(), **layout), dtype,
                     f"{what} dx")
        if dtype != torch.bfloat16:
            continue
        fp8 = torch.float8_e4m3fn
        for fused, plain in ((swiglu_forward_fp8_triton(x, fp8, FP8_MAX[fp8], True, **layout),
                              swiglu_forward_triton(x, **layout)),
                             (swiglu_backward_fp8_triton(dy, x, fp8, FP8_MAX[fp8], True,
                                                         **layout),
                              swiglu_backward_triton(dy, x, **layout))):
            for got, want in zip(fused, cast_to_fp8_triton(plain, fp8, FP8_MAX[fp8], True)):
                assert same_bits(got, want), what


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_rms_norm_backward_adds_the_branch_gradient_on_gpu(dtype):
    from fusible.functional.norms import rms_norm_backward, rms_norm_forward
    from fusible.kernels.norms import norm_backward_triton, norm_forward_triton
    torch.manual_seed(0)
    for n in (4096, 20000):  # whole rows, and column tiles
        x, dy, add = (torch.randn(64, n, device="cuda").to(dtype) for _ in range(3))
        w = torch.randn(n, device="cuda").to(dtype)
        _, _, rstd = norm_forward_triton(x, w, None, 1e-5, False)
        _, ref_rstd = rms_norm_forward(x.double(), w.double(), [n], 1e-5)
        dx, _, _ = norm_backward_triton(dy, x, None, rstd, w, False, True, False,
                                        accumulate_into=add)
        want, _ = rms_norm_backward(dy.double(), x.double(), ref_rstd, w.double(), [n], True,
                                    False)
        assert_close(dx, want + add.double(), dtype, f"dx + add, {n} wide")


def test_cached_launches_keep_unaligned_pointers_apart_on_gpu():
    """A launch on a pointer off the 16-byte grid after one on an aligned pointer (the
    cached kernel may assume alignment) gives the right values."""
    from fusible.kernels.fp8_cast import amax_triton
    x = torch.randn(4097, device="cuda", dtype=torch.bfloat16)
    for view in (x[:4096], x[1:], x[:4096], x[3:4099]):
        assert amax_triton(view).item() == view.float().abs().max().item()


def test_amax_slots_zeroed_again_eagerly_and_zeros_under_capture_on_gpu(monkeypatch):
    """The casts' amax accumulators (fp8_cast._ZeroedSlots) start from zero after the
    slots wrap around, on the stream that used them; a captured CUDA graph gets fresh
    zeros (captured with it), so each replay scales its own input."""
    from fusible.kernels import fp8_cast
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    monkeypatch.setattr(fp8_cast._ZeroedSlots, "count", 3)
    monkeypatch.setattr(fp8_cast, "_SLOTS", {})

    def cast(x):
        return fp8_cast.cast_to_fp8_triton(x, torch.float8_e4m3fn, 448.0, False)[1]

    torch.manual_seed(0)
    side = torch.cuda.Stream()
    for k in range(8):  # shrinking maxima: a slot used again unzeroed keeps a larger one
        x = torch.randn(300, 200, device="cuda") * 2.0 ** -k
        stream = side if k % 3 == 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = cast(x)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(got, cast_tensorwise_torch(x, torch.float8_e4m3fn)[1]), k
    assert len(fp8_cast._SLOTS) == 2  # one set of slots per stream
    static = torch.randn(300, 200, device="cuda")
    cast(static)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cast(static)
    for k in range(3):
        static.copy_(torch.randn(300, 200, device="cuda") * 2.0 ** -k)
        graph.replay()
        assert torch.equal(captured, cast_tensorwise_torch(static, torch.float8_e4m3fn)[1]), k


def test_backward_linear_scale_fp8_with_a_negative_scale_on_gpu(plugins):
    """Under FP8 the scale multiplies dy's inverse scale inside the GEMMs: a negative one
    too. The fused gradients match the unfused ones (which quantize ``scale * dy``) to the
    FP8 rounding of that product."""
    import fusible
    from fusible.fusions.backward_linear_scale import BackwardLinearScale
    torch.manual_seed(0)
    model = ops.Sequential(ops.BasicLinear(128, 256), ops.ConstantScale(-0.75)).to(
        "cuda", torch.bfloat16)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    grads = []
    for fused in (True, False):
        if not fused:  # the built-in comes back after the test (plugins)
            fusible.unregister_fusion(BackwardLinearScale)
        with fusible.autocast():
            assert ("BackwardLinearScale" in stage_names(model.plan(x).backward)) == fused
            model(x).backward(dy)
        grads.append((x.grad, model[0].weight.grad))
        x.grad = model[0].weight.grad = None
    for got, want in zip(*grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.07,
                                   atol=0.07 * want.abs().max().item())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_main_grad_on_gpu(fp8):
    """accumulate_into_main_grad on CUDA (cuBLAS's float32-output GEMM; _scaled_mm's under
    FP8): compiled with Inductor the buffer gets eager's bits, and it is the model's bf16
    weight gradient before rounding (within a bf16 step of it)."""
    import contextlib
    import fusible
    state = fusible.autocast if fp8 else contextlib.nullcontext
    torch._dynamo.reset()
    results = []
    for mode in ("eager", "compiled", "plain"):
        torch.manual_seed(0)
        model = _cuda(ops.Sequential(ops.Linear(64, 128, accumulate_into_main_grad=mode != "plain"),
                                     ops.GELU(), ops.Linear(128, 64, bias=False)),
                      torch.bfloat16)
        weight = model[0].weight
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
        run = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        x = exact_tensor((32, 64), torch.bfloat16, device="cuda")
        with state():
            y = run(x)
        y.backward(exact_tensor((32, 64), torch.bfloat16, device="cuda"))
        results.append(weight.grad if mode == "plain" else weight.main_grad)
        assert (weight.grad is None) == (mode != "plain")
    eager, compiled, plain = results
    assert eager.dtype == torch.float32 and torch.equal(eager, compiled)
    assert ((eager - plain.float()).abs() <= 2.0 ** -7 * eager.abs() + 1e-6).all()


def test_main_grad_exact_on_gpu():
    """bf16 weights, two exact microbatches: the float32 buffer holds the fp64 sum of the
    weight gradients exactly (a bf16 gradient added in would be rounded)."""
    model = _cuda(ops.Sequential(ops.BasicLinear(64, 96, accumulate_into_main_grad=True)),
                  torch.bfloat16)
    weight = model[0].weight
    weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
    want = 0
    for _ in range(2):
        x = exact_tensor((48, 64), torch.bfloat16, device="cuda")
        dy = exact_tensor((48, 96), torch.bfloat16, device="cuda")
        model(x).backward(dy)
        want = want + dy.double().t() @ x.double()
    assert torch.equal(weight.main_grad.double(), want)


def test_fp8_parameters_on_gpu():
    """quantized_model_init on CUDA: compiled with Inductor the FP8-weight model gives
    eager's bits under fusible.autocast (the GEMMs read the FP8 weights), and an optimizer
    step quantizes the weights again in place (Triton casts)."""
    import fusible
    from fusible.quantization import Float8Tensor
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        with fusible.quantized_model_init():
            model = ops.Sequential(ops.Linear(256, 512), ops.GELU(approximate="tanh"),
                                   ops.Linear(512, 256)).to("cuda", torch.bfloat16)
        run = torch.compile(model, fullgraph=True) if compiled else model
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with fusible.autocast():
            y = run(x)
        y.backward(torch.randn_like(y))
        results.append([y, x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    w = model[0].weight
    before = w.dequantize().detach().float()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert isinstance(w, Float8Tensor) and w.is_cuda
    step = (w.dequantize().detach().float() - before + 0.5 * w.grad.float()).abs()
    assert (step <= 2.0 ** -3 * before.abs() + 2.0 ** -3 * w.grad.float().abs() + 1e-3).all()
    assert torch.equal(w._transpose.view(torch.uint8), w._data.view(torch.uint8).t())


@pytest.mark.parametrize("unit", ["swiglu", "geglu", "clamped"])
def test_recompute_glu_linear_same_bits_as_the_basic_ops_on_gpu(unit, fresh_dynamo,
                                                                 monkeypatch):
    """RecomputeGluLinear on the Triton kernels (the backward kernel writes the unit's
    output again over the dgrad it read, and eagerly its gradient over its input):
    outputs and every gradient equal the plan without it, eagerly and compiled
    (Inductor), on a shape of several tiles with ragged edges."""
    import fusible.fusions.recompute_glu_linear as module
    written, real = [], module.glu_backward_with_output

    def spy(kind, dy, x, *args, **kwargs):
        dx, y = real(kind, dy, x, *args, **kwargs)
        written.append(dx is x)
        return dx, y
    monkeypatch.setattr(module, "glu_backward_with_output", spy)
    Unit = {"swiglu": ops.SwiGLU, "geglu": ops.GEGLU, "clamped": ops.ClampedSwiGLU}[unit]
    torch.manual_seed(0)

    def block(recompute):
        return ops.Sequential(ops.BasicLinear(200, 2 * 328), Unit(recompute_output=recompute),
                              ops.BasicLinear(328, 200), ops.Bias(200),
                              ops.AddExtraInput()).to("cuda", torch.bfloat16)

    joint, plain = block(True), block(False)
    plain.load_state_dict(joint.state_dict())
    x = torch.randn(3, 77, 200, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step(model):
        xx = x.clone().requires_grad_()
        y = model(xx, xx)
        y.backward(dy)
        grads = [y.detach(), xx.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    assert "RecomputeGluLinear" in stage_names(joint.plan(x.requires_grad_(), x).backward)
    x.requires_grad_(False)
    want = step(plain)
    assert all(torch.equal(a, b) for a, b in zip(step(joint), want))
    assert written == [True]
    compiled = torch.compile(joint, fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(step(compiled), want))
    assert written[0] and len(written) > 1 and not any(written[1:])  # (traced: fakes too)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_recompute_norm_linear_same_bits_as_the_basic_ops_on_gpu(norm, fp8, monkeypatch):
    """RecomputeNormLinear on the Triton norm kernels (under FP8 the backward's
    recomputation is the norm's cast pass alone, by the forward's amax): outputs and every
    gradient equal the plan without it, eagerly and compiled (Inductor); the transposed
    FP8 copy of the norm's output is not kept."""
    import contextlib

    import fusible
    from fusible.kernels import norms
    calls = []
    real = norms.norm_cast_fp8_triton
    monkeypatch.setattr(norms, "norm_cast_fp8_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    Norm = ops.RMSNorm if norm == "rms" else ops.LayerNorm

    def block(recompute):
        return ops.Sequential(Norm(256, recompute_output=recompute), ops.BasicLinear(256, 512),
                              ops.SwiGLU(), ops.BasicLinear(256, 256),
                              ops.AddExtraInput()).to("cuda", torch.bfloat16)

    joint, plain = block(True), block(False)
    plain.load_state_dict(joint.state_dict())
    x = torch.randn(4, 48, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    context = fusible.autocast if fp8 else contextlib.nullcontext

    def step(model):
        xx = x.clone().requires_grad_()
        with context():
            y = model(xx, xx)
        y.backward(dy)
        grads = [y.detach(), xx.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    with context():
        assert "RecomputeNormLinear" in stage_names(joint.plan(x, x).backward)
        if fp8:
            node = joint(x.requires_grad_(), x).grad_fn
            assert node.fusible[1][1].saved is None  # the linear keeps no copy of its input
            x.requires_grad_(False)
    want = step(plain)
    calls.clear()
    assert all(torch.equal(a, b) for a, b in zip(step(joint), want))
    assert len(calls) == (2 if fp8 else 0)  # the forward's second pass, the backward's
    torch._dynamo.reset()
    compiled = torch.compile(joint, fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(step(compiled), want))


def test_grouped_linear_on_gpu(monkeypatch):
    """bf16 through torch._grouped_mm (forward, dgrad, 2-D wgrad; an empty group), against
    the same op in float32 (one GEMM per group); compiled (Inductor) bitwise eager, for
    two routings."""
    from fusible.functional import grouped
    used = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: used.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = ops.Sequential(ops.GroupedLinear(4, 64, 128, bias=True)).to("cuda")
    ref = ops.Sequential(ops.GroupedLinear(4, 64, 128, bias=True)).to("cuda")
    ref.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    x = torch.randn(40, 64, device="cuda")
    splits = torch.tensor([16, 0, 8, 16], device="cuda")
    dy = torch.randn(40, 128, device="cuda")

    def step(m, dtype, sizes=splits):
        xx = x.to(dtype).clone().requires_grad_()
        y = m(xx, sizes)
        y.backward(dy.to(dtype))
        out = [y.detach(), xx.grad] + [p.grad for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return out

    got = step(model, torch.bfloat16)
    assert len(used) == 3 and grouped.grouped_mm_available(x.bfloat16(), 128, 64)
    for a, b in zip(got, step(ref, torch.float32)):
        assert_close(a, b, torch.bfloat16, scale=4)
    assert not got[2][1].any() and not got[3][1].any()  # the empty group's gradients
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    assert all(same_bits(a, b) for a, b in zip(step(compiled, torch.bfloat16), got))
    other = torch.tensor([8, 8, 8, 16], device="cuda")
    want = step(model, torch.bfloat16, other)
    assert all(same_bits(a, b) for a, b in zip(step(compiled, torch.bfloat16, other), want))


def test_grouped_linear_scaled_bias_on_gpu():
    """scale_bias (float32 routing probabilities, bf16 layer) on the GPU: against the
    same op on the CPU in float32, the scales' gradient too; Inductor bitwise eager."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.GroupedLinear(4, 64, 128, bias=True, scale_bias=True))
    ref = ops.Sequential(ops.GroupedLinear(4, 64, 128, bias=True, scale_bias=True))
    ref.load_state_dict(model.state_dict())
    model.to("cuda", torch.bfloat16)
    x, dy = torch.randn(40, 64), torch.randn(40, 128)
    probs, splits = torch.rand(40), torch.tensor([16, 0, 8, 16])

    def step(m, device, dtype):
        xx = x.to(device, dtype, copy=True).requires_grad_()
        s = probs.to(device, copy=True).requires_grad_()
        y = m(xx, splits.to(device), s)
        y.backward(dy.to(device, dtype))
        out = [y.detach(), xx.grad, s.grad] + [p.grad for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return out

    got = step(model, "cuda", torch.bfloat16)
    for a, b in zip(got, step(ref, "cpu", torch.float32)):
        assert_close(a.cpu().float(), b, torch.bfloat16, scale=4)
    names = ["y", "dx", "dscales", "dweight", "dbias"]
    again = step(model, "cuda", torch.bfloat16)
    assert [n for n, a, b in zip(names, again, got) if not same_bits(a, b)] == []
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    differ = {n: (a.float() - b.float()).abs().max().item()
              for n, a, b in zip(names, step(compiled, "cuda", torch.bfloat16), got)
              if not same_bits(a, b)}
    assert differ == {}


def test_grouped_fp8_on_gpu(monkeypatch):
    """FP8 SwiGLU experts through torch._scaled_grouped_mm (an empty expert): against the
    same FP8 operands through the Triton grouped GEMMs and one torch._scaled_mm per group
    (forward, dgrad, wgrad), the FP8 weight casts' bits against PyTorch's on the CPU,
    Inductor bitwise eager."""
    import fusible
    from fusible.functional import grouped_fp8
    torch.manual_seed(0)
    E4M3 = torch.float8_e4m3fn
    w = (torch.randn(4, 96, 64) * torch.tensor([1.0, 16.0, 2.0 ** -5, 0.5]).view(4, 1, 1))
    w = w.to("cuda", torch.bfloat16)
    for layouts in ((True, False), (False, True), (True, True)):  # PyTorch's bits
        got = grouped_fp8.cast_grouped_weight(w, E4M3, rowwise=layouts[0],
                                              columnwise=layouts[1])
        want = grouped_fp8.cast_grouped_weight(w.cpu(), E4M3, rowwise=layouts[0],
                                               columnwise=layouts[1])
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or same_bits(a.cpu(), b))
    used = []
    real = torch._scaled_grouped_mm
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: used.append(1)
                        or real(*a, **k))
    model = ops.Sequential(ops.GroupedLinear(4, 64, 192), ops.SwiGLU(),
                           ops.GroupedLinear(4, 96, 64)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        model[0].weight.mul_(torch.tensor([1.0, 16.0, 2.0 ** -5, 0.5], device="cuda")
                             .view(4, 1, 1).bfloat16())
    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor([32, 0, 48, 16], device="cuda")
    dy = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)

    def step(m):
        xx = x.clone().requires_grad_()
        with fusible.autocast():
            y = m(xx, splits, splits)
        y.backward(dy)
        out = [y.detach(), xx.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    got = step(model)
    assert len(used) == 6  # forward, dgrad, wgrad of both layers
    monkeypatch.setattr(grouped_fp8, "HOPPER_KERNEL", "triton")
    triton_run = step(model)
    monkeypatch.setattr(grouped_fp8, "fp8_backend", lambda *a: "loop")
    loop = step(model)
    assert len(used) == 6
    for other in (triton_run, loop):
        for name, a, b in zip(("y", "dx", "dw13", "dw2"), got, other):
            assert snr_db(a, b) > 40, name  # the same operands: accumulation and rounding
        assert not other[2][1].any() and not other[3][1].any()
    assert not got[2][1].any() and not got[3][1].any()  # the empty expert's gradients
    monkeypatch.undo()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    assert all(same_bits(a, b) for a, b in zip(step(compiled), got))


def test_moe_routing_kernels_on_gpu(monkeypatch):
    """The routing's row moves through their Triton kernels (aligned and with a capacity
    that drops copies): values and gradients (tokens, router logits) against float64 on
    the CPU; compiled through AOTAutograd bitwise eager, through Inductor close to it."""
    from fusible import moe
    from fusible.kernels import moe_rows
    calls = []
    for name in ("gather_rows_triton", "combine_rows_triton"):
        real = getattr(moe_rows, name)
        monkeypatch.setattr(moe_rows, name, lambda *a, _r=real, _n=name, **k:
                            calls.append(_n) or _r(*a, **k))
    torch.manual_seed(0)
    x = torch.randn(300, 96).bfloat16().double()
    # distinct, exact logits: the same experts chosen in bf16 and float64
    logits = torch.stack([torch.randperm(8) for _ in range(300)]).double() / 4
    scale = torch.linspace(0.5, 2.0, 96)
    dy = torch.randn(300, 96).bfloat16().double()

    def layer(x, logits, **kw):
        experts, weights = moe.route_top_k(logits, 3)
        rows, routing = moe.permute_tokens(x, experts, 8, **kw)
        # a factor per row: the experts differ (the same function for all would leave the
        # router no gradient: its weights add up to one)
        factor = torch.linspace(0.5, 1.5, rows.shape[0], device=rows.device)[:, None]
        return moe.unpermute_tokens(rows * scale.to(rows) * factor.to(rows), routing, weights)

    def step(fn, device, dtype, **kw):
        xx = x.to(device, dtype).detach().clone().requires_grad_()
        ll = logits.to(device, dtype).detach().clone().requires_grad_()
        y = fn(xx, ll, **kw)
        y.backward(dy.to(y))  # not ones: the router's gradient would cancel to rounding
        return [y.detach(), xx.grad, ll.grad]

    for kw in ({"align": 16}, {"capacity_factor": 0.5, "align": 16}):
        calls.clear()
        got = step(layer, "cuda", torch.bfloat16, **kw)
        assert set(calls) == {"gather_rows_triton", "combine_rows_triton"}
        want = step(layer, "cpu", torch.float64, **kw)
        for a, b in zip(got[:2], want[:2]):
            assert_close(a.float().cpu(), b, torch.bfloat16, scale=4)
        # the router's gradient: bf16 dot products through the softmax's cancellations
        # (about 40 dB on the CPU's bf16 path too)
        assert snr_db(got[2].cpu(), want[2]) > 30
        # compiled without Inductor's code for the ops around them (its softmax and fused
        # products round differently): the row moves' custom ops give eager's bits
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert all(same_bits(a, b) for a, b in zip(step(compiled, "cuda", torch.bfloat16,
                                                        **kw), got))
        torch._dynamo.reset()
        calls.clear()
        compiled = torch.compile(layer, fullgraph=True)
        inductor = step(compiled, "cuda", torch.bfloat16, **kw)
        for a, b in zip(inductor[:2], got[:2]):
            assert_close(a, b, torch.bfloat16, scale=4)
        assert snr_db(inductor[2], got[2]) > 30
        assert set(calls) == {"gather_rows_triton", "combine_rows_triton"}


def test_scaled_glu_kernels_on_gpu():
    """The scaled units' Triton kernels: values against FP64, the fused FP8 casts bit for
    bit the plain kernels' results cast, and FP8 scaled SwiGLU experts compiled (Inductor)
    bitwise eager."""
    import fusible
    from fusible.functional.activations import scaled_glu_backward, scaled_glu_forward
    from fusible.kernels.scaled_glu import scaled_glu_backward_triton, scaled_glu_forward_triton
    from fusible.quantization.casts.tensorwise import cast_tensorwise
    torch.manual_seed(0)
    E4M3 = torch.float8_e4m3fn
    for kind, clamp in (("swiglu", None), ("geglu", None), ("clamped_swiglu", (1.0, 1.702, 1.0))):
        layout = dict(kind=kind, **({"clamp": clamp} if clamp else {}))
        x = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16)
        s = torch.rand(96, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16)
        y = scaled_glu_forward_triton(x, s, **layout)
        assert_close(y, scaled_glu_forward(x=x.double(), scales=s.double(), **layout),
                     torch.bfloat16, kind)
        dx, ds = scaled_glu_backward_triton(dy, x, s, True, True, **layout)
        rdx, rds = scaled_glu_backward(grad_output=dy.double(), x=x.double(), scales=s.double(),
                                       need_grad_input=True, need_grad_scales=True, **layout)
        assert_close(dx, rdx, torch.bfloat16, f"{kind} dx")
        assert_close(ds, rds, torch.bfloat16, f"{kind} ds", scale=4)
        for fused, plain in ((scaled_glu_forward_triton(x, s, (E4M3, 448.0, True), **layout), y),
                             (scaled_glu_backward_triton(dy, x, s, True, False,
                                                         (E4M3, 448.0, True), **layout)[0], dx)):
            want = cast_tensorwise(plain, E4M3, True)
            assert all(same_bits(a, b) for a, b in zip(fused, want)), kind
    model = ops.Sequential(ops.GroupedLinear(4, 64, 256), ops.ScaledSwiGLU(),
                           ops.GroupedLinear(4, 128, 64)).to("cuda", torch.bfloat16)
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    scales = torch.rand(64, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor([16, 0, 32, 16], device="cuda")

    def step(m):
        xx, ss = x.clone().requires_grad_(), scales.clone().requires_grad_()
        with fusible.autocast():
            y = m(xx, splits, ss, splits)
        y.backward(torch.ones_like(y))
        out = [y.detach(), xx.grad, ss.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    want = step(model)
    torch._dynamo.reset()
    assert all(same_bits(a, b) for a, b in zip(step(torch.compile(model, fullgraph=True)), want))


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_grouped_gemm_triton_on_gpu(dtype):
    """The Triton grouped GEMMs (GPUs and dtypes torch._grouped_mm does not take) against
    an FP64 loop over the groups, empty groups included."""
    from fusible.kernels.grouped_gemm import grouped_mm_triton, grouped_wgrad_triton
    torch.manual_seed(0)
    sizes = (5, 0, 130, 61, 0)
    splits = torch.tensor(sizes, device="cuda")
    rows, g = sum(sizes), len(sizes)
    x = torch.randn(rows, 200, device="cuda", dtype=dtype)
    w = torch.randn(g, 72, 200, device="cuda", dtype=dtype)
    dy = torch.randn(rows, 72, device="cuda", dtype=dtype)
    want_y, want_dx = (torch.zeros(rows, 72, dtype=torch.float64),
                       torch.zeros(rows, 200, dtype=torch.float64))
    want_dw, start = torch.zeros(g, 72, 200, dtype=torch.float64), 0
    for i, n in enumerate(sizes):
        xs, dys, wi = (t.double().cpu() for t in (x[start:start + n], dy[start:start + n], w[i]))
        want_y[start:start + n], want_dx[start:start + n] = xs @ wi.t(), dys @ wi
        want_dw[i] = dys.t() @ xs
        start += n
    assert_close(grouped_mm_triton(x, w, splits), want_y, dtype, "y", scale=4)
    assert_close(grouped_mm_triton(dy, w.transpose(-2, -1), splits), want_dx, dtype, "dx",
                 scale=4)
    dw = grouped_wgrad_triton(dy, x, splits, g)
    assert_close(dw, want_dw, dtype, "dw", scale=4)
    assert not dw[1].any() and not dw[4].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_fp8_cast_on_gpu(dtype):
    """The row-wise cast's Triton kernel gives PyTorch's bits on the CPU: data, per-row
    scales, the transposed copy scaled per feature, zero and tiny rows; a NaN stays in its
    row."""
    from fusible.quantization.casts.rowwise import cast_rowwise
    torch.manual_seed(0)
    x = torch.randn(300, 1000) * torch.logspace(-6, 6, 300).view(-1, 1)
    x[5] = 0.0
    x[9] = 1e-38
    x = x.to(dtype)
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got = cast_rowwise(x.cuda(), fp8_dtype, True, True)
        want = cast_rowwise(x, fp8_dtype, True, True)
        for a, b in zip(got, want):
            assert same_bits(a.cpu(), b)
    x[7, 3] = float("nan")  # NaN stays in its row (and its column of the copy)
    _, scale_inv, _, t_scale_inv = cast_rowwise(x.cuda(), torch.float8_e4m3fn, True, True)
    assert scale_inv.isnan().nonzero().tolist() == [[7, 0]]
    assert t_scale_inv.isnan().nonzero().tolist() == [[3, 0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_block_fp8_casts_on_gpu(dtype):
    """The block casts' Triton kernel (1x128 tiles, 128x128 blocks, MX 1x32) gives
    PyTorch's bits on the CPU: data, scales, transposed copies, on ragged shapes with zero
    and tiny rows; a NaN stays in its block."""
    from fusible.quantization.casts.blocks import cast_blocks
    torch.manual_seed(0)
    x = torch.randn(300, 1000) * torch.logspace(-6, 6, 300).view(-1, 1)
    x[5] = 0.0
    x[9] = 1e-38
    x = x.to(dtype)
    for (group, square, power2), fp8_dtype in zip(
            ((128, False, False), (128, True, False), (32, False, True), (128, False, False)),
            (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)):
        got = cast_blocks(x.cuda(), fp8_dtype, group, square, power2, True, True)
        want = cast_blocks(x, fp8_dtype, group, square, power2, True, True)
        for a, b in zip(got, want):
            assert same_bits(a.cpu(), b), (group, square, power2, fp8_dtype)
    x[7, 3] = float("nan")
    _, scale_inv, _, t_scale_inv = cast_blocks(x.cuda(), torch.float8_e4m3fn, 128, False,
                                               False, True, True)
    assert scale_inv.isnan().nonzero().tolist() == [[7, 0]]
    assert t_scale_inv.isnan().nonzero().tolist() == [[3, 0]]


def test_blockwise_gemm_on_gpu_matches_the_emulation():
    """PyTorch's blockwise GEMM (cuBLAS; 1x128 x 128x128 forward and dgrad, 1x128 x 1x128
    wgrad, a ragged contraction padded: 1008 features) against the float32 emulation on
    the same operands; on a GPU that has it, each of the three takes the native path."""
    from fusible.quantization.gemm import (_block_kinds, _emulated, native_blockwise_gemm,
                                           scaled_gemm)
    from fusible.quantization.scalings.base import scaling_named
    torch.manual_seed(0)
    tiles, blocks = scaling_named("blockwise_1x128"), scaling_named("blockwise_128x128")
    x = torch.randn(512, 1008, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1008, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn
    xq, wq, dyq = (tiles.cast(x, e4m3, True, True), blocks.cast(w, e4m3, True, True),
                   tiles.cast(dy, e4m3, True, True))
    gemms = [(xq[0], xq[1], wq[0].t(), wq[1].t()),  # forward
             (dyq[0], dyq[1], wq[2].t(), wq[3].t()),  # dgrad
             (dyq[2], dyq[3], xq[2].t(), xq[3].t())]  # wgrad (512 tokens)
    native = native_blockwise_gemm(x.device)
    for a, sa, b, sb in gemms:
        assert not native or _block_kinds(a, sa, b, sb) is not None, (a.shape, b.shape)
        got = scaled_gemm(a, sa, b, sb, None, torch.float32)
        want = _emulated(a, sa, b, sb)
        assert snr_db(got, want) > 60, (tuple(a.shape), tuple(b.shape))


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_recipes_on_gpu_compile_bit_for_bit(recipe):
    """The Llama FFN block under each recipe on the GPU: Inductor-compiled bitwise eager,
    and close to bf16."""
    import fusible
    torch.manual_seed(0)
    model = _cuda(_llama_ffn(256, 512), torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    r = fusible.recipe_from_name(recipe)
    eager = _ffn_step(model, model, x, r)
    compiled = _ffn_step(torch.compile(model, fullgraph=True), model, x, r)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    plain = _ffn_step(model, model, x, None)
    assert all(snr_db(a, b) > 18 for a, b in zip(eager, plain))


def _ffn_step(run, model, x, recipe):
    """One step of ``run`` (``model`` or its compiled self) on ``x`` as ``run(x, x)``
    under ``recipe`` (None: without FP8): the output, the input's and ``model``'s
    parameters' gradients (then cleared)."""
    import fusible
    xx = x.clone().requires_grad_()
    with fusible.autocast(enabled=recipe is not None, recipe=recipe):
        y = run(xx, xx)
    y.backward(torch.ones_like(y))
    out = [y.detach(), xx.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_delayed_casts_same_bits_as_pytorch_on_gpu():
    """The delayed cast kernel (one launch: the cast, the amax and the roll by the grid's
    last program; with a reduction, the roll kernel after it) against PyTorch's ops on the
    same state, step after step, on tensors of thousands of programs."""
    from fusible.kernels.fp8_delayed import DelayedCast, cast_delayed_triton, roll_torch
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for most_recent, margin, reduce in ((False, 0, None), (True, 1, None),
                                            (False, 0, lambda t: t * 1)):
            ours, ref = (torch.zeros(2 + 16, device="cuda") for _ in range(2))
            for step in range(5):
                x = (torch.randn(4096, 3072, device="cuda") * 2.0 ** (step - 2)).to(dtype)
                got = cast_delayed_triton(x, torch.float8_e4m3fn, 448.0, True,
                                          DelayedCast(ours, most_recent, margin, reduce))
                want = cast_tensorwise_torch(x, torch.float8_e4m3fn, True, ref[0].clone())
                roll_torch(ref, x.float().abs().amax(), most_recent, margin)
                assert torch.equal(ours, ref), (dtype, step, ours[:3], ref[:3])
                assert all(same_bits(a, b) for a, b in zip(got, want)), (dtype, step)


def test_delayed_casts_keep_non_finite_values_on_gpu():
    """An inf scaled by a finite scale from history becomes NaN (E4M3 has no infinity, and
    the GPU's conversions saturate one), in the kernel as in PyTorch's ops."""
    from fusible.kernels.fp8_delayed import DelayedCast, cast_delayed_triton
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    for fp8, fp8_max in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        x = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
        x[1, 2], x[3, 4], x[5, 6] = float("inf"), -float("inf"), float("nan")
        state = torch.zeros(2 + 4, device="cuda")
        state[0] = 4.0
        got = cast_delayed_triton(x, fp8, fp8_max, True, DelayedCast(state, False, 0))
        want = cast_tensorwise_torch(x, fp8, True, torch.tensor(4.0, device="cuda"))
        for a, b in zip(got, want):  # the same bits, but NaN's payload
            nan = a.float().isnan()
            assert torch.equal(nan, b.float().isnan()), fp8
            assert same_bits(torch.where(nan, 0, a.float()), torch.where(nan, 0, b.float())), fp8
        bad = got[0].float()[[1, 3, 5], [2, 4, 6]].tolist()
        assert all(math.isnan(v) for v in bad), (fp8, bad)


def test_delayed_fused_casts_same_bits_as_kernel_then_cast_on_gpu():
    """The norm's and gated units' kernels under delayed scaling (one pass, recording the
    amax) against their plain kernels' output cast by the delayed cast kernel."""
    from fusible.kernels.activation_cast import activation_fp8_triton, activation_triton
    from fusible.kernels.fp8_delayed import DelayedCast, cast_delayed_triton
    from fusible.kernels.norms import norm_forward_fp8_triton, norm_forward_triton
    from fusible.kernels.swiglu import (swiglu_backward_fp8_triton, swiglu_backward_triton,
                                        swiglu_forward_fp8_triton, swiglu_forward_triton)
    torch.manual_seed(0)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    cases = [(lambda d: swiglu_forward_fp8_triton(x, e4m3, 448.0, True, d),
              swiglu_forward_triton(x), e4m3),
             (lambda d: swiglu_backward_fp8_triton(dy, x, e5m2, 57344.0, True, d),
              swiglu_backward_triton(dy, x), e5m2),
             (lambda d: norm_forward_fp8_triton(x, w, None, 1e-5, False, e4m3, 448.0, True,
                                                d)[0],
              norm_forward_triton(x, w, None, 1e-5, False)[0], e4m3),
             (lambda d: activation_fp8_triton("gelu", x, e4m3, 448.0, True, d),
              activation_triton("gelu", x), e4m3)]
    for fused, plain, fp8 in cases:
        ours, ref = (torch.tensor([1.5, 0.0, 1.5, 1.0], device="cuda") for _ in range(2))
        for _ in range(3):
            got = fused(DelayedCast(ours))
            want = cast_delayed_triton(plain, fp8, FP8_MAX[fp8], True, DelayedCast(ref))
            assert torch.equal(ours, ref) and ours[0] > 1.5, (ours, ref)
            assert all(same_bits(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_delayed_llama_ffn_compiles_bit_for_bit_on_gpu(mode):
    """The Llama FFN block under delayed scaling on the GPU, three steps: Inductor-compiled
    bitwise eager, the histories alike; close to bf16 once the histories are filled."""
    import copy

    import fusible
    torch.manual_seed(0)
    recipe = fusible.DelayedScaling(amax_history_len=16)
    model = _cuda(_llama_ffn(256, 512), torch.bfloat16)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, mode=mode)
    for i in range(3):
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * (i + 1)
        eager = _ffn_step(model, model, x, recipe)
        assert all(torch.equal(a, b) for a, b in zip(eager, _ffn_step(compiled, twin, x, recipe)))
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers()))
    plain = _ffn_step(model, model, x, None)
    assert all(snr_db(a, b) > 18 for a, b in zip(eager, plain))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_split_backward_on_gpu_bit_for_bit(fp8, backend, fresh_dynamo):
    """The split backward on the GPU (Triton casts, cuBLAS GEMMs): every gradient equals
    the one-lane backward's, eagerly and compiled."""
    def grads(split):
        torch.manual_seed(0)
        model = ops.Sequential(ops.RMSNorm(256), ops.BasicLinear(256, 1024), ops.SwiGLU(),
                               ops.BasicLinear(512, 256), ops.Bias(256)).cuda().bfloat16()
        f = model if backend is None else torch.compile(model, fullgraph=True)
        torch.manual_seed(1)
        x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with fusible.autocast(enabled=fp8), fusible.split_backward(split):
            y = f(x)
        y.backward(torch.randn_like(y))
        fusible.run_deferred_wgrad()
        return [x.grad] + [p.grad for p in model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("routing", [{}, {"align": 16}, {"capacity_factor": 1.25}])
def test_moe_batch_without_tokens_on_gpu(routing):
    """A micro-batch with no token through the Triton routing kernels and bf16 grouped
    GEMMs: empty outputs and gradients, zero expert gradients, no error."""
    from fusible import moe
    x = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    experts, weights = moe.route_top_k(torch.randn(0, 4, device="cuda"), 2)
    rows, plan = moe.permute_tokens(x, experts, 4, **routing)
    layer = ops.Sequential(ops.GroupedLinear(4, 64, 64)).to("cuda", torch.bfloat16)
    y = moe.unpermute_tokens(layer(rows, plan.splits), plan, weights)
    y.float().sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64)
    assert layer[0].weight.grad is not None and not layer[0].weight.grad.any()


@pytest.mark.parametrize("cls", [ops.GELU, ops.ReLU, ops.SReLU, ops.QGELU, ops.SiLU])
def test_cached_fp8_activation_input_on_gpu(cls):
    """cache_quantized_input on the GPU: the saved E4M3 tensor and the gradient at its
    dequantized values as on the CPU (close: other kernels), Inductor bitwise eager."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    dy = torch.randn(64, 256, dtype=torch.bfloat16)

    def step(model, device):
        xx = x.to(device, copy=True).requires_grad_()
        y = model(xx)
        y.backward(dy.to(device))
        return [y.detach(), xx.grad]

    model = ops.Sequential(cls(cache_quantized_input=True))
    want = step(model, "cpu")
    got = step(model, "cuda")
    for a, b in zip(got, want):
        assert_close(a.cpu(), b, torch.bfloat16, scale=2)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    assert all(same_bits(a, b) for a, b in zip(step(compiled, "cuda"), got))


def test_checkpoint_context_on_gpu():
    """Two checkpointed forwards in flight under delayed scaling on the GPU (Triton casts
    recording amaxes): with fusible.checkpoint_context each recomputation repeats its own
    forward, the backwards in a 1F1B order: the bits and states of no checkpointing."""
    import copy
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64))
    model.to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    recipe = fusible.DelayedScaling(amax_history_len=4)
    inputs = [torch.randn(32, 64) * 8.0 ** k for k in range(2)]

    def run(m, fn):
        outs = []
        for x in inputs:
            with fusible.autocast(recipe=recipe):
                outs.append(fn(x.to("cuda", torch.bfloat16).requires_grad_()))
        for out in outs:
            out.float().square().sum().backward()
        return [p.grad for p in m.parameters()] + [b.clone() for b in m.buffers()]

    want = run(model, model)
    got = run(twin, lambda t: checkpoint(twin, t, use_reentrant=False,
                                         context_fn=fusible.checkpoint_context))
    assert len(want) == len(got) and all(same_bits(a, b) for a, b in zip(want, got))


def _relative_error(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


ATTENTION_CASES = [  # (kv heads, window, documents, position ids)
    (8, None, False, False), (2, None, False, False), (2, 64, False, False),
    (2, None, True, False), (1, 32, True, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv,window,documents,positions", ATTENTION_CASES)
def test_attention_flash_on_gpu_matches_float64(dtype, kv, window, documents, positions):
    """FlashAttention-2 through the varlen entry: grouped heads, windows, packed documents,
    given positions, against the same op on the CPU's float64 math formulas."""
    heads, d = 8, 64
    batch, seq = (1, 700) if documents else (2, 333)
    options = dict(num_kv_heads=kv, rotary_base=5e5, window=window, documents=documents,
                   position_ids=positions)
    gpu = ops.Sequential(ops.Attention(heads, backend="flash", **options)).cuda()
    ref = ops.Sequential(ops.Attention(heads, backend="math", **options)).double()
    torch.manual_seed(0)
    x = torch.randn(batch, seq, (heads + 2 * kv) * d, dtype=torch.float64)
    extras = []
    if documents:
        extras.append(torch.tensor([0, 100, 101, 450, seq], dtype=torch.int32))
    if positions:
        extras.append(torch.randint(0, 4000, (seq,)))
    assert "kernel: flash" in gpu.plan(x.to("cuda", dtype),
                                       *[e.cuda() for e in extras]).explain()
    x_gpu = x.to("cuda", dtype).requires_grad_()
    x_ref = x_gpu.detach().double().cpu().requires_grad_()
    y = gpu(x_gpu, *[e.cuda() for e in extras])
    want = ref(x_ref, *extras)
    dy = torch.randn_like(want)
    y.backward(dy.to("cuda", dtype))
    want.backward(dy)
    bound = 8e-3 if dtype == torch.bfloat16 else 1e-3
    assert _relative_error(y.cpu(), want) < bound
    assert _relative_error(x_gpu.grad.cpu(), x_ref.grad) < 2 * bound


def test_attention_on_gpu_never_runs_the_math_formulas_unasked():
    model = ops.Sequential(ops.Attention(4, rotary_base=1e4)).cuda()
    with pytest.raises(ValueError, match="no attention kernel on cuda fits.*backend='math'"):
        model(torch.randn(2, 8, 12 * 16, device="cuda"))
    with pytest.raises(ValueError, match="head_dim 12 is not a multiple of 8"):
        model(torch.randn(2, 8, 12 * 12, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_rotary_kernel_on_gpu(interleaved, dtype):
    """The Triton QKV split + RoPE kernel, both ways, against the PyTorch formulas."""
    from fusible.functional.qkv import HeadLayout, split, views
    from fusible.functional.rotary import RotaryOptions, apply_rotary, rotary_angles
    from fusible.kernels.rotary import qkv_rotary_backward_triton, qkv_rotary_forward_triton
    torch.manual_seed(0)
    heads, kv, d, rot, batch, seq = 8, 2, 128, 64, 2, 300
    layout = HeadLayout(heads, kv, d)
    opts = RotaryOptions(5e5, rot, interleaved, 8.0, 1.0, 4.0, 8192)
    pos = torch.randint(0, 9000, (batch, seq), device="cuda")
    cos, sin = rotary_angles(pos, opts)
    cos2, sin2 = cos.reshape(-1, rot // 2), sin.reshape(-1, rot // 2)
    qkv = torch.randn(batch, seq, (heads + 2 * kv) * d, device="cuda").to(dtype)
    got = views(qkv_rotary_forward_triton(qkv.flatten(0, 1), cos2, sin2, heads, kv,
                                          interleaved), batch, seq, layout)
    q, k, v = split(qkv, layout)
    want = (apply_rotary(q, cos, sin, opts), apply_rotary(k, cos, sin, opts), v)
    grads = [torch.randn_like(t) for t in got]
    dqkv = qkv_rotary_backward_triton(*(g.flatten(0, 1) for g in grads), cos2, sin2,
                                      interleaved).view(qkv.shape)
    want_grads = (apply_rotary(grads[0], cos, sin, opts, inverse=True),
                  apply_rotary(grads[1], cos, sin, opts, inverse=True), grads[2])
    for a, b in zip((*got, *split(dqkv, layout)), (*want, *want_grads)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_transformer_layer_on_gpu_compiles_bit_for_bit(fresh_dynamo):
    from fusible.layers import TransformerLayer
    from fusible.testing import check_compiled_matches_eager
    torch.manual_seed(0)
    layer = TransformerLayer(512, 1024, 8, num_kv_heads=2, device="cuda",
                             dtype=torch.bfloat16)
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    check_compiled_matches_eager(layer, x, backend="inductor")


def test_transformer_layer_on_gpu_matches_hugging_face_llama():
    """bf16 on the GPU against Hugging Face's LlamaDecoderLayer (sdpa) on the same weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as llama
    from fusible.layers import TransformerLayer, llama_layer_state_dict
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                      num_attention_heads=16, num_key_value_heads=4,
                                      rope_theta=5e5)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = llama.LlamaDecoderLayer(config, 0).to("cuda", torch.bfloat16)
    rotary = llama.LlamaRotaryEmbedding(config).cuda()
    ours = TransformerLayer(1024, 2816, 16, num_kv_heads=4,
                            rotary_base=config.rope_parameters["rope_theta"],
                            eps=config.rms_norm_eps, device="cuda", dtype=torch.bfloat16)
    ours.load_state_dict(llama_layer_state_dict(hf.state_dict()))
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(512, device="cuda").expand(2, 512)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = hf(x_hf, position_ids=pos, position_embeddings=rotary(x_hf, pos))
    got = ours(x_ours)
    dy = torch.randn_like(got)
    want.backward(dy)
    got.backward(dy)
    assert _relative_error(got, want) < 1e-2
    assert _relative_error(x_ours.grad, x_hf.grad) < 2e-2
    grads = llama_layer_state_dict({n: p.grad for n, p in hf.named_parameters()})
    for name, grad in grads.items():
        assert _relative_error(ours.get_parameter(name).grad, grad) < 3e-2, name


def test_linear_cross_entropy_on_gpu_never_holds_the_logits():
    """The LM head and its loss at a real vocabulary: against F.cross_entropy on float32
    logits, and the step's memory beyond its inputs stays under half the bf16 logits' (the
    default chunks: 4096 tokens, 512 MiB of bf16 logits; the weight's gradient: 128 MiB)."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 32768, 1024, 65536
    head = ops.LinearCrossEntropy(hidden, vocab, device="cuda", dtype=torch.bfloat16)
    model = ops.Sequential(head)
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::7] = -100
    x_ref = x.clone().float().requires_grad_()
    w_ref = head.weight.detach().float().requires_grad_()
    want = torch.nn.functional.cross_entropy(x_ref @ w_ref.t(), labels)
    want.backward()
    x = x.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = model(x, labels)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = tokens * vocab * 2
    print(f"LinearCrossEntropy step: {extra / 2**20:.0f} MiB beyond its inputs; bf16 logits "
          f"{logits_bytes / 2**20:.0f} MiB")
    assert extra < logits_bytes / 2, (extra, logits_bytes)
    assert abs(loss.item() - want.item()) < 2e-3 * abs(want.item())
    assert _relative_error(x.grad, x_ref.grad) < 1e-2
    assert _relative_error(head.weight.grad, w_ref.grad) < 1e-2


@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-4)])
def test_cross_entropy_kernel_on_gpu_matches_float64(smoothing, z_loss):
    """The chunk kernel compiled (its loop over a vocabulary that is no multiple of its
    block, an ignored token, in place and given the lse) against the PyTorch formulas in
    float64 on the same bf16 logits; and CrossEntropy alone against F.cross_entropy."""
    from fusible.functional.cross_entropy import LossOptions, chunk_logits_grad, chunk_losses
    from fusible.kernels.cross_entropy import chunk_cross_entropy_triton
    torch.manual_seed(0)
    tokens, vocab = 64, 128256
    opts = LossOptions(label_smoothing=smoothing, z_loss=z_loss)
    z = (torch.randn(tokens, vocab, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[3] = -100
    scale = torch.rand(tokens, device="cuda") + 0.5
    want_loss, want_lse = chunk_losses(z.double(), labels, opts)
    want_dz = chunk_logits_grad(z.double(), want_lse, labels, opts, scale.double())
    losses, lse = torch.empty(tokens, device="cuda"), torch.empty(tokens, device="cuda")
    dz = torch.empty_like(z)
    chunk_cross_entropy_triton(z, labels, -100, smoothing, z_loss, losses, lse, scale, dz)
    assert_close(losses, want_loss, torch.float32, "loss", scale=4.0)
    assert_close(lse, want_lse, torch.float32, "lse", scale=4.0)
    assert_close(dz, want_dz, torch.bfloat16, "dz")
    again = torch.empty_like(z)
    chunk_cross_entropy_triton(z, labels, -100, smoothing, z_loss, losses, lse, scale, again,
                               lse_given=True)
    assert torch.equal(again, dz)
    chunk_cross_entropy_triton(z, labels, -100, smoothing, z_loss, losses, lse, scale, z)
    assert torch.equal(z, dz)
    logits = (torch.randn(2, 100, 5000, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 5000, (2, 100), device="cuda")
    loss = ops.Sequential(ops.CrossEntropy(label_smoothing=smoothing, chunk_size=64))(
        logits, labels)
    loss.backward()
    ref = logits.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(),
                                             label_smoothing=smoothing)
    want.backward()
    assert_close(loss, want, torch.float32, "CrossEntropy", scale=4.0)
    assert_close(logits.grad, ref.grad, torch.bfloat16, "CrossEntropy's gradient")


def test_fp8_lm_head_on_gpu():
    """Under fusible.autocast the head's logits and dgrad GEMMs run in FP8 (torch's
    _scaled_mm): signal-to-noise floors against float32 logits' cross-entropy."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 4096, 1024, 32000
    head = ops.LinearCrossEntropy(hidden, vocab, device="cuda", dtype=torch.bfloat16)
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    x_ref = x.clone().float().requires_grad_()
    w_ref = head.weight.detach().float().requires_grad_()
    want = torch.nn.functional.cross_entropy(x_ref @ w_ref.t(), labels)
    want.backward()
    x = x.requires_grad_()
    with fusible.autocast():
        assert stage_names(ops.Sequential(head).plan(x, labels).forward) == [
            "LinearCrossEntropy"]
        loss = ops.Sequential(head)(x, labels)
    loss.backward()
    assert abs(loss.item() - want.item()) < 1e-2 * want.item()
    assert snr_db(x.grad, x_ref.grad) > 20
    assert snr_db(head.weight.grad, w_ref.grad) > 30


def test_attention_given_rotary_tables_on_gpu_equal_its_own():
    """The rotary kernel reading given tables (shared rows, or one per token; from a
    strided complex view as torchtitan's freqs_cis) rotates as it does with the tables it
    makes itself from the same angles: the same bits."""
    from fusible.functional.rotary import RotaryOptions, rotary_angles
    torch.manual_seed(0)
    heads, kv, d, batch, seq = 8, 2, 64, 2, 100
    x = torch.randn(batch, seq, (heads + 2 * kv) * d, device="cuda", dtype=torch.bfloat16)
    own = ops.Sequential(ops.Attention(heads, num_kv_heads=kv, rotary_base=1e4,
                                       rotary_interleaved=True))
    given = ops.Sequential(ops.Attention(heads, num_kv_heads=kv, rotary_tables=True,
                                         rotary_interleaved=True))
    cos, sin = rotary_angles(torch.arange(seq, device="cuda"),
                             RotaryOptions(1e4, d, True))
    freqs_cis = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
    pairs = torch.view_as_real(freqs_cis)  # strided: every other float
    results = []
    for model, extras in ((own, ()), (given, (cos, sin)),
                          (given, (cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)))):
        inp = x.clone().requires_grad_()
        y = model(inp, *extras)
        y.backward(torch.ones_like(y))
        results.append((y, inp.grad))
    for y, dx in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])
    y = given(x, pairs[..., 0], pairs[..., 1])  # the complex table's angles, float32-close
    assert _relative_error(y, results[0][0]) < 1e-2


@pytest.mark.parametrize("kv,causal", [(8, True), (2, True), (2, False)])
def test_attention_cudnn_on_gpu_matches_flash(kv, causal):
    """The cuDNN backend (opt-in) against FlashAttention on the same bf16 inputs: outputs
    and gradients within bf16 rounding of each other."""
    heads, d, batch, seq = 8, 64, 2, 333
    torch.manual_seed(0)
    x = torch.randn(batch, seq, (heads + 2 * kv) * d, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(batch, seq, heads * d, device="cuda", dtype=torch.bfloat16)
    results = []
    for backend in ("flash", "cudnn"):
        model = ops.Sequential(ops.Attention(heads, num_kv_heads=kv, causal=causal,
                                             rotary_base=1e4, backend=backend)).cuda()
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(dy)
        results.append((y.float(), xi.grad.float()))
    (y_flash, g_flash), (y_cudnn, g_cudnn) = results
    assert _relative_error(y_cudnn, y_flash) < 1e-2
    assert _relative_error(g_cudnn, g_flash) < 2e-2


def _record_triton_attention_calls(monkeypatch) -> list:
    """The names of fusible's Triton attention launchers, in call order, as they run."""
    from fusible.kernels import attention as kernels
    calls = []
    for name in ("attention_forward_triton", "attention_backward_triton"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel, _n=name, **kw: (
            calls.append(_n), _k(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,kv,causal", [(16, 8, True), (16, 2, True), (32, 1, False),
                                         (64, 2, True), (16, 4, False)])
def test_attention_triton_on_gpu_matches_float64(dtype, d, kv, causal, monkeypatch):
    """fusible's Triton attention kernels (the default up to 32-wide heads) against the
    float64 math formulas on the CPU: grouped heads, a length no tile divides, both masks."""
    heads, batch, seq = 8, 2, 333
    options = dict(num_kv_heads=kv, causal=causal, rotary_base=1e4)
    backend = None if d <= attn.TRITON_DEFAULT_HEAD_DIM else "triton"
    gpu = ops.Sequential(ops.Attention(heads, backend=backend, **options)).cuda()
    ref = ops.Sequential(ops.Attention(heads, backend="math", **options)).double()
    calls = _record_triton_attention_calls(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(batch, seq, (heads + 2 * kv) * d, dtype=torch.float64)
    x_gpu = x.to("cuda", dtype).requires_grad_()
    x_ref = x_gpu.detach().double().cpu().requires_grad_()
    y = gpu(x_gpu)
    want = ref(x_ref)
    dy = torch.randn_like(want)
    y.backward(dy.to("cuda", dtype))
    want.backward(dy)
    assert calls == ["attention_forward_triton", "attention_backward_triton"]
    bound = 8e-3 if dtype == torch.bfloat16 else 1e-3
    assert _relative_error(y.cpu(), want) < bound
    assert _relative_error(x_gpu.grad.cpu(), x_ref.grad) < 2 * bound


def test_attention_triton_on_gpu_compiles_bit_for_bit(fresh_dynamo, monkeypatch):
    """The Triton kernels inside a compiled layer's custom ops: the eager bits (the
    kernels run in both: eager, and the compiled graph's stages)."""
    from fusible.layers import TransformerLayer
    from fusible.testing import check_compiled_matches_eager
    calls = _record_triton_attention_calls(monkeypatch)
    torch.manual_seed(0)
    layer = TransformerLayer(256, 768, 16, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    check_compiled_matches_eager(layer, x, backend="inductor")
    assert calls.count("attention_forward_triton") >= 2
    assert calls.count("attention_backward_triton") >= 2


@pytest.mark.parametrize("fp8", [False, True])
def test_a_captured_training_step_replays_the_eager_steps_bit_for_bit(fp8):
    """fusible.capture_step on a native model (two TransformerLayers and the chunked LM
    head): 50 replays against the same 50 steps run eagerly from the same weights and
    optimizer state, fused AdamW with capturable=True; loss and every parameter equal."""
    import contextlib
    from fusible.layers import CausalLM

    def build():
        torch.manual_seed(0)
        model = CausalLM(512, 128, 256, 2, 4, num_kv_heads=2, device="cuda",
                         dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        return model, opt

    def make_step(model, opt):
        def step(ids):
            with fusible.autocast() if fp8 else contextlib.nullcontext():
                loss = model(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()
        return step

    gen = torch.Generator("cuda").manual_seed(1)
    batches = [torch.randint(0, 512, (2, 64), device="cuda", generator=gen) for _ in range(54)]
    eager_model, eager_opt = build()
    eager = make_step(eager_model, eager_opt)
    captured_model, captured_opt = build()
    captured = fusible.capture_step(make_step(captured_model, captured_opt), batches[0],
                                    optimizers=[captured_opt], warmup=3)
    for _ in range(4):  # the check run and the three warm-up steps, on the example batch
        eager(batches[0])
    for ids in batches[4:]:
        want = eager(ids)
        got = captured(ids).clone()
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    for (name, p), q in zip(captured_model.named_parameters(), eager_model.parameters()):
        assert torch.equal(p, q), name


def _converted_tiny_llama():
    """A two-layer bf16 Hugging Face Llama on CUDA from seed 0, converted with the fused
    loss, both layers fused whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=768,
                                      num_hidden_layers=2, num_attention_heads=16,
                                      num_key_value_heads=4, vocab_size=2048,
                                      max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    report = fusible.convert(model, fuse_loss=True)
    assert sum(new.startswith("TransformerLayer") for _, _, new in report.converted) == 2
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_captured_converted_hf_step_replays_the_eager_steps_bit_for_bit(compiled):
    """fusible.capture_step on a converted Hugging Face Llama (fused layers, the fused
    loss): 50 replays against the same steps run eagerly (the same step function, so the
    same .grad handling), loss and every parameter by name; compiled: the converted
    forward under torch.compile in both (the check run, the fourth step, runs its Python
    in both). The message names the first step that differs."""

    def build():
        model = _converted_tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        forward = lambda ids: model(input_ids=ids, labels=ids).loss  # noqa: E731
        if compiled:
            forward = torch.compile(forward, fullgraph=False)

        def step(ids):
            loss = forward(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()
        return model, step

    gen = torch.Generator("cuda").manual_seed(1)
    batches = [torch.randint(0, 2048, (2, 128), device="cuda", generator=gen)
               for _ in range(54)]
    eager_model, eager = build()
    captured_model, step = build()
    captured = fusible.capture_step(step, batches[0], warmup=3)
    for i in range(4):  # the warm-up steps and the check run (its Python), on the example
        with torch.compiler.set_stance("force_eager" if i == 3 else "default"):
            eager(batches[0])
    for i, ids in enumerate(batches[4:]):
        want = eager(ids)
        got = captured(ids).clone()
        assert torch.equal(got, want), f"step {i}: loss {got.item()} captured, {want.item()}"
    torch.cuda.synchronize()
    for (name, p), q in zip(captured_model.named_parameters(), eager_model.parameters()):
        assert torch.equal(p, q), name


def test_a_converted_hf_model_trains_under_reduce_overhead_as_compiled():
    """torch.compile(mode="reduce-overhead") (CUDA graph trees) on a converted Hugging
    Face Llama: 12 training steps give the losses and parameters of the same compiled
    steps without CUDA graphs, bit for bit."""
    gen = torch.Generator("cuda").manual_seed(1)
    batches = [torch.randint(0, 2048, (2, 128), device="cuda", generator=gen)
               for _ in range(12)]
    runs = []
    for mode in (None, "reduce-overhead"):
        model = _converted_tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        forward = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, mode=mode)
        losses = []
        for ids in batches:
            torch.compiler.cudagraph_mark_step_begin()
            loss = forward(ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        runs.append((torch.stack(losses), dict(model.named_parameters())))
    (want, params), (got, graphed) = runs
    assert torch.equal(got, want)
    for name, p in params.items():
        assert torch.equal(graphed[name], p), name
