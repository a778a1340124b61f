"""ops.Attention against references written from the conventions' definitions (Hugging
Face's rotate_half and repeat_kv, GPT-J's interleaved pairs, F.scaled_dot_product_attention
on the math backend, in float64), its kernels' choice, its errors, and the QKV/rotary
Triton kernel under Triton's interpreter."""

import os
import re
import subprocess
import sys
import textwrap

import attrs
import pytest
import torch
import torch.nn.functional as F

import fusible
from fusible import ops
from fusible.core.conditions import PlanConditions
from fusible.functional import attention as attn
from fusible.functional.rotary import RotaryOptions, inverse_frequencies
from fusible.testing import check_compiled_matches_eager

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import (  # noqa: E402
    apply_rotary_pos_emb, repeat_kv)

H, D, B, S = 4, 8, 2, 7  # an odd sequence length


def _tables(positions, inv_freq, dtype):
    """Hugging Face's cos/sin ``(B, S, D)``: float32 angles, both halves alike."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), -1).flatten(-2)


def _interleaved(x, positions, inv_freq):
    """GPT-J's convention: pairs (x[2i], x[2i+1]) rotated by angle i."""
    freqs = positions.float()[..., None] * inv_freq
    cos = freqs.cos().repeat_interleave(2, -1).to(x.dtype)[:, None]
    sin = freqs.sin().repeat_interleave(2, -1).to(x.dtype)[:, None]
    return x * cos + _rotate_every_two(x) * sin


