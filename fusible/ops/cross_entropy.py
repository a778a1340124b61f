"""CrossEntropy: the loss of logits against labels, chunked over the tokens (for models
that keep their own LM head; :class:`~fusible.ops.LinearCrossEntropy` never stores the
logits at all)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import cross_entropy as ce
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class CrossEntropyForwardArgs:
    input: Tensor
    labels: Tensor
    options: ce.LossOptions
    chunk: int


@attrs.define
class CrossEntropySaved:
    """The logits, labels and each token's log-sum-exp (float32 for 16-bit logits)."""

    logits: Tensor
    labels: Tensor
    lse: Tensor


@attrs.define
class CrossEntropyBackwardArgs:
    grad_output: Tensor
    logits: Tensor
    labels: Tensor
    lse: Tensor
    options: ce.LossOptions
    chunk: int


class LossOp(BasicOperation, abstract=True):
    """What the two cross-entropy ops share: the options, the labels as the extra input,
    their checks and the reference."""

    num_extra_inputs = 1
    attribute_checks = {"ignore_index": checks.integer("ignore_index"),
                        "reduction": checks.one_of("reduction", ce.REDUCTIONS),
                        "label_smoothing": checks.real("label_smoothing", minimum=0.0),
                        "z_loss": checks.real("z_loss", minimum=0.0),
                        "chunk_size": checks.optional(checks.positive_int("chunk_size"))}

    def _init_options(self, ignore_index: int, reduction: str, label_smoothing: float,
                      z_loss: float, chunk_size: Optional[int]) -> None:
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss = label_smoothing, z_loss
        self.chunk_size = chunk_size
        ce.check_options(type(self).__name__, self.options)

    @property
    def options(self) -> ce.LossOptions:
        return ce.LossOptions(self.ignore_index, self.reduction, self.label_smoothing,
                              self.z_loss)

    def chunk(self, vocab: int) -> int:
        return self.chunk_size or ce.default_chunk(vocab)

    def _options_text(self) -> str:
        text = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"
        if self.label_smoothing:
            text += f", label_smoothing={self.label_smoothing}"
        if self.z_loss:
            text += f", z_loss={self.z_loss}"
        return text

    def _check_labels(self, labels, tokens_shape: tuple, device) -> None:
        checks.extra_tensor(self.describe(), labels, "the labels",
                            "an integer tensor (int32 or int64)", tokens_shape,
                            (torch.int32, torch.int64).__contains__, device)

    def _output_shape(self, tokens_shape: tuple) -> tuple:
        return tokens_shape if self.reduction == "none" else ()

    def loss_reference(self, logits: Tensor, labels: Tensor) -> Tensor:
        """``F.cross_entropy`` on the logits, plus the z-loss, reduced as the op reduces."""
        z = logits.reshape(-1, logits.shape[-1])
        flat = labels.reshape(-1).long()
        losses = F.cross_entropy(z, flat, ignore_index=self.ignore_index, reduction="none",
                                 label_smoothing=self.label_smoothing)
        if self.z_loss:
            lse = torch.logsumexp(z, -1)
            losses = losses + self.z_loss * torch.where(flat != self.ignore_index,
                                                        lse.square(), 0.0)
        return ce.reduce_losses(losses, flat.reshape(labels.shape), self.options)


class CrossEntropy(LossOp):
    """The cross-entropy loss of logits ``(..., vocab)`` against integer labels ``(...)``,
    ``loss = model(logits, labels)``: ``F.cross_entropy`` (``ignore_index``,
    ``reduction``, ``label_smoothing``) plus an optional z-loss ``z_loss * lse**2`` per
    token, computed over chunks of tokens in float32 (no float32 copy of all the logits),
    the loss in float32 for 16-bit logits. The formulas: :mod:`fusible.functional.cross_entropy`.

    Parameters
    ----------
    ignore_index : int
        Tokens with this label count for nothing (``reduction="mean"`` averages over the
        others).
    reduction : {"mean", "sum", "none"}
    label_smoothing : float
        In [0, 1], as ``F.cross_entropy``'s.
    z_loss : float
        Weight of the squared log-partition per token (0: none).
    chunk_size : int or None
        Tokens per chunk (None: chunks of at most 2**28 logits, 512 MiB in bf16).
    """

    fwd_args_type = CrossEntropyForwardArgs
    bwd_args_type = CrossEntropyBackwardArgs
    saved_type = CrossEntropySaved

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 chunk_size: Optional[int] = None):
        super().__init__()
        self._init_options(ignore_index, reduction, label_smoothing, z_loss, chunk_size)

    def describe(self) -> str:
        return f"CrossEntropy({self._options_text()})"

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape or not dtype.is_floating_point:
            raise ValueError(f"{self.describe()} takes floating logits (..., vocab), got "
                             f"{dtype} of shape {tuple(shape)}")
        self._check_labels(extra_inputs[0], tuple(shape[:-1]), device)
        return self._output_shape(tuple(shape[:-1]))

    def forward_args(self, input, params, extra_inputs, ctxs):
        return CrossEntropyForwardArgs(input, extra_inputs[0], self.options,
                                       self.chunk(input.shape[-1]))

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        z = args.input.reshape(-1, args.input.shape[-1])
        labels = args.labels.reshape(-1)
        ce.check_labels(labels, z.shape[-1], args.options, "CrossEntropy")
        acc = ce.loss_dtype(z.dtype)
        losses = z.new_empty(labels.shape, dtype=acc)
        lse = torch.empty_like(losses)
        for lo, hi in ce.chunks(z.shape[0], args.chunk):
            ce.chunk_forward(z[lo:hi], labels[lo:hi], args.options, losses[lo:hi], lse[lo:hi])
        loss = ce.reduce_losses(losses, args.labels, args.options)
        return ForwardResult(loss, (), (lse,))

    def save_for_backward(self, args, result, ctxs):
        if ctxs[0].needs.input:
            ctxs[0].saved = CrossEntropySaved(args.input, args.labels, result.aux[0])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        saved = ctxs[0].saved
        return CrossEntropyBackwardArgs(grad_output, saved.logits, saved.labels, saved.lse,
                                        self.options, self.chunk(saved.logits.shape[-1]))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        z = args.logits.reshape(-1, args.logits.shape[-1])
        labels = args.labels.reshape(-1)
        scale = ce.grad_row_scale(args.grad_output, labels, args.options, args.lse.dtype)
        dz = torch.empty_like(z)
        for lo, hi in ce.chunks(z.shape[0], args.chunk):
            ce.chunk_grad(z[lo:hi], labels[lo:hi], args.options, args.lse[lo:hi], scale[lo:hi],
                          out=dz[lo:hi])
        return BackwardResult(dz.view(args.logits.shape), (), (None,))

    def reference(self, x, extra_inputs, params):
        return self.loss_reference(x, extra_inputs[0]), ()

    @classmethod
    def example(cls):
        labels = torch.tensor([[3, -100, 0], [7, 2, 7]])
        return Example((cls(label_smoothing=0.25, z_loss=0.125, chunk_size=4),), (2, 3, 8),
                       extra_input_values=(labels,), fp8=False)
