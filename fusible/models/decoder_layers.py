"""Whole decoder layers as one fusible plan: :func:`fuse_decoder_layer` asks the registered
layer converters (:mod:`fusible.models.layer_converter`; built in: Llama, Mistral, Qwen2,
Qwen3, Phi-3, GPT-NeoX) whether they know a layer, confirms the answer by computing the
layer both ways on a probe input, then installs a forward on the instance that runs it as
a :class:`fusible.layers.TransformerLayer`.

The layer keeps its class, children and parameters: the fused forward calls the
TransformerLayer (built on the meta device, holding nothing) with the layer's own
parameters through ``torch.func.functional_call``, those whose layout differs computed
from them by autograd on each call (a concatenation, a reordering), so an optimizer built
before the conversion keeps training the original parameter objects, and state dicts
keep their keys. Calls the fused layer does not compute (a KV cache, an attention mask,
attention weights asked for, packed-sequence arguments, positional arguments) run the
original forward, the reason counted in ``forward.fallbacks``.
"""

from __future__ import annotations

import collections
import copy
import inspect
import weakref
from typing import Any, Optional, Union

import torch
from torch import nn

from fusible.layers.transformer_layer import TransformerLayer
from fusible.models import layer_converters  # noqa: F401  (registers the built-ins)
from fusible.models.layer_converter import layer_converter, registered_layer_converters

# The probe's tolerance, relative to the largest value the layer adds to its input:
# Hugging Face computes its norms in float32 whatever the dtype; 16-bit layers are probed
# as float32 copies (what they add would drown in the output's rounding)
_PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}
FALLBACKS = ("falls back to the original code for dropout in training, a KV cache, an "
             "attention mask (padding; the eager attention's causal mask), output_attentions "
             "and packed-sequence arguments")


def fuse_decoder_layer(layer: nn.Module) -> Union[None, str, "FusedLayerForward"]:
    """Install the fused forward on ``layer`` if a registered converter knows it.

    Returns
    -------
    None, str or FusedLayerForward
        None: no converter knows the layer; a str: one does, and why it stays as it is;
        the installed forward otherwise.
    """
    if "forward" in layer.__dict__:
        return None  # rewritten already (a residual fusion, or fused whole)
    refusals = []  # a layer may look like one family's and be another's (Gemma, Llama)
    for name, converter in registered_layer_converters().items():
        spec = converter.recognise(layer)
        if spec is None:
            continue
        if isinstance(spec, str):
            refusals.append(f"{spec} ({name} layer converter)")
            continue
        fused = FusedLayerForward(layer, name, spec, next(layer.parameters()).dtype)
        why = fused.probe()
        if why:
            refusals.append(f"{why} ({name} layer converter)")
            continue
        layer.forward = fused
        return fused
    return "; ".join(refusals) or None


