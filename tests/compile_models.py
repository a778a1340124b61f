"""Models covering every op and built-in fusion, shared by the compile tests."""

import torch
from torch import nn

from fusible import ops


def mlp():
    """ForwardLinearBias, BackwardLinearBias, BackwardActivationBias (GELU tanh)."""
    return ops.Sequential(ops.Linear(8, 16), ops.GELU(approximate="tanh"), ops.Linear(16, 8)), 0


def relu_block():
    """ForwardLinearBiasActivation (ReLU in training), BackwardActivationBias (ReLU)."""
    return ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16), ops.ReLU(),
                          ops.BasicLinear(16, 8)), 0


def residual():
    """LayerNorm, SiLU, ForwardLinearBiasAdd, MakeExtraOutput/AddExtraInput."""
    return ops.Sequential(ops.MakeExtraOutput(), ops.LayerNorm(8), ops.Linear(8, 16), ops.SiLU(),
                          ops.Linear(16, 8), ops.AddExtraInput()), 1


def branch():
    """BackwardLinearAdd, SwiGLU, RMSNorm, exact GELU, ConstantScale, Identity, Reshape."""
    return ops.Sequential(ops.RMSNorm(8), ops.MakeExtraOutput(), ops.BasicLinear(8, 32),
                          ops.SwiGLU(), ops.GELU(), ops.ConstantScale(0.5), ops.Identity(),
                          ops.Reshape((-1, 4, 4)), ops.Reshape((-1, 16)),
                          ops.BasicLinear(16, 8)), 0


def split():
    """An ordinary module between two groups of fusible ops."""
    return ops.Sequential(ops.BasicLinear(8, 16), nn.Tanh(), ops.Bias(16), ops.GELU(),
                          ops.BasicLinear(16, 8)), 0


def recompute():
    """RecomputeNormLinear (a joint fusion) over RMSNorm + BasicLinear and over LayerNorm +
    Linear, around the residual branch."""
    return ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(8, recompute_output=True),
                          ops.BasicLinear(8, 32), ops.SwiGLU(),
                          ops.LayerNorm(16, recompute_output=True), ops.Linear(16, 8),
                          ops.AddExtraInput()), 1


MODELS = {f.__name__: f for f in (mlp, relu_block, residual, branch, split, recompute)}


def inputs(num_extra: int, dtype=torch.float32, tokens=(2, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, 8, generator=g).to(dtype).requires_grad_()
    extras = [torch.randn(*tokens, 8, generator=g).to(dtype).requires_grad_()
              for _ in range(num_extra)]
    return x, extras


def outputs_of(out):
    return out if isinstance(out, tuple) else (out,)
