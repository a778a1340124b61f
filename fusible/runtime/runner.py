"""PipelineRunner: plans one group of basic ops (with a cache) and runs it."""

from __future__ import annotations

import functools
from typing import Optional

import attrs
import torch
from torch.autograd import forward_ad

from fusible.core.conditions import PlanConditions, conditions_key
from fusible.core.lanes import splitting
from fusible.core.operation import CASTING
from fusible.planning.channels import caller_counts
from fusible.planning.prepare import ExecPlan, prepare_group, scaling_states
from fusible.quantization.recipes.autocast import current_key
from fusible.runtime import custom_ops, wgrad
from fusible.runtime.executor import apply_pipeline, run_forward
from fusible.runtime.scaling_states import assign_states, check_states, fits


_UNSET = object()


class PipelineRunner:
    """Plans (with a cache keyed by :class:`PlanConditions`) and runs one group of basic ops."""

    def __init__(self, ops: tuple, start: int):
        self.ops = tuple(ops)
        self.start = start
        # what the caller passes and receives (channels' are the group's own)
        self.num_extra_inputs, self.num_extra_outputs = caller_counts(self.ops)
        self._plans: dict = {}
        self._param_slots = [(op._parameters, name) for op in self.ops for name in op.param_names]
        for params, name in self._param_slots:
            if name in params and params[name] is None:
                op = next(op for op in self.ops if op._parameters is params)
                raise TypeError(f"{op.describe()} has no {name} (it was set to None); "
                                f"{op.__class__.__name__} computes with one")
        # Parametrizations and pruning take parameters out of the dicts: then each op says
        # what it computes with (slower; re-planned when they come or go).
        self._direct = all(name in d for d, name in self._param_slots)
        self._param_ops = [(op, name) for op in self.ops for name in op.param_names]
        self.num_params = len(self._param_ops)
        self._main_grad_slots = [(k, op, name) for k, (op, name) in enumerate(self._param_ops)
                                 if name in op.main_grad_params]
        self._quantized = {i for i, (op, name) in enumerate(
            (op, name) for op in self.ops for name in op.param_names)
            if name in op.quantized_params}
        self._forward_key = _UNSET  # the FP8 recipe key of the latest forward
        # Under a stateful recipe, the states the plans read (planning.prepare.state_owners)
        self._state_names = [(k, f"fp8_state_{role}") for k, op in enumerate(self.ops)
                             for role in op.scaling_state_roles]
        self._snapshot: Optional[list] = None  # the states as the latest eager forward began

    def _recipe_key(self, traced: bool):
        """The FP8 recipe key to run under: the one in effect, except for a forward run
        during a backward pass, activation checkpointing's recomputation, which repeats
        the latest forward's (as torch.utils.checkpoint restores torch.autocast's state)."""
        if traced or torch._C._current_graph_task_id() == -1 or self._forward_key is _UNSET:
            self._forward_key = current_key()
        return self._forward_key

    def params(self, ops: "tuple | None" = None) -> list:
        """The ops' parameters, read afresh each call (they may have been swapped);
        ``ops``: the group's ops themselves, where :attr:`ops` holds a lone op's proxy."""
        if self._direct:
            return [params[name] for params, name in self._param_slots]
        if ops is None:
            return [op.param(name) for op, name in self._param_ops]
        return [op.param(name) for op in ops for name in op.param_names]

    def main_grads(self, params, traced: bool = False) -> list:
        """The ``main_grad`` buffers the gradients of ``params`` (the group's, in order) go
        into: of the parameters in their op's ``main_grad_params`` that need a gradient.
        Raises naming the op where a buffer is missing or does not fit."""
        if not self._main_grad_slots or not torch.is_grad_enabled():
            return []
        return [_main_grad_of(op, name, params[k], traced)
                for k, op, name in self._main_grad_slots if params[k].requires_grad]

    def states(self, ops: "tuple | None" = None) -> list:
        """The ops' FP8 scaling states (every role of every op that keeps some), made by
        the planning of a stateful recipe; ``ops`` as in :meth:`params`."""
        ops = self.ops if ops is None else ops
        return [ops[k]._buffers[name] for k, name in self._state_names]

    def _call_states(self, plan, x) -> list:
        """The states an eager call casts with. A forward records into the ops' own, after
        keeping a copy of them; one during a backward pass (activation checkpointing's
        recomputation) casts with copies of that copy, the latest forward's scales, and
        records nothing (as it repeats the latest forward's recipe); its gradients' states
        stay the ops' own (a reentrant checkpoint runs its backward through them)."""
        states = self.states()
        if not all(fits(s, x, n) for s, n in zip(states, plan.state_sizes)):
            # another history length, or .to() changed a state's dtype: made again
            scaling_states(self.ops, plan.recipe, x.device.type)
            states = self.states()
        snapshot = self._snapshot
        if torch._C._current_graph_task_id() != -1 and snapshot is not None \
                and len(snapshot) == len(states):
            return [t.clone() if name != "fp8_state_grad" else own
                    for t, own, (_, name) in zip(snapshot, states, self._state_names)]
        if torch.is_inference_mode_enabled():  # nothing will be recomputed
            return states
        if snapshot is None or [t.shape for t in snapshot] != [t.shape for t in states] \
                or snapshot[0].device != x.device:
            self._snapshot = [t.clone() for t in states]
        else:
            torch._foreach_copy_(snapshot, states)
        return states

    def run(self, x, extra_inputs: tuple, training: bool, params=None, traced: bool = False,
            main_grads=None, states=None):
        """Run the group; returns (output, tuple of extra outputs).

        ``traced`` runs the stages' custom ops (the compiled path) on the given
        ``params``, ``main_grads`` and ``states``, the tensors the compiled graph passes
        for ``self.params()``, ``self.main_grads(...)`` and ``self.states()``.
        """
        if type(x) is not torch.Tensor or len(extra_inputs) != self.num_extra_inputs \
                or extra_inputs:
            self._check_inputs(x, extra_inputs)  # the full checks, with the errors
        if not traced and (torch._C._are_functorch_transforms_active()
                           or torch._C._is_tracing() or forward_ad._current_level >= 0):
            self._refuse_transforms(x)
        device_type = x.device.type
        params = self.params() if params is None else list(params)
        if main_grads is None:  # read before torch.autocast swaps in cast copies
            main_grads = self.main_grads(params)
        if _autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return self._run_autocast(x, extra_inputs, training, params, traced, device_type,
                                      main_grads, states)
        key = conditions_key(x, device_type, params, extra_inputs, self._recipe_key(traced),
                             training)
        if not traced and wgrad.any_pending() and not splitting():
            wgrad.check_forward(self._name())
        plan = self._plans.get(key) or self.lookup(PlanConditions(*key))
        if plan.state_slots:
            states = self._call_states(plan, x) if states is None else states
            check_states(plan, states, x)
        else:
            states = ()
        if not plan.needs_backward:
            assign_states(plan, plan.idle_ctxs, states)
            return run_forward(plan, x, params, extra_inputs, plan.idle_ctxs, save=False,
                               traced=traced)
        if len(main_grads) != len(plan.main_grad_params):
            raise RuntimeError(f"{self._name()}: {len(main_grads)} main_grad buffers for "
                               f"{len(plan.main_grad_params)} parameters that accumulate "
                               f"into one")
        outputs = apply_pipeline(plan, traced, x, *extra_inputs, *params, *main_grads, *states)
        if self.num_extra_outputs == 0:
            return outputs, ()
        return outputs[0], tuple(outputs[1:])

    def _run_autocast(self, x, extra_inputs, training, params, traced, device_type,
                      main_grads, states):
        """Under torch.autocast: compute in the autocast dtype, from parameters cast to it
        (differentiably: their gradients come back in their own dtype), like nn.Linear.
        Under an FP8 recipe the weights GEMMs quantize are passed as they are."""
        dtype = torch.get_autocast_dtype(device_type)
        keep = self._quantized if self._recipe_key(traced) is not None else ()
        x = x.to(dtype)
        if any(getattr(op, "in_place", False) for op in self.ops if op.num_extra_inputs) \
                and any(e.dtype != dtype for e in extra_inputs):
            raise TypeError(f"{self._name()}: an AddExtraInput(in_place=True) writes into its "
                            f"extra input, which under torch.autocast must be in the autocast "
                            f"dtype {dtype}; got {[e.dtype for e in extra_inputs]}")
        extra_inputs = tuple(e.to(dtype) if e.is_floating_point() else e
                             for e in extra_inputs)  # split sizes stay integers
        params = [p if i in keep else p.to(dtype) for i, p in enumerate(params)]
        CASTING.active = True
        try:
            with torch.autocast(device_type, enabled=False):
                return self.run(x, extra_inputs, training, params, traced, main_grads, states)
        finally:
            CASTING.active = False

    def lookup(self, conditions: PlanConditions) -> ExecPlan:
        """The cached plan for the group's ``conditions``, planned on first use."""
        plan = self._plans.get(conditions)
        if plan is None:
            plan = self._plans[conditions] = with_compile_reasons(
                prepare_group(self.ops, self.start, conditions))
            if plan.wgrad_stages:
                wgrad.install_step_check()
        return plan

    def _refuse_transforms(self, x) -> None:
        """torch.func transforms, forward-mode AD and torch.jit.trace: a clear error."""
        if torch._C._is_tracing():
            raise RuntimeError(f"fusible: torch.jit.trace cannot record {self._name()} (its "
                               f"planning is Python and its stages custom ops): use "
                               f"torch.compile, or torch.export")
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError(f"fusible: {self._name()} cannot run under torch.func transforms "
                               f"(grad, vmap, jacrev, jvp, ...): a pipeline is one "
                               f"autograd.Function without vmap or forward-mode rules; take "
                               f"gradients with torch.autograd (see docs/guide.md, Limits)")
        if forward_ad.unpack_dual(x).tangent is not None or any(
                forward_ad.unpack_dual(p).tangent is not None for p in self.params()):
            raise RuntimeError(f"fusible: {self._name()} has no forward-mode AD (dual tensors): "
                               f"take gradients with torch.autograd's reverse mode")

    def _check_inputs(self, x, extra_inputs) -> None:
        """Raise for inputs this group cannot take, naming what is wrong."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._name()} expects a tensor input, got {type(x).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"{self._name()} expects {self.num_extra_inputs} extra input(s) "
                            f"(AddExtraInput's residuals, GroupedLinear's split sizes), got "
                            f"{len(extra_inputs)}")
        if extra_inputs and not all(isinstance(e, torch.Tensor) for e in extra_inputs):
            raise TypeError(f"{self._name()} expects tensor extra inputs, got "
                            f"{[type(e).__name__ for e in extra_inputs]}")

    def _name(self) -> str:
        return "Sequential(" + ", ".join(op.__class__.__name__ for op in self.ops) + ")"


def _main_grad_of(op, name: str, param, traced: bool):
    """``param.main_grad``, checked: a tensor of the parameter's shape on its device."""
    where = f"{op.describe()}: its {name} accumulates into main_grad"
    buffer = getattr(param, "main_grad", None)
    if not isinstance(buffer, torch.Tensor):
        raise RuntimeError(f"{where}, which {name} lacks (got {buffer!r}): set "
                           f"{name}.main_grad = torch.zeros_like({name}, dtype=torch.float32)")
    if buffer.shape != param.shape or buffer.device != param.device \
            or not buffer.is_floating_point():
        raise RuntimeError(f"{where}, a floating-point tensor of shape {tuple(param.shape)} on "
                           f"{param.device}; got {buffer.dtype} of shape {tuple(buffer.shape)} "
                           f"on {buffer.device}")
    if traced and hasattr(param, "grad_added_to_main_grad"):
        raise RuntimeError(f"{where} with Megatron's grad_added_to_main_grad flag, which "
                           f"the backward sets in Python: a compiled graph would not set it "
                           f"again each step; run this model eagerly")
    return buffer


