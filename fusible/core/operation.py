"""The contract of the operations that stand in a pipeline.

A *basic* operation owns its parameters and state and implements both passes of
the compute interface (:class:`~fusible.core.stage.StageSpec`); a fused operation
(:class:`~fusible.core.fused.FusedOperation`) owns nothing and computes one pass of
a run of basic ops. Both are checked where they enter the library: basic ops when
their class is created, fusions when they are registered. The runnable classes users
subclass (``fusible.ops.BasicOperation``) add the module that runs a pipeline on top
of this contract (``fusible.module``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Optional

import attrs
import torch
from torch import nn

from fusible.core import epoch
from fusible.core.stage import StageSpec, check_stage_class

Tensor = torch.Tensor

# Set while a pipeline runs under torch.autocast: the parameters are cast (or quantized)
# to the compute dtype for the call, so their own dtype need not match the input's.
CASTING = threading.local()

# The parameters a traced group was given, by op (params_given): under
# torch.func.functional_call a compiled graph's tensors are not the module's attributes
_GIVEN = threading.local()


@contextlib.contextmanager
def params_given(ops, params) -> Iterator[None]:
    """Within the block each op's :meth:`~BasicOperationSpec.param` returns its share of
    ``params`` (the ops' parameters in order, as a runner reads them): a compiled group's
    ops check the tensors the graph gives them, which under
    ``torch.func.functional_call`` are not their module attributes."""
    given, it = {}, iter(params)
    for op in ops:
        given[id(op)] = {name: next(it) for name in op.param_names}
    outer = getattr(_GIVEN, "params", None)
    _GIVEN.params = {**(outer or {}), **given}
    try:
        yield
    finally:
        _GIVEN.params = outer


# An op's parallel state: its ``parallel`` record (``fusible.functional.parallel.
# TensorParallel``), set once in the constructor, and the read-only views of it named as
# the constructor's arguments (``tensor_parallel_mode``, ``sequence_parallel``, ...).
_CONSTRUCTION_ONLY = frozenset({"parallel", "tensor_parallel_mode", "sequence_parallel",
                                "tensor_parallel", "tensor_parallel_group", "process_group"})


class FusibleSpec(nn.Module):
    """Anything that can stand in a Sequential: it stands for basic ops in order.

    ``attribute_checks`` maps attribute names to checks (``fusible.core.checks``) that run on
    every assignment, in the constructor and after it.
    """

    attribute_checks: ClassVar[dict] = {}

    def basic_ops(self) -> tuple:
        """The basic ops this operation stands for, in forward order."""
        raise NotImplementedError(f"{type(self).__name__} must implement basic_ops()")

    def describe(self) -> str:
        """A short label with sizes, for plans, diagrams and error messages."""
        return type(self).__name__

    def register_parameter(self, name: str, param) -> None:
        swap = _sharding_swap(self._parameters.get(name), param)
        super().register_parameter(name, param)
        if not swap:
            epoch.bump_if_planned(self)  # parametrizations and pruning swap parameters so

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # FP8 scaling states (delayed scaling's histories) are made at the first plan that
        # reads them: a checkpoint's are taken where this op has none yet, and one without
        # them (torch.nn's, or saved before any FP8 step) leaves the op's as they are.
        names = [f"fp8_state_{role}" for op in self.basic_ops() for role in
                 op.scaling_state_roles]
        for name in names:
            saved, own = state_dict.get(prefix + name), self._buffers.get(name)
            if saved is not None and (own is None or own.shape != saved.shape):
                device = next((p.device for p in self.parameters()), saved.device)
                self.register_buffer(name, torch.zeros(saved.shape, device=device,
                                                       dtype=torch.float32))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        optional = {prefix + name for name in names}
        missing_keys[:] = [k for k in missing_keys if k not in optional]

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        epoch.bump_if_planned(self)

    def __setattr__(self, name: str, value: Any) -> None:
        check = type(self).attribute_checks.get(name)
        if check is not None:
            value = check(type(self).__name__, value)
        if name in _CONSTRUCTION_ONLY and (name in self.__dict__ or isinstance(
                getattr(type(self), name, None), property)):
            raise AttributeError(f"{self.describe()}: {name} is fixed at construction (the "
                                 f"parameter shards and collectives depend on it); build a "
                                 f"new operation instead")
        # Plans depend on op configuration: a new value invalidates cached plans.
        old = self.__dict__.get(name, epoch.MISSING)
        super().__setattr__(name, value)
        # A parameter's write went through register_parameter, which decided on the epoch
        parameter = name in self.__dict__.get("_parameters", {})
        if name != "training" and not parameter and epoch.changed(old, value):
            epoch.bump_if_planned(self)


def _sharding_swap(old, new) -> bool:
    """Whether a parameter write is FSDP2 swapping a sharded parameter (a DTensor) and
    the gathered one, around every forward and backward: plans stay valid (inside a
    forward the parameters are always the gathered ones, which the plan was made for),
    and a move of the epoch there would replan, and recompile, every step."""
    return (isinstance(old, nn.Parameter) and isinstance(new, nn.Parameter)
            and (is_dtensor(old) or is_dtensor(new)))


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor; without importing torch.distributed.tensor (0.45 s of
    `import fusible`): none exists before someone imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


class BasicOperationSpec(FusibleSpec, StageSpec):
    """The contract of a basic operation: parameters, state and both passes.

    A subclass defines ``fwd_args_type``, ``bwd_args_type`` and the five compute hooks
    of :class:`~fusible.core.stage.StageSpec`; a class that lacks one is an error when
    it is created, naming the class and the hook. An intermediate base class that
    leaves hooks to its subclasses says so: ``class Pointwise(BasicOperation,
    abstract=True)``.

    Class attributes
    ----------------
    param_names : tuple of str
        The registered parameters that receive gradients through the fuser, in order.
    num_extra_inputs, num_extra_outputs : int
        Extra inputs consumed (``AddExtraInput``) and extra outputs branched.
    saved_type : attrs class or None
        The record ``ctx.saved`` holds for the backward (None: saves nothing). Every
        stage covering the op fills it in this layout.
    quantized_params : tuple of str
        Parameters that an FP8 recipe casts to FP8 from whatever dtype they have: under
        ``torch.autocast`` they reach the op uncast (no detour through the autocast dtype).
    main_grad_params : tuple of str
        Parameters whose gradient is added into their ``main_grad`` attribute (a
        Megatron-style float32 buffer) instead of going to autograd; the stages covering
        the op return those gradients in float32. Usually an instance property
        (``BasicLinear(accumulate_into_main_grad=True)``).
    scaling_state_roles : tuple of str
        The FP8 tensor roles (``"input"``, ``"weight"``, ``"grad"``) this op casts in:
        under a recipe whose formats keep state (delayed scaling), the op keeps one state
        buffer per role (:meth:`scaling_state`), ``ctx.states[role]`` in its stages, and
        a stage that hands this op its input (gradient) in FP8 casts it with the op's
        ``"input"`` (``"grad"``) state.
    rounds_within : str
        Why the op's own stage rounds to the input dtype before its end (empty: it
        computes in float32 and rounds once, which the test matrix holds single ops to).
        Attention says so: its kernels take 16-bit q, k, v and round the softmax's
        probabilities for the second GEMM.
    input_dims : int or None
        How many dimensions the op's input has (None: any, the features last). Attention
        takes ``(batch, seq, features)``: 3.
    """

    param_names: tuple = ()  # not a ClassVar: an instance may name fewer (GroupedLinear)
    scaling_state_roles: ClassVar[tuple] = ()
    quantized_params: ClassVar[tuple] = ()
    if TYPE_CHECKING:  # read-only, for the type checker: BasicLinear's is a property
        @property
        def main_grad_params(self) -> tuple: ...
    else:
        main_grad_params: tuple = ()
    # Each output feature (last dimension) comes from the same input feature alone (a bias,
    # a pointwise activation, dropout, a scale, an extra input or output, a collective along
    # the tokens): a split of the features over a tensor-parallel group passes through
    # unchanged (planning.passes.check_gated_layouts).
    keeps_features: ClassVar[bool] = False
    rounds_within: ClassVar[str] = ""
    input_dims: ClassVar[Optional[int]] = None
    num_extra_inputs: int = 0  # not a ClassVar: an instance may take more (GroupedLinear)
    num_extra_outputs: ClassVar[int] = 0
    saved_type: ClassVar[Optional[type]] = None

    def __init_subclass__(cls, abstract: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if not abstract:
            check_basic_operation(cls)

    def basic_ops(self) -> tuple:
        return (self,)

    def left_out_of_plans(self) -> bool:
        """Whether the op, as configured now, returns its input unchanged and draws nothing,
        so that a pipeline with other ops leaves it out and fusions match across it:
        ``Dropout(p=0)`` (``ops.Identity`` stays: it is how two ops are kept from fusing).
        A configuration change replans, so the answer may change (a new ``p``)."""
        return False

    def fusible_params(self) -> list:
        """Parameters that receive gradients through the fuser: ``param_names``, in order."""
        return [self.param(name) for name in self.param_names]

    def param(self, name: str):
        """The tensor the op computes with for parameter ``name``: the one a compiled group
        was given (:func:`params_given`), the registered parameter, or, where a
        parametrization or pruning replaced it, what the module attribute gives (computed
        from the original, so gradients reach it)."""
        given = getattr(_GIVEN, "params", None)
        if given is not None and id(self) in given:
            return given[id(self)][name]
        found = self._parameters.get(name)
        if found is not None:
            return found
        owner = self.__dict__.get("_fusible_owner")  # the composite holding the parameter
        return getattr(owner() if owner is not None else self, name)

    def scaling_state(self, role: str, size: int, device) -> Tensor:
        """The op's state of FP8 tensor ``role``: a persistent float32 buffer of ``size``
        values on ``device``, named ``fp8_state_<role>``; made zero where missing or of
        another size (another history length), made float32 again (``.to(dtype)`` casts
        buffers) or moved where it is not."""
        name = f"fp8_state_{role}"
        state = self._buffers.get(name)
        device = torch.device(device)
        if state is not None and state.shape == (size,):
            if state.dtype == torch.float32 and state.device.type == device.type:
                return state
            made = state.detach().to(device, torch.float32)
        else:
            made = torch.zeros(size, device=device, dtype=torch.float32)
        if made.is_inference():  # first planned under torch.inference_mode: a normal tensor
            with torch.inference_mode(False):
                made = made.clone()
        self.register_buffer(name, made)
        return made

    def plan_note(self, conditions) -> str:
        """What the op decides for a plan's conditions (:class:`PlanConditions`), shown
        after its description in ``explain()`` and under it in the diagram: ``""``, or
        e.g. Attention's ``"kernel: flash"``."""
        return ""

    def diagram_label(self) -> str:
        """Sizes and settings shown under the op's name in plan diagrams."""
        text, name = self.describe(), type(self).__name__
        return text[len(name) + 1:-1] if text.startswith(name + "(") else ""

    def validate(self, shape: tuple, dtype: torch.dtype, device: torch.device,
                 extra_inputs: tuple = ()) -> tuple:
        """Check an input of this shape, dtype and device; return the output shape.

        Raises ValueError or TypeError naming the op and the offending values.
        """
        return tuple(shape)

    def validate_fp8(self, shape: tuple, recipe) -> None:
        """Check an input shape against the op's FP8 constraints under ``recipe`` (the
        plan's, never None here); raise ValueError naming the op and the sizes."""

    def quantizes(self, recipe, direction: str) -> bool:
        """Whether this op's ``direction`` compute quantizes tensors under ``recipe``: a
        fusion covering it must then declare its own format hook for that direction
        (``input_format`` / ``grad_format``), or the planner refuses it."""
        return False

    def communication(self, direction: str, needs=None) -> tuple:
        """The collectives this op's compute runs in ``direction`` ("forward" or
        "backward"), as ``(where, what)`` pairs for plans: ``where`` is "before" or
        "after" the op's own compute, or "is" for a collective op; ``what`` says which
        tensor and how. With ``needs``, only those that run for these gradients. A fusion
        covering an op that communicates must run these itself (``handles_communication``).
        """
        return ()

    def check_split_features(self, producer: str, world_size: int) -> None:
        """Refuse (ValueError) an input whose features (last dimension) are split over a
        tensor-parallel group of ``world_size`` ranks by ``producer``, a column-parallel
        layer before this op, where this op's result would not be the split of the
        unsplit op's. Default: accepted."""

    def grad_reduction(self):
        """The group (the op's ``parallel`` record) over which the runtime sums this op's
        parameter gradients after its backward stage (a replicated parameter seeing tokens
        split over the group, ``sequence_parallel=True``), or None."""
        parallel = self.__dict__.get("parallel")
        return parallel if parallel is not None and parallel.reduces_param_grads else None

    def reference(self, x: Tensor, extra_inputs: tuple, params: tuple) -> tuple:
        """The op in plain differentiable PyTorch, for FP64 references.

        Parameters
        ----------
        x : Tensor
            The input (float64 in tests).
        extra_inputs : tuple of Tensor
            The extra inputs this op consumes.
        params : tuple of Tensor
            Copies of ``fusible_params()``, in order.

        Returns
        -------
        (Tensor, tuple of Tensor)
            The output and the extra outputs.
        """
        raise NotImplementedError(f"{type(self).__name__} has no reference(); define it (or "
                                  f"register one with fusible.testing.register_reference)")

    @classmethod
    def example(cls):
        """A small :class:`~fusible.core.example.Example` that exercises this op, for the
        test matrices; None if the op has none."""
        return None

    # Helpers shared by subclasses -------------------------------------------------

    def _check_param(self, name: str, param: Tensor, dtype: torch.dtype,
                     device: torch.device, shape: tuple) -> None:
        if param is None:
            raise TypeError(f"{self.describe()} has no {name} (it was set to None); it "
                            f"needs a tensor of shape {tuple(shape)}")
        if tuple(param.shape) != tuple(shape):
            raise ValueError(f"{self.describe()} has {name} of shape {tuple(param.shape)}; "
                             f"expected {tuple(shape)}")
        if param.dtype != dtype and not getattr(CASTING, "active", False):
            raise TypeError(f"{self.describe()} has {name} of dtype {param.dtype} but got "
                            f"input of dtype {dtype}; convert the model or the input so "
                            f"that they match")
        if param.device != device:
            raise ValueError(f"{self.describe()} has {name} on device {param.device} but got "
                             f"input on device {device}")

    def _check_last_dim(self, shape: tuple, expected: int, what: str) -> None:
        if len(shape) == 0 or shape[-1] != expected:
            got = shape[-1] if len(shape) else "none (a 0-d tensor)"
            raise ValueError(f"{self.describe()} got input with last dimension {got}; "
                             f"expected {what}={expected}")


def check_basic_operation(cls) -> None:
    """Raise TypeError naming ``cls`` when it does not fulfil the basic-op contract."""
    check_stage_class(cls, "basic operation", BasicOperationSpec, ("forward", "backward"))
    name = cls.__name__
    if not (isinstance(cls.param_names, tuple) and all(isinstance(n, str)
                                                        for n in cls.param_names)):
        raise TypeError(f"{name}.param_names must be a tuple of str, got {cls.param_names!r}")
    for count in ("num_extra_inputs", "num_extra_outputs"):
        if not isinstance(getattr(cls, count), int) or getattr(cls, count) < 0:
            raise TypeError(f"{name}.{count} must be an int >= 0, got {getattr(cls, count)!r}")
    saved = cls.saved_type
    if saved is not None and not (inspect.isclass(saved) and attrs.has(saved)):
        raise TypeError(f"{name}.saved_type must be an attrs class or None, got {saved!r}")
