"""Block scalings (1x128 tiles, 128x128 blocks, MX's 1x32 power-of-two scales): the casts
block by block against the per-tensor cast and FP64, the scales' special values, the
Float8Tensor of block-scaled data (dequantized, viewed, transposed, multiplied) and the
FP8 GEMM dispatch (emulated here: the CPU has no blockwise GEMM)."""

import math

import pytest
import torch

import fusible

from fusible.quantization.casts import blocks as block_cast
from fusible.quantization.casts.common import FP8_MAX, expand_scales, scale_blocks
from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
from fusible.quantization.gemm import scaled_gemm
from fusible.quantization.scalings.base import registered_scalings, scaling_named, scaling_of
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.tensor.quantize import quantize_scaled
from fusible.testing import snr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCKED = ("blockwise_1x128", "blockwise_128x128", "mx_1x32")


def _outlier_rows(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** torch.randint(-8, 9, (rows, 1), generator=gen)
    return torch.randn(rows, cols, generator=gen) * magnitudes


def _block_views(x, block):
    """``[((i, j), x's block)]`` for a (rows, cols) block shape, ragged edges included."""
    br, bc = block
    return [((i, j), x[i * br:(i + 1) * br, j * bc:(j + 1) * bc])
            for i in range(math.ceil(x.shape[0] / br)) for j in range(math.ceil(x.shape[1] / bc))]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_each_block_is_the_per_tensor_cast_of_that_block(block, fp8_dtype):
    x = _outlier_rows(200, 300, 0)  # ragged in both dimensions
    data, scale_inv = block_cast._cast_blocks_torch(x, fp8_dtype, block)
    assert scale_inv.shape == (math.ceil(200 / block[0]), math.ceil(300 / block[1]))
    for (i, j), part in _block_views(x, block):
        want_data, want_scale_inv = cast_tensorwise_torch(part, fp8_dtype)
        got = dict(_block_views(data, block))[(i, j)]
        assert torch.equal(got.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(scale_inv[i, j], want_scale_inv)


def test_mx_scales_are_the_power_of_two_at_or_above_the_block_amax():
    """OCP MX with the scale rounded up: ``2^ceil(log2(amax / 448))`` as E8M0, so that the
    block's largest value lands in [224, 448] and nothing saturates; the data is the values
    divided by that power of two (exact), rounded once."""
    x = _outlier_rows(64, 96, 1)
    data, scale_inv = block_cast._cast_blocks_torch(x, E4M3, (1, 32), power2=True)
    assert scale_inv.dtype == torch.float8_e8m0fnu and scale_inv.shape == (64, 3)
    amax = x.abs().view(64, 3, 32).amax(2).double()
    s = scale_inv.double()
    assert torch.equal(s, torch.exp2(torch.ceil(torch.log2(amax / 448))))
    want = (x.double() / expand_scales(s, x.shape)).to(E4M3)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert (data.float().abs().view(64, 3, 32).amax(2) >= 224).all()


@pytest.mark.parametrize("power2", [False, True])
def test_special_blocks_stay_in_their_block(power2):
    """An all-zero block gets scale 1; a NaN or an inf makes its own block NaN (loudly),
    and no other."""
    x = torch.randn(4, 256)
    x[0, :128] = 0.0
    x[1, 5] = float("nan")
    x[2, 130] = float("inf")
    data, scale_inv = block_cast._cast_blocks_torch(x, E4M3, (1, 128), power2)
    s = scale_inv.float()
    assert s[0, 0] == 1.0 and (data[0, :128].float() == 0).all()
    assert s[1, 0].isnan() and data[1, :128].float().isnan().all() and s[1, 1].isfinite()
    deq = data.float() * expand_scales(s, x.shape)
    assert deq[2, 128:].isnan().all() and deq[2, :128].isfinite().all()
    assert deq[3].isfinite().all()


def test_tiny_blocks_stay_finite():
    x = torch.full((2, 128), 1e-40)
    for power2 in (False, True):
        data, scale_inv = block_cast._cast_blocks_torch(x, E4M3, (1, 128), power2)
        deq = data.float() * scale_inv.float()
        assert deq.isfinite().all() and (deq > 0).all(), power2


@pytest.mark.parametrize("name", BLOCKED)
def test_transposed_copy_is_scaled_along_its_own_rows(name):
    """Tiles: the copy is the cast of ``x.T`` (its tiles run along the tokens, as wgrad
    contracts); square blocks: the same data and scales, transposed."""
    scaling = scaling_named(name)
    x = _outlier_rows(160, 96, 2)
    data, scale_inv, t, t_scale_inv = scaling.cast(x, E4M3, True, True)
    if name == "blockwise_128x128":
        assert torch.equal(t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
        assert torch.equal(t_scale_inv, scale_inv.t())
    else:
        want = scaling.cast(x.t().contiguous(), E4M3)
        assert torch.equal(t.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(t_scale_inv.float(), want[1].float())
    only_t = scaling.cast(x, E4M3, False, True)
    assert only_t[0] is None and torch.equal(only_t[2].view(torch.uint8), t.view(torch.uint8))


def test_the_shapes_say_which_block_a_scale_covers():
    assert scale_blocks((130, 2), (130, 200)) == (1, 128)
    assert scale_blocks((2, 2), (200, 130)) == (128, 128)
    assert scale_blocks((64, 3), (64, 96)) == (1, 32)
    assert scale_blocks((64, 1), (64, 96)) == (1, 96)
    assert scale_blocks((), (5, 7)) == (5, 7)
    with pytest.raises(ValueError, match="do not block a tensor"):
        scale_blocks((3,), (3, 4))
    x = torch.randn(256, 384)  # a row of several tiles (one tile is one scale per row)
    for name, scaling in registered_scalings().items():
        state = torch.zeros(scaling.state_size) if scaling.stateful else None
        data, scale_inv = scaling.cast(x, E4M3, state=state)[:2]
        # a stateful per-tensor scaling's scales are tensorwise's (one per tensor)
        want = scaling_named("tensorwise") if scaling.stateful else scaling
        assert scaling_of(data, scale_inv) is want, name


@pytest.mark.parametrize("name", BLOCKED)
def test_block_scaled_float8_tensor_dequantizes_views_and_transposes(name):
    """Without the transposed copy, ``.t()`` is the data seen transposed; with it, the
    copy (scaled along its own rows for tiles, so close, not equal)."""
    x = _outlier_rows(256, 128, 3)
    scaling = scaling_named(name)
    q = quantize_scaled(x, scaling, E4M3)
    values = q.dequantize()
    assert torch.equal(q.t().dequantize(), values.t())
    assert torch.equal(q.t().t().dequantize(), values)
    assert torch.equal(q.clone().dequantize(), values)
    assert torch.equal(q.view(2, 128, 128).dequantize(), values.view(2, 128, 128))
    assert torch.equal(q[3:7].dequantize(), values[3:7])  # dequantized, then sliced
    assert snr_db(values, x) > 25
    with_copy = quantize_scaled(x, scaling, E4M3, columnwise=True)
    t, t_scale_inv = scaling.cast(x, E4M3, False, True)[2:]
    copy_values = t.float() * expand_scales(t_scale_inv.float(), t.shape)
    assert torch.equal(with_copy.t().dequantize(), copy_values)


@pytest.mark.parametrize("name", BLOCKED)
def test_block_scaled_gemm_is_the_product_of_the_dequantized_operands(name):
    """Emulated (no blockwise GEMM on the CPU): float32 products of the dequantized
    operands, exact on these operands up to float32 accumulation."""
    scaling = scaling_named(name)
    a = scaling.cast(_outlier_rows(48, 256, 4), E4M3)
    w = scaling.cast(_outlier_rows(64, 256, 5), E4M3)
    bias = torch.randn(64, dtype=torch.bfloat16)
    y = scaled_gemm(a[0], a[1], w[0].t(), w[1].t(), bias, torch.bfloat16)
    want = ((a[0].double() * expand_scales(a[1].double(), a[0].shape))
            @ (w[0].double() * expand_scales(w[1].double(), w[0].shape)).t() + bias.double())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, want.to(torch.bfloat16)) or (y.double() - want).abs().max() <= \
        want.abs().max() * 2 ** -7
    qa = Float8Tensor(a[0], a[1], torch.bfloat16)
    qw = Float8Tensor(w[0], w[1], torch.bfloat16)
    assert torch.equal(qa @ qw.t(), scaled_gemm(a[0], a[1], w[0].t(), w[1].t(), None,
                                                torch.bfloat16))


def test_the_fake_cast_has_the_real_shapes():
    """The custom op's fake (what a compiled graph is traced with) against the real op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(200, 300)
    op = torch.ops.fusible.cast_to_fp8_blocks.default
    for group, square, power2 in ((128, False, False), (128, True, False), (32, False, True)):
        real = op(x, E4M3, group, square, power2, True, True)
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), E4M3, group, square, power2, True, True)
        assert [(t.shape, t.dtype, t.stride()) for t in real] == \
            [(t.shape, t.dtype, t.stride()) for t in fake]


def test_bad_block_casts_say_what():
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        block_cast.cast_blocks(torch.randn(4, 4), torch.float16, 128, False, False)
    with pytest.raises(ValueError, match="neither the data nor its transpose"):
        block_cast.cast_blocks(torch.randn(4, 4), E4M3, 128, False, False, False, False)
    with pytest.raises(ValueError, match="takes a 2-D tensor"):
        block_cast.cast_blocks(torch.randn(2, 4, 4), E4M3, 128, False, False)
    assert FP8_MAX[E4M3] == 448.0


MANTISSA_BITS = {E4M3: 3, E5M2: 2}
DELAYED = fusible.DelayedScaling().granularity  # registers delayed scaling's scaling


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("name", list(registered_scalings()))
def test_quantization_snr_floor_follows_from_the_format(name, fp8_dtype):
    """Rounding to ``m`` mantissa bits errs by at most 2^-(m+1) of each value in the
    normal range, so the SNR of a cast is at least 6.02 (m + 1) dB (24.1 dB for E4M3, 18.1
    for E5M2) wherever the scales keep values off the subnormals. On rows 2^-8 to 2^8
    apart, scales per row or per tile of a row do; one scale over many rows (per tensor,
    128x128 blocks) leaves E4M3's small rows to its subnormals (E5M2's range holds them),
    the reason for the others. A stateful scaling (delayed) casts twice: the second cast
    scales by the amax the first recorded."""
    x = _outlier_rows(256, 512, 7)
    scaling = scaling_named(name)
    state = torch.zeros(scaling.state_size) if scaling.stateful else None
    for _ in range(2 if scaling.stateful else 1):
        q = quantize_scaled(x, scaling, fp8_dtype, state=state).dequantize()
    floor = 6.02 * (MANTISSA_BITS[fp8_dtype] + 1)
    small = x.abs().amax(1) < 2.0 ** -5
    if (scaling.per_tensor or name == "blockwise_128x128") and fp8_dtype == E4M3:
        assert snr_db(q[small], x[small]) < floor - 3
    else:
        assert snr_db(q, x) > floor and snr_db(q[small], x[small]) > floor


def test_mx_scales_of_subnormal_quotients_do_not_saturate():
    """``amax / 448`` below 2^-126 (float32's subnormals): the scale is still the power of
    two at or above it (2^-126 for 1.5 * 2^-127; E8M0's least, 2^-127, below that)."""
    amax = torch.tensor([448 * 1.5 * 2.0 ** -127, 448 * 2.0 ** -127, 448 * 2.0 ** -130])
    assert block_cast._power2_scale_inv(amax, E4M3).tolist() == [2.0 ** -126, 2.0 ** -127,
                                                                2.0 ** -127]
    x = torch.full((1, 32), 448 * 1.5 * 2.0 ** -127)
    data, scale_inv = block_cast._cast_blocks_torch(x, E4M3, (1, 32), power2=True)
    assert (data.float() < 448).all()


def test_the_blockwise_gemm_takes_partial_blocks():
    """Which products PyTorch's blockwise GEMM can take (where the device has it): 1x128
    tiles against 128x128 blocks or 1x128 tiles, one scale over a dimension of at most 128
    being a partial block; not M or N off multiples of 16, nor MX's E8M0 scales."""
    from fusible.quantization.gemm import _block_kinds
    tiles, blocks = scaling_named("blockwise_1x128"), scaling_named("blockwise_128x128")
    x, w = torch.randn(64, 96), torch.randn(256, 96)  # K of one partial block
    xq, wq = tiles.cast(x, E4M3), blocks.cast(w, E4M3)
    assert _block_kinds(xq[0], xq[1], wq[0].t(), wq[1].t()) == ((1, 128), (128, 128))
    x2 = torch.randn(512, 300)
    xq2, wq2 = tiles.cast(x2, E4M3, True, True), tiles.cast(torch.randn(64, 512), E4M3)
    assert _block_kinds(xq2[2], xq2[3], wq2[0].t(), wq2[1].t()) is None  # 300 rows
    assert _block_kinds(wq2[0], wq2[1], xq2[0][:, :256].contiguous(),
                        tiles.cast(x2[:, :256].contiguous(), E4M3)[1]) is None  # b's tiles along N
    mx = scaling_named("mx_1x32").cast(x, E4M3)
    assert _block_kinds(mx[0], mx[1], wq[0].t(), wq[1].t()) is None
