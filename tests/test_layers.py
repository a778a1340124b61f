"""The import-layers contract: imports point one way, and none hides in a function body
(but the heavy third-party modules of LAZY, loaded when first used).

Layers, lowest first (docs/design.md draws them). A module may import modules of its own
package unit and of lower layers only; units that share a layer are independent of each
other. The built-in fusions sit above everything, as plugins do. The registry loads
plugins with ``importlib`` (the one dynamic import), not with import statements.
"""

import ast
import collections
import importlib
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).parent.parent
LAYERS = [
    ("fusible.core",),
    ("fusible.kernels",),
    ("fusible.quantization",),
    ("fusible.functional",),
    ("fusible.moe",),  # token routing: functional's row moves, for GroupedLinear layers
    ("fusible.planning",),
    ("fusible.runtime",),
    ("fusible.module",),
    ("fusible.ops",),
    ("fusible.layers",),  # building blocks made of ops
    ("fusible.models.installed_forward",),  # the forwards convert installs: their base
    # the whole-model tools (fusible.models): independent pieces, then what combines them;
    # a module added to the package falls in the lowest of them until it is listed
    ("fusible.models", "fusible.models.checkpoint_names", "fusible.models.glu_rows",
     "fusible.models.layer_pairing", "fusible.models.model_plan_dot",
     "fusible.models.traced_forward"),
    ("fusible.models.gated_mlps", "fusible.models.model_plan",
     "fusible.models.residual_adds", "fusible.models.state_dicts"),
    ("fusible.models.conversion", "fusible.fsdp", "fusible.expert_sharding",
     "fusible.pipelining", "fusible.testing"),
    ("fusible",),  # the facade, fusible/__init__.py
    ("fusible.cli",),  # the command line, on top of the facade
    ("fusible.fusions",),
]
UNITS = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict:
    """Module name -> path, for the library and the built-in fusions."""
    found = {}
    for path in (ROOT / "fusible").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "fusions").glob("*.py"):
        name = "fusible.fusions" + ("" if path.stem == "__init__" else f".{path.stem}")
        found[name] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    """The layer unit a module belongs to (the longest unit prefix)."""
    best = "fusible"
    for unit in UNITS:
        if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    return best


def _imported(node, importer: str) -> list:
    """The fusible modules an import statement imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "fusible"]
    if node.level:  # relative: resolve against the importer's package
        base = importer.rsplit(".", node.level)[0] if importer in MODULES else importer
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    if source.split(".")[0] != "fusible":
        return []
    # "from package import submodule" imports the submodule
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
            for a in node.names]


def _statements():
    """(importer, statement, inside a function or class) for every import statement."""
    for name, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text(), str(path))
        nested = {id(sub) for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield name, node, id(node) in nested


STATEMENTS = list(_statements())


def test_every_module_is_in_a_layer():
    """Listed, not left to the facade's layer by default (as fusible.moe once was)."""
    assert all(_unit(m) in UNITS for m in MODULES)
    assert {"fusible.core.operation", "fusible.fusions.forward_linear_bias"} <= set(MODULES)
    unlisted = sorted(m for m in MODULES if _unit(m) == "fusible" and m != "fusible")
    assert not unlisted, f"modules in no layer of LAYERS: {unlisted}"


# Heavy third-party modules that load when first used, not with `import fusible` (which
# stays under 0.3 s after torch): the only imports a function body may hold.
LAZY = {"torch.distributed.pipelining", "graphviz", "functorch.compile", "triton",
        "triton.language", "torch._dynamo.utils", "torch._functorch.aot_autograd"}
# (fusible.expert_sharding imports torch.distributed.fsdp and .tensor at its top: the facade
# does not import it)


def _module_of(node) -> str:
    return node.module if isinstance(node, ast.ImportFrom) else node.names[0].name


def test_no_import_in_a_function_body():
    deferred = [f"{name}:{node.lineno}: {ast.unparse(node)}"
                for name, node, nested in STATEMENTS if nested
                and not (_module_of(node) in LAZY and not getattr(node, "level", 0))]
    assert not deferred, "imports hidden in function or class bodies:\n" + "\n".join(deferred)


