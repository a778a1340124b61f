"""Fusible operations and the Sequential pipeline that plans and runs them."""

from fusible.ops.activation import GELU, ReLU, SiLU, SwiGLU
from fusible.ops.base import (BackwardResult, BasicOperation, ForwardResult, FusedOperation,
                              FusibleOperation, OperationContext)
from fusible.ops.basic_linear import BasicLinear
from fusible.ops.bias import Bias
from fusible.ops.collectives import AllGather, AllReduce, ReduceScatter
from fusible.ops.constant_scale import ConstantScale
from fusible.ops.extra_io import AddExtraInput, MakeExtraOutput
from fusible.ops.identity import Identity
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.linear import Linear
from fusible.ops.quantize import Quantize
from fusible.ops.reshape import Reshape
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.sequential import Sequential

__all__ = [
    "AddExtraInput", "AllGather", "AllReduce", "BackwardResult", "BasicLinear", "BasicOperation", "Bias", "ConstantScale",
    "ForwardResult", "FusedOperation", "FusibleOperation", "GELU", "Identity", "LayerNorm",
    "Linear", "MakeExtraOutput", "OperationContext", "Quantize", "RMSNorm", "ReLU", "ReduceScatter", "Reshape", "SiLU",
    "Sequential", "SwiGLU",
]
