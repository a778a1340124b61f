"""``main_grad`` at run time: the float32 gradients of the plan's main-grad parameters are
added into their ``main_grad`` buffers after the backward, and autograd gets None for
them, or, eagerly, where Megatron's DDP tracks the parameter (``grad_added_to_main_grad``),
the flag set and a dummy gradient for its hooks (``planning/features/main_grad.py``)."""

from __future__ import annotations

import torch

from fusible.runtime.executor import Call
from fusible.runtime.features.base import RuntimeFeature


class MainGradRuntime(RuntimeFeature):
    """The buffers are the node's feature tensors: read from the parameters (before
    ``torch.autocast`` swaps in cast copies), graph inputs when compiled."""

    name = "main_grad"

    def count(self, record) -> int:
        return len(record.params)

    def call_tensors(self, record, plan, runner, x) -> list:
        return [main_grad_of(op, name, op.param(name)) for op, name in record.owners]

    def graph_tensors(self, runner, ops, params) -> list:
        owners = [(op, name) for op in ops for name in op.param_names]
        return [main_grad_of(op, name, params[k], traced=True)
                for k, (op, name) in enumerate(owners)
                if name in op.main_grad_params and params[k].requires_grad]

    def end_backward(self, record, call: Call) -> None:
        grads = call.grad_params
        for k, buffer, (op, name) in zip(record.params, call.tensors[self.name],
                                          record.owners):
            g = grads[k]
            if g is None:
                continue
            if g.dtype != torch.float32:
                raise RuntimeError(f"the backward stage covering {op.describe()} returned a "
                                   f"{g.dtype} gradient for its {name}, which accumulates into "
                                   f"main_grad: compute it in float32 (gemm_backward_args(..., "
                                   f"linear.wgrad_dtype))")
            buffer.add_(g)
            grads[k] = None if call.traced else _megatron_dummy(op.param(name))


FEATURE = MainGradRuntime()


def main_grad_of(op, name: str, param, traced: bool = False):
    """``param.main_grad``, checked: a tensor of the parameter's shape on its device."""
    where = f"{op.describe()}: its {name} accumulates into main_grad"
    buffer = getattr(param, "main_grad", None)
    if not isinstance(buffer, torch.Tensor):
        raise RuntimeError(f"{where}, which {name} lacks (got {buffer!r}): set "
                           f"{name}.main_grad = torch.zeros_like({name}, dtype=torch.float32)")
    if buffer.shape != param.shape or buffer.device != param.device \
            or not buffer.is_floating_point():
        raise RuntimeError(f"{where}, a floating-point tensor of shape {tuple(param.shape)} on "
                           f"{param.device}; got {buffer.dtype} of shape {tuple(buffer.shape)} "
                           f"on {buffer.device}")
    if traced and hasattr(param, "grad_added_to_main_grad"):
        raise RuntimeError(f"{where} with Megatron's grad_added_to_main_grad flag, which "
                           f"the backward sets in Python: a compiled graph would not set it "
                           f"again each step; run this model eagerly")
    return buffer


def _megatron_dummy(param):
    """None, or for a parameter Megatron's DDP tracks, its flag set and a dummy gradient
    (zeros with ``zero_out_wgrad``)."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    make = torch.zeros_like if getattr(param, "zero_out_wgrad", False) else torch.empty_like
    return make(param, memory_format=torch.contiguous_format)
