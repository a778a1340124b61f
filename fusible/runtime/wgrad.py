"""Running deferred weight gradients, and the checks that none is lost.

:func:`take` hands the queued wgrads over as one callable (a pipeline stage's
``dw_builder``); each runs its stage's ``wgrad_compute`` (through its custom op when
its dgrad ran compiled) and adds the gradients where autograd would have put them:
into ``param.grad`` (set when None, added in place otherwise, as ``AccumulateGrad``
does; cast to the parameter's dtype, as autograd's copy node does under
``torch.autocast``), or into ``main_grad``. Until then the entries are pending: the
next optimizer step over their parameters (whichever thread queued them), or a forward
of the thread that queued them outside :func:`fusible.split_backward`, raises naming
them. Each thread takes and runs its own (``runtime/deferred.py``).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fusible.core import tokens
from fusible.functional import parallel
from fusible.runtime import custom_ops, deferred

_hook = None


class _Runner:
    """A set of taken entries; running it once runs their wgrads and frees their records.
    ``owner``: the thread that took them."""

    def __init__(self, entries: list):
        self.entries, self.owner = entries, threading.get_ident()
        deferred.hand_out(self)

    def __call__(self) -> None:
        entries, self.entries = self.entries, []
        deferred.handed_back(self)
        run_entries(entries)


def take() -> Callable[[], None]:
    """This thread's wgrads queued so far as one callable (its queue left empty): calling
    it runs them, in the order their dgrad stages ran. Any order of calls is correct."""
    install_step_check()
    return _Runner(deferred.drain(threading.get_ident()))


def run_pending() -> None:
    """Run this thread's queued wgrads now."""
    take()()


def pending() -> list:
    """The provenance of every deferred wgrad of this thread not yet run (queued or
    taken)."""
    return [target.stage.provenance for target in _pending_targets(threading.get_ident())]


def _pending_targets(thread: "int | None" = None) -> list:
    """The WgradTarget of every entry not yet run, queued then taken: every thread's, or
    ``thread``'s."""
    entries = deferred.queue(thread) + [e for runner in deferred.taken(thread)
                                        for e in runner.entries]
    return [tokens.lookup(entry[0]) for entry in entries]


def run_entries(entries) -> None:
    """Run queue entries ``(target token, record, compiled, owner)``, in the order given."""
    for token, record, compiled, _ in entries:
        run_entry(tokens.lookup(token), record, compiled)


def run_entry(target, record, compiled: bool) -> None:
    """Compute one deferred wgrad and add it into its parameters' gradients."""
    st, split = target.stage, target.split
    if compiled:
        result = custom_ops.call_wgrad(st, split, record)
    else:
        result = split.wgrad(record)
    del record  # the saved input and dy: freed once the GEMMs have read them
    grads = list(result.grad_params)
    if len(grads) != st.num_params:
        raise RuntimeError(f"{type(st.op).__name__}.wgrad_compute returned {len(grads)} "
                           f"parameter gradients for the stage's {st.num_params}")
    sync = dict(split.grad_reduction)
    params = target.params()
    with torch.no_grad():
        for k, (p, deferred_k) in enumerate(zip(params, split.deferred)):
            g = grads[k]
            if not deferred_k or g is None:
                continue
            if k in sync:
                g = parallel.all_reduce(g, sync[k])
            _accumulate(p, g, split.into_main_grad[k], st.provenance)


def _accumulate(param, g, into_main: bool, where: str) -> None:
    if g.shape != param.shape:
        raise RuntimeError(f"the wgrad stage {where} returned a gradient of shape "
                           f"{tuple(g.shape)} for a parameter of shape {tuple(param.shape)}")
    if into_main:
        param.main_grad.add_(g)
        return
    g = g.to(param.dtype)
    if param.grad is None:
        param.grad = g if g.is_contiguous() else g.contiguous()
    else:
        param.grad.add_(g)


def check_forward(name: str) -> None:
    """Raise if this thread's wgrads are pending at a forward outside ``split_backward``."""
    waiting = pending()
    if waiting:
        raise RuntimeError(f"{name}: a forward ran outside fusible.split_backward() while "
                           f"{len(waiting)} deferred weight gradient(s) have not run (first: "
                           f"{waiting[0]}); run them first (fusible.run_deferred_wgrad(), or "
                           f"the callable fusible.take_deferred_wgrad() returned)")


def install_step_check() -> None:
    """Once per process: every optimizer step first checks that no wgrad of its
    parameters is pending."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)


def _check_step(optimizer, args, kwargs) -> None:
    targets = _pending_targets()
    if not targets:
        return
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for target in targets:
        if any(id(p) in mine for p in target.params()):
            raise RuntimeError(f"{type(optimizer).__name__}.step(): the deferred weight "
                               f"gradient of {target.stage.provenance} has not run, so its "
                               f"parameters' gradients are incomplete; run the deferred wgrads "
                               f"before the step (fusible.run_deferred_wgrad(), or the "
                               f"schedule's backward_weight steps)")
