"""GPU: real transformer blocks at real sizes, fusible against torch.nn and torchao float8.

Each block runs fwd+bwd (input and weights require grad, a fixed output gradient, no
optimizer; the method of ``gpu_mlp.measure``) side by side in one run, as rows:

- ``torch_eager``, ``torch_compile``: the torch.nn twin in bf16;
- ``torchao_tensorwise``, ``torchao_rowwise``: the twin converted by torchao's
  ``convert_to_float8_training``, compiled;
- ``fusible_bf16_eager`` / ``_compile``, ``fusible_fp8_eager`` / ``_compile``: fusible
  Sequentials on the same weights, FP8 under ``fusible.autocast()``;
- ``fusible_rowwise_eager`` / ``_compile``: the same under
  ``fusible.autocast(recipe=fusible.Float8RowwiseScaling())`` (torchao_rowwise's twin),
  ``fusible_blockwise_*`` under ``Float8BlockScaling()`` (DeepSeek-V3's blocks),
  ``fusible_delayed_*`` under ``DelayedScaling()`` (scales from amax histories, which the
  warm-up steps fill); on
  request ``fusible_mxfp8_*`` under ``MXFP8BlockScaling()`` (emulated GEMMs: what the
  emulation costs, not a speed);
- on request (``--rows``), ``fusible_{bf16,fp8}_recompute_{eager,compile}``: the same with
  the norms' ``recompute_output=True`` (the joint fusion RecomputeNormLinear).

Blocks: ``llama_ffn`` (RMSNorm, Linear to 2xFF without bias, SwiGLU, Linear back,
residual) at Llama-3-8B and -70B widths; ``gpt_mlp`` (LayerNorm, Linear+bias,
GELU(tanh), Linear+bias, residual); ``attention`` (RMSNorm and the QKV projection, then
plain ``F.scaled_dot_product_attention`` over 2048-token sequences, then the output
projection with the residual). Results go to a JSON file row by row (a run cut short
keeps what it measured) and, with ``--png``, a chart of each row's time over
torch.compile's.

    python benchmarks/zoo.py --output benchmarks/results/zoo_h200.json --png zoo.png
"""

import argparse
import contextlib
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import fusible
from fusible import ops
from gpu_mlp import make_step, measure_rows, prepare, profile_step

SEQUENCE = 2048  # tokens per sequence in the attention block


