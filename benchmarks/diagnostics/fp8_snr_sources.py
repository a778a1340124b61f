"""Where FP8 results on the GPU part from the emulated reference: the same Llama FFN
block (RMSNorm, Linear, SwiGLU, Linear, residual) checked against the emulation with
(1) everything as shipped, (2) the fused RMSNorm/SwiGLU/activation FP8 kernels off (the
high-precision kernels then the separate cast), (3) the forward GEMMs without Hopper's
fast accumulation. If (2) reaches what (1) does and (3) more, the gap is the GEMMs'
accumulation, not the fused kernels.

    PYTHONPATH=.:tests python3 benchmarks/diagnostics/fp8_snr_sources.py
"""

import contextlib
import functools

import torch

import fusible
import fusible.functional.activations as activations
import fusible.functional.linear as linear
import fusible.functional.norms as norms
from fusible import ops
from fp8_emulation import check_against_emulation


@contextlib.contextmanager
def patched(module, name, value):
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


def snrs(hidden=256, ffn=512, tokens=1024):
    torch.manual_seed(0)
    model = ops.Sequential(ops.RMSNorm(hidden), ops.BasicLinear(hidden, 2 * ffn), ops.SwiGLU(),
                           ops.BasicLinear(ffn, hidden), ops.AddExtraInput()).to("cuda",
                                                                                 torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = check_against_emulation(model, [x, r], model, fusible.Float8CurrentScaling(), -1e9)
    return {k: round(v, 1) for k, v in got.items()}


def main():
    print("as shipped        ", snrs())
    with patched(norms, "triton_can_run", lambda *t: False), \
            patched(activations, "triton_can_run", lambda *t: False):
        print("no fused kernels  ", snrs())
    slow = functools.partial(linear.fp8_gemm, fast_accum=False)
    with patched(linear, "fp8_gemm", lambda *a, fast_accum=False, **k: slow(*a, **k)):
        print("no fast accum     ", snrs())


if __name__ == "__main__":
    main()
