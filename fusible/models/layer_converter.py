"""LayerConverter: how one kind of decoder layer (a model family's class, or a user's
own) runs as a :class:`fusible.layers.TransformerLayer`. ``fusible.convert`` asks each
registered converter in turn (``fusible/models/layer_converters/``, one file each; a user
registers theirs with :func:`register_layer_converter`), and confirms the answer on a
probe input (:mod:`fusible.models.decoder_layers`)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from fusible.functional.rotary import RotaryOptions, rotary_angles, sequence_positions
from fusible.models.joined_weights import joined


class LayerConverter:
    """How a kind of decoder layer runs as one TransformerLayer.

    A subclass names itself (``name``, unique) and defines :meth:`recognise` and
    :meth:`parameters`; :meth:`probe_kwargs` and :meth:`fused_inputs` where the layer's
    forward takes more than Hugging Face's Llama-style ``position_ids`` /
    ``position_embeddings``.

    Attributes
    ----------
    name : str
        The converter's registry name, shown in reports.
    cache_kwargs : tuple of str
        The keyword arguments through which the layer's forward takes a KV cache (a call
        with one runs the original forward).
    mask_kwargs : tuple of str
        Those through which it takes an attention mask (one given: the original forward).
    taken_kwargs : frozenset of str
        The arguments the fused layer takes or that mean nothing to it (any other given
        and not None: the original forward).
    """

    name: str = ""
    cache_kwargs: tuple = ("cache", "past_key_values")
    mask_kwargs: tuple = ("attention_mask",)
    taken_kwargs: frozenset = frozenset({"attention_mask", "position_ids", "use_cache",
                                         "position_embeddings", "cache_position",
                                         "output_attentions"})

    def recognise(self, layer: nn.Module) -> Union[None, str, dict]:
        """None: not this converter's kind of layer; a str: one, but not convertible
        (why); a dict: :class:`TransformerLayer`'s keyword arguments for it (with
        ``position_ids=True`` where it takes rotary positions)."""
        raise NotImplementedError(f"{type(self).__name__}.recognise")

    def parameters(self, layer: nn.Module, spec: dict) -> dict:
        """The layer's parameters under the TransformerLayer's names (tensors computed
        from them by autograd where the layouts differ: a concatenation, a reordering),
        every one of the TransformerLayer's."""
        raise NotImplementedError(f"{type(self).__name__}.parameters")

    def joined_groups(self, layer: nn.Module) -> tuple:
        """The groups of the layer's modules whose weights :meth:`parameters` joins (q/k/v,
        gate/up), for :func:`fusible.models.joined_weights.colocate` to lay end to end
        once at conversion (each call's join is then a view). Default: none."""
        return ()

    def fallback(self, layer: nn.Module, modules: Optional[list] = None) -> Optional[str]:
        """Why this call of ``layer`` runs its original forward (e.g. dropout in training,
        which the fused layer does not apply), or None. Default: dropout with ``p > 0``
        anywhere in the layer, in training mode. ``modules``: ``list(layer.modules())``
        where the caller has it (an override may take ``layer`` alone)."""
        if not layer.training:
            return None
        rates = set()
        for m in layer.modules() if modules is None else modules:
            if isinstance(m, nn.Dropout):
                rates.add(m.p)
            # (read from the instance or its class: a module's missing attribute raises
            # inside nn.Module.__getattr__, a twentieth of an eager layer call's host time)
            rates.add(m.__dict__.get("attention_dropout",
                                     getattr(type(m), "attention_dropout", 0.0)))
        rates.discard(0.0)
        return f"dropout in training (p={sorted(rates)})" if rates else None

    def fused_inputs(self, spec: dict, hidden_states: torch.Tensor, named: dict) -> tuple:
        """The TransformerLayer's inputs after the hidden states, from the arguments of
        the layer's call by name: the rotary positions (Hugging Face's ``position_ids``,
        ``0..S-1`` when None) where the spec takes them, or (``rotary_tables``) the
        model's own ``position_embeddings`` tables, one half of each (Hugging Face repeats
        the angles over both halves of the rotated width)."""
        if spec.get("rotary_tables"):
            tables = named.get("position_embeddings")
            if tables is None:
                raise TypeError("a Hugging Face layer whose rotary type fusible does not "
                                "compute takes its model's position_embeddings (cos, sin); "
                                "got None")
            half = rotary_width(spec) // 2
            return tables[0][..., :half], tables[1][..., :half]
        if not spec.get("position_ids"):
            return ()
        position_ids = named.get("position_ids")
        if position_ids is None:  # fusible's own 0..S-1: its rotary tables are kept
            position_ids = sequence_positions(hidden_states.shape[1], hidden_states.device)
        elif position_ids.shape[0] == 1:
            position_ids = position_ids[0]
        return (position_ids,)

    def probe_kwargs(self, layer: nn.Module, spec: dict, x: torch.Tensor,
                     positions: torch.Tensor) -> dict:
        """Keyword arguments of the layer's original forward for the probe input ``x``
        ``(batch, seq, hidden)`` at ``positions`` ``(seq,)``: Hugging Face's rotary tables
        and the causal mask its attention implementation takes."""
        from_spec = hf_rotary_tables(spec, positions, x.dtype) if spec.get("rotary_base") \
            else random_rotary_tables(spec, positions, x) if spec.get("rotary_tables") \
            else None
        kwargs: dict = {"position_ids": positions[None],
                        "attention_mask": causal_mask(layer, x)}
        if from_spec is not None:
            kwargs["position_embeddings"] = from_spec
        return kwargs


