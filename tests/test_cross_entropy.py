"""CrossEntropy and LinearCrossEntropy (the LM head and its loss, chunked over the tokens):
against F.cross_entropy on full logits in float64, compiled bitwise, the logits never made
whole (the matrix of tests/test_matrix.py runs their examples too)."""

import weakref

import pytest
import torch
import torch.nn.functional as F

from fusible import ops
from fusible.functional import cross_entropy as ce
from fusible.functional import head_gemms
from fusible.testing import check_compiled_matches_eager, stage_names

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
VOCAB = 11  # no chunk of tokens divides anything here


def _labels(shape, ignored=((0, 1),)):
    labels = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    for index in ignored:
        labels[index] = -100
    return labels


def _reference(logits, labels, reduction, label_smoothing, z_loss):
    """F.cross_entropy on the full logits, plus z_loss * lse**2 per counted token."""
    flat = logits.reshape(-1, logits.shape[-1])
    kept = labels.reshape(-1) != -100
    losses = F.cross_entropy(flat, labels.reshape(-1), reduction="none",
                             label_smoothing=label_smoothing)
    losses = losses + z_loss * torch.where(kept, torch.logsumexp(flat, -1).square(), 0.0)
    if reduction == "none":
        return losses.reshape(labels.shape)
    return losses.sum() / kept.sum() if reduction == "mean" else losses.sum()


OPTIONS = [("mean", 0.0, 0.0), ("mean", 0.1, 1e-3), ("sum", 0.0, 1e-3), ("none", 0.2, 0.0)]


@pytest.mark.parametrize("reduction,label_smoothing,z_loss", OPTIONS,
                         ids=[f"{r}-ls{s}-z{z}" for r, s, z in OPTIONS])
