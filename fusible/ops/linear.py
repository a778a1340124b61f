"""Linear: the convenience operation that expands to BasicLinear [+ Bias]."""

from __future__ import annotations

import math

import torch
from torch import nn

from fusible.ops.base import FusibleOperation
from fusible.ops.basic_linear import BasicLinear, check_not_parallel
from fusible.ops.bias import Bias


class Linear(FusibleOperation):
    """``y = x @ weight.T + bias``, a drop-in for ``torch.nn.Linear``.

    It owns ``weight`` (out_features, in_features) and ``bias`` (out_features,)
    under those names, initialised like ``torch.nn.Linear``, so its state_dict
    keys match ``nn.Linear``'s. For planning it expands into a
    :class:`BasicLinear` and a :class:`Bias` that share these parameters, so the
    planner can fuse them (and their neighbours) like any other basic ops.

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the last dimension of input and output.
    bias : bool
        Whether to add a bias.
    tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        Reserved for tensor parallelism; only the defaults are accepted now.
    device, dtype
        Where and in which dtype to create the parameters.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 tensor_parallel_mode=None, tensor_parallel_group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        check_not_parallel("Linear", tensor_parallel_mode, sequence_parallel)
        linear = BasicLinear(in_features, out_features, device="meta")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        ops = [linear]
        if bias:
            ops.append(Bias(out_features, device="meta"))
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        # The basic ops share this module's parameter dict, so that every way of replacing
        # a parameter (assignment, load_state_dict(assign=True), .to_empty(),
        # torch.func.functional_call) reaches them. They are not submodules: no duplicate state.
        for op in ops:
            object.__setattr__(op, "_parameters", self._parameters)
        object.__setattr__(self, "_ops", tuple(ops))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise like ``torch.nn.Linear``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def basic_ops(self):
        return self._ops

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