_REGISTRY: dict[str, LayerConverter] = {}


def register_layer_converter(converter: LayerConverter) -> LayerConverter:
    """Register ``converter`` (an instance) for :func:`fusible.convert`; converters are
    asked in registration order, the built-ins first. Raises ValueError for a name
    registered already."""
    if not isinstance(converter, LayerConverter) or not converter.name:
        raise TypeError(f"register_layer_converter needs a LayerConverter instance with a "
                        f"name, got {converter!r}")
    if converter.name in _REGISTRY:
        raise ValueError(f"a layer converter named {converter.name!r} is registered already")
    _REGISTRY[converter.name] = converter
    return converter


def unregister_layer_converter(name: str) -> None:
    """Remove the converter registered as ``name`` (KeyError if none)."""
    del _REGISTRY[name]


def registered_layer_converters() -> dict:
    """``{name: converter}`` in the order :func:`fusible.convert` asks them."""
    return dict(_REGISTRY)


def layer_converter(name: str) -> LayerConverter:
    """The converter registered as ``name`` (KeyError naming the registered ones)."""
    if name not in _REGISTRY:
        raise KeyError(f"no layer converter {name!r} (registered: {sorted(_REGISTRY)})")
    return _REGISTRY[name]


# --- helpers for converters

def has_children(module: Any, required, optional=()) -> bool:
    """Whether ``module`` has the children ``required`` and none but them and
    ``optional`` (what a fused layer would leave out, a probe could miss)."""
    if module is None:
        return False
    names = set(module._modules)
    return set(required) <= names <= set(required) | set(optional)


def separate_projections(spec: dict, input_norm, mlp_norm, qkv: tuple, proj, gate_up: tuple,
                         down, qk_norms: tuple = ()) -> dict:
    """The TransformerLayer parameters of a pre-norm layer whose q/k/v and gate/up
    projections are separate ``nn.Linear`` modules (Llama's, torchtitan's): their weights
    (and biases, where ``spec`` has them) concatenated by autograd on each call, the rest
    as they are; ``qk_norms`` the per-head q and k norms, where ``spec`` has them."""
    params = {"input_norm.weight": input_norm.weight, "mlp_norm.weight": mlp_norm.weight,
              "qkv.weight": joined([m.weight for m in qkv]), "proj.weight": proj.weight,
              "fc1.weight": joined([m.weight for m in gate_up]),  # [gate | up]
              "fc2.weight": down.weight}
    if spec["qkv_bias"]:
        params["qkv.bias"] = joined([m.bias for m in qkv])
    if spec["bias"]:
        params.update({"proj.bias": proj.bias, "fc2.bias": down.bias,
                       "fc1.bias": joined([m.bias for m in gate_up])})
    if spec.get("qk_norm"):
        params.update({"attention.q_norm_weight": qk_norms[0].weight,
                       "attention.k_norm_weight": qk_norms[1].weight})
    return params


def norm_eps(norm: nn.Module) -> Optional[float]:
    """A norm module's epsilon (Hugging Face's ``variance_epsilon``, torch's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def shared_eps(*norms: nn.Module) -> Union[str, float]:
    """The norms' one epsilon, or why there is none (they differ, or cannot be read)."""
    values = {norm_eps(n) for n in norms}
    eps = values.pop() if len(values) == 1 else None
    return "its norms' epsilons differ or cannot be read" if eps is None else eps


NO_CONFIG = "its attention holds no config to read the heads and rotary embedding from"


