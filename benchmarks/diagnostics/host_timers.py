"""Where the host time of an eager step goes, function by function, without a profiler:
every function of a list (fusible's stages, casts, GEMM wrappers and kernel launchers,
``torch._scaled_mm``, ``torch.zeros``, the Triton launches) is wrapped in a
timer, a step runs 50 times, and each reports its calls and inclusive host time per step
(about 0.3 us of timer per call; a function's time includes the functions it calls).

    PYTHONPATH=.:benchmarks python3 benchmarks/diagnostics/host_timers.py [CONFIG_INDEX]

(``CONFIG_INDEX`` into the zoo's ``CONFIGS``, default 1: the Llama-3-8B FFN at 2048 tokens,
whose FP8 step waits on the host.)
"""

import collections
import sys
import time

import torch

from host_breakdown import launch_split
from zoo import CONFIGS

import fusible

FUNCTIONS = {
    "fusible.runtime.executor": ("run_forward", "run_backward"),
    "fusible.functional.linear": ("gemm_forward", "gemm_backward", "fp8_gemm", "as_fp8",
                                  "_dgrad_weight", "linear_forward", "linear_dgrad",
                                  "linear_wgrad"),
    "fusible.functional.linear_state": ("gemm_forward_args", "gemm_backward_args",
                                        "save_linear", "forward_aux"),
    "fusible.quantization.tensor.quantize": ("quantize_raw",),
    "fusible.quantization.casts.tensorwise": ("cast_tensorwise", "_cast_eager", "tensor_amax"),
    "fusible.quantization.format": ("to_format",),
    "fusible.kernels.fp8_cast": ("cast_to_fp8_triton", "amax_triton", "fp8_buffers",
                                 "fp8_results"),
    "fusible.functional.norms": ("rms_norm_forward", "rms_norm_backward"),
    "fusible.kernels.norms": ("norm_forward_fp8_triton", "norm_forward_triton",
                              "norm_backward_triton"),
    "fusible.functional.activations": ("glu_forward", "glu_backward"),
    "fusible.kernels.swiglu": ("swiglu_forward_fp8_triton", "swiglu_backward_fp8_triton",
                               "swiglu_forward_triton", "swiglu_backward_triton"),
    "fusible.runtime.saved": ("stash_saved",),
}
CLASS_METHODS = {"fusible.ops": ("RMSNorm", "BasicLinear", "SwiGLU", "AddExtraInput")}

TIMES = collections.defaultdict(float)
CALLS = collections.Counter()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter_ns() - start
            CALLS[name] += 1
    return wrapper


def patch_everywhere(original, replacement) -> None:
    """Replace ``original`` in every fusible module that holds it by name."""
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("fusible"):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


def install() -> None:
    for module_name, names in FUNCTIONS.items():
        module = sys.modules[module_name]
        for name in names:
            original = getattr(module, name)
            patch_everywhere(original, timed(f"{module_name.split('.')[-1]}.{name}", original))
    ops = fusible.ops
    for cls_name in CLASS_METHODS["fusible.ops"]:
        cls = getattr(ops, cls_name)
        for method in ("forward_compute", "backward_compute"):
            fn = cls.__dict__.get(method)
            if fn is not None:
                setattr(cls, method, classmethod(timed(f"{cls_name}.{method}", fn.__func__)))
    torch._scaled_mm = timed("torch._scaled_mm", torch._scaled_mm)
    torch.zeros = timed("torch.zeros", torch.zeros)
    launches = fusible.kernels.CachedLaunches
    launches.__call__ = timed("Triton kernel launch (CachedLaunches)", launches.__call__)


def main(config) -> None:
    install()
    for row in ("fusible_bf16_eager", "fusible_fp8_eager"):
        torch._dynamo.reset()
        forward, backward, halves = launch_split(row, config)
        TIMES.clear()
        CALLS.clear()
        steps = 50
        for _ in range(steps):
            halves()
        print(f"== {row} {config}: host ms, timers on: forward {forward:.3f}, backward "
              f"{backward:.3f}; per step (us, inclusive), calls per step:")
        for name, total in sorted(TIMES.items(), key=lambda kv: -kv[1]):
            per_step = total / steps / 1e3
            print(f"   {name:48s} {per_step:8.1f} us  {CALLS[name] / steps:5.1f} calls  "
                  f"{per_step / (CALLS[name] / steps):7.1f} us/call")


if __name__ == "__main__":
    main(CONFIGS[int(sys.argv[1]) if len(sys.argv) > 1 else 1])
