"""Triton kernels against their PyTorch fallbacks, run on CPU by Triton's interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.activations import dact_dbias_torch
    from fusible.kernels.dact_dbias import dact_dbias_triton
    from fusible.testing import assert_close
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("gelu", "gelu_tanh", "relu", "silu"):
            for shape in ((70, 200), (3, 5, 33)):
                dy = torch.randn(shape).to(dtype)
                saved = (3 * torch.randn(shape)).to(dtype)
                if kind == "relu":
                    saved = saved.relu()
                ref_dact, ref_dbias = dact_dbias_torch(kind, dy.double(), saved.double())
                dact, dbias = dact_dbias_triton(kind, dy, saved, rows_per_program=64,
                                                block_m=16, block_n=64)
                assert_close(dact, ref_dact, dtype, f"{kind} {dtype} dact")
                assert_close(dbias, ref_dbias, dtype, f"{kind} {dtype} dbias")
    print("ok")
""")


def _run_interpreted(script: str) -> None:
    """Run ``script`` in a fresh process with Triton's interpreter; it prints "ok". The
    tests folder is on its path, for the FP8 constants of ``fp8_formats``."""
    path = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_dact_dbias_triton_matches_reference():
    _run_interpreted(_SCRIPT)


# Triton's interpreter rounds to FP8 differently from GPUs, so this checks the scale, the
# masking and the transposed layout; tests/test_cuda.py checks the bits on a GPU.
_CAST_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fp8_formats import FP8_MAX
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for fp8_dtype in FP8_MAX:
            for shape in ((70, 200), (3, 5, 48)):
                x = (torch.randn(shape).sign() * (1 + torch.rand(shape))).to(dtype)
                data, scale_inv, transpose = cast_to_fp8_triton(
                    x, fp8_dtype, FP8_MAX[fp8_dtype], True, block=256, block_m=16, block_n=32)
                ref = cast_tensorwise_torch(x, fp8_dtype, True)
                assert data.shape == ref[0].shape and data.dtype == fp8_dtype
                assert torch.equal(scale_inv, ref[1]), (scale_inv, ref[1])
                bits = data.view(torch.uint8)
                assert torch.equal(transpose.view(torch.uint8), bits.reshape(-1, shape[-1]).t())
                assert (bits != 0).all()  # every tile was written (no |x| rounds to 0 here)
                t_only, t_scale_inv = cast_to_fp8_triton(
                    x, fp8_dtype, FP8_MAX[fp8_dtype], True, block=256, block_m=16,
                    block_n=32, rowwise=False)  # the transposed copy alone
                assert torch.equal(t_scale_inv, scale_inv)
                assert torch.equal(t_only.view(torch.uint8), transpose.view(torch.uint8))
    x = torch.randn(40, 32)
    x[3, 5] = float("inf")  # scale 0, scale_inv inf: every dequantized value NaN
    assert torch.equal(cast_to_fp8_triton(x, torch.float8_e4m3fn, 448.0, False)[1],
                       cast_tensorwise_torch(x, torch.float8_e4m3fn)[1])
    x[7, 1] = float("nan")  # a NaN amax: a NaN scale, as in PyTorch
    ours = cast_to_fp8_triton(x, torch.float8_e4m3fn, 448.0, False)
    assert ours[1].isnan() and cast_tensorwise_torch(x, torch.float8_e4m3fn)[1].isnan()
    x = torch.full((40, 32), 1e-38)  # tiny: the scale stops at the largest float32
    assert torch.equal(cast_to_fp8_triton(x, torch.float8_e4m3fn, 448.0, False)[1],
                       cast_tensorwise_torch(x, torch.float8_e4m3fn)[1])
    print("ok")
""")


_TRANSPOSE_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.fp8_cast import transpose_bytes_triton
    torch.manual_seed(0)
    for shape in ((70, 200), (1, 33), (16, 16), (130, 5)):
        data = torch.randint(0, 256, shape, dtype=torch.uint8)
        for dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
            out = transpose_bytes_triton(data.view(dtype), block=16)
            assert out.dtype == dtype and out.is_contiguous()
            assert torch.equal(out.view(torch.uint8), data.t()), (shape, dtype)
    print("ok")
""")


def test_fp8_transpose_triton_matches_pytorch():
    _run_interpreted(_TRANSPOSE_SCRIPT)


_GPU_COVERS = pytest.mark.skipif(
    torch.cuda.is_available(), reason="tests/test_cuda.py checks these kernels on the GPU; "
    "Triton 3.6's interpreter rejects their runtime loop bounds")


# On the GPU machine (Triton 3.6, numpy 2.5) the interpreter fails these four with
# "TypeError: only 0-dimensional arrays can be converted to Python scalars", before and
# after the kernels' lazy import alike; test_cuda.py runs each kernel compiled there.
_GPU_RUNS_THEM = pytest.mark.skipif(
    torch.cuda.is_available(), reason="tests/test_cuda.py checks these kernels on the GPU; "
    "the interpreter there (Triton 3.6, numpy 2.5) fails on their scalar arguments")


_ZEROED_SLOTS_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels import fp8_cast
    from fusible.kernels.swiglu import swiglu_forward_fp8_triton
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    fp8_cast._ZeroedSlots.count = 3  # the slots wrap around twice below
    torch.manual_seed(0)
    for k in range(8):  # shrinking maxima: a slot not zeroed again keeps a larger one
        x = torch.randn(40, 64) * 2.0 ** -k
        _, scale_inv = fp8_cast.cast_to_fp8_triton(x, torch.float8_e4m3fn, 448.0, False,
                                                   block=256, block_m=16, block_n=32)
        assert torch.equal(scale_inv, cast_tensorwise_torch(x, torch.float8_e4m3fn)[1]), k
        y = x[:, :32] * torch.sigmoid(x[:, :32]) * x[:, 32:]
        _, scale_inv = swiglu_forward_fp8_triton(x, torch.float8_e4m3fn, 448.0, False,
                                                 block_m=16, block_n=16)
        assert torch.equal(scale_inv, cast_tensorwise_torch(y, torch.float8_e4m3fn)[1]), k
    slots = next(iter(fp8_cast._SLOTS.values()))
    assert slots.buffer.data_ptr() % 16 == 0 and all(
        s.data_ptr() % 16 == 0 for s in slots.slots)
    print("ok")
