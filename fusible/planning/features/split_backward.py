"""The split backward's planning pass (:func:`fusible.split_backward`): each backward stage
whose class defines ``dgrad_compute`` / ``wgrad_compute`` and whose ``deferred_params``
allow it runs as a dgrad stage in the backward pass, and queues its deferred wgrad
(``runtime/features/split_backward.py`` runs the dgrad and queues the record;
``runtime/wgrad.py`` runs the queue)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import attrs

from fusible.core import tokens
from fusible.planning.exec_plan import ExecStage, Preparation, stage_recipe
from fusible.planning.features import grad_reduction


@attrs.frozen
class SplitStage:
    """How one backward stage splits.

    Attributes
    ----------
    deferred : tuple of bool
        Per parameter of the stage: whether its gradient goes to the wgrad lane.
    dgrad, wgrad : callable
        The class's ``dgrad_compute`` (given the stage's output format where its kernels
        write it) and ``wgrad_compute``.
    target : WgradTarget
        Where the deferred records go, named by its token in compiled graphs.
    into_main_grad : tuple of bool
        Per parameter: whether its gradient goes into ``main_grad``.
    grad_reduction : tuple
        ``((parameter index, group), ...)`` summed over their group after the wgrad.
    """

    deferred: tuple
    dgrad: Callable[..., Any]
    wgrad: Callable[..., Any]
    target: "WgradTarget"
    into_main_grad: tuple
    grad_reduction: tuple = ()


@attrs.frozen
class SplitBackward:
    """The split stages by their backward stage's ``lo``, the wgrad lane's public Stages
    (direction ``"wgrad"``) and ``(Stage, reason)`` of the stages kept whole."""

    stages: tuple  # ((lo, SplitStage), ...)
    lane: tuple
    kept: tuple

    def of(self, lo: int) -> Optional[SplitStage]:
        """The split of the backward stage at ``lo``, or None."""
        return dict(self.stages).get(lo)


class WgradTarget:
    """Where a deferred wgrad goes: the split stage (``stage`` and ``split``, set once
    built) of a group whose ops are ``ops``; named by its token in compiled graphs."""

    def __init__(self, ops: tuple):
        self.ops = ops
        self.stage: Optional[ExecStage] = None
        self.split: Optional[SplitStage] = None
        self.token = tokens.register(self)

    def params(self) -> list:
        """The parameters of the stage's ops, read afresh (they may have been swapped)."""
        st = self.stage
        if st is None:
            raise RuntimeError("a WgradTarget is used before its stage is set")
        return [op.param(name) for op in self.ops[st.lo:st.hi] for name in op.param_names]


def attach(prep: Preparation, attached: dict) -> Optional[SplitBackward]:
    """Each stage whose parameters need gradients split into its dgrad stage and a
    deferred wgrad stage, where it can (``deferred_params``)."""
    if not prep.conditions.split_backward:
        return None
    # the deferred gradients' all-reduces: read from their pass, whatever the fields' order
    reduction = grad_reduction.attach(prep, {})
    splits, lane, kept = [], [], []
    for st, stage in zip(prep.backward, prep.backward_public):
        wanted = st.grad_mask[1] if st.num_params else ()
        if not any(wanted):
            continue
        verdict = _deferral(st, prep.needs, stage_recipe(st, prep.op_recipes, "backward")
                            if prep.op_recipes else prep.recipe)
        if isinstance(verdict, str):
            kept.append((stage, verdict))
            continue
        deferred = tuple(bool(d and w) for d, w in zip(verdict, wanted))
        if not any(deferred):
            kept.append((stage, f"{stage.name} defers none of the gradients it computes"))
            continue
        splits.append((st.lo, _split(st, deferred, prep.ops,
                                     reduction.of(st.lo) if reduction is not None else ())))
        lane.append(attrs.evolve(stage, direction="wgrad"))
    return SplitBackward(tuple(splits), tuple(lane), tuple(kept))


def _deferral(st: ExecStage, needs: tuple, recipe) -> "tuple | str":
    """The stage's ``deferred_params``, or why its backward cannot split."""
    if recipe is not None and recipe.stateful:
        return (f"under {recipe.name} scaling each cast records into an amax history, "
                f"which a deferred wgrad would record out of order")
    verdict = st.op.deferred_params(recipe, needs[st.lo:st.hi])
    if not isinstance(verdict, str) and len(verdict) != st.num_params:
        raise TypeError(f"{type(st.op).__name__}.deferred_params returned {len(verdict)} flags "
                        f"for the stage's {st.num_params} parameters")
    return verdict


def _split(st: ExecStage, deferred: tuple, ops: tuple, reduction: tuple) -> SplitStage:
    """How ``st`` splits: its ``deferred`` parameter gradients go to the wgrad lane."""
    cls = st.op.__class__
    dgrad = cls.dgrad_compute
    fmt = st.output_format
    if cls.quantizes_own_output and fmt is not None and not fmt.stateful:
        dgrad = functools.partial(dgrad, output_format=fmt if fmt.kernel_cast else None)
    target = WgradTarget(ops)
    main = tuple(name in op.main_grad_params for op in st.ops for name in op.param_names)
    split = SplitStage(deferred, dgrad, cls.wgrad_compute, target, main, reduction)
    target.stage, target.split = st, split
    return split
