"""FP8 recipes as plugins: the :class:`Recipe` base and its registry.

A recipe is a frozen attrs config that says, for each tensor role a GEMM reads (the
input, the weight, the output gradient), in which :class:`~fusible.quantization.format.
Float8Format` it is quantized. The planner and the runtime read only those formats and
the recipe's :attr:`Recipe.key`; they never name a recipe class. Recipes register like
fusions: :func:`register_recipe`, or an entry point of the group ``fusible.recipes``
(fusible's own are entry points of its distribution), each under its class's ``name``,
with named ``presets`` (:func:`recipe_from_name`, as torchao's
``Float8LinearConfig.from_recipe_name``).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs

from fusible.core.plugins import EntryPointGroup
from fusible.quantization.gemm_policy import Fp8GemmPolicy, default_gemm_policy

ENTRY_POINT_GROUP = "fusible.recipes"
ROLES = ("input", "weight", "grad")  # the tensor roles of a GEMM's operands

_recipes: dict = {}  # name -> class


@attrs.frozen
class Recipe:
    """Base of FP8 recipes.

    A subclass is an ``attrs.frozen`` class with a unique ``name``, optional named
    ``presets`` (preset name -> keyword arguments of the class) and the three format
    methods; register it with :func:`register_recipe` (or an entry point of the group
    ``fusible.recipes``) before ``fusible.autocast(recipe=...)`` takes its instances.

    Attributes
    ----------
    name : str
        The registry's name of the class (a class attribute).
    presets : dict
        Named configurations: ``{preset name: keyword arguments}`` (a class attribute).
    gemm_policy : Fp8GemmPolicy or None
        Which GEMMs run in FP8 (keyword only; :mod:`fusible.quantization.gemm_policy`):
        the cost model by default, which on CUDA keeps GEMMs too small to gain in bf16;
        None: every GEMM the recipe takes.
    """

    name: ClassVar[str] = ""
    presets: ClassVar[dict] = {}
    gemm_policy: Optional[Fp8GemmPolicy] = attrs.field(factory=default_gemm_policy,
                                                       kw_only=True)

    def input_format(self, columnwise: bool = False):
        """The Float8Format of a GEMM's input (activations); ``columnwise``: with the
        transposed copy the weight gradient reads."""
        raise NotImplementedError(f"{type(self).__name__}.input_format")

    def weight_format(self, columnwise: bool = False):
        """The Float8Format of a GEMM's weight."""
        raise NotImplementedError(f"{type(self).__name__}.weight_format")

    def grad_format(self, columnwise: bool = False):
        """The Float8Format of the gradient a GEMM's backward reads (dgrad and wgrad)."""
        raise NotImplementedError(f"{type(self).__name__}.grad_format")

    def role_format(self, role: str):
        """The format of tensor role ``"input"``, ``"weight"`` or ``"grad"`` (without
        transposed copies)."""
        formats = {"input": self.input_format, "weight": self.weight_format,
                   "grad": self.grad_format}
        if role not in formats:
            raise ValueError(f"{type(self).__name__}: no tensor role {role!r}; the roles are "
                             f"{sorted(formats)}")
        return formats[role]()

    @property
    def stateful(self) -> bool:
        """Whether some role's format keeps state per op (delayed scaling)."""
        return any(self.role_format(role).stateful for role in ROLES)

    def emulated_scalings(self, device) -> tuple:
        """The granularities of this recipe's formats whose GEMMs run emulated on
        ``device`` (no native kernel there), sorted."""
        formats = (self.input_format(), self.weight_format(), self.grad_format())
        return tuple(sorted({f.granularity for f in formats if f.scaling.emulated_on(device)}))

    @property
    def key(self) -> str:
        """The string that names this recipe in plan conditions and compiled guards: the
        class's name and every field's value."""
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}"
                           for f in attrs.fields(type(self)))
        return f"{self.name}({fields})"


def register_recipe(cls: type) -> type:
    """Class decorator that makes a :class:`Recipe` subclass available to
    ``fusible.autocast`` and :func:`recipe_from_name`.

    Raises
    ------
    TypeError
        If ``cls`` is not an attrs-frozen subclass of Recipe.
    ValueError
        If its ``name`` is empty or another registered class has it, or a preset name
        is taken by another class.
    """
    # its own attrs class (a plain subclass inherits the base's attrs attributes)
    if not (isinstance(cls, type) and issubclass(cls, Recipe)
            and "__attrs_attrs__" in vars(cls)):
        raise TypeError(f"register_recipe: {cls!r} is not an attrs class derived from "
                        f"fusible.Recipe")
    if not (isinstance(cls.name, str) and cls.name):
        raise ValueError(f"register_recipe: {cls.__qualname__} needs a name (a non-empty "
                         f"class attribute 'name')")
    _load_plugins()
    known = _recipes.get(cls.name)
    if known is cls:
        return cls
    if known is not None:
        raise ValueError(f"register_recipe: the name {cls.name!r} of {_where(cls)} is taken "
                         f"by {_where(known)}")
    for preset in cls.presets:
        owner = _preset_owner(preset)
        if owner is not None:
            raise ValueError(f"register_recipe: preset {preset!r} of {_where(cls)} is taken "
                             f"by {_where(owner)}")
    _recipes[cls.name] = cls
    return cls


def unregister_recipe(cls: type[Recipe]) -> None:
    """Remove a recipe class registered by :func:`register_recipe` (tests, plugins
    reloading)."""
    if _recipes.get(cls.name) is cls:
        del _recipes[cls.name]


def registered_recipes() -> dict:
    """``{name: class}`` of every registered recipe (entry points loaded first)."""
    _load_plugins()
    return dict(_recipes)


def is_registered(recipe) -> bool:
    """Whether ``recipe`` is an instance of a registered recipe class."""
    return isinstance(recipe, Recipe) and registered_recipes().get(recipe.name) is type(recipe)


def recipe_from_name(name: str) -> Recipe:
    """The recipe of a preset name (``"tensorwise"``, ...) or of a registered class's name
    (its default configuration).

    Raises ValueError for an unknown name, listing the known ones.
    """
    _load_plugins()
    owner = _preset_owner(name)
    if owner is not None:
        return owner(**owner.presets[name])
    if name in _recipes:
        return _recipes[name]()
    known = sorted({*_recipes, *(p for cls in _recipes.values() for p in cls.presets)})
    raise ValueError(f"recipe_from_name: no recipe or preset named {name!r}; known: "
                     f"{', '.join(known)}")


def _preset_owner(preset: str):
    return next((cls for cls in _recipes.values() if preset in cls.presets), None)


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# Loaded at the first registration or lookup.
_PLUGINS = EntryPointGroup(ENTRY_POINT_GROUP, "recipe", register_recipe)
_state = _PLUGINS.state
_load_plugins = _PLUGINS.load
