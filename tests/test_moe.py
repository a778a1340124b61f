"""Token routing (fusible.moe) and the MoE layer of examples/moe.py built on GroupedLinear."""

import importlib.util
import pathlib

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fusible import moe

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "moe.py"
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_route_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    experts, weights = moe.route_top_k(logits, 2)
    assert experts.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    p = torch.softmax(logits[0], -1)
    torch.testing.assert_close(weights[0], p[[1, 2]] / p[[1, 2]].sum())
    _, raw = moe.route_top_k(logits, 2, normalize=False)
    torch.testing.assert_close(raw[0], p[[1, 2]])
    with pytest.raises(ValueError, match=r"k must be in 1..4 \(the experts\), got 5"):
        moe.route_top_k(logits, 5)


def test_permute_sorts_copies_by_expert_stably_and_unpermute_combines():
    x = torch.arange(5.0).unsqueeze(1).repeat(1, 3)  # row t holds t
    experts = torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2], [3, 0]])
    copies, routing = moe.permute_tokens(x, experts, 5)
    assert routing.splits.tolist() == [4, 0, 3, 3, 0]  # an expert without tokens
    assert copies[:, 0].tolist() == [0, 1, 3, 4, 0, 2, 3, 1, 2, 4]  # tokens in order
    weights = torch.tensor([[0.25, 0.75]] * 5)
    torch.testing.assert_close(moe.unpermute_tokens(copies, routing, weights), x)
    y = copies * 2  # an expert that doubles: the weighted sum doubles
    torch.testing.assert_close(moe.unpermute_tokens(y, routing, weights), 2 * x)


def test_permute_refuses_a_wrong_expert_index():
    with pytest.raises(RuntimeError, match=r"expert indices must be in 0..3"):
        moe.permute_tokens(torch.randn(2, 4), torch.tensor([[0], [4]]), 4)
    with pytest.raises(ValueError, match=r"must be \(tokens, k\) = \(2, k\)"):
        moe.permute_tokens(torch.randn(2, 4), torch.tensor([0, 1]), 4)


def test_moe_layer_matches_the_loop_over_experts_with_gradients(example):
    torch.manual_seed(0)
    layer = example.MoEFeedForward(hidden=32, ffn=48, num_experts=6, k=2).double()
    x = torch.randn(40, 32, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, want = layer(x), example.loop_reference(layer, x_ref)
    torch.testing.assert_close(y, want)
    dy = torch.randn_like(y)
    y.backward(dy)
    router_grad = layer.router.weight.grad.clone()
    layer.zero_grad()
    want.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(router_grad, layer.router.weight.grad)


def test_moe_layer_compiles_once_for_changing_routings(example):
    torch.manual_seed(0)
    layer = example.MoEFeedForward(hidden=32, ffn=48, num_experts=6, k=2)
    counter = CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for seed in range(3):
        x = torch.randn(40, 32, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_capacity_gives_static_rows_and_drops_the_overflow():
    x = torch.arange(1.0, 7.0).unsqueeze(1).repeat(1, 2)  # row t holds t + 1
    experts = torch.tensor([[0], [0], [0], [1], [2], [2]])  # expert 0 overloaded
    rows, routing = moe.permute_tokens(x, experts, 3, capacity_factor=1.0)  # capacity 2
    assert routing.capacity == 2 and routing.splits.tolist() == [2, 2, 2]
    assert rows[:, 0].tolist() == [1, 2, 4, 0, 5, 6]  # token 3 dropped, a zero row
    weights = torch.ones(6, 1)
    out = moe.unpermute_tokens(rows * 10, routing, weights)
    assert out[:, 0].tolist() == [10, 20, 0, 40, 50, 60]  # the dropped one gets nothing
    scales = moe.sorted_weights(torch.arange(1.0, 7.0).unsqueeze(1), routing)
    assert scales.tolist() == [1, 2, 4, 0, 5, 6]
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        moe.permute_tokens(x, experts, 3, capacity_factor=0.0)


def test_capacity_rounds_a_fractional_share_up():
    """The documented ``ceil``: 7 copies over 3 experts at factor 1.0 give 3 rows each, not 2
    (rounding down would drop a routed copy even when the routing is balanced)."""
    experts = torch.tensor([[0], [0], [0], [1], [1], [2], [2]])
    rows, routing = moe.permute_tokens(torch.randn(7, 2), experts, 3, capacity_factor=1.0)
    assert routing.capacity == 3 and rows.shape == (9, 2)
    assert bool((routing.slot < routing.rows).all())  # nothing dropped


def test_capacity_gradients_and_compiled_once(example):
    """The dropped copies get no gradient; compiled, one graph for changing routings (the
    rows' count is static)."""
    torch.manual_seed(0)
    experts_op = example.MoEFeedForward(hidden=16, ffn=32, num_experts=4, k=2).experts

    def layer(x, logits):
        experts, weights = moe.route_top_k(logits, 2)
        rows, routing = moe.permute_tokens(x, experts, 4, capacity_factor=0.5)
        y = experts_op(rows, routing.splits, routing.splits)
        return moe.unpermute_tokens(y, routing, weights)

    counter = CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(24, 16, generator=gen, requires_grad=True)
        logits = torch.randn(24, 4, generator=gen)
        y = compiled(x, logits)
        torch.testing.assert_close(y, layer(x, logits), rtol=0, atol=0)
        y.sum().backward()
        dropped = (y == 0).all(-1)  # tokens whose copies were all dropped
        assert not x.grad[dropped].any()
    assert counter.frame_count == 1


def test_align_pads_every_expert_to_a_multiple_and_changes_no_result():
    """Each expert's rows padded with zeros to a multiple of 4; the static row count
    ``round_up(tokens * k + experts * 3, 4)``, the spare rows the last expert's; the
    combined result, its gradients and the scales as without padding."""
    torch.manual_seed(0)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    experts = torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2], [3, 0], [0, 1], [2, 0]])
    weights = torch.rand(7, 2, dtype=torch.float64)
    rows, routing = moe.permute_tokens(x, experts, 5, align=4)
    assert rows.shape == (32, 3) and routing.rows == 32  # round_up(14 + 5 * 3, 4)
    # counts 6, 1, 4, 3, 0 padded to 8, 4, 4, 4, 0; the last expert takes the 12 spare
    assert routing.splits.tolist() == [8, 4, 4, 4, 12]
    copies, plain = moe.permute_tokens(x, experts, 5)
    kept = torch.zeros(32, dtype=torch.bool)
    kept[routing.slot] = True
    assert not rows[~kept].any()  # the padding rows are zeros
    out = moe.unpermute_tokens(rows * 3, routing, weights)
    torch.testing.assert_close(out, moe.unpermute_tokens(copies * 3, plain, weights),
                               rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 3 * weights.sum(-1, keepdim=True).expand(7, 3))
    scales = moe.sorted_weights(weights, routing)
    assert torch.equal(scales[routing.slot], moe.sorted_weights(weights, plain))
    assert not scales[~kept].any()
    _, both = moe.permute_tokens(x, experts, 5, capacity_factor=1.0, align=4)
    assert both.capacity == 4 and both.splits.tolist() == [4] * 5  # ceil(2.8) = 3 -> 4
    with pytest.raises(ValueError, match="align must be a positive int, got 0"):
        moe.permute_tokens(x, experts, 5, align=0)