""")


@_GPU_COVERS
def test_amax_slots_start_from_zero_after_wrapping_around():
    """The amax accumulators handed out in turn (no fill per cast) are zero each time:
    with shrinking inputs a slot used again without its fill would give a larger
    amax, so a larger scale_inv than PyTorch's cast."""
    _run_interpreted(_ZEROED_SLOTS_SCRIPT)


@_GPU_COVERS
def test_fp8_cast_triton_scale_and_layout():
    _run_interpreted(_CAST_SCRIPT)


_DACT_FP8_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.dact_dbias import dact_dbias_fp8_triton, dact_dbias_triton
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fp8_formats import FP8_MAX
    torch.manual_seed(0)
    for kind in ("gelu_tanh", "relu"):
        for shape in ((70, 200), (3, 5, 48)):
            dy = torch.randn(shape).to(torch.bfloat16)
            saved = torch.randn(shape).to(torch.bfloat16)
            fp8 = torch.float8_e5m2
            q_data, q_scale_inv, q_t, dbias = dact_dbias_fp8_triton(
                kind, dy, saved, fp8, FP8_MAX[fp8], True, rows_per_program=64, block_m=16,
                block_n=64, cast_block_m=16, cast_block_n=32)
            ref_dact, ref_dbias = dact_dbias_triton(kind, dy, saved, rows_per_program=64,
                                                    block_m=16, block_n=64)
            data, scale_inv, transpose = cast_to_fp8_triton(
                ref_dact, torch.float8_e5m2, FP8_MAX[torch.float8_e5m2], True, block=256,
                block_m=16, block_n=32)
            assert q_data.shape == dy.shape and q_data.dtype == fp8
            assert torch.equal(q_scale_inv, scale_inv)
            assert torch.equal(q_data.view(torch.uint8), data.view(torch.uint8))
            assert torch.equal(q_t.view(torch.uint8), transpose.view(torch.uint8))
            assert torch.equal(dbias, ref_dbias)
    print("ok")
