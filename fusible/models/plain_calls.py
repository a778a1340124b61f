"""Plain model calls: a converted model's calls that give no attention mask, positions or
cache leave each fused layer its own attention pattern, whatever mask the model's code
builds.

A fused decoder layer takes no attention mask: a call with one runs the original code,
since a mask may hold padding. But the mask a model builds for a call without an attention
mask, position ids or cache is the layers' own pattern (causal, or none for an encoder),
and transformers builds it whole in cases where it could have passed None: the eager
attention always, and under ``torch.compile`` always (it cannot tell, while tracing, that
position ids it made itself hold one sequence). So ``fusible.convert`` wraps the innermost
Hugging Face model (else the innermost module) whose forward takes an ``attention_mask``
and holds fused layers (a ``LlamaModel``, a ``BertModel``: the one that builds their mask,
whatever modules inside it it hands the mask to; a caller above it that builds a mask of
its own passes it down, and the call is not plain) with :class:`PlainCallsForward`: for
the length of a plain call it marks a :class:`PlainCalls` shared with those layers, which
then take the mask as their own pattern (unless the model's config has a sliding window
shorter than the sequence). The mark is per thread; dynamo traces it as a constant, so
compiled calls run the fused layers too.

In training mode a call that leaves ``use_cache`` unsaid (and passes no cache) gets
``use_cache=False``: transformers would build a KV cache (its config's ``use_cache`` is
True) that no training step reads and that a fused layer cannot fill, so every layer would
run its original code. Evaluation-mode calls (generation) keep the model's default.
"""

from __future__ import annotations

import threading

from torch import nn

from fusible.models.call_arguments import named_arguments, read_ahead, takes
from fusible.models.installed_forward import InstalledForward

# A model call's arguments that leave the masks the layers' own pattern, whatever value
# (not token_type_ids: a prefix-LM's bidirectional prefix comes from them)
_NEUTRAL = frozenset({"input_ids", "inputs_embeds", "labels", "use_cache", "output_attentions",
                      "output_hidden_states", "return_dict", "logits_to_keep",
                      "num_logits_to_keep", "num_items_in_batch"})


class PlainCalls(threading.local):
    """Whether the wrapped model's call under way in this thread is plain (see the module
    notes)."""

    def __init__(self):
        # set in every thread's own dict (threading.local runs this per thread): a class
        # default would leave the dict without it until the first call sets it, and dynamo
        # guards a compiled call on that absence (the guard then fails in its own frame)
        self.active = False

    def __reduce__(self):
        return PlainCalls, ()  # a fresh mark: no call is under way in the new copy

    def __deepcopy__(self, memo: dict) -> "PlainCalls":
        return PlainCalls()


class PlainCallsForward(InstalledForward):
    """The forward installed on the model: the original one, marked plain or not."""

    _copied = ("calls",)

    def __init__(self, model: nn.Module, calls: PlainCalls):
        super().__init__(model)
        self.calls = calls
        read_ahead(type(model))

    def __call__(self, *args, **kwargs):
        model = self._owner()
        named = named_arguments(model, args, kwargs)
        if named is not None and model.training and takes(model, "use_cache") and \
                named.get("use_cache") is None and named.get("past_key_values") is None \
                and named.get("cache") is None:
            kwargs = {**kwargs, "use_cache": False}  # no KV cache for a training step
        outer = self.calls.active
        self.calls.active = named is not None and all(
            value is None or name in _NEUTRAL for name, value in named.items())
        try:
            return type(model).forward(model, *args, **kwargs)
        finally:
            self.calls.active = outer

    def __reduce__(self):
        return PlainCallsForward, (self._owner(), self.calls)


def _inside(path: str, fused: dict) -> dict:
    return {p: f for p, f in fused.items() if not path or p.startswith(path + ".")}


def _is_hf_model(module: nn.Module) -> bool:
    """A model class of transformers itself (a remote-code class may build a padding mask
    of its own, as a user's wrapper may)."""
    return type(module).__module__.startswith("transformers.") and any(
        cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _builds_the_mask(path: str, candidates: dict) -> bool:
    """Whether the candidate at ``path`` is the module that builds its layers' mask: the
    innermost Hugging Face model (a ``PreTrainedModel`` of transformers' own code: it
    builds masks from the attention mask it is given only; the modules inside it it hands
    the mask, a ``BertEncoder``, are not marked), else the innermost candidate (a wrapper
    of the user's above may build a padding mask of its own)."""
    def within(outer: str, inner: str) -> bool:
        return inner != outer and (not outer or inner.startswith(outer + "."))
    inner = [p for p in candidates if within(path, p)]
    if any(_is_hf_model(candidates[p]) for p in inner):
        return False
    if _is_hf_model(candidates[path]):
        return True
    hf_above = any(within(p, path) and _is_hf_model(candidates[p]) for p in candidates)
    return not inner and not hf_above


def mark_plain_calls(model: nn.Module, fused: dict) -> list:
    """Install :class:`PlainCallsForward` on the modules of ``model`` that build their fused
    layers' mask (:func:`_builds_the_mask`) among those whose forward
    takes an ``attention_mask`` and that hold fused layers (``fused``: path -> installed
    forward), sharing a :class:`PlainCalls` with those layers' forwards (their
    ``plain_calls``). Returns the report entries ``(path, class name, note)``."""
    candidates = {path: module for path, module in model.named_modules()
                  if path not in fused and "forward" not in module.__dict__
                  and _inside(path, fused)
                  and takes(module, "attention_mask")}
    entries: list = []
    for path, module in candidates.items():
        if not _builds_the_mask(path, candidates):
            continue
        inside = _inside(path, fused)
        calls = PlainCalls()
        module.forward = PlainCallsForward(module, calls)
        for forward in inside.values():
            forward.plain_calls = calls
        entries.append((path, type(module).__name__,
                        f"plain calls marked: a call without an attention mask, position "
                        f"ids or cache runs its {len(inside)} fused layers whatever mask its "
                        f"code builds (the layers' own pattern: transformers builds it whole "
                        f"for the eager attention and under torch.compile)"
                        + ("; in training, use_cache=False unless given (a KV cache no "
                           "step reads, which fused layers cannot fill)"
                           if takes(module, "use_cache")
                           else "")))
    return entries
