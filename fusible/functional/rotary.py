"""Rotary position embeddings (RoPE), in the two conventions in use, on ``(..., heads,
head_dim)`` tensors: the plain-PyTorch arithmetic (the CPU path and the reference of the
Triton kernel in :mod:`fusible.kernels.rotary`).

A token at position ``p`` rotates each pair ``(x1, x2)`` of its first ``rotary_dim``
features by the angle ``p * inv_freq[i]``::

    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin

where pair ``i`` is ``(x[i], x[i + rotary_dim / 2])`` in Hugging Face's ``rotate_half``
convention (GPT-NeoX's) and ``(x[2i], x[2i + 1])`` in the interleaved one (GPT-J's, Meta's
original Llama); features past ``rotary_dim`` pass through (partial rotary, as GPT-NeoX
and Phi). ``inv_freq[i] = base ** (-2i / rotary_dim)``, optionally rescaled as Llama 3.1
does for long contexts. Angles are float32 products, as Hugging Face computes them; the
rotation is computed in float32 (float64 for float64 inputs) and rounded once.
"""

from __future__ import annotations

import collections
import functools
import math
import weakref

import attrs
import torch

Tensor = torch.Tensor

__all__ = ["RotaryOptions", "apply_rotary", "inverse_frequencies", "rotary_angles"]