class LlamaFFN(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.w13 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        a, b = self.w13(self.norm(x)).chunk(2, -1)
        return x + self.w2(F.silu(a) * b)


class GptMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def _attention(qkv, heads, kv_heads, head_dim):
    """Causal grouped-query attention of (tokens, (heads + 2 kv_heads) * head_dim)."""
    tokens = qkv.shape[0]
    q, k, v = qkv.view(tokens // SEQUENCE, SEQUENCE, heads + 2 * kv_heads, head_dim).split(
        [heads, kv_heads, kv_heads], dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(tokens, heads * head_dim)


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.shape = (heads, kv_heads, hidden // heads)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * hidden // heads, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return x + self.out(_attention(self.qkv(self.norm(x)), *self.shape))


class FusibleBlock(nn.Module):
    """Fusible Sequentials around what stays plain PyTorch, as ``block(x)``."""

    def __init__(self, first, middle=None, last=None):
        super().__init__()
        self.first, self.last, self.middle = first, last, middle

    def forward(self, x):
        if self.last is None:
            return self.first(x, x)
        return self.last(self.middle(self.first(x)), x)


def fusible_twin(name: str, ref: nn.Module) -> nn.Module:
    """The fusible block of ``ref``'s kind on ``ref``'s weights, device and dtype (moved
    first, so the weights load without a round trip through float32)."""
    block, loads = _fusible_block(name, ref)
    weight = ref.norm.weight
    block.to(weight.device, weight.dtype)
    sd = ref.state_dict()
    for seq, names in loads:
        seq.load_state_dict({ours: sd[theirs] for ours, theirs in names.items()})
    # each parameter's name in ref, by its name here (the tests compare their gradients)
    block.ref_names = {f"{attr}.{ours}": theirs for attr in ("first", "last")
                       for seq, names in loads if seq is getattr(block, attr)
                       for ours, theirs in names.items()}
    return block


def _fusible_block(name: str, ref: nn.Module) -> tuple:
    """``(block, [(Sequential, {its parameter: ref's}), ...])``."""
    if name == "llama_ffn":
        hidden, ffn = ref.w2.out_features, ref.w2.in_features
        seq = ops.Sequential(ops.RMSNorm(hidden), ops.BasicLinear(hidden, 2 * ffn), ops.SwiGLU(),
                             ops.BasicLinear(ffn, hidden), ops.AddExtraInput())
        return FusibleBlock(seq), [(seq, {"0.weight": "norm.weight", "1.weight": "w13.weight",
                                          "3.weight": "w2.weight"})]
    if name == "gpt_mlp":
        hidden, ffn = ref.fc2.out_features, ref.fc2.in_features
        seq = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, ffn),
                             ops.GELU(approximate="tanh"), ops.Linear(ffn, hidden),
                             ops.AddExtraInput())
        return FusibleBlock(seq), [(seq, {"0.weight": "norm.weight", "0.bias": "norm.bias",
                                          "1.weight": "fc1.weight", "1.bias": "fc1.bias",
                                          "3.weight": "fc2.weight", "3.bias": "fc2.bias"})]
    hidden, qkv = ref.qkv.in_features, ref.qkv.out_features
    first = ops.Sequential(ops.RMSNorm(hidden), ops.BasicLinear(hidden, qkv))
    last = ops.Sequential(ops.BasicLinear(hidden, hidden), ops.AddExtraInput())
    return FusibleBlock(first, _Attend(ref.shape), last), [
        (first, {"0.weight": "norm.weight", "1.weight": "qkv.weight"}),
        (last, {"0.weight": "out.weight"})]


class _Attend(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, qkv):
        return _attention(qkv, *self.shape)


# name -> (builder of the torch.nn block, GEMM FLOPs of one fwd+bwd step per token)
BLOCKS = {
    "llama_ffn": (lambda h, f: LlamaFFN(h, f), lambda h, f: 6 * 3 * h * f),
    "gpt_mlp": (lambda h, f: GptMLP(h, f), lambda h, f: 6 * 2 * h * f),
    # f: the key/value heads (128-wide heads)
    "attention": (lambda h, f: Attention(h, h // 128, f),
                  lambda h, f: 6 * h * (h + 2 * f * 128 + h)),
}
# (block, hidden, ffn or kv heads, tokens): Llama-3-8B and -70B, a GPT-3 6.7B-like MLP
CONFIGS = [("llama_ffn", 4096, 14336, 8192), ("llama_ffn", 4096, 14336, 2048),
           ("gpt_mlp", 4096, 16384, 16384), ("llama_ffn", 8192, 28672, 8192),
           ("gpt_mlp", 4096, 16384, 2048), ("attention", 4096, 8, 8192),
           ("attention", 4096, 8, 2048), ("llama_ffn", 8192, 28672, 2048)]
ROWS = ("torch_eager", "torch_compile", "torchao_tensorwise", "torchao_rowwise",
        "fusible_bf16_eager", "fusible_bf16_compile", "fusible_fp8_eager",
        "fusible_fp8_compile", "fusible_rowwise_eager", "fusible_rowwise_compile",
        "fusible_blockwise_eager", "fusible_blockwise_compile", "fusible_delayed_eager",
        "fusible_delayed_compile")
RECIPES = {"_fp8_": lambda: fusible.Float8CurrentScaling(),
           "_delayed_": lambda: fusible.DelayedScaling(),
           "_rowwise_": lambda: fusible.Float8RowwiseScaling(),
           "_blockwise_": lambda: fusible.Float8BlockScaling(),
           "_mxfp8_": lambda: fusible.MXFP8BlockScaling()}


def build_row(row: str, name: str, hidden: int, size: int) -> tuple:
    """``(model, mode, context)`` of one row."""
    torch.manual_seed(0)
    ref = BLOCKS[name][0](hidden, size).to("cuda", torch.bfloat16)
    mode = "eager" if row.endswith("eager") else "compile"
    if row.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        recipe = row.split("_")[1]
        return (convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name(recipe)),
                mode, contextlib.nullcontext)
    if row.startswith("torch"):
        return ref, mode, contextlib.nullcontext
    recipe = next((make() for tag, make in RECIPES.items() if tag in row), None)
    context = (contextlib.nullcontext if recipe is None
               else lambda: fusible.autocast(recipe=recipe))
    model = fusible_twin(name, ref)
    if "_recompute_" in row:  # the norms' outputs recomputed (RecomputeNormLinear)
        for m in model.modules():
            if isinstance(m, (ops.RMSNorm, ops.LayerNorm)):
                m.recompute_output = True
    return model, mode, context


def run_config(config: tuple, rows, results: dict, output: str) -> None:
    name, hidden, size, tokens = config
    measure_rows(f"{name}_H{hidden}_{size}_T{tokens}", rows,
                 lambda row: build_row(row, name, hidden, size), (tokens, hidden, size),
                 BLOCKS[name][1](hidden, size) * tokens, results, output)


def profile(config: tuple, rows, path: str) -> None:
    """Append the kernels of three steps of each row, by GPU time, to ``path``."""
    name, hidden, size, tokens = config
    for row in rows:
        torch._dynamo.reset()
        model, mode, context = build_row(row, name, hidden, size)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        step = make_step(prepare(model, mode), list(model.parameters()), x, dy, context)
        profile_step(step, f"{row} {config}", path)
        del model


def draw(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k in results if isinstance(results[k], dict)
            and "ms" in results[k].get("torch_compile", {})]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(keys)), 5))
    width = 0.8 / len(ROWS)
    for i, row in enumerate(ROWS):
        ratios = [results[k][row]["ms"] / results[k]["torch_compile"]["ms"]
                  if "ms" in results[k].get(row, {}) else 0 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], ratios, width, label=row)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 for j in range(len(keys))], keys, rotation=20, fontsize=7)
    ax.set_ylabel("time / torch.compile bf16 (lower is faster)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/zoo.json")
    parser.add_argument("--png")
    parser.add_argument("--configs", type=int, default=len(CONFIGS),
                        help="how many of CONFIGS to run, in order")
    parser.add_argument("--first", type=int, default=0,
                        help="the index in CONFIGS to start from (a run split in two)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--profile", help="first write kernel profiles of fusible's eager "
                        "rows here (bf16 and FP8 of the first config, FP8 of the third)")
    parser.add_argument("--draw", help="only draw --png from this earlier results file")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    if args.draw:
        with open(args.draw) as f:
            return draw(json.load(f), args.png)
    if args.profile and args.first == 0:
        profile(CONFIGS[0], ("fusible_bf16_eager", "fusible_fp8_eager", "fusible_rowwise_eager",
                             "fusible_blockwise_eager", "fusible_delayed_eager"), args.profile)
        profile(CONFIGS[2], ("fusible_fp8_eager",), args.profile)
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for config in CONFIGS[args.first:args.first + args.configs]:
        run_config(config, args.rows.split(","), results, args.output)
    if args.png:
        draw(results, args.png)


if __name__ == "__main__":
    main()
