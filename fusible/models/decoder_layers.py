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
from typing import Optional, Union, cast

import torch
from torch import nn

from fusible.layers.transformer_layer import TransformerLayer
from fusible.ops.attention import Attention
from fusible.models.call_arguments import accepted, named_arguments, read_ahead
from fusible.models.joined_weights import colocate
from fusible.models.installed_forward import RUN_HOOKS, InstalledForward
from fusible.models import layer_converters  # noqa: F401  (registers the built-ins)
from fusible.models.layer_converter import (LayerConverter, hf_config, layer_converter,
                                            registered_layer_converters)
from fusible.models.plain_calls import PlainCalls

# The probe's tolerance, relative to the largest value the layer adds to its input:
# Hugging Face computes its norms in float32 whatever the dtype; 16-bit layers are probed
# as float32 copies (what they add would drown in the output's rounding)
_PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}
FALLBACKS = ("falls back to the original code for dropout in training, a KV cache, an "
             "attention mask given to the model (padding), output_attentions and "
             "packed-sequence arguments, and after a module of the layer is swapped for "
             "another kind (an adapter)")


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
        fused.module_types = _module_types(_submodules(layer))
        for group in converter.joined_groups(layer):
            colocate(group)  # each call's join a view, not a copy
        return fused
    return "; ".join(refusals) or None


class FusedLayerForward(InstalledForward):
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
    plain_calls : PlainCalls or None
        Set by ``fusible.convert`` where the model marks its plain calls, during which a
        mask is the layer's own pattern (:mod:`fusible.models.plain_calls`).
    """

    _copied = ("fused", "_slots", "plain_calls")  # the slots after fused: the copies' own

    def __init__(self, layer: nn.Module, converter: str, spec: dict, dtype: torch.dtype):
        super().__init__(layer)  # unpickling, the layer is not whole yet: not read here
        read_ahead(type(layer))
        self.converter, self.spec, self.dtype = converter, spec, dtype
        self.fused = TransformerLayer(**spec, device="meta", dtype=dtype)
        self._slots = {name: _slot(self.fused, name) for name, _ in self.fused.named_parameters()}
        self.fallbacks: collections.Counter = collections.Counter()
        self.plain_calls: Optional[PlainCalls] = None
        self.module_types: Optional[tuple] = None  # the layer's at conversion (its first call
        # for an unpickled copy)

    def __call__(self, hidden_states, *args, **kwargs):
        layer = self._owner()
        named = named_arguments(layer, (hidden_states, *args), kwargs, skip=1) if args \
            else kwargs
        why = self._fallback_reason(layer, named, hidden_states.shape[1])
        if why is not None:
            self.fallbacks[why] += 1
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        return self.run(layer, hidden_states, named)

    def _fallback_reason(self, layer: nn.Module, kwargs: Optional[dict],
                         seq: int) -> Optional[str]:
        if kwargs is None:
            return "arguments its forward's signature does not name"
        modules = _submodules(layer)  # one walk for the kinds, the hooks and the dropout
        why = self._changed(modules)
        if why is not None:
            return why
        converter = layer_converter(self.converter)
        why = converter.fallback(layer, modules) if type(converter).fallback is \
            LayerConverter.fallback else converter.fallback(layer)  # (an override's own)
        if why is not None:
            return why
        cache = converter.cache_kwargs
        if any(kwargs.get(name) is not None for name in cache):
            return "a KV cache"
        if any(kwargs.get(name) is not None for name in converter.mask_kwargs) and \
                not self._mask_is_the_pattern(layer, seq):
            return "an attention mask"
        if kwargs.get("output_attentions"):
            return "output_attentions"
        other = sorted(k for k, v in kwargs.items()
                       if k not in converter.taken_kwargs and k not in cache and v is not None)
        if other:
            return f"keyword arguments the fused layer does not take ({', '.join(other)})"
        return None

    def _changed(self, modules: list) -> Optional[str]:
        """Why the layer (``modules``: its :func:`_submodules`) is no longer what was
        converted (a module swapped for another kind since: an adapter's wrapper, whose
        weights the fused layer would not read), or None."""
        types = _module_types(modules)
        if self.module_types is None:
            self.module_types = types
        if types != self.module_types and (len(types) != len(self.module_types) or not all(
                _same_kind(now, then) for now, then in zip(types, self.module_types))):
            return ("its modules changed since conversion (an adapter added?): the fused "
                    "layer would not compute them; convert the model again")
        hooked = [m for m in modules[1:] for hooks in RUN_HOOKS if m.__dict__.get(hooks)]
        # (plan_model's own, marked ``_fusible_planning``, record what runs: not counted)
        if hooked and any(not getattr(hook, "_fusible_planning", False)
                          for m in hooked for hooks in RUN_HOOKS
                          for hook in getattr(m, hooks).values()):
            return "hooks on its modules (the fused layer would not run them)"
        return None

    def _plain(self) -> bool:
        """Whether the call under way is a plain model call (no padding, positions or
        cache: :mod:`fusible.models.plain_calls`)."""
        return self.plain_calls is not None and self.plain_calls.active

    def _mask_is_the_pattern(self, layer: nn.Module, seq: int) -> bool:
        """Whether the call under way is a plain model call and no sliding window of the
        model's config is shorter than ``seq``."""
        if not self._plain():
            return False
        window = getattr(hf_config(layer), "sliding_window", None)
        return not isinstance(window, int) or seq <= window

    def run(self, layer: nn.Module, hidden_states, named: dict):
        """The fused computation on ``(batch, seq, hidden)``, given the call's other
        arguments by name (the rotary positions or tables)."""
        converter = layer_converter(self.converter)
        if self._plain() and named.get("position_ids") is not None:
            # a plain call's positions are the model's own 0..S-1 (no cache, none given)
            named = {**named, "position_ids": None}
        inputs = (hidden_states, *converter.fused_inputs(self.spec, hidden_states, named))
        if self.fused.training != layer.training:  # train() walks every submodule
            self.fused.train(layer.training)
        params = converter.parameters(layer, self.spec)
        if torch.compiler.is_compiling():  # dynamo traces functional_call whole
            return torch.func.functional_call(self.fused, params, inputs)
        return _call_with(self.fused, self._slots, params, inputs)

    def probe(self) -> Optional[str]:
        """Compute a random input both ways; why they differ, or None."""
        layer = self._owner()
        weight = next(layer.parameters())
        if weight.device.type == "meta":
            return "its parameters are on the meta device: nothing to probe them with"
        why = self._kernel_refusal(weight)
        if why is not None:
            return why
        if weight.dtype in (torch.bfloat16, torch.float16):
            probed = copy.deepcopy(layer).float()
            # the float32 stand-in attends by the formulas: CUDA's kernels take 16-bit only
            spec = {**self.spec, "backend": "math"}
            return FusedLayerForward(probed, self.converter, spec, torch.float32).probe()
        tolerance = _PROBE_TOLERANCE.get(weight.dtype)
        if tolerance is None:
            return f"no probe tolerance for {weight.dtype}"
        generator = torch.Generator(weight.device).manual_seed(0)
        x = torch.randn(2, 8, self.spec["hidden_size"], generator=generator,
                        device=weight.device).to(weight.dtype)
        positions = torch.arange(8, device=weight.device)
        kwargs = accepted(layer, layer_converter(self.converter).probe_kwargs(
            layer, self.spec, x, positions))
        named = {"position_ids": positions[None], **kwargs}
        training = layer.training
        try:  # in evaluation mode: no dropout
            layer.eval()
            with torch.no_grad():
                want = type(layer).forward(layer, x, **kwargs)
                want = want[0] if isinstance(want, tuple) else want
                got = self.run(layer, x, named)
        except Exception as failure:  # noqa: BLE001 - a layer the converter misread
            return f"the probe call failed ({type(failure).__name__}: {failure})"
        finally:  # both back in the layer's mode (a compiled first call would retrace)
            layer.train(training)
            self.fused.train(training)
        # against what the layer adds to its input: the residual would hide the rest
        error = (got.double() - want.double()).abs().max().item()
        bound = tolerance * (want.double() - x.double()).abs().max().item()
        if not error <= bound:
            return (f"it computes other than the fused layer on a probe input (max error "
                    f"{error:.3g}, tolerance {bound:.3g}: {tolerance} of the largest value "
                    f"the layer adds to its input)")
        return None

    def _kernel_refusal(self, weight: torch.Tensor) -> Optional[str]:
        """Why no attention kernel would run this layer's calls (its device and dtype;
        the probe of a 16-bit layer computes in float32 by the formulas)."""
        attention = cast(Attention, self.fused.attention)
        try:
            attention.kernel(weight.device.type, weight.dtype, attention.head_dim,
                             "the fused layer")
        except ValueError as error:
            return str(error)
        return None

    def __deepcopy__(self, memo: dict) -> "FusedLayerForward":
        new = cast(FusedLayerForward, super().__deepcopy__(memo))
        new.fallbacks = collections.Counter()  # the copy's own calls
        return new

    def __reduce__(self):
        return (FusedLayerForward, (self._owner(), self.converter, self.spec, self.dtype),
                {"plain_calls": self.plain_calls, "module_types": self.module_types})


