"""How a pipeline keeps the tensors its backward needs.

Saved tensors that are inputs of the pipeline's autograd.Function (the input,
extra inputs, parameters) also go through ``save_for_backward``, so that
autograd checks their versions. Saved outputs go *only* through it: a context
holding an output would close a reference cycle through the output's
``grad_fn``. Intermediates stay referenced by the op contexts only, so dropping
a context in the backward frees them; their versions are recorded and checked
here, and a saved view is kept detached so that it holds no reference to its base.
"""

from __future__ import annotations


class _SavedRef:
    """Placeholder in ``ctx.saved`` for an output kept through ``save_for_backward``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def stash_saved(fctx, ctxs, inputs, outputs) -> None:
    """Prepare the op contexts' saved tensors for the backward (see the module docstring)."""
    input_ids = {id(t) for t in inputs}
    output_ids = {id(t) for t in outputs}
    to_save = []
    for c in ctxs:
        saved = c.saved
        versions = None
        for k, t in enumerate(saved):
            if t is None:
                continue
            if id(t) in input_ids:
                to_save.append(t)
            elif id(t) in output_ids:
                saved = c.saved = list(saved) if type(saved) is not list else saved
                saved[k] = _SavedRef(len(to_save))
                to_save.append(t)
            else:
                if t._base is not None:  # shares the version counter, drops the base
                    saved = c.saved = list(saved) if type(saved) is not list else saved
                    t = saved[k] = t.detach()
                versions = versions or []
                versions.append((k, t._version))
        if versions:
            c.versions = versions
    fctx.save_for_backward(*to_save)


def restore_saved(fctx, ctxs, ops) -> list:
    """The op contexts with every saved tensor in place, after checking versions."""
    if ctxs is None:
        raise RuntimeError("fusible frees saved intermediates during the backward pass: "
                           "backward through the same graph twice (retain_graph=True) is not "
                           "supported; run the forward again")
    kept = fctx.saved_tensors  # autograd checks these tensors' versions
    for i, c in enumerate(ctxs):
        saved = c.saved
        if c.versions:
            _check_versions(saved, c.versions, ops[i])
        if type(saved) is list:  # stash_saved rewrote it: put saved outputs back
            c.saved = tuple([kept[t.index] if type(t) is _SavedRef else t for t in saved])
    return ctxs


def _check_versions(saved, versions, op) -> None:
    for k, version in versions:
        if saved[k]._version != version:
            raise RuntimeError(
                f"a tensor saved for the backward of {op.describe()} has been modified by an "
                f"inplace operation: its version is {saved[k]._version}, expected {version}")
