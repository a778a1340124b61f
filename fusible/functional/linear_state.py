"""A linear layer's per-call state: building its GEMM records, saving and restoring
:class:`~fusible.functional.linear.LinearSaved`. Shared by BasicLinear and every fusion
that covers one, so all of them save and read the same layout."""

from __future__ import annotations

from typing import Optional

from fusible.functional.linear import as_fp8, handed_in
from fusible.functional.linear_records import GemmBackwardArgs, GemmForwardArgs, LinearSaved
from fusible.functional.parallel import TensorParallel
from fusible.quantization.format import Float8Format, bound_format
from fusible.quantization.tensor.quantize import transposed_only

# Declared for fusion authors (docs/writing_a_fusion.md, "Helpers for fusion authors").
__all__ = ["forward_aux", "gemm_backward_args", "gemm_forward_args", "gemm_grad_format",
           "gemm_input_format", "save_linear"]


def gemm_input_format(recipe, needs) -> Optional[Float8Format]:
    """The format a linear layer's GEMM reads its input in: what a fusion starting with a
    linear layer returns from ``input_format``.

    Parameters
    ----------
    recipe : Recipe or None
        The FP8 recipe in effect.
    needs : OpGradNeeds
        The linear layer's gradient needs: with the transposed copy when wgrad needs it
        (``needs.params[0]``).

    Returns
    -------
    Float8Format or None
        None without a recipe.
    """
    return None if recipe is None else recipe.input_format(columnwise=needs.params[0])


def gemm_grad_format(recipe, needs) -> Optional[Float8Format]:
    """The format a linear layer's backward GEMMs read ``dy`` in: what a backward fusion
    ending with a linear layer returns from ``grad_format``.

    Parameters
    ----------
    recipe : Recipe or None
        The FP8 recipe in effect.
    needs : OpGradNeeds
        The linear layer's gradient needs: with the transposed copy when wgrad needs it.

    Returns
    -------
    Float8Format or None
        None without a recipe.
    """
    return None if recipe is None else recipe.grad_format(columnwise=needs.params[0])


def gemm_forward_args(input, weight, tp: TensorParallel, ctx) -> GemmForwardArgs:
    """The forward GEMM record of a linear layer, its FP8 formats from its context.

    Parameters
    ----------
    input : Tensor or Float8Tensor
        The GEMM's input.
    weight : Tensor or Float8Tensor
        The layer's weight parameter (its local shard).
    tp : TensorParallel
        The layer's ``tp``.
    ctx : OperationContext
        The linear layer's context (its ``recipe`` and ``needs``).

    Returns
    -------
    GemmForwardArgs
    """
    recipe = ctx.recipe
    if recipe is None:
        return GemmForwardArgs(input, weight, None, None, tp)
    return GemmForwardArgs(input, weight,
                           bound_format(gemm_input_format(recipe, ctx.needs), ctx, "input"),
                           bound_format(recipe.weight_format(), ctx, "weight"), tp)


def forward_aux(gemm: GemmForwardArgs, kept) -> tuple:
    """The aux tensors a forward GEMM stage returns (``ForwardResult.aux``), which
    :func:`save_linear` reads.

    Parameters
    ----------
    gemm : GemmForwardArgs
        The record the GEMM ran.
    kept
        What :func:`~fusible.functional.linear.gemm_forward` returned beside ``y``.

    Returns
    -------
    tuple
        In high precision the gathered input (column + sequence parallel) if any; under
        FP8 the input's transposed copy and scale and the weight's amax, ``(x_t,
        x_scale_inv, w_amax)`` (None where not kept). An input that arrived in FP8 is the
        caller's to save (see :func:`~fusible.functional.linear.handed_in`): then
        ``(w_amax,)``.
    """
    if gemm.input_format is None:
        return () if kept is None else (kept,)
    x_q, w_amax = kept
    if _kept_by_caller(gemm):
        return (w_amax,)
    return (x_q._transpose, x_q.transpose_scale_inv, w_amax)


