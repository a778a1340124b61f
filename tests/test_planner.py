"""The planner: priorities, optional elements, refusals, caching and re-planning."""

import attrs
import pytest
import torch

import fusible
from fusible import Check, FusedOperation, Op, Pattern, ops
from fusible.ops import BackwardResult, ForwardResult
from fusible.testing import stage_names
from plugin_registries import Registries


@attrs.frozen
class _Args:
    input: torch.Tensor


def make_fusion(name, pattern, direction="forward", accepts=None):
    """A test fusion that computes the identity over any run of Identity-like ops."""
    body = {"direction": direction, "pattern": pattern}
    if direction == "forward":
        body.update(fwd_args_type=_Args,
                    forward_args=lambda self, x, p, e, c: _Args(x),
                    forward_compute=classmethod(lambda cls, a, *, in_custom_op=False:
                                                ForwardResult(a.input)),
                    save_for_backward=lambda self, a, r, c: None)
    else:
        body.update(bwd_args_type=_Args,
                    backward_args=lambda self, dy, de, c: _Args(dy),
                    backward_compute=classmethod(lambda cls, a, *, in_custom_op=False:
                                                 BackwardResult(a.input)))
    if accepts is not None:
        body["accepts"] = classmethod(accepts)
    return type(name, (FusedOperation,), body)


def test_longer_match_wins(plugins):
    plugins.fusion(make_fusion("TwoIds", Pattern(Op(ops.Identity), Op(ops.Identity))))
    plugins.fusion(make_fusion("ThreeIds", Pattern(Op(ops.Identity), Op(ops.Identity),
                                               Op(ops.Identity))))
    plan = ops.Sequential(*[ops.Identity() for _ in range(4)]).plan()
    assert [(s.name, s.indices) for s in plan.forward] == [("ThreeIds", (0, 1, 2)),
                                                            ("Identity", (3,))]
    statuses = {(c.fusion, c.indices): c.status for c in plan.candidates}
    assert statuses[("TwoIds", (0, 1))] == "superseded"
    assert statuses[("ThreeIds", (0, 1, 2))] == "chosen"


def test_registration_order_breaks_ties(plugins):
    plugins.fusion(make_fusion("FirstPair", Pattern(Op(ops.Identity), Op(ops.Identity))))
    plugins.fusion(make_fusion("SecondPair", Pattern(Op(ops.Identity), Op(ops.Identity))))
    plan = ops.Sequential(ops.Identity(), ops.Identity()).plan()
    assert stage_names(plan.forward) == ["FirstPair"]
    second = [c for c in plan.candidates if c.fusion == "SecondPair"]
    assert second[0].status == "superseded" and "FirstPair" in second[0].reason


def test_a_model_planned_before_a_registry_change_replans(plugins):
    """A registered or unregistered fusion reaches models whose plans are cached: a
    fusion removed is never run again by a model planned with it."""
    model = ops.Sequential(ops.Identity(), ops.Identity())
    x = torch.ones(2, requires_grad=True)
    assert stage_names(model.plan(x).forward) == ["Identity", "Identity"]
    ran = []
    pair = make_fusion("LatePair", Pattern(Op(ops.Identity), Op(ops.Identity)))
    pair.forward_compute = classmethod(lambda cls, a, *, in_custom_op=False:
                                       ran.append(1) or ForwardResult(a.input))
    plugins.fusion(pair)
    assert stage_names(model.plan(x).forward) == ["LatePair"]
    model(x)
    assert ran == [1]
    fusible.unregister_fusion(pair)
    assert stage_names(model.plan(x).forward) == ["Identity", "Identity"]
    model(x)
    assert ran == [1]


def test_restored_registries_plan_in_their_order():
    """What the plugins fixture restores after a test: built-ins it removed come back in
    their planning order, not after the others."""
    before = Registries.now()
    first, *_ = removed = before.fusions[:3]
    for cls in removed:
        fusible.unregister_fusion(cls)
    fusible.register_fusion(first)  # now the last registered
    assert Registries.now() != before
    before.restore()
    assert Registries.now() == before


def test_backward_is_scanned_from_the_end(plugins):
    plugins.fusion(make_fusion("FwdPair", Pattern(Op(ops.Identity), Op(ops.Identity))))
    plugins.fusion(make_fusion("BwdPair", Pattern(Op(ops.Identity), Op(ops.Identity)), "backward"))
    model = ops.Sequential(*[ops.Identity() for _ in range(3)])
    plan = model.plan(torch.ones(2, requires_grad=True))
    assert [s.indices for s in plan.forward] == [(0, 1), (2,)]
    assert [s.indices for s in plan.backward] == [(1, 2), (0,)]
    x = torch.randn(4, requires_grad=True)
    model(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4))


def test_optional_and_alternative_elements():
    pattern = Pattern(Op(ops.BasicLinear, name="linear"), Op(ops.Bias, name="bias", optional=True),
                      Op(ops.ReLU, name="act") | Op(ops.SiLU, name="act"))
    seq = [ops.BasicLinear(2, 2), ops.Bias(2), ops.SiLU()]
    (length, names, failures), = pattern.matches(seq, 0)
    assert length == 3 and names["act"] is seq[2] and not failures
    seq = [ops.BasicLinear(2, 2), ops.ReLU()]
    (length, names, _), = pattern.matches(seq, 0)
    assert length == 2 and names["bias"] is None and names["act"] is seq[1]
    assert pattern.matches([ops.BasicLinear(2, 2), ops.GELU()], 0) == []


