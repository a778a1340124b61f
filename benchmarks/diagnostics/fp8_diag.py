"""One-off GPU diagnostics for FP8: _scaled_mm output dtypes and layouts, cast bits,
and memory allocated after each stage of the MLP block's forward and backward.

    PYTHONPATH=. python3 benchmarks/diagnostics/fp8_diag.py   (from the repository root)
"""

import functools
import gc

import torch

import fusible
from fusible import ops


def mlp_problem(tokens: int, hidden: int, ffn: int) -> tuple:
    """``(model, x, dy)``: the benchmarks' Linear + GELU(tanh) + Linear block in bf16 on
    CUDA, an input that requires grad and an output gradient."""
    model = ops.Sequential(ops.Linear(hidden, ffn), ops.GELU(approximate="tanh"),
                           ops.Linear(ffn, hidden)).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    return model, x, dy


def scaled_mm_checks():
    """NaN count and error of _scaled_mm against the dequantized product, per dtype pair."""
    torch.manual_seed(0)
    one = torch.ones((), device="cuda")
    for a_dt, b_dt in ((torch.float8_e4m3fn,) * 2, (torch.float8_e5m2, torch.float8_e4m3fn)):
        for m, k, n in ((32, 48, 64), (16, 64, 32), (512, 256, 1024)):
            a = torch.randn(m, k, device="cuda").to(a_dt)
            b = torch.randn(n, k, device="cuda").to(b_dt).t()  # column-major
            ref = a.double() @ b.double()
            for out_dtype in (torch.float32, torch.bfloat16):
                for fast in (False, True):
                    y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype,
                                         use_fast_accum=fast)
                    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                    print(f"_scaled_mm {a_dt} x {b_dt} ({m},{k},{n}) -> {out_dtype} fast={fast}: "
                          f"nan {y.isnan().sum().item()} rel err {err:.2e}")


def cast_checks():
    from fusible.kernels.fp8_cast import cast_to_fp8_triton
    from fusible.quantization.casts.common import FP8_MAX
    from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for fp8 in FP8_MAX:
            x = (torch.randn(4096, 1024, device="cuda")
                 * torch.logspace(-9, 3, 1024, device="cuda")).to(dtype)
            ours, ref = (cast_to_fp8_triton(x, fp8, FP8_MAX[fp8], True),
                         cast_tensorwise_torch(x, fp8, True))
            diff = ours[0].view(torch.uint8) != ref[0].view(torch.uint8)
            print(f"cast {dtype}->{fp8}: scale_inv {ours[1].item():.9g} vs {ref[1].item():.9g}, "
                  f"{diff.sum().item()} data bytes differ, transpose differs "
                  f"{(ours[2].view(torch.uint8) != ref[2].view(torch.uint8)).sum().item()}")
            if diff.any():
                idx = diff.nonzero()[:5]
                for i, j in idx.tolist():
                    print("   x", x[i, j].item(), "ours", ours[0][i, j].float().item(),
                          "ref", ref[0][i, j].float().item())


def memory_by_stage(fp8: bool, tokens=16384, hidden=4096, ffn=16384):
    """Allocated and peak GiB after each stage compute, eager."""
    log = []

    def wrap(cls, name):
        original = getattr(cls, name).__func__

        @functools.wraps(original)
        def traced(c, args, **kwargs):
            result = original(c, args, **kwargs)
            torch.cuda.synchronize()
            log.append(f"{c.__name__}.{name}: allocated "
                       f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, peak "
                       f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
            return result
        setattr(cls, name, classmethod(traced))
        return original

    from fusible.fusions.backward_activation_bias import BackwardActivationBias
    from fusible.fusions.backward_linear_bias import BackwardLinearBias
    from fusible.fusions.forward_linear_bias import ForwardLinearBias
    from fusible.ops import GELU, BasicLinear
    patched = [(ForwardLinearBias, "forward_compute"), (GELU, "forward_compute"),
               (BackwardLinearBias, "backward_compute"),
               (BackwardActivationBias, "backward_compute"), (BasicLinear, "backward_compute")]
    originals = [(cls, name, wrap(cls, name)) for cls, name in patched]
    try:
        model, x, dy = mlp_problem(tokens, hidden, ffn)
        for step in range(2):
            log.clear()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            log.append(f"start: allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
            with fusible.autocast(enabled=fp8):
                y = model(x)
            y.backward(dy)
            x.grad = None
            for p in model.parameters():
                p.grad = None
        print(f"== memory by stage, fp8={fp8}")
        print("\n".join(log))
    finally:
        for cls, name, original in originals:
            setattr(cls, name, classmethod(original))


def snapshot(fp8: bool, path: str, compiled=False, tokens=16384, hidden=4096, ffn=16384):
    """Allocator history of the last of four fwd+bwd steps, for reading the peak offline."""
    model, x, dy = mlp_problem(tokens, hidden, ffn)
    run = torch.compile(model) if compiled else model
    gc.collect()  # a compiled model lives until the cyclic GC runs: not the one measured
    torch.cuda.memory._record_memory_history(max_entries=100000)  # all steps: see leaks too
    for step in range(4):
        if step == 3:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with fusible.autocast(enabled=fp8):
            y = run(x)
        y.backward(dy)
        del y
        x.grad = None
        for p in model.parameters():
            p.grad = None
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"snapshot fp8={fp8}: peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB -> {path}")


def host_profile(tokens=2048, hidden=1024, ffn=4096, steps=20):
    """cProfile of eager FP8 fwd+bwd steps at a small, host-bound shape: where the host
    time goes (Python functions by own time)."""
    import cProfile
    import pstats
    model, x, dy = mlp_problem(tokens, hidden, ffn)

    def step():
        with fusible.autocast():
            model(x).backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    import os
    import sys
    if "--host" in sys.argv:
        host_profile()
    elif "--snapshot" in sys.argv:
        out = os.environ.get("OUT", "out")
        for compiled in (False, True):
            suffix = "_compiled" if compiled else ""
            for fp8 in (False, True):
                snapshot(fp8, f"{out}/mem_{'fp8' if fp8 else 'bf16'}{suffix}.pickle", compiled)
    else:
        scaled_mm_checks()
        cast_checks()
        memory_by_stage(False)
        memory_by_stage(True)