""")


@_GPU_COVERS
def test_dact_dbias_fp8_triton_matches_dact_then_cast():
    _run_interpreted(_DACT_FP8_SCRIPT)


_NORM_SWIGLU_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.activations import (glu_backward, glu_forward, swiglu_backward,
                                                swiglu_forward)
    from fusible.functional.norms import (layer_norm_backward, layer_norm_forward,
                                          rms_norm_backward, rms_norm_forward)
    from fusible.kernels.norms import norm_backward_triton, norm_forward_triton
    from fusible.kernels.swiglu import KINDS, swiglu_backward_triton, swiglu_forward_triton
    GATED_KINDS = [k for k in KINDS if k != "swiglu"]
    from fusible.testing import assert_close
    torch.manual_seed(0)

    def reference(center, x, w, b, ns):
        if center:
            return layer_norm_forward(x, w, b, ns, 1e-5)
        y, rstd = rms_norm_forward(x, w, ns, 1e-5)
        return y, None, rstd

    def reference_grads(center, dy, x, mean, rstd, w, b, ns, mask):
        if center:
            return layer_norm_backward(dy, x, mean, rstd, w, b, ns, list(mask))
        return (*rms_norm_backward(dy, x, rstd, w, ns, *mask[:2]), None)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((7, 66), (3, 5, 34), (0, 10)):
            x, dy = torch.randn(shape).to(dtype), torch.randn(*shape[:-1], shape[-1] // 2).to(dtype)
            y = swiglu_forward_triton(x, block_m=4, block_n=16)
            assert_close(y, swiglu_forward(x.double()), dtype, f"swiglu {dtype} {shape}")
            dx = swiglu_backward_triton(dy, x, block_m=4, block_n=16)
            assert_close(dx, swiglu_backward(dy.double(), x.double()), dtype, "swiglu dx")
            dx2, y2 = swiglu_backward_triton(dy, x, block_m=4, block_n=16, with_output=True)
            assert torch.equal(dx2, dx) and torch.equal(y2, y), f"swiglu {dtype} {shape}"
            for kind in GATED_KINDS:  # the other gated units share the kernels
                what = f"{kind} {dtype} {shape}"
                y = swiglu_forward_triton(x, block_m=4, block_n=16, kind=kind)
                assert_close(y, glu_forward(kind, x.double()), dtype, what)
                dx = swiglu_backward_triton(dy, x, block_m=4, block_n=16, kind=kind)
                assert_close(dx, glu_backward(kind, dy.double(), x.double()), dtype, f"{what} dx")
        # interleaved halves, and the clamped SwiGLU with limits that bite
        for kind, interleave, clamp in (("clamped_swiglu", 0, (1.0, 1.702, 1.0)),
                                        ("clamped_swiglu", 1, (0.5, 1.0, 0.0)),
                                        ("situ_glu", 0, (1.5, 0.75, 0.25)),
                                        ("situ_glu", 2, (0.3, 0.0, -0.5)),  # linear uncapped
                                        ("swiglu", 2, None), ("geglu", 4, None)):
            x, dy = torch.randn(7, 72).to(dtype), torch.randn(7, 36).to(dtype)
            layout = dict(kind=kind, interleave=interleave)
            if clamp:
                layout["clamp"] = clamp
                x[0, :4] = torch.tensor([clamp[0], -clamp[0], 2 * clamp[0], -2 * clamp[0]])
            what = f"{layout} {dtype}"
            y = swiglu_forward_triton(x, block_m=4, block_n=16, **layout)
            assert_close(y, glu_forward(x=x.double(), **layout), dtype, what)
            dx = swiglu_backward_triton(dy, x, block_m=4, block_n=16, **layout)
            assert_close(dx, glu_backward(grad_output=dy.double(), x=x.double(), **layout),
                         dtype, f"{what} dx")
            # the backward that writes the forward's result again: both, bit for bit
            dx2, y2 = swiglu_backward_triton(dy, x, block_m=4, block_n=16, **layout,
                                             with_output=True)
            assert torch.equal(dx2, dx) and torch.equal(y2, y), what
            consumed = dy.clone()  # y written over the gradient it was computed from
            dx3, y3 = swiglu_backward_triton(consumed, x, block_m=4, block_n=16, **layout,
                                             with_output=True, consume_grad=True)
            assert torch.equal(dx3, dx) and torch.equal(y3, y), what
            assert y3.data_ptr() == consumed.data_ptr() or dy.dtype != x.dtype, what
            read = x.clone()  # and the input gradient over the input it was computed from
            dx4, y4 = swiglu_backward_triton(dy, read, block_m=4, block_n=16, **layout,
                                             with_output=True, consume_input=True)
            assert torch.equal(dx4, dx) and torch.equal(y4, y), what
            assert dx4.data_ptr() == read.data_ptr() or dy.dtype != x.dtype, what
            read, consumed = x.clone(), dy.clone()  # both at once, as the fusion runs it
            dx5, y5 = swiglu_backward_triton(consumed, read, block_m=4, block_n=16, **layout,
                                             with_output=True, consume_grad=True,
                                             consume_input=True)
            assert torch.equal(dx5, dx) and torch.equal(y5, y), what
        for shape, ns in (((7, 70), [70]), ((3, 5, 3, 12), [3, 12]), ((0, 8), [8])):
            # an offset mean, so that LayerNorm's centring shows
            x, dy = (3 * torch.randn(shape) + 2).to(dtype), torch.randn(shape).to(dtype)
            w, b = torch.randn(ns).to(dtype), torch.randn(ns).to(dtype)
            for center in (True, False):
                what = f"{'layer' if center else 'rms'}_norm {dtype} {shape}"
                y, mean, rstd = norm_forward_triton(x, w, b if center else None, 1e-5, center,
                                                    block_n=16)
                ref_y, ref_mean, ref_rstd = reference(center, x.double(), w.double(),
                                                      b.double(), ns)
                assert_close(y, ref_y, dtype, what)
                assert rstd.shape == ref_rstd.shape and rstd.dtype == torch.float32
                assert_close(rstd, ref_rstd, torch.float32, f"{what} rstd")
                assert (mean is None) != center
                if center:
                    assert_close(mean, ref_mean, torch.float32, f"{what} mean")
                # tiles narrower than a row (two passes) and whole rows; few programs
                for mask, block_n, programs in (
                        ((True, True, True), 16, 3), ((True, False, False), 16, None),
                        ((False, True, False), 16, 2), ((False, False, True), 16, 2),
                        ((True, True, True), None, 3), ((True, False, True), None, None),
                        ((False, True, False), None, 2)):
                    got = norm_backward_triton(dy, x, mean, rstd, w, center, *mask,
                                               block_n=block_n, programs=programs)
                    want = reference_grads(center, dy.double(), x.double(), ref_mean,
                                           ref_rstd, w.double(), b.double(), ns, mask)
                    for g, r, need, name in zip(got, want, mask, ("dx", "dweight", "dbias")):
                        if need and (center or name != "dbias"):
                            assert_close(g, r, dtype, f"{what} {name} {block_n}")
                        else:
                            assert g is None, (what, name)
                if not center and x.numel():  # a residual branch's gradient added to dx
                    add = torch.randn(shape).to(dtype)
                    for block_n in (16, None):  # tiles, and whole rows
                        dx, _, _ = norm_backward_triton(dy, x, None, rstd, w, False, True, False,
                                                        block_n=block_n, accumulate_into=add)
                        want = reference_grads(False, dy.double(), x.double(), None, ref_rstd,
                                               w.double(), None, ns, (True, False, False))[0]
                        assert_close(dx, want + add.double(), dtype, f"{what} dx + add")
            if dtype != torch.float32 and x.numel():  # a zero-centred gamma: 1 + w in float32
                w32 = w.float() + 1
                for center in (True, False):
                    what = f"{'layer' if center else 'rms'}_norm {dtype} {shape} float32 weight"
                    y, mean, rstd = norm_forward_triton(x, w32, b if center else None, 1e-5,
                                                        center, block_n=16)
                    ref_y, ref_mean, ref_rstd = reference(center, x.double(), w32.double(),
                                                          b.double(), ns)
                    assert y.dtype == dtype
                    assert_close(y, ref_y, dtype, what)
                    mask = (True, True, center)
                    dx, dw, _ = norm_backward_triton(dy, x, mean, rstd, w32, center, *mask)
                    want = reference_grads(center, dy.double(), x.double(), ref_mean, ref_rstd,
                                           w32.double(), b.double(), ns, mask)
                    assert dw.dtype == torch.float32  # rounded to the parameter's by the op
                    assert_close(dx, want[0], dtype, f"{what} dx")
                    assert_close(dw, want[1], dtype, f"{what} dweight")
    print("ok")
""")


@_GPU_COVERS
def test_norms_and_swiglu_triton_match_fp64():
    _run_interpreted(_NORM_SWIGLU_SCRIPT)


