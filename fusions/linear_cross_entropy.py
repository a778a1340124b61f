"""LinearCrossEntropy: an LM head (BasicLinear) and its CrossEntropy owning both passes,
the logits made a chunk of tokens at a time and never stored."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.cross_entropy import (HeadFp8, LossOptions,
                                              linear_cross_entropy_backward,
                                              linear_cross_entropy_forward)
from fusible.ops import BackwardResult, BasicLinear, CrossEntropy, ForwardResult

Tensor = torch.Tensor


@attrs.define
class LinearLossForwardArgs:
    """``gradients_now``: the gradients are made in the forward, for a unit output
    gradient (a reduced loss, whose backward only scales them: one GEMM less than making
    the logits again in the backward)."""

    input: Tensor
    weight: Tensor
    labels: Tensor
    options: LossOptions
    chunk: int
    need_grad_input: bool
    need_grad_weight: bool
    gradients_now: bool
    fp8: Optional[HeadFp8] = None
    grad_weight_dtype: Optional[torch.dtype] = None


@attrs.define
class LinearLossSaved:
    """With ``gradients_now`` the forward's gradients (in float32 for 16-bit tensors); otherwise the input, the weight, the labels and each token's
    log-sum-exp, to make each chunk's logits again."""

    grad_input: Optional[Tensor] = None
    grad_weight: Optional[Tensor] = None
    input: Optional[Tensor] = None
    weight: Optional[Tensor] = None
    labels: Optional[Tensor] = None
    lse: Optional[Tensor] = None
    input_dtype: torch.dtype = torch.float32  # the input gradient's


@attrs.define
class LinearLossBackwardArgs:
    grad_output: Tensor
    saved: LinearLossSaved
    options: LossOptions
    chunk: int
    need_grad_input: bool
    need_grad_weight: bool
    weight_grad_dtype: torch.dtype
    fp8: Optional[HeadFp8] = None


