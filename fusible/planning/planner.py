"""The fusion planner: one scan serves every registered fusion.

Forward and backward are planned independently. The forward scan walks the
ops front to back, the backward scan back to front (the order the backward
pass runs). At each position every registered fusion of that direction is
tried; among the matches its ``accepts`` allows, the longest wins, ties going
to the higher priority, then to the fusion registered first. Where nothing
matches, the basic op is its own stage. Every match is recorded: chosen,
superseded by a longer one, or refused with the reason. The result must flatten
back to the basic ops in order.

Joint fusions (``direction = "both"``) are matched first, front to back, by the same
rule; each chosen one is a stage of both passes, and the two scans go around it.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from fusible.core.conditions import PlanConditions
from fusible.core.fused import FusedOperation
from fusible.core.operation import BasicOperationSpec, FusibleSpec
from fusible.core.pattern import Match
from fusible.planning.registry import registered_fusions


@attrs.frozen
class PlanEnvironment:
    """What a plan depends on besides the ops; passed to ``accepts(match, env)``.

    Attributes
    ----------
    conditions : PlanConditions
        Dtype, device type, grad mode, what requires grad, recipe, training mode.
    needs : dict
        Global op index -> :class:`~fusible.core.results.OpGradNeeds`.
    recipe : Recipe or None
        The FP8 recipe in effect (the one ``conditions.recipe_key`` names), or None.
    op_recipes : dict
        Global op index -> the recipe that op computes under: ``recipe``, or None for a
        GEMM its ``gemm_policy`` (or its ``fp8`` attribute) keeps in high precision
        (:mod:`fusible.quantization.gemm_policy`). Empty: ``recipe`` for every op.
    """

    conditions: PlanConditions
    needs: dict = attrs.field(eq=False)
    recipe: Any = None
    op_recipes: dict = attrs.field(factory=dict, eq=False)

    def recipe_of(self, *indices: int):
        """The recipe the ops at these global indices compute under: the plan's where
        one of them does, else None (GEMMs the policy keeps in high precision)."""
        if not self.op_recipes:
            return self.recipe
        return self.recipe if any(self.op_recipes.get(i, self.recipe) is not None
                                  for i in indices) else None

    @property
    def device_type(self) -> str:
        """``"cpu"``, ``"cuda"``, ..."""
        return self.conditions.device_type

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the pipeline input."""
        return self.conditions.dtype

    @property
    def grad_enabled(self) -> bool:
        """Whether autograd records this call (and so whether a backward exists)."""
        return self.conditions.grad_enabled

    @property
    def training(self) -> bool:
        return self.conditions.training

    @property
    def needs_backward(self) -> bool:
        return any(n.any for n in self.needs.values())


@attrs.frozen
class Stage:
    """One step of a plan: a basic op, a fusion, or an ordinary module.

    Attributes
    ----------
    name : str
        The operation's class name, e.g. ``"ForwardLinearBias"`` or ``"Bias"``.
    indices : tuple of int
        Positions of the covered ops in the flattened pipeline, ascending.
    op : torch.nn.Module
        The stage's operation (a fused op is built by the planner).
    direction : str
        ``"forward"`` or ``"backward"``.
    compile_reason : str or None
        Why this stage cannot run compiled, or None (ordinary modules: None); found by
        the runtime when it prepares the plan.
    called_alone : bool
        The item runs as its own module call: an ordinary module, or an operation with
        module hooks (which no fusion crosses).
    """

    name: str
    indices: tuple
    op: Any = attrs.field(eq=False, repr=False)
    direction: str = "forward"
    compile_reason: Optional[str] = attrs.field(default=None, eq=False)
    called_alone: bool = False

    @property
    def fused(self) -> bool:
        """Whether a fusion covers this stage."""
        return isinstance(self.op, FusedOperation)

    @property
    def inline_when_compiled(self) -> bool:
        """Whether a compiled graph runs this stage's compute inline (its ops traced as
        they are) instead of as its custom op: a stage of aliases only (see the op's
        ``inline_when_compiled``)."""
        return not self.is_module and self.op.inline_when_compiled(self.direction)

    @property
    def is_module(self) -> bool:
        """Whether the stage is a module call of its own (an ordinary ``nn.Module``, or an
        operation with hooks) rather than a planned stage."""
        return self.called_alone or not isinstance(self.op, (FusibleSpec, FusedOperation))