_FUSED_CAST_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fusible.kernels.norms import norm_forward_fp8_triton, norm_forward_triton
    from fusible.kernels.swiglu import (swiglu_backward_fp8_triton, swiglu_backward_triton,
                                        swiglu_forward_fp8_triton, swiglu_forward_triton)
    from fusible.testing import same_bits
    from fp8_formats import FP8_MAX
    torch.manual_seed(0)

    def same(fused, plain, fp8, columnwise):
        ref = cast_to_fp8_triton(plain, fp8, FP8_MAX[fp8], columnwise, block=256,
                                 block_m=16, block_n=32)
        assert len(fused) == len(ref) and fused[0].shape == plain.shape
        for got, want in zip(fused, ref):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert same_bits(got, want)

    for fp8 in FP8_MAX:
        for columnwise in (False, True):
            for shape in ((70, 96), (3, 5, 34)):
                x = torch.randn(shape).to(torch.bfloat16)
                dy = torch.randn(*shape[:-1], shape[-1] // 2).to(torch.bfloat16)
                args = (fp8, FP8_MAX[fp8], columnwise)
                same(swiglu_forward_fp8_triton(x, *args, block_m=4, block_n=16),
                     swiglu_forward_triton(x), fp8, columnwise)
                same(swiglu_backward_fp8_triton(dy, x, *args, block_m=4, block_n=16),
                     swiglu_backward_triton(dy, x), fp8, columnwise)
                # each other gated unit in some of these eight cases
                case = 4 * list(FP8_MAX).index(fp8) + 2 * columnwise + len(shape) - 2
                kind = ("geglu", "glu", "reglu", "sreglu", "qgeglu")[case % 5]
                same(swiglu_forward_fp8_triton(x, *args, block_m=4, block_n=16, kind=kind),
                     swiglu_forward_triton(x, kind=kind), fp8, columnwise)
                same(swiglu_backward_fp8_triton(dy, x, *args, block_m=4, block_n=16, kind=kind),
                     swiglu_backward_triton(dy, x, kind=kind), fp8, columnwise)
                layout = dict(kind=("clamped_swiglu", "situ_glu")[case % 2],
                              clamp=(1.0, 1.5, 0.5), interleave=2 if shape[-1] % 4 == 0 else 1)
                same(swiglu_forward_fp8_triton(x, *args, block_m=4, block_n=16, **layout),
                     swiglu_forward_triton(x, **layout), fp8, columnwise)
                same(swiglu_backward_fp8_triton(dy, x, *args, block_m=4, block_n=16, **layout),
                     swiglu_backward_triton(dy, x, **layout), fp8, columnwise)
                # one normalised dimension, and two (the transposed copy is still over the
                # last dimension alone)
                for ns in (shape[-1:], shape[-2:]) if columnwise and len(shape) > 2 \
                        else (shape[-1:],):
                    w, b = (torch.randn(ns).to(torch.bfloat16) for _ in range(2))
                    for center in (True, False):
                        bias = b if center else None
                        parts, mean, rstd = norm_forward_fp8_triton(
                            x, w, bias, 1e-5, center, *args, block_n=16, cast_block=(16, 32))
                        y, ref_mean, ref_rstd = norm_forward_triton(x, w, bias, 1e-5, center,
                                                                    block_n=16)
                        assert torch.equal(rstd, ref_rstd)
                        assert (mean is None) == (ref_mean is None)
                        assert mean is None or torch.equal(mean, ref_mean)
                        same(parts, y, fp8, columnwise)
    print("ok")
""")


@_GPU_COVERS
def test_fused_fp8_outputs_are_the_plain_kernel_then_the_cast():
    """LayerNorm, RMSNorm and SwiGLU writing FP8 themselves: the bits of their plain
    kernel followed by the FP8 cast kernel (scale, data, transposed copy)."""
    _run_interpreted(_FUSED_CAST_SCRIPT)


_ACTIVATION_CAST_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.activations import activation_forward
    from fusible.kernels.activation_cast import activation_fp8_triton, activation_triton
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fusible.testing import assert_close
    from fp8_formats import FP8_MAX
    torch.manual_seed(0)
    for kind in ("gelu", "gelu_tanh", "silu"):
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((37, 100), (3, 5, 48)):
                x = (3 * torch.randn(shape)).to(dtype)
                y = activation_triton(kind, x, block_m=16, block_n=32)
                assert_close(y, activation_forward(kind, x.double()), dtype, f"{kind} {dtype}")
                for fp8 in FP8_MAX:
                    fused = activation_fp8_triton(kind, x, fp8, FP8_MAX[fp8], True, block_m=16,
                                                  block_n=32)
                    ref = cast_to_fp8_triton(y, fp8, FP8_MAX[fp8], True, block=256,
                                             block_m=16, block_n=32)
                    assert fused[0].shape == x.shape and fused[0].dtype == fp8
                    assert torch.equal(fused[1], ref[1])
                    for got, want in (fused[0], ref[0]), (fused[2], ref[2]):
                        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    print("ok")
""")


@_GPU_COVERS
def test_activation_writing_fp8_is_the_activation_then_the_cast():
    _run_interpreted(_ACTIVATION_CAST_SCRIPT)


_NORM_RECAST_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.norms import norm_cast_fp8_triton, norm_forward_fp8_triton
    from fp8_formats import FP8_MAX
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):  # the copy in the kernel, and from the data
        for center in (True, False):
            x = torch.randn(37, 48).to(dtype)
            w, b = torch.randn(48).to(dtype), torch.randn(48).to(dtype)
            bias = b if center else None
            for fp8 in FP8_MAX:
                amax = torch.zeros(())
                full, mean, rstd = norm_forward_fp8_triton(
                    x, w, bias, 1e-5, center, fp8, FP8_MAX[fp8], True, block_n=16,
                    cast_block=(16, 32), amax=amax)
                again = norm_cast_fp8_triton(x, w, bias, mean, rstd, amax, center, fp8,
                                             FP8_MAX[fp8], True, (16, 32), rowwise=False)
                assert len(again) == 2 and torch.equal(again[1], full[1])
                assert again[0].shape == (48, 37)
                assert torch.equal(again[0].view(torch.uint8), full[2].view(torch.uint8))
    print("ok")
""")


@_GPU_COVERS
def test_norm_output_quantized_again_by_a_kept_amax_has_the_same_bits():
    """RecomputeNormLinear's recomputation: the norm's cast pass by the forward's amax,
    the transposed copy alone, gives the forward's bytes and scale."""
    _run_interpreted(_NORM_RECAST_SCRIPT)


def test_cached_launches_reuse_only_an_identical_specialisation():
    """A Triton kernel's launch skips ``JITFunction.run`` only for a call that Triton
    would specialise exactly as an earlier one: any change of dtype, alignment, an int's
    width, its being 1 or a multiple of 16, or a constexpr goes through the JIT again."""
    from fusible.kernels import CachedLaunches, jit, tl, triton
    if triton is None:
        pytest.skip("Triton is not installed")
    jit_calls, direct = [], []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: direct.append((grid, args))

    def jit_run(*args, grid, warmup, **kwargs):
        jit_calls.append(args)
        return Compiled()

    @jit
    def kernel(x_ptr, n, scale, BLOCK: tl.constexpr):
        pass

    launch = CachedLaunches(kernel, jit_run)
    x = torch.zeros(64)
    launch(x, 32, 0.5, grid=(4,), warmup=False, BLOCK=16)
    launch(x, 48, 0.25, grid=(2, 3), warmup=False, BLOCK=16)  # same specialisation
    assert len(jit_calls) == 1 and direct == [((2, 3, 1), (x, 48, 0.25, 16))]
    for args, block in (((x[1:], 32, 0.5), 16), ((x, 1, 0.5), 16), ((x, 33, 0.5), 16),
                        ((x.double(), 32, 0.5), 16), ((x, 2**40, 0.5), 16),
                        ((x, 2**63, 0.5), 16), ((x, 32, 0.5), 32)):
        launch(*args, grid=(1,), warmup=False, BLOCK=block)
    assert len(jit_calls) == 8 and len(direct) == 1
    launch(x, 2**41, 0.5, grid=(1,), warmup=False, BLOCK=16)  # i64 again: a hit
    assert len(jit_calls) == 8 and len(direct) == 2
    launch(x, 32, 0.5, grid=(1,), warmup=True, BLOCK=16)  # warm-ups always compile
    assert len(jit_calls) == 9
    assert isinstance(kernel.run, CachedLaunches)  # the library's kernels launch so


