"""Process groups for tensor and sequence parallelism, and the collectives the ops run.

Collectives go through PyTorch's functional collectives (``torch.ops._c10d_functional``):
one code path for eager runs and for custom-op kernels, fake implementations that know the
shape changes (so the ops' fake kernels need nothing of their own), and process groups
named by string, which is how a group crosses a custom-op boundary.
All gathers and scatters are along dim 0 (tokens, or sequence for (S, B, H) inputs).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fusible.core.schema import SchemaType, register_schema_type

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

# What fusion authors import (docs/writing_a_fusion.md, "Helpers for fusion authors"); the
# collectives and group helpers serve the ops.
__all__ = ["TensorParallel"]

Tensor = torch.Tensor
_c10d = torch.ops._c10d_functional

_MODES = (None, "column", "row")


@attrs.frozen
class TensorParallel:
    """How one op is split over a process group: every op's parallel state, its
    ``parallel`` attribute (read-only after construction); hashable, crosses custom ops by
    value.

    Attributes
    ----------
    mode : {None, "column", "row"}
        How a linear layer's weight is split (a column-parallel bias: ``"column"``); None
        for an op whose parameters are not split (a replicated bias or norm, a collective).
    sequence_parallel : bool
        Whether tokens (dim 0) are split over the group outside the op.
    group_name : str
        The process group's name (``ProcessGroup.group_name``); ``""`` when alone.
    world_size : int
        The group's size.
    active : bool
        Whether any communication happens (a group of more than one rank).
    gathers_input : bool
        A linear layer that all-gathers its input (column + sequence parallel).
    scatters_output, gathers_grad : bool
        A linear layer that reduce-scatters its output (row + sequence parallel), and so
        all-gathers the gradient it receives.
    reduces_param_grads : bool
        A replicated parameter that sees tokens split over the group (``mode`` None with
        ``sequence_parallel``): the runtime sums its gradients over the group
        (``grad_reduction()``).

    The last five are derived once, at construction: they are read on every call.
    """

    mode: Optional[str] = None
    sequence_parallel: bool = False
    group_name: str = ""
    world_size: int = 1
    active: bool = attrs.field(init=False, eq=False, repr=False)
    gathers_input: bool = attrs.field(init=False, eq=False, repr=False)
    scatters_output: bool = attrs.field(init=False, eq=False, repr=False)
    gathers_grad: bool = attrs.field(init=False, eq=False, repr=False)
    reduces_param_grads: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"TensorParallel: mode must be one of {_MODES}, got {self.mode!r}")
        active = self.world_size > 1
        split = active and self.sequence_parallel
        for name, value in (("active", active),
                            ("gathers_input", split and self.mode == "column"),
                            ("scatters_output", split and self.mode == "row"),
                            ("gathers_grad", split and self.mode == "row"),
                            ("reduces_param_grads", split and self.mode is None)):
            object.__setattr__(self, name, value)


NOT_PARALLEL = TensorParallel()


def resolve_group(op_name: str, group) -> dist.ProcessGroup:
    """``group`` (a process group, or a one-dimensional DeviceMesh such as ``mesh["tp"]``:
    its group), or the default group for None; a clear error without torch.distributed."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{op_name}: a tensor-parallel group from a DeviceMesh needs one "
                             f"dimension, e.g. mesh['tp'], got {group.ndim} "
                             f"({group.mesh_dim_names})")
        return group.get_group()
    if group is not None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{op_name}: its group must be a torch.distributed ProcessGroup or "
                            f"a one-dimensional DeviceMesh (such as mesh['tp']), got "
                            f"{type(group).__name__} {group!r}")
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op_name} needs torch.distributed: call "
                           f"torch.distributed.init_process_group() first, or pass a group")
    return cast(dist.ProcessGroup, dist.group.WORLD)  # not None once initialized


def tensor_parallel(op_name: str, mode: Optional[str], sequence_parallel: bool,
                    group) -> TensorParallel:
    """The :class:`TensorParallel` of an op's constructor arguments."""
    if mode not in _MODES:
        raise ValueError(f"{op_name}: tensor_parallel_mode must be one of {_MODES}, got {mode!r}")
    if mode is None and not sequence_parallel:
        if group is not None:
            raise ValueError(f"{op_name}: tensor_parallel_group given without "
                             f"tensor_parallel_mode or sequence_parallel")
        return NOT_PARALLEL
    return group_config(op_name, mode, bool(sequence_parallel), group)


def group_config(op_name: str, mode: Optional[str], sequence_parallel: bool,
                 group) -> TensorParallel:
    """A :class:`TensorParallel` over ``group`` (None: the default group)."""
    pg = resolve_group(op_name, group)
    return TensorParallel(mode, sequence_parallel, pg.group_name, dist.get_world_size(pg))


def sequence_parallel(op_name: str, enabled: bool, group) -> TensorParallel:
    """The group over which an op's tokens are split (for its gradient all-reduce), or
    :data:`NOT_PARALLEL` when they are not."""
    if not enabled:
        if group is not None:
            raise ValueError(f"{op_name}: tensor_parallel_group given without "
                             f"sequence_parallel=True")
        return NOT_PARALLEL
    return group_config(op_name, None, True, group)


