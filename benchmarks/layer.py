"""GPU: a whole decoder layer and the LM head with its loss, fusible against Hugging Face
and the libraries users reach for, side by side in one run (bf16 and FP8, fwd+bwd).

Layers: transformers' ``LlamaDecoderLayer`` (sdpa attention, its rotary tables made
once outside the step as the model does) eager, under ``torch.compile`` and with
torchao's float8 training (tensorwise) + compile, against ``fusible.layers.TransformerLayer``
on the same weights, eager, compiled and with its forward and backward captured as CUDA
graphs (``fusible.make_graphed_callables``), bf16 and under ``fusible.autocast()`` (its
GEMM policy; the ``fp8delayed`` rows under ``fusible.DelayedScaling()``: one pass per cast),
FlashAttention-2 beside the default cuDNN attention, at
Llama-3-8B widths (2 x 4096 and 1 x 8192 tokens), Llama-3.2-1B widths and torchtitan's
debugmodel shape. LM head: ``F.linear`` +
``F.cross_entropy`` eager and compiled, Liger-Kernel's fused linear cross-entropy (when
installed), ``ops.LinearCrossEntropy`` eager and compiled, at the 8B head (vocab 128256).
Method as ``gpu_mlp.py``: median of ``triton.testing.do_bench``, peak memory of one step;
``rel_err`` compares each row's output with the first row's.

    python benchmarks/layer.py --output benchmarks/results/layer_h200.json \
        --profile benchmarks/results/layer_profile_h200.txt
"""

import argparse
import contextlib
import functools
import re
import gc
import json

import torch
import torch.nn.functional as F
import triton.testing
from torch import nn

import fusible
from fusible import ops
from fusible.layers import TransformerLayer, llama_layer_state_dict
from gpu_mlp import profile_step
from diagnostics.allocator_peak import allocator_peak
from diagnostics.peak_tensors import peak_breakdown

# name: (hidden, ffn, heads, kv heads, batch, seq)
LAYERS = {"llama3_8b": (4096, 14336, 32, 8, 2, 4096),
          "llama3_8b_1x8192": (4096, 14336, 32, 8, 1, 8192),
          "llama3_1b": (2048, 8192, 32, 8, 2, 4096),
          "debugmodel": (256, 768, 16, 16, 8, 2048)}
HEAD = (4096, 128256, 8192)  # hidden, vocab, tokens
THETA = 500000.0
LAYER_ROWS = ["hf_eager", "hf_compile", "torchao_fp8_compile", "fusible_eager",
              "fusible_compile", "fusible_graphed", "fusible_compile_cudagraphs",
              "fusible_flash_eager", "fusible_fp8_eager", "fusible_fp8_compile",
              "fusible_fp8_graphed", "fusible_fp8_compile_cudagraphs", "hf_compile_cudagraphs",
              "torchao_fp8_compile_cudagraphs", "fusible_fp8delayed_eager",
              "fusible_fp8delayed_graphed"]
HEAD_ROWS = ["torch_eager", "torch_compile", "liger_eager", "fusible_eager", "fusible_compile",
             "fusible_c1024_eager", "fusible_c4096_eager", "fusible_fp8_eager",
             "fusible_fp8_compile"]
# rows whose kernels --profile writes out
PROFILED = ("hf_eager", "torchao_fp8_compile", "fusible_eager", "fusible_fp8_eager",
            "fusible_fp8_compile", "torch_compile", "liger_eager")


class HFLayer(nn.Module):
    """A Hugging Face decoder layer called as ``layer(x)``, its rotary tables given."""

    def __init__(self, layer, cos_sin):
        super().__init__()
        self.layer, self.cos_sin = layer, cos_sin

    def forward(self, x):
        return self.layer(x, position_embeddings=self.cos_sin)


def build_layer(row: str, shape: tuple):
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama
    hidden, ffn, heads, kv, batch, seq = shape
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=kv, rope_theta=THETA)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = llama.LlamaDecoderLayer(config, 0).to("cuda", torch.bfloat16)
    if row.startswith(("hf", "torchao")):
        x = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(seq, device="cuda").expand(batch, seq)
        model = HFLayer(hf, llama.LlamaRotaryEmbedding(config).cuda()(x, pos))
        if row.startswith("torchao"):  # torchao's float8 training, tensorwise scaling
            from torchao.float8 import convert_to_float8_training
            convert_to_float8_training(model)
    else:
        backend = {"backend": "flash"} if "flash" in row else {}
        model = TransformerLayer(hidden, ffn, heads, num_kv_heads=kv, rotary_base=THETA,
                                 eps=config.rms_norm_eps, device="cuda", dtype=torch.bfloat16,
                                 **backend)
        model.load_state_dict(llama_layer_state_dict(hf.state_dict()))
        if "graphed" in row:  # forward and backward as CUDA graphs: no host time per op
            sample = torch.zeros(batch, seq, hidden, device="cuda", dtype=torch.bfloat16,
                                 requires_grad=True)
            with _autocast(row)():
                model = fusible.make_graphed_callables(model, (sample,))
    return model


def _autocast(row: str):
    """The context a row runs its steps in: FP8 rows under ``fusible.autocast()``, the
    ``fp8delayed`` ones with delayed scaling (one pass per cast, scales from amax
    histories), the others none."""
    if row.startswith("fusible_fp8delayed"):
        return functools.partial(fusible.autocast, recipe=fusible.DelayedScaling())
    return fusible.autocast if row.startswith("fusible_fp8") else contextlib.nullcontext


