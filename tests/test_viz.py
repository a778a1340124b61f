"""Plans you can see: explain(), to_dot() and render()."""

import shutil

import pytest
import torch
from torch import nn

from fusible import ops


def _block():
    return ops.Sequential(ops.MakeExtraOutput(), ops.LayerNorm(16), ops.Linear(16, 64),
                          ops.GELU(approximate="tanh"), ops.Linear(64, 16), nn.Dropout(0.0),
                          ops.AddExtraInput())


def test_explain_lists_stages_and_every_match():
    text = _block().plan().explain()
    assert "forward (" in text and "backward (" in text
    assert "ForwardLinearBias" in text and "BackwardActivationBias" in text
    assert "ForwardLinearBiasActivation" in text and "refused:" in text
    assert "BasicLinear(in_features=16, out_features=64)" in text


def test_dot_has_lanes_clusters_nodes_and_refusals():
    dot = _block().plan().to_dot()
    assert dot.startswith("digraph FusionPlan {") and dot.rstrip().endswith("}")
    assert "subgraph cluster_forward" in dot and "subgraph cluster_backward" in dot
    assert 'label="ForwardLinearBias"' in dot and 'label="BackwardActivationBias"' in dot
    assert "16 \u2192 64" in dot and "normalized_shape=(16,)" in dot
    assert "Dropout\\n(torch module)" in dot and "shape=box3d" in dot
    assert "ForwardLinearBiasActivation refused" in dot and "shape=note" in dot
    for i in range(1, 9):                   # ops with a backward: in both lanes, aligned
        assert f"{{rank=same; f{i}; b{i};}}" in dot
    assert "b0 [" not in dot                # MakeExtraOutput's input needs no gradient


def test_inference_plan_has_one_lane():
    with torch.no_grad():
        dot = _block().plan().to_dot()
    assert "cluster_forward" in dot and "cluster_backward" not in dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz binary not installed")
@pytest.mark.parametrize("fmt,magic", [("svg", b"<?xml"), ("png", b"\x89PNG"), ("pdf", b"%PDF")])
def test_render_writes_the_picture(tmp_path, fmt, magic):
    path = _block().plan().render(str(tmp_path / "plan"), format=fmt)
    assert path == str(tmp_path / f"plan.{fmt}")
    with open(path, "rb") as f:
        assert f.read(5).startswith(magic)
    assert not (tmp_path / "plan").exists()  # the DOT source is cleaned up


def test_render_errors(monkeypatch, tmp_path):
    plan = _block().plan()
    with pytest.raises(ValueError, match="format must be one of"):
        plan.render(str(tmp_path / "p"), format="jpg")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs the graphviz 'dot' binary"):
        plan.render(str(tmp_path / "p"))
    assert not (tmp_path / "p.dot").exists()


def test_render_without_graphviz_writes_the_dot_source_when_asked(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    plan = _block().plan()
    path = plan.render(str(tmp_path / "p.svg"), dot_source_without_graphviz=True)
    assert path == str(tmp_path / "p.dot")
    assert (tmp_path / "p.dot").read_text() == plan.to_dot()
