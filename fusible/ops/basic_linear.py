"""BasicLinear: ``y = x @ weight.T`` over any number of leading dimensions."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fusible.core.arg_types import DTypeArg, DeviceArg, GroupArg, ParallelModeArg
from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.functional.linear import (gemm_backward, gemm_forward, split_dgrad,
                                       split_gemm_backward)
from fusible.functional.linear_records import GemmBackwardArgs, GemmForwardArgs, LinearSaved
from fusible.functional.linear_state import (forward_aux, gemm_backward_args, gemm_forward_args,
                                             gemm_grad_format, gemm_input_format, save_linear)
from fusible.functional.parallel import NOT_PARALLEL
from fusible.module import BasicOperation
from fusible.quantization.params import fp8_parameter
from fusible.quantization.tensor.float8_tensor import Float8Tensor

# The op, and what fusions covering it import (docs/writing_a_fusion.md, "Helpers for
# fusion authors"); the rest serves ops.Linear and the state dicts.
__all__ = ["BasicLinear", "parallel_refusal"]

Tensor = torch.Tensor


def parallel_refusal(linear: "BasicLinear", modes=(None,), why: str = "") -> "bool | str":
    """Whether a fusion covering ``linear`` runs its tensor-parallel collectives: what a
    fusion's ``accepts`` returns for the layer.

    Parameters
    ----------
    linear : BasicLinear
        The covered layer.
    modes : tuple of (str or None)
        The tensor-parallel modes the fusion handles (None: none, the default).
    why : str
        The reason to give otherwise (default: one naming the layer's mode).

    Returns
    -------
    bool or str
        True when the layer communicates nothing or its mode is one of ``modes``, else
        the reason for the plan.
    """
    tp = linear.parallel
    if not tp.active or tp.mode in modes:
        return True
    return why or (f"this fusion does not run BasicLinear's collectives "
                   f"(tensor_parallel_mode={tp.mode!r}, sequence_parallel="
                   f"{tp.sequence_parallel}, world size {tp.world_size})")


class BasicLinear(BasicOperation):
    """``y = x @ weight.T`` with ``weight`` of shape (out_features, in_features).

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the last dimension of the input and of the output.
    tensor_parallel_mode : {None, "column", "row"}
        Split the weight over ``tensor_parallel_group``: "column" keeps rows
        ``rank*out/ws ...`` of it (this rank's slice of the output features), "row"
        columns ``rank*in/ws ...`` (the input is this rank's slice of the features).
        Sizes stay global; ``weight`` is the local shard.
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.
    sequence_parallel : bool
        Tokens (dim 0) are split over the group outside this layer: column
        all-gathers its input (and reduce-scatters its dgrad), row reduce-scatters
        its output (and all-gathers its incoming gradient). Without it, column
        all-reduces its dgrad and row all-reduces its output.
    device, dtype
        Where and in which dtype to create ``weight``.
    accumulate_into_main_grad : bool
        Megatron-style gradient accumulation: the weight gradient is computed in float32
        and added into ``weight.main_grad`` (a buffer of the weight's shape the caller
        creates, usually float32 zeros, and zeroes between optimizer steps), and
        ``weight.grad`` is left alone. A weight with a ``grad_added_to_main_grad``
        attribute (Megatron's DDP) has it set to True and receives a dummy gradient
        (zeros with ``zero_out_wgrad``), so that DDP's hooks run; eagerly only: a compiled
        graph does not replay that Python, and refuses such a weight.
    fp8 : bool, optional
        Under an FP8 recipe: True runs this GEMM in FP8, False in high precision; None
        (default) leaves it to the recipe's ``gemm_policy``, which on CUDA keeps GEMMs
        too small to gain in high precision (:mod:`fusible.quantization.gemm_policy`).

    Notes
    -----
    Saves a :class:`~fusible.functional.linear.LinearSaved`: the input only when the
    weight needs a gradient (wgrad), the weight only when the input does (dgrad); with
    column + sequence_parallel, the gathered input; under FP8 the input's transposed
    FP8 copy. Initialised like ``torch.nn.Linear`` of the global sizes.
    """

    param_names = ("weight",)
    quantized_params = ("weight",)
    scaling_state_roles = ("input", "weight", "grad")
    attribute_checks = {"in_features": checks.positive_int("in_features"),
                        "out_features": checks.positive_int("out_features"),
                        "accumulate_into_main_grad": checks.boolean("accumulate_into_main_grad"),
                        "fp8": checks.optional(checks.boolean("fp8"))}
    fwd_args_type = GemmForwardArgs
    bwd_args_type = GemmBackwardArgs
    saved_type = LinearSaved

    def __init__(self, in_features: int, out_features: int, *,
                 tensor_parallel_mode: ParallelModeArg = None,
                 tensor_parallel_group: GroupArg = None, sequence_parallel: bool = False,
                 device: DeviceArg = None, dtype: DTypeArg = None,
                 accumulate_into_main_grad: bool = False, fp8: Optional[bool] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.fp8 = fp8
        sequence_parallel = bool(checks.boolean("sequence_parallel")("BasicLinear", sequence_parallel))
        if sequence_parallel and tensor_parallel_mode is None:
            raise ValueError(f"{self.describe()}: sequence_parallel=True needs "
                             f"tensor_parallel_mode 'column' or 'row'")
        self.parallel = parallel.tensor_parallel(self.describe(), tensor_parallel_mode,
                                                 sequence_parallel, tensor_parallel_group)
        self.local_in, self.local_out = _local_linear_sizes(self)
        self.weight = nn.Parameter(torch.empty(self.local_out, self.local_in, device=device,
                                               dtype=dtype))
        self.reset_parameters()
        self.weight = fp8_parameter(self.weight)  # FP8 inside quantized_model_init()

    def reset_parameters(self) -> None:
        """Initialise ``weight`` like ``torch.nn.Linear`` of the global sizes (this rank's
        shard of it)."""
        init_linear_weight(self.weight, self)

    @property
    def main_grad_params(self) -> tuple:
        return ("weight",) if self.accumulate_into_main_grad else ()

    def fp8_gemm_shape(self) -> tuple:
        """``(in_features, out_features)`` of this rank's GEMM, for the FP8 policy."""
        return self.local_in, self.local_out

    @property
    def wgrad_dtype(self):
        """The dtype the weight gradient is computed in: float32 where it goes into
        ``main_grad``, else None (the GEMM's)."""
        return torch.float32 if self.accumulate_into_main_grad else None

    @property
    def tensor_parallel_mode(self):
        """None, ``"column"`` or ``"row"`` (``parallel.mode``)."""
        return self.parallel.mode

    @property
    def sequence_parallel(self) -> bool:
        """Whether tokens are split over the group outside the layer."""
        return self.parallel.sequence_parallel

    @property
    def tensor_parallel_group(self):
        """The process group the weight is split over (None when not parallel)."""
        return parallel.group_of(self.parallel)

    def describe(self) -> str:
        tp = self.__dict__.get("parallel", NOT_PARALLEL)
        mode = (f", tensor_parallel_mode={tp.mode!r}, sequence_parallel={tp.sequence_parallel}"
                if tp.mode else "")
        main = (", accumulate_into_main_grad=True"
                if getattr(self, "accumulate_into_main_grad", False) else "")
        return (f"BasicLinear(in_features={self.in_features}, out_features={self.out_features}"
                f"{mode}{main})")

    def diagram_label(self) -> str:
        tp = self.parallel
        mode = f"\n{tp.mode}{' + SP' if tp.sequence_parallel else ''} /{tp.world_size}"
        return f"{self.in_features} \u2192 {self.out_features}" + (mode if tp.mode else "")

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape:
            raise ValueError(f"{self.describe()} got a 0-d input; it needs (..., "
                             f"{self.in_features})")
        if shape[-1] != self.local_in:
            shard = " (this rank's shard)" if self.local_in != self.in_features else ""
            raise ValueError(f"{self.describe()} got input with last dimension {shape[-1]}; "
                             f"expected {self.local_in}{shard}")
        self._check_param("weight", self.param("weight"), dtype, device,
                          (self.local_out, self.local_in))
        return (*_parallel_tokens(self, shape), self.local_out)

    def validate_fp8(self, shape, recipe) -> None:
        """FP8 GEMMs (Hopper's) need every dimension divisible by 16; an FP8 weight
        (``quantized_model_init``, ``fsdp_float8_all_gather``) holds one current scale
        per tensor, which a recipe scaling weights otherwise would silently not get."""
        if isinstance(self.param("weight"), Float8Tensor):
            fmt = recipe.weight_format()
            if not fmt.per_tensor or fmt.stateful:
                how = "from an amax history" if fmt.stateful else fmt.granularity
                raise ValueError(f"{self.describe()}: its weight is FP8 with one current "
                                 f"scale per tensor (quantized_model_init or "
                                 f"fsdp_float8_all_gather), but {type(recipe).__name__} "
                                 f"scales weights {how}; use a current-scaling recipe "
                                 f"(Float8CurrentScaling) or a high-precision weight")
        tokens = math.prod(shape[:-1]) * (self.parallel.world_size if self.parallel.gathers_input else 1)
        if self.local_in % 16 or self.local_out % 16 or tokens % 16:
            raise ValueError(f"{self.describe()} under an FP8 recipe needs in_features, "
                             f"out_features (of this rank's shard: {self.local_in}, "
                             f"{self.local_out}) and the number of tokens divisible by 16, got "
                             f"{tokens} tokens; pad the tokens or run it outside "
                             f"fusible.autocast")

    def forward_args(self, input, params, extra_inputs, ctxs):
        return gemm_forward_args(input, params[0], self.parallel, ctxs[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, kept = gemm_forward(args)
        return ForwardResult(y, (), forward_aux(args, kept))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args, result.aux)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return gemm_backward_args(ctxs[0], grad_output, self.parallel, self.wgrad_dtype)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dx, dw = gemm_backward(args)
        return BackwardResult(dx, (dw,))

    @classmethod
    def dgrad_compute(cls, args, *, in_custom_op=False):
        dgrad, wgrad = split_gemm_backward(args)
        return BackwardResult(split_dgrad(dgrad, args.grad_output), (None,)), wgrad

    @classmethod
    def wgrad_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(None, (gemm_backward(args)[1],))

    def deferred_params(self, recipe, needs):
        if self.parallel.gathers_grad:
            return ("row + sequence parallel all-gathers dy for both GEMMs: a deferred wgrad "
                    "would gather it again")
        return (True,)

    def input_format(self, recipe, needs):
        # A layer that all-gathers its input quantizes it after the gather itself.
        return None if self.parallel.gathers_input else gemm_input_format(recipe, needs[0])

    def grad_format(self, recipe, needs):
        return None if self.parallel.gathers_grad else gemm_grad_format(recipe, needs[0])

    def quantizes(self, recipe, direction):
        return recipe is not None

    def reference(self, x, extra_inputs, params):
        return F.linear(x, params[0]), ()

    @classmethod
    def example(cls):
        return Example((cls(32, 48),), (2, 8, 32))

    def communication(self, direction, needs=None):
        tp = self.parallel
        if not tp.active or (direction == "backward" and needs is not None
                             and not needs.input and tp.mode == "column"):
            return ()  # a column layer's backward communicates only its dgrad
        sp, ws = tp.sequence_parallel, tp.world_size
        reduce = "reduce-scatter" if sp else "all-reduce"
        if direction == "forward":
            return ((("before", f"all-gather input /{ws}"),) if tp.mode == "column" and sp
                    else (("after", f"{reduce} output /{ws}"),) if tp.mode == "row" else ())
        return ((("before", f"all-gather grad /{ws}"),) if tp.mode == "row" and sp
                else (("after", f"{reduce} dgrad /{ws}"),) if tp.mode == "column" else ())

    def extra_repr(self) -> str:
        return self.describe()[len("BasicLinear("):-1]


def _local_linear_sizes(op) -> tuple:
    """``(local in_features, local out_features)``: the weight shard's shape, reversed."""
    tp, name = op.parallel, op.describe()
    if tp.mode == "column":
        return op.in_features, parallel.shard_size(name, "out_features", op.out_features, tp)
    if tp.mode == "row":
        return parallel.shard_size(name, "in_features", op.in_features, tp), op.out_features
    return op.in_features, op.out_features


def init_linear_weight(weight: Tensor, linear: "BasicLinear") -> None:
    """``torch.nn.Linear``'s initialisation (kaiming uniform, a=sqrt(5)) of the full
    weight, of which a parallel layer keeps its shard: with the same seed on every rank,
    the shards are slices of the weight a single-GPU layer would get."""
    gain = math.sqrt(2.0 / (1 + 5))
    bound = math.sqrt(3.0) * gain / math.sqrt(linear.in_features)
    init_shard_(weight, (linear.out_features, linear.in_features), linear_shard(linear),
                bound)


def init_shard_(param: Tensor, full_shape: tuple, shard: tuple, bound: float) -> None:
    """Draw the full tensor uniformly in [-bound, bound] and keep ``shard`` (slices)."""
    with torch.no_grad():
        if param.shape == full_shape:
            param.uniform_(-bound, bound)
        else:
            full = torch.empty(full_shape, device=param.device, dtype=param.dtype)
            param.copy_(full.uniform_(-bound, bound)[shard])


def linear_shard(linear: "BasicLinear") -> tuple:
    """``(rows, columns)`` of the full weight that this rank's shard holds."""
    tp, everything = linear.parallel, slice(None)
    if not tp.active:
        return everything, everything
    if tp.mode == "column":
        return parallel.rank_slice(tp, linear.local_out), everything
    return everything, parallel.rank_slice(tp, linear.local_in)


def _parallel_tokens(op, shape) -> tuple:
    """The leading dimensions of a linear layer's output: dim 0 gathered (column + SP)
    or scattered (row + SP) over the group."""
    tp, lead = op.parallel, tuple(shape[:-1])
    if not (tp.active and tp.sequence_parallel):
        return lead
    if not lead:
        raise ValueError(f"{op.describe()} splits tokens along dim 0; got a 1-D input")
    if tp.mode == "column":
        return (lead[0] * tp.world_size, *lead[1:])
    if lead[0] % tp.world_size:
        raise ValueError(f"{op.describe()} reduce-scatters its output along dim 0: got "
                         f"{lead[0]} rows, which do not divide by the world size "
                         f"{tp.world_size}")
    return (lead[0] // tp.world_size, *lead[1:])
