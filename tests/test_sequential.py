"""Sequential behaves like nn.Sequential, flattens, splits and keeps state_dict names."""

import pytest
import torch
from torch import nn

import fusible
from fusible import ops
from fusible.testing import check_against_reference, exact_parameters_, exact_tensor, stage_names


def test_indexing_iteration_len_append():
    a, b, c = ops.BasicLinear(4, 8), ops.GELU(), ops.BasicLinear(8, 4)
    model = ops.Sequential(a, b)
    model.append(c)
    assert len(model) == 3 and list(model) == [a, b, c]
    assert model[0] is a and model[-1] is c
    assert isinstance(model[1:], ops.Sequential) and list(model[1:]) == [b, c]
    with pytest.raises(IndexError, match="index 3 is out of range"):
        model[3]
    del model[1]
    assert list(model) == [a, c] and list(dict(model.named_children())) == ["0", "1"]
    model.insert(1, b)
    assert list(model) == [a, b, c]
    d = ops.ReLU()
    model[1] = d
    assert model[1] is d
    assert stage_names(model.plan().forward) == ["BasicLinear", "ReLU", "BasicLinear"]


def test_pop_add_and_iadd_as_nn_sequential():
    a, b, c = ops.BasicLinear(4, 8), ops.GELU(), ops.BasicLinear(8, 4)
    model = ops.Sequential(a, b, c)
    assert model.pop(1) is b and list(model) == [a, c]
    assert list(dict(model.named_children())) == ["0", "1"]
    assert model.pop() is c and list(model) == [a]
    with pytest.raises(IndexError, match="index 5 is out of range"):
        model.pop(5)
    model = ops.Sequential(a, b, c)
    popped = model.pop(slice(1, 3))
    assert isinstance(popped, ops.Sequential) and list(popped) == [b, c] and list(model) == [a]
    joined = model + popped
    assert isinstance(joined, ops.Sequential) and list(joined) == [a, b, c]
    assert list(model) == [a] and list(popped) == [b, c]  # the operands stay as they were
    assert stage_names(joined.plan().forward) == ["BasicLinear", "GELU", "BasicLinear"]
    same = model
    model += popped
    assert model is same and list(model) == [a, b, c]
    model += model
    assert list(model) == [a, b, c, a, b, c]
    with pytest.raises(ValueError, match=r"Sequential \+ takes a fusible Sequential, got "
                                         r"torch.nn.modules.container.Sequential"):
        model + nn.Sequential(nn.ReLU())
    with pytest.raises(ValueError, match=r"Sequential \+= takes a fusible Sequential, got "
                                         r"builtins.list"):
        model += [ops.ReLU()]


def test_nested_sequentials_flatten_into_one_plan():
    inner = ops.Sequential(ops.Bias(8), ops.ReLU())
    model = ops.Sequential(ops.BasicLinear(4, 8), inner, ops.BasicLinear(8, 2))
    assert len(model.pipeline()) == 4
    with torch.no_grad():
        plan = model.plan()
    assert [(s.name, s.indices) for s in plan.forward] == [
        ("ForwardLinearBiasActivation", (0, 1, 2)), ("BasicLinear", (3,))]
    assert list(model.state_dict()) == ["0.weight", "1.0.bias", "2.weight"]
    inner.append(ops.Identity())  # mutating the inner Sequential re-plans the outer one
    assert len(model.pipeline()) == 5


def test_ordinary_module_splits_the_pipeline(dtype):
    model = exact_parameters_(ops.Sequential(ops.BasicLinear(4, 8), nn.Identity(), ops.Bias(8),
                                             ops.GELU()).to(dtype))
    x = exact_tensor((3, 4), dtype).requires_grad_()
    plan = model.plan(x)
    assert [(s.name, s.indices) for s in plan.forward] == [
        ("BasicLinear", (0,)), ("Identity", (1,)), ("Bias", (2,)), ("GELU", (3,))]
    assert plan.forward[1].is_module
    assert [s.indices for s in plan.backward] == [(2, 3), (1,), (0,)]
    check_against_reference(model, x)


def test_ordinary_module_between_extra_io():
    model = ops.Sequential(ops.MakeExtraOutput(), nn.Tanh(), ops.AddExtraInput(),
                           ops.MakeExtraOutput())
    x, r = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    y, b1, b2 = model(x, r)
    torch.testing.assert_close(y, torch.tanh(x) + r)
    (y.sum() + 2 * b1.sum() + 3 * b2.sum()).backward()
    torch.testing.assert_close(r.grad, torch.full((3, 4), 4.0))
    torch.testing.assert_close(x.grad, 4 * (1 - torch.tanh(x) ** 2) + 2)


def test_state_dict_names_and_round_trip():
    model = ops.Sequential(ops.LayerNorm(4), ops.Linear(4, 8), ops.GELU(), ops.Linear(8, 4),
                           ops.RMSNorm(4))
    names = list(model.state_dict())
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias",
                     "4.weight"]
    clone = ops.Sequential(ops.LayerNorm(4), ops.Linear(4, 8), ops.GELU(), ops.Linear(8, 4),
                           ops.RMSNorm(4))
    clone.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)


def test_load_from_equivalent_torch_model():
    torch_mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    basic = ops.Sequential(ops.BasicLinear(4, 8), ops.Bias(8), ops.GELU(),
                           ops.BasicLinear(8, 4), ops.Bias(4))
    basic.load_state_dict(fusible.state_dict_from_torch(basic, torch_mlp))
    composite = ops.Sequential(ops.Linear(4, 8), ops.GELU(), ops.Linear(8, 4))
    composite.load_state_dict(torch_mlp.state_dict())  # same names as nn.Linear
    x = torch.randn(5, 4, dtype=torch.float32)
    torch.testing.assert_close(basic(x), torch_mlp(x))
    torch.testing.assert_close(composite(x), torch_mlp(x))
    with pytest.raises(ValueError, match="does not pair with"):
        fusible.state_dict_from_torch(basic, nn.Sequential(nn.Linear(4, 9), nn.Linear(9, 4)))