def test_custom_op_kernels_get_fresh_amax_zeros(monkeypatch):
    """Outside a custom op the amax accumulators are slots of one buffer; inside one
    (where CUDA graph trees may be allocating from a graph's pool) fresh zeros."""
    from fusible.kernels import fp8_cast
    monkeypatch.setattr(fp8_cast, "_SLOTS", {})
    slot = fp8_cast.zeroed_amax(torch.device("cpu"))
    buffer = fp8_cast._SLOTS[torch.device("cpu"), 0].buffer
    assert slot.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    inside = fp8_cast.fresh_zeros_inside(lambda: fp8_cast.zeroed_amax(torch.device("cpu")))()
    assert inside.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert inside.shape == () and inside.dtype == torch.float32 and inside.item() == 0
    assert fp8_cast._IN_OP == [0]


# The interpreter rounds to FP8 differently from GPUs (see _CAST_SCRIPT): the scales, the
# batches' offsets and both layouts here; tests/test_cuda.py checks the bits on a GPU.
_BATCHED_CAST_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.grouped_fp8 import grouped_weight_amax
    from fusible.kernels.fp8_cast import cast_batched_triton, cast_to_fp8_triton
    torch.manual_seed(0)
    E4M3 = torch.float8_e4m3fn
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(3, 20, 36) * torch.tensor([1.0, 64.0, 2.0 ** -7]).view(3, 1, 1)
        w = w.to(dtype)
        amax = grouped_weight_amax(w)
        data, none, scale_inv = cast_batched_triton(w, amax, E4M3, 448.0, True, False, 8, 16)
        assert none is None and data.shape == (3, 20, 36) and data.dtype == E4M3
        for b in range(3):  # each batch as the plain kernel casts it with its amax
            alone = cast_to_fp8_triton(w[b], E4M3, 448.0, False, block_m=8, block_n=16,
                                       amax=amax[b])
            assert torch.equal(data[b].view(torch.uint8), alone[0].view(torch.uint8))
            assert torch.equal(scale_inv[b], alone[1])
        none, t, t_scale_inv = cast_batched_triton(w, amax, E4M3, 448.0, False, True, 8, 16)
        assert none is None and t.shape == (3, 36, 20) and torch.equal(t_scale_inv, scale_inv)
        assert torch.equal(t.view(torch.uint8), data.view(torch.uint8).transpose(-2, -1))
        both = cast_batched_triton(w, amax, E4M3, 448.0, True, True, 8, 16)
        assert torch.equal(both[0].view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(both[1].view(torch.uint8), t.view(torch.uint8))
    print("ok")
""")


def test_batched_fp8_cast_triton_scales_and_layouts():
    _run_interpreted(_BATCHED_CAST_SCRIPT)


# The FP8 casts' bits are checked on the GPU (tests/test_cuda.py); here the values against
# the FP64 PyTorch path, the row sums, odd shapes, interleaving and the clamps.
_SCALED_GLU_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.activations import scaled_glu_backward, scaled_glu_forward
    from fusible.kernels.scaled_glu import (scaled_glu_backward_triton,
                                            scaled_glu_forward_triton)
    from fusible.kernels.swiglu import KINDS
    from fusible.testing import assert_close
    torch.manual_seed(0)
    cases = [(kind, 0, None) for kind in KINDS if kind not in ("clamped_swiglu", "situ_glu")]
    cases += [("clamped_swiglu", 1, (1.0, 1.702, 1.0)), ("situ_glu", 2, (1.5, 0.75, 0.25))]
    for dtype in (torch.float32, torch.bfloat16):
        for kind, interleave, clamp in cases:
            layout = dict(kind=kind, interleave=interleave)
            if clamp:
                layout["clamp"] = clamp
            for shape in ((7, 72), (3, 5, 40)):
                x = torch.randn(shape).to(dtype)
                dy = torch.randn(*shape[:-1], shape[-1] // 2).to(dtype)
                s = torch.rand(shape[:-1]).to(dtype)
                what = f"{layout} {dtype} {shape}"
                y = scaled_glu_forward_triton(x, s, block_m=4, block_n=16, **layout)
                assert_close(y, scaled_glu_forward(x=x.double(), scales=s.double(), **layout),
                             dtype, what)
                for need in ((True, True), (True, False), (False, True)):
                    dx, ds = scaled_glu_backward_triton(dy, x, s, *need, block_m=4,
                                                        block_n=16, **layout)
                    rdx, rds = scaled_glu_backward(grad_output=dy.double(), x=x.double(),
                                                   scales=s.double(), need_grad_input=need[0],
                                                   need_grad_scales=need[1], **layout)
                    assert (dx is None) == (not need[0]) and (ds is None) == (not need[1])
                    if need[0]:
                        assert_close(dx, rdx, dtype, f"{what} dx")
                    if need[1]:  # a sum over the row: about sqrt(N) roundings' worth
                        assert_close(ds, rds, dtype, f"{what} ds", scale=4)
                parts = scaled_glu_forward_triton(x, s, (torch.float8_e4m3fn, 448.0, True),
                                                  block_m=4, block_n=16, **layout)
                data, scale_inv, transpose = parts
                assert data.shape == y.shape and transpose.shape == (y.shape[-1], y.numel() //
                                                                     y.shape[-1])
                assert torch.allclose(scale_inv, y.float().abs().max() / 448.0, rtol=1e-6)
                (g_data, g_scale_inv, g_t), _ = scaled_glu_backward_triton(
                    dy, x, s, True, False, (torch.float8_e4m3fn, 448.0, True), block_m=4,
                    block_n=16, **layout)
                assert g_data.shape == x.shape and g_t.shape == (x.shape[-1], x.numel() //
                                                                 x.shape[-1])
                dx, _ = scaled_glu_backward_triton(dy, x, s, True, False, block_m=4,
                                                   block_n=16, **layout)
                assert torch.allclose(g_scale_inv, dx.float().abs().max() / 448.0, rtol=1e-6)
    print("ok")
""")


