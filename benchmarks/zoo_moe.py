"""GPU: mixture-of-experts layers at real sizes, fusible's GroupedLinear against a loop over
experts, ``torch._grouped_mm`` used directly and torchao's FP8 grouped GEMMs.

Every row is the same layer (router, top-k, tokens sorted by expert with
``fusible.moe``, each expert's rows padded to a multiple of 16 as FP8 grouped GEMMs
need, SwiGLU experts, weighted combine), fwd+bwd as ``gpu_mlp.measure`` times
it; the rows differ only in how the experts run:

- ``torch_loop``: one ``F.linear`` per expert on its slice (the sizes read on the host),
  eager, bf16;
- ``grouped_mm_eager`` / ``_compile``: ``torch._grouped_mm`` written by hand, bf16;
- ``torchao_fp8_rowwise``: the same with torchao's
  ``_to_fp8_rowwise_then_scaled_grouped_mm`` (rowwise FP8), compiled, where its wheel
  imports;
- ``fusible_bf16_eager`` / ``_compile``, ``fusible_fp8_eager`` / ``_compile``:
  ``ops.Sequential(GroupedLinear, SwiGLU, GroupedLinear)``, FP8 under
  ``fusible.autocast()`` with every GEMM in FP8 (``gemm_policy=None``: the default
  policy keeps the DeepSeek-like experts in bf16);
- on request (``--rows``), ``fusible_scaled_{bf16,fp8}_{eager,compile}``: the router's
  weights applied inside the experts by ``ScaledSwiGLU`` (``moe.sorted_weights``), the
  combine an unweighted sum; ``fusible_fp8_triton_{eager,compile}``: FP8 through fusible's
  Triton grouped GEMMs instead of ``torch._scaled_grouped_mm``.

Layers: DeepSeek-V3-like (64 experts of FF=2048, H=4096, top-6) and Mixtral-like
(8 experts of FF=14336, top-2), 8192 tokens. Results go to a JSON file row by row.

    python benchmarks/zoo_moe.py --output benchmarks/results/zoo_moe_h200.json
"""

import argparse
import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

import fusible
from fusible import moe, ops
from fusible.functional import grouped_fp8
from gpu_mlp import make_step, measure_rows, prepare, profile_step

# (name, hidden, ffn per expert, experts, top-k, tokens)
CONFIGS = [("deepseek_v3_like", 4096, 2048, 64, 6, 8192),
           ("mixtral_like", 4096, 14336, 8, 2, 8192)]
ROWS = ("torch_loop", "grouped_mm_eager", "grouped_mm_compile", "torchao_fp8_rowwise",
        "fusible_bf16_eager", "fusible_bf16_compile", "fusible_fp8_eager",
        "fusible_fp8_compile")


class LoopExperts(nn.Module):
    """One ``F.linear`` per expert on its tokens: the baseline every MoE codebase starts
    from (the sizes read on the host)."""

    def __init__(self, w13, w2):
        super().__init__()
        self.w13, self.w2 = w13, w2

    def forward(self, x, splits):
        out, start = [], 0
        for e, size in enumerate(splits.tolist()):
            a, b = F.linear(x[start:start + size], self.w13[e]).chunk(2, -1)
            out.append(F.linear(F.silu(a) * b, self.w2[e]))
            start += size
        return torch.cat(out)


class GroupedMMExperts(LoopExperts):
    """``torch._grouped_mm`` by hand (``gemm`` may be torchao's FP8 one, same layout)."""

    def __init__(self, w13, w2, gemm=None):
        super().__init__(w13, w2)
        self.gemm = gemm or (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))

    def forward(self, x, splits):
        offs = torch.cumsum(splits, 0, dtype=torch.int32)
        a, b = self.gemm(x, self.w13.transpose(-2, -1), offs).chunk(2, -1)
        return self.gemm(F.silu(a) * b, self.w2.transpose(-2, -1), offs)


