#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: the whole test suite (CUDA tests included)
# under the machine's PyTorch, then the GPU benchmarks. Results land in $OUT (or out/).
# Usage there: [TESTS="tests/test_fp8.py ..."] bash scripts/gpu_check.sh [bf16] [fp8] [tp] [tiles]
#   [idle] [breakdown] [small] [graphs] [zoo] [moe] [probe] [fsdp] [layer] [models] [policy]
#   [layerhost] [headpeak] [fp8layer] [tiles16] [attntiles]
# (no argument: bf16 and fp8; tp needs two GPUs (kind nvidia-h200-x2); tiles: the GELU
# kernels' tile shapes (diagnostics/activation_tiles.py); idle: host time, GPU idle and
# kernels and host profile of the FP8 attention projections, eager and compiled (gpu_idle.py);
# breakdown: where the host time of the 8B FFN's T=2048 step goes (host_breakdown.py,
# host_timers.py); small: issue 13's small steps (small_steps.py); graphs: host time of
# the small MLP's CUDA-graph steps (graphs_host.py); zoo: the block zoo,
# ZOO_CONFIGS of its configs (default all) from index ZOO_FIRST (default 0, which also
# profiles), ZOO_ROWS its rows (comma-separated, default all); moe: the mixture-of-experts
# layers (zoo_moe.py, MOE_ROWS its rows, default all; MOE_CONFIGS which configs it
# measures, default 0,1, empty none; MOE_PROFILE which it profiles, default 0); probe: what
# torch._scaled_grouped_mm
# takes (diagnostics/scaled_grouped_probe.py); fsdp: FSDP2 on every GPU against one
# (gpu_fsdp.py); pipeline: 1F1B against zero-bubble with the split backward
# (gpu_pipeline.py); layer: a whole decoder layer at three sizes and the 8B LM head with
# its loss against Hugging Face, torch.compile and Liger (layer.py; LAYERS: which sizes,
# LAYER_ARGS: more arguments, e.g. --no-head); models: whole-model training steps, a process
# per row (models.py; MODEL_CONFIGS, MODEL_ROWS, MODEL_ROW_TIMEOUT (seconds a row may take),
# MODEL_PROFILE=1: each row's kernels and each eager or compiled row's Python profile);
# policy: the FP8 GEMM policy against measured bf16 and
# FP8 steps per GEMM shape (gemm_policy.py); layerhost: one decoder layer's host time
# per step, HF, converted piece by piece and whole, native, bf16 and FP8 (layer_host.py);
# headpeak: the blocks alive at the LM head's memory peak (diagnostics/head_peak.py);
# fp8layer: the ops beside the GEMMs of the 1B layer's FP8 step (diagnostics/fp8_layer_ops.py);
# tiles16: tile shapes of the bf16 SwiGLU, norm backward and rotary kernels
# (diagnostics/bf16_kernel_tiles.py; TILE_PARTS: which, default all); attntiles: the
# Triton attention kernels' tiles against cuDNN and FlashAttention (diagnostics/
# attention_tiles.py; ATTN_SHAPES: head widths, default 16,32,64);
# TESTS: which tests,
# default all, "none" for none; PYTEST_ARGS: more pytest arguments (-x); the argument
# "none" runs no benchmark)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT_ABS=$(realpath "$OUT")
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Install the checkout (editable, nothing fetched): fusible.fusions maps onto the fusions/
# folder and the built-in fusions are entry points of the installed distribution.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
export PYTHONUNBUFFERED=1
# Every FP8 check against the emulated reference records what it reached (floors calibrate)
export SNR_LOG="$OUT_ABS/snrs.jsonl"
# NVLink multicast stays off on the lent machines (the NCCL tests and the TP benchmark)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import os, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
  'tf32', torch.backends.cuda.matmul.allow_tf32, {k: v for k, v in os.environ.items() if 'TF32' in k})" \
    | tee -a "$OUT/gpu.txt"
tests_rc=0
if [[ "${TESTS:-tests}" != none ]]; then
    # PYTEST_ARGS: e.g. "-x", so that a failure's report is written before a caller's
    # timeout can cut the run (pytest reports failures at its end)
    python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} ${TESTS:-tests} 2>&1 \
        | tee "$OUT/pytest.log" | tail -15
    tests_rc=${PIPESTATUS[0]}
