"""How a pipeline keeps the tensors its backward needs.

Each op's context holds a saved record (the op's ``saved_type``). Saved tensors that
are inputs of the pipeline's autograd.Function (the input, extra inputs, parameters)
also go through ``save_for_backward``, so that autograd checks their versions. Saved
outputs go *only* through it: a context holding an output would close a reference
cycle through the output's ``grad_fn``. Intermediates stay referenced by the op
contexts only, so dropping a context in the backward frees them; their versions are
recorded and checked here, and a saved view is kept detached so that it holds no
reference to its base. Under saved-tensors hooks (``torch.utils.checkpoint`` with
``use_reentrant=False``, ``save_on_cpu``) intermediates go through ``save_for_backward``
as outputs do, so that the hooks see them: a checkpoint then holds none of them between
the passes.

A joint fusion may overwrite fields of its record in its backward (``consumable_saved``:
a gradient written over the activation it was computed from) where the record alone holds
the tensor: ``ctx.owned`` lists those fields. A backward runs once (the pipeline refuses
``retain_graph``), so nothing reads the overwritten tensor after it.
"""

from __future__ import annotations

import functools
import operator
import sys

import attrs
import torch

_FIELDS: dict = {}  # saved type -> (field names, a getter of all their values at once)


def _fields(record_type) -> tuple:
    found = _FIELDS.get(record_type)
    if found is None:
        names = tuple(f.name for f in attrs.fields(record_type))
        getter = operator.attrgetter(*names) if len(names) > 1 else (
            lambda r, _get=operator.attrgetter(*names): (_get(r),)) if names else (lambda r: ())
        found = _FIELDS[record_type] = (names, getter)
    return found


# Saved records may be frozen: the fuser's own substitutions bypass that.
_set = object.__setattr__
# The innermost saved-tensors hooks in effect, or None (torch's own query)
_saved_tensors_hooks = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False)


class _SavedRef:
    """Placeholder in a saved record for an output kept through ``save_for_backward``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def stash_saved(fctx, ctxs, readers, inputs, outputs, traced: bool = False) -> None:
    """Prepare the op contexts' saved records for the backward (see the module docstring).

    ``readers``: per op, ``(op, reader, record type, consumable fields)``: who reads its
    context's record in the backward (the op itself, or the joint fusion owning it), in
    which type (None: the context must stay empty) and which fields it may overwrite.
    Raises TypeError naming the op when a stage left another record (the fused-op
    equivalence contract). ``traced``: the stages run as custom ops (the compiled path),
    which never write over their inputs: no field is owned.
    """
    input_ids = {id(t) for t in inputs}
    output_ids = {id(t) for t in outputs}
    # Under saved-tensors hooks (non-reentrant activation checkpointing, save_on_cpu)
    # intermediates go through save_for_backward too, so that the hooks see them (and a
    # checkpoint frees them until its recomputation); else the contexts alone hold them
    # and each is freed as soon as its backward stage has run.
    hooked = _saved_tensors_hooks() is not None
    to_save = []
    held: list = []  # id of every intermediate kept, once per field holding it
    candidates: list = []  # (context, field, tensor, held key) a reader may overwrite
    for c, (op, reader, record_type, consumable) in zip(ctxs, readers, strict=True):
        saved = c.saved
        if saved is None:
            continue
        if type(saved) is not record_type:
            raise TypeError(f"the stage covering {op.describe()} saved a "
                            f"{type(saved).__name__}; {reader} reads "
                            f"{'no record' if record_type is None else 'a ' + record_type.__name__}"
                            f" there")
        names, values = _FIELDS.get(type(saved)) or _fields(type(saved))
        versions = refs = None
        for name, t in zip(names, values(saved)):
            if t is None:
                continue
            if id(t) in input_ids:
                to_save.append(t)
            elif id(t) in output_ids:
                _set(saved, name, _SavedRef(len(to_save)))
                to_save.append(t)
                refs = (refs or []) + [name]
            elif isinstance(t, torch.Tensor):
                key = id(t)
                held.append(key)
                if t._base is not None:  # shares the version counter, drops the base
                    t = t.detach()
                    _set(saved, name, t)
                if hooked:
                    _set(saved, name, _SavedRef(len(to_save)))
                    to_save.append(t)
                    refs = (refs or []) + [name]
                    continue
                versions = versions or []
                versions.append((name, t._version))
                # plain tensors only: a wrapper subclass (Float8Tensor) has a storage of its
                # own, not its data's, and writing into it would quantize the gradient
                if name in consumable and not traced and type(t) is torch.Tensor:
                    candidates.append((c, name, t, key))
        if versions:
            c.versions = versions
        if refs:
            c.outputs = refs
    for c, name, t, key in candidates:
        # the record, ``candidates``, ``t`` and getrefcount's argument: nothing else
        if held.count(key) == 1 and sys.getrefcount(t) <= _REFS_ALONE and _sole_holder(t):
            c.owned += (name,)
    fctx.save_for_backward(*to_save)


def _refs_alone() -> int:
    """What ``sys.getrefcount`` says of a tensor held as a candidate of :func:`stash_saved`
    is (one holder, the candidate tuple, the loop variable, the argument), measured on
    this interpreter (its calls may borrow references)."""
    held = [torch.empty(0)]
    candidates = [(None, "", held[0], 0)]
    for _, _, t, _ in candidates:
        return sys.getrefcount(t)
    raise AssertionError("unreachable")


_REFS_ALONE = _refs_alone()


def _sole_holder(t: torch.Tensor) -> bool:
    """Whether no other tensor shares ``t``'s storage (a view, its base, a detached alias):
    its storage's references are ``t``'s and the storage object asked for here."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def restore_saved(fctx, ctxs, ops) -> list:
    """The op contexts with every saved tensor in place, after checking versions."""
    kept = fctx.saved_tensors  # autograd checks these tensors' versions
    for c, op in zip(ctxs, ops):
        if c.versions:
            _check_versions(c.saved, c.versions, op)
        if c.outputs:
            for name in c.outputs:
                _set(c.saved, name, kept[getattr(c.saved, name).index])
    return ctxs


def _check_versions(saved, versions, op) -> None:
    for name, version in versions:
        now = getattr(saved, name)._version
        if now != version:
            raise RuntimeError(
                f"a tensor saved for the backward of {op.describe()} has been modified by an "
                f"inplace operation: its version is {now}, expected {version}")