class FusibleExperts(nn.Module):
    scaled = False

    def __init__(self, w13, w2):
        super().__init__()
        e, ff2, h = w13.shape
        gate = ops.ScaledSwiGLU() if self.scaled else ops.SwiGLU()
        self.seq = ops.Sequential(ops.GroupedLinear(e, h, ff2), gate,
                                  ops.GroupedLinear(e, ff2 // 2, h))
        self.seq[0].weight, self.seq[2].weight = w13, w2

    def forward(self, x, splits, scales=None):
        if self.scaled:
            return self.seq(x, splits, scales, splits)
        return self.seq(x, splits, splits)


class ScaledFusibleExperts(FusibleExperts):
    """The router's weights applied inside the experts (ScaledSwiGLU)."""

    scaled = True


class MoELayer(nn.Module):
    def __init__(self, router, experts, k):
        super().__init__()
        self.router, self.experts, self.k = router, experts, k

    def forward(self, x):
        experts, weights = moe.route_top_k(self.router(x), self.k)
        copies, routing = moe.permute_tokens(x, experts, self.router.out_features, align=16)
        if getattr(self.experts, "scaled", False):
            scales = moe.sorted_weights(weights, routing)
            return moe.unpermute_tokens(self.experts(copies, routing.splits, scales), routing)
        return moe.unpermute_tokens(self.experts(copies, routing.splits), routing, weights)


def build_row(row: str, hidden: int, ffn: int, num_experts: int, k: int) -> tuple:
    """``(layer, mode, context)``: every row on the same weights (seed 0)."""
    torch.manual_seed(0)
    grouped_fp8.HOPPER_KERNEL = "triton" if "_triton_" in row else "torch"
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    router = nn.Linear(hidden, num_experts, bias=False, **kw)
    w13 = nn.Parameter(torch.randn(num_experts, 2 * ffn, hidden, **kw) * hidden ** -0.5)
    w2 = nn.Parameter(torch.randn(num_experts, hidden, ffn, **kw) * ffn ** -0.5)
    mode = "eager" if row.endswith(("eager", "loop")) else "compile"
    context = functools.partial(fusible.autocast, recipe=fusible.Float8CurrentScaling(
        gemm_policy=None)) if "_fp8_" in row and row.startswith("fusible") \
        else contextlib.nullcontext
    if row == "torch_loop":
        experts = LoopExperts(w13, w2)
    elif row.startswith("grouped_mm"):
        experts = GroupedMMExperts(w13, w2)
    elif row == "torchao_fp8_rowwise":
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
        experts = GroupedMMExperts(w13, w2, lambda a, b, offs: (
            _to_fp8_rowwise_then_scaled_grouped_mm(a, b, offs,
                                                   pad_token_groups_for_grouped_mm=False)))
    elif "_scaled_" in row:
        experts = ScaledFusibleExperts(w13, w2)
    else:
        experts = FusibleExperts(w13, w2)
    return MoELayer(router, experts, k), mode, context


def run_config(config: tuple, rows, results: dict, output: str) -> None:
    name, hidden, ffn, num_experts, k, tokens = config
    measure_rows(f"{name}_H{hidden}_FF{ffn}_E{num_experts}_top{k}_T{tokens}", rows,
                 lambda row: build_row(row, hidden, ffn, num_experts, k),
                 (tokens, hidden, ffn),
                 6 * 3 * hidden * ffn * tokens * k,  # the experts' GEMMs, fwd+bwd
                 results, output)


def profile(config: tuple, rows, path: str) -> None:
    """Append the kernels of three steps of each row, by GPU time, to ``path`` (a row that
    cannot run is reported; the measurements go on)."""
    name, hidden, ffn, num_experts, k, tokens = config
    for row in rows:
        try:
            torch._dynamo.reset()
            layer, mode, context = build_row(row, hidden, ffn, num_experts, k)
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            step = make_step(prepare(layer, mode), list(layer.parameters()), x, dy, context)
            profile_step(step, f"{row} {config}", path)
        except Exception as error:
            print("profile of", row, "failed:", repr(error)[:300], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/zoo_moe.json")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--profile", help="first write kernel profiles of fusible's eager "
                        "rows here")
    parser.add_argument("--configs", default="0,1",
                        help="which of CONFIGS to measure, by index (empty: none)")
    parser.add_argument("--profile-configs", default="0",
                        help="which of CONFIGS --profile profiles, by index")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    rows = args.rows.split(",")
    if args.profile:
        for index in _indices(args.profile_configs):
            profile(CONFIGS[index], [r for r in rows if r.startswith("fusible") and "eager" in r],
                    args.profile)
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for index in _indices(args.configs):
        run_config(CONFIGS[index], rows, results, args.output)


def _indices(text: str) -> list:
    return [int(i) for i in text.split(",") if i]

if __name__ == "__main__":
    main()