fi
benches=${*:-bf16 fp8}
bench_rc=0
if [[ " $benches " == *" bf16 "* ]]; then
    python3 benchmarks/diagnostics/gpu_overhead.py 2>&1 | tee "$OUT/overhead.log"
    python3 benchmarks/gpu_mlp.py --output "$OUT/gpu_mlp.json" --profile "$OUT/profile.txt" \
        2>&1 | tee "$OUT/bench.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" fp8 "* ]]; then
    python3 benchmarks/gpu_fp8.py --output "$OUT/gpu_fp8.json" 2>&1 | tee "$OUT/bench_fp8.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" fsdp "* ]]; then  # every GPU of the machine
    python3 benchmarks/gpu_fsdp.py --output "$OUT/gpu_fsdp.json" 2>&1 | tee "$OUT/bench_fsdp.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" pipeline "* ]]; then  # two GPUs (one: the code path)
    python3 benchmarks/gpu_pipeline.py --output "$OUT/gpu_pipeline.json" 2>&1 \
        | tee "$OUT/bench_pipeline.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" tp "* ]]; then
    python3 benchmarks/gpu_tp.py --output "$OUT/gpu_tp.json" 2>&1 | tee "$OUT/bench_tp.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" tiles "* ]]; then
    python3 benchmarks/diagnostics/activation_tiles.py 2>&1 | tee "$OUT/tiles.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" idle "* ]]; then  # the open questions of the zoo's last run
    (cd benchmarks && PYTHONPATH=$PYTHONPATH:$PWD python3 diagnostics/gpu_idle.py 5 \
        fusible_fp8_eager fusible_fp8_compile torchao_tensorwise) 2>&1 | tee "$OUT/idle.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" breakdown "* ]]; then  # host time of the 8B FFN at T=2048
    (cd benchmarks && PYTHONPATH=$PYTHONPATH:$PWD python3 diagnostics/host_breakdown.py 1 \
        && PYTHONPATH=$PYTHONPATH:$PWD python3 diagnostics/host_timers.py 1) \
        2>&1 | tee "$OUT/breakdown.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" small "* ]]; then  # issue 13's small steps, side by side
    (cd benchmarks && python3 small_steps.py --output "$OUT_ABS/small_steps.json") \
        2>&1 | tee "$OUT/small_steps.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" graphs "* ]]; then  # host time of CUDA-graph steps
    (cd benchmarks && PYTHONPATH=$PYTHONPATH:$PWD python3 diagnostics/graphs_host.py) \
        2>&1 | tee "$OUT/graphs.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" zoo "* ]]; then
    (cd benchmarks && python3 zoo.py --configs "${ZOO_CONFIGS:-99}" --first "${ZOO_FIRST:-0}" \
        ${ZOO_ROWS:+--rows "$ZOO_ROWS"} \
        --output "$OUT_ABS/zoo.json" --profile "$OUT_ABS/zoo_profile.txt") 2>&1 | tee "$OUT/zoo.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" layer "* ]]; then  # a decoder layer and the LM head (layer.py)
    (cd benchmarks && python3 layer.py --output "$OUT_ABS/layer.json" \
        --profile "$OUT_ABS/layer_profile.txt" --peak-breakdown "$OUT_ABS/layer_peaks.txt" \
        ${LAYERS:+--layers "$LAYERS"} ${LAYER_ARGS:-}) 2>&1 \
        | tee "$OUT/layer.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" layerhost "* ]]; then  # a decoder layer's host time (layer_host.py)
    (cd benchmarks && python3 layer_host.py --output "$OUT_ABS/layer_host.json") 2>&1 \
        | tee "$OUT/layer_host.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" policy "* ]]; then  # the FP8 GEMM policy's calibration
    (cd benchmarks && python3 gemm_policy.py --output "$OUT_ABS/gemm_policy.json") 2>&1 \
        | tee "$OUT/gemm_policy.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" models "* ]]; then  # whole-model training steps (models.py)
    (cd benchmarks && python3 models.py --output "$OUT_ABS/models.json" \
        ${MODEL_CONFIGS:+--configs "$MODEL_CONFIGS"} ${MODEL_ROWS:+--rows "$MODEL_ROWS"} \
        ${MODEL_PROFILE:+--profile "$OUT_ABS/models_profile.txt"} \
        ${MODEL_ROW_TIMEOUT:+--row-timeout "$MODEL_ROW_TIMEOUT"}) \
        2>&1 | tee "$OUT/models.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" headpeak "* ]]; then  # the LM head's peak, block by block
    python3 benchmarks/diagnostics/head_peak.py 2>&1 | tee "$OUT/head_peak.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" fp8layer "* ]]; then  # the FP8 layer's other kernels, by op
    python3 benchmarks/diagnostics/fp8_layer_ops.py 2>&1 | tee "$OUT/fp8_layer_ops.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" tiles16 "* ]]; then  # the bf16 kernels beside a layer's GEMMs
    python3 benchmarks/diagnostics/bf16_kernel_tiles.py ${TILE_PARTS:-} 2>&1 \
        | tee "$OUT/bf16_tiles.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" attntiles "* ]]; then  # our attention kernels against cuDNN's
    python3 benchmarks/diagnostics/attention_tiles.py --shapes "${ATTN_SHAPES:-16,32,64}" \
        2>&1 | tee "$OUT/attention_tiles.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" probe "* ]]; then
    python3 benchmarks/diagnostics/scaled_grouped_probe.py 2>&1 | tee "$OUT/probe.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
if [[ " $benches " == *" moe "* ]]; then
    (cd benchmarks && python3 zoo_moe.py ${MOE_ROWS:+--rows "$MOE_ROWS"} \
        --configs "${MOE_CONFIGS-0,1}" --profile-configs "${MOE_PROFILE:-0}" \
        --output "$OUT_ABS/zoo_moe.json" --profile "$OUT_ABS/moe_profile.txt") 2>&1 \
        | tee "$OUT/zoo_moe.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