@_GPU_RUNS_THEM
def test_scaled_glu_triton_matches_pytorch():
    _run_interpreted(_SCALED_GLU_SCRIPT)


# float32 and float16: Triton 3.6's interpreter returns garbage for a bf16 tl.dot (a 16 x 16
# product off by 1e10); tests/test_cuda.py runs the bf16 kernels on the GPU.
_GROUPED_GEMM_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.grouped_gemm import grouped_mm_triton, grouped_wgrad_triton
    from fusible.testing import assert_close
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for sizes in ((5, 0, 17, 10), (0, 0, 0, 0), (33, 0, 0, 1)):
            splits = torch.tensor(sizes)
            rows, g = sum(sizes), len(sizes)
            x = torch.randn(rows, 40).to(dtype)
            w = torch.randn(g, 24, 40).to(dtype)
            dy = torch.randn(rows, 24).to(dtype)
            want_y, want_dx = torch.zeros(rows, 24).double(), torch.zeros(rows, 40).double()
            want_dw, start = torch.zeros(g, 24, 40).double(), 0
            for i, n in enumerate(sizes):
                xs, dys = x[start:start + n].double(), dy[start:start + n].double()
                want_y[start:start + n] = xs @ w[i].double().t()
                want_dx[start:start + n] = dys @ w[i].double()
                want_dw[i] = dys.t() @ xs
                start += n
            what = f"{dtype} {sizes}"
            y = grouped_mm_triton(x, w, splits, 16, 16, 16)
            assert_close(y, want_y, dtype, f"y {what}", scale=4)
            dx = grouped_mm_triton(dy, w.transpose(-2, -1), splits, 16, 16, 16)  # dgrad
            assert_close(dx, want_dx, dtype, f"dx {what}", scale=4)
            dw = grouped_wgrad_triton(dy, x, splits, g, 16, 16, 16)
            assert_close(dw, want_dw, dtype, f"dw {what}", scale=4)
            for i, n in enumerate(sizes):
                assert n or not dw[i].any()  # an empty group: zeros
    # FP8 operands with their scales: as the CPU's loop of torch._scaled_mm computes them
    from fusible.functional.grouped_fp8 import (cast_grouped_weight, fp8_grouped_mm,
                                                fp8_grouped_wgrad)
    from fusible.quantization.casts.tensorwise import cast_tensorwise
    E4M3 = torch.float8_e4m3fn
    sizes = (16, 0, 32, 16)
    splits = torch.tensor(sizes)
    x, dy = torch.randn(64, 48), torch.randn(64, 40)
    w = torch.randn(4, 40, 48) * torch.tensor([1.0, 8.0, 0.25, 2.0]).view(4, 1, 1)
    xq, sx, xt = cast_tensorwise(x, E4M3, True)
    dyq, sdy, dyt = cast_tensorwise(dy, E4M3, True)
    wq, wt, sw = cast_grouped_weight(w, E4M3, columnwise=True)
    for out_dtype in (torch.float32, torch.float16):
        got = grouped_mm_triton(xq, wq, splits, 16, 16, 16, scales=(sx, sw), out_dtype=out_dtype)
        want = fp8_grouped_mm(xq, sx, wq, sw, splits, out_dtype, fast_accum=False)
        assert_close(got, want, out_dtype, f"fp8 y {out_dtype}")
        got = grouped_mm_triton(dyq, wt, splits, 16, 16, 16, scales=(sdy, sw),
                                out_dtype=out_dtype)
        want = fp8_grouped_mm(dyq, sdy, wt, sw, splits, out_dtype, fast_accum=False)
        assert_close(got, want, out_dtype, f"fp8 dx {out_dtype}")
        got = grouped_wgrad_triton(dyt.t(), xt.t(), splits, 4, 16, 16, 16,
                                   scales=(sdy, sx), out_dtype=out_dtype)
        want = fp8_grouped_wgrad(dyt, sdy, xt, sx, splits, 4, out_dtype)
        assert_close(got, want, out_dtype, f"fp8 dw {out_dtype}")
        assert not got[1].any()
    print("ok")
""")


@_GPU_RUNS_THEM
def test_grouped_gemm_triton_matches_a_loop():
    _run_interpreted(_GROUPED_GEMM_SCRIPT)


# Small integers times powers of two: every product and sum exact, so the kernels and the
# PyTorch arithmetic must agree bit for bit; two column blocks (1100 > 1024).
_MOE_ROWS_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.moe_rows import _combine_rows_impl, _gather_rows_impl
    from fusible.kernels.moe_rows import combine_rows_triton, gather_rows_triton
    torch.manual_seed(0)
    tokens, k, h = 5, 3, 1100
    row_copy = torch.tensor([4, -1, 0, 14, 7, -1, 2, 9, 13, 1, 3, 5, 6, -1, 8, 10, 11, 12])
    copy_row = torch.full((tokens * k,), -1)
    kept = row_copy >= 0
    copy_row[row_copy[kept]] = torch.arange(row_copy.numel())[kept]
    copy_row[[5, 12]] = -1  # two dropped copies (no row reads them either way)
    row_copy[row_copy == 5] = -1
    row_copy[row_copy == 12] = -1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randint(-8, 8, (tokens, h)).to(dtype)
        y = torch.randint(-8, 8, (row_copy.numel(), h)).to(dtype)
        w = (2.0 ** torch.randint(-3, 2, (tokens * k,))).to(dtype)
        for scales, dots_with in ((None, None), (w, None), (w, y)):
            got = gather_rows_triton(x, row_copy, k, scales, dots_with)
            want = _gather_rows_impl(x, row_copy, k, scales, dots_with)
            assert torch.equal(got[0], want[0]), (dtype, scales is None)
            assert not got[0][row_copy < 0].any()
            if dots_with is not None:
                assert torch.equal(got[1], want[1]) and got[1][[5, 12]].eq(0).all()
        for weights in (None, w.view(tokens, k)):
            got = combine_rows_triton(y, copy_row.view(tokens, k), weights)
            want = _combine_rows_impl(y, copy_row.view(tokens, k), weights)
            assert got.dtype == dtype and torch.equal(got, want), (dtype, weights is None)
    print("ok")
""")


