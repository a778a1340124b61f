"""FP8 checks: signal-to-noise ratios and the floors the formats imply."""

from __future__ import annotations

import torch

from fusible.quantization.tensor.float8_tensor import Float8Tensor

# FP8: signal-to-noise bounds derived from the formats ---------------------------------

# Round-to-nearest with m mantissa bits leaves a relative error uniform in +-2^-(m+1):
# a noise-to-signal power of 2^-2(m+1) / 3 for values spread over a binade, that is an
# SNR of 6.02 (m + 1) + 4.77 dB. E4M3 keeps 3 mantissa bits, E5M2 2.
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def snr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``actual`` against ``reference``, in dB."""
    if isinstance(actual, Float8Tensor):
        actual = actual.dequantize()
    a, r = actual.detach().double().cpu(), reference.detach().double().cpu()
    noise = (a - r).square().sum()
    return float("inf") if noise == 0 else (10 * torch.log10(r.square().sum() / noise)).item()


def fp8_snr_floor(*fp8_dtypes: torch.dtype, margin_db: float = 3.0) -> float:
    """The SNR a result of operands quantized to ``fp8_dtypes`` should exceed, in dB.

    The operands' quantization noise powers add (a GEMM of an E4M3 and an E5M2
    operand: ``fp8_snr_floor(E4M3, E5M2)``); ``margin_db`` allows for the
    accumulation and the output rounding.
    """
    nsr = sum(10 ** (-(6.02 * (_MANTISSA_BITS[d] + 1) + 4.77) / 10) for d in fp8_dtypes)
    return -10 * torch.log10(torch.tensor(nsr)).item() - margin_db