def test_optional_tries_longer_first():
    pattern = Pattern(Op(ops.Identity), Op(ops.Identity, optional=True))
    assert [m[0] for m in pattern.matches([ops.Identity(), ops.Identity()], 0)] == [2, 1]


def test_attribute_and_where_checks_give_refusal_reasons(plugins):
    plugins.fusion(make_fusion("TanhOnly", Pattern(
        Op(ops.GELU, approximate="tanh"),
        Op(ops.ConstantScale, where=Check(lambda op: op.scale > 0, "a positive scale")))))
    plan = ops.Sequential(ops.GELU(), ops.ConstantScale(-1.0)).plan()
    (cand,) = [c for c in plan.candidates if c.fusion == "TanhOnly"]
    assert cand.status == "refused"
    assert "GELU.approximate='none', needs 'tanh'" in cand.reason
    assert "a positive scale" in cand.reason
    assert "TanhOnly" in plan.explain() and "a positive scale" in plan.explain()


def test_accepts_reason_and_bad_verdict(plugins):
    plugins.fusion(make_fusion("Picky", Pattern(Op(ops.Identity), Op(ops.Identity)),
                           accepts=lambda cls, m, env: "not on Tuesdays"))
    plan = ops.Sequential(ops.Identity(), ops.Identity()).plan()
    assert stage_names(plan.forward) == ["Identity", "Identity"]
    assert [c.reason for c in plan.candidates] == ["not on Tuesdays"]
    plugins.fusion(make_fusion("Vague", Pattern(Op(ops.Identity), Op(ops.Identity)),
                           accepts=lambda cls, m, env: False))
    with pytest.raises(TypeError, match="Vague.accepts.. must return True or a non-empty"):
        ops.Sequential(ops.Identity(), ops.Identity()).plan()


def test_plan_is_cached_and_replanned_when_conditions_change(monkeypatch):
    from fusible.planning import prepare
    calls = []
    real = prepare.plan_group
    monkeypatch.setattr(prepare, "plan_group", lambda *a: calls.append(a[2]) or real(*a))
    model = ops.Sequential(ops.BasicLinear(4, 4), ops.Bias(4), ops.GELU())
    x = torch.randn(2, 4)
    model(x), model(x), model(torch.randn(7, 3, 4))
    assert len(calls) == 1
    with torch.no_grad():
        model(x), model(x)
    assert len(calls) == 2 and calls[-1].grad_enabled is False
    model.double()(x.double())
    assert len(calls) == 3 and calls[-1].dtype == torch.float64
    model(x.double().requires_grad_())
    assert len(calls) == 4
    model[0].weight.requires_grad_(False)
    model(x.double())
    assert len(calls) == 5
    model[2].approximate = "tanh"          # op configuration changed
    model(x.double())
    assert len(calls) == 6


def test_plan_depends_on_device_type():
    model = ops.Sequential(ops.BasicLinear(4, 4, device="meta"), ops.Bias(4, device="meta"),
                           ops.ReLU())
    with torch.no_grad():
        plan = model.plan(torch.empty(2, 4, device="meta"))
    assert stage_names(plan.forward) == ["ForwardLinearBias", "ReLU"]
    assert any("no GEMM activation epilogue on meta" in c.reason for c in plan.candidates)


def test_new_registration_replans(plugins):
    model = ops.Sequential(ops.Identity(), ops.ConstantScale(2.0))
    assert stage_names(model.plan().forward) == ["Identity", "ConstantScale"]
    plugins.fusion(make_fusion("IdScale", Pattern(Op(ops.Identity), Op(ops.ConstantScale))))
    assert stage_names(model.plan().forward) == ["IdScale"]


def test_plan_must_flatten_back(plugins):
    cls = make_fusion("Liar", Pattern(Op(ops.Identity), Op(ops.Identity)))
    cls.basic_ops = lambda self: self.match.ops[:1]
    plugins.fusion(cls)
    with pytest.raises(RuntimeError, match="does not flatten back.*Liar"):
        ops.Sequential(ops.Identity(), ops.Identity()).plan()


def test_entry_point_plugins_are_loaded(monkeypatch, plugins):
    import fusible.planning.registry as registry
    plugin = make_fusion("FromEntryPoint", Pattern(Op(ops.Identity), Op(ops.ReLU)))

    class FakeEntryPoint:
        name = "demo"

        def load(self):
            return plugin

    monkeypatch.setitem(registry._state, "loaded", False)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == "fusible.fusions" else [])
    plan = ops.Sequential(ops.Identity(), ops.ReLU()).plan()
    assert stage_names(plan.forward) == ["FromEntryPoint"]


_PLAN_SCRIPT = """
import torch
from fusible import ops
model = ops.Sequential(ops.Linear(16, 32), ops.ReLU(), ops.Linear(32, 16), ops.AddExtraInput())
x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
print(model.plan(x, r).explain())
"""


def test_planning_is_deterministic_across_processes():
    """The same model plans the same in processes with different hash seeds (set and dict
    orders of strings differ between them): nothing in the planner may depend on it."""
    import os
    import subprocess
    import sys
    plans = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        plans.append(subprocess.run([sys.executable, "-c", _PLAN_SCRIPT], env=env, check=True,
                                    capture_output=True, text=True).stdout)
    assert "ForwardLinearBiasActivation" in plans[0] and "BackwardLinearBias" in plans[0]
    assert plans[0] == plans[1] == plans[2]
