"""Checkpoints of a rewritten module kept under its original names, by state-dict hooks
(a merged gated MLP's weight saved as its two projections, a linear layer wrapped to take
a residual add saved under its own names)."""

from __future__ import annotations

import functools

import attrs
import torch
from torch import nn


@attrs.frozen
class CheckpointNames:
    """State-dict hooks that keep a rewritten module's checkpoints under its original names.

    Each entry ``(key, originals, rows)`` saves the state ``key`` as the keys
    ``originals`` (split along dim 0 into ``rows`` where there are several) and loads
    them back joined. Hooks of module-level functions, not closures: the model pickles.
    """

    entries: tuple  # ((key, (original, ...), (rows, ...)), ...), keys relative to the module

    def install(self, module: nn.Module) -> None:
        # partials, not bound methods: torch marks its hooks with an attribute
        module.register_state_dict_post_hook(functools.partial(_save_originals, self.entries))
        module.register_load_state_dict_pre_hook(
            functools.partial(_load_originals, self.entries))


def _save_originals(entries: tuple, module, state, prefix, local_metadata) -> None:
    for key, originals, rows in entries:
        if prefix + key not in state:  # e.g. a bias set to None since
            continue
        value = state.pop(prefix + key)
        parts = value.split(list(rows)) if len(originals) > 1 else (value,)
        for name, part in zip(originals, parts):
            state[prefix + name] = part


def _load_originals(entries: tuple, module, state, prefix, *args) -> None:
    for key, originals, _ in entries:
        names = [prefix + name for name in originals]
        if all(n in state for n in names):
            parts = [state.pop(n) for n in names]
            state[prefix + key] = torch.cat(parts) if len(parts) > 1 else parts[0]
