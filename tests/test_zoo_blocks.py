"""The benchmark zoo compares like with like: each fusible block computes what its torch.nn
twin computes (float64, outputs and every gradient), so its timings mean something."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")  # benchmarks/gpu_mlp.py imports triton.testing
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import zoo  # noqa: E402


@pytest.mark.parametrize("name,hidden,size", [("llama_ffn", 64, 96), ("gpt_mlp", 64, 128),
                                              ("attention", 256, 1)])
def test_fusible_twin_computes_the_torch_block(name, hidden, size, monkeypatch):
    monkeypatch.setattr(zoo, "SEQUENCE", 8)
    torch.manual_seed(0)
    ref = zoo.BLOCKS[name][0](hidden, size).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms' ones and zeros would hide a swap
    ours = zoo.fusible_twin(name, ref)
    x = torch.randn(16, hidden, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ref(x), ours(x2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(y2, y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-10, atol=1e-10)
    ref_params = dict(ref.named_parameters())
    assert sorted(ours.ref_names.values()) == sorted(ref_params)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[ours.ref_names[name]].grad, rtol=1e-10,
                                   atol=1e-10, msg=name)