def _reference(qkv, kv_heads, *, causal=True, rotary_base=None, interleaved=False,
               rotary_dim=D, inv_freq=None, positions=None, allowed=None, norms=None,
               scale=None, softcap=None):
    """The attention written as Hugging Face's Llama code writes it, heads first."""
    b, s = qkv.shape[:2]
    q, k, v = qkv.view(b, s, H + 2 * kv_heads, D).split([H, kv_heads, kv_heads], 2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if norms is not None:
        q, k = (t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6) * w
                for t, w in zip((q, k), norms))
    if rotary_base is not None:
        if inv_freq is None:
            inv_freq = 1.0 / rotary_base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
        pos = torch.arange(s).expand(b, s) if positions is None else positions.expand(b, s)
        rot = (slice(None),) * 3 + (slice(0, rotary_dim),)
        q_rot, k_rot = q[rot], k[rot]
        if interleaved:
            q_rot, k_rot = _interleaved(q_rot, pos, inv_freq), _interleaved(k_rot, pos, inv_freq)
        else:
            cos, sin = _tables(pos, inv_freq, qkv.dtype)
            q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        q = torch.cat((q_rot, q[..., rotary_dim:]), -1)
        k = torch.cat((k_rot, k[..., rotary_dim:]), -1)
    k, v = repeat_kv(k, H // kv_heads), repeat_kv(v, H // kv_heads)
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool)
        if causal:
            allowed = allowed.tril()
    if softcap is not None:  # as Gemma 2's eager attention: scale, cap, mask, softmax
        scores = q @ k.transpose(2, 3) * (scale or D ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
        return out.transpose(1, 2).flatten(2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2).flatten(2)


def _qkv(kv_heads, batch=B, seq=S, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, (H + 2 * kv_heads) * D, generator=gen, dtype=dtype)
    return x.requires_grad_()


def _compare(op, reference_fn, qkv, *extras, atol=1e-10):
    """Output and every gradient (input, parameters) of ``op`` against ``reference_fn``."""
    model = ops.Sequential(op).double()
    ref_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref_in = qkv.detach().clone().requires_grad_()
    y = model(qkv, *extras)
    want = reference_fn(ref_in, ref_params)
    torch.testing.assert_close(y, want, atol=atol, rtol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(qkv.grad, ref_in.grad, atol=atol, rtol=0)
    for p, r in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p.grad, r.grad, atol=atol, rtol=0)


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_hugging_face_llama_attention(backend, kv_heads, causal):
    op = ops.Attention(H, num_kv_heads=kv_heads, causal=causal, rotary_base=10000.0,
                       backend=backend)
    _compare(op, lambda x, _: _reference(x, kv_heads, causal=causal, rotary_base=10000.0),
             _qkv(kv_heads))


def test_no_rotary_and_a_softmax_scale():
    op = ops.Attention(H, num_kv_heads=2, softmax_scale=0.3)
    _compare(op, lambda x, _: _reference(x, 2, scale=0.3), _qkv(2))


def test_interleaved_pairs_match_gptj():
    op = ops.Attention(H, num_kv_heads=2, rotary_base=500.0, rotary_interleaved=True)
    _compare(op, lambda x, _: _reference(x, 2, rotary_base=500.0, interleaved=True), _qkv(2))


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_leaves_the_other_features(interleaved):
    op = ops.Attention(H, rotary_base=10000.0, rotary_fraction=0.5,
                       rotary_interleaved=interleaved)
    _compare(op, lambda x, _: _reference(x, H, rotary_base=10000.0, rotary_dim=D // 2,
                                         interleaved=interleaved), _qkv(H))


def test_llama3_frequency_scaling_matches_hugging_face():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    config = LlamaConfig(hidden_size=H * 16, num_attention_heads=H, max_position_embeddings=256,
                         rope_parameters={"rope_theta": 10000.0, **scaling})
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    ours = inverse_frequencies(RotaryOptions(10000.0, 16, False, 8.0, 1.0, 4.0, 32))
    assert torch.equal(ours, hf_inv_freq)
    assert not torch.equal(ours, inverse_frequencies(RotaryOptions(10000.0, 16)))  # rescaled
    op = ops.Attention(H, rotary_base=10000.0, rotary_scaling=scaling)
    inv_freq = inverse_frequencies(RotaryOptions(10000.0, D, False, 8.0, 1.0, 4.0, 32))
    _compare(op, lambda x, _: _reference(x, H, rotary_base=10000.0, inv_freq=inv_freq),
             _qkv(H, seq=40))


def test_q_and_k_norms_before_the_rotary_embedding_as_qwen3():
    op = ops.Attention(H, num_kv_heads=2, rotary_base=10000.0, qk_norm=True, head_dim=D)
    with torch.no_grad():
        op.q_norm_weight.uniform_(0.5, 1.5)
        op.k_norm_weight.uniform_(0.5, 1.5)
    _compare(op, lambda x, p: _reference(x, 2, rotary_base=10000.0, norms=p), _qkv(2))


def test_zero_centered_q_and_k_norms_scale_by_one_plus_weight_as_gemma3():
    op = ops.Attention(H, num_kv_heads=2, rotary_base=10000.0, qk_norm=True, head_dim=D,
                       qk_norm_zero_centered=True)
    assert not op.q_norm_weight.any() and "qk_norm_zero_centered=True" in op.describe()
    with torch.no_grad():
        op.q_norm_weight.uniform_(-0.5, 0.5)
        op.k_norm_weight.uniform_(-0.5, 0.5)
    _compare(op, lambda x, p: _reference(x, 2, rotary_base=10000.0, norms=[1 + w for w in p]),
             _qkv(2))


def test_sliding_window_sees_the_last_window_keys():
    op = ops.Attention(H, num_kv_heads=2, rotary_base=10000.0, window=3)
    s = torch.arange(S)
    allowed = (s[None, :] <= s[:, None]) & (s[:, None] - s[None, :] < 3)
    _compare(op, lambda x, _: _reference(x, 2, rotary_base=10000.0, allowed=allowed), _qkv(2))
    # the CPU's flash kernel has no window
    assert "kernel: math" in ops.Sequential(op).plan(_qkv(2)).explain()


@pytest.mark.parametrize("window", [None, 3])
def test_soft_capped_logits_as_gemma2(window):
    """Scores of several units (the input's spread) capped at 0.5: far from uncapped."""
    op = ops.Attention(H, num_kv_heads=2, rotary_base=10000.0, softcap=0.5, window=window)
    s = torch.arange(S)
    allowed = (s[None, :] <= s[:, None]) & (s[:, None] - s[None, :] < (window or S))
    qkv = _qkv(2)
    with torch.no_grad():
        qkv.mul_(2.0)
    _compare(op, lambda x, _: _reference(x, 2, rotary_base=10000.0, allowed=allowed,
                                         softcap=0.5), qkv)
    uncapped = _reference(qkv, 2, rotary_base=10000.0, allowed=allowed)
    assert (ops.Sequential(op)(qkv) - uncapped).abs().max() > 0.1
    assert "kernel: math" in ops.Sequential(op).plan(qkv).explain()  # no CPU kernel caps


def test_flex_kernels_masks_and_capping_match_the_formulas():
    """The flex kernel's forward (flex_attention run eagerly: the CPU's has no backward,
    the op runs it on CUDA only) against the math formulas: output and log-sum-exp,
    soft-capped, causal and windowed, grouped-query."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, 16, generator=gen) * 2
    k, v = (torch.randn(B, S, 2, 16, generator=gen) * 2 for _ in range(2))
    for causal, window, softcap in ((True, 0, 0.5), (True, 3, 0.5), (False, 3, 0.0)):
        options = attn.AttentionOptions(causal, 0.25, window, "flex", softcap)
        got = attn.attention_forward(q, k, v, options)
        want = attn.attention_forward(q, k, v, attrs.evolve(options, backend="math"))
        torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="backend='flex' cannot run this attention: the flex "
                                         "kernel runs on CUDA only"):
        ops.Sequential(ops.Attention(H, softcap=0.5, backend="flex"))(torch.randn(1, S, 3 * H * D))


@pytest.mark.usefixtures("fresh_dynamo")
def test_flex_path_runs_in_a_compiled_graphs_first_call(monkeypatch):
    """AOTAutograd runs a compiled graph's first call under a dispatch mode (its custom-op
    aliasing check), from whose __torch_dispatch__ the op runs with functorch's keys
    excluded: flex's block masks and score changes (vmap) failed there. The flex path
    let onto the CPU for this (forward only, the kernel traced by dynamo and run eagerly):
    the compiled model's first call and the next give the eager op's bits."""
    refusal = attn._backend_refusal
    monkeypatch.setattr(attn, "_backend_refusal", lambda backend, *rest:
                        None if backend == "flex" else refusal(backend, *rest))
    kernels = {flag: torch.compile(attn._flex_with_lse if flag else attn._flex_for_grad,
                                   backend="eager") for flag in (True, False)}
    monkeypatch.setattr(attn, "_flex_kernel", lambda device_type, with_lse: kernels[with_lse])
    model = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_base=1e4, softcap=0.5,
                                         window=3, head_dim=16, backend="flex"))
    x = torch.randn(2, 11, 8 * 16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), eager) and torch.equal(compiled(x), eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("fresh_dynamo")
def test_flex_kernel_on_cuda_trains_as_the_formulas_and_compiles_bitwise():
    """Soft-capped, windowed, grouped-query attention on the compiled flex kernel (chosen
    unasked for soft-capped logits) against the math formulas, output and input gradient, over
    two sequence lengths (blocks of 128 and a partial one); the op under torch.compile
    gives the eager op's bits."""
    for seq in (200, 72):
        _flex_against_math_on_cuda(seq)
    x = (_qkv(2, dtype=torch.float32, seq=200) * 2.0).detach().cuda().bfloat16()
    model = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_base=1e4, softcap=0.5,
                                         head_dim=16, backend="flex"))
    check_compiled_matches_eager(model, torch.cat([x, x], -1).requires_grad_(),
                                 backend="inductor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("fresh_dynamo")
def test_flex_kernel_under_cuda_graphs_keeps_its_masks():
    """Under ``mode="reduce-overhead"`` (the block mask is made and kept on the first,
    warm-up call, inside cudagraph trees' memory pool): four steps, each with new inputs,
    give the eager op's outputs and gradients."""
    model = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_base=1e4, softcap=0.5,
                                         window=32, head_dim=64, backend="flex")).cuda()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(4):
        x = torch.randn(2, 128, 8 * 64, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(2, 128, H * 64, device="cuda", dtype=torch.bfloat16)
        results = []
        for run in (model, compiled):
            torch.compiler.cudagraph_mark_step_begin()
            xi = x.clone().requires_grad_()
            y = run(xi)
            y.backward(dy)
            results.append((y.clone(), xi.grad))
        torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)