@attrs.frozen
class RotaryOptions:
    """How the rotary embedding rotates (the formulas: the module notes).

    Attributes
    ----------
    base : float
        The frequencies' base (``rope_theta``).
    rotary_dim : int
        How many leading features of each head rotate (even; the head size for full
        rotary).
    interleaved : bool
        Pairs ``(x[2i], x[2i+1])`` rather than ``rotate_half``'s halves.
    scaling_factor : float
        Llama 3.1's ``factor`` (1: no rescaling).
    low_freq_factor, high_freq_factor : float
        Llama 3.1's wavelength bounds, as fractions of ``original_max_position``.
    original_max_position : int
        The context the frequencies were trained for (``original_max_position_embeddings``).
    """

    base: float
    rotary_dim: int
    interleaved: bool = False
    scaling_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def inverse_frequencies(options: RotaryOptions, device=None) -> Tensor:
    """``inv_freq`` (float32, ``rotary_dim / 2``), Llama 3.1's rescaling applied where
    ``scaling_factor != 1`` (Hugging Face's ``rope_type="llama3"``)."""
    exponents = torch.arange(0, options.rotary_dim, 2, dtype=torch.int64, device=device)
    inv_freq = 1.0 / (options.base ** (exponents.float() / options.rotary_dim))
    if options.scaling_factor == 1.0:
        return inv_freq
    factor, old = options.scaling_factor, options.original_max_position
    low, high = options.low_freq_factor, options.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rotary_angles(positions: Tensor, options: RotaryOptions) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` float32 of shape ``positions.shape + (rotary_dim / 2,)``."""
    angles = positions.float()[..., None] * inverse_frequencies(options, positions.device)
    return angles.cos(), angles.sin()


_SEQUENCE_TABLES: collections.OrderedDict = collections.OrderedDict()
_POSITIONS: collections.OrderedDict = collections.OrderedDict()
_KEPT = 16  # the last (seq, device[, options]) of each


def _keepable(device: torch.device) -> bool:
    """Whether what is made now may be kept for later calls: not an inference tensor
    (training could not save it), not in a CUDA graph's pool (the graph must own what it
    reads): neither while a graph captures nor on a side stream (torch.compile's CUDA
    graph trees warm a graph up on a stream of their own, allocating from its private
    pool, where nothing may stay allocated)."""
    if torch.is_inference_mode_enabled():
        return False
    if device.type != "cuda":
        return True
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch._C._cuda_getCurrentStream(index)[0] == 0 and \
        not torch.cuda.is_current_stream_capturing()


def _kept(store: collections.OrderedDict, key, make, keep: bool):
    keep = keep and _keepable(key[1])
    found = store.get(key) if keep else None
    if found is not None:
        return found
    made = make()
    if keep:
        store[key] = made
        _trim(store)
    return made


def _trim(store: collections.OrderedDict) -> None:
    """Drop ``store``'s oldest entries past the last ``_KEPT``."""
    while len(store) > _KEPT:
        try:  # (a dying positions tensor's callback may drop an entry meanwhile)
            store.popitem(last=False)
        except KeyError:
            break


def sequence_positions(seq: int, device: torch.device) -> Tensor:
    """The positions ``0..seq-1`` as one kept tensor per ``(seq, device)``: fusible's own,
    which nothing writes, so that :func:`sequence_angles` can be known by it (a converted
    layer hands it to its attention for the model's positions of a plain call). Traced by
    dynamo, a new tensor (a compiled graph makes its own)."""
    if torch.compiler.is_compiling():
        return torch.arange(seq, device=device)
    return _kept(_POSITIONS, (seq, device), lambda: torch.arange(seq, device=device), True)


def is_sequence_positions(positions: Tensor) -> bool:
    """Whether ``positions`` is :func:`sequence_positions`' tensor of its length."""
    return _POSITIONS.get((positions.shape[-1], positions.device)) is positions


def sequence_angles(seq: int, device: torch.device, options: RotaryOptions,
                    keep: bool = True) -> tuple[Tensor, Tensor]:
    """``rotary_angles`` of the positions ``0..seq-1``, kept per ``(seq, device,
    options)`` (the last 16): every layer of a step, and every step, reads the same tables
    (on a GPU, eight small kernels a layer call saved); read-only. ``keep=False`` (tracing
    with fake tensors), inference mode and a CUDA graph capturing make them afresh,
    neither read nor kept."""
    return _kept(_SEQUENCE_TABLES, (seq, device, options),
                 lambda: rotary_angles(torch.arange(seq, device=device), options), keep)


# key -> (weakref to the positions tensor, tables)
_BY_POSITIONS: collections.OrderedDict = collections.OrderedDict()


def angles_of(positions: Tensor, batch: int, seq: int, options: RotaryOptions,
              make) -> tuple[Tensor, Tensor]:
    """``make()`` (the rotary tables of the position ids ``positions`` for ``batch`` x
    ``seq`` tokens), kept while that tensor lives and is unchanged (its version): a
    model's layers take one positions tensor a step, forward and backward, which a
    compiled graph hands its custom ops (where :func:`sequence_positions` cannot be
    recognised): one table a step, not two a layer. The entry goes with the tensor.

    Not kept where :func:`sequence_angles` would not be (inference mode, a CUDA graph
    capturing, a side stream), for inference tensors (no version to read) and under
    functorch's transforms. A write the version does not see (through ``.data``, a
    kernel of one's own, a CUDA graph's replay into a static buffer) would leave the tables
    stale: positions are tensors a model makes each step, or ones written by PyTorch ops."""
    if not _keepable(positions.device) or positions.is_inference() or \
            torch._C._are_functorch_transforms_active():
        return make()
    key = (id(positions), positions._version, tuple(positions.shape), batch, seq, options)
    found = _BY_POSITIONS.get(key)
    if found is not None and found[0]() is positions:
        return found[1]
    tables = make()
    ref = weakref.ref(positions, functools.partial(_forget, key))
    _BY_POSITIONS[key] = (ref, tables)
    _trim(_BY_POSITIONS)  # (versions of one living tensor)
    return tables


def _forget(key: tuple, dead: weakref.ref) -> None:
    """Drop the entry of a positions tensor that died (not a later one at its id)."""
    found = _BY_POSITIONS.get(key)
    if found is not None and found[0] is dead:
        _BY_POSITIONS.pop(key, None)


def _pairs(x: Tensor, options: RotaryOptions) -> tuple[Tensor, Tensor]:
    rot = x[..., :options.rotary_dim]
    if options.interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    half = options.rotary_dim // 2
    return rot[..., :half], rot[..., half:]


def _unpairs(y1: Tensor, y2: Tensor, options: RotaryOptions) -> Tensor:
    if options.interleaved:
        return torch.stack((y1, y2), -1).flatten(-2)
    return torch.cat((y1, y2), -1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, options: RotaryOptions, *,
                 inverse: bool = False) -> Tensor:
    """Rotate ``x`` ``(..., S, heads, head_dim)`` by the angles ``cos, sin`` ``(..., S,
    rotary_dim / 2)`` (one per token, shared by the heads); ``inverse`` rotates back (the
    backward: the rotation's transpose). Computed in float32 (float64 for float64 ``x``),
    rounded once to ``x``'s dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = cos.to(acc)[..., None, :], sin.to(acc)[..., None, :]
    if inverse:
        sin = -sin
    x1, x2 = (part.to(acc) for part in _pairs(x, options))
    rotated = _unpairs(x1 * cos - x2 * sin, x2 * cos + x1 * sin, options)
    rest = x[..., options.rotary_dim:].to(acc)
    return torch.cat((rotated, rest), -1).to(x.dtype)
