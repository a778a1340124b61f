"""Scalings: what one FP8 scale covers, the plugin point behind a format's ``granularity``.

A :class:`Scaling` casts a 2-D (rows, features) tensor into FP8 data with its scales
and, where a GEMM contracting over the rows needs it, the transposed copy with the
copy's own scales; it says whether the producers' fused casts write it
(``kernel_cast``: per-tensor scales only) and whether the GEMMs it feeds run natively
on a device or emulated. Scales are stored so that the shapes say which block each
covers (:func:`fusible.quantization.casts.common.scale_blocks`): a Float8Tensor
dequantizes, views and transposes whatever its scaling. A recipe picks scalings by name
in its formats; a new one registers with :func:`register_scaling`. The built-in ones
(a file per family here) call the casts of :mod:`fusible.quantization.casts`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, TypeVar

import attrs
import torch

_scalings: dict = {}  # name -> Scaling


@attrs.frozen
class Scaling:
    """Base of scalings (a subclass registers an instance with :func:`register_scaling`).

    Attributes
    ----------
    name : str
        The registry's name, what ``Float8Format.granularity`` holds.
    kernel_cast : bool
        Whether the norm and activation kernels' fused casts (one scale per tensor)
        write this scaling; otherwise those stages hand over high precision and the
        cast follows them in the same stage.
    per_tensor : bool
        One scale per tensor (0-d scales).
    stateful : bool
        The casts read and update a state tensor of their tensor role (one per op and
        role, kept by the op: ``state_size`` float32 values, zeros at first) that the
        format carries (``Float8Format.state``): delayed scaling's amax history.
    """

    if TYPE_CHECKING:  # read-only, for the type checker: a subclass may compute it
        @property
        def name(self) -> str: ...
    else:
        name: ClassVar[str] = ""
    kernel_cast: ClassVar[bool] = False
    per_tensor: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    @property
    def state_size(self) -> int:
        """The number of float32 values of a role's state (0: stateless)."""
        return 0

    def cast(self, x2: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = True,
             columnwise: bool = False, state=None) -> list:
        """``[data, scale_inv, transpose, transpose_scale_inv]`` of the 2-D ``x2``, None
        where not asked for; ``transpose`` is the row-major (features, rows) copy.
        ``state``: the role's state tensor of a stateful scaling (updated), else None."""
        raise NotImplementedError(f"{type(self).__name__}.cast")

    def describes(self, data: torch.Tensor, scale_inv: torch.Tensor) -> bool:
        """Whether ``scale_inv`` has the shape (and dtype) this scaling gives ``data``."""
        raise NotImplementedError(f"{type(self).__name__}.describes")

    def emulated_on(self, device: torch.device) -> bool:
        """Whether the GEMMs of this scaling run emulated on ``device`` (dequantized
        operands, a float32 GEMM) for want of a native kernel."""
        return False

    def cast_gathered(self, x2: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
                      gather, max_over_group, state=None) -> list:
        """``[data, scale_inv, transpose, transpose_scale_inv]`` of the rows of every rank
        concatenated (``gather(t)``: every rank's ``t`` along dim 0), each rank casting
        its own rows: the bits of casting the gathered tensor. ``max_over_group(t)``: the
        elementwise maximum over the ranks; ``state`` as in :meth:`cast`. Scalings whose
        scales span rows of several ranks raise NotImplementedError."""
        raise NotImplementedError(f"an FP8 all-gather under {self.name} scaling is not "
                                  f"implemented")


_S = TypeVar("_S", bound=Scaling)


def register_scaling(scaling: _S) -> _S:
    """Make ``scaling`` (an instance of a :class:`Scaling` subclass) a granularity that
    formats may name. Raises ValueError if another scaling holds its name."""
    if not (isinstance(scaling, Scaling) and scaling.name):
        raise TypeError(f"register_scaling: takes an instance of a named Scaling subclass, "
                        f"got {scaling!r}")
    known = _scalings.get(scaling.name)
    if known is not None and known != scaling:
        raise ValueError(f"register_scaling: the name {scaling.name!r} is taken by {known!r}")
    _scalings[scaling.name] = scaling
    return scaling


def scaling_named(name: str) -> Scaling:
    """The registered scaling ``name``; ValueError listing the known ones otherwise."""
    found = _scalings.get(name)
    if found is None:
        raise ValueError(f"no FP8 scaling named {name!r}; known: {', '.join(_scalings)}")
    return found


def registered_scalings() -> dict:
    """``{name: Scaling}``, in registration order."""
    return dict(_scalings)


def scaling_of(data: torch.Tensor, scale_inv: torch.Tensor) -> Scaling:
    """The first registered scaling that describes these scales (ValueError if none)."""
    found = next((s for s in _scalings.values() if s.describes(data, scale_inv)), None)
    if found is None:
        raise ValueError(f"no registered FP8 scaling gives data of shape {tuple(data.shape)} "
                         f"scales of shape {tuple(scale_inv.shape)} ({scale_inv.dtype})")
    return found


def gather_columns(t: torch.Tensor, gather) -> torch.Tensor:
    """Every rank's (rows, columns) ``t`` concatenated along the columns (a gather along
    dim 0, then the ranks' blocks side by side)."""
    stacked = gather(t.contiguous())
    ranks = stacked.shape[0] // t.shape[0] if t.shape[0] else 1
    return stacked.view(ranks, *t.shape).permute(1, 0, 2).reshape(t.shape[0], -1)
