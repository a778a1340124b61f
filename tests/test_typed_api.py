"""The typed API: fusible ships py.typed, and every public function (fusible.__all__) and
every public method of the plan classes annotates its parameters and its result, every
public class's constructor its parameters."""

import inspect
import pathlib

import fusible


def _unannotated(fn) -> list:
    sig = inspect.signature(fn)
    lacking = [name for name, p in sig.parameters.items()
               if p.annotation is inspect.Parameter.empty and name not in ("self", "cls")
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if sig.return_annotation is inspect.Signature.empty:
        lacking.append("return")
    return lacking


def test_public_functions_are_annotated():
    lacking = {name: _unannotated(obj) for name in fusible.__all__
               if inspect.isfunction(obj := getattr(fusible, name)) and _unannotated(obj)}
    for cls in (fusible.FusionPlan, fusible.ModelPlan, fusible.ops.Sequential):
        for name, fn in vars(cls).items():
            if inspect.isfunction(fn) and not name.startswith("_") and _unannotated(fn):
                lacking[f"{cls.__name__}.{name}"] = _unannotated(fn)
    assert not lacking, lacking


def test_public_constructors_are_annotated():
    """Classes of fusible.__all__ and fusible.ops.__all__ whose constructor is fusible's
    own (attrs-generated ones included: they take the fields' or converters' types)."""
    lacking = {}
    for module in (fusible, fusible.ops):
        for name in module.__all__:
            cls = getattr(module, name)
            init = getattr(cls, "__init__", None) if inspect.isclass(cls) else None
            if not inspect.isfunction(init) or not init.__module__.startswith("fusible"):
                continue
            missing = [n for n in _unannotated(init) if n != "return"]
            if missing:
                lacking[f"{module.__name__}.{name}"] = missing
    assert not lacking, lacking


def test_the_package_is_marked_typed():
    assert (pathlib.Path(fusible.__file__).parent / "py.typed").exists()