def test_to_dtype_and_replaced_parameters():
    model = ops.Sequential(ops.Linear(4, 8), ops.ReLU())
    x = torch.randn(2, 4)
    y32 = model(x)
    model.to(torch.float64)
    assert model(x.double()).dtype == torch.float64
    model[0].weight = nn.Parameter(torch.zeros(8, 4, dtype=torch.float64))
    torch.testing.assert_close(model(x.double()), torch.relu(model[0].bias).expand(2, 8))
    assert y32.dtype == torch.float32


def test_extra_inputs_and_outputs_shapes():
    model = ops.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(4, 4), ops.AddExtraInput())
    x, r = torch.randn(3, 4), torch.randn(3, 4)
    y, branch = model(x, r)
    torch.testing.assert_close(branch, x, rtol=0, atol=0)
    torch.testing.assert_close(y, x @ model[1].weight.T + r)
    model_no_out = ops.Sequential(ops.BasicLinear(4, 4), ops.AddExtraInput())
    assert isinstance(model_no_out(x, r), torch.Tensor)


def test_same_module_twice_shares_gradients():
    lin = ops.BasicLinear(4, 4)
    model = ops.Sequential(lin, ops.ReLU(), lin)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref = nn.Linear(4, 4, bias=False)
    ref.weight.data.copy_(lin.weight.data)
    ref(torch.relu(ref(x))).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def test_fusion_inside_model_is_rejected():
    from fusible.fusions.forward_linear_bias import ForwardLinearBias
    with pytest.raises(TypeError, match="is a fusion"):
        ops.Sequential(ForwardLinearBias.__new__(ForwardLinearBias))


def test_functional_call_and_to_empty_reach_the_basic_ops():
    model = ops.Sequential(ops.Linear(4, 3), ops.ReLU(), ops.BasicLinear(3, 2))
    x = torch.randn(2, 4)
    params = {"0.weight": torch.zeros(3, 4), "0.bias": torch.ones(3),
              "2.weight": torch.ones(2, 3)}
    out = torch.func.functional_call(model, params, (x,))
    torch.testing.assert_close(out, torch.full((2, 2), 3.0))
    assert not torch.equal(model(x), out)  # the model's own parameters are back
    model.to_empty(device="meta")
    assert model[0]._ops[0].weight.device.type == "meta"


def test_deepcopy_and_pickle_keep_linear_parameters_shared():
    import copy
    import pickle
    model = ops.Sequential(ops.Linear(4, 3), ops.GELU())
    x = torch.randn(2, 4)
    y = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(clone(x), y, rtol=0, atol=0)
        with torch.no_grad():
            clone[0].weight.zero_()
            clone[0].bias.fill_(1.0)
        torch.testing.assert_close(clone(x), torch.nn.functional.gelu(torch.ones(2, 3)))
        torch.testing.assert_close(model(x), y, rtol=0, atol=0)


@pytest.mark.parametrize("edit", ["add_module", "register_module", "del_last", "setattr"])
def test_every_structural_edit_replans(edit):
    model = ops.Sequential(ops.ConstantScale(2.0))
    new = ops.ConstantScale(3.0)  # built first: building an op must not be what re-plans
    x = torch.ones(1, 2)
    torch.testing.assert_close(model(x), 2 * x)
    if edit == "add_module":
        model.add_module("1", new)
        expected = 6 * x
    elif edit == "register_module":
        model.register_module("1", new)
        expected = 6 * x
    elif edit == "setattr":
        setattr(model, "1", new)
        expected = 6 * x
    else:
        del model[0]
        expected = x
    torch.testing.assert_close(model(x), expected)


def test_reference_helper_handles_aliased_inputs_and_module_parameters():
    from fusible.testing import check_against_reference
    model = ops.Sequential(ops.BasicLinear(4, 4), nn.Linear(4, 4), ops.AddExtraInput())
    x = exact_tensor((3, 4)).requires_grad_()
    check_against_reference(model, x, x)   # the README's block(x, x) pattern


def test_dropout_of_zero_is_left_out_so_fusions_cross_it():
    """Dropout(p=0) returns its input and draws nothing (as torch.nn.Dropout(0)): the plan
    leaves it out, so the linear layer's epilogue takes the residual add; a new p replans."""
    torch.manual_seed(0)
    dropout = ops.Dropout(0.0)
    model = ops.Sequential(ops.Linear(8, 8), dropout, ops.AddExtraInput())
    x, residual = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    plan = model.plan(x, residual)
    assert stage_names(plan.forward) == ["ForwardLinearBiasAdd"]
    assert plan.left_out == (dropout,) and "left out (they return their input): " \
        "Dropout(p=0.0)" in plan.explain()
    state = torch.get_rng_state()
    y = model(x, residual)
    assert torch.equal(torch.get_rng_state(), state)  # no mask drawn
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, residual), y)
    torch.testing.assert_close(y, model[0](x) + residual)
    dropout.p = 0.5  # a configuration change: replanned, the mask drawn again
    assert stage_names(model.plan(x, residual).forward) == [
        "ForwardLinearBias", "Dropout", "AddExtraInput"]
    assert (model(x, residual) - residual == 0).any()
    alone = ops.Sequential(ops.Dropout(0.0))  # nothing else: it keeps its own stage
    assert stage_names(alone.plan(x).forward) == ["Dropout"] and not alone.plan(x).left_out
