"""Expert parallelism (run by tests/test_parallel.py on every rank): the experts split over
the ranks, tokens dispatched and combined by AllToAll ops in the plan, against the whole
layer run on this rank's tokens alone."""

import torch
import torch.distributed as dist

import fusible
from fusible import moe, ops
from fusible.testing import exact_tensor, snr_db
from parallel_layers import DEVICE

EXPERTS, HIDDEN, FFN, TOKENS, K = 4, 16, 32, 24, 2


def _experts(num_experts):
    return ops.Sequential(ops.GroupedLinear(num_experts, HIDDEN, 2 * FFN), ops.SwiGLU(),
                          ops.GroupedLinear(num_experts, FFN, HIDDEN))


def _whole_and_parallel(rank, ws, all_to_all, dtype, seed):
    """``(whole layer in FP64, expert-parallel layer in dtype, this rank's experts)``: the
    same exactly representable weights (seed), the parallel layer holding this rank's
    share of the experts between two ``all_to_all`` ops."""
    full = _experts(EXPERTS).to(DEVICE[0], torch.float64)
    local = EXPERTS // ws
    mine = slice(rank * local, (rank + 1) * local)
    ep = ops.Sequential(all_to_all(), ops.PermuteRows(), *_experts(local), ops.PermuteRows(),
                        all_to_all()).to(DEVICE[0], dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (full[0], full[2]):
            layer.weight.copy_(exact_tensor(tuple(layer.weight.shape), torch.float64,
                                            generator=g))
        ep[2].weight.copy_(full[0].weight[mine])
        ep[4].weight.copy_(full[2].weight[mine])
    return full, ep, mine


def _run(layer, x, logits, make_inputs):
    experts, weights = moe.route_top_k(logits, K)
    rows, routing = moe.permute_tokens(x, experts, EXPERTS, align=16)
    y = layer(rows, *make_inputs(routing))
    return moe.unpermute_tokens(y, routing, weights)


def _check_expert_parallel(rank, ws, fp8=False):
    """Outputs and input gradients equal to the whole layer's on this rank's tokens; each
    local expert's weight gradient the sum over the ranks of the whole layer's."""
    dtype = torch.bfloat16 if fp8 else torch.float64
    full, ep, mine = _whole_and_parallel(rank, ws, ops.AllToAll, dtype, 5)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens and routing
    x0 = exact_tensor((TOKENS * (rank + 1), HIDDEN), torch.float64, generator=g)
    logits = torch.randn(x0.shape[0], EXPERTS, generator=g, dtype=torch.float64)
    dy = exact_tensor(tuple(x0.shape), torch.float64, generator=g)
    results = []
    for layer, inputs, run_dtype in (
            (full, lambda r: (r.splits, r.splits), torch.float64),
            (ep, lambda r: moe.expert_parallel(r.splits).inputs(), dtype)):
        x = x0.to(DEVICE[0], run_dtype).clone().requires_grad_()
        with fusible.autocast(enabled=fp8 and layer is ep):
            y = _run(layer, x, logits.to(DEVICE[0], run_dtype), inputs)
        y.backward(dy.to(DEVICE[0], run_dtype))
        first, second = (ep[2], ep[4]) if layer is ep else (full[0], full[2])
        results.append([y, x.grad, first.weight.grad, second.weight.grad])
    (y, dx, dw1, dw2), (ep_y, ep_dx, ep_dw1, ep_dw2) = results
    dw1, dw2 = dw1.clone(), dw2.clone()
    dist.all_reduce(dw1)
    dist.all_reduce(dw2)
    want = [y, dx, dw1[mine], dw2[mine]]
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), [ep_y, ep_dx, ep_dw1, ep_dw2], want):
        if fp8:
            assert snr_db(a, b) > 20, (name, snr_db(a, b))  # E4M3 through two layers
        else:
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")


def _check_expert_parallel_plan(rank, ws):
    """The all-to-alls are collectives of the plan, their stages eager only; compiling
    with fullgraph is an error naming why."""
    ep = ops.Sequential(ops.AllToAll(), ops.PermuteRows(), ops.GroupedLinear(2, 16, 16),
                        ops.PermuteRows(), ops.AllToAll()).to(DEVICE[0])
    rows = torch.randn(16, 16, device=DEVICE[0])
    splits = torch.tensor([16] + [0] * (2 * ws - 1), device=DEVICE[0])
    inputs = moe.expert_parallel(splits).inputs(1)
    text = ep.plan(rows, *inputs).explain()
    assert "EAGER ONLY (its output's row count depends on the routing" in text, text
    if ws > 1:
        assert "AllToAll: all-to-all /2" in text, text
    compiled = torch.compile(ep, backend="aot_eager", fullgraph=True)
    try:
        compiled(rows, *inputs)
    except Exception as error:  # dynamo wraps it
        assert "AllToAll at [0] cannot be compiled: its output's row count" in str(error), \
            error
    else:
        raise AssertionError("a compiled AllToAll ran")


def _check_expert_parallel_capacity(rank, ws):
    """With a capacity: equal all-to-alls (AllToAllEqual), no counts exchanged; the same
    results as the whole layer, and the whole MoE layer compiled in one graph, bit for bit
    eager, without recompiling for a new routing."""
    from torch._dynamo.testing import CompileCounter
    full, ep, mine = _whole_and_parallel(rank, ws, ops.AllToAllEqual, torch.float64, 6)

    def layer(experts_seq, x, logits, parallel):
        chosen, weights = moe.route_top_k(logits, K)
        rows, routing = moe.permute_tokens(x, chosen, EXPERTS, capacity_factor=0.75)
        inputs = (moe.expert_parallel(routing.splits, capacity=routing.capacity).inputs()
                  if parallel else (routing.splits, routing.splits))
        return moe.unpermute_tokens(experts_seq(rows, *inputs), routing, weights)

    counter = CompileCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for step in range(2):  # two routings
        g = torch.Generator().manual_seed(200 + 10 * step + rank)
        x0 = exact_tensor((TOKENS, HIDDEN), torch.float64, generator=g).to(DEVICE[0])
        logits = torch.randn(TOKENS, EXPERTS, generator=g, dtype=torch.float64).to(DEVICE[0])
        results = []
        for run, seq, parallel in ((layer, full, False), (layer, ep, True),
                                   (compiled, ep, True)):
            x = x0.clone().requires_grad_()
            y = run(seq, x, logits, parallel)
            y.backward(torch.ones_like(y))
            first, second = (seq[2], seq[4]) if parallel else (seq[0], seq[2])
            results.append([y, x.grad, first.weight.grad.clone(), second.weight.grad.clone()])
            seq.zero_grad(set_to_none=True)
        (y, dx, dw1, dw2), eager, graph = results
        dist.all_reduce(dw1)
        dist.all_reduce(dw2)
        for name, a, b in zip(("y", "dx", "dw13", "dw2"), eager, (y, dx, dw1[mine], dw2[mine])):
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
        assert all(torch.equal(a, b) for a, b in zip(graph, eager))
    assert counter.frame_count == 1, counter.frame_count
