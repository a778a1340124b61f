"""The ``fusible`` command: ``plan``, ``doctor`` and ``bench``.

    fusible plan MODULE:FACTORY --input-shape 2,16 [--factory-args 64,256] [--tokens 64]
                 [--extra-input-shape 2,16] [--convert] [--fp8] [--diagram out/plan]
    fusible doctor
    fusible bench [zoo.py's arguments]

Errors of ``plan`` (a bad factory, shapes the model refuses) print one line, the error's
type and message; ``--traceback`` shows where it came from.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import shutil
import subprocess
import sys
from typing import Optional, Sequence

import torch

import fusible
from fusible.module import PipelineModule

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="fusible", description="fusible's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print a model's plan and write its diagram")
    plan.add_argument("factory", help="MODULE:FACTORY, a callable returning the model "
                                      "(MODULE importable, or a path to a .py file)")
    plan.add_argument("--factory-args", default="", metavar="ARGS",
                      help="the factory's arguments as Python literals, e.g. '64, 256' or "
                           "'hidden=64, ffn=256'")
    plan.add_argument("--input-shape", required=True,
                      help="comma-separated shape of the example input, e.g. 8,1024")
    plan.add_argument("--extra-input-shape", action="append", default=None, metavar="SHAPE",
                      help="the shape of an extra input of a fusible Sequential (once per "
                           "extra input; default: the input's shape for each, as a residual "
                           "add takes)")
    plan.add_argument("--convert", action="store_true",
                      help="fusible.convert the model first (a plain torch.nn model)")
    plan.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                      help="dtype of the model and of a floating-point input")
    plan.add_argument("--tokens", type=int, metavar="VOCAB",
                      help="the input is token ids below VOCAB (an embedding first)")
    plan.add_argument("--fp8", action="store_true", help="plan under fusible.autocast()")
    plan.add_argument("--split-backward", action="store_true",
                      help="plan under fusible.split_backward()")
    plan.add_argument("--diagram", default="out/plan",
                      help="where to write the diagram (svg; .dot without graphviz's dot)")
    plan.add_argument("--traceback", action="store_true",
                      help="on an error, the full traceback instead of one line")
    commands.add_parser("doctor", help="report the environment fusible runs in")
    commands.add_parser("bench", add_help=False,
                        help="run the block zoo on this GPU (benchmarks/zoo.py's arguments)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "doctor":
        print(doctor())
        return 0
    try:
        return plan_command(args)
    except Exception as error:  # one line each: the command is a tool, not a library call
        if args.traceback:
            raise
        print(f"fusible plan: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


def plan_command(args) -> int:
    dtype = _DTYPES[args.dtype]
    factory_args, factory_kwargs = parse_call_arguments(args.factory_args)
    model = load_factory(args.factory)(*factory_args, **factory_kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{args.factory} returned {type(model).__name__}, not an nn.Module")
    model = model.to(dtype)
    if args.convert:
        model = _converted(model)
    elif not any(isinstance(m, PipelineModule) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no fusible module: add --convert to "
                         f"fusible.convert it first")
    shape = _shape(args.input_shape, "--input-shape")
    if args.tokens:
        x = torch.randint(0, args.tokens, shape)
    else:
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
    extras = [torch.randn(s, dtype=dtype) for s in _extra_shapes(model, shape, args)]
    with fusible.autocast(enabled=args.fp8), fusible.split_backward(args.split_backward):
        plan = fusible.plan_model(model, x, *extras)
    print(plan.explain())
    os.makedirs(os.path.dirname(os.path.abspath(args.diagram)), exist_ok=True)
    path = plan.render(args.diagram, "svg", dot_source_without_graphviz=True)
    print(f"diagram: {path}" + (" (graphviz's dot is not installed: DOT source)"
                                if path.endswith(".dot") else ""))
    return 0


def parse_call_arguments(text: str) -> tuple:
    """``(args, kwargs)`` of ``text`` read as a call's arguments, each a Python literal."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        assert isinstance(call, ast.Call)
        return ([ast.literal_eval(a) for a in call.args],
                {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg})
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"--factory-args must be Python literals, e.g. '64, 256' or "
                         f"'hidden=64'; got {text!r} ({error})") from None


def _shape(text: str, option: str) -> tuple:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None


def _extra_shapes(model, shape: tuple, args) -> list:
    """The extra inputs' shapes: as given, or the input's for each one a root Sequential
    takes."""
    wanted = (sum(getattr(op, "num_extra_inputs", 0) for op in model.pipeline())
              if isinstance(model, PipelineModule) else 0)
    if args.extra_input_shape is None:
        return [shape] * wanted
    given = [_shape(s, "--extra-input-shape") for s in args.extra_input_shape]
    if len(given) != wanted:
        raise ValueError(f"{len(given)} --extra-input-shape given; {type(model).__name__} "
                         f"takes {wanted} extra input(s)")
    return given


def _converted(model):
    """``model`` converted (its root replaced where it converts whole), the report shown."""
    root = fusible.convert_module(model)
    if root is not None:
        print(f"converted: {type(model).__name__} -> {type(root).__name__}")
        return root
    print(fusible.convert(model))
    return model


def load_factory(spec: str):
    """The callable ``MODULE:FACTORY`` names (``MODULE`` a module or a .py file)."""
    if ":" not in spec:
        raise SystemExit(f"fusible plan: expected MODULE:FACTORY, got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        found = importlib.util.spec_from_file_location(pathlib.Path(where).stem, where)
        if found is None or found.loader is None:
            raise SystemExit(f"fusible plan: cannot load {where}")
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"fusible plan: {where} has no callable {name!r}")
    return factory


def doctor() -> str:
    """A report of what fusible finds here: versions, GPU and FP8 support, Triton, graphviz."""
    lines = [f"fusible {fusible.__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        fp8 = (major, minor) >= (8, 9)
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor}), FP8 GEMMs: "
                     f"{'yes' if fp8 else 'no (needs sm_89 or later: emulated)'}")
    else:
        lines.append("GPU: none (CPU: FP8 GEMMs run through torch._scaled_mm's CPU kernel)")
    lines.append(f"Triton: {_version('triton') or 'not installed (plain-torch kernels)'}")
    dot = shutil.which("dot")
    lines.append(f"graphviz: python package {_version('graphviz') or 'missing'}, dot "
                 f"{'at ' + dot if dot else 'not on PATH (plans render as DOT source only)'}")
    return "\n".join(lines)


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def bench(argv: Sequence[str]) -> int:
    """Run benchmarks/zoo.py (the repository's) with ``argv``; needs a GPU."""
    if not torch.cuda.is_available():
        print("fusible bench: the zoo measures GPU kernels; no GPU here", file=sys.stderr)
        return 2
    zoo = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "zoo.py"
    if not zoo.exists():
        print(f"fusible bench: {zoo} not found (the benchmarks ship with the repository, "
              f"not the wheel)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(zoo), *argv])


if __name__ == "__main__":
    sys.exit(main())