class ReplicatedParallelViews:
    """The read-only views of a replicated op's ``parallel`` record (a norm's), named as its
    constructor's arguments: mixed into the op class."""

    parallel: TensorParallel

    @property
    def sequence_parallel(self) -> bool:
        """Whether the input's tokens are split over the group (its gradients summed)."""
        return self.parallel.sequence_parallel

    @property
    def tensor_parallel_group(self):
        """The group of ``sequence_parallel`` (None without it)."""
        return group_of(self.parallel)


def group_of(tp: TensorParallel):
    """The process group ``tp`` names, or None. Ops keep only the name (a string copies,
    pickles and compares; a ProcessGroup does not) and look the group up here."""
    if not tp.group_name:
        return None
    # GroupName: the NewType of str that the name was read as (pg.group_name)
    return dist.distributed_c10d._resolve_process_group(cast("GroupName", tp.group_name))


def group_rank(tp: TensorParallel) -> int:
    """This process's rank in ``tp``'s group (0 when alone)."""
    return dist.get_rank(group_of(tp)) if tp.group_name else 0


def rank_slice(tp: TensorParallel, local_size: int) -> slice:
    """This rank's ``local_size`` entries of a dim split evenly over ``tp``'s group."""
    start = group_rank(tp) * local_size
    return slice(start, start + local_size)


def shard_size(op_name: str, what: str, size: int, tp: TensorParallel) -> int:
    """``size / world_size``, or an error naming the op and the sizes."""
    if size % tp.world_size:
        raise ValueError(f"{op_name}: {what}={size} does not divide by the tensor-parallel "
                         f"world size {tp.world_size}")
    return size // tp.world_size


def _as_bytes(x: Tensor):
    """FP8 crosses collectives as bytes (not every backend knows FP8 types)."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        return x.view(torch.uint8), x.dtype
    return x, None


def all_gather(x: Tensor, tp: TensorParallel) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0."""
    if not tp.active:
        return x
    data, fp8 = _as_bytes(x.contiguous())
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(data, tp.world_size, tp.group_name))
    return out.view(fp8) if fp8 is not None else out


def all_to_all(x: Tensor, send_sizes: list, recv_sizes: list, tp: TensorParallel) -> Tensor:
    """Rows ``send_sizes[r]`` of ``x`` (consecutive, in rank order) to rank ``r``; the
    rows received, ``recv_sizes[r]`` from rank ``r``, in rank order. The sizes are Python
    ints (an all-to-all needs them on the host)."""
    if not tp.active:
        return x
    data, fp8 = _as_bytes(x.contiguous())
    out = _c10d.wait_tensor(_c10d.all_to_all_single(data, recv_sizes, send_sizes,
                                                    tp.group_name))
    return out.view(fp8) if fp8 is not None else out


def all_to_all_equal(x: Tensor, tp: TensorParallel) -> Tensor:
    """An equal share of ``x``'s rows to every rank (the first ``rows / world size`` to
    rank 0, ...); the shares every rank sent this one, in rank order (the ranks' counts
    exchanged as ``(world size, ...)`` rows: row ``r`` to rank ``r``)."""
    share = [x.shape[0] // tp.world_size] * tp.world_size
    return all_to_all(x, share, share, tp)


def reduce_scatter(x: Tensor, tp: TensorParallel, wait: bool = True) -> Tensor:
    """Sum over ranks, each keeping its slice of dim 0.

    ``wait=False`` returns while the collective runs (on the backend's own stream under
    NCCL), so that work issued before ``wait(result)`` overlaps with it.
    """
    if not tp.active:
        return x
    out = _c10d.reduce_scatter_tensor(x.contiguous(), "sum", tp.world_size, tp.group_name)
    return _c10d.wait_tensor(out) if wait else out


def all_reduce(x: Tensor, tp: TensorParallel, op: str = "sum", wait: bool = True) -> Tensor:
    """Sum (or ``op``) over ranks, out of place; ``wait`` as in :func:`reduce_scatter`."""
    if not tp.active:
        return x
    out = _c10d.all_reduce(x.contiguous(), op, tp.group_name)
    return _c10d.wait_tensor(out) if wait else out


def sum_over_group(x: Tensor, tp: TensorParallel, wait: bool = True) -> Tensor:
    """Partial sums summed over the group: reduce-scattered along dim 0 when tokens are
    split (sequence parallel), all-reduced otherwise; ``wait`` as in :func:`reduce_scatter`."""
    if tp.sequence_parallel:
        return reduce_scatter(x, tp, wait)
    return all_reduce(x, tp, "sum", wait)


def wait(x: Tensor) -> Tensor:
    """``x`` once the collective that produces it (started with ``wait=False``) is done;
    a tensor with no collective in flight is returned as it is."""
    return _c10d.wait_tensor(x)


@functools.lru_cache(maxsize=None)
def _tensor_parallel(mode: Optional[str], sequence_parallel: bool, group_name: str,
                     world_size: int) -> TensorParallel:
    """One TensorParallel per value: rebuilt inside every custom-op call, so cached."""
    return TensorParallel(mode, sequence_parallel, group_name, world_size)


# A TensorParallel crosses custom ops as four arguments: the group by name. None of them is
# a tensor or an int a graph may make symbolic, so all four travel in the call's constants
# (JSON), where a mode of None is null.
register_schema_type(TensorParallel, SchemaType(
    ("str", "bool", "str", "int"),
    lambda tp: [tp.mode, tp.sequence_parallel, tp.group_name, tp.world_size],
    lambda vals: _tensor_parallel(*vals)))
