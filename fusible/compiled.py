"""The torch.compile path: what dynamo sees of a fusible model.

Dynamo traces ``Sequential.forward`` (or a lone op's ``forward``) into
:func:`compiled_forward`. There:

* the layout and the plans are made eagerly at trace time by a function dynamo
  treats as a constant (``assume_constant_result``), so dynamo never traces the
  planner; it returns why some stage cannot compile, or None;
* each group of fusible ops becomes one call of :func:`fusible_group`, which
  dynamo puts in its graph as is. AOTAutograd traces through it: the group's
  autograd.Function then contributes one custom op per forward stage to the
  forward graph and one per backward stage to the backward graph, and the tensors
  the backward needs are outputs of those custom ops;
* ordinary modules between groups are traced by dynamo as usual.

Dynamo guards on the fusible epoch, so a change to the model's structure or an
op's configuration recompiles. A model with a stage that cannot compile runs
eagerly as a whole, after a graph break whose message names the stage and the
reason (the error under ``fullgraph=True``).
"""

from __future__ import annotations

import logging

import torch

from fusible import _epoch, _tokens
from fusible.quantization import recipe

log = logging.getLogger("fusible")
_warned: set = set()


@torch._dynamo.assume_constant_result
def _prepare(module_token: int, epoch: int, conditions: tuple):
    """Build the layout and plans (eagerly, at trace time); why it cannot compile, or None."""
    from fusible.plan import build_plan

    module = _tokens.lookup(module_token)
    plan = build_plan(module._layout(), *conditions[:-1], recipe.recipe_from_format(conditions[-1]))
    for stage in plan.forward + plan.backward:
        reason = stage.compile_reason
        if reason is not None:
            message = (f"fusible: {stage.direction} stage {stage.name} at {list(stage.indices)} "
                       f"cannot be compiled: {reason}")
            if (module_token, epoch, conditions) not in _warned:
                _warned.add((module_token, epoch, conditions))
                log.warning("%s; %s runs eagerly after a graph break", message,
                            type(module).__name__)
            return message
    return None


@torch.compiler.allow_in_graph
def fusible_group(runner_token: int, num_extra: int, x, *tensors):
    """One group of fusible ops, run through its stages' custom ops."""
    runner = _tokens.lookup(runner_token)
    y, extra_outputs = runner.run(x, tensors[:num_extra], params=tensors[num_extra:],
                                  traced=True)
    return (y, *extra_outputs)


@torch.compiler.disable
def _run_eagerly(module, x, extra_inputs):
    return module._layout().run_eager(x, extra_inputs)


def _graph_break(message: str) -> None:
    try:
        torch._dynamo.graph_break(msg=message)
    except TypeError:  # a PyTorch whose graph_break takes no message
        torch._dynamo.graph_break()


def compiled_forward(module, x, extra_inputs: tuple):
    """``module(x, *extra_inputs)`` as dynamo should trace it."""
    grad = torch.is_grad_enabled()
    conditions = (x.dtype, x.device.type, grad, grad and x.requires_grad,
                  tuple(grad and e.requires_grad for e in extra_inputs), recipe._recipe_format)
    reason = _prepare(id(module), _epoch.current(), conditions)  # dynamo guards on the epoch
    if reason is not None:
        _graph_break(reason)
        return _run_eagerly(module, x, extra_inputs)
    return module._fusible_cache.run(x, extra_inputs, _run_group)


def _run_group(runner, x, extra_inputs):
    params = runner.params()
    out = fusible_group(id(runner), len(extra_inputs), x, *extra_inputs, *params)
    return out[0], out[1:]