@pytest.mark.parametrize("level", range(len(LAYERS)), ids=lambda i: "+".join(LAYERS[i]))
def test_imports_point_down(level):
    wrong = []
    for name, node, _ in STATEMENTS:
        unit = _unit(name)
        if UNITS[unit] != level:
            continue
        for target in _imported(node, name):
            other = _unit(target)
            if other != unit and UNITS[other] >= level:
                wrong.append(f"{name}:{node.lineno} imports {target} ({other}, layer "
                             f"{UNITS[other]} >= {level})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import():
    """The checker itself: an upward import is reported."""
    node = ast.parse("from fusible.runtime.executor import apply_pipeline").body[0]
    (target,) = _imported(node, "fusible.core.stage")
    assert UNITS[_unit(target)] > UNITS[_unit("fusible.core.stage")]


def test_import_fusible_loads_no_heavy_module():
    """`import fusible` after torch pays for none of dynamo, DTensor, pipelining, Triton or
    graphviz: each loads when first used (a compile, a DTensor, a pipeline stage, a CUDA
    kernel, a rendering)."""
    code = ("import sys, torch; before = set(sys.modules); import fusible; "
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', "
            "'torch.distributed.pipelining', 'graphviz', 'triton') if m in sys.modules "
            "and m not in before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out


# Private attributes of torch's own classes, which any layer may use as torch documents.
TORCH_PRIVATE = set(dir(torch.nn.Module())) | set(dir(torch.Tensor)) | {"_base", "_version"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private(tree) -> set:
    """The private names a module defines: functions, classes, attributes it assigns, and
    string constants (``setattr(obj, "_x", ...)``, ``__slots__``, a slot's name)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return {n for n in names if _private(n)}


def _reached_private(tree):
    """``(line, name)`` of every private attribute a module reads off another object
    (``obj._x``, ``getattr(obj, "_x")``; ``self`` and ``cls`` are the module's own)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            yield node.lineno, node.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            yield node.lineno, node.args[1].value


def _private_reaches(sources: dict) -> list:
    """Where a module reads a private attribute that only a higher layer defines (duck
    typing across layers: the lower layer should declare the interface it needs)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    level = {name: UNITS[_unit(name)] for name in trees}
    defined = {name: _defined_private(tree) for name, tree in trees.items()}
    wrong = []
    for name, tree in sorted(trees.items()):
        for line, attr in _reached_private(tree):
            if attr in defined[name] or attr in TORCH_PRIVATE:
                continue
            owners = [m for m in trees if level[m] > level[name] and attr in defined[m]]
            if owners:
                wrong.append(f"{name}:{line} reads .{attr}, private to {owners[0]} "
                             f"(layer {level[owners[0]]} > {level[name]})")
    return wrong


def test_no_private_attribute_of_a_higher_layer():
    sources = {name: path.read_text() for name, path in MODULES.items()}
    wrong = _private_reaches(sources)
    assert not wrong, "lower layers reaching into higher ones:\n" + "\n".join(wrong)


def test_the_check_sees_a_private_reach():
    """The checker itself: the compiled path reading a module's private cache is caught."""
    sources = {"fusible.module": "class M:\n    def _layout(self):\n        self._cache = 1\n",
               "fusible.runtime.compiled": "def f(module):\n    return module._layout()\n"}
    (found,) = _private_reaches(sources)
    assert found.startswith("fusible.runtime.compiled:2 reads ._layout, private to "
                            "fusible.module")


# What fusions may import from fusible's internals is declared: each module's __all__
# (docs/writing_a_fusion.md, "Helpers for fusion authors"). The public faces, fusible and
# fusible.ops, are documented in the API reference instead.
PUBLIC_FACES = {"fusible", "fusible.ops"}
# Modules a fusion imports from that have no __all__ yet (none now; a module listed here
# that gains an __all__ is checked as the rest).
AWAITING_ALL: set = set()
FUSION_DOCS = ROOT / "docs" / "writing_a_fusion.md"


def _fusion_imports() -> dict:
    """``{module: {name, ...}}``: what the built-in fusions import from fusible."""
    found = collections.defaultdict(set)
    for name, node, _ in STATEMENTS:
        if name.startswith("fusible.fusions") and isinstance(node, ast.ImportFrom) \
                and not node.level and (node.module or "").split(".")[0] == "fusible":
            found[node.module] |= {a.name for a in node.names}
    return dict(found)


def _declared(module: str):
    """The module's ``__all__``, or None (a module awaiting one)."""
    declared = getattr(importlib.import_module(module), "__all__", None)
    assert declared is not None or module in AWAITING_ALL, (
        f"{module}: a built-in fusion imports from it, so it declares what fusions may "
        f"import in __all__")
    return declared


def _undeclared(imports: dict) -> dict:
    """``{module: [name, ...]}`` of the imported names missing from their module's
    ``__all__``."""
    return {module: sorted(names - set(declared)) for module, names in imports.items()
            if (declared := _declared(module)) is not None and names - set(declared)}


def test_fusions_import_only_declared_helpers():
    undeclared = _undeclared(_fusion_imports())
    assert not undeclared, (f"built-in fusions import names their modules do not declare "
                            f"in __all__: {undeclared}")


def _helper_section() -> str:
    text = FUSION_DOCS.read_text()
    start = text.index("## Helpers for fusion authors")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_declared_helpers_are_documented_and_listed():
    """Each helper of a module fusions import from has its numpydoc (a section such as
    Parameters or Attributes) and a row in writing_a_fusion.md's helper table."""
    section = _helper_section()
    for module, names in sorted(_fusion_imports().items()):
        if module in PUBLIC_FACES:
            continue
        declared = _declared(module)
        rows = [line for line in section.splitlines() if line.startswith(f"| `{module}` |")]
        assert rows, f"{module} has no row in the helper table of {FUSION_DOCS.name}"
        for name in declared or names:
            assert f"`{name}`" in rows[0], f"{module}.{name} is not in the helper table"
            doc = getattr(importlib.import_module(module), name).__doc__ or ""
            assert declared is None or re.search(r"\n\s*-{3,}\n", doc), (
                f"{module}.{name} has no numpydoc section")


def test_the_check_sees_an_undeclared_helper():
    """The checker itself: a fusion importing a helper its module keeps for itself (one
    left out of __all__) is reported."""
    planted = {"fusible.functional.linear": {"gemm_forward", "linear_dgrad"}}
    assert _undeclared(planted) == {"fusible.functional.linear": ["linear_dgrad"]}