@functools.lru_cache(maxsize=None)
def _autocast_available(device_type: str) -> bool:
    """Whether torch.autocast exists for the device type (not for "meta")."""
    return torch.amp.is_autocast_available(device_type)


def compile_reason(stage) -> "str | None":
    """Why a planned stage cannot run compiled (its own reason, or its args cannot become a
    custom-op schema: not asked of a stage traced inline, which has no custom op), or None."""
    direction = stage.direction
    own = stage.op.compile_unsupported_reason(direction)
    if own is not None or stage.inline_when_compiled:
        return own
    return custom_ops.unsupported_reason(stage.op.__class__, direction)


def with_compile_reasons(plan: ExecPlan) -> ExecPlan:
    """``plan`` with each public stage's ``compile_reason`` filled in (once per plan)."""
    def mark(stage, why=compile_reason):
        reason = why(stage)
        return stage if reason is None else attrs.evolve(stage, compile_reason=reason)

    def mark_split(stage):
        return mark(stage, _split_reason)

    group = attrs.evolve(plan.group, forward=tuple(map(mark, plan.group.forward)),
                         backward=tuple(map(mark, plan.group.backward)))
    return attrs.evolve(plan, group=group, backward_stages=tuple(map(mark, plan.backward_stages)),
                        wgrad_stages=tuple(map(mark_split, plan.wgrad_stages)))


def _split_reason(stage) -> "str | None":
    """Why a wgrad-lane stage, or its dgrad stage (the other custom op), cannot compile."""
    return compile_reason(stage) or custom_ops.unsupported_reason(stage.op.__class__, "dgrad")
