"""Converting an existing ``torch.nn`` model to fusible ops, in place.

:func:`convert` walks a model and swaps the modules it recognises for fusible ops that
compute the same thing and hold *the same parameter objects* under the same names, so an
optimizer built before the conversion, its state and every checkpoint keep working:

* ``nn.Linear`` -> ``ops.Linear``; ``nn.LayerNorm`` / ``nn.RMSNorm`` -> ``ops.LayerNorm``
  / ``ops.RMSNorm``; ``nn.GELU`` / ``nn.SiLU`` / ``nn.ReLU`` / ``nn.Dropout`` and
  ``nn.Identity`` -> their ops;
* an ``nn.Sequential`` whose children all convert -> an ``ops.Sequential`` of them (the
  same child names), planned as one pipeline: fusions cross its layers (an MLP written
  as ``nn.Sequential(Linear, GELU, Linear)`` gets its GEMM epilogues).

A decoder layer a registered layer converter knows (Hugging Face's Llama family, Gemma,
Phi-3, GPT-NeoX, GPT-2, BERT, nanoGPT-style blocks) runs as one TransformerLayer plan with
its own parameters (``fuse_layers``, :mod:`fusible.models.decoder_layers`).
Any other module whose forward is Python (attention, a residual block) keeps that forward; its
recognised children are converted one by one, and the report says what stayed and why.
Its Linear + residual adds are fused (``fuse_residuals=True``, the default): the forward,
traced one level deep with ``torch.fx``, adds a residual to the output of a converted child
ending in a linear layer (``x = x + self.proj(y)``, ``x + self.mlp(h)``); that child becomes
a Sequential ending in ``ops.AddExtraInput``, called as ``child(y, x)``, so the planner fuses
the add into the GEMM (``ForwardLinearBiasAdd``). The rewritten forward is installed on the
instance (the module keeps its class); where the residual's shape or dtype differ from the
linear layer's output at run time (a broadcast; under ``torch.autocast``, a float32 residual
that the add would promote) the add runs as written. A lone ``ops.Linear`` child is wrapped
(``proj.linear.weight``), its checkpoints kept under the original names by state-dict hooks.
A forward fx cannot trace (data-dependent control flow) stays as it is; the report says why.
With ``merge_gated_mlps=True``, a gated MLP class (``down(silu(gate(x)) * up(x))`` with
children named ``gate_proj`` / ``up_proj`` / ``down_proj``, or torchtitan's ``w1`` / ``w3``
/ ``w2``; recognised by those names and confirmed by computing both on a probe input)
becomes ``ops.Sequential(gate_up=BasicLinear, act=SwiGLU, down=BasicLinear)``: one GEMM
for both projections, the SwiGLU kernel, and its checkpoints still under the original names
(state-dict hooks split and join the merged weight). The merged weight is a new parameter:
build the optimizer after such a conversion.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional, cast

import attrs
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from fusible.models.fused_loss import fuse_causal_lm_loss
from fusible.models.decoder_layers import FALLBACKS, FusedLayerForward, fuse_decoder_layer
from fusible.models.experts import FusedExpertsForward, fuse_experts
from fusible.models.plain_calls import mark_plain_calls
from fusible.models.gated_mlps import gated_mlp_names, merged_gated_mlp
from fusible.models.probed_modules import PROBE_TOLERANCE, probed_module
from fusible.models.residual_adds import FUSED, fuse_residual_adds
from fusible.module import PipelineModule, Sequential
from fusible.ops.dropout import Dropout
from fusible.ops.gelu import GELU
from fusible.ops.identity import Identity
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.linear import Linear
from fusible.ops.relu import ReLU
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.silu import SiLU


@attrs.frozen
class ConversionReport:
    """What :func:`convert` did.

    Attributes
    ----------
    converted : tuple of (str, str, str)
        ``(module path, torch class, fusible class)`` of each module swapped.
    left : tuple of (str, str, str)
        ``(module path, class, why)`` of each module with parameters (or a known
        computation) that stayed as it was.
    """

    converted: tuple
    left: tuple

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} modules, left {len(self.left)}:"]
        lines += [f"  {p or '(the model)'}: {a} -> {b}" for p, a, b in self.converted]
        lines += [f"  {p or '(the model)'}: {a} left: {why}" for p, a, why in self.left]
        return "\n".join(lines)


def convert(model: nn.Module, *, merge_gated_mlps: bool = False,
            fuse_residuals: bool = True, fuse_layers: bool = True,
            fuse_loss: bool = False) -> ConversionReport:
    """Swap the modules of ``model`` that fusible recognises for fusible ops, in place.

    Parameters
    ----------
    model : nn.Module
        Converted in place; its parameters stay the same objects with the same names.
        The root object itself stays (its children are swapped); for a root that is
        itself a convertible module (an ``nn.Linear``, an ``nn.Sequential``) use
        :func:`convert_module`, which returns its replacement.
    merge_gated_mlps : bool
        Also replace gated MLP classes (see the module docstring), merging their gate and
        up projections into one new parameter.
    fuse_residuals : bool
        Fuse the Linear + residual adds of Python forwards into the linear layers'
        pipelines (see the module docstring): each is reported as converted,
        ``(child path, "Linear + residual", "AddExtraInput fused")``.
    fuse_layers : bool
        Run each decoder layer a registered layer converter knows (the built-ins:
        Hugging Face's Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3, GPT-NeoX, GPT-2
        and BERT layers, nanoGPT-style blocks; recognised by its children, confirmed on a
        probe input) as one
        :class:`fusible.layers.TransformerLayer` with its own parameters (see
        :mod:`fusible.models.decoder_layers`); its children stay as they are, for the calls
        the fused layer does not take (a KV cache, an attention mask).
    fuse_loss : bool
        Compute a Hugging Face causal LM's training loss (a training call with
        ``labels``) with :class:`fusible.ops.LinearCrossEntropy` on its ``lm_head``
        weight, never making the logits, which such calls then return as None (as
        Liger-Kernel's fused loss does; see :mod:`fusible.models.fused_loss`): Llama,
        Mistral, Qwen2 and Qwen3.

    Returns
    -------
    ConversionReport
    """
    options = _Options(merge_gated_mlps, fuse_residuals, _shared_modules(model), fuse_layers)
    converted: list[tuple[str, str, str]] = []
    left: list[tuple[str, str, str]] = []
    _convert_children(model, "", converted, left, options)
    if fuse_residuals and not isinstance(model, (PipelineModule, nn.Sequential)):
        _fuse_residuals(model, "", converted, left, None, options)
    fused = {path: m.__dict__["forward"] for path, m in model.named_modules()
             if isinstance(m.__dict__.get("forward"), FusedLayerForward)}
    converted += mark_plain_calls(model, fused)
    if fuse_loss:
        converted += _fuse_losses(model)
    return ConversionReport(tuple(converted), tuple(left))


def _fuse_losses(model: nn.Module) -> list:
    """The report entries of the causal LMs whose loss is now fused; ValueError if none."""
    entries = []
    for path, module in list(model.named_modules()):
        note = fuse_causal_lm_loss(module)
        if note is not None:
            entries.append((path, type(module).__name__, note))
    if not entries:
        raise ValueError(f"convert(fuse_loss=True): {type(model).__name__} holds no causal LM "
                         f"whose loss fusible computes (Hugging Face's Llama, Mistral, Qwen2 "
                         f"and Qwen3 *ForCausalLM with an lm_head without bias)")
    return entries


@attrs.frozen
class _Options:
    merge_gated: bool
    fuse_residuals: bool
    shared: frozenset  # id() of the modules the model holds more than once
    fuse_layers: bool = True


def _shared_modules(model: nn.Module) -> frozenset:
    counts = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    return frozenset(i for i, n in counts.items() if n > 1)


def convert_module(module: nn.Module) -> Optional[nn.Module]:
    """The fusible equivalent of ``module`` holding its parameters, or None where there is
    none (an ``nn.Sequential`` needs every child convertible)."""
    if isinstance(module, nn.Sequential):
        children = [convert_module(c) for c in module]
        if not children or any(c is None for c in children):
            return None
        seq = Sequential(collections.OrderedDict(  # type: ignore[arg-type]
            zip(module._modules, children)))  # the same child names
        seq.training = module.training  # its children took their own modes
        return keep_hooks(module, seq)
    make = _LEAVES.get(type(module), probed_module)
    new = None if _reparametrization(module) else make(module)
    # the mode of what it replaces (a model from from_pretrained is in eval mode)
    return None if new is None else keep_hooks(module, new.train(module.training))


# The hooks a module call runs, and the state-dict hooks: the replacement takes the very
# dicts, so that the handles the user holds still remove them.
_CALL_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")
_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


def keep_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new``, running the hooks registered on ``old`` (which it replaces) as ``old``
    would: forward, forward-pre and backward hooks, and state-dict hooks where ``new`` has
    none of its own (a fusible op with hooks runs as its own module call, so they see what
    the original's saw)."""
    for name in _CALL_HOOKS + _STATE_HOOKS:
        own = new.__dict__.get(name)
        if name in _STATE_HOOKS and own:
            own.update(old.__dict__[name])  # fusible's own come first; handles kept by id
            continue
        setattr(new, name, old.__dict__[name])
    new._is_full_backward_hook = old._is_full_backward_hook
    return new


def _convert_children(module, path, converted, left, options: _Options) -> None:
    for name, child in list(module.named_children()):
        where = f"{path}.{name}" if path else name
        if isinstance(child, PipelineModule):
            continue  # fusible already
        refused = _fused_layer(child, where, converted) if options.fuse_layers else None
        if refused is True:
            continue  # one plan; its children stay, for the calls it does not take
        experts = fuse_experts(child)
        if isinstance(experts, FusedExpertsForward):
            converted.append((where, type(child).__name__, f"GroupedLinear -> SwiGLU -> "
                                                           f"GroupedLinear ({experts.num_experts}"
                                                           f" experts; routing stays the "
                                                           f"model's)"))
            continue
        if type(child) is nn.Dropout and child.p == 0.0:
            continue  # alone it computes nothing: a fusible group of it would only cost
        new = convert_module(child)
        gated = gated_mlp_names(child) if new is None else None
        if gated is not None:
            if not options.merge_gated:
                left.append((where, type(child).__name__,
                             f"a gated MLP ({', '.join(gated)}): convert(..., "
                             f"merge_gated_mlps=True) merges its gate and up projections into "
                             f"one fusible SwiGLU block (a new parameter: build the optimizer "
                             f"after it); its projections are converted one by one"))
            else:
                new = keep_hooks(child, merged_gated_mlp(child, gated, where)
                                 .train(child.training))
        if new is not None:
            setattr(module, name, new)
            probed = "" if type(child) in _LEAVES or isinstance(child, nn.Sequential) or \
                gated is not None else (f" (recognised by computation: within "
                                        f"{PROBE_TOLERANCE} on a probe input)")
            converted.append((where, type(child).__name__, type(new).__name__ + probed))
            continue
        why = _why_left(child) if gated is None else None
        if refused:
            why = f"a decoder layer not fused whole: {refused}" + (f"; {why}" if why else "")
        if isinstance(experts, str):
            why = f"an expert bank not fused: {experts}"
        entry = len(left)
        if why is not None:
            left.append((where, type(child).__name__, why))
        before = len(converted)
        _convert_children(child, where, converted, left, options)
        if why is not None and "its forward is Python" in why:
            left[entry] = (*left[entry][:2], why + _separate_groups_hint(converted[before:],
                                                                         where))
        if options.fuse_residuals and not isinstance(child, nn.Sequential):
            _fuse_residuals(child, where, converted, left, entry if why else None, options)


def _fused_layer(child, where, converted) -> "bool | str | None":
    """True where ``child`` is a decoder layer now fused whole; why a layer of that shape
    was not (its children are then converted one by one); None for other modules."""
    outcome = fuse_decoder_layer(child)
    if outcome is None or isinstance(outcome, str):
        return outcome
    converted.append((where, type(child).__name__, f"TransformerLayer (the whole layer; "
                                                   f"{FALLBACKS})"))
    return True


def _separate_groups_hint(converted: list, where: str) -> str:
    """Where a Python forward calls two or more converted children: they run as separate
    fusible groups, which one pipeline would fuse."""
    children = [p[len(where) + 1:] for p, _, _ in converted
                if p.startswith(where + ".") and "." not in p[len(where) + 1:]]
    if len(children) < 2:
        return ""
    return (f"; its converted children ({', '.join(children)}) run as separate fusible "
            f"groups: written as an nn.Sequential (or fusible.ops.Sequential) where they "
            f"run in a chain, they would be planned as one pipeline and fused")


def _fuse_residuals(module, path, converted, left, entry: Optional[int],
                    options: _Options) -> None:
    """Fuse ``module``'s Linear + residual adds; what stayed joins its ``left`` entry (at
    ``entry``, or a new one)."""
    if type(module).forward is nn.Module.forward:
        return  # no forward of its own (ModuleDict, ModuleList): no add to fuse
    done = fuse_residual_adds(module, path, options.shared)
    converted += [(f"{path}.{name}" if path else name, FUSED, "AddExtraInput fused")
                  for name in done.fused]
    notes = [why for _, why in done.unfused]
    if done.untraced:
        notes.append(f"its residual adds, if it has any, stay unfused: fx could not trace "
                     f"it ({done.untraced})")
    if done.fused:
        notes.insert(0, f"rewritten to fuse the residual adds of {', '.join(done.fused)}")
    if not notes:
        return
    if entry is None:
        left.append((path, type(module).__name__, "; ".join(notes)))
    else:
        where, kind, why = left[entry]
        left[entry] = (where, kind, "; ".join([why, *notes]))


def _why_left(module) -> Optional[str]:
    """Why a module with its own computation stays (None for a plain container)."""
    if isinstance(module, nn.Sequential):
        return "a child does not convert: its convertible children are converted one by one"
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return None
    how = _reparametrization(module)
    if how:
        return (f"its {how}: a fusible op would train the computed tensor, not the "
                f"parameters behind it, so it runs as is")
    own = [n for n, _ in module.named_parameters(recurse=False)]
    reason = _REASONS.get(type(module))
    if reason is not None:
        return reason
    if own:
        return f"no fusible op computes {type(module).__name__} (parameters {own})"
    if list(module.children()):
        return "its forward is Python: its children are converted one by one"
    return None


def _reparametrization(module) -> str:
    """How a parameter of ``module`` is computed from others (``torch.nn.utils``'
    parametrizations, or the legacy ``spectral_norm`` / ``weight_norm`` pre-hooks), or ""."""
    if parametrize.is_parametrized(module):
        return (f"{', '.join(module.parametrizations.keys())} is parametrized "
                f"(torch.nn.utils.parametrize.remove_parametrizations undoes it)")
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, (SpectralNorm, WeightNorm)):
            undo = ("remove_spectral_norm" if isinstance(hook, SpectralNorm)
                    else "remove_weight_norm")
            return (f"{hook.name} is computed by a {type(hook).__name__} forward pre-hook "
                    f"(torch.nn.utils.{undo} undoes it)")
    return ""