def test_capacity_below_one_with_drops_back_propagates():
    """A capacity under the tokens' copies (experts' rows left empty while copies are
    dropped): the gradient reaches the kept copies only."""
    x = torch.randn(5, 4, requires_grad=True)
    rows, routing = moe.permute_tokens(x, torch.zeros(5, 1, dtype=torch.long), 2,
                                       capacity_factor=0.8)  # capacity 2: three dropped
    assert routing.capacity == 2
    out = moe.unpermute_tokens(rows * 2, routing, torch.ones(5, 1))
    out.sum().backward()
    assert x.grad[:2].eq(2).all() and not x.grad[2:].any()


def test_combine_keeps_the_rows_only_for_the_weights_gradient():
    """The experts' output is saved for the router weights' gradient alone: not when the
    weights need none, nor without weights (a scaled unit applied them)."""
    x = torch.randn(6, 4, requires_grad=True)
    experts = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    rows, routing = moe.permute_tokens(x, experts, 3)
    y = rows * 2
    for weights, kept in ((torch.rand(6, 2, requires_grad=True), True),
                          (torch.rand(6, 2), False), (None, False)):
        out = moe.unpermute_tokens(y, routing, weights)
        assert (out.grad_fn.saved_tensors[0] is not None) == kept
        out.sum().backward(retain_graph=True)
        if weights is not None and kept:  # d(sum)/dw[t, j] = sum of copy j's row
            want = y.detach()[routing.copy_row].sum(-1).view(6, 2)
            torch.testing.assert_close(weights.grad, want)


@pytest.mark.parametrize("routing", [{}, {"align": 16}, {"capacity_factor": 1.25}])
def test_a_batch_without_tokens_runs_forward_and_backward(routing):
    """A rank or microbatch may get no token: every expert gets no row (or padding)."""
    x = torch.randn(0, 8, requires_grad=True)
    experts, weights = moe.route_top_k(torch.randn(0, 4), 2)
    rows, plan = moe.permute_tokens(x, experts, 4, **routing)
    assert rows.shape[1] == 8 and int(plan.splits.sum()) == rows.shape[0]
    y = moe.unpermute_tokens(rows * 2, plan, weights)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)


def test_an_infinite_capacity_is_refused_with_the_dropless_choice():
    experts, _ = moe.route_top_k(torch.randn(6, 4), 2)
    with pytest.raises(ValueError, match=r"capacity_factor must be positive and finite "
                                         r"\(None: dropless, every copy kept\), got inf"):
        moe.permute_tokens(torch.randn(6, 8), experts, 4, capacity_factor=float("inf"))
