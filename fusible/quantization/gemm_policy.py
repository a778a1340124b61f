"""Which GEMMs an FP8 recipe runs in FP8: a cost model per GEMM, from its weight's shape.

A GEMM of ``K`` input and ``N`` output features over ``M`` tokens saves, in FP8,
``2 M K N (1 / bf16_rate - 1 / fp8_rate)`` seconds of tensor-core time, and costs the
casts that feed it: the input and the output gradient read in 16 bits, their amax, the
FP8 copies and the transposed copies the weight gradient reads, about ``cast_bytes``
bytes per token per feature of ``K + N`` at the memory's bandwidth. Both grow with
``M``, so the choice depends on the shape alone: FP8 pays where

    K N / (K + N)  >  cast_bytes / (2 * bandwidth * (1 / bf16_rate - 1 / fp8_rate)),

about 1150 with the H200's figures (bf16 GEMMs 670 TFLOP/s, FP8 1300, copies 4.2 TB/s,
7 bytes per feature). So Llama-3-8B's GEMMs (K N / (K + N) from 2048 up) run in FP8, a
1B model's 2048 x 2048 output projection (1024) and every GEMM of a model of width 256
(torchtitan's debugmodel: 192) stay in bf16, without the casts and amax work. The policy
applies on CUDA; on other devices (the CPU's FP8 emulation) every GEMM the recipe takes
runs in FP8. A linear layer's ``fp8`` attribute overrides it (True / False; None: the
policy), a layer whose weights are FP8 already (``quantized_model_init``) runs in FP8, and a
recipe built with ``gemm_policy=None`` runs every GEMM in FP8.

Grouped GEMMs (a mixture of experts' ``GroupedLinear``) decide with their own FP8 rate:
PyTorch's grouped FP8 GEMM is 1.18x-1.48x its bf16 one where dense FP8 GEMMs are about
2x, and each expert's weight is cast for its few tokens (measured on an H200: a
DeepSeek-V3-like layer, experts 4096 x 2048, ran 0.95x bf16's speed in FP8, a
Mixtral-like one, 4096 x 14336, 1.23x). At 1.3x bf16's rate (``grouped_fp8_speedup``)
the threshold is about 2420: the first's experts stay in bf16, the second's run in FP8.
"""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.quantization.tensor.float8_tensor import Float8Tensor


@attrs.frozen
class Fp8GemmPolicy:
    """The cost model deciding which GEMMs run in FP8 (see the module notes).

    Attributes
    ----------
    bf16_tflops, fp8_tflops : float
        The GEMM rates (TFLOP/s) of the GPU's bf16 and FP8 tensor cores.
    bandwidth_tbs : float
        Its memory bandwidth (TB/s), which the casts are bound by.
    cast_bytes : float
        Bytes the casts move per token per input and output feature.
    devices : tuple of str
        The device types it decides on (elsewhere every GEMM runs in FP8).
    grouped_fp8_speedup : float
        How much faster than bf16 grouped GEMMs run in FP8, each expert's weight cast
        counted in (1 or less: grouped GEMMs stay in high precision).
    """

    bf16_tflops: float = 670.0
    fp8_tflops: float = 1300.0
    bandwidth_tbs: float = 4.2
    cast_bytes: float = 7.0
    devices: tuple = ("cuda",)
    grouped_fp8_speedup: float = 1.3

    @property
    def threshold(self) -> float:
        """The ``K N / (K + N)`` above which FP8 pays."""
        return self._threshold(self.fp8_tflops)

    @property
    def grouped_threshold(self) -> float:
        """The same for grouped GEMMs (FP8 at ``grouped_fp8_speedup`` times bf16's rate)."""
        return self._threshold(self.grouped_fp8_speedup * self.bf16_tflops)

    def _threshold(self, fp8_tflops: float) -> float:
        saved = 1.0 / (self.bf16_tflops * 1e12) - 1.0 / (fp8_tflops * 1e12)
        if saved <= 0:
            return float("inf")
        return self.cast_bytes / (2.0 * self.bandwidth_tbs * 1e12 * saved)

    def why_high_precision(self, in_features: int, out_features: int,
                           grouped: bool = False) -> Optional[str]:
        """Why a GEMM (``grouped``: each group's) of this shape stays in high precision, or
        None (FP8 pays)."""
        size = in_features * out_features / (in_features + out_features)
        threshold = self.grouped_threshold if grouped else self.threshold
        if size > threshold:
            return None
        return (f"FP8 would not pay: K N / (K + N) = {size:.0f} <= {threshold:.0f}"
                f"{' (grouped)' if grouped else ''} (fusible.Fp8GemmPolicy)")


_DEFAULT: list = [Fp8GemmPolicy()]  # what a recipe built without gemm_policy gets


def default_gemm_policy() -> Optional[Fp8GemmPolicy]:
    """The policy of a recipe built without ``gemm_policy``."""
    return _DEFAULT[0]


def set_default_gemm_policy(policy: Optional[Fp8GemmPolicy]) -> None:
    """Make ``policy`` (None: every GEMM in FP8) the default of recipes built from now on
    (the test suite runs its FP8 checks on every GEMM, whatever their size)."""
    _DEFAULT[0] = policy


def gemm_decision(recipe, op, device_type: str) -> Optional[str]:
    """Why ``op`` runs its GEMMs in high precision under ``recipe``, or None (FP8, or no
    GEMM to decide). ``op.fp8`` (True / False) overrides the recipe's ``gemm_policy``."""
    shape = getattr(op, "fp8_gemm_shape", None)
    if recipe is None or shape is None:
        return None
    forced = getattr(op, "fp8", None)
    if forced is not None:
        return None if forced else f"{op.describe()}.fp8 = False"
    if any(isinstance(p, Float8Tensor) for p in op.parameters()):
        return None  # its weights are FP8 already (quantized_model_init): FP8 GEMMs
    policy = getattr(recipe, "gemm_policy", None)
    if policy is None or device_type not in policy.devices:
        return None
    return policy.why_high_precision(*shape(), grouped=getattr(op, "fp8_gemm_grouped", False))
