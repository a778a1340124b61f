"""FP8 GEMMs on scaled operands, whatever the scales' blocks: ``torch._scaled_mm`` for
scales per tensor or per row / column, PyTorch's blockwise GEMM (``F.scaled_mm``,
DeepSeek-V3's 1x128 and 128x128 blocks) on the GPUs that have one, and an emulation
(the operands dequantized, a float32 GEMM) for everything else: the CPU's blockwise
GEMMs (and row-wise ones before PyTorch 2.13) and MX GEMMs (no native MX path yet).
``Scaling.emulated_on`` says which, and plans show it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from fusible.quantization.casts.common import expand_scales, scale_blocks

BLOCK = 128  # the blockwise GEMM's block along the contraction


def scaled_mm_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, n: int,
                     rowwise: bool = False) -> tuple:
    """The scales ``torch._scaled_mm`` takes for an ``(m, k) @ (k, n)`` product: both 0-d,
    or one per row of ``a`` ``(m, 1)`` and one per column of ``b`` ``(1, n)``, a 0-d one
    expanded to match (both, with ``rowwise``)."""
    if scale_a.dim() == 0 and scale_b.dim() == 0 and not rowwise:
        return scale_a, scale_b
    return scale_a.expand(m, 1).contiguous(), scale_b.expand(1, n).contiguous()


def whole_contraction(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, n: int) -> bool:
    """Whether each scale (float32) holds along the whole contraction (per tensor, per
    row of ``a``, per column of ``b``): what ``torch._scaled_mm`` takes (E8M0 scales
    there would mean MX blocks)."""
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return False
    return ((scale_a.dim() == 0 or tuple(scale_a.shape) == (m, 1))
            and (scale_b.dim() == 0 or tuple(scale_b.shape) == (1, n)))


@functools.lru_cache(maxsize=None)
def native_rowwise_gemm(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` takes row-wise scales on this device type: CUDA's does;
    the CPU's since PyTorch 2.13 (2.11's takes one scale per tensor only), so it is asked,
    once, with a tiny product."""
    if device_type != "cpu":
        return True
    # Real tensors even when first asked while tracing (a fake product always "works")
    with unset_fake_temporarily(), _disable_current_modes():
        a = torch.ones((16, 16), dtype=torch.float8_e4m3fn)
        try:
            torch._scaled_mm(a, a.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)),
                             out_dtype=torch.float32)
        except RuntimeError:
            return False
    return True


@functools.lru_cache(maxsize=None)
def native_blockwise_gemm(device: torch.device) -> bool:
    """Whether ``device`` runs 1x128 / 128x128 blockwise FP8 GEMMs natively: PyTorch's
    cuBLAS path, on Hopper (compute capability 9.x) with CUDA 12.9 or later."""
    if torch.device(device).type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


