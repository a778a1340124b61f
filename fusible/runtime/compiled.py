"""The torch.compile path: what dynamo sees of a fusible model.

Dynamo traces ``Sequential.forward`` (or a lone op's ``forward``) into
:func:`compiled_forward`. There:

* the plan conditions (:class:`~fusible.core.conditions.PlanConditions`: input dtype,
  device type, grad mode, what requires grad, the FP8 recipe's key, training mode) are
  read in traced code, so dynamo guards on each of them, and passed on as a plain tuple
  of constants;

* the layout and the plans are made eagerly at trace time by a function dynamo
  treats as a constant (``assume_constant_result``), so dynamo never traces the
  planner; it returns why some stage cannot compile, or None, and which execution
  features' tensors (main_grad buffers, scaling states) each group's graph takes;
* each group of fusible ops becomes one call of :func:`fusible_group`, which
  dynamo puts in its graph as is. AOTAutograd traces through it: the group's
  autograd.Function then contributes one custom op per forward stage to the
  forward graph and one per backward stage to the backward graph (a stage of
  aliases and views, ``inline_when_compiled``, is traced inline instead), and the
  tensors the backward needs are outputs of those custom ops;
* ordinary modules between groups are traced by dynamo as usual.

Dynamo guards on the fusible epoch, so a change to the model's structure or an
op's configuration recompiles. A model with a stage that cannot compile runs
eagerly as a whole, after a graph break whose message names the stage and the
reason (the error under ``fullgraph=True``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fusible.core import epoch, tokens
from fusible.core.conditions import PlanConditions, conditions_key
from fusible.quantization.recipes.autocast import current_key, fp8_recipe
from fusible.runtime.features import RUNTIME
from fusible.runtime.layout import built_layout, layout_of

log = logging.getLogger("fusible")
_warned: set = set()


def _prepare(module_token: int, epoch_now: int, conditions: tuple):
    """Build the layout and plans (eagerly, at trace time, which also makes the FP8
    scaling states the plans read); ``(why it cannot compile or None, per group the names
    of the execution features whose tensors its graph takes)``.

    ``conditions`` leaves the parameters' requires-grad pattern out (None): it is read
    here, from the parameters dynamo guards on.
    """
    _register_with_dynamo()
    module = tokens.lookup(module_token)
    layout = layout_of(module)
    grad = conditions[2]
    params_rg = tuple(grad and p.requires_grad for p in layout.params())
    conditions_now = PlanConditions(*conditions)._replace(params_requires_grad=params_rg)
    fp8 = fp8_recipe()
    plan = layout.plan(conditions_now, fp8)
    features = tuple(group.hooks.tensor_features
                     for _, _, group, _ in layout.group_plans(conditions_now, fp8)
                     if group is not None)
    return _compile_refusal(module, module_token, epoch_now, conditions, plan), features


def _compile_refusal(module, module_token, epoch_now, conditions, plan):
    """Why a stage of ``plan`` cannot compile (warned once), or None."""
    for stage in plan.forward + plan.backward + plan.wgrad:
        reason = stage.compile_reason
        if reason is not None:
            message = (f"fusible: {stage.direction} stage {stage.name} at {list(stage.indices)} "
                       f"cannot be compiled: {reason}")
            if (module_token, epoch_now, conditions) not in _warned:
                _warned.add((module_token, epoch_now, conditions))
                log.warning("%s; %s runs eagerly after a graph break", message,
                            type(module).__name__)
            return message
    return None


def fusible_group(runner_token: int, num_extra: int, training: bool, modes: tuple, x,
                  *tensors):
    """One group of fusible ops, run through its stages' custom ops (``modes``: the ops'
    training flags, which the compiled graph depends on); ``tensors``: the extra inputs,
    the parameters, then the feature tensors (main_grad buffers, FP8 scaling states,
    which the stages update: the graph writes them back)."""
    runner = tokens.lookup(runner_token)
    params_end = num_extra + runner.num_params
    y, extra_outputs = runner.run(x, tensors[:num_extra], training,
                                  params=tensors[num_extra:params_end], traced=True,
                                  tensors=tensors[params_end:])
    return (y, *extra_outputs)


def _run_eagerly_impl(module, x, extra_inputs):
    return layout_of(module).run_eager(x, extra_inputs, module.training)


# What dynamo must know of this module's functions. Importing torch._dynamo costs 0.4 s,
# which `import fusible` need not pay: _prepare is marked by hand (what
# torch._dynamo.assume_constant_result sets), and dynamo, which calls it eagerly at trace
# time before it meets the rest, then learns the others.
setattr(_prepare, "_dynamo_marked_constant", True)  # setattr: mypy allows functions none
# _run_eagerly_impl, hidden from dynamo: set by _register_with_dynamo. Any, not Optional:
# the traced compiled_forward calls it (set by then) without narrowing it first.
_run_eagerly: Any = None


def _register_with_dynamo() -> None:
    global _run_eagerly
    if _run_eagerly is None:
        torch.compiler.allow_in_graph(fusible_group)
        _run_eagerly = torch.compiler.disable(_run_eagerly_impl)


def _graph_break(message: str) -> None:
    try:
        torch._dynamo.graph_break(msg=message)
    except TypeError:  # a PyTorch whose graph_break takes no message
        torch._dynamo.graph_break()


def compiled_forward(module, x, extra_inputs: tuple):
    """``module(x, *extra_inputs)`` as dynamo should trace it."""
    training = module.training
    conditions = conditions_key(x, x.device.type, None, extra_inputs, current_key(),
                                training)
    # dynamo guards on the epoch
    reason, features = _prepare(id(module), epoch.current(), conditions)
    if reason is not None:
        _graph_break(reason)
        return _run_eagerly(module, x, extra_inputs)

    layout = built_layout(module)
    lone = (module,) if layout.lone else None  # dynamo cannot trace the layout's proxy
    features_of = iter(features)  # per group, in order

    def run_group(runner, y, extras):
        # Each op's own training flag is read here, so that dynamo guards on it: a stage's
        # arguments may depend on it (an op switched to eval() alone recompiles too).
        ops = lone or runner.ops
        modes = tuple(op.training for op in ops)
        params = runner.params.read(ops)
        # feature tensors (main_grad buffers, scaling states) become graph inputs here
        # (dynamo reads the attributes), so the graphs can write into them
        tensors = [t for name in next(features_of)
                   for t in RUNTIME[name].graph_tensors(runner, ops, params)]
        out = fusible_group(id(runner), len(extras), training, modes, y, *extras, *params,
                            *tensors)
        return out[0], out[1:]

    return layout.run(x, extra_inputs, run_group)
