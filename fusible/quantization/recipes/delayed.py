"""The delayed-scaling recipe (TransformerEngine's ``DelayedScaling``): every role's
format names the :class:`~fusible.quantization.scalings.delayed.DelayedTensorScaling` of
its parameters."""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import torch.distributed as dist

from fusible.quantization.recipes.granularity import GranularityRecipe, check_fp8_format
from fusible.quantization.scalings.delayed import DelayedTensorScaling, delayed_scaling

ALGORITHMS = ("max", "most_recent")


def _group_name(group: "dist.ProcessGroup | str | None") -> Optional[str]:
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