@attrs.frozen
class Candidate:
    """A fusion that matched somewhere, and what the planner did with it.

    ``status`` is ``"chosen"``, ``"superseded"`` (a longer or earlier-registered
    match won) or ``"refused"`` (an attribute check or ``accepts`` said no;
    ``reason`` says why).
    """

    fusion: str
    direction: str
    indices: tuple
    status: str
    reason: str = ""


@attrs.frozen
class GroupPlan:
    """The plan of one run of basic ops (a group between ordinary modules)."""

    forward: tuple
    backward: tuple
    candidates: tuple
    env: PlanEnvironment


def plan_group(ops: tuple, start: int, env: PlanEnvironment) -> GroupPlan:
    """Plan a group of basic ops whose first op sits at ``start`` in the pipeline."""
    claims, joint_candidates = _claim_joint(ops, start, env)
    forward, fwd_candidates = _scan(ops, start, env, "forward", claims)
    backward, bwd_candidates = ((), ())
    if env.needs_backward:
        backward, bwd_candidates = _scan(ops, start, env, "backward", claims)
    _check_flattens(ops, start, forward, list(forward))
    _check_flattens(ops, start, backward, list(reversed(backward)) if backward else None)
    return GroupPlan(forward, backward, joint_candidates + fwd_candidates + bwd_candidates, env)


def _claim_joint(ops, start, env) -> tuple:
    """The joint fusions' matches, chosen first, front to back: ``({local index of the
    first op: (fusion instance, match)}, candidates)``. Both scans then take each claim
    as it is and let no other fusion overlap it."""
    fusions = registered_fusions("both")
    claims, candidates, pos = {}, [], 0
    while fusions and pos < len(ops):
        best, found = _best_at(fusions, ops, start, list(ops), pos, env, "both", {})
        candidates += found
        if best is None:
            pos += 1
            continue
        fusion, match = best
        claims[match.indices[0] - start] = (fusion(match), match)
        pos += len(match)
    return claims, tuple(candidates)


def _claimed_by(claims: dict) -> dict:
    """Local op index -> the joint fusion's name, for every op a claim covers."""
    return {lo + k: type(op).__name__ for lo, (op, match) in claims.items()
            for k in range(len(match))}


def _scan(ops, start, env, direction, claims):
    n = len(ops)
    reverse = direction == "backward"
    seq = list(ops[::-1]) if reverse else list(ops)
    fusions = registered_fusions(direction)
    claimed = _claimed_by(claims)
    # where each claim is met: its first op going forward, its last going backward
    entries = {(lo + len(m) - 1 if reverse else lo): (op, m) for lo, (op, m) in claims.items()}
    stages, candidates = [], []
    pos = 0
    while pos < n:
        local = n - 1 - pos if reverse else pos
        if local in entries:
            op, match = entries[local]
            stages.append(Stage(type(op).__name__, match.indices, op, direction))
            for p in range(pos, pos + len(match)):  # what the claim keeps out, for the plan
                candidates += _best_at(fusions, ops, start, seq, p, env, direction, claimed)[1]
            pos += len(match)
            continue
        best, found = _best_at(fusions, ops, start, seq, pos, env, direction, claimed)
        candidates += found
        if best is not None:
            fusion, match = best
            stages.append(Stage(fusion.__name__, match.indices, fusion(match), direction))
            pos += len(match)
        else:
            op = ops[local]
            stages.append(Stage(op.__class__.__name__, (start + local,), op, direction))
            pos += 1
    return tuple(stages), tuple(candidates)


