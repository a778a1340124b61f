"""GPU: whole-model training steps (forward with the loss, backward, fused AdamW), each row
in a process of its own (Liger patches transformers' classes in place), side by side in one
run: Hugging Face's LlamaForCausalLM eager, compiled, compiled with CUDA graphs
(``*_cudagraphs``: ``mode="reduce-overhead"``), the whole step captured as one CUDA graph
(``*_captured``: ``fusible.capture_step``), with
Liger-Kernel, with torchao's float8 training + compile, the same model after
``fusible.convert`` (``converted_*``: its decoder layers fused whole, and with
``fuse_loss=True`` its loss by LinearCrossEntropy, no logits made) and the same
architecture as a native fusible model (``fusible.layers.CausalLM`` on the same weights),
eager, compiled, bf16 and FP8; mixture-of-experts models (``MOE_CONFIGS``: Qwen3-MoE and
Mixtral widths, two layers) in the Hugging Face and converted rows. Reports ms per step, tokens/s, peak memory and the loss after the timed
steps (the rows start from the same weights and see the same batch: their losses agree,
FP8 within its tolerance).

A fusible row may name the attention kernel of every fused layer after a colon
(``fusible_captured:flash``; cudnn, flash, flex, triton or math): an A/B of the kernels at
one model's shapes.

    python benchmarks/models.py --output benchmarks/results/models_h200.json
    python benchmarks/models.py --configs debugmodel --rows hf_eager,fusible_compile
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import time

# name: (hidden, ffn, layers, heads, kv heads, vocab, tied, batch, seq, rope theta)
CONFIGS = {
    "llama3_8b_4_layers": (4096, 14336, 4, 32, 8, 128256, False, 2, 4096, 500000.0),
    "llama3_2_1b": (2048, 8192, 16, 32, 8, 128256, True, 2, 4096, 500000.0),
    "debugmodel": (256, 768, 6, 16, 16, 2048, False, 8, 2048, 500000.0),
}
# Mixture-of-experts models (Hugging Face rows and converted ones; no native fusible
# model): name -> (transformers config class, its arguments, batch, seq)
MOE_CONFIGS = {
    "qwen3_moe_30b_a3b_2_layers": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936,
        max_position_embeddings=8192), 2, 4096),
    "mixtral_8x7b_2_layers": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=8192), 2, 4096),
}
ROWS = ["hf_eager", "hf_compile", "hf_compile_cudagraphs", "hf_captured", "liger",
        "torchao_fp8_compile", "torchao_fp8_compile_cudagraphs",
        "converted_eager", "converted_compile", "converted_compile_cudagraphs",
        "converted_captured", "converted_fp8_eager",
        "converted_fp8_compile", "converted_fp8_captured",
        "fusible_eager", "fusible_compile", "fusible_compile_cudagraphs", "fusible_captured",
        "fusible_fp8_eager", "fusible_fp8_compile", "fusible_fp8_captured"]
STEPS, WARMUP = 20, 5
CAPTURE_STEPS = 4  # capture_step's own real steps: three warm-ups and the check run


def _hf_model(config_name: str):
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    if config_name in MOE_CONFIGS:
        cls, kwargs, _, _ = MOE_CONFIGS[config_name]
        config = getattr(transformers, cls)(**kwargs)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    hidden, ffn, layers, heads, kv, vocab, tied, _, _, theta = CONFIGS[config_name]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, rope_theta=theta,
                         max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model


def build(row: str, config_name: str, example_ids, attention: str = ""):
    """``(step function of (ids, labels) -> loss, the model)`` for one row; ``attention``
    names the fusible attention kernel (set before a captured row captures its step)."""
    import contextlib
    import torch
    if row == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    hf = _hf_model(config_name)
    context = contextlib.nullcontext
    if row.startswith("fusible"):
        if config_name in MOE_CONFIGS:
            raise ValueError("no native fusible model of a mixture of experts (the "
                             "converted rows are fusible's)")
        import fusible
        from fusible.layers import CausalLM
        hidden, ffn, layers, heads, kv, vocab, tied, _, _, theta = CONFIGS[config_name]
        model = CausalLM(vocab, hidden, ffn, layers, heads, num_kv_heads=kv,
                         rotary_base=theta, eps=hf.config.rms_norm_eps, tie_embeddings=tied,
                         device="cuda", dtype=torch.bfloat16)
        model.load_state_dict(CausalLM.state_dict_from_llama(hf.state_dict()))
        del hf

        def forward(ids, labels):
            return model(ids, labels)
        if "fp8" in row:
            context = fusible.autocast
    else:
        model = hf
        if row.startswith("converted"):
            import fusible
            # the training loss by LinearCrossEntropy (no logits) where the family has it
            report = fusible.convert(model, fuse_loss=config_name not in MOE_CONFIGS)
            whole = "GroupedLinear" if config_name in MOE_CONFIGS else "TransformerLayer"
            fused = sum(new.startswith(whole) for _, _, new in report.converted)
            if fused != model.config.num_hidden_layers:  # a converted row measuring HF code
                raise RuntimeError(f"{fused} of {model.config.num_hidden_layers} layers "
                                   f"converted to {whole}:\n{report}")
            if "fp8" in row:
                context = fusible.autocast
        if row.startswith("torchao"):
            from torchao.float8 import convert_to_float8_training
            convert_to_float8_training(model.model.layers)

        def forward(ids, labels):
            return model(input_ids=ids, labels=labels).loss
    if "compile" in row:
        mode = "reduce-overhead" if row.endswith("cudagraphs") else None
        forward = torch.compile(forward, mode=mode)
    if attention:
        _set_attention_backend(model, attention)
    captured = row.endswith("captured")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=captured)

    def step(ids, labels):
        if row.endswith("cudagraphs"):
            torch.compiler.cudagraph_mark_step_begin()
        with context():
            loss = forward(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not captured)  # a captured step keeps its .grad
        return loss.detach()
    if captured:
        import fusible
        return fusible.capture_step(step, example_ids, example_ids,
                                    optimizers=[optimizer]), model
    return step, model


def run_row(row: str, config_name: str, profile: str = "") -> dict:
    import torch
    if config_name in MOE_CONFIGS:
        _, kwargs, batch, seq = MOE_CONFIGS[config_name]
        vocab = kwargs["vocab_size"]
    else:
        *_, batch, seq, _ = CONFIGS[config_name]
        vocab = CONFIGS[config_name][5]
    ids = torch.randint(0, vocab, (batch, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    row, _, attention = row.partition(":")
    step, model = build(row, config_name, ids, attention)
    start = time.perf_counter()
    # a captured row's capture made CAPTURE_STEPS real steps: every row trains as many
    for i in range(WARMUP - (CAPTURE_STEPS if row.endswith("captured") else 0)):
        loss = step(ids, ids)
        torch.cuda.synchronize()  # (a row cut by its timeout says how far it got)
        print(f"warm-up step {i} done at {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(STEPS):
        loss = step(ids, ids)
    end.record()
    torch.cuda.synchronize()
    ms = begin.elapsed_time(end) / STEPS
    # read now: a captured step's loss is its static output, which the profiled replays
    # below would overwrite
    loss_after = loss.item()
    if profile:
        from gpu_mlp import profile_step
        profile_step(lambda: step(ids, ids), f"{config_name} {row}", profile, rows=80)
        if row.endswith(("eager", "compile")):  # where the host's time goes, by function
            _host_profile(lambda: step(ids, ids), f"{config_name} {row}", profile + ".host.txt")
    fallbacks = _fallbacks(model)
    if "compile" in row:  # where a compile's seconds went (dynamo, AOT, Inductor), graphs
        fallbacks["compile_s"] = _compile_breakdown()
    if fallbacks.get("fallbacks"):  # a converted row that ran Hugging Face's layers
        raise RuntimeError(f"{row}: fused layers fell back to the original code: {fallbacks}")
    return {"ms": ms, "tokens_per_s": batch * seq / ms * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            # a captured step's tensors live in its graph's private pool, which the
            # allocated peak may not count: the reserved peak does (fragmentation included)
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "loss_after": loss_after, "steps": WARMUP + STEPS, "warmup_s": warmup_s,
            **fallbacks}


def _compile_breakdown() -> dict:
    """The compile's seconds by phase (torch._dynamo's timed functions, summed over its
    graphs; the 12 longest; nested: a phase's time includes the phases it calls) and how
    many graphs and graph breaks it made."""
    from torch._dynamo.utils import compile_times, counters
    names, values = compile_times(repr="csv", aggregate=True)
    phases = sorted(((float(v), n) for n, v in zip(names, values)), reverse=True)[:12]
    return {"phases": {n: round(v, 2) for v, n in phases},
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def _host_profile(step, title: str, path: str) -> None:
    """Append the Python functions five ``step()`` calls spend their host time in (by
    cumulative and by own time) to ``path``."""
    import cProfile
    import io
    import pstats
    import torch
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    with open(path, "a") as f:
        f.write(f"== {title}, 5 steps\n{text.getvalue()}\n")


def _fallbacks(model) -> dict:
    """A converted model's fused layers and the calls that ran their original code (a
    converted row measuring Hugging Face's code would say so here)."""
    forwards = _fused_forwards(model)
    if not forwards:
        return {}
    reasons: dict = {}
    for forward in forwards:
        for why, count in forward.fallbacks.items():
            reasons[why] = reasons.get(why, 0) + count
    return {"fused_layers": len(forwards), "fallbacks": reasons}