class FusedLayerForward:
    """The forward :func:`fuse_decoder_layer` installs: the layer as one
    TransformerLayer where the call allows, the original forward otherwise.

    Attributes
    ----------
    converter : str
        The layer converter's name.
    spec : dict
        The TransformerLayer's arguments.
    fused : TransformerLayer
        On the meta device; called with the layer's parameters.
    fallbacks : collections.Counter
        Why calls ran the original forward, and how many.
    """

    def __init__(self, layer: nn.Module, converter: str, spec: dict, dtype: torch.dtype):
        self._layer = weakref.ref(layer)  # no reference cycle; and unpickling, the layer
        self.converter, self.spec, self.dtype = converter, spec, dtype  # is not whole
        self.fused = TransformerLayer(**spec, device="meta", dtype=dtype)  # yet: not read
        self.fallbacks: collections.Counter = collections.Counter()

    def _owner(self) -> nn.Module:
        layer = self._layer()
        if layer is None:
            raise ReferenceError("the layer of this fused forward no longer exists")
        return layer

    def __call__(self, hidden_states, *args, **kwargs):
        layer = self._owner()
        named = _named_arguments(layer, hidden_states, args, kwargs) if args else kwargs
        why = self._fallback_reason(layer, named)
        if why is not None:
            self.fallbacks[why] += 1
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        return self.run(layer, hidden_states, named)

    def _fallback_reason(self, layer: nn.Module, kwargs: Optional[dict]) -> Optional[str]:
        if kwargs is None:
            return "arguments its forward's signature does not name"
        converter = layer_converter(self.converter)
        why = converter.fallback(layer)
        if why is not None:
            return why
        cache = converter.cache_kwargs
        if any(kwargs.get(name) is not None for name in cache):
            return "a KV cache"
        if any(kwargs.get(name) is not None for name in converter.mask_kwargs):
            return "an attention mask"
        if kwargs.get("output_attentions"):
            return "output_attentions"
        other = sorted(k for k, v in kwargs.items()
                       if k not in converter.taken_kwargs and k not in cache and v is not None)
        if other:
            return f"keyword arguments the fused layer does not take ({', '.join(other)})"
        return None

    def run(self, layer: nn.Module, hidden_states, named: dict):
        """The fused computation on ``(batch, seq, hidden)``, given the call's other
        arguments by name (the rotary positions or tables)."""
        converter = layer_converter(self.converter)
        inputs = (hidden_states, *converter.fused_inputs(self.spec, hidden_states, named))
        if self.fused.training != layer.training:  # train() walks every submodule
            self.fused.train(layer.training)
        params = converter.parameters(layer, self.spec)
        return torch.func.functional_call(self.fused, params, inputs)

    def probe(self) -> Optional[str]:
        """Compute a random input both ways; why they differ, or None."""
        layer = self._owner()
        weight = next(layer.parameters())
        if weight.device.type == "meta":
            return "its parameters are on the meta device: nothing to probe them with"
        if weight.dtype in (torch.bfloat16, torch.float16):
            probed = copy.deepcopy(layer).float()
            return FusedLayerForward(probed, self.converter, self.spec, torch.float32).probe()
        tolerance = _PROBE_TOLERANCE.get(weight.dtype)
        if tolerance is None:
            return f"no probe tolerance for {weight.dtype}"
        generator = torch.Generator(weight.device).manual_seed(0)
        x = torch.randn(2, 8, self.spec["hidden_size"], generator=generator,
                        device=weight.device).to(weight.dtype)
        positions = torch.arange(8, device=weight.device)
        kwargs = _accepted(layer, layer_converter(self.converter).probe_kwargs(
            layer, self.spec, x, positions))
        named = {"position_ids": positions[None], **kwargs}
        training = layer.training
        try:  # in evaluation mode: no dropout
            layer.eval()
            with torch.no_grad():
                want = type(layer).forward(layer, x, **kwargs)
                want = want[0] if isinstance(want, tuple) else want
                got = self.run(layer, x, named)
        finally:
            layer.train(training)
        # against what the layer adds to its input: the residual would hide the rest
        error = (got.double() - want.double()).abs().max().item()
        bound = tolerance * (want.double() - x.double()).abs().max().item()
        if not error <= bound:
            return (f"it computes other than the fused layer on a probe input (max error "
                    f"{error:.3g}, tolerance {bound:.3g}: {tolerance} of the largest value "
                    f"the layer adds to its input)")
        return None

    def __deepcopy__(self, memo: dict) -> "FusedLayerForward":
        new = copy.copy(self)
        new._layer = weakref.ref(copy.deepcopy(self._owner(), memo))
        new.fused = copy.deepcopy(self.fused, memo)
        new.fallbacks = collections.Counter()
        return new

    def __reduce__(self):
        return FusedLayerForward, (self._owner(), self.converter, self.spec, self.dtype)


def _named_arguments(layer: nn.Module, hidden_states, args: tuple,
                     kwargs: dict) -> Optional[dict]:
    """The call's arguments after ``hidden_states`` by name (GPT-2's model passes its
    cache and mask positionally), or None where the signature does not bind them."""
    signature = _forward_signature(type(layer))
    try:
        bound = signature.bind(layer, hidden_states, *args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    for name in list(named)[:2]:  # self, hidden_states
        named.pop(name)
    for name, value in list(named.items()):  # **kwargs spread out
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.pop(name)
            named.update(value)
    return named


_SIGNATURES: dict = {}  # layer class -> its forward's signature


def _forward_signature(cls: Any) -> inspect.Signature:
    """A layer class's forward signature, read once per class (a call binds against it
    on every model step)."""
    signature = _SIGNATURES.get(cls)
    if signature is None:
        signature = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return signature


def _accepted(layer: nn.Module, kwargs: dict) -> dict:
    """The keyword arguments the layer's forward takes (all of them with ``**kwargs``): a
    block of one's own code may take the hidden states alone."""
    parameters = _forward_signature(type(layer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}
