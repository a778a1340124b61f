"""The plugin registries as a value: what a test found, restored after it (the
``plugins`` fixture, tests/conftest.py)."""

import attrs

import fusible
from fusible.core import schema
from fusible.testing import reference


@attrs.frozen
class Registries:
    """What the plugin registries hold: fusions (in planning order), recipes, the types
    that cross custom ops, the FP64 references of ops."""

    fusions: tuple
    recipes: dict
    schema_types: dict
    references: dict

    @classmethod
    def now(cls) -> "Registries":
        # the schema types and references have no public listing: read where they live
        return cls(fusible.registered_fusions(), fusible.registered_recipes(),
                   dict(schema._ADAPTERS), dict(reference._REFERENCES))

    def restore(self) -> None:
        """Back to these registries: what was registered since is removed, what was
        removed comes back (fusions in their planning order)."""
        if fusible.registered_fusions() != self.fusions:
            for cls in fusible.registered_fusions():
                fusible.unregister_fusion(cls)
            for cls in self.fusions:  # registered in planning order, they plan in it
                fusible.register_fusion(cls)
        for name, cls in fusible.registered_recipes().items():
            if self.recipes.get(name) is not cls:
                fusible.unregister_recipe(cls)
        for cls in self.recipes.values():
            fusible.register_recipe(cls)
        for now, then in ((schema._ADAPTERS, self.schema_types),
                          (reference._REFERENCES, self.references)):
            if now != then:
                now.clear()
                now.update(then)


class Plugins:
    """Registrations for one test (the ``plugins`` fixture), undone after it."""

    fusion = staticmethod(fusible.register_fusion)
    recipe = staticmethod(fusible.register_recipe)
    schema_type = staticmethod(fusible.register_schema_type)
    reference = staticmethod(reference.register_reference)
