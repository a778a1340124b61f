"""A converted Hugging Face causal LM's training loss without its logits:
``fusible.convert(model, fuse_loss=True)``.

Hugging Face's ``*ForCausalLM`` makes the logits of every token (``(tokens, vocab)`` in
bf16, then a float32 copy for the loss: at Llama-3's vocabulary and 8192 tokens, 2 and 4
GiB, and their gradients) before the cross-entropy. With ``fuse_loss=True`` a training
call given ``labels`` computes the same loss (the labels shifted as Hugging Face's
``ForCausalLMLoss`` shifts them, its mean over the counted tokens or its sum over
``num_items_in_batch``) with :class:`fusible.ops.LinearCrossEntropy` on the model's own
``lm_head`` weight, a chunk of tokens at a time, and returns ``logits=None``, as
Liger-Kernel's fused loss does. Every other call (evaluation, no labels,
``logits_to_keep``, ``shift_labels``, ``return_dict=False``, a loss function of another
kind) runs the model's own forward; the reasons are counted in ``model.forward.fallbacks``.

The families whose forward is exactly that (the base model, ``lm_head``, the loss
function): Llama, Mistral, Qwen2 and Qwen3 from transformers."""

from __future__ import annotations

import collections
import sys
from typing import Any, Optional, cast

import torch
from torch import nn

from fusible.models.call_arguments import named_arguments, read_ahead
from fusible.models.installed_forward import RUN_HOOKS, InstalledForward
from fusible.module import Sequential
from fusible.ops.linear import Linear
from fusible.ops.linear_cross_entropy import LinearCrossEntropy

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_IGNORE = -100  # ForCausalLMLoss's ignore_index
_BASE_ONLY = frozenset({"labels", "num_items_in_batch", "logits_to_keep"})


def fuse_causal_lm_loss(model: nn.Module) -> Optional[str]:
    """Install :class:`FusedLossForward` on ``model`` if it is a causal LM of a known
    family; the report's note, or None for other modules."""
    cls = type(model)
    parts = cls.__module__.split(".")
    if not (len(parts) > 2 and parts[:2] == ["transformers", "models"]
            and parts[2] in _FAMILIES and cls.__name__.endswith("ForCausalLM")):
        return None
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or getattr(head, "bias", None) is not None or "forward" in model.__dict__:
        return None
    model.forward = forward = FusedLossForward(model)
    forward.bind(weight)
    return ("training calls with labels: the loss by LinearCrossEntropy on lm_head's "
            "weight, logits=None (fuse_loss=True)")


class FusedLossForward(InstalledForward):
    """The forward :func:`fuse_causal_lm_loss` installs (see the module notes).

    Attributes
    ----------
    fallbacks : collections.Counter
        Why training calls with labels ran the model's own forward, and how many.
    """

    _copied = ("heads",)  # a copy's heads hold the copied model's lm_head weight

    def __init__(self, model: nn.Module):
        super().__init__(model)
        read_ahead(type(model))
        self.output = getattr(sys.modules[type(model).__module__], "CausalLMOutputWithPast")
        fields = getattr(self.output, "__dataclass_fields__", {})
        self.cache_field = "cache" if "cache" in fields else "past_key_values"
        self.heads: dict = {}  # reduction -> a LinearCrossEntropy holding lm_head's weight
        self.fallbacks: collections.Counter = collections.Counter()

    def bind(self, weight: torch.Tensor) -> None:
        """Hold the model's ``lm_head`` weight (before any call: a compiled first call then
        traces no rebinding; unpickled, the model is not whole when this is built)."""
        self._head("mean", weight)

    def __call__(self, *args, **kwargs):
        model = self._owner()
        named = named_arguments(model, args, kwargs)
        if named is None or not model.training or named.get("labels") is None:
            return type(model).forward(model, *args, **kwargs)
        why = _fallback_reason(model, named)
        if why is not None:
            self.fallbacks[why] += 1
            return type(model).forward(model, *args, **kwargs)
        labels, items = named["labels"], named.get("num_items_in_batch")
        outputs = model.model(**{k: v for k, v in named.items() if k not in _BASE_ONLY})
        loss = self._loss(model.lm_head, outputs.last_hidden_state, labels, items)
        cache = getattr(outputs, self.cache_field, None)
        return self.output(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                           attentions=outputs.attentions, **{self.cache_field: cache})

    def _loss(self, lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
              items: Any) -> torch.Tensor:
        """ForCausalLMLoss of ``lm_head(hidden)`` against ``labels``, each token's label
        the next token's."""
        shifted = torch.nn.functional.pad(labels, (0, 1), value=_IGNORE)[..., 1:]
        reduction = "mean" if items is None else "sum"
        head = self._head(reduction, cast(torch.Tensor, lm_head.weight))
        self._follow(head, lm_head)
        loss = head(hidden.reshape(-1, hidden.shape[-1]), shifted.reshape(-1).to(hidden.device))
        if items is not None:
            loss = loss / (items.to(loss.device) if isinstance(items, torch.Tensor) else items)
        return loss

    def _head(self, reduction: str, weight: torch.Tensor) -> Sequential:
        """The head of ``reduction`` holding ``weight``, the model's own parameter (not a
        child of the model: its parameters and state dict stay as they were)."""
        head = self.heads.get(reduction)
        if head is None:
            vocab, hidden = weight.shape
            head = self.heads[reduction] = Sequential(LinearCrossEntropy(
                hidden, vocab, ignore_index=_IGNORE, reduction=reduction, device="meta"))
        if head[0].weight is not weight:  # first use, or lm_head given a new parameter
            head[0].weight = weight
        return head

    def _follow(self, head: Sequential, lm_head: nn.Module) -> None:
        """The head's GEMM decides FP8 as ``lm_head``'s would (its ``fp8`` override)."""
        fp8 = getattr(lm_head, "fp8", None)
        gemm = head[0].basic_ops()[0]
        if gemm.fp8 != fp8:
            gemm.fp8 = fp8

    def __reduce__(self):
        return FusedLossForward, (self._owner(),)


def _fallback_reason(model: nn.Module, named: dict) -> Optional[str]:
    head = cast(nn.Module, model.lm_head)
    if type(head) not in (nn.Linear, Linear) or getattr(head, "bias", None) is not None:
        return f"its lm_head is {type(head).__name__} (an adapter?), not a plain linear layer"
    if any(getattr(head, hooks) for hooks in RUN_HOOKS):  # (FSDP2's unshard among them)
        return "hooks on its lm_head"
    if getattr(model.loss_function, "__name__", "") != "ForCausalLMLoss":
        return f"its loss function is {getattr(model.loss_function, '__name__', '?')}"
    if named.get("ignore_index") not in (None, _IGNORE):
        return f"ignore_index={named['ignore_index']}"
    if named.get("logits_to_keep") not in (None, 0):
        return "logits_to_keep"
    if named.get("shift_labels") is not None:
        return "shift_labels"
    if named.get("return_dict") is False:
        return "return_dict=False"
    return None