def _flex_against_math_on_cuda(seq: int) -> None:
    qkv = (_qkv(2, dtype=torch.float32, seq=seq) * 2.0).detach().cuda().bfloat16()
    outs = []
    for backend in ("flex", "math"):
        model = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_base=1e4, softcap=0.5,
                                             window=16, backend=backend, head_dim=16))
        x = torch.cat([qkv, qkv], -1).detach().requires_grad_()  # head_dim 16
        y = model(x)
        y.float().backward(torch.cos(y.detach().float()))
        outs.append((y.float(), x.grad.float()))
        if backend == "flex":
            assert "kernel: flex" in model.plan(x).explain()
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_packed_documents_equal_each_document_alone():
    """Tokens attend within their document and rotary positions restart at each: the
    packed row gives what each document gives as a batch of its own."""
    lengths = [3, 1, 5]
    op = ops.Attention(H, num_kv_heads=2, rotary_base=10000.0, documents=True)
    model = ops.Sequential(op).double()
    qkv = _qkv(2, batch=1, seq=sum(lengths))
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    y = model(qkv, cu)
    alone = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_base=10000.0)).double()
    parts = qkv.detach().split(lengths, 1)
    want = torch.cat([alone(p.clone().requires_grad_()) for p in parts], 1)
    torch.testing.assert_close(y, want, atol=1e-12, rtol=0)
    y.sum().backward()
    grads = []
    for p in parts:
        p = p.clone().requires_grad_()
        alone(p).sum().backward()
        grads.append(p.grad)
    torch.testing.assert_close(qkv.grad, torch.cat(grads, 1), atol=1e-12, rtol=0)


def test_given_positions_rotate_by_them():
    """A shift of every position leaves the attention as it is (RoPE is relative; up to
    the float32 angles, as Hugging Face computes them); given positions rotate by them."""
    op = ops.Attention(H, rotary_base=10000.0, position_ids=True)
    model = ops.Sequential(op).double()
    qkv = _qkv(H)
    implied = ops.Sequential(ops.Attention(H, rotary_base=10000.0)).double()(qkv)
    shifted = model(qkv, torch.arange(S).expand(B, S) + 11)
    torch.testing.assert_close(shifted, implied, atol=1e-6, rtol=0)
    assert not torch.allclose(shifted, model(qkv, torch.arange(S).flip(0)), atol=1e-3)
    positions = torch.tensor([0, 2, 3, 7, 8, 8, 30])
    _compare(op, lambda x, _: _reference(x, H, rotary_base=10000.0, positions=positions),
             qkv.detach().clone().requires_grad_(), positions)