@pytest.mark.parametrize("chunk_size", [3, None], ids=["chunks_of_3", "one_chunk"])
def test_linear_cross_entropy_against_full_logits_in_float64(reduction, label_smoothing,
                                                             z_loss, chunk_size):
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(16, VOCAB, reduction=reduction, chunk_size=chunk_size,
                                  label_smoothing=label_smoothing, z_loss=z_loss,
                                  dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    labels = _labels((2, 5))
    loss = ops.Sequential(head)(x, labels)
    grad = torch.rand_like(loss) + 0.5
    loss.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = head.weight.detach().clone().requires_grad_()
    want = _reference(x_ref @ w_ref.t(), labels, reduction, label_smoothing, z_loss)
    want.backward(grad)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    assert not x.grad[0, 1].any()  # the ignored token


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_alone_against_f_cross_entropy_in_bf16(reduction):
    """Logits in bf16, the loss in float32 (summed in float32), the logits' gradient in
    bf16 within a rounding of the float64 one."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, VOCAB) * 4).bfloat16().requires_grad_()
    labels = _labels((3, 7), ignored=((0, 1), (2, 6)))
    loss_fn = ops.Sequential(ops.CrossEntropy(reduction=reduction, label_smoothing=0.1,
                                              chunk_size=5))
    loss = loss_fn(logits, labels)
    assert loss.dtype == torch.float32
    grad = torch.rand_like(loss) + 0.5
    loss.backward(grad)
    z = logits.detach().double().requires_grad_()
    want = _reference(z, labels, reduction, 0.1, 0.0)
    want.backward(grad.double())
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), z.grad, rtol=0.01, atol=1e-3)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_bitwise_eager(reduction):
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(16, VOCAB, reduction=reduction, chunk_size=4, z_loss=0.01)
    x = torch.randn(3, 5, 16, requires_grad=True)
    check_compiled_matches_eager(ops.Sequential(head), x, _labels((3, 5)))
    logits = torch.randn(3, 5, VOCAB, requires_grad=True)
    check_compiled_matches_eager(ops.Sequential(ops.CrossEntropy(reduction=reduction,
                                                                 chunk_size=4)),
                                 logits, _labels((3, 5)))


def test_the_logits_are_made_one_chunk_at_a_time_and_never_saved(monkeypatch):
    """Forward and backward see chunks of at most chunk_size tokens, and what is saved for
    the backward is no bigger than the input and the weight: no tensor of all the
    logits."""
    seen = []
    real = ce.chunk_losses
    monkeypatch.setattr(ce, "chunk_losses", lambda z, *a: seen.append(z.shape) or real(z, *a))
    torch.manual_seed(0)
    for reduction in ("mean", "none"):
        head = ops.LinearCrossEntropy(16, 64, reduction=reduction, chunk_size=4)
        x = torch.randn(10, 16, requires_grad=True)
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append(t.shape) or t, lambda t: t):
            loss = ops.Sequential(head)(x, torch.randint(0, 64, (10,)))
        loss.sum().backward()
        assert [s[0] for s in seen] == [4, 4, 2] and all(s[1] == 64 for s in seen)
        # the input and weight (or their gradients), and a number per token at most
        assert sizes and sum(s.numel() for s in sizes) <= 10 * 16 + 64 * 16 + 2 * 10, sizes
        seen.clear()


def test_one_chunk_of_logits_is_alive_at_a_time(monkeypatch):
    """Each chunk's logits (and their gradient) are freed before the next chunk's are made,
    forward and backward: the head's transient memory is one chunk's (512 MiB at
    Llama-3's vocabulary), not two."""
    alive: list = []

    def tracked(make, first=False):
        def made(*args, **kwargs):
            if first:  # a chunk's first tensor: the last chunk's are gone
                assert all(ref() is None for ref in alive), "a chunk's logits outlived it"
            out = make(*args, **kwargs)
            if out is not None:
                alive.append(weakref.ref(out))
            return out
        return made
    monkeypatch.setattr(head_gemms.HeadOperands, "logits",
                        tracked(head_gemms.HeadOperands.logits, first=True))
    monkeypatch.setattr(ce, "chunk_forward", tracked(ce.chunk_forward))
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    for reduction in ("mean", "none"):  # gradients made in the forward; in the backward
        head = ops.LinearCrossEntropy(16, 64, reduction=reduction, chunk_size=4)
        alive.clear()
        ops.Sequential(head)(x, torch.randint(0, 64, (10,))).sum().backward()
        assert len(alive) >= 6, len(alive)  # three chunks each way at least


def test_gradients_in_the_forward_only_when_a_backward_is_to_come(monkeypatch):
    calls = []
    real = ce.chunk_logits_grad
    monkeypatch.setattr(ce, "chunk_logits_grad", lambda *a: calls.append(1) or real(*a))
    head = ops.Sequential(ops.LinearCrossEntropy(16, VOCAB, chunk_size=4))
    x, labels = torch.randn(8, 16), _labels((8,), ignored=())
    with torch.no_grad():
        head(x, labels)
    with torch.inference_mode():
        head(x, labels)
    assert calls == []
    head(x, labels).backward()  # the weight's gradient: made in the forward
    assert len(calls) == 2


def test_a_frozen_head_gives_the_hidden_states_gradient_and_a_tied_weight_trains():
    """A weight tied to an embedding (Hugging Face's tie_word_embeddings) gets both
    gradients; a frozen head still passes the gradient to the hidden states."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, 16, dtype=torch.float64)
    head = ops.LinearCrossEntropy(16, VOCAB, dtype=torch.float64)
    head.weight = embedding.weight
    tokens, labels = torch.randint(0, VOCAB, (2, 6)), _labels((2, 6))
    ops.Sequential(head)(embedding(tokens), labels).backward()
    w = embedding.weight.detach().clone().requires_grad_()
    _reference(F.embedding(tokens, w) @ w.t(), labels, "mean", 0.0, 0.0).backward()
    torch.testing.assert_close(embedding.weight.grad, w.grad, rtol=1e-12, atol=1e-12)
    head.weight.requires_grad_(False)
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    ops.Sequential(head)(x, labels).backward()
    x_ref = x.detach().clone().requires_grad_()
    _reference(x_ref @ w.detach().t(), labels, "mean", 0.0, 0.0).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_every_label_ignored_gives_nan_as_f_cross_entropy():
    head = ops.Sequential(ops.LinearCrossEntropy(16, VOCAB))
    labels = torch.full((4,), -100)
    loss = head(torch.randn(4, 16), labels)
    want = F.cross_entropy(torch.randn(4, VOCAB), labels)
    assert loss.isnan() and want.isnan()


def test_bad_labels_and_options_are_errors_naming_the_op():
    head = ops.Sequential(ops.LinearCrossEntropy(16, VOCAB))
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match=r"CrossEntropy\(ignore_index=-100, reduction='mean'\) "
                                        r"takes the labels as an integer tensor \(int32 or "
                                        r"int64\) of shape \(4,\), got torch.float32 of shape "
                                        r"\(4,\)"):
        head(x, torch.zeros(4))
    with pytest.raises(TypeError, match=r"of shape \(4,\), got torch.int64 of shape \(2, 2\)"):
        head(x, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"every label must be in \[0, 11\) or ignore_index"):
        head(x, torch.tensor([0, 11, 2, 3]))
    with pytest.raises(ValueError, match=r"CrossEntropy: reduction must be one of "
                                         r"\('mean', 'sum', 'none'\), got 'avg'"):
        ops.LinearCrossEntropy(16, VOCAB, reduction="avg")
    with pytest.raises(ValueError, match=r"CrossEntropy: label_smoothing must be in \[0, 1\]"):
        ops.CrossEntropy(label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"CrossEntropy: chunk_size must be positive"):
        ops.CrossEntropy(chunk_size=0)
    with pytest.raises(ValueError, match=r"BasicLinear\(in_features=16, out_features=11\) got "
                                         r"input with last dimension 8; expected 16"):
        head(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))


def test_the_head_and_its_loss_are_one_stage_each_way_and_fp8_rowwise_is_refused():
    """ops.LinearCrossEntropy, and the same two ops written by hand, plan the joint
    fusion; under a recipe other than per-tensor current scaling it is refused with the
    reason and the ops run alone."""
    import fusible
    x, labels = torch.randn(16, 16, requires_grad=True), _labels((16,), ignored=())
    for model in (ops.Sequential(ops.LinearCrossEntropy(16, 32)),
                  ops.Sequential(ops.BasicLinear(16, 32), ops.CrossEntropy())):
        plan = model.plan(x, labels)
        assert stage_names(plan.forward) == ["LinearCrossEntropy"]
        assert stage_names(plan.backward) == ["LinearCrossEntropy"]
    with fusible.autocast(recipe=fusible.Float8RowwiseScaling()):
        plan = model.plan(x, labels)
        refused = {c.fusion: c.reason for c in plan.candidates if c.status == "refused"}
        assert "runs its FP8 GEMMs with per-tensor current scaling only" in refused[
            "LinearCrossEntropy"]
        assert stage_names(plan.forward) == ["BasicLinear", "CrossEntropy"]
        model(x, labels).backward()
    assert x.grad is not None and x.grad.isfinite().all()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp8_head_runs_the_logits_and_dgrad_gemms_in_fp8(reduction, monkeypatch):
    """Under per-tensor current scaling the logits' and the hidden states' gradient's
    GEMMs are FP8 (two per chunk of 16 tokens' multiples), the weight's gradient bf16:
    signal-to-noise floors against float64, and the FP8 GEMMs counted."""
    import fusible
    from fusible.functional import head_gemms
    from fusible.testing import snr_db
    calls = []
    scaled = head_gemms.scaled_gemm
    monkeypatch.setattr(head_gemms, "scaled_gemm",
                        lambda *a, **k: calls.append(a[0].shape) or scaled(*a, **k))
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(64, 96, reduction=reduction, chunk_size=40,
                                  dtype=torch.bfloat16)
    model = ops.Sequential(head)
    x = torch.randn(2, 48, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 96, (2, 48))
    with fusible.autocast():
        assert stage_names(model.plan(x, labels).forward) == ["LinearCrossEntropy"]
        loss = model(x, labels)
    loss.sum().backward()
    # chunks of 32 tokens (40 rounded down to 16's multiple): the logits of each, and their
    # gradient's GEMM; "none" makes the logits again in the backward
    logits_passes = 1 if reduction == "mean" else 2
    assert [s[0] for s in calls] == [32] * (3 * (logits_passes + 1))
    x_ref, w_ref = x.detach().double().requires_grad_(), head.weight.detach().double()
    w_ref.requires_grad_()
    want = F.cross_entropy((x_ref @ w_ref.t()).reshape(-1, 96), labels.reshape(-1),
                           reduction=reduction)
    want.sum().backward()
    assert snr_db(loss.double().reshape(-1), want.reshape(-1)) > 40
    assert 25 < snr_db(x.grad, x_ref.grad) < 40  # E5M2 gradients: FP8, not bf16
    assert snr_db(head.weight.grad, w_ref.grad) > 40  # the bf16 weight-gradient GEMM


def test_fp8_head_compiles_bit_for_bit():
    import fusible
    head = ops.LinearCrossEntropy(64, 96, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with fusible.autocast():
        check_compiled_matches_eager(ops.Sequential(head), x, torch.randint(0, 96, (32,)))


def test_state_dict_names_as_nn_linear_and_load():
    head = ops.LinearCrossEntropy(16, VOCAB, z_loss=1e-4)
    assert list(head.state_dict()) == ["weight"]
    twin = ops.LinearCrossEntropy(16, VOCAB)
    twin.load_state_dict(torch.nn.Linear(16, VOCAB, bias=False).state_dict())
    assert "z_loss=0.0001" in repr(head) and head.loss.z_loss == 1e-4


@pytest.mark.parametrize("reduction,grad", [("mean", 1.0), ("sum", 0.25)])
def test_gradients_made_in_the_forward_round_where_the_ops_do_in_bf16(reduction, grad):
    """For a reduced loss the logits' gradient is made in the forward for an output
    gradient of 1: with 1 or a power of two (loss.backward(), a loss scale) its roundings
    are the ops' own (the logits after the GEMM, their gradient before the GEMMs), so the
    results are the FP64 computation rounded at those points, within two units; the
    weight's gradient is summed over the chunks in bf16, rounded after each chunk's GEMM."""
    from fusible.testing import assert_close
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(32, 24, reduction=reduction, label_smoothing=0.1,
                                  chunk_size=5).to(torch.bfloat16)
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 24, (3, 7))
    labels[1, 2] = -100
    loss = ops.Sequential(head)(x, labels)
    loss.backward(torch.tensor(grad))
    w = head.weight.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    logits = (x64 @ w.t()).bfloat16().double().detach()  # rounded after the GEMM
    logits.requires_grad_()
    want = _reference(logits, labels, reduction, 0.1, 0.0)
    want.backward(torch.tensor(grad, dtype=torch.float64))
    dz = logits.grad.bfloat16().double()  # rounded before the GEMMs
    assert_close(loss, want, torch.bfloat16, "loss")
    assert_close(x.grad, (dz @ w.detach()).reshape(x.shape), torch.bfloat16, "dx")
    assert_close(head.weight.grad, _chunked_bf16_sum(dz.reshape(-1, 24),
                                                     x64.detach().reshape(-1, 32), 5),
                 torch.bfloat16, "dweight")


def _chunked_bf16_sum(dz, x, chunk):
    """``dz.T @ x`` in float64 a chunk of rows at a time, the sum rounded to bf16 after each
    chunk (as the head's GEMMs add into the bf16 gradient)."""
    total = None
    for lo in range(0, dz.shape[0], chunk):
        part = dz[lo:lo + chunk].t() @ x[lo:lo + chunk]
        total = (part if total is None else total + part).bfloat16().double()
    return total


def test_a_float32_main_grad_head_sums_the_chunks_in_float32():
    """Written by hand with accumulate_into_main_grad, the head (still one fused stage)
    sums the weight's gradient over the chunks in float32: float32 close to the FP64 sum
    of the bf16 logit gradients, where a bf16 sum would be two hundred times further."""
    from fusible.testing import assert_close
    torch.manual_seed(0)
    linear = ops.BasicLinear(32, 24, accumulate_into_main_grad=True, dtype=torch.bfloat16)
    model = ops.Sequential(linear, ops.CrossEntropy(reduction="sum", chunk_size=5))
    linear.weight.main_grad = torch.zeros(24, 32)
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16)
    labels = torch.randint(0, 24, (3, 7))
    assert "LinearCrossEntropy" in stage_names(model.plan(x, labels).forward)
    model(x, labels).backward()
    w = linear.weight.detach().double()
    logits = (x.double() @ w.t()).bfloat16().double().requires_grad_()
    _reference(logits, labels, "sum", 0.0, 0.0).backward()
    dz = logits.grad.bfloat16().double().reshape(-1, 24)
    assert_close(linear.weight.main_grad, dz.t() @ x.double().reshape(-1, 32), torch.float32,
                 "main_grad")


def test_logits_returned_when_asked_and_gradients_flow_through_both():
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(16, VOCAB, return_logits=True, dtype=torch.float64)
    model = ops.Sequential(head)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    labels = _labels((2, 5))
    loss, logits = model(x, labels)
    plan = model.plan(x, labels)
    assert "LinearCrossEntropy" not in stage_names(plan.forward)  # the logits are made whole
    x_ref = x.detach().clone().requires_grad_()
    want_logits = x_ref @ head.weight.detach().t()
    want = _reference(want_logits, labels, "mean", 0.0, 0.0)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    (loss + logits.square().mean()).backward()
    (want + want_logits.square().mean()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="return_logits must be a bool"):
        ops.LinearCrossEntropy(16, VOCAB, return_logits=1)


def test_many_chunks_sum_the_weight_gradient_in_float32():
    """Over more than eight chunks a bf16 weight gradient is summed in float32 and rounded
    once: within two units of the FP64 sum of the chunks' products (a bf16 sum rounded after
    each of 48 chunks strays further)."""
    from fusible.testing import assert_close
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(32, 24, reduction="sum", chunk_size=1).to(torch.bfloat16)
    x = torch.randn(48, 32, dtype=torch.bfloat16)
    labels = torch.randint(0, 24, (48,))
    ops.Sequential(head)(x, labels).backward()
    w = head.weight.detach().double()
    logits = (x.double() @ w.t()).bfloat16().double().requires_grad_()
    _reference(logits, labels, "sum", 0.0, 0.0).backward()
    dz = logits.grad.bfloat16().double()
    assert_close(head.weight.grad, dz.t() @ x.double(), torch.bfloat16, "dweight")
