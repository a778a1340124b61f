"""Float8Format: how one tensor is quantized, as a value that stages ask for and hand on.

A consuming stage says in which format it wants its input or gradient
(``input_format(recipe, needs)`` / ``grad_format(...)``); the stage before it
produces that format. The format crosses custom ops as an ordinary argument.
"""

from __future__ import annotations

import functools
from typing import Optional, Protocol, cast

import attrs
import torch

from fusible.core.schema import SchemaType, register_schema_type
from fusible.kernels.fp8_cast import transposed_copy
from fusible.kernels.fp8_delayed import DelayedCast
from fusible.quantization.casts.common import FP8_MAX
from fusible.quantization.scalings.base import Scaling, registered_scalings, scaling_named
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.tensor.quantize import quantize_raw, quantize_scaled

# Declared for fusion authors (docs/writing_a_fusion.md, "Helpers for fusion authors").
__all__ = ["Float8Format", "bound_format"]


class _StatefulScaling(Protocol):
    """What a stateful scaling adds for the fused kernels (DelayedTensorScaling's)."""

    def delayed(self, state: Optional[torch.Tensor]) -> DelayedCast: ...


@attrs.frozen
class Float8Format:
    """A quantized tensor's format.

    Attributes
    ----------
    fp8_dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    columnwise : bool
        Also keep the transposed (features, tokens) copy that a GEMM on the other
        operand side needs (wgrad reads the input's and the gradient's).
    granularity : str
        What one scale covers: the name of a registered
        :class:`~fusible.quantization.scalings.base.Scaling` (``"tensorwise"``, ``"rowwise"``,
        ``"blockwise_1x128"``, ``"blockwise_128x128"``, ``"mx_1x32"``, a delayed
        scaling's, or a plugin's).
    state : Tensor or None
        For a stateful scaling (delayed scaling's amax history), the state of the op and
        tensor role this cast belongs to (:meth:`bound`), updated by the cast; not part
        of the format's value (equality, hashing).
    """

    fp8_dtype: torch.dtype = attrs.field()
    columnwise: bool = False
    granularity: str = attrs.field(default="tensorwise")
    state: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)

    @fp8_dtype.validator
    def _check_dtype(self, attribute, value):
        if value not in FP8_MAX:
            raise ValueError(f"Float8Format: fp8_dtype must be one of {list(FP8_MAX)}, "
                             f"got {value!r}")

    @granularity.validator
    def _check_granularity(self, attribute, value):
        if value not in registered_scalings():
            raise ValueError(f"Float8Format: granularity must be a registered scaling "
                             f"({', '.join(registered_scalings())}), got {value!r}")

    @property
    def scaling(self) -> Scaling:
        """The registered scaling this format's granularity names."""
        return scaling_named(self.granularity)

    @property
    def per_tensor(self) -> bool:
        """Whether one scale covers the whole tensor."""
        return self.scaling.per_tensor

    @property
    def stateful(self) -> bool:
        """Whether its casts read and update a state (:attr:`state`)."""
        return self.scaling.stateful

    def bound(self, state: Optional[torch.Tensor]) -> "Float8Format":
        """This format casting with ``state`` (a stateful scaling's; None: unbound)."""
        return attrs.evolve(self, state=state)

    def cast_args(self) -> tuple:
        """``(fp8_dtype, its largest value, columnwise)``: what the fused cast kernels
        take; a stateful format adds the kernels' view of its state
        (:class:`~fusible.kernels.fp8_delayed.DelayedCast`)."""
        if self.stateful:
            scaling = cast(_StatefulScaling, self.scaling)
            return (self.fp8_dtype, FP8_MAX[self.fp8_dtype], self.columnwise,
                    scaling.delayed(self.state))
        return self.fp8_dtype, FP8_MAX[self.fp8_dtype], self.columnwise

    def rowwise(self) -> "Float8Format":
        """The same format without the transposed copy."""
        return attrs.evolve(self, columnwise=False) if self.columnwise else self

    @property
    def kernel_cast(self) -> bool:
        """Whether the producers' fused casts (norms, activations: one scale per tensor)
        write this format; otherwise they hand over high precision and the cast follows
        them in their stage."""
        return self.scaling.kernel_cast

    def matches(self, t) -> bool:
        """Whether the Float8Tensor ``t`` is of this FP8 dtype and scaling (its
        transposed copy aside)."""
        return (isinstance(t, Float8Tensor) and t.fp8_dtype == self.fp8_dtype
                and self.scaling.describes(t._data if t._data.dim() == 2 or self.per_tensor
                                           else t._data.reshape(-1, t.shape[-1]),
                                           _scales_2d(t)))