@pytest.mark.parametrize("interleaved", [False, True])
def test_given_rotary_tables_rotate_by_them(interleaved):
    """rotary_tables=True: the model's own tables, shared (S, R/2) or per row (B, S, R/2),
    rotate as Hugging Face's (rotate_half) or GPT-J's (interleaved) code does with them;
    tables of another scheme (any frequencies) rotate by their angles, not the base's."""
    inv_freq = torch.rand(D // 2) + 0.1  # no base makes these
    pos = torch.tensor([[0, 2, 3, 7, 8, 8, 30], [5, 1, 1, 0, 9, 2, 4]])
    angles = pos.float()[..., None] * inv_freq
    op = ops.Attention(H, num_kv_heads=2, rotary_tables=True, rotary_interleaved=interleaved)
    assert "rotary_tables=True" in op.describe()
    want = (lambda x, _: _reference(x, 2, rotary_base=1.0, interleaved=interleaved,
                                    inv_freq=inv_freq, positions=pos))
    _compare(op, want, _qkv(2), angles.cos(), angles.sin())
    shared = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_tables=True)).double()
    qkv = _qkv(2)
    torch.testing.assert_close(  # (S, R/2) tables: the rows of (B, S, R/2) ones alike
        shared(qkv, angles[0].cos(), angles[0].sin()),
        shared(qkv, angles[0].cos().expand(B, S, -1), angles[0].sin().expand(B, S, -1)),
        rtol=0, atol=0)


def test_cpu_flash_kernel_and_math_agree_in_float32():
    qkv = _qkv(2, dtype=torch.float32)
    outs = []
    for backend in ("flash", "math"):
        model = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_base=1e4,
                                             backend=backend))
        x = qkv.detach().clone().requires_grad_()
        y = model(x)
        y.backward(torch.ones_like(y))
        outs.append((y, x.grad))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_the_kernel_is_chosen_explicitly_and_shown():
    op = ops.Attention(H, num_kv_heads=2, rotary_base=1e4)
    model = ops.Sequential(op)
    plan = model.plan(torch.randn(1, S, 8 * D))
    assert "Attention(num_heads=4, num_kv_heads=2, causal=True, rotary_base=10000.0) " \
           "[kernel: flash]" in plan.explain()
    assert "kernel: flash" in plan.to_dot()
    assert attn.choose_backend(None, "cuda", torch.bfloat16, 128, 0, False, "A") == "cudnn"
    assert attn.choose_backend(None, "cuda", torch.bfloat16, 256, 0, False, "A") == "flash"
    assert attn.choose_backend(None, "cuda", torch.bfloat16, 128, 64, False, "A") == "flash"
    with pytest.raises(ValueError, match="no attention kernel on cuda fits .*float16 or "
                                         "bfloat16.*backend='math'"):
        attn.choose_backend(None, "cuda", torch.float32, 128, 0, False, "A")
    with pytest.raises(ValueError, match="head_dim 12 is not a multiple of 8"):
        attn.choose_backend("flash", "cuda", torch.bfloat16, 12, 0, False, "A")
    assert attn.choose_backend("math", "cuda", torch.float32, 12, 0, False, "A") == "math"
    # soft-capped: neither cuDNN nor flash takes it, flex does (and says why it cannot)
    assert attn.choose_backend(None, "cuda", torch.bfloat16, 128, 0, False, "A", 50.0) == "flex"
    with pytest.raises(ValueError, match="flex: head_dim 8 is under the flex kernel's 16"):
        attn.choose_backend(None, "cuda", torch.bfloat16, 8, 0, False, "A", 50.0)
    assert attn.choose_backend("flex", "cuda", torch.bfloat16, 128, 0, False, "A", 50.0) == "flex"
    assert attn.choose_backend(None, "cpu", torch.bfloat16, 128, 0, False, "A", 50.0) == "math"
    with pytest.raises(ValueError, match="backend='cudnn' cannot run this attention: the "
                                         "cudnn kernel has no logit soft-capping"):
        attn.choose_backend("cudnn", "cuda", torch.bfloat16, 128, 0, False, "A", 50.0)
    with pytest.raises(ValueError, match="head_dim 8 is under the flex kernel's 16"):
        attn.choose_backend("flex", "cuda", torch.bfloat16, 8, 0, False, "A", 50.0)
    with pytest.raises(ValueError, match="flex kernel here takes no packed documents"):
        attn.choose_backend("flex", "cuda", torch.bfloat16, 128, 0, True, "A")
    windowed = ops.Sequential(ops.Attention(H, window=2, backend="flash"))
    with pytest.raises(ValueError, match="backend='flash' cannot run this attention: PyTorch's "
                                         "CPU flash kernel has no sliding window"):
        windowed(torch.randn(1, S, 3 * H * D))


