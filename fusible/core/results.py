"""What stages return, and which gradients a basic op must produce."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

Tensor = torch.Tensor


@attrs.define
class ForwardResult:
    """What a forward stage computes.

    Attributes
    ----------
    output : Tensor
        Input of the next stage.
    extra_outputs : tuple of Tensor
        Outputs branched off by covered ``MakeExtraOutput`` ops, in order.
    aux : tuple of Tensor
        Fresh tensors computed only to be saved for backward (e.g. LayerNorm's
        mean and rstd); ``save_for_backward`` picks them up.
    """

    output: Tensor
    extra_outputs: tuple = ()
    aux: tuple = ()


@attrs.define
class BackwardResult:
    """What a backward stage computes.

    Attributes
    ----------
    grad_input : Tensor or None
        Gradient w.r.t. the stage input; None where it is not needed.
    grad_params : tuple of (Tensor or None)
        Gradients of the covered basic ops' parameters, flat, in the order of
        ``fusible_params()`` of each covered op in forward order.
    grad_extra_inputs : tuple of (Tensor or None)
        Gradients of the extra inputs consumed by covered ops, in forward order.
    """

    grad_input: Optional[Tensor]
    grad_params: tuple = ()
    grad_extra_inputs: tuple = ()


@attrs.frozen
class OpGradNeeds:
    """Which gradients one basic op must produce; fixed for a plan.

    Attributes
    ----------
    input : bool
        The gradient w.r.t. the op's input is needed (something upstream
        requires grad).
    params : tuple of bool
        Per parameter in ``fusible_params()`` order.
    extra_inputs : tuple of bool
        Per extra input the op consumes.
    """

    input: bool = False
    params: tuple = ()
    extra_inputs: tuple = ()

    @property
    def any(self) -> bool:
        """Whether this op takes part in the backward pass at all."""
        return self.input or any(self.params) or any(self.extra_inputs)
