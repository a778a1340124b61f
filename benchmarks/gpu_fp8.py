"""GPU: FP8 training of Linear+Bias+GELU(tanh)+Linear+Bias, fusible vs torchao vs bf16.

One run, the same method as ``gpu_mlp.py`` (fwd+bwd with a fixed output gradient,
median of triton.testing.do_bench, peak allocated memory during a step), rows:

- bf16: torch.nn eager and compiled, fusible eager and compiled;
- fp8: fusible under ``fusible.autocast()`` eager, compiled and compiled with CUDA
  graphs; torchao float8 tensorwise (``convert_to_float8_training``) eager and compiled.

``snr_db_*`` compares each FP8 model's output with the bf16 model's on the same weights.
With ``SNAPSHOT_DIR`` set, each row at the large shape also writes the allocator history
of its measured step there (``{row}.pickle``), to read what is alive at the peak.

    python benchmarks/gpu_fp8.py --output benchmarks/results/gpu_fp8_h200.json
"""

import argparse
import contextlib
import gc
import json
import os

import torch
import triton

import fusible
from gpu_mlp import SHAPES, build, measure
from fusible.testing import snr_db


def torchao_fp8(hidden: int, ffn: int):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = build("torch", hidden, ffn)
    return convert_to_float8_training(model,
                                      config=Float8LinearConfig.from_recipe_name("tensorwise"))


# (row name, model builder, mode, runs under fusible.autocast)
ROWS = [
    ("bf16_torch_eager", lambda h, f: build("torch", h, f), "eager", False),
    ("bf16_torch_compile", lambda h, f: build("torch", h, f), "compile", False),
    ("bf16_fusible_eager", lambda h, f: build("fusible", h, f), "eager", False),
    ("bf16_fusible_compile", lambda h, f: build("fusible", h, f), "compile", False),
    ("fp8_fusible_eager", lambda h, f: build("fusible", h, f), "eager", True),
    ("fp8_fusible_compile", lambda h, f: build("fusible", h, f), "compile", True),
    ("fp8_fusible_reduce-overhead", lambda h, f: build("fusible", h, f), "reduce-overhead", True),
    ("fp8_torchao_eager", torchao_fp8, "eager", False),
    ("fp8_torchao_compile", torchao_fp8, "compile", False),
]


def output_snr(tokens: int, hidden: int, ffn: int) -> dict:
    """Signal-to-noise (dB) of each FP8 model's forward output against bf16's."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = build("torch", hidden, ffn)(x)
        with fusible.autocast():
            ours = build("fusible", hidden, ffn)(x)
        theirs = torchao_fp8(hidden, ffn)(x)
    return {"fusible": snr_db(ours, ref), "torchao": snr_db(theirs, ref)}


def run_rows(tokens: int, hidden: int, ffn: int) -> dict:
    results, shape = {}, f"T{tokens}_H{hidden}_FF{ffn}"
    snapshot_dir = os.environ.get("SNAPSHOT_DIR") if (tokens, hidden, ffn) == SHAPES[0] else None
    for name, make, mode, fp8 in ROWS:
        torch._dynamo.reset()
        gc.collect()  # earlier compiled models are freed by the cyclic GC: not counted here
        model = make(hidden, ffn)
        context = fusible.autocast if fp8 else contextlib.nullcontext
        snapshot = f"{snapshot_dir}/{name}.pickle" if snapshot_dir else None
        try:
            results[f"{name}_{shape}"] = measure(model, tokens, hidden, ffn, mode, context,
                                                 snapshot)
        except Exception as error:  # one failing row must not hide the others
            results[f"{name}_{shape}"] = {"error": repr(error)[:500]}
        del model
        torch.cuda.empty_cache()
    results[f"snr_db_vs_bf16_{shape}"] = output_snr(tokens, hidden, ffn)
    return results


def summary(results: dict, shape: str) -> dict:
    """The issue's targets for one shape, as ratios (None where a row failed)."""
    ms = {k[:-len(shape) - 1]: v.get("ms") for k, v in results.items()
          if k.endswith(shape) and isinstance(v, dict) and "ms" in v}

    def ratio(a, b):
        return ms[a] / ms[b] if a in ms and b in ms else None

    peak = {k[:-len(shape) - 1]: v["peak_gib"] for k, v in results.items()
            if k.endswith(shape) and isinstance(v, dict) and "peak_gib" in v}
    return {
        "speedup_fp8_compile_over_bf16_fusible_compile":
            ratio("bf16_fusible_compile", "fp8_fusible_compile"),
        "fp8_fusible_compile_over_torchao_compile": ratio("fp8_fusible_compile",
                                                          "fp8_torchao_compile"),
        "fp8_fusible_eager_over_bf16_fusible_eager": ratio("fp8_fusible_eager",
                                                           "bf16_fusible_eager"),
        "fp8_fusible_compile_peak_over_bf16": (peak["fp8_fusible_compile"]
                                               / peak["bf16_fusible_compile"]
                                               if {"fp8_fusible_compile", "bf16_fusible_compile"}
                                               <= peak.keys() else None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/gpu_fp8.json")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
               "triton": triton.__version__}
    for tokens, hidden, ffn in SHAPES:
        shape = f"T{tokens}_H{hidden}_FF{ffn}"
        results.update(run_rows(tokens, hidden, ffn))
        results[f"summary_{shape}"] = summary(results, shape)
        with open(args.output, "w") as f:  # after each shape: a later failure loses nothing
            json.dump(results, f, indent=1)
    for key, value in results.items():
        if isinstance(value, dict) and "ms" in value:
            print(f"{key:<52} {value['ms']:8.3f} ms {value['tflops']:7.1f} TFLOP/s "
                  f"{value['peak_gib']:6.2f} GiB first3 {value['first3_s']:.2f} s")
        else:
            print(f"{key:<52} {value}")


if __name__ == "__main__":
    main()