def test_narrow_heads_get_the_triton_kernels_by_default_on_cuda(monkeypatch):
    """Up to TRITON_DEFAULT_HEAD_DIM (16 and 32) the default on CUDA is fusible's Triton
    kernels; wider heads cuDNN's, which still runs narrow ones when asked; the triton
    backend refuses what it lacks, by name, and a plan before the width is known says
    which it will be."""
    monkeypatch.setattr(attn, "triton_imports", lambda: True)
    choose = attn.choose_backend
    assert choose(None, "cuda", torch.bfloat16, 16, 0, False, "A") == "triton"
    assert choose(None, "cuda", torch.float16, 32, 0, False, "A") == "triton"
    assert choose(None, "cuda", torch.bfloat16, 64, 0, False, "A") == "cudnn"
    assert choose("cudnn", "cuda", torch.bfloat16, 16, 0, False, "A") == "cudnn"
    assert choose("triton", "cuda", torch.bfloat16, 64, 0, False, "A") == "triton"
    assert choose(None, "cuda", torch.bfloat16, None, 0, False, "A") == "cudnn"
    # what the kernels lack goes to the next one unasked, and is refused when asked for
    assert choose(None, "cuda", torch.bfloat16, 16, 8, False, "A") == "flash"
    assert choose(None, "cuda", torch.bfloat16, 16, 0, True, "A") == "flash"
    assert choose(None, "cpu", torch.bfloat16, 16, 0, False, "A") == "flash"
    for args, why in (((torch.bfloat16, 24, 0, False), r"head_dim 24 is not one of the "
                       r"triton kernel's \(16, 32, 64\)"),
                      ((torch.bfloat16, 128, 0, False), "head_dim 128 is not one of"),
                      ((torch.float32, 16, 0, False), "takes float16 or bfloat16, not "
                       "torch.float32"),
                      ((torch.bfloat16, 16, 8, False), "no sliding window"),
                      ((torch.bfloat16, 16, 0, True), "no packed documents")):
        with pytest.raises(ValueError, match="A: backend='triton' cannot run this attention: "
                                             ".*" + why):
            choose("triton", "cuda", *args, "A")
    with pytest.raises(ValueError, match="the triton kernel runs on CUDA only"):
        choose("triton", "cpu", torch.bfloat16, 16, 0, False, "A")
    with pytest.raises(ValueError, match="no logit soft-capping"):
        choose("triton", "cuda", torch.bfloat16, 16, 0, False, "A", 50.0)
    conditions = PlanConditions(torch.bfloat16, "cuda", True, True, (), (), None, True)
    assert ops.Attention(H).plan_note(conditions) == \
        "kernel: triton for heads up to 32 wide, else cudnn"
    assert ops.Attention(H, head_dim=16).plan_note(conditions) == "kernel: triton"
    assert ops.Attention(H, backend="cudnn").plan_note(conditions) == "kernel: cudnn"
    # what the Triton kernels cannot take gets no conditional note
    for options, chosen in ((dict(window=8), "flash"), (dict(documents=True), "flash"),
                            (dict(softcap=30.0), "flex")):
        assert ops.Attention(H, **options).plan_note(conditions) == f"kernel: {chosen}"
    # a dtype no kernel takes: each one's own reason, not the default's width rule
    with pytest.raises(ValueError, match="triton: the triton kernel takes float16 or "
                                         "bfloat16, not torch.float32"):
        choose(None, "cuda", torch.float32, None, 0, False, "A")
    # Triton installed but failing to import: cuDNN's, not an error at the first call
    monkeypatch.setattr(attn, "triton_imports", lambda: False)
    assert choose(None, "cuda", torch.bfloat16, 16, 0, False, "A") == "cudnn"
    assert ops.Attention(H).plan_note(conditions) == "kernel: cudnn"
    with pytest.raises(ValueError, match="Triton is not installed or failed to import"):
        choose("triton", "cuda", torch.bfloat16, 16, 0, False, "A")


@pytest.mark.parametrize("call,tile,rule", [
    ("forward", (16, 32, 4, 1), "BLOCK_N dividing BLOCK_M"),
    ("dq", (32, 48, 4, 1), "BLOCK_N dividing BLOCK_M"),
    ("dkv", (32, 16, 4, 1), "BLOCK_M dividing BLOCK_N"),
    ("forward", (32, 8, 4, 1), "of 16 or more")])
def test_the_triton_kernels_refuse_tiles_their_loops_would_misread(call, tile, rule):
    """The loops put the causal diagonal in whole blocks: a tile that breaks it would read
    keys past the diagonal unmasked (wrong results, no error), so it is refused first."""
    from fusible.kernels import attention as kernels
    q = torch.randn(1, 64, 2, 16)
    k = torch.randn(1, 64, 1, 16)
    name = "dk/dv" if call == "dkv" else call
    with pytest.raises(ValueError, match=re.escape(f"the {name} tile {tile} needs") + ".*"
                       + rule):
        if call == "forward":
            kernels.attention_forward_triton(q, k, k, True, 0.25, tile)
        else:
            tiles = {"dq_tile": tile} if call == "dq" else {"dkv_tile": tile}
            kernels.attention_backward_triton(q, q, k, k, q, q[..., 0], True, 0.25, **tiles)


