"""PipelineRunner: finds or builds the plan of one group of basic ops for a call, and runs it."""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from fusible.core.conditions import PlanConditions, conditions_key
from fusible.planning.exec_plan import ExecPlan
from fusible.planning.features.channels import caller_counts
from fusible.planning.prepare import prepare_group
from fusible.runtime.autocast import autocast_available, run_autocast
from fusible.runtime.compile_reasons import with_compile_reasons
from fusible.runtime.executor import apply_pipeline, feature_tensors, run_forward
from fusible.runtime.features import GUARDS, bind
from fusible.runtime.params import GroupParams
from fusible.runtime.recompute import LatestForward
from fusible.runtime.refusals import refuse_transforms


class PipelineRunner:
    """Plans (with a cache keyed by :class:`PlanConditions`) and runs one group of basic ops.

    Attributes
    ----------
    ops : tuple
        The group's basic ops (a lone op's: its ``weakref.proxy``).
    params : GroupParams
        Reads the parameters the ops compute with, afresh each call.
    memory : dict
        What the runtime remembers across the group's calls, each module under its own
        keys (autocast's quantized parameters).
    latest : LatestForward
        The forward a recomputation repeats: its recipe and scaling-state snapshot.
    """

    def __init__(self, ops: tuple, start: int):
        self.ops = tuple(ops)
        self.start = start
        # what the caller passes and receives (channels' are the group's own)
        self.num_extra_inputs, self.num_extra_outputs = caller_counts(self.ops)
        self.params = GroupParams(self.ops)
        self.num_params = self.params.count
        self.latest = LatestForward()
        self.memory: dict = {}
        self._plans: dict = {}

    def run(self, x, extra_inputs: tuple, training: bool, params=None, traced: bool = False,
            tensors=None):
        """Run the group; returns (output, tuple of extra outputs).

        ``traced`` runs the stages' custom ops (the compiled path) on the given
        ``params`` and feature ``tensors`` (flat, in the plan's order), the graph's inputs.
        """
        if type(x) is not torch.Tensor or len(extra_inputs) != self.num_extra_inputs \
                or extra_inputs:
            self._check_inputs(x, extra_inputs)  # the full checks, with the errors
        if not traced:
            if torch._C._are_functorch_transforms_active() or torch._C._is_tracing() \
                    or forward_ad._current_level >= 0:
                refuse_transforms(self, x)
            for guard in GUARDS:  # the features' (split backward: no wgrad left pending)
                guard(self)
        device_type = x.device.type
        params = self.params.read() if params is None else list(params)
        key, recipe = self.latest.recipe_for_call(traced, training, self.name)
        if autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return run_autocast(self, x, extra_inputs, training, params, traced, tensors,
                                fp8=key is not None)
        conditions = conditions_key(x, device_type, params, extra_inputs, key, training)
        plan = self._plans.get(conditions) or self.lookup(PlanConditions(*conditions), recipe)
        if tensors is None:  # eager: the features read theirs from the ops
            tensors = [t for _, feature, record, _ in plan.hooks.tensors
                       for t in feature.call_tensors(record, plan, self, x)] \
                if plan.hooks.tensors else ()
        if not plan.needs_backward:
            return run_forward(plan, x, params, extra_inputs, plan.idle_ctxs, save=False,
                               traced=traced,
                               tensors=feature_tensors(plan, tensors)
                               if tensors or plan.hooks.tensors else None)
        outputs = apply_pipeline(plan, traced, x, *extra_inputs, *params, *tensors)
        if self.num_extra_outputs == 0:
            return outputs, ()
        return outputs[0], tuple(outputs[1:])

    def lookup(self, conditions: PlanConditions, recipe) -> ExecPlan:
        """The cached plan for the group's ``conditions``, planned on first use (``recipe``:
        the FP8 recipe ``conditions.recipe_key`` names)."""
        plan = self._plans.get(conditions)
        if plan is None:
            if (None if recipe is None else recipe.key) != conditions.recipe_key:
                raise RuntimeError(f"{self.name()}: planned for the FP8 recipe key "
                                   f"{conditions.recipe_key!r} with the recipe {recipe!r}")
            plan = self._plans[conditions] = bind(with_compile_reasons(
                prepare_group(self.ops, self.start, conditions, recipe)))
        return plan

    def _check_inputs(self, x, extra_inputs) -> None:
        """Raise for inputs this group cannot take, naming what is wrong."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name()} expects a tensor input, got {type(x).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"{self.name()} expects {self.num_extra_inputs} extra input(s) "
                            f"(AddExtraInput's residuals, GroupedLinear's split sizes), got "
                            f"{len(extra_inputs)}")
        if extra_inputs and not all(isinstance(e, torch.Tensor) for e in extra_inputs):
            raise TypeError(f"{self.name()} expects tensor extra inputs, got "
                            f"{[type(e).__name__ for e in extra_inputs]}")

    def name(self) -> str:
        """``Sequential(Op, ...)``: the group, for errors."""
        return "Sequential(" + ", ".join(op.__class__.__name__ for op in self.ops) + ")"
