"""FP8 recipes and the autocast context that turns them on."""

from __future__ import annotations

import contextlib
import threading

from typing import TYPE_CHECKING, ClassVar, Iterator

import attrs
import torch

from fusible.quantization.format import Float8Format
from fusible.quantization.recipe_base import Recipe, is_registered, registered_recipes

_FORMATS = {
    "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2),
    "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
}


def check_fp8_format(recipe, attribute, value) -> None:
    if value not in _FORMATS:
        raise ValueError(f"{type(recipe).__name__}: fp8_format must be one of "
                         f"{sorted(_FORMATS)}, got {value!r}")


@attrs.frozen
class GranularityRecipe(Recipe):
    """Every role's format at the ``granularity`` (a registered scaling's name) of the
    subclass (``weight_granularity`` for weights, if set), E4M3 forward and
    ``fp8_format``'s gradients: the base of the built-in recipes."""

    if TYPE_CHECKING:  # read-only, for the type checker: a subclass may compute it
        @property
        def granularity(self) -> str: ...
    else:
        granularity: ClassVar[str] = ""
    weight_granularity: ClassVar[str] = ""
    fp8_format: str = attrs.field(default="hybrid", validator=check_fp8_format)

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of inputs and weights."""
        return _FORMATS[self.fp8_format][0]

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 dtype of gradients."""
        return _FORMATS[self.fp8_format][1]

    def input_format(self, columnwise: bool = False) -> Float8Format:
        """The format of a GEMM's input (activations)."""
        return Float8Format(self.forward_dtype, columnwise, self.granularity)

    def weight_format(self, columnwise: bool = False) -> Float8Format:
        """The format of a GEMM's weight."""
        return Float8Format(self.forward_dtype, columnwise,
                            self.weight_granularity or self.granularity)

    def grad_format(self, columnwise: bool = False) -> Float8Format:
        """The format of a gradient a GEMM reads (dgrad and wgrad's ``dy``)."""
        return Float8Format(self.backward_dtype, columnwise, self.granularity)


@attrs.frozen
class Float8CurrentScaling(GranularityRecipe):
    """Per-tensor current scaling: each tensor is scaled by its own amax when it is cast
    (registered as ``"tensorwise"``; presets ``"tensorwise"`` and ``"tensorwise_e4m3"``).

    Attributes
    ----------
    fp8_format : {"hybrid", "e4m3"}
        ``"hybrid"``: E4M3 for forward tensors (inputs, weights), E5M2 for
        gradients (more range). ``"e4m3"``: E4M3 for both.

    Examples
    --------
    >>> with fusible.autocast(recipe=fusible.Float8CurrentScaling()):
    ...     y = model(x)
    """

    name: ClassVar[str] = "tensorwise"
    presets: ClassVar[dict] = {"tensorwise": {}, "tensorwise_e4m3": {"fp8_format": "e4m3"}}
    granularity: ClassVar[str] = "tensorwise"


@attrs.frozen
class Float8RowwiseScaling(GranularityRecipe):
    """Row-wise current scaling: one scale per row of each GEMM operand (a token of the
    input and of the gradient, an output feature of the weight), and the transposed
    copies the backward GEMMs read scaled per row of their own layout (an input feature
    of the weight, a feature of the input and of the gradient), as the math requires.
    More accurate than one scale per tensor where rows differ in magnitude (outliers);
    ``torch._scaled_mm`` with row-wise scales on the GPU. Registered as ``"rowwise"``
    (presets ``"rowwise"``, E4M3 throughout as torchao's, and ``"rowwise_hybrid"``).

    Tensor parallelism gathers the tokens in FP8 with their scales (each rank casts its
    own; the transposed copy's per-feature scales from the group's maxima). Not yet: FP8
    parameters (``quantized_model_init``), the producers' fused casts (norms and
    activations hand over high precision; the cast follows them in their stage).

    Parameters
    ----------
    fp8_format : {"e4m3", "hybrid"}
        ``"e4m3"``: E4M3 for every operand; ``"hybrid"``: E5M2 for gradients.
    """

    name: ClassVar[str] = "rowwise"
    presets: ClassVar[dict] = {"rowwise": {}, "rowwise_hybrid": {"fp8_format": "hybrid"}}
    granularity: ClassVar[str] = "rowwise"

    fp8_format: str = attrs.field(default="e4m3", validator=check_fp8_format)


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
