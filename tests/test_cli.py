"""The ``fusible`` command: plan, doctor, bench."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

import fusible
from fusible import cli

MODELS = pathlib.Path(__file__).parent / "whole_models.py"


def test_plan_prints_the_model_plan_and_writes_the_diagram(tmp_path, capsys):
    out = tmp_path / "gpt"
    assert cli.main(["plan", f"{MODELS}:FusibleGPT", "--input-shape", "2,16", "--tokens", "64",
                     "--diagram", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ModelPlan: 7 fusible groups" in text
    assert "layers.0-1: identical plans, shown once" in text
    written = next(tmp_path.glob("gpt.*"))
    assert written.suffix in (".svg", ".dot") and written.stat().st_size > 0


def test_plan_of_a_sequential_under_fp8(tmp_path, capsys):
    factory = tmp_path / "mlp.py"
    factory.write_text("from fusible import ops\n"
                       "def mlp():\n"
                       "    return ops.Sequential(ops.Linear(32, 64), ops.GELU(),"
                       " ops.Linear(64, 32))\n")
    assert cli.main(["plan", f"{factory}:mlp", "--input-shape", "16,32", "--dtype", "bfloat16",
                     "--fp8", "--diagram", str(tmp_path / "p")]) == 0
    assert "2 FP8 GEMMs" in capsys.readouterr().out


def test_plan_names_a_bad_factory():
    with pytest.raises(SystemExit, match="has no callable 'nothing'"):
        cli.main(["plan", f"{MODELS}:nothing", "--input-shape", "2"])
    with pytest.raises(SystemExit, match="expected MODULE:FACTORY"):
        cli.main(["plan", "whole_models", "--input-shape", "2"])


EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "train_mlp.py"


def test_plan_of_the_readme_block_with_factory_arguments(tmp_path, capsys):
    """examples/train_mlp.py:mlp_block takes two arguments and the residual as an extra
    input: the factory's arguments are given, the extra input takes the input's shape."""
    assert cli.main(["plan", f"{EXAMPLE}:mlp_block", "--factory-args", "64, ffn=256",
                     "--input-shape", "32,64", "--diagram", str(tmp_path / "p")]) == 0
    text = capsys.readouterr().out
    assert "ForwardLinearBiasAdd[4, 5, 6]" in text  # the residual add fused: 1 extra input
    args = ["plan", f"{EXAMPLE}:mlp_block", "--factory-args", "64, 256", "--input-shape",
            "32,64", "--diagram", str(tmp_path / "p")]
    assert cli.main(args + ["--extra-input-shape", "32,64"]) == 0
    capsys.readouterr()
    assert cli.main(args + ["--extra-input-shape", "32,64", "--extra-input-shape", "1"]) == 1
    assert capsys.readouterr().err == ("fusible plan: ValueError: 2 --extra-input-shape given; "
                                       "Sequential takes 1 extra input(s)\n")


PLAIN = """
from torch import nn
def mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), mlp()
    def forward(self, x):
        return x + self.mlp(self.norm(x))
