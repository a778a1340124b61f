"""The torch.compile path: what dynamo sees of a fusible model.

Dynamo traces ``Sequential.forward`` (or a lone op's ``forward``) into
:func:`compiled_forward`. There:

* the layout and each group's plan are made eagerly at trace time by functions
  dynamo treats as constants (``assume_constant_result``), so dynamo never traces
  the planner; they return why the plan cannot compile, or None;
* each group of fusible ops becomes one call of :func:`fusible_group`, which
  dynamo puts in its graph as is. AOTAutograd traces through it: the group's
  autograd.Function then contributes one custom op per forward stage to the
  forward graph and one per backward stage to the backward graph, and the tensors
  the backward needs are outputs of those custom ops;
* ordinary modules between groups are traced by dynamo as usual.

Dynamo guards on the fusible epoch, so a change to the model's structure or an
op's configuration recompiles; a stage that cannot compile is a graph break
whose message names it and the reason (an error under ``fullgraph=True``).
"""

from __future__ import annotations

import logging

import torch

from fusible import _epoch, _tokens

log = logging.getLogger("fusible")


@torch._dynamo.assume_constant_result
def _prepare_layout(module_token: int, epoch: int) -> int:
    """Build the module's layout (eagerly, at trace time); returns its number of groups."""
    return len(_tokens.lookup(module_token)._layout().groups)


@torch._dynamo.assume_constant_result
def _prepare_group(runner_token: int, epoch: int, key: tuple):
    """Plan a group for ``key`` (eagerly); returns why it cannot compile, or None."""
    runner = _tokens.lookup(runner_token)
    plan = runner.lookup(*key)
    stages = [("forward", s) for s in plan.group.forward]
    stages += [("backward", s) for s in plan.backward_stages]
    for direction, stage in stages:
        reason = stage.op.compile_unsupported_reason(direction)
        if reason is not None:
            message = (f"fusible: {direction} stage {stage.name} at {list(stage.indices)} cannot "
                       f"be compiled: {reason}")
            log.warning("%s; it runs eagerly after a graph break", message)
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
def _run_eagerly(runner, x, extra_inputs):
    y, extra_outputs = runner.run(x, extra_inputs)
    return (y, *extra_outputs)


def _graph_break(message: str) -> None:
    try:
        torch._dynamo.graph_break(msg=message)
    except TypeError:  # a PyTorch whose graph_break takes no message
        torch._dynamo.graph_break()


def compiled_forward(module, x, extra_inputs: tuple):
    """``module(x, *extra_inputs)`` as dynamo should trace it."""
    _prepare_layout(id(module), _epoch.current())  # dynamo guards on the epoch
    return module._fusible_cache.run(x, extra_inputs, _run_group)


def _run_group(runner, x, extra_inputs):
    params = runner.params()
    grad = torch.is_grad_enabled()
    key = (x.dtype, x.device.type, grad, x.requires_grad and grad,
           tuple(p.requires_grad for p in params), tuple(e.requires_grad for e in extra_inputs))
    reason = _prepare_group(id(runner), _epoch.current(), key)
    if reason is not None:
        _graph_break(reason)
        out = _run_eagerly(runner, x, extra_inputs)
    else:
        out = fusible_group(id(runner), len(extra_inputs), x, *extra_inputs, *params)
    return out[0], out[1:]
