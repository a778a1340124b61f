"""FP8 constants written from the OCP FP8 formats, not taken from fusible, to catch wrong ones."""

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# OCP 8-bit Floating Point Specification (OFP8) 1.0. E4M3: bias 7, no infinities, only
# S.1111.111 is NaN, so the largest finite value is 1.75 * 2**8. E5M2: bias 15, IEEE-like
# (exponent 11111 is inf/NaN), so the largest finite value is 1.75 * 2**15.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
MANTISSA_BITS = {E4M3: 3, E5M2: 2}

# Typos here would make every test that uses them vacuous: check them against PyTorch's
# dtypes (which implement the same formats) when imported.
for _dtype, _max in FP8_MAX.items():
    assert torch.finfo(_dtype).max == _max, (_dtype, torch.finfo(_dtype).max)
    assert torch.finfo(_dtype).eps == 2.0 ** -MANTISSA_BITS[_dtype], _dtype