def test_the_triton_backward_reads_an_fp8_saved_output_as_its_values(monkeypatch):
    """An FP8 plan saves the attention's output as the Float8Tensor it hands the next GEMM;
    the Triton kernels read memory, so they get its values as a plain tensor (a
    Float8Tensor's pointer is not its values': an illegal address on the GPU)."""
    from fusible.kernels import attention as kernels
    from fusible.quantization.tensor.quantize import quantize_raw
    seen = []
    monkeypatch.setattr(kernels, "attention_backward_triton",
                        lambda *args: seen.append(args) or (args[1], args[2], args[3]))
    q, dout, out = (torch.randn(1, 4, 2, 16) for _ in range(3))
    k = v = torch.randn(1, 4, 1, 16)
    fp8_out = quantize_raw(out, torch.float8_e4m3fn, False, torch.float32)
    options = attn.AttentionOptions(True, 0.25, 0, "triton")
    attn.attention_backward(dout, q, k, v, fp8_out, torch.zeros(1, 2, 4), None, options)
    given_dout, given_out = seen[0][0], seen[0][4]
    assert type(given_out) is torch.Tensor and given_dout is dout
    assert torch.equal(given_out, fp8_out.dequantize())


def test_flex_refuses_wide_heads_on_gpus_without_the_shared_memory(monkeypatch):
    """Over head_dim 128 the flex backward's kernels need about 114-131 KiB of shared
    memory per block: a consumer board (99 KiB) is refused with the reason, a Hopper GPU
    (227 KiB) is not; up to 128 the device is not asked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for kib, fits in ((99, False), (227, True)):
        monkeypatch.setattr(attn, "device_shared_memory_kib", lambda kib=kib: kib)
        assert attn.choose_backend(None, "cuda", torch.bfloat16, 128, 0, False, "A",
                                   50.0) == "flex"
        if fits:
            assert attn.choose_backend(None, "cuda", torch.bfloat16, 256, 0, False, "A",
                                       50.0) == "flex"
        else:
            with pytest.raises(ValueError, match="flex: head_dim 256 over 128 needs 160 KiB "
                                                 "of shared memory per block for the flex "
                                                 "backward; this GPU has 99"):
                attn.choose_backend(None, "cuda", torch.bfloat16, 256, 0, False, "A", 50.0)


def test_flex_asks_inductor_for_its_training_kernel(monkeypatch):
    """Both flex calls ask for the training kernel: Inductor's flex-decoding template,
    which it takes for queries under 128 tokens, had no kernel for these shapes."""
    seen = []

    def flex_attention(*args, kernel_options=None, return_aux=None, **kwargs):
        seen.append(kernel_options)
        return (None, type("Aux", (), {"lse": None})()) if return_aux is not None else None
    monkeypatch.setattr(attn.flex, "flex_attention", flex_attention)
    attn._flex_with_lse(None, None, None, None, None, 1.0, False)
    attn._flex_for_grad(None, None, None, None, None, 1.0, False)
    assert seen == [{"FORCE_USE_FLEX_ATTENTION": True}] * 2


@pytest.mark.parametrize("make, shape, extras, match", [
    (lambda: ops.Attention(4, num_kv_heads=3), None, (), "multiple of num_kv_heads, got 4 and 3"),
    (lambda: ops.Attention(4, qk_norm=True), None, (), "qk_norm=True needs head_dim"),
    (lambda: ops.Attention(4, rotary_fraction=1.5, rotary_base=1.0), None, (), "at most 1"),
    (lambda: ops.Attention(4, rotary_scaling={"rope_type": "yarn"}, rotary_base=1.0), None, (),
     "supports Llama 3.1's"),
    (lambda: ops.Attention(4), (2, 3, 50), (), r"\(num_heads \+ 2 \* num_kv_heads\) x head_dim "
                                                r"= 12 x head_dim, got 50"),
    (lambda: ops.Attention(4, head_dim=8), (2, 3, 48), (), "= 12 x 8 = 96, got 48"),
    (lambda: ops.Attention(4), (6, 48), (), r"\(batch, seq, features\)"),
    (lambda: ops.Attention(4, rotary_base=1.0, rotary_fraction=0.1), (2, 3, 96), (),
     "must be a positive even number, got 1"),
    (lambda: ops.Attention(4, documents=True), (2, 3, 96), (torch.tensor([0, 3]),),
     "packed documents take one row"),
    (lambda: ops.Attention(4, documents=True), (1, 3, 96), (torch.tensor([0.0, 3.0]),),
     "cu_seqlens"),
    (lambda: ops.Attention(4, position_ids=True, rotary_base=1.0), (2, 3, 96),
     (torch.zeros(3, 2, dtype=torch.long),), r"position_ids must be \(batch, seq\)"),
    (lambda: ops.Attention(4, rotary_tables=True, rotary_base=1.0), None, (),
     "rotary_base must be None and position_ids False, got 1.0 and False"),
    (lambda: ops.Attention(4, rotary_tables=True), (2, 3, 96),
     (torch.zeros(3, 4), torch.zeros(3, 5)), r"the rotary table sin must be \(seq, rotary_dim "
                                             r"/ 2\) = \(3, 4\), \(1, 3, 4\) or \(2, 3, 4\), "
                                             r"got \(3, 5\)"),
    (lambda: ops.Attention(4, rotary_tables=True), (2, 3, 96),
     (torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4)), "rotary table cos"),
    (lambda: ops.Attention(4, rotary_tables=True), (2, 3, 96),
     (torch.zeros(3, 4), torch.zeros(2, 3, 4)), r"must have one shape, got \(3, 4\) and "
                                                r"\(2, 3, 4\)"),
])
def test_errors_name_the_op_and_the_values(make, shape, extras, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op = make()
        ops.Sequential(op)(torch.randn(shape), *extras)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_with_documents_norms_and_positions_is_bitwise_eager():
    op = ops.Attention(H, num_kv_heads=2, rotary_base=1e4, qk_norm=True, head_dim=D,
                       documents=True, position_ids=True, window=4)
    model = ops.Sequential(op)
    qkv = torch.randn(1, 9, 8 * D, requires_grad=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    check_compiled_matches_eager(model, qkv, cu, torch.arange(9))
    tables = ops.Sequential(ops.Attention(H, num_kv_heads=2, rotary_tables=True,
                                          rotary_interleaved=True))
    angles = torch.rand(9, D // 2) * 6
    check_compiled_matches_eager(tables, qkv, angles.cos(), angles.sin())


_KERNEL_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.functional.qkv import HeadLayout, split, views
    from fusible.functional.rotary import RotaryOptions, apply_rotary, rotary_angles
    from fusible.kernels.rotary import qkv_rotary_backward_triton, qkv_rotary_forward_triton
    torch.manual_seed(0)
    B, S = 2, 7
    for interleaved in (False, True):
        for heads, kv, d, rot in ((4, 2, 16, 16), (3, 1, 12, 8), (2, 2, 8, 2)):
            for per_token in (False, True):
                layout = HeadLayout(heads, kv, d)
                opts = RotaryOptions(10000.0, rot, interleaved)
                pos = torch.randint(0, 50, (B, S)) if per_token else torch.arange(S)
                cos, sin = rotary_angles(pos, opts)
                cos2, sin2 = cos.reshape(-1, rot // 2), sin.reshape(-1, rot // 2)
                for dtype in (torch.float32, torch.bfloat16):
                    qkv = torch.randn(B, S, (heads + 2 * kv) * d).to(dtype)
                    flat = qkv_rotary_forward_triton(qkv.flatten(0, 1), cos2, sin2, heads, kv,
                                                     interleaved)
                    # other tilings (one head, a few tokens a program): the same bits
                    assert torch.equal(flat, qkv_rotary_forward_triton(
                        qkv.flatten(0, 1), cos2, sin2, heads, kv, interleaved, block_t=4,
                        group=1))
                    got = views(flat, B, S, layout)
                    q, k, v = split(qkv, layout)
                    want = (apply_rotary(q, cos, sin, opts), apply_rotary(k, cos, sin, opts), v)
                    grads = [torch.randn_like(t) for t in got]
                    dqkv = qkv_rotary_backward_triton(*(g.flatten(0, 1) for g in grads), cos2,
                                                      sin2, interleaved).view(qkv.shape)
                    assert torch.equal(dqkv, qkv_rotary_backward_triton(
                        *(g.flatten(0, 1) for g in grads), cos2, sin2, interleaved, block_t=4,
                        group=1).view(qkv.shape))
                    dq, dk, dv = split(dqkv, layout)
                    want_grads = (apply_rotary(grads[0], cos, sin, opts, inverse=True),
                                  apply_rotary(grads[1], cos, sin, opts, inverse=True), grads[2])
                    assert torch.equal(v, want[2]) and torch.equal(dv, want_grads[2])
                    for a, b in zip((*got[:2], dq, dk), (*want[:2], *want_grads[:2])):
                        if dtype == torch.float32:  # the same float32 arithmetic
                            assert torch.equal(a, b), (a - b).abs().max()
                        else:  # the interpreter rounds to bf16 its own way: one unit apart
                            ulp = 2.0 ** (torch.frexp(b.float())[1] - 8).float()
                            assert ((a.float() - b.float()).abs() <= ulp).all()
    print("ok")
""")