def _fused_forwards(model) -> list:
    """The ``FusedLayerForward`` of each decoder layer ``fusible.convert`` fused."""
    return [m.__dict__["forward"] for m in model.modules()
            if type(m.__dict__.get("forward")).__name__ == "FusedLayerForward"]


def _set_attention_backend(model, backend: str) -> None:
    """Every fusible attention op of ``model`` (a native model's, or a converted one's
    fused layers') on ``backend``; ValueError where the model has none."""
    from fusible import ops
    roots = [model] + [forward.fused for forward in _fused_forwards(model)]
    found = [m for root in roots for m in root.modules() if isinstance(m, ops.Attention)]
    if not found:
        raise ValueError(f"attention backend {backend!r} asked for a model without fusible "
                         f"attention (a Hugging Face row?)")
    for attention in found:
        attention.backend = backend


def _run_row_process(row: str, config: str, profile: str, timeout: float) -> dict:
    """One row in a process of its own (Liger patches classes); its result or its error
    (a row cut by the timeout: the end of what it wrote, its Python stack shortly before
    the cut included)."""
    try:
        done = subprocess.run([sys.executable, __file__, "--row", row, "--config", config,
                               "--profile", profile, "--stack-after", str(timeout - 15)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as cut:
        written = cut.stderr or b""
        written = written.decode(errors="replace") if isinstance(written, bytes) else written
        # (every thread's stack: the main thread's may be far from the end)
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": written[-12000:]}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (done.stderr or done.stdout)[-600:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/models.json")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--row", help="(internal) run this one row here and print it")
    parser.add_argument("--config", help="(internal) of --row")
    parser.add_argument("--profile", default="", metavar="PATH",
                        help="append each row's kernels (three steps, by GPU time) to PATH")
    parser.add_argument("--row-timeout", type=float, default=900,
                        help="seconds one row may take before it is recorded as timed out")
    parser.add_argument("--stack-after", type=float, default=0,
                        help="(internal) of --row: write the Python stack to stderr after "
                             "this many seconds (where a row cut by its timeout was)")
    args = parser.parse_args()
    if args.row:
        if args.stack_after > 0:
            faulthandler.dump_traceback_later(args.stack_after)
        print(json.dumps(run_row(args.row, args.config, args.profile)))
        return
    import torch
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for config in args.configs.split(","):
        for row in args.rows.split(","):
            result = _run_row_process(row, config, args.profile, args.row_timeout)
            results.setdefault(config, {})[row] = result
            print(config, row, result, flush=True)
            with open(args.output, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