def common_spec(config, norms: tuple, attention_width: int) -> Union[str, dict]:
    """The TransformerLayer arguments every rotary Hugging Face layer reads alike: the
    heads (``attention_width`` over the config's ``num_attention_heads``), the norms'
    epsilon and the rotary embedding's; or why they cannot be read."""
    eps = shared_eps(*norms)
    if isinstance(eps, str):
        return eps
    heads = config.num_attention_heads
    rotary = rotary_options(config, attention_width // heads)
    if isinstance(rotary, str):
        return rotary
    spec: dict = dict(num_heads=heads, head_dim=attention_width // heads, eps=eps)
    return {**spec, **rotary}


def rotary_options(config, head_dim: int) -> Union[str, dict]:
    """TransformerLayer's rotary arguments from a Hugging Face config's
    ``rope_parameters`` (default and Llama 3.1 rotary types), or why there are none."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # one per layer type
        fractions = {float(v.get("partial_rotary_factor", 1.0)) for v in rope.values()}
        if len(fractions) == 1:  # Gemma 3: each layer gets its type's tables
            return {"rotary_base": None, "rotary_tables": True, "rotary_fraction": fractions.pop()}
    if "rope_theta" not in rope:
        return "its config has no rope_parameters (rope_theta) to read"
    rope_type = rope.get("rope_type", "default")
    fraction = float(rope.get("partial_rotary_factor", 1.0))
    if rope_type not in ("default", "llama3"):  # yarn, longrope, dynamic...: the model's
        return {"rotary_base": None, "rotary_tables": True,  # own tables
                "rotary_fraction": fraction}
    options: dict = {"rotary_base": float(rope["rope_theta"]), "position_ids": True,
               "rotary_fraction": fraction}
    if rope_type == "llama3":
        options["rotary_scaling"] = dict(rope, rope_type="llama3")
    return options


def hf_config(layer: nn.Module) -> Any:
    """A Hugging Face layer's config, read from its attention module (``self_attn``,
    ``attention`` or ``attn``); None where there is none."""
    for name in ("self_attn", "attention", "attn"):
        config = getattr(layer._modules.get(name), "config", None)
        if config is not None:
            return config
    return None


def attention_implementation(layer: nn.Module) -> Optional[str]:
    """The attention implementation (``"sdpa"``, ``"eager"``, ...) of a Hugging Face
    layer, read from its config (:func:`hf_config`)."""
    return getattr(hf_config(layer), "_attn_implementation", None)


def causal_mask(layer: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The mask a Hugging Face model passes its layers for a causal batch without padding:
    None, which the sdpa and flash kernels read as causal, or (the eager attention, read
    from the layer's attention config) the additive ``(1, 1, S, S)`` mask."""
    if attention_implementation(layer) != "eager":
        return None
    seq = x.shape[1]
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
    return torch.zeros(seq, seq, dtype=x.dtype, device=x.device).masked_fill(
        blocked, torch.finfo(x.dtype).min)[None, None]


def rotary_width(spec: dict) -> int:
    """The rotated width of a TransformerLayer spec's heads."""
    return int(round(spec["head_dim"] * spec.get("rotary_fraction", 1.0)))


def random_rotary_tables(spec: dict, positions: torch.Tensor, x: torch.Tensor) -> tuple:
    """Hugging Face-style tables ``(cos, sin)`` ``(1, S, rotary_dim)`` of random angles (both
    halves alike), for probing a layer that takes its model's tables whatever their
    frequencies: the probe checks the rotation."""
    generator = torch.Generator(x.device).manual_seed(2)
    angles = torch.rand(positions.shape[0], rotary_width(spec) // 2, generator=generator,
                        device=x.device) * 6.0
    angles = torch.cat((angles, angles), -1)[None]
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def hf_rotary_tables(spec: dict, positions: torch.Tensor, dtype) -> tuple:
    """Hugging Face's rotary tables ``(cos, sin)`` ``(1, S, rotary_dim)`` (both halves
    alike) for the rotary options of ``spec``."""
    rotary_dim = rotary_width(spec)
    scaling = spec.get("rotary_scaling") or {}
    options = RotaryOptions(spec["rotary_base"], rotary_dim, False,
                            float(scaling.get("factor", 1.0)),
                            float(scaling.get("low_freq_factor", 1.0)),
                            float(scaling.get("high_freq_factor", 4.0)),
                            int(scaling.get("original_max_position_embeddings", 8192)))
    cos, sin = rotary_angles(positions, options)
    return (torch.cat((cos, cos), -1)[None].to(dtype),
            torch.cat((sin, sin), -1)[None].to(dtype))