def _kept_by_caller(gemm: GemmForwardArgs) -> bool:
    """The input arrived in FP8 and the GEMM used it as it is (not gathered): its buffers
    are the caller's, so the stage returns none of them."""
    return handed_in(gemm.input, gemm.input_format) and not gemm.parallel.gathers_input


def save_linear(ctx, gemm: GemmForwardArgs, aux: tuple) -> None:
    """Set ``ctx.saved`` to the linear layer's
    :class:`~fusible.functional.linear_records.LinearSaved`, as BasicLinear saves it: the
    input for wgrad, the weight for dgrad.

    Under FP8 the input is kept as its transposed FP8 copy only (all wgrad reads), from
    the forward result's aux; the weight is kept as the parameter itself and quantized
    again in the backward, with the forward's amax.

    Parameters
    ----------
    ctx : OperationContext
        The linear layer's context.
    gemm : GemmForwardArgs
        The record the GEMM ran.
    aux : tuple
        The stage's ``ForwardResult.aux``: exactly :func:`forward_aux`'s tuple.

    Raises
    ------
    TypeError
        Under FP8, for an ``aux`` that is not :func:`forward_aux`'s.
    """
    needs = ctx.needs
    x = None
    w_amax = _weight_amax(gemm, aux) if gemm.input_format is not None and needs.input else None
    if needs.params[0]:
        fmt = gemm.input_format
        if fmt is None:
            x = aux[0] if aux else gemm.input
        else:
            if _kept_by_caller(gemm):
                x_q = as_fp8(gemm.input, fmt)
                x_t, x_scale_inv = x_q._transpose, x_q.transpose_scale_inv
                assert x_t is not None  # fmt is columnwise where wgrad is needed
            else:
                x_t, x_scale_inv = aux[:2]
            x = transposed_only(x_t, x_scale_inv, gemm.input.dtype)
    ctx.saved = LinearSaved(x, gemm.weight if needs.input else None, w_amax)


def _weight_amax(gemm: GemmForwardArgs, aux: tuple):
    """The weight's amax in an FP8 forward's aux, read where :func:`forward_aux` puts it
    (a wrong amax would quantize the backward's weight wrongly, without an error)."""
    expected = 1 if _kept_by_caller(gemm) else 3
    if len(aux) != expected:
        raise TypeError(f"save_linear: under FP8 the aux must be forward_aux's result "
                        f"({'(w_amax,)' if expected == 1 else '(x_t, x_scale_inv, w_amax)'}), "
                        f"got {len(aux)} tensors")
    return aux[expected - 1]


def gemm_backward_args(ctx, grad_output, tp: TensorParallel,
                       wgrad_dtype=None) -> GemmBackwardArgs:
    """The backward GEMM record of a linear layer from its context and saved record.

    Under FP8 the weight goes in high precision with the forward's amax:
    :func:`~fusible.functional.linear.gemm_backward` quantizes it into the transposed copy
    dgrad reads, the same bits as in the forward (current scaling of an unchanged
    parameter; autograd checks its version), and no FP8 copy of every weight is held
    between the passes.

    Parameters
    ----------
    ctx : OperationContext
        The linear layer's context, its ``saved`` a LinearSaved.
    grad_output : Tensor or Float8Tensor
        ``dy``.
    tp : TensorParallel
        The layer's ``tp``.
    wgrad_dtype : torch.dtype, optional
        The layer's ``BasicLinear.wgrad_dtype`` (float32 where the weight gradient goes
        into ``main_grad``).

    Returns
    -------
    GemmBackwardArgs
    """
    saved, recipe, needs = ctx.saved, ctx.recipe, ctx.needs
    if recipe is None:
        return GemmBackwardArgs(grad_output, saved.input, saved.weight, None, needs.input,
                                needs.params[0], tp, wgrad_dtype=wgrad_dtype)
    # The weight's format unbound: dgrad casts it with the forward's amax, recording nothing
    return GemmBackwardArgs(grad_output, saved.input, saved.weight,
                            bound_format(gemm_grad_format(recipe, needs), ctx, "grad"),
                            needs.input, needs.params[0], tp,
                            weight_format=recipe.weight_format(), weight_amax=saved.weight_amax,
                            wgrad_dtype=wgrad_dtype)
