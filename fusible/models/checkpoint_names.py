"""Checkpoints of a rewritten module kept under its original names, by state-dict hooks
(a merged gated MLP's weight saved as its two projections, a linear layer wrapped to take
a residual add saved under its own names)."""

from __future__ import annotations

import functools

import attrs
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


def _load_originals(entries: tuple, module, state, prefix, local_metadata, strict,
                    missing_keys, unexpected_keys, error_msgs) -> None:
    """Join the originals into the module's state, speaking of them by their names: a
    checkpoint missing one (``strict=False``) loads the others into their rows and reports
    the missing ones; a wrong shape is an error naming the original key."""
    for key, originals, rows in entries:
        names = [prefix + name for name in originals]
        present = [n in state for n in names]
        if not any(present):
            continue  # torch reports the key missing, as for any module
        current = _current(module, key)
        if current is None:  # a bias set to None since: nothing to load into
            continue
        if len(originals) == 1:  # a rename: torch loads it (FP8, DTensors alike)
            part = state.pop(names[0])
            if tuple(part.shape) != tuple(current.shape):
                error_msgs.append(_mismatch(names[0], part.shape, current.shape))
                part = current  # no second message under the internal name
            state[prefix + key] = part
            continue
        slices = _rows(rows)
        value, wrong = current.detach().clone(), False
        for name, here, (start, stop) in zip(names, present, slices):
            if not here:
                missing_keys.append(name)
                continue
            part, want = state.pop(name), (stop - start, *current.shape[1:])
            if tuple(part.shape) != want:
                error_msgs.append(_mismatch(name, part.shape, want))
                wrong = True
                continue
            value[start:stop] = part
        state[prefix + key] = current if wrong else value  # wrong: loads nothing


def _current(module, key: str):
    """The module's tensor at the dotted ``key`` (None where it is missing)."""
    owner, _, name = key.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    return getattr(holder, name, None)


def _rows(rows: tuple) -> list:
    """``(start, stop)`` of each original's rows in the joined tensor."""
    bounds, start = [], 0
    for n in rows:
        bounds.append((start, start + n))
        start += n
    return bounds


def _mismatch(name: str, got, want) -> str:
    """torch's message for a checkpoint tensor of another shape, under the original name."""
    return (f"size mismatch for {name}: copying a param with shape {tuple(got)} from "
            f"checkpoint, the shape in current model is {tuple(want)}.")
