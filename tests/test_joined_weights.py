"""Joined projections (q/k/v, gate/up) of converted layers: laid end to end once at
conversion, keeping the parameter objects, so that each call joins them as a view (no
copy forward or backward), with torch.cat's values and gradients; a copy where they no
longer lie end to end."""

import copy

import pytest
import torch

import fusible
from fusible.models import joined_weights
from fusible.models.joined_weights import colocate, end_to_end, joined

transformers = pytest.importorskip("transformers")


@pytest.fixture
def views_of_any_size(monkeypatch):
    """These tests' tensors are small: joined as views all the same."""
    monkeypatch.setattr(joined_weights, "VIEW_FROM_BYTES", 0)


def _linears(*rows, bias=False):
    torch.manual_seed(0)
    return [torch.nn.Linear(8, r, bias=bias, dtype=torch.float64) for r in rows]


def test_colocate_keeps_the_parameters_and_their_values():
    modules = _linears(4, 2, 2, bias=True)
    params = [(m.weight, m.weight.detach().clone(), m.bias, m.bias.detach().clone())
              for m in modules]
    colocate(modules)
    for m, (weight, weight_value, bias, bias_value) in zip(modules, params):
        assert m.weight is weight and m.bias is bias
        assert torch.equal(weight, weight_value) and torch.equal(bias, bias_value)
    assert end_to_end([m.weight for m in modules]) and end_to_end([m.bias for m in modules])


def test_joined_is_a_view_with_cats_values_and_gradients(views_of_any_size):
    modules = _linears(4, 2, 2)
    twins = copy.deepcopy(modules)
    colocate(modules)
    weights = [m.weight for m in modules]
    got = joined(weights)
    assert got.data_ptr() == weights[0].data_ptr()  # no copy
    want = torch.cat([m.weight for m in twins])
    assert torch.equal(got, want)
    x = torch.randn(3, 8, dtype=torch.float64)
    (x @ got.t()).square().sum().backward()
    (x @ want.t()).square().sum().backward()
    for m, twin in zip(modules, twins):
        assert torch.equal(m.weight.grad, twin.weight.grad)


def test_weights_not_end_to_end_are_copied(views_of_any_size):
    modules = _linears(4, 2, 2)
    colocate(modules)
    for m in modules:
        m.weight.data = m.weight.data.clone()  # moved, as .to() would
    weights = [m.weight for m in modules]
    assert not end_to_end(weights)
    got = joined(weights)
    assert got.data_ptr() != weights[0].data_ptr()
    assert torch.equal(got, torch.cat(weights))
    assert not end_to_end(weights[::-1])  # out of order


def test_a_converted_llama_joins_its_projections_in_place_and_saves_as_before(tmp_path):
    from test_convert_layers import _model
    model = _model("llama")
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    fusible.convert(model)
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    assert list(model.state_dict()) == keys
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert end_to_end([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert end_to_end([mlp.gate_proj.weight, mlp.up_proj.weight])
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, before[name][1]), name


def test_a_weight_changed_in_place_before_the_backward_raises(views_of_any_size):
    """Any joined parameter changed in place between the forward and the backward is an
    error, as it is for the copy torch.cat would have made (not only the first one's,
    whose version counter the view shares)."""
    modules = _linears(4, 2, 2)
    colocate(modules)
    x = torch.randn(3, 8, dtype=torch.float64)
    y = (x @ joined([m.weight for m in modules]).t()).square().sum()
    with torch.no_grad():
        modules[1].weight.mul_(10)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_small_joins_are_copies():
    """Below VIEW_FROM_BYTES a join is torch.cat (the view's Python autograd node costs
    more host time than the copy): same values and gradients."""
    modules = _linears(4, 2, 2)
    colocate(modules)
    weights = [m.weight for m in modules]
    assert end_to_end(weights)
    got = joined(weights)
    assert got.data_ptr() != weights[0].data_ptr()
    assert got.grad_fn.name() == "CatBackward0"
    assert torch.equal(got, torch.cat([w.detach() for w in weights]))


def test_joins_copy_under_functorch_transforms(views_of_any_size):
    """torch.func's wrappers have no storage to read: the join is torch.cat there."""
    modules = _linears(4, 2)
    colocate(modules)
    weights = [m.weight.detach() for m in modules]

    def loss(w0):
        return (joined([w0, weights[1]]) ** 2).sum()
    torch.testing.assert_close(torch.func.grad(loss)(weights[0]), 2 * weights[0])


@pytest.mark.parametrize("large", [True, False], ids=["large", "small"])
def test_compiled_joins_are_made_again_in_the_backward_not_kept(large, monkeypatch):
    """Compiled, a join is torch.cat (dynamo reads no addresses); the backward makes a
    large one again from the parameters rather than keeping the copy (at 8B widths, 285 MB
    a layer on the peak): no concatenation among what the forward graph saves. A join
    under VIEW_FROM_BYTES is kept (a few MiB; recomputing it is a kernel more)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from test_convert_layers import _model
    if large:  # the tiny model's joins count as large
        monkeypatch.setattr(joined_weights, "VIEW_FROM_BYTES", 0)
    model = _model("llama")
    fusible.convert(model)
    saved_cats = []

    def forward_graph(gm, example_inputs):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        saved_cats.extend(a for a in output.args[0]
                          if getattr(a, "target", None) is torch.ops.aten.cat.default)
        return gm
    backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda gm, _: gm,
                           partition_fn=min_cut_rematerialization_partition)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # eagerly
    twin_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(lambda: model(input_ids=ids, labels=ids).loss, backend=backend,
                             fullgraph=True)
    compiled().backward()
    assert bool(saved_cats) != large, saved_cats
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, twin_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=name)
