"""The flattened pipeline of a Sequential (or of one op), split into groups."""

from __future__ import annotations

from torch import nn

from fusible import _epoch, _tokens
from fusible.fuser import PipelineRunner
from fusible.ops.base import FusibleOperation


def flatten(module: nn.Module) -> list:
    """Basic ops and ordinary modules of ``module``, nested Sequentials flattened."""
    from fusible.ops.sequential import Sequential

    if isinstance(module, (FusibleOperation, Sequential)):
        _epoch.mark_planned(module)  # from now on its changes move the epoch
    if isinstance(module, FusibleOperation):
        return list(module.basic_ops())
    if isinstance(module, Sequential):
        return [item for child in module for item in flatten(child)]
    return [module]


class Layout:
    """The flattened pipeline split into runs of basic ops (one runner each) and modules.

    Attributes
    ----------
    items : tuple
        The flattened pipeline; plan indices are positions in it.
    groups : list
        ``(runner, None)`` for a run of basic ops, ``(None, module)`` for a module.
    single : PipelineRunner or None
        The only runner when the pipeline is one group of basic ops.
    """

    def __init__(self, items: list):
        self.epoch = _epoch.current()
        self.items = tuple(items)
        self.groups = []
        run: list = []
        for i, item in enumerate(items + [None]):
            if isinstance(item, FusibleOperation):
                run.append(item)
                continue
            if run:
                runner = PipelineRunner(tuple(run), i - len(run))
                _tokens.register(runner)
                self.groups.append((runner, None))
                run = []
            if item is not None:
                self.groups.append((None, item))
        runners = [r for r, _ in self.groups if r is not None]
        self.single = runners[0] if len(self.groups) == 1 and runners else None
        self.num_extra_inputs = sum(r.num_extra_inputs for r in runners)
        self.num_extra_outputs = sum(r.num_extra_outputs for r in runners)

    def run_eager(self, x, extra_inputs: tuple):
        """Run eagerly: ``(y, *extra_outputs)`` if there are extra outputs, else ``y``."""
        if self.single is not None:  # one group of fusible ops: the common, fast case
            output, extra_outputs = self.single.run(x, extra_inputs)
            return (output, *extra_outputs) if extra_outputs else output
        return self.run(x, extra_inputs, _run_group_eagerly)

    def run(self, x, extra_inputs: tuple, run_group):
        """Run the groups in order; ``run_group(runner, x, extras)`` returns ``(y, extra_outputs)``.

        Ordinary modules are called as they are.
        """
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"Sequential expects {self.num_extra_inputs} extra input(s) for "
                            f"its AddExtraInput ops, got {len(extra_inputs)}")
        extra_outputs, pos = [], 0
        for runner, module in self.groups:
            if runner is None:
                x = module(x)
                continue
            k = runner.num_extra_inputs
            x, outs = run_group(runner, x, extra_inputs[pos:pos + k])
            pos += k
            extra_outputs.extend(outs)
        return (x, *extra_outputs) if self.num_extra_outputs else x


def _run_group_eagerly(runner, x, extra_inputs):
    return runner.run(x, extra_inputs)