def to_format(t, fmt: Optional[Float8Format]):
    """``t`` in format ``fmt`` (None: unchanged).

    A Float8Tensor of the format passes (a missing transposed copy of per-tensor data is
    made from the FP8 data, no requantization); anything else is quantized in ``fmt``
    (a Float8Tensor dequantized first): current scaling, or a stateful format's cast.
    """
    if fmt is None:
        return t
    if fmt.matches(t):
        if not fmt.columnwise or t._transpose is not None:
            return t
        if fmt.per_tensor:
            return Float8Tensor(t._data, t._scale_inv, t.dtype, transposed_copy(t._data))
    values = t._dequantize_raw() if isinstance(t, Float8Tensor) else t
    if fmt.per_tensor and not fmt.stateful:
        return quantize_raw(values, fmt.fp8_dtype, fmt.columnwise, t.dtype)
    return quantize_scaled(values, fmt.scaling, fmt.fp8_dtype, fmt.columnwise, values.dtype,
                           state=fmt.state)


def bound_format(fmt: Optional[Float8Format], ctx, role: str) -> Optional[Float8Format]:
    """``fmt`` bound to the op context ``ctx``'s state of tensor ``role`` where it is
    stateful (an op's own casts under delayed scaling); else ``fmt`` itself.

    Parameters
    ----------
    fmt : Float8Format or None
        The format an op casts one of its own tensors in (None: no cast).
    ctx : OperationContext
        The op's context for the call, whose ``states`` hold its scaling states.
    role : {"input", "weight", "grad"}
        The tensor's role.

    Returns
    -------
    Float8Format or None
        ``fmt``, bound to the state when it is stateful.

    Raises
    ------
    RuntimeError
        If ``fmt`` is stateful and the op keeps no state for ``role``.
    """
    if fmt is None or not fmt.stateful:
        return fmt
    state = ctx.states.get(role)
    if state is None:
        raise RuntimeError(f"an FP8 cast in {fmt.granularity} scaling needs the op's {role!r} "
                           f"state, which this op does not keep (its scaling_state_roles)")
    return fmt.bound(state)


def _scales_2d(t: Float8Tensor):
    """``t``'s scales as for its data seen as (tokens, features): scales per row (or per
    tile of a row) with the data's leading dimensions flattened like them."""
    scale_inv = t._scale_inv
    if scale_inv.dim() > 2 and scale_inv.shape[:-1] == t._data.shape[:-1]:
        return scale_inv.reshape(-1, scale_inv.shape[-1])
    return scale_inv


def _flatten(fmt: Optional[Float8Format]) -> list:
    if fmt is None:
        return [None, False, "", None]
    return [fmt.fp8_dtype, fmt.columnwise, fmt.granularity, fmt.state]


def _unflatten(values) -> Optional[Float8Format]:
    fp8_dtype, columnwise, granularity, state = values
    if fp8_dtype is None:
        return None
    fmt = _format(fp8_dtype, columnwise, granularity)
    return fmt if state is None else fmt.bound(state)


@functools.lru_cache(maxsize=None)
def _format(fp8_dtype, columnwise: bool, granularity: str) -> Float8Format:
    """One Float8Format per value: rebuilt inside every custom-op call, so cached."""
    return Float8Format(fp8_dtype, columnwise, granularity)


# The state crosses as a tensor the op's kernel updates (a copy, returned: see
# fusible.runtime.custom_ops); the rest are constants of the graph.
_FORMAT_SCHEMA = SchemaType(("ScalarType?", "bool", "str", "Tensor?"), _flatten, _unflatten,
                            states=(3,))
register_schema_type(Float8Format, _FORMAT_SCHEMA)
register_schema_type(Optional[Float8Format], _FORMAT_SCHEMA)
