"""Linear: the convenience operation that expands to BasicLinear [+ Bias]."""

from __future__ import annotations

import math
from typing import Optional
import weakref

import torch
from torch import nn

from fusible.core.arg_types import DTypeArg, DeviceArg, GroupArg, ParallelModeArg
from fusible.core import checks
from fusible.module import FusibleOperation
from fusible.ops.basic_linear import BasicLinear, init_linear_weight, init_shard_, linear_shard
from fusible.ops.bias import Bias
from fusible.quantization.params import fp8_parameter


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
        As :class:`BasicLinear`; ``weight`` and (column) ``bias`` hold this rank's
        shards. Row-parallel layers add their full bias once, after the reduction (a
        separate Bias op; with sequence_parallel its gradient is summed over the group).
    device, dtype
        Where and in which dtype to create the parameters.
    accumulate_into_main_grad : bool
        As :class:`BasicLinear`: the weight's gradient goes into ``weight.main_grad``
        (the bias's to autograd as usual). An attribute too.
    fp8 : bool, optional
        As :class:`BasicLinear`: this GEMM in FP8 (True), in high precision (False), or as
        the recipe's ``gemm_policy`` decides (None). An attribute too.
    """

    attribute_checks = {"in_features": checks.positive_int("in_features"),
                        "out_features": checks.positive_int("out_features")}
    _ops: tuple[BasicLinear, Bias]  # set past nn.Module's __setattr__ (not submodules)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 tensor_parallel_mode: ParallelModeArg = None,
                 tensor_parallel_group: GroupArg = None, sequence_parallel: bool = False,
                 device: DeviceArg = None, dtype: DTypeArg = None,
                 accumulate_into_main_grad: bool = False, fp8: Optional[bool] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # checked here
        checks.boolean("bias")("Linear", bias)
        linear = BasicLinear(in_features, out_features, tensor_parallel_mode=tensor_parallel_mode,
                             tensor_parallel_group=tensor_parallel_group,
                             sequence_parallel=sequence_parallel, device="meta",
                             accumulate_into_main_grad=accumulate_into_main_grad, fp8=fp8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(torch.empty(linear.weight.shape, device=device, dtype=dtype))
        column = tensor_parallel_mode == "column"
        bias_sp = tensor_parallel_mode == "row" and sequence_parallel
        # The Bias op exists either way: assigning a bias later (or None) works as on
        # nn.Linear, and basic_ops() follows.
        add_bias = Bias(out_features, tensor_parallel=column, sequence_parallel=bias_sp,
                        tensor_parallel_group=tensor_parallel_group if column or bias_sp
                        else None, device="meta")
        if bias:
            self.bias = nn.Parameter(torch.empty(add_bias.bias.shape, device=device,
                                                dtype=dtype))
        else:
            self.register_parameter("bias", None)
        ops = [linear, add_bias]
        object.__setattr__(self, "_ops", tuple(ops))
        self._link_ops()
        self.reset_parameters()
        self.weight = fp8_parameter(self.weight)  # FP8 inside quantized_model_init()

    def _link_ops(self) -> None:
        for op in self._ops:
            object.__setattr__(op, "_parameters", self._parameters)
            object.__setattr__(op, "_buffers", self._buffers)  # FP8 scaling states
            object.__setattr__(op, "_fusible_owner", weakref.ref(self))  # see param()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._link_ops()  # pickling drops the weak links to this module

    def reset_parameters(self) -> None:
        """Initialise like ``torch.nn.Linear`` (of the global sizes)."""
        linear = self._ops[0]
        init_linear_weight(self.weight, linear)
        if self.bias is not None:
            init_shard_(self.bias, (self.out_features,), linear_shard(linear)[:1],
                        1 / math.sqrt(self.in_features))

    @property
    def fp8(self) -> Optional[bool]:
        """Its GEMM in FP8 (True), in high precision (False), or as the recipe's
        ``gemm_policy`` decides (None): :class:`BasicLinear`'s ``fp8``."""
        return self._ops[0].fp8

    @fp8.setter
    def fp8(self, value: Optional[bool]) -> None:
        self._ops[0].fp8 = value

    @property
    def accumulate_into_main_grad(self) -> bool:
        return self._ops[0].accumulate_into_main_grad

    @accumulate_into_main_grad.setter
    def accumulate_into_main_grad(self, value: bool) -> None:
        self._ops[0].accumulate_into_main_grad = value

    def basic_ops(self):
        has_bias = (self._parameters.get("bias") is not None
                    or "bias" in getattr(self, "parametrizations", {}))
        return self._ops if has_bias else self._ops[:1]

    def extra_repr(self) -> str:
        tp = self._ops[0].parallel
        mode = (f", tensor_parallel_mode={tp.mode!r}, sequence_parallel={tp.sequence_parallel}"
                if tp.mode else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{mode}")