@_GPU_RUNS_THEM
def test_moe_row_moves_triton_match_pytorch():
    _run_interpreted(_MOE_ROWS_SCRIPT)


# The interpreter rounds to FP8 differently from GPUs (see _CAST_SCRIPT; it sends
# -127.03 to -64, not -128, at a binade's top): the per-row scales bit for bit, the data's
# signs and zeros, its values within that error; tests/test_cuda.py checks the bits on a
# GPU.
_ROWWISE_CAST_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.fp8_rowwise import cast_rows_and_columns_triton, cast_rows_triton
    from fusible.quantization.casts.rowwise import _cast_rows
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for fp8_dtype, fp8_max in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
            for shape in ((13, 70), (1, 5), (9, 1)):
                x = torch.randn(shape) * torch.logspace(-3, 3, shape[0]).view(-1, 1)
                x = (x.sign() * (x.abs() + 1e-3)).to(dtype)  # no value rounds to 0
                x[0, 0] = 0.0 if shape[1] > 1 else x[0, 0]
                data, scale_inv = cast_rows_triton(x, fp8_dtype, fp8_max, block_m=4,
                                                   block_n=32)
                want, want_scale_inv = _cast_rows(x, fp8_dtype)
                assert data.shape == shape and scale_inv.shape == (shape[0], 1)
                assert torch.equal(scale_inv, want_scale_inv), (shape, fp8_dtype)
                got, ref = data.float(), want.float()
                assert torch.equal(got.sign(), ref.sign())
                assert ((got - ref).abs() <= 0.5 * ref.abs()).all()
                # both layouts from the row and column maxima (two kernels, atomic maxima)
                for rowwise in (True, False):
                    parts = cast_rows_and_columns_triton(x, fp8_dtype, fp8_max, rowwise,
                                                         block_m=8, block_n=32)
                    wanted = [want, want_scale_inv, *_cast_rows(x.t(), fp8_dtype)]
                    for k, (g, w) in enumerate(zip(parts, wanted)):
                        if not rowwise and k < 2:
                            assert g is None
                        elif k % 2:  # the scales
                            assert torch.equal(g, w), (shape, fp8_dtype, k)
                        else:  # subnormals (small rows in a column's scale) may round to 0
                            tiny = torch.finfo(fp8_dtype).smallest_normal
                            a, b = g.float(), w.float()
                            assert g.shape == w.shape
                            assert ((a - b).abs() <= 0.5 * b.abs() + tiny).all()
                # a group's column maxima: larger ones replace the local ones
                group = x.float().abs().amax(0) * torch.where(
                    torch.arange(shape[1]) % 2 == 0, 4.0, 0.0)
                parts = cast_rows_and_columns_triton(x, fp8_dtype, fp8_max, False, block_m=8,
                                                     block_n=32, column_amax=group)
                amax = torch.maximum(x.float().abs().amax(0), group).view(-1, 1)
                _, want_t_scale_inv = _cast_rows(x.t(), fp8_dtype, amax)
                assert torch.equal(parts[3], want_t_scale_inv), (shape, fp8_dtype)
    print("ok")
""")


@_GPU_RUNS_THEM
def test_rowwise_fp8_cast_triton_matches_pytorch():
    _run_interpreted(_ROWWISE_CAST_SCRIPT)


# The block casts (1x128 tiles, 128x128 blocks, MX 1x32 with power-of-two scales), data
# and transposed copy from one read: the scales bit for bit, the data within the
# interpreter's FP8 rounding error (as above), on ragged shapes.
_BLOCK_CAST_SCRIPT = textwrap.dedent("""
    import itertools
    import torch
    from fusible.kernels.fp8_blocks import cast_blocks_triton
    from fusible.quantization.casts.blocks import _cast_torch
    torch.manual_seed(0)
    sources = ((torch.bfloat16, torch.float8_e4m3fn, 448.0),
               (torch.float32, torch.float8_e5m2, 57344.0))
    blocks = ((128, False, False), (128, True, False), (32, False, True))
    for (dtype, fp8_dtype, fp8_max), (group, square, power2), (rowwise, columnwise) in \\
            itertools.product(sources, blocks, ((True, True), (False, True))):
        x = torch.randn(130, 200) * torch.logspace(-3, 3, 130).view(-1, 1)
        x = (x.sign() * (x.abs() + 1e-3)).to(dtype)
        x[7, :] = 0.0
        got = cast_blocks_triton(x, fp8_dtype, fp8_max, group, square, power2, rowwise,
                                 columnwise)
        want = _cast_torch(x, fp8_dtype, group, square, power2, rowwise, columnwise)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is None:
                continue
            assert g.shape == w.shape and g.dtype == w.dtype
            if g.dtype != fp8_dtype:  # the scales
                assert torch.equal(g.float(), w.float()), (group, square)
                continue
            a, b = g.float(), w.float()
            tiny = torch.finfo(fp8_dtype).smallest_normal
            normal = b.abs() >= tiny  # subnormals may round to 0 there
            assert torch.equal(a.sign()[normal], b.sign()[normal])
            assert ((a - b).abs() <= 0.5 * b.abs() + tiny).all()
    print("ok")
