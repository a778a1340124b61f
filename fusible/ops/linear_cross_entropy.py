"""LinearCrossEntropy: a language model's head and its loss, ``BasicLinear`` and
``CrossEntropy`` planned as one stage each way (the joint fusion
``fusions/linear_cross_entropy.py``) that never stores the logits."""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import nn

from fusible.core import checks
from fusible.core.arg_types import DTypeArg, DeviceArg
from fusible.module import FusibleOperation
from fusible.ops.basic_linear import BasicLinear
from fusible.ops.cross_entropy import CrossEntropy
from fusible.ops.make_extra_output import MakeExtraOutput


class LinearCrossEntropy(FusibleOperation):
    """``loss = head(hidden, labels)``: ``CrossEntropy(hidden @ weight.T, labels)``
    without the logits ever stored whole.

    It expands into a :class:`BasicLinear` (no bias) and a :class:`CrossEntropy` (see it for
    the options), which the joint fusion ``LinearCrossEntropy`` plans as one stage in each
    pass: for each chunk of tokens one GEMM makes the chunk's logits, they are reduced in
    float32 to the tokens' losses and, when gradients are wanted, turned into the chunk's
    logit gradient at once, whose GEMMs give the hidden states' gradient and add to the
    weight's (float32 across chunks). For ``reduction="mean"`` or ``"sum"`` this happens
    in the forward and the backward only scales by the output gradient (three GEMMs a
    step, as an unfused head); for ``"none"`` the backward makes each chunk's logits
    again (four). The same two ops written by hand in a Sequential get the same stage.

    Parameters
    ----------
    in_features : int
        The hidden size.
    vocab_size : int
    ignore_index, reduction, label_smoothing, z_loss, chunk_size
        As :class:`~fusible.ops.CrossEntropy`'s.
    return_logits : bool
        Also return the logits: ``loss, logits = head(hidden, labels)`` (gradients flow
        through both). They are then made whole and kept, as an unfused head's: the head
        expands into ``BasicLinear``, ``MakeExtraOutput`` and ``CrossEntropy``, which the
        joint fusion does not match.
    device, dtype
        Where and in which dtype to create the weight.

    Attributes
    ----------
    weight : Parameter
        ``(vocab_size, in_features)``, as ``nn.Linear(in_features, vocab_size,
        bias=False)``'s (Hugging Face's ``lm_head.weight``); may be tied to an embedding.
    """

    attribute_checks = {"in_features": checks.positive_int("in_features"),
                        "vocab_size": checks.positive_int("vocab_size"),
                        "return_logits": checks.boolean("return_logits")}
    _ops: tuple  # (BasicLinear, [MakeExtraOutput,] CrossEntropy), past nn.Module's __setattr__

    def __init__(self, in_features: int, vocab_size: int, *, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 chunk_size: Optional[int] = None, return_logits: bool = False,
                 device: DeviceArg = None, dtype: DTypeArg = None):
        super().__init__()
        self.in_features, self.vocab_size = in_features, vocab_size
        self.return_logits = return_logits
        loss = CrossEntropy(ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing, z_loss=z_loss,
                            chunk_size=chunk_size)
        linear = BasicLinear(in_features, vocab_size, device="meta")
        self.weight = nn.Parameter(torch.empty(vocab_size, in_features, device=device,
                                               dtype=dtype))
        logits = (MakeExtraOutput(),) if return_logits else ()
        object.__setattr__(self, "_ops", (linear, *logits, loss))
        self._link_ops()
        self.reset_parameters()

    def _link_ops(self) -> None:
        linear = self._ops[0]
        object.__setattr__(linear, "_parameters", self._parameters)
        object.__setattr__(linear, "_buffers", self._buffers)  # FP8 scaling states
        object.__setattr__(linear, "_fusible_owner", weakref.ref(self))

    def __setstate__(self, state):
        super().__setstate__(state)
        self._link_ops()  # pickling drops the weak links to this module

    def reset_parameters(self) -> None:
        """As ``torch.nn.Linear(in_features, vocab_size, bias=False)``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    @property
    def loss(self) -> CrossEntropy:
        """The :class:`CrossEntropy` op (its options: ``head.loss.reduction``, ...)."""
        return self._ops[-1]

    def basic_ops(self):
        return self._ops

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, "
                f"{self.loss._options_text()}"
                + (", return_logits=True" if self.return_logits else ""))