def _slot(module: nn.Module, name: str) -> tuple:
    """``(submodule, parameter name there)`` of the dotted parameter ``name``."""
    *path, leaf = name.split(".")
    return module.get_submodule(".".join(path)), leaf


def _call_with(fused: nn.Module, slots: dict, params: dict, inputs: tuple):
    """``torch.func.functional_call(fused, params, inputs)`` for a ``params`` holding
    every parameter of ``fused`` (none tied) by its name: the tensors put in place and
    put back, without functional_call's checks (a sixth of an eager layer call's host
    time at small widths)."""
    saved = []
    try:
        for name, tensor in params.items():
            module, leaf = slots[name]
            saved.append((module, leaf, module._parameters[leaf]))
            module._parameters[leaf] = tensor
        return fused(*inputs)
    finally:
        for module, leaf, original in saved:
            module._parameters[leaf] = original


def _submodules(layer: nn.Module) -> list:
    """``list(layer.modules())`` (the same order, each module once), without the
    generators and names ``modules()`` builds: a layer call's checks walk it each call."""
    found, seen, stack = [], set(), [layer]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))
    return found


def _module_types(modules) -> tuple:
    """The classes of ``modules`` (a layer's ``modules()``), in order."""
    return tuple(map(type, modules))


def _same_kind(now: type, then: type) -> bool:
    """The class a module had at conversion, or FSDP2's subclass of it (``fully_shard``
    renames a module's class ``FSDP<name>``)."""
    return now is then or (issubclass(now, then) and now.__name__ == f"FSDP{then.__name__}")
