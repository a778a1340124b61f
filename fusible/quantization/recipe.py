"""FP8 recipes and the autocast context that turns them on."""

from __future__ import annotations

import contextlib

import attrs
import torch

_FORMATS = {
    "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2),
    "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
}


@attrs.frozen
class Float8CurrentScaling:
    """Per-tensor current scaling: each tensor is scaled by its own amax when it is cast.

    Parameters
    ----------
    fp8_format : {"hybrid", "e4m3"}
        ``"hybrid"``: E4M3 for forward tensors (inputs, weights), E5M2 for
        gradients (more range). ``"e4m3"``: E4M3 for both.

    Examples
    --------
    >>> with fusible.autocast(recipe=fusible.Float8CurrentScaling()):
    ...     y = model(x)
    """

    fp8_format: str = attrs.field(default="hybrid")

    @fp8_format.validator
    def _check_format(self, attribute, value):
        if value not in _FORMATS:
            raise ValueError(f"Float8CurrentScaling: fp8_format must be one of "
                             f"{sorted(_FORMATS)}, got {value!r}")

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of inputs and weights."""
        return _FORMATS[self.fp8_format][0]

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 dtype of gradients."""
        return _FORMATS[self.fp8_format][1]


# The recipe in effect: None when FP8 is off. Plain module globals: a compiled model
# reads the format (a string) in traced code, and dynamo guards on its value.
_recipe = None
_recipe_format = None


def fp8_recipe():
    """The FP8 recipe in effect, or None."""
    return _recipe


def recipe_from_format(fp8_format):
    """The recipe of ``fp8_format``, or None for None (the inverse of ``_recipe_format``)."""
    return None if fp8_format is None else Float8CurrentScaling(fp8_format)


@contextlib.contextmanager
def autocast(*, enabled: bool = True, recipe=None):
    """Run fusible models inside the block with FP8 GEMMs under ``recipe``.

    Parameters
    ----------
    enabled : bool
        False turns FP8 off inside the block (blocks nest).
    recipe : Float8CurrentScaling, optional
        Defaults to ``Float8CurrentScaling()``.

    Notes
    -----
    The recipe is read when a model runs, and is part of the conditions its
    plan (and a compiled model's graph) depends on: changing it re-plans, and
    recompiles rather than breaks.
    """
    global _recipe, _recipe_format
    if recipe is not None and not isinstance(recipe, Float8CurrentScaling):
        raise TypeError(f"autocast: recipe must be a Float8CurrentScaling, got {recipe!r}")
    previous = _recipe, _recipe_format
    _recipe = (recipe or Float8CurrentScaling()) if enabled else None
    _recipe_format = None if _recipe is None else _recipe.fp8_format
    try:
        yield
    finally:
        _recipe, _recipe_format = previous