@pytest.mark.skipif(not fusible.kernels.HAVE_TRITON, reason="needs Triton")
def test_qkv_rotary_kernel_matches_pytorch_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")



def test_sequence_tables_are_kept_per_length_device_and_options():
    """The tables of positions 0..S-1 are made once per (S, device, options) and read by
    every later call (the same tensors, equal to rotary_angles'); not kept when asked
    (tracing with fake tensors, a capture), and the last 16 only."""
    from fusible.functional import rotary
    options = rotary.RotaryOptions(10000.0, 8)
    rotary._SEQUENCE_TABLES.clear()
    first = rotary.sequence_angles(12, torch.device("cpu"), options)
    assert rotary.sequence_angles(12, torch.device("cpu"), options) is first
    want = rotary.rotary_angles(torch.arange(12), options)
    assert all(torch.equal(a, b) for a, b in zip(first, want))
    other = rotary.sequence_angles(12, torch.device("cpu"), rotary.RotaryOptions(500.0, 8))
    assert not torch.equal(other[0], first[0])
    assert rotary.sequence_angles(12, torch.device("cpu"), options, keep=False) is not first
    for seq in range(20):
        rotary.sequence_angles(100 + seq, torch.device("cpu"), options)
    assert len(rotary._SEQUENCE_TABLES) == 16
    assert (12, torch.device("cpu"), options) not in rotary._SEQUENCE_TABLES


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_attention_after_eager_calls_reads_no_kept_table_while_tracing():
    """Eager calls keep the tables; a compiled call after them (its stages traced with
    fake tensors) neither reads nor keeps them there, and gives the eager bits."""
    torch.manual_seed(0)
    op = ops.Attention(num_heads=2, rotary_base=10000.0)
    x = torch.randn(2, 6, 3 * 2 * 8)
    want = op(x)
    got = torch.compile(op, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, want)