def _linear(m: nn.Linear) -> Linear:
    new = Linear(m.in_features, m.out_features, bias=m.bias is not None,
                 device="meta", dtype=m.weight.dtype)
    new.weight = cast(nn.Parameter, m.weight)
    if m.bias is not None:
        new.bias = m.bias
    return new


def _layer_norm(m: nn.LayerNorm) -> Optional[LayerNorm]:
    if not m.elementwise_affine or m.bias is None:
        return None
    new = LayerNorm(m.normalized_shape, eps=m.eps, device="meta", dtype=m.weight.dtype)
    new.weight, new.bias = m.weight, cast(nn.Parameter, m.bias)
    return new


def _rms_norm(m: nn.RMSNorm) -> Optional[RMSNorm]:
    if not m.elementwise_affine or m.eps is None:
        return None
    new = RMSNorm(m.normalized_shape, eps=m.eps, device="meta", dtype=m.weight.dtype)
    new.weight = m.weight
    return new


_LEAVES: dict[type, Callable[[Any], Optional[nn.Module]]] = {
    nn.Linear: _linear,
    nn.LayerNorm: _layer_norm,
    nn.RMSNorm: _rms_norm,
    nn.GELU: lambda m: GELU(approximate=m.approximate),
    nn.SiLU: lambda m: SiLU(),
    nn.ReLU: lambda m: ReLU(),
    nn.Identity: lambda m: Identity(),
    nn.Dropout: lambda m: Dropout(m.p),
}
_REASONS = {
    nn.LayerNorm: "a LayerNorm without affine parameters (or bias) has no fusible op",
    nn.RMSNorm: "an RMSNorm without a weight, or with eps=None (the dtype's epsilon), has "
                "no fusible op",
    nn.Embedding: "fusible has no embedding op; it runs as is between fusible groups",
    nn.MultiheadAttention: "attention runs as is; its projections are not separate modules",
}
