"""The autocast context that turns a recipe on, and the recipe in effect (thread-local)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from fusible.quantization.recipes.base import Recipe, is_registered, registered_recipes
from fusible.quantization.recipes.current import Float8CurrentScaling

# The recipe in effect, per thread like torch.autocast's state: None when FP8 is off. A
# compiled model reads the key (a string) in traced code, and dynamo guards on its value;
# the runtime reads the recipe itself once per call, and a plan keeps the one it was made
# for.
_state = threading.local()


def fp8_recipe():
    """The FP8 recipe in effect in this thread, or None."""
    return getattr(_state, "recipe", None)


def current_key():
    """The key of the recipe in effect in this thread, or None (what plan conditions hold)."""
    return getattr(_state, "key", None)


@contextlib.contextmanager
def autocast(*, enabled: bool = True, recipe: "Recipe | None" = None) -> Iterator[None]:
    """Run fusible models inside the block with FP8 GEMMs under ``recipe``.

    Parameters
    ----------
    enabled : bool
        False turns FP8 off inside the block (blocks nest).
    recipe : Recipe, optional
        An instance of a registered recipe class (``fusible.recipe_from_name`` gives
        one by name); defaults to ``Float8CurrentScaling()``.

    Notes
    -----
    The state is thread-local, like ``torch.autocast``'s: other threads keep theirs. The
    recipe is read when a model runs, and is part of the conditions its plan (and a
    compiled model's graph) depends on: changing it re-plans, and recompiles rather than
    breaks.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast: enabled must be a bool, got {enabled!r}")
    if recipe is not None and not is_registered(recipe):
        raise TypeError(f"autocast: recipe must be an instance of a registered recipe class "
                        f"({', '.join(sorted(registered_recipes()))}; a new one registers with "
                        f"fusible.register_recipe), got {recipe!r}")
    previous = fp8_recipe(), current_key()
    active = (recipe or Float8CurrentScaling()) if enabled else None
    _state.recipe, _state.key = active, None if active is None else active.key
    try:
        yield
    finally:
        _state.recipe, _state.key = previous