def scaled_gemm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                bias=None, out_dtype: torch.dtype = torch.bfloat16,
                fast_accum: bool = False) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` in ``out_dtype``: ``a`` (M, K) and ``b``
    (K, N) FP8, each scale blocking its operand (:func:`fusible.quantization.casts.common.
    scale_blocks`). ``fast_accum`` (Hopper's faster FP8 accumulation) where the GEMM
    takes it: not the blockwise one."""
    m, n = a.shape[0], b.shape[1]
    if not (m and a.shape[1] and n):  # zero tokens or features
        y = a.new_zeros((m, n), dtype=out_dtype)
        return y if bias is None else y + bias
    if whole_contraction(scale_a, scale_b, m, n) and (
            scale_a.dim() == scale_b.dim() == 0 or native_rowwise_gemm(a.device.type)):
        return _scaled_mm(a, scale_a, b, scale_b, bias, out_dtype, fast_accum)
    kinds = _block_kinds(a, scale_a, b, scale_b)
    if kinds is not None and native_blockwise_gemm(a.device):
        y = _blockwise(a, scale_a, b, scale_b, kinds, out_dtype)
    else:
        y = _emulated(a, scale_a, b, scale_b)
    y = y if bias is None else y + bias
    return y.to(out_dtype)


def _k_major(a, b) -> tuple:
    """``a`` row-major and ``b`` column-major, the layouts Hopper's FP8 GEMMs read."""
    return (a if a.is_contiguous() else a.contiguous(),
            b if b.t().is_contiguous() else b.t().contiguous().t())


def _scaled_mm(a, scale_a, b, scale_b, bias, out_dtype, fast_accum):
    a, b = _k_major(a, b)
    epilogue = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
    # The CPU's per-tensor kernel is oneDNN's reference loop, 300x slower than its row-wise
    # one (0.3 s against 1 ms at 256x128x512): the same product, its scales applied per row
    # and column instead of as one product of the two.
    rowwise = a.device.type == "cpu" and native_rowwise_gemm("cpu")
    scale_a, scale_b = scaled_mm_scales(scale_a, scale_b, a.shape[0], b.shape[1], rowwise)
    y = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                         bias=bias if epilogue else None, out_dtype=out_dtype,
                         use_fast_accum=fast_accum)
    return y + bias if bias is not None and not epilogue else y


def _block_kinds(a, scale_a, b, scale_b):
    """``(a's, b's)`` blocks as the blockwise GEMM names them (``(1, 128)`` or ``(128,
    128)``, b's seen as (N, K)), or None where it has no such GEMM (E4M3 operands,
    float32 scales, M and N multiples of 16, not both 128x128)."""
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return None
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return None
    if scale_a.dim() != 2 or scale_b.dim() != 2 or a.shape[0] % 16 or b.shape[1] % 16:
        return None
    block_a = _gemm_block(scale_blocks(scale_a.shape, a.shape), a.shape)
    block_b = _gemm_block(scale_blocks(scale_b.t().shape, b.t().shape), b.t().shape)
    kinds = ((1, BLOCK), (BLOCK, BLOCK))
    if block_a not in kinds or block_b not in kinds or block_a == block_b == kinds[1]:
        return None
    return block_a, block_b


def _gemm_block(block: tuple, shape: tuple) -> tuple:
    """One scale over a whole dimension of at most 128 is a 128 block (a partial one)."""
    return tuple(BLOCK if b == n and 1 < n <= BLOCK else b for b, n in zip(block, shape))


def _blockwise(a, scale_a, b, scale_b, kinds, out_dtype):
    """PyTorch's blockwise GEMM (cuBLAS): the contraction padded to whole blocks, the
    scales in the layouts it reads (1x128: outer-dimension-major; 128x128: the blocks
    along the contraction padded to a multiple of 4)."""
    k = a.shape[1]
    kp = -(-k // BLOCK) * BLOCK
    if kp != k:  # zeros contribute nothing; the scales already cover the partial block
        a = torch.cat([a.contiguous(), a.new_zeros((a.shape[0], kp - k))], 1)
        b = torch.cat([b.t().contiguous(), b.new_zeros((b.shape[1], kp - k))], 1).t()
    a, b = _k_major(a, b)
    sa, ra = _v2_scale(scale_a, kinds[0])
    sb, rb = _v2_scale(scale_b.t(), kinds[1])
    return F.scaled_mm(a, b, sa, ra, sb, rb, output_dtype=out_dtype, use_fast_accum=False)


def _v2_scale(scale: torch.Tensor, kind: tuple) -> tuple:
    """``(scale, ScalingType)`` for ``F.scaled_mm`` from an operand's scales seen as
    (outer, K blocks)."""
    if kind == (1, BLOCK):
        return scale.t().contiguous().t(), F.ScalingType.BlockWise1x128
    blocks = scale.shape[1]
    padded = scale.new_ones((scale.shape[0], -(-blocks // 4) * 4))
    padded[:, :blocks] = scale
    return padded.t(), F.ScalingType.BlockWise128x128


def _emulated(a, scale_a, b, scale_b) -> torch.Tensor:
    """The operands dequantized to float32 and multiplied in float32."""
    a32 = a.float() * expand_scales(scale_a.float(), a.shape)
    b32 = b.float() * expand_scales(scale_b.float(), b.shape)
    return torch.mm(a32, b32)