class LinearCrossEntropy(FusedOperation):
    """A joint fusion: the LM head's GEMM and the cross-entropy of its logits, chunked
    over the tokens (see :class:`fusible.ops.LinearCrossEntropy`, which expands into
    these two ops). Each chunk's logits are made, reduced to the tokens' losses in float32
    and (where a gradient is wanted) turned into their gradient at once: the whole logits
    never exist, forward or backward.

    Pattern: ``BasicLinear, CrossEntropy``. Refused for tensor-parallel layers (a
    vocabulary split needs the loss reduced over the group). Under an FP8 recipe with
    per-tensor current scaling (``"tensorwise"``) the logits' and the hidden states'
    gradient's GEMMs run in FP8, the weight's gradient in high precision, chunks of a
    multiple of 16 tokens; other recipes are refused (the ops then run as their own
    stages, the logits whole), the plan saying why. On CUDA each chunk's losses and
    logit gradient are one Triton kernel (:mod:`fusible.kernels.cross_entropy`), the
    gradient written over the chunk's logits.
    Rounds as the basic ops do: the logits to the model's dtype after the GEMM, their
    gradient before the GEMMs of the backward; the weight's gradient is summed over the
    chunks in its own dtype, each chunk's GEMM adding into it (one rounding per chunk where
    the unfused GEMM rounds once; in float32, rounded once, over more than eight chunks or
    where it goes into ``main_grad``: :mod:`fusible.functional.head_gemms`). With ``reduction="mean"`` or ``"sum"`` the
    logits' gradient is made (and rounded) in the forward for an output gradient of 1, and
    the backward scales the float32 results by the actual one: the same roundings as the
    ops' for an output gradient of 1 or any power of two (``loss.backward()``, a loss
    scale), one rounding apart otherwise. (The registry matrix's example therefore uses
    ``"none"``, the ops' rounding points exactly; tests/test_cross_entropy.py checks the
    others.)
    """

    direction = "both"
    pattern = Pattern(Op(BasicLinear, name="linear"), Op(CrossEntropy, name="loss"))
    fwd_args_type = LinearLossForwardArgs
    bwd_args_type = LinearLossBackwardArgs
    saved_type = LinearLossSaved
    rounds_output_after = ("linear",)
    rounds_gradient_before = ("loss",)

    @classmethod
    def accepts(cls, match, env):
        linear = match["linear"]
        if linear.parallel.active:
            return (f"{linear.describe()} is tensor-parallel: a vocabulary split over ranks "
                    f"needs the loss reduced over the group, which this stage does not do")
        recipe = env.recipe_of(match.indices[0])  # None: the FP8 policy keeps it in bf16
        if recipe is not None and _head_fp8(recipe) is None:
            return (f"under {recipe.name} scaling: the chunked LM head runs its FP8 GEMMs "
                    f"with per-tensor current scaling only, so the ops run as their own "
                    f"stages (the logits whole, the GEMM in FP8)")
        return True

    def input_format(self, recipe, needs):
        return None  # high-precision hidden states: the stage casts them itself

    def grad_format(self, recipe, needs):
        return None  # the loss's gradient, a number per token at most

    def forward_args(self, input, params, extra_inputs, ctxs):
        linear, loss = self.match["linear"], self.match["loss"]
        needs = ctxs[0].needs
        wanted = needs.input or needs.params[0]
        fp8 = _head_fp8(ctxs[0].recipe)
        return LinearLossForwardArgs(
            input, params[0], extra_inputs[0], loss.options,
            _chunk(loss.chunk(linear.out_features), fp8), needs.input, needs.params[0],
            wanted and loss.reduction != "none", fp8, linear.wgrad_dtype or params[0].dtype)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        loss, lse, dx, dw = linear_cross_entropy_forward(
            args.input.reshape(-1, args.input.shape[-1]), args.weight,
            args.labels.reshape(-1), args.options, args.chunk, args.need_grad_input,
            args.need_grad_weight, args.gradients_now, args.fp8, args.grad_weight_dtype)
        if args.options.reduction == "none":
            loss = loss.view(args.labels.shape)
        if not args.gradients_now:
            return ForwardResult(loss, (), (lse,))
        aux = (dx.view(args.input.shape),) if args.need_grad_input else ()  # float32
        return ForwardResult(loss, (), aux + ((dw,) if args.need_grad_weight else ()))

    def save_for_backward(self, args, result, ctxs):
        if not (args.need_grad_input or args.need_grad_weight):
            return
        if args.gradients_now:
            aux = iter(result.aux)
            ctxs[0].saved = LinearLossSaved(next(aux) if args.need_grad_input else None,
                                            next(aux) if args.need_grad_weight else None,
                                            input_dtype=args.input.dtype)
        else:
            ctxs[0].saved = LinearLossSaved(None, None, args.input, args.weight, args.labels,
                                            result.aux[0])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        linear, loss = self.match["linear"], self.match["loss"]
        needs = ctxs[0].needs
        fp8 = _head_fp8(ctxs[0].recipe)
        return LinearLossBackwardArgs(
            grad_output, ctxs[0].saved, loss.options,
            _chunk(loss.chunk(linear.out_features), fp8), needs.input, needs.params[0],
            linear.wgrad_dtype or linear.param("weight").dtype, fp8)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        saved = args.saved
        if saved.input is None:
            return _scaled_forward_grads(args)
        assert saved.weight is not None and saved.labels is not None and saved.lse is not None
        dx, dw = linear_cross_entropy_backward(
            args.grad_output, saved.input.reshape(-1, saved.input.shape[-1]), saved.weight,
            saved.labels.reshape(-1), saved.lse, args.options, args.chunk,
            args.need_grad_input, args.need_grad_weight, args.fp8, args.weight_grad_dtype)
        dx = None if dx is None else dx.view(saved.input.shape)
        return BackwardResult(dx, (dw,), (None,))

    @classmethod
    def example(cls):
        labels = torch.tensor([[3, -100, 0], [9, 2, 9]])
        return Example((BasicLinear(16, 10),
                        CrossEntropy(reduction="none", label_smoothing=0.25, z_loss=0.125,
                                     chunk_size=4)),
                       (2, 3, 16), extra_input_values=(labels,), fp8=False)


def _head_fp8(recipe) -> Optional[HeadFp8]:
    """The head's FP8 dtypes under ``recipe`` where its formats are per-tensor current
    scaling (None: no recipe, or one the head's GEMMs do not take)."""
    if recipe is None:
        return None
    formats = (recipe.input_format(), recipe.weight_format(), recipe.grad_format())
    if any(not f.per_tensor or f.stateful for f in formats):
        return None
    return HeadFp8(*(f.fp8_dtype for f in formats))


def _chunk(chunk: int, fp8: Optional[HeadFp8]) -> int:
    """FP8 GEMMs take operands whose dimensions divide by 16: chunks of 16 tokens."""
    return max(16, chunk // 16 * 16) if fp8 is not None else chunk


def _scaled_forward_grads(args: LinearLossBackwardArgs) -> BackwardResult:
    """The forward's gradients (for a unit output gradient) times the output gradient."""
    dx = dw = None
    if args.need_grad_input:
        saved = args.saved.grad_input
        assert saved is not None  # made by the forward (gradients_now), in float32
        dx = (saved * args.grad_output.to(saved.dtype)).to(args.saved.input_dtype)
    if args.need_grad_weight:
        saved = args.saved.grad_weight
        assert saved is not None
        scale = args.grad_output.to(saved.dtype)
        # scaled in place: this backward is the saved gradient's only reader (a pipeline's
        # backward runs once), and a second (vocab, hidden) tensor would set the head's peak
        dw = saved.mul_(scale) if saved.dtype == args.weight_grad_dtype else \
            (saved * scale).to(args.weight_grad_dtype)
    return BackwardResult(dx, (dw,), (None,))