"""


@pytest.mark.parametrize("factory, groups", [("mlp", 1), ("Block", 2)])
def test_a_plain_torch_model_is_planned_with_convert_and_refused_without(factory, groups,
                                                                         tmp_path, capsys):
    (tmp_path / "plain.py").write_text(PLAIN)
    args = ["plan", f"{tmp_path / 'plain.py'}:{factory}", "--input-shape", "4,16",
            "--diagram", str(tmp_path / "p")]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "has no fusible module: add --convert" in err and len(err.splitlines()) == 1
    assert cli.main(args + ["--convert"]) == 0
    assert f"ModelPlan: {groups} fusible groups" in capsys.readouterr().out


def test_plan_errors_are_one_line_unless_asked(tmp_path, capsys):
    args = ["plan", f"{EXAMPLE}:mlp_block", "--input-shape", "32,64", "--diagram",
            str(tmp_path / "p")]
    assert cli.main(args) == 1
    assert capsys.readouterr().err == ("fusible plan: TypeError: mlp_block() missing 2 required "
                                       "positional arguments: 'hidden' and 'ffn'\n")
    with pytest.raises(TypeError, match="missing 2 required positional arguments"):
        cli.main(args + ["--traceback"])
    assert cli.main(args + ["--factory-args", "64,"]) == 1  # one argument short
    assert "missing 1 required positional argument: 'ffn'" in capsys.readouterr().err
    assert cli.main(args + ["--factory-args", "64, 256", "--input-shape", "32,63"]) == 1
    assert capsys.readouterr().err == (
        "fusible plan: ValueError: LayerNorm(normalized_shape=(64,)) got input of shape "
        "(32, 63); its trailing dimensions must be (64,)\n")
    assert cli.main(args + ["--factory-args", "hidden=sixty"]) == 1
    assert "--factory-args must be Python literals" in capsys.readouterr().err


def test_doctor_reports_the_environment(capsys):
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert f"torch {torch.__version__}" in text and "graphviz" in text and "Triton" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_bench_needs_a_gpu(capsys):
    assert cli.main(["bench"]) == 2
    assert "no GPU here" in capsys.readouterr().err


def test_the_installed_command_runs():
    exe = pathlib.Path(sys.executable).parent / "fusible"
    if not exe.exists():
        pytest.skip("the console script is installed by pip install -e .")
    result = subprocess.run([str(exe), "doctor"], capture_output=True, text=True, check=True)
    assert f"fusible {fusible.__version__}" in result.stdout


def test_the_version_is_semantic_and_one():
    pyproject = (pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert f'version = "{fusible.__version__}"' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", fusible.__version__)
    changelog = (pathlib.Path(__file__).parent.parent / "CHANGELOG.md").read_text()
    assert f"## {fusible.__version__}" in changelog


@pytest.mark.parametrize("graphviz", [True, False], ids=["dot", "no dot"])
def test_the_main_example_runs_with_and_without_graphviz(graphviz, tmp_path, monkeypatch,
                                                         capsys):
    """Without graphviz's dot (no apt-get, no root) the example writes the DOT source,
    says so, and trains; it never stops at the diagram."""
    import shutil

    import train_mlp  # examples/ is on the path (conftest)
    if graphviz and shutil.which("dot") is None:
        pytest.skip("graphviz binary not installed")
    if not graphviz:
        monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["train_mlp.py", "--steps", "20", "--tokens", "64",
                                      "--plan", str(tmp_path / "plan"), "--device", "cpu"])
    train_mlp.main()
    text = capsys.readouterr().out
    suffix = ".svg" if graphviz else ".dot"
    assert f"plan diagram: {tmp_path / 'plan'}{suffix}" in text
    assert ("DOT source" in text) != graphviz
    assert (tmp_path / f"plan{suffix}").stat().st_size > 0
    first, last = map(float, re.search(r"loss: ([\d.]+) at the first step, ([\d.]+)",
                                       text).groups())
    assert last < first


def test_plan_of_a_hugging_face_model_shows_its_fused_layers(tmp_path, capsys):
    """`fusible plan --convert` on a transformers model: each decoder layer one
    TransformerLayer group (a training call builds no KV cache, which would send the
    layers to their original code), the report's plain-calls entry."""
    pytest.importorskip("transformers")
    factory = tmp_path / "hf_llama.py"
    factory.write_text(
        "import transformers\n"
        "def llama():\n"
        "    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32,\n"
        "        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,\n"
        "        num_key_value_heads=2)\n"
        "    config._attn_implementation = 'sdpa'\n"
        "    return transformers.AutoModelForCausalLM.from_config(config)\n")
    assert cli.main(["plan", f"{factory}:llama", "--convert", "--input-shape", "2,16",
                     "--tokens", "96", "--diagram", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    assert "plain calls marked" in out
    assert "model.layers.0-1: identical plans, shown once" in out
    assert "(the block): TransformerLayer, 12 ops" in out