def _best_at(fusions, ops, start, seq, pos, env, direction, claimed) -> tuple:
    """The match that wins at ``pos`` of ``seq`` (None if none is accepted), and every
    candidate found there with its status. A match over ops that a joint fusion owns
    (``claimed``: local index -> its name) is refused."""
    reverse = direction == "backward"
    accepted: list[tuple[type, Match]] = []  # (fusion, match)
    candidates = []
    for fusion in fusions:
        for length, names, failures in fusion.pattern.matches(seq, pos, reverse=reverse):
            if length == 0:
                continue
            match = _make_match(ops, start, seq, pos, length, names, reverse)
            owner = next((claimed[i - start] for i in match.indices if i - start in claimed),
                         None)
            if owner is not None:
                verdict = (f"its ops overlap those of the joint fusion {owner}, which owns "
                           f"both passes")
            else:
                verdict = " and ".join(failures) if failures else _ask(fusion, match, env)
            if verdict is True:
                accepted.append((fusion, match))
            else:
                candidates.append(Candidate(fusion.__name__, direction, match.indices,
                                            "refused", verdict))
    if not accepted:
        return None, candidates
    best = max(accepted, key=lambda fm: len(fm[1]))  # max() keeps the first of ties
    for fm in accepted:
        status, why = ("chosen", "") if fm is best else (
            "superseded", f"{best[0].__name__} at {list(best[1].indices)} won")
        candidates.append(Candidate(fm[0].__name__, direction, fm[1].indices, status, why))
    return best, candidates


def _make_match(ops, start, seq, pos, length, names, reverse) -> Match:
    if reverse:
        lo = len(ops) - pos - length
    else:
        lo = pos
    return Match(tuple(ops[lo:lo + length]), tuple(range(start + lo, start + lo + length)), names)


def _ask(fusion, match, env):
    if not fusion.handles_communication:
        talking = [(op.describe(), d) for op in match.ops for d in fusion.directions()
                   if op.communication(d)]
        if talking:
            return (f"it covers {talking[0][0]}, whose {talking[0][1]} compute "
                    f"communicates, and does not run collectives itself "
                    f"(handles_communication=False)")
    verdict = fusion.accepts(match, env)
    if verdict is not True:
        if not isinstance(verdict, str) or not verdict:
            raise TypeError(f"{fusion.__name__}.accepts() must return True or a non-empty "
                            f"reason string, got {verdict!r}")
        return verdict
    return _fp8_contract(fusion, match, env.recipe_of(*match.indices))


def _fp8_contract(fusion, match, recipe):
    """Under a recipe, a fusion over an op that quantizes in its direction must say how
    it takes its input or gradient (its own format hook): else its saved state or its
    GEMMs would silently leave the recipe's layout."""
    if recipe is None or fusion.declares_format():
        return True
    quantizing = [(op.describe(), d) for op in match.ops for d in fusion.directions()
                  if op.quantizes(recipe, d)]
    if not quantizing:
        return True
    what, direction = quantizing[0]
    hooks = {"forward": "input_format()", "backward": "grad_format()"}
    hook = " and ".join(hooks[d] for d in fusion.directions())
    return (f"it covers {what}, which quantizes in the {direction} pass under {recipe!r}, "
            f"and does not declare {hook}: define it to take part in FP8 plans")


def _check_flattens(ops, start, stages, in_forward_order) -> None:
    """Verify that the stages cover the basic ops exactly once, in order."""
    if in_forward_order is None:
        return
    covered = [i for stage in in_forward_order for i in stage.indices]
    expected = list(range(start, start + len(ops)))
    if covered != expected:
        raise RuntimeError(f"plan does not flatten back to the basic ops: stages cover "
                           f"{covered}, expected {expected}")
    for stage in stages:
        got = stage.op.basic_ops()
        want = tuple(ops[i - start] for i in stage.indices)
        # != rather than `is not`: a lone op's plan holds a proxy of it
        if len(got) != len(want) or any(a != b for a, b in zip(got, want)):
            raise RuntimeError(
                f"plan does not flatten back to the basic ops: {stage.name} at "
                f"{list(stage.indices)} reports basic ops {[type(o).__name__ for o in got]}, "
                f"expected {[type(o).__name__ for o in want]}")
        if not all(isinstance(o, BasicOperationSpec) for o in got):
            raise RuntimeError(f"{stage.name} reports non-basic ops {got!r}")