""")


def test_block_fp8_cast_triton_matches_pytorch():
    _run_interpreted(_BLOCK_CAST_SCRIPT)


def test_importing_triton_warns_nothing():
    """Triton's first import (the stand-ins replaced in every module namespace) reads no
    deprecated attribute of other modules (torch.distributed.reduce_op warned)."""
    pytest.importorskip("triton")
    code = ("import torch, torch.distributed, fusible\n"
            "from fusible.kernels import require_triton\n"
            "require_triton('a test')\nprint('ok')")
    out = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


_CROSS_ENTROPY_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.cross_entropy import LossOptions, chunk_logits_grad, chunk_losses
    from fusible.kernels.cross_entropy import chunk_cross_entropy_triton
    from fusible.testing import assert_close
    torch.manual_seed(0)
    tokens, vocab = 9, 300  # five loop steps of 64, the last one partial
    for dtype in (torch.float32, torch.bfloat16):
        for smoothing, z_loss in ((0.0, 0.0), (0.1, 1e-3)):
            opts = LossOptions(ignore_index=-100, label_smoothing=smoothing, z_loss=z_loss)
            z = (torch.randn(tokens, vocab) * 4).to(dtype)
            labels = torch.randint(0, vocab, (tokens,))
            labels[2] = -100
            labels[5] = vocab - 1  # in the partial step
            scale = torch.rand(tokens) + 0.5
            want_loss, want_lse = chunk_losses(z.double(), labels, opts)
            want_dz = chunk_logits_grad(z.double(), want_lse, labels, opts, scale.double())
            losses, lse = torch.empty(tokens), torch.empty(tokens)
            chunk_cross_entropy_triton(z, labels, -100, smoothing, z_loss, losses, lse,
                                       block=64)  # no gradient: z untouched
            assert_close(losses, want_loss, torch.float32, "loss")
            assert_close(lse, want_lse, torch.float32, "lse")
            dz = torch.empty_like(z)
            given = torch.empty(tokens)
            chunk_cross_entropy_triton(z, labels, -100, smoothing, z_loss, given, lse, scale,
                                       dz, lse_given=True, block=64)
            assert_close(dz, want_dz, dtype, f"dz {dtype}")
            assert not dz[2].any()  # the ignored token
            chunk_cross_entropy_triton(z, labels, -100, smoothing, z_loss, losses, lse, scale,
                                       z, block=64)  # in place: z becomes its gradient
            assert_close(z, want_dz, dtype, f"dz in place {dtype}")
            assert_close(losses, want_loss, torch.float32, "loss with the gradient")
    # a first block of -inf logits (a masked vocabulary), a whole row of them ignored
    z = torch.randn(3, vocab)
    z[0, :64] = float("-inf")
    z[1] = float("-inf")
    labels = torch.tensor([100, -100, 5])
    opts = LossOptions()
    want_loss, want_lse = chunk_losses(z.double(), labels, opts)
    want_dz = chunk_logits_grad(z.double(), want_lse, labels, opts, torch.ones(3).double())
    losses, lse, dz = torch.empty(3), torch.empty(3), torch.empty_like(z)
    chunk_cross_entropy_triton(z, labels, -100, 0.0, 0.0, losses, lse, torch.ones(3), dz,
                               block=64)
    assert not want_dz.isnan().any() and not dz.isnan().any() and not dz[1].any()
    assert_close(losses, want_loss, torch.float32, "loss past -inf logits")
    assert torch.equal(lse[1], want_lse[1].float()) and lse[1] == float("-inf")
    assert_close(lse[[0, 2]], want_lse[[0, 2]], torch.float32, "lse past -inf logits")
    assert_close(dz, want_dz, torch.float32, "dz past -inf logits")
    print("ok")
""")


@_GPU_COVERS
def test_chunk_cross_entropy_triton_matches_pytorch():
    _run_interpreted(_CROSS_ENTROPY_SCRIPT)


_ATTENTION_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional import attention as attn
    from fusible.kernels.attention import attention_backward_triton, attention_forward_triton
    from fusible.testing import assert_close
    torch.manual_seed(0)
    tiles = (((32, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)),  # several blocks a row
             ((64, 64, 4, 1), (64, 64, 4, 1), (64, 64, 4, 1)))  # one partial block
    for causal in (True, False):
        # grouped heads and a length no block divides; one kv head per query head
        for b, s, h, kv, d in ((2, 45, 4, 2, 16), (1, 40, 2, 2, 32)):
            # (float16, not bfloat16: the interpreter's bfloat16 tl.dot is wrong, Triton
            # 3.9; tests/test_cuda.py runs bfloat16 on a GPU)
            for dtype in (torch.float32, torch.float16):
                q = torch.randn(b, s, h, d).to(dtype)
                k, v = (torch.randn(b, s, kv, d).to(dtype) for _ in range(2))
                dout = torch.randn(b, s, h, d).to(dtype)
                options = attn.AttentionOptions(causal, d ** -0.5, 0, "math")
                want, want_lse, _ = attn.attention_forward(q.double(), k.double(),
                                                           v.double(), options)
                want_grads = attn.attention_backward(dout.double(), q.double(), k.double(),
                                                     v.double(), want, want_lse, None, options)
                for forward, dq_tile, dkv_tile in tiles:
                    what = f"causal={causal} {(b, s, h, kv, d)} {dtype} {forward[:2]}"
                    out, lse = attention_forward_triton(q, k, v, causal, d ** -0.5, forward)
                    # a 16-bit output is rounded once: 2 ulps of it
                    assert_close(out, want, dtype, f"out {what}", 1 if dtype != torch.float32
                                 else 4)
                    assert_close(lse, want_lse, torch.float32, f"lse {what}", 4)
                    grads = attention_backward_triton(dout, q, k, v, out, lse, causal,
                                                      d ** -0.5, dq_tile, dkv_tile)
                    # 16-bit: the probabilities and their gradient rounded for the products
                    scale = 4 if dtype == torch.float32 else 8
                    for name, got, ref in zip("qkv", grads, want_grads):
                        assert_close(got, ref, dtype, f"d{name} {what}", scale)
    # every score of a row far below zero (log-sum-exp -140): the keys past the last
    # tile's end must get probability 0, not exp2(140 log2 e) (an infinite dq)
    q = torch.full((1, 40, 1, 16), 6.0)
    k = -6.0 + 0.1 * torch.randn(1, 40, 1, 16)
    v, dout = torch.randn(1, 40, 1, 16), torch.randn(1, 40, 1, 16)
    options = attn.AttentionOptions(False, 0.25, 0, "math")
    want, want_lse, _ = attn.attention_forward(q.double(), k.double(), v.double(), options)
    assert want_lse.max() < -100
    want_grads = attn.attention_backward(dout.double(), q.double(), k.double(), v.double(),
                                         want, want_lse, None, options)
    tile = (32, 32, 4, 1)
    out, lse = attention_forward_triton(q, k, v, False, 0.25, tile)
    grads = attention_backward_triton(dout, q, k, v, out, lse, False, 0.25, tile, tile)
    for name, got, ref in zip("qkv", grads, want_grads):
        # (float32 scores near -200 in base 2: their exponents carry 1e-5 relative error)
        assert_close(got, ref, torch.float32, f"d{name} with far-negative scores", 64)
    print("ok")
""")


@_GPU_COVERS
def test_attention_triton_matches_float64():
    _run_interpreted(_ATTENTION_SCRIPT)
