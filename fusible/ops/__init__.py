"""Fusible operations, one per file, and the Sequential pipeline that plans and runs them."""

from fusible.core.context import OperationContext
from fusible.core.fused import FusedOperation
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation, FusibleOperation, Sequential
from fusible.ops.add_extra_input import AddExtraInput
from fusible.ops.all_gather import AllGather
from fusible.ops.all_to_all import AllToAll, AllToAllEqual
from fusible.ops.all_reduce import AllReduce
from fusible.ops.basic_linear import BasicLinear
from fusible.ops.bias import Bias
from fusible.ops.constant_scale import ConstantScale
from fusible.ops.attention import Attention
from fusible.ops.cross_entropy import CrossEntropy
from fusible.ops.dropout import Dropout
from fusible.ops.gelu import GELU
from fusible.ops.glu import GEGLU, GLU, QGEGLU, ReGLU, SReGLU
from fusible.ops.grouped_linear import GroupedLinear
from fusible.ops.permute_rows import PermuteRows
from fusible.ops.identity import Identity
from fusible.ops.l2_normalization import L2Normalization
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.linear import Linear
from fusible.ops.linear_cross_entropy import LinearCrossEntropy
from fusible.ops.make_extra_output import MakeExtraOutput
from fusible.ops.qgelu import QGELU
from fusible.ops.quantize import Quantize
from fusible.ops.reduce_scatter import ReduceScatter
from fusible.ops.relu import ReLU
from fusible.ops.reshape import Reshape
from fusible.ops.resume_from_channel import ResumeFromChannel
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.scaled_glu import (ScaledClampedSwiGLU, ScaledGEGLU, ScaledGLU, ScaledQGEGLU,
                                    ScaledReGLU, ScaledSiTUGLU, ScaledSReGLU, ScaledSwiGLU)
from fusible.ops.silu import SiLU
from fusible.ops.srelu import SReLU
from fusible.ops.swiglu import ClampedSwiGLU, SiTUGLU, SwiGLU

__all__ = [
    "AddExtraInput", "AllGather", "AllReduce", "AllToAll", "AllToAllEqual", "Attention",
    "BackwardResult", "BasicLinear", "BasicOperation", "Bias", "ClampedSwiGLU",
    "ConstantScale", "CrossEntropy", "Dropout", "ForwardResult", "FusedOperation",
    "FusibleOperation", "GEGLU", "GELU", "GLU", "GroupedLinear", "Identity",
    "L2Normalization", "LayerNorm", "Linear", "LinearCrossEntropy", "MakeExtraOutput",
    "OperationContext", "PermuteRows", "QGEGLU", "QGELU", "Quantize", "RMSNorm", "ReGLU",
    "ReLU", "ReduceScatter", "Reshape", "ResumeFromChannel", "SReGLU", "SReLU",
    "ScaledClampedSwiGLU", "ScaledGEGLU", "ScaledGLU",
    "ScaledQGEGLU", "ScaledReGLU", "ScaledSReGLU", "ScaledSiTUGLU", "ScaledSwiGLU", "Sequential",
    "SiLU", "SiTUGLU", "SwiGLU",
]
