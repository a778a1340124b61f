"""Whole-model weights between a fusible model and its torch.nn twin, both ways
(``state_dict_from_torch`` / ``state_dict_to_torch``): layers paired in the order they run,
ordinary modules (the embedding) by their tensors, tied weights under every name."""

import copy

import pytest
import torch
from torch import nn

import fusible
from fusible import ops
from whole_models import FusibleGPT, TorchGPT

TOKENS = torch.arange(2 * 16).remainder(64).view(2, 16)


def _twins(**kw):
    torch.manual_seed(0)
    return FusibleGPT(**kw), TorchGPT(head_bias=True, **kw)


def test_a_whole_gpt_loads_its_twins_weights_and_computes_the_same():
    fusible_gpt, torch_gpt = _twins(layers=3)
    state = fusible.state_dict_from_torch(fusible_gpt, torch_gpt, example_input=TOKENS)
    assert state.keys() == fusible_gpt.state_dict().keys()
    fusible_gpt.load_state_dict(state)
    torch.testing.assert_close(fusible_gpt(TOKENS), torch_gpt(TOKENS), rtol=2e-6, atol=2e-6)
    assert fusible_gpt.embed.weight.data_ptr() != torch_gpt.wte.weight.data_ptr()  # copies


def test_and_back_a_fusible_gpts_weights_load_into_its_torch_twin():
    fusible_gpt, torch_gpt = _twins()
    state = fusible.state_dict_to_torch(fusible_gpt, torch_gpt, example_input=TOKENS)
    assert state.keys() == torch_gpt.state_dict().keys()
    torch_gpt.load_state_dict(state)
    torch.testing.assert_close(torch_gpt(TOKENS), fusible_gpt(TOKENS), rtol=2e-6, atol=2e-6)
    for name, value in state.items():  # every tensor is one of the fusible model's
        assert any(torch.equal(value, p) for p in fusible_gpt.state_dict().values()), name


def test_tied_weights_are_given_under_every_name():
    fusible_gpt, torch_gpt = _twins()
    torch_gpt.lm_head.weight = torch_gpt.wte.weight
    fusible_gpt.head[1].weight = fusible_gpt.embed.weight
    state = fusible.state_dict_from_torch(fusible_gpt, torch_gpt, example_input=TOKENS)
    assert torch.equal(state["embed.weight"], state["head.1.weight"])
    fusible_gpt.load_state_dict(state)  # strict: both names present
    torch.testing.assert_close(fusible_gpt(TOKENS), torch_gpt(TOKENS), rtol=2e-6, atol=2e-6)


def test_a_sequential_round_trips():
    torch.manual_seed(0)
    torch_mlp = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model = ops.Sequential(ops.LayerNorm(8), ops.BasicLinear(8, 16), ops.Bias(16), ops.GELU(),
                           ops.BasicLinear(16, 8), ops.Bias(8))
    back = fusible.state_dict_to_torch(model, torch_mlp)
    torch_mlp.load_state_dict(back)
    model.load_state_dict(fusible.state_dict_from_torch(model, torch_mlp))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.values()))
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), torch_mlp(x))


def test_an_ordinary_module_pairs_with_the_same_module_kept_as_it_is():
    """A torch.nn.Linear the fusible model kept as an nn.Linear (inside an ordinary module
    or as a leaf) pairs with it by its tensors."""
    torch.manual_seed(0)
    src = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), ops.Sequential(ops.LayerNorm(8)))
    x = torch.tensor([[1, 2, 3]])
    model.load_state_dict(fusible.state_dict_from_torch(model, src, example_input=x))
    torch.testing.assert_close(model(x), src(x))


def test_whole_models_name_what_does_not_pair():
    fusible_gpt, torch_gpt = _twins()
    with pytest.raises(ValueError, match="FusibleGPT is not a fusible Sequential.*example_input"):
        fusible.state_dict_from_torch(fusible_gpt, nn.Sequential(nn.Linear(32, 32)))
    with pytest.raises(ValueError, match="TorchGPT is not an nn.Sequential.*example_input"):
        fusible.state_dict_from_torch(fusible_gpt, torch_gpt)
    with pytest.raises(ValueError, match=r"Embedding\(65, 32\) does not pair with Embedding "
                                         r"\(an ordinary module\).*\(65, 32\).*\(64, 32\)"):
        fusible.state_dict_from_torch(fusible_gpt, TorchGPT(vocab=65, head_bias=True),
                                      example_input=TOKENS)
    with pytest.raises(ValueError, match=r"LayerNorm\(\(32,\).* has no counterpart: the fusible "
                                         r"model has no more ops"):  # layer 1's first
        fusible.state_dict_from_torch(nn.Sequential(fusible_gpt.embed, fusible_gpt.layers[0]),
                                      torch_gpt, example_input=TOKENS)
    with pytest.raises(ValueError, match="cannot fill GroupedLinear"):
        fusible.state_dict_from_torch(ops.Sequential(ops.GroupedLinear(2, 8, 8)),
                                      nn.Sequential(nn.Linear(8, 8)))


def test_a_converted_model_pairs_with_its_original():
    """fusible.convert's rewrites (a wrapped Linear ending in AddExtraInput, a Dropout(0)
    left out of the plan) pair layer for layer with the original's."""
    torch.manual_seed(0)
    original = TorchGPT()
    model = copy.deepcopy(original)
    fusible.convert(model)
    with torch.no_grad():
        for p in original.parameters():
            p.add_(0.25)  # new weights: the converted model no longer has them
    by_names = copy.deepcopy(model)
    by_names.load_state_dict(original.state_dict())  # convert keeps the names
    model.load_state_dict(fusible.state_dict_from_torch(model, original, example_input=TOKENS))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_names.parameters()))
    assert torch.equal(model(TOKENS), by_names(TOKENS))
    back = fusible.state_dict_to_torch(model, original, example_input=TOKENS)
    assert all(torch.equal(back[k], v) for k, v in original.state_dict().items())
