"""Delayed scaling, as TransformerEngine's ``DelayedScaling``: a tensor is cast with the
scale that its role's earlier amaxes give, and its own amax joins that history in the
same pass. No pass over a tensor for its amax before the cast, so every cast reads its
tensor once (current scaling reads it twice, or recomputes a producer's values twice).

The scaling (:class:`DelayedTensorScaling`, one scale per tensor) is stateful: each op
keeps one state per tensor role (a linear layer's input, weight and output gradient)
as a buffer, zeros at first (scale 1: the first step's values are not yet known), and
the formats carry it to the casts (``Float8Format.state``); the state's layout and its
update are :mod:`fusible.kernels.fp8_delayed`'s.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Optional

import attrs
import torch
import torch.distributed as dist

from fusible.kernels import fp8_cast, fp8_delayed, plain_eager
from fusible.kernels.fp8_delayed import DelayedCast
from fusible.quantization import cast
from fusible.quantization.recipe import GranularityRecipe, check_fp8_format
from fusible.quantization.scaling import Scaling, register_scaling

_c10d = torch.ops._c10d_functional
ALGORITHMS = ("max", "most_recent")


@attrs.frozen
class DelayedTensorScaling(Scaling):
    """One scale per tensor, from the amaxes its role recorded in its ``history`` last
    casts (their maximum, or the newest with ``most_recent``), ``2 ** margin`` smaller;
    each cast records its tensor's amax, reduced over the process group named ``group``
    first where given. Its name says its parameters (``"delayed_max16"``, ...)."""

    history: int
    most_recent: bool = False
    margin: int = 0
    group: str = ""

    kernel_cast: ClassVar[bool] = True
    per_tensor: ClassVar[bool] = True
    stateful: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return (f"delayed_{'latest' if self.most_recent else 'max'}{self.history}"
                + (f"_margin{self.margin}" if self.margin else "")
                + (f"_group{self.group}" if self.group else ""))

    @property
    def state_size(self) -> int:
        return 2 + self.history

    def describes(self, data, scale_inv):
        return scale_inv.dim() == 0

    def delayed(self, state: Optional[torch.Tensor], reduce=None) -> DelayedCast:
        """The kernels' view of one cast with ``state``; ``reduce``: a maximum over
        another group (tensor parallelism's) before this scaling's own."""
        if state is None:
            raise ValueError(f"an FP8 cast under {self.name} scaling needs its role's state "
                             f"(a Float8Format bound to it); none was given")
        own = _max_over(self.group)
        if reduce is not None and own is not None:
            return DelayedCast(state, self.most_recent, self.margin, lambda t: own(reduce(t)))
        return DelayedCast(state, self.most_recent, self.margin, reduce or own)

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        if not rowwise:
            raise ValueError(f"a {self.name} cast keeps the data: its scale and amax are "
                             f"those of the step's one cast of the tensor")
        parts = cast_to_fp8_delayed(x2, fp8_dtype, columnwise, self.delayed(state))
        return [parts[0], parts[1], parts[2] if columnwise else None, None]

    def cast_gathered(self, x2, fp8_dtype, columnwise, gather, max_over_group, state=None):
        # The ranks' states are equal (their amaxes always reduced over the group): the
        # same scale on every rank, and each casts its own rows.
        data, scale_inv = cast_to_fp8_delayed(x2, fp8_dtype, False,
                                              self.delayed(state, max_over_group))[:2]
        data = gather(data)
        return [data, scale_inv, fp8_cast.transposed_copy(data) if columnwise else None, None]


def _max_over(group: str):
    """``t -> t``: the elementwise maximum over the process group named ``group``, or None."""
    if not group:
        return None
    return lambda t: _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "max", group))


def cast_to_fp8_delayed(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
                        delayed: DelayedCast) -> list:
    """``[data, scale_inv]`` (+ ``transpose``) of ``x`` cast by ``delayed``'s state, its
    amax recorded and the state rolled: one Triton kernel on CUDA, PyTorch ops elsewhere
    (the same bits; traced, the ops)."""
    if x.is_cuda and fp8_delayed.triton is not None and x.numel() \
            and plain_eager(x, delayed.state):
        return fp8_delayed.cast_delayed_triton(x, fp8_dtype, cast.FP8_MAX[fp8_dtype],
                                               columnwise, delayed)
    parts = cast.cast_to_fp8_any(x, fp8_dtype, columnwise, delayed.state[0])
    amax = cast.tensor_amax(x)
    if delayed.reduce is not None:
        amax = delayed.reduce(amax)
    fp8_delayed.roll_torch(delayed.state, amax, delayed.most_recent, delayed.margin)
    return parts


@functools.lru_cache(maxsize=None)
def delayed_scaling(history: int, most_recent: bool, margin: int, group: str
                    ) -> DelayedTensorScaling:
    """The registered scaling of these parameters (registered on first use)."""
    return register_scaling(DelayedTensorScaling(history, most_recent, margin, group))


def _group_name(group) -> Optional[str]:
    if group is None or isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    raise TypeError(f"DelayedScaling: amax_reduction_group must be a ProcessGroup, its name "
                    f"or None, got {group!r}")


def _check_history(recipe, attribute, value) -> None:
    if type(value) is not int or not 1 <= value <= 65536:
        raise ValueError(f"DelayedScaling: amax_history_len must be an int in [1, 65536], "
                         f"got {value!r}")


def _check_margin(recipe, attribute, value) -> None:
    if type(value) is not int or not 0 <= value <= 32:
        raise ValueError(f"DelayedScaling: margin must be an int in [0, 32], got {value!r}")


def _check_algorithm(recipe, attribute, value) -> None:
    if value not in ALGORITHMS:
        raise ValueError(f"DelayedScaling: amax_compute_algo must be one of {ALGORITHMS}, "
                         f"got {value!r}")


@attrs.frozen
class DelayedScaling(GranularityRecipe):
    """Delayed scaling (TransformerEngine's): each op keeps, for each tensor role (a
    linear layer's input, weight and output gradient), the amaxes of that role's last
    ``amax_history_len`` casts; a cast scales by ``FP8_MAX / (amax * 2 ** margin)`` with
    ``amax`` the history's maximum (or newest), and records its own tensor's amax in the
    same pass. One scale per tensor, so the norm and activation kernels write the next
    GEMM's FP8 operand in one pass. Registered as ``"delayed"`` (presets ``"delayed"``
    and ``"delayed_e4m3"``).

    The histories are buffers of the ops (``fp8_delayed_input``, ``..._weight``,
    ``..._grad``: ``[amax the next cast scales by, 0, history newest first]``), created
    at the first plan under this recipe, saved in state_dicts and moved by ``.to()``;
    at first all zero (scale 1). A history advances at every cast of its role: once per
    forward for inputs and weights, once per backward for gradients (each microbatch of
    gradient accumulation counts). Tensor parallelism's FP8 gathers reduce the amax over
    the group before it joins the history, so every rank casts with the same scale.

    Parameters
    ----------
    fp8_format : {"hybrid", "e4m3"}
        E4M3 forward; E5M2 (``"hybrid"``) or E4M3 gradients.
    amax_history_len : int
        How many recorded amaxes a scale is derived from.
    amax_compute_algo : {"max", "most_recent"}
        The history's maximum, or its newest value.
    margin : int
        Scales ``2 ** margin`` smaller (headroom for growing values).
    reduce_amax : bool
        Reduce every recorded amax (maximum) over ``amax_reduction_group`` (the default
        process group when None), so that every data-parallel rank scales alike: one
        small all-reduce per cast.
    amax_reduction_group : torch.distributed.ProcessGroup or str, optional
        The group (or its name) of ``reduce_amax``.
    """

    name: ClassVar[str] = "delayed"
    presets: ClassVar[dict] = {"delayed": {}, "delayed_e4m3": {"fp8_format": "e4m3"}}

    fp8_format: str = attrs.field(default="hybrid", validator=check_fp8_format)
    amax_history_len: int = attrs.field(default=1024, validator=_check_history)
    amax_compute_algo: str = attrs.field(default="max", validator=_check_algorithm)
    margin: int = attrs.field(default=0, validator=_check_margin)
    reduce_amax: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    amax_reduction_group: Optional[str] = attrs.field(default=None, converter=_group_name)

    def __attrs_post_init__(self):
        if self.amax_reduction_group is not None and not self.reduce_amax:
            raise ValueError("DelayedScaling: amax_reduction_group is given but reduce_amax is "
                             "False")
        if self.reduce_amax and self.amax_reduction_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("DelayedScaling(reduce_amax=True) reduces over the default "
                                   "process group: call torch.distributed.init_process_group() "
                                   "first, or pass amax_reduction_group")
            object.__setattr__(self, "amax_reduction_group", dist.group.WORLD.group_name)

    @property
    def scaling(self) -> DelayedTensorScaling:
        """This recipe's scaling (the same for every role; each role has its own state)."""
        return delayed_scaling(self.amax_history_len, self.amax_compute_algo == "most_recent",
                               self.margin, self.amax_reduction_group or "")

    @property
    def granularity(self) -> str:
        return self.scaling.name