def test_fusibles_own_positions_read_the_kept_tables_and_no_other_tensor_does():
    """sequence_positions' tensor (a converted layer's positions in plain calls) reads the
    kept tables of 0..S-1; another tensor of the same values is computed afresh (its
    memory could be rewritten unseen); inference mode keeps nothing."""
    from fusible.functional import rotary
    from fusible.ops.attention import _angles
    options = rotary.RotaryOptions(10000.0, 8)
    x = torch.randn(2, 10, 4)
    own = rotary.sequence_positions(10, x.device)
    assert rotary.sequence_positions(10, x.device) is own and torch.equal(own, torch.arange(10))
    kept = _angles(x, options, None, own, None, None)
    assert kept is rotary.sequence_angles(10, x.device, options)
    other = _angles(x, options, None, torch.arange(10), None, None)
    assert other is not kept and all(torch.equal(a, b.expand_as(a)) for a, b in zip(other, kept))
    with torch.inference_mode():
        fresh = rotary.sequence_angles(11, x.device, options)
        assert rotary.sequence_positions(11, x.device) is not rotary.sequence_positions(11, x.device)
    assert rotary.sequence_angles(11, x.device, options) is not fresh  # not kept


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layers_given_one_positions_tensor_make_its_tables_once(compiled, monkeypatch):
    """Every layer of a step takes the model's one position_ids tensor (a compiled
    graph hands it to each custom op): its rotary tables are made once, forward and
    backward, and made again once the tensor changes in place; the bits are those of
    tables made per call."""
    from fusible.functional import rotary
    from fusible.ops import attention
    made = []
    real = rotary.rotary_angles

    def counted(positions, options):
        if type(positions) is torch.Tensor:  # not a trace's fake tensor
            made.append(1)
        return real(positions, options)
    monkeypatch.setattr(attention, "rotary_angles", counted)
    rotary._BY_POSITIONS.clear()
    torch.manual_seed(0)
    layers = [ops.Attention(2, rotary_base=1e4, position_ids=True) for _ in range(3)]

    def model(x, positions):  # three layers' attention, each given the same positions
        return sum(layer(x * (i + 1), positions) for i, layer in enumerate(layers))
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    x = torch.randn(2, 6, 3 * 2 * 8, requires_grad=True)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    run(x, positions).sum().backward()
    assert len(made) == 1
    got = x.grad.clone()
    rotary._BY_POSITIONS.clear()
    monkeypatch.setattr(rotary, "_keepable", lambda device: False)  # made per call
    x.grad = None
    run(x, positions).sum().backward()
    assert torch.equal(x.grad, got) and len(made) == 1 + 6
    monkeypatch.undo()
    monkeypatch.setattr(attention, "rotary_angles", counted)
    made.clear()
    run(x, positions)
    positions.add_(1)  # in place: the version moves, the tables are made again
    run(x, positions)
    assert len(made) == 2


def test_kept_position_tables_go_with_their_tensor_and_skip_inference_tensors():
    """An entry of angles_of goes when its positions tensor dies (its tables are not
    kept for a dead tensor); position ids made under inference mode (no version to read)
    and used outside it are computed each call."""
    from fusible.functional import rotary
    rotary._BY_POSITIONS.clear()
    options = rotary.RotaryOptions(10000.0, 8)
    x = torch.randn(2, 6, 3 * 2 * 8)
    op = ops.Attention(2, rotary_base=1e4, position_ids=True)
    positions = torch.arange(6).expand(2, 6).clone()
    with torch.no_grad():
        want = op(x, positions)
    assert len(rotary._BY_POSITIONS) == 1
    del positions
    assert not rotary._BY_POSITIONS
    with torch.inference_mode():
        frozen = torch.arange(6).expand(2, 6).clone()
    with torch.no_grad():
        assert torch.equal(op(x, frozen), want)
    assert not rotary._BY_POSITIONS
    made = rotary.angles_of(torch.arange(6), 2, 6, options,
                            lambda: rotary.rotary_angles(torch.arange(6), options))
    assert len(rotary._BY_POSITIONS) == 0 and made[0].shape == (6, 4)  # its tensor died