class TorchHead(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, x, labels):
        return F.cross_entropy(F.linear(x, self.weight).float(), labels)


class LigerHead(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        self.weight = nn.Parameter(torch.empty(vocab, hidden))
        self.loss = LigerFusedLinearCrossEntropyLoss()

    def forward(self, x, labels):
        return self.loss(self.weight, x, labels)


def build_head(row: str):
    hidden, vocab, _ = HEAD
    torch.manual_seed(0)
    cls = {"torch": TorchHead, "liger": LigerHead}.get(row.split("_")[0])
    # fusible_c<N>_...: chunks of N tokens (else the default, 2**28 logits: 2093 tokens)
    chunk = int(row.split("_")[1][1:]) if re.match(r"fusible_c\d+_", row) else None
    model = cls(hidden, vocab) if cls else ops.Sequential(
        ops.LinearCrossEntropy(hidden, vocab, chunk_size=chunk))
    model = model.to("cuda", torch.bfloat16)
    with torch.no_grad():
        nn.init.normal_(model.get_parameter([n for n, _ in model.named_parameters()][0]),
                        std=0.02)
    return model


def measure(model, inputs: tuple, compiled: "bool | str", dy=None,
            context=contextlib.nullcontext) -> tuple:
    """``({"ms", "peak_gib"}, the output, the step)`` of fwd+bwd steps, each forward inside
    ``context()``; ``compiled``: False, True, or ``"cudagraphs"`` (torch.compile's
    reduce-overhead mode: the compiled graphs replayed as CUDA graphs)."""
    graphs = compiled == "cudagraphs"
    run = torch.compile(model, fullgraph=True, mode="reduce-overhead" if graphs else None) \
        if compiled else model
    params = list(model.parameters())
    x = inputs[0]

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with context():
            y = run(*inputs)
        y.backward(dy if dy is not None else None)
        x.grad = None
        for p in params:
            p.grad = None
        return y

    for _ in range(3):
        out = step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = triton.testing.do_bench(step, warmup=30, rep=500, return_mode="median")
    return {"ms": ms, "peak_gib": peak}, out.detach(), step


def _fresh():
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def run_rows(rows, build, make_inputs, results: dict, key: str, output: str,
             profile: str = "", peaks: str = "") -> None:
    first = None
    for row in rows:
        _fresh()
        try:
            model = build(row)
            inputs, dy = make_inputs()
            context = _autocast(row)
            compiled = "cudagraphs" if row.endswith("cudagraphs") else row.endswith("compile")
            result, out, step = measure(model, inputs, compiled, dy, context)
            # (on the host: the next rows' peaks must not hold it)
            first = out.float().cpu() if first is None else first
            result["rel_err"] = ((out.float().cpu() - first).norm() / first.norm()).item()
            if profile and row in PROFILED:
                profile_step(step, f"{key} {row}", profile)
            if peaks and row in ("fusible_eager", "fusible_fp8_eager", "liger_eager"):
                peak_breakdown(step, f"{key} {row}", peaks)
            if peaks and key.startswith("layer") and row in ("hf_compile", "fusible_eager"):
                allocator_peak(step, f"{key} {row}", peaks)
        except Exception as error:  # a row that cannot run is reported, the rest go on
            result = {"error": repr(error)[:300]}
        # the next row's peak must not hold this row's model, inputs and step (its closure)
        model = inputs = dy = out = step = None
        results.setdefault(key, {})[row] = result
        print(key, row, result, flush=True)
        with open(output, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/layer.json")
    parser.add_argument("--profile", default="", help="kernels of the 1B layer's and the head's PROFILED rows")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--peak-breakdown", default="", metavar="PATH",
                        help="the tensors alive at the LM head rows' memory peak (its stages "
                             "then run as custom ops: diagnostics/peak_tensors.py), and the "
                             "allocator's blocks at the layers' (diagnostics/allocator_peak.py)")
    parser.add_argument("--no-head", dest="head", action="store_false",
                        help="skip the LM head rows")
    parser.add_argument("--rows", default="",
                        help="comma-separated: only these rows (of the layers and the head)")
    args = parser.parse_args()
    chosen = set(args.rows.split(",")) if args.rows else None
    known = set(LAYER_ROWS) | set(HEAD_ROWS)
    if chosen is not None and not chosen <= known:
        parser.error(f"unknown rows {sorted(chosen - known)}; rows: {sorted(known)}")

    def rows(names: list) -> list:
        return [n for n in names if chosen is None or n in chosen]
    if args.profile:
        open(args.profile, "w").close()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in [n for n in args.layers.split(",") if n]:
        shape = LAYERS[name]
        hidden, batch, seq = shape[0], shape[4], shape[5]

        def layer_inputs():
            torch.manual_seed(1)
            x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16)
            return (x.requires_grad_(),), torch.randn_like(x)

        run_rows(rows(LAYER_ROWS),
                 lambda row: build_layer(row, shape), layer_inputs, results, f"layer {name}",
                 args.output, args.profile if name == "llama3_1b" else "",
                 args.peak_breakdown)
    hidden, vocab, tokens = HEAD

    def head_inputs():
        torch.manual_seed(1)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (tokens,), device="cuda")
        return (x.requires_grad_(), labels), None

    if args.head:
        run_rows(rows(HEAD_ROWS),
                 build_head, head_inputs, results, "lm_head 8b", args.output, args.profile,
                 args.peak_breakdown)


if __name__ == "__main__":
    main()
