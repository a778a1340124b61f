"""Host time of one decoder layer's training step (forward and backward), where the GPU's
work is too small to hide it: torchtitan's debugmodel widths (dim 256, 16 heads, FF 768)
over 2 x 64 tokens, so each step's wall time is the host's. Rows: Hugging Face's
``LlamaDecoderLayer`` as it is; converted piece by piece (``fusible.convert(...,
fuse_layers=False)``: its linear layers and norms as fusible groups); converted whole
(one ``TransformerLayer`` plan); the native ``TransformerLayer``; each eager and, for the
fusible rows, under FP8 (``gemm_policy=None``: every GEMM, to see FP8's bookkeeping) and
under the default GEMM policy (which keeps these GEMMs in bf16). Reports microseconds per
step (median of 200 after 20 to warm up) and the fusible groups and stages per layer.

    python benchmarks/layer_host.py --output out/layer_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch

import fusible
from fusible.layers import TransformerLayer, llama_layer_state_dict

HIDDEN, FFN, HEADS, BATCH, SEQ = 256, 768, 16, 2, 64


def _hf_layer():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = llama.LlamaDecoderLayer(config, 0).to("cuda", torch.bfloat16)
    rotary = llama.LlamaRotaryEmbedding(config).cuda()
    return layer, rotary


def build(row: str):
    """``(step, stages per layer, groups per layer)``."""
    layer, rotary = _hf_layer()
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    pos = torch.arange(SEQ, device="cuda")[None]
    tables = rotary(x, pos)
    def context():  # a fresh context manager per use
        if "fp8_all" in row:
            return fusible.autocast(recipe=fusible.Float8CurrentScaling(gemm_policy=None))
        return fusible.autocast() if "fp8" in row else contextlib.nullcontext()
    if row.startswith("native"):
        model = TransformerLayer(HIDDEN, FFN, HEADS, rotary_base=10000.0, device="cuda",
                                 dtype=torch.bfloat16)
        model.load_state_dict(llama_layer_state_dict(layer.state_dict()))

        def call():
            return model(x)
    else:
        model = copy.deepcopy(layer)
        holder = torch.nn.ModuleList([model])  # convert works on a root's children
        if row.startswith("pieces"):
            fusible.convert(holder, fuse_layers=False)
        elif row.startswith("whole"):
            fusible.convert(holder)

        def call():
            out = model(x, position_ids=pos, position_embeddings=tables)
            return out[0] if isinstance(out, tuple) else out

    def step():
        with context():
            y = call()
        y.backward(torch.ones_like(y))
        x.grad = None
        for p in model.parameters():
            p.grad = None

    stages = groups = 0
    if not row.startswith("hf"):
        with context():
            plan = fusible.plan_model(model, *(
                (x,) if row.startswith("native") else ()),
                **({} if row.startswith("native") else dict(hidden_states=x, position_ids=pos,
                                                            position_embeddings=tables)))
        totals = plan.totals()
        stages = totals["forward stages"] + totals["backward stages"]
        groups = totals["fusible groups"]
    return step, stages, groups


def measure(step) -> float:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(200):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


ROWS = ["hf_eager", "pieces_eager", "whole_eager", "native_eager", "whole_fp8_all",
        "native_fp8_all", "whole_fp8_policy", "native_fp8_policy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/layer_host.json")
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for row in ROWS:
        try:
            step, stages, groups = build(row)
            results[row] = {"us_per_step": measure(step), "stages": stages, "groups": groups}
        except Exception as error:  # a row that cannot run is reported, the rest go on
            results[row] = {"error": repr(error)[:300]}
        print(row, results[row], flush=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
