"""A mixture-of-experts feed-forward layer: a router picks ``k`` of ``E`` SwiGLU experts per
token; the experts run as two GroupedLinear ops over the tokens sorted by expert.

It checks itself against the same layer written as a loop over ``nn.Linear`` experts (the
same weights, converted with ``GroupedLinear.to_linears``), trains a few steps eagerly and
compiled (one compilation, whatever the routing), then a few with FP8 grouped GEMMs
(``fusible.autocast()``; each expert's rows padded to a multiple of 16, as their weight
gradients need):

    python examples/moe.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import fusible
from fusible import moe, ops


class MoEFeedForward(nn.Module):
    """``sum_j w_j * expert_j(x)`` over each token's top-``k`` experts."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int, align: int = 1):
        super().__init__()
        self.k, self.num_experts, self.align = k, num_experts, align
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ops.Sequential(ops.GroupedLinear(num_experts, hidden, 2 * ffn),
                                      ops.SwiGLU(),
                                      ops.GroupedLinear(num_experts, ffn, hidden))

    def forward(self, x):
        experts, weights = moe.route_top_k(self.router(x), self.k)
        copies, routing = moe.permute_tokens(x, experts, self.num_experts, align=self.align)
        y = self.experts(copies, routing.splits, routing.splits)  # each GroupedLinear's
        return moe.unpermute_tokens(y, routing, weights)


def loop_reference(layer: MoEFeedForward, x):
    """The same layer as a loop over nn.Linear experts."""
    w13 = layer.experts[0].to_linears()
    w2 = layer.experts[2].to_linears()
    experts, weights = moe.route_top_k(layer.router(x), layer.k)
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        if token.numel():
            gate, up = w13[e](x[token]).chunk(2, -1)
            out.index_add_(0, token, weights[token, slot, None] * w2[e](F.silu(gate) * up))
    return out


def main() -> None:
    torch.manual_seed(0)
    layer = MoEFeedForward(hidden=64, ffn=96, num_experts=8, k=2)
    x = torch.randn(256, 64)
    y, want = layer(x), loop_reference(layer, x)
    print(f"largest difference from the loop over experts: {(y - want).abs().max():.2e}")
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5)

    target = torch.randn(256, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=3e-3)
    for step in range(30):
        run = compiled if step % 2 else layer  # eager and compiled steps alike
        loss = F.mse_loss(run(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == 29:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"graphs compiled over 15 compiled steps with changing routings: {graphs}")
    print(fusible.compile_report(layer, x))

    layer.align = 16  # FP8 weight gradients need every expert's rows a multiple of 16
    for step in range(5):
        with fusible.autocast():  # FP8 grouped GEMMs, E4M3, a scale per expert weight
            loss = F.mse_loss(layer(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(f"after 5 FP8 steps  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
