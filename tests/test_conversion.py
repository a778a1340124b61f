"""fusible.convert: plain-PyTorch GPT- and Llama-style models converted in place: the same
parameters under the same names, the same outputs in float32, the same training curves,
an optimizer built before the conversion still working, and a report of what stayed."""

import copy
import re

import pytest
import torch
from torch import nn

import fusible
from fusible import ops
import whole_models as wm

MODELS = {"gpt": wm.TorchGPT, "llama": wm.TorchLlama}


def data(steps=5):
    """Sequences counting up from a random start (mod 64): a rule to learn."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (2, 1), generator=g) + torch.arange(17)) % 64
            for _ in range(steps + 1)]


def train(model, opt, batches) -> list:
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", MODELS)
def test_converted_model_computes_and_trains_like_the_original(name):
    torch.manual_seed(0)
    original = MODELS[name]()
    model = copy.deepcopy(original)
    params_before = list(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before the conversion
    report = fusible.convert(model)
    assert model.state_dict().keys() == original.state_dict().keys()  # checkpoint names
    after = list(model.parameters())  # the same objects in the same order (optimizer state)
    assert len(after) == len(params_before) and all(p is q for p, q in zip(after, params_before))
    tokens = data()[0]
    torch.testing.assert_close(model(tokens), original(tokens), rtol=2e-6, atol=2e-6)
    want = train(original, torch.optim.Adam(original.parameters(), lr=1e-2), data())
    got = train(model, opt, data())
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert got[-1] < got[0]
    assert report.converted


def test_the_report_says_what_was_converted_and_what_stayed():
    model = wm.TorchGPT(layers=1)
    report = fusible.convert(model)
    converted = {p: (a, b) for p, a, b in report.converted if (a, b) != FUSED}
    assert converted["h.0.mlp"] == ("Sequential", "Sequential")  # one pipeline: fusions
    assert converted["h.0.qkv"] == ("Linear", "Linear")
    assert converted["ln_f"] == ("LayerNorm", "LayerNorm")
    assert isinstance(model.h[0].mlp, ops.Sequential)
    x = torch.zeros(2, 32)
    stages = [s.name for s in model.h[0].mlp.plan(x, x).forward]  # x + mlp(x): fused
    assert "ForwardLinearBias" in stages
    left = {p: why for p, _, why in report.left}
    assert "fusible has no embedding op" in left["wte"]
    assert "its forward is Python" in left["h.0"]
    text = str(report)
    assert "h.0.mlp: Sequential -> Sequential" in text and "wte: Embedding left" in text


def test_a_container_without_forward_is_not_reported():
    """A ModuleDict or ModuleList computes nothing: no residual add to fuse, no line (the
    getting-started page's report is the whole report)."""
    mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    for model in (nn.ModuleDict({"mlp": mlp}), nn.ModuleList([copy.deepcopy(mlp)])):
        report = fusible.convert(model)
        assert report.left == () and len(report.converted) == 1, str(report)


class _PythonMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_a_python_forward_calling_converted_children_gets_the_sequential_hint():
    holder = nn.Module()
    holder.mlp = _PythonMLP()
    left = {p: why for p, _, why in fusible.convert(holder).left}
    assert left["mlp"].startswith("its forward is Python")
    assert ("its converted children (fc1, act, fc2) run as separate fusible groups: written "
            "as an nn.Sequential") in left["mlp"]
    holder.one = nn.Sequential()  # no converted child: no hint
    holder.one.only = _OneChild()
    left = {p: why for p, _, why in fusible.convert(holder).left}
    assert "separate fusible groups" not in left["one.only"]


class _OneChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).relu()


def test_llama_mlp_converts_its_projections_one_by_one():
    model = wm.TorchLlama(layers=1)
    report = fusible.convert(model)
    assert isinstance(model.layers[0].mlp.gate_proj, ops.Linear)
    assert isinstance(model.layers[0].input_layernorm, ops.RMSNorm)
    left = {p: why for p, _, why in report.left}
    assert "merge_gated_mlps=True) merges its gate and up" in left["layers.0.mlp"]


def test_gated_mlps_merge_into_one_swiglu_block_with_the_same_checkpoints():
    torch.manual_seed(0)
    original = wm.TorchLlama()
    model = copy.deepcopy(original)
    report = fusible.convert(model, merge_gated_mlps=True)
    assert ("layers.0.mlp", "LlamaMLP", "Sequential") in report.converted
    mlp = model.layers[0].mlp
    assert ("layers.0.mlp", "Linear + residual", "AddExtraInput fused") in report.converted
    x = torch.zeros(2, 32)
    assert [s.name for s in mlp.plan(x, x).forward] == [
        "BasicLinear", "SwiGLU", "ForwardLinearBiasAdd"]  # x + mlp(h): the down GEMM adds x
    tokens = data()[0]
    torch.testing.assert_close(model(tokens), original(tokens), rtol=2e-6, atol=2e-6)
    assert model.state_dict().keys() == original.state_dict().keys()  # checkpoints keep names
    for name, value in model.state_dict().items():
        assert torch.equal(value, original.state_dict()[name]), name
    fresh = copy.deepcopy(original)
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    fusible.convert(fresh, merge_gated_mlps=True)
    fresh.load_state_dict(original.state_dict())  # an original checkpoint loads
    torch.testing.assert_close(fresh(tokens), original(tokens), rtol=2e-6, atol=2e-6)
    want = train(original, torch.optim.Adam(original.parameters(), lr=1e-2), data())
    got = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), data())
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_a_module_named_like_a_gated_mlp_but_computing_otherwise_is_not_merged():
    class NotGated(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
            self.w2 = nn.Linear(16, 8, bias=False)

        def forward(self, x):  # GELU, not SiLU
            return self.w2(nn.functional.gelu(self.w1(x)) * self.w3(x))

    holder = nn.Module()
    holder.mlp = NotGated()
    fusible.convert(holder, merge_gated_mlps=True)
    assert isinstance(holder.mlp, NotGated) and isinstance(holder.mlp.w1, ops.Linear)


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_a_norm_keeps_its_eps(norm):
    """A non-default eps (0.5 moves every output visibly) survives the conversion."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(8, 8), norm(8, eps=0.5))
    model = fusible.convert_module(copy.deepcopy(original))
    assert model[1].eps == 0.5
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), original(x), rtol=1e-6, atol=1e-6)


REPARAMETRIZED = {
    "spectral_norm": (nn.utils.parametrizations.spectral_norm, "weight is parametrized"),
    "weight_norm": (nn.utils.parametrizations.weight_norm, "weight is parametrized"),
    "legacy spectral_norm": (nn.utils.spectral_norm, "SpectralNorm forward pre-hook "
                                                     r"\(torch.nn.utils.remove_spectral_norm"),
    "legacy weight_norm": (nn.utils.weight_norm, "WeightNorm forward pre-hook "
                                                 r"\(torch.nn.utils.remove_weight_norm"),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch deprecates the legacy ones
@pytest.mark.parametrize("name", REPARAMETRIZED)
def test_a_reparametrized_layer_stays_and_keeps_training(name):
    """Its weight is computed from other parameters: converting it would train the computed
    tensor. It stays, the report says why and what undoes it; the rest converts, and the
    parameters behind the weight still learn."""
    wrap, why = REPARAMETRIZED[name]

    def build():  # twice: a legacy weight_norm module does not deepcopy
        torch.manual_seed(0)
        holder = nn.Module()
        holder.body = nn.Sequential(wrap(nn.Linear(8, 8)), nn.GELU(), nn.Linear(8, 8))
        return holder

    holder, original = build(), build()
    report = fusible.convert(holder)
    left = {p: reason for p, _, reason in report.left}
    assert re.search(why, left["body.0"]) and "runs as is" in left["body.0"]
    assert isinstance(holder.body[2], ops.Linear)
    x = torch.randn(4, 8)
    torch.testing.assert_close(holder.body(x), original.body(x), rtol=1e-6, atol=1e-6)
    before = {n: p.detach().clone() for n, p in holder.body[0].named_parameters()}
    opt = torch.optim.SGD(holder.parameters(), lr=0.1)
    holder.body(x).square().sum().backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in holder.body[0].named_parameters())


def test_modules_without_a_fusible_equivalent_stay():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=False))
    holder = nn.Module()
    holder.body = model
    report = fusible.convert(holder)
    assert isinstance(holder.body, nn.Sequential)  # a child does not convert
    assert isinstance(holder.body[0], ops.Linear)
    assert [p for p, _, _ in report.left] == ["body", "body.1"]


def test_convert_module_replaces_a_root():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    want = mlp(x)
    new = fusible.convert_module(mlp)
    assert isinstance(new, ops.Sequential)
    assert new[0].weight is mlp[0].weight
    torch.testing.assert_close(new(x), want)
    assert fusible.convert_module(nn.Embedding(3, 4)) is None


# Linear + residual ---------------------------------------------------------------------

FUSED = ("Linear + residual", "AddExtraInput fused")


def chosen(plan) -> list:
    return [s.name for s in plan.forward]


class Residual(nn.Module):
    """``x + proj(y)`` and ``mlp(x) + x``: a lone Linear and a Sequential ending in one."""

    def __init__(self, bias=True):
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(32, 64, bias=bias), nn.GELU(),
                                 nn.Linear(64, 32, bias=bias))

    def forward(self, x, y):
        x = x + self.proj(y)
        return self.mlp(x) + x


def converted_pair(block_type=Residual, **kwargs):
    torch.manual_seed(0)
    original = block_type(**kwargs)
    model = copy.deepcopy(original)
    return original, model, fusible.convert(model)


def test_gpt_blocks_fuse_their_projections_with_the_residuals():
    """Both adds of each block: the attention projection's, and the MLP's, across its
    trailing Dropout(0.0) (left out of the plan: it returns its input)."""
    torch.manual_seed(0)
    original = wm.TorchGPT()
    model = copy.deepcopy(original)
    report = fusible.convert(model)
    for where in ("h.0.proj", "h.1.proj", "h.0.mlp", "h.1.mlp"):
        assert (where, *FUSED) in report.converted, where
    block = model.h[0]
    assert type(block) is wm.TorchGPTBlock and "forward" in block.__dict__  # its class stays
    assert type(block.proj).__name__ == "ResidualLinear" and isinstance(block.proj, ops.Linear)
    assert [type(op).__name__ for op in block.proj.basic_ops()] == [
        "BasicLinear", "Bias", "AddExtraInput"]
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in original.named_parameters()]  # the original names
    assert block.proj.weight is dict(model.named_parameters())["h.0.proj.weight"]
    x = torch.zeros(2, 16, 32)
    assert chosen(block.proj.plan(x, x)) == ["ForwardLinearBiasAdd"]
    mlp_plan = block.mlp.plan(x, x)
    assert chosen(mlp_plan)[-1] == "ForwardLinearBiasAdd"
    assert [type(op).__name__ for op in mlp_plan.left_out] == ["Dropout"]
    totals = fusible.plan_model(model, data()[0]).totals()
    assert totals["fusions chosen"]["ForwardLinearBiasAdd"] == 4
    tokens = data()[0]
    want, got = original(tokens), model(tokens)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)  # (x + x@W) + b: reordered
    want.square().sum().backward()
    got.square().sum().backward()
    grads = dict(zip(original.state_dict(), [p.grad for p in original.parameters()]))
    for name, p in zip(model.state_dict(), model.parameters()):
        torch.testing.assert_close(p.grad, grads[name], rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_residual_adds_compute_like_the_original(bias):
    original, model, report = converted_pair(bias=bias)
    assert [c for c in report.converted if c[1:] == FUSED] == [("proj", *FUSED), ("mlp", *FUSED)]
    x = torch.zeros(4, 7, 32)
    assert chosen(model.mlp.plan(x, x))[-1] == "ForwardLinearBiasAdd"
    g = torch.Generator().manual_seed(1)
    x, y, dz = (torch.randn(4, 7, 32, generator=g) for _ in range(3))
    inputs = [t.clone().requires_grad_() for t in (x, y)]
    want = original(*inputs)
    want_grads = torch.autograd.grad(want, [*inputs, *original.parameters()], dz)
    inputs = [t.clone().requires_grad_() for t in (x, y)]
    got = model(*inputs)
    got_grads = torch.autograd.grad(got, [*inputs, *model.parameters()], dz)
    if not bias:  # the GEMM accumulates into the residual: the same float adds, bitwise
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    else:  # x + (x@W + b) became (x + x@W) + b: one rounding apart
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_residuals_that_broadcast_or_promote_are_added_as_written():
    original, model, _ = converted_pair(bias=True)
    y = torch.randn(4, 7, 32)

    class One(nn.Module):  # the proj add alone, to compare bitwise
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

        def forward(self, x, y):
            return x + self.proj(y)

    one_original = One(copy.deepcopy(original.proj))
    one = copy.deepcopy(one_original)
    fusible.convert(one)
    assert isinstance(one.proj, ops.Linear) and "residual_add=True" in repr(one.proj)
    for x in (torch.randn(32), torch.randn(7, 1), torch.randn(4, 7, 32, dtype=torch.float64)):
        want, got = one_original(x, y), one(x, y)  # broadcast; float64 promotes
        assert got.dtype == want.dtype and torch.equal(got, want)
    x = torch.randn(4, 7, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = one_original(x, y), one(x, y)  # a bfloat16 GEMM + a float32 residual
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
        want, got = one_original(x.bfloat16(), y), one(x.bfloat16(), y)  # fused: bf16 both
        assert got.dtype == want.dtype == torch.bfloat16  # the GEMM rounds once less
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)  # about one bf16 ulp
        assert chosen(one.proj.plan(y, x.bfloat16())) == ["ForwardLinearBiasAdd"]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the whole model, as written
        torch.testing.assert_close(model(x, y), original(x, y), rtol=0, atol=0)


def test_a_forward_fx_cannot_trace_stays_as_it_is():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x + self.proj(x)
            return x

    holder = nn.Module()
    holder.block = Branchy()
    report = fusible.convert(holder)
    assert isinstance(holder.block.proj, ops.Linear) and "forward" not in holder.block.__dict__
    left = {p: why for p, _, why in report.left}
    assert "stay unfused: fx could not trace it (TraceError: " in left["block"]
    assert not [c for c in report.converted if c[1:] == FUSED]
    x = torch.ones(2, 8)
    torch.testing.assert_close(holder.block(x), x + holder.block.proj(x))


def test_fuse_residuals_false_leaves_the_adds():
    original, model = Residual(), Residual()
    model.load_state_dict(original.state_dict())
    report = fusible.convert(model, fuse_residuals=False)
    assert isinstance(model.proj, ops.Linear) and "forward" not in model.__dict__
    assert not [c for c in report.converted if c[1:] == FUSED]
    x = torch.randn(2, 32)
    assert torch.equal(model(x, x), original(x, x))


def test_the_rewritten_model_copies_pickles_saves_and_compiles():
    import pickle
    original, model, _ = converted_pair()
    x, y = torch.randn(4, 7, 32), torch.randn(4, 7, 32)
    want = model(x, y)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(clone(x, y), want)
        with torch.no_grad():
            clone.proj.bias.add_(1.0)  # the clone's forward calls the clone's children
        assert torch.equal(model(x, y), want) and not torch.equal(clone(x, y), want)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the unfused path: the clone's too
            assert not torch.equal(clone(x, y), model(x, y))
    assert model.state_dict().keys() == original.state_dict().keys()
    fresh = Residual()
    fusible.convert(fresh)
    fresh.load_state_dict(original.state_dict())  # an original checkpoint loads
    assert torch.equal(fresh(x, y), want)
    back = Residual()
    back.load_state_dict(model.state_dict())  # and the converted one loads into the original
    assert torch.equal(back(x, y), original(x, y))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, y), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(x, y), model(x, y))  # the unfused path, compiled too


def test_a_forward_reading_its_attributes_keeps_them_honest():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.scale = nn.Linear(8, 8), 2.0

        def forward(self, x):
            y = x * self.scale if self.training else x
            return x + self.proj(y)

    original = Scaled()
    model = copy.deepcopy(original)
    fusible.convert(model)
    assert isinstance(model.proj, ops.Linear) and "residual_add=True" in repr(model.proj)
    x = torch.randn(2, 8)
    for mode in (True, False):  # traced in both modes
        original.train(mode), model.train(mode)
        torch.testing.assert_close(model(x), original(x), rtol=2e-6, atol=2e-6)
    model.scale = 3.0  # the trace holds 2.0
    with pytest.raises(RuntimeError, match=r"Scaled.scale changed since fusible.convert"):
        model(x)


class _DropoutBlock(nn.Module):
    """Dropout in every place a converted module can stand: a leaf, an nn.Sequential, and
    after a Linear whose residual add is fused."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.seq = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.5))
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(self.drop(self.seq(self.norm(x))))


@pytest.mark.parametrize("merge", [False, True])
def test_converted_modules_take_the_mode_of_what_they_replace(merge):
    """A model from from_pretrained is in eval mode: converting it must not turn dropout
    back on (nor a training model's off)."""
    for training in (False, True):
        torch.manual_seed(0)
        model = nn.ModuleDict({"block": _DropoutBlock(), "llama": wm.TorchLlama(layers=1)})
        model.train(training)
        twin = copy.deepcopy(model)
        report = fusible.convert(model, merge_gated_mlps=merge)
        assert ("block.fc", "Linear + residual", "AddExtraInput fused") in report.converted
        assert {m.training for m in model.modules()} == {training}
        if not training:
            x, tokens = torch.randn(4, 16), data()[0]
            assert torch.equal(model["block"](x), model["block"](x))
            torch.testing.assert_close(model["block"](x), twin["block"](x), rtol=2e-6,
                                       atol=2e-6)
            torch.testing.assert_close(model["llama"](tokens), twin["llama"](tokens),
                                       rtol=2e-6, atol=2e-6)


def test_an_optimizer_built_before_the_merge_is_refused_at_its_first_step():
    """Its gate and up weights are no longer the model's: they would silently not train."""
    model = wm.TorchLlama(layers=1)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fusible.convert(model, merge_gated_mlps=True)
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    model(data()[0][:1]).sum().backward()
    late.step()  # built after convert: it holds the merged parameter
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): it holds layers.0.mlp.gate_proj"
                                           r".weight, which fusible.convert.*Build the "
                                           r"optimizer after convert"):
        early.step()


def test_a_partial_checkpoint_loads_into_the_merged_rows_and_names_what_is_missing():
    torch.manual_seed(0)
    original = wm.TorchLlama(layers=1)
    model = copy.deepcopy(original)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    fusible.convert(model, merge_gated_mlps=True)
    partial = {k: v for k, v in original.state_dict().items() if "up_proj" not in k}
    result = model.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["layers.0.mlp.up_proj.weight"]
    assert result.unexpected_keys == []
    merged = model.layers[0].mlp.gate_up.weight
    gate = original.layers[0].mlp.gate_proj.weight
    assert torch.equal(merged[:gate.shape[0]], gate)  # the gate's rows loaded
    assert not merged[gate.shape[0]:].any()  # the up rows as they were
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: "
                                           r"\"layers.0.mlp.up_proj.weight\""):
        model.load_state_dict(partial)
    wrong = dict(original.state_dict())
    wrong["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 32)
    with pytest.raises(RuntimeError, match=r"size mismatch for layers.0.mlp.up_proj.weight: "
                                           r"copying a param with shape \(3, 32\)") as error:
        model.load_state_dict(wrong)
    assert "gate_up" not in str(error.value)


def test_hooks_on_replaced_modules_keep_running():
    """Forward, forward-pre and backward hooks registered on a module convert replaces
    run on its replacement with what the original's saw, and their handles still remove
    them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    wrapper = nn.ModuleDict({"mlp": model, "head": nn.Linear(4, 2)})
    seen = []
    handles = [
        model[0].register_forward_hook(lambda m, a, o: seen.append(("fc1 out", o.sum()))),
        model[2].register_forward_pre_hook(lambda m, a: seen.append(("fc2 in", a[0].sum()))),
        model.register_forward_hook(lambda m, a, o: seen.append(("mlp out", o.sum()))),
        wrapper["head"].register_full_backward_hook(
            lambda m, gi, go: seen.append(("head dx", gi[0].sum())))]
    x = torch.randn(3, 8, requires_grad=True)
    wrapper["head"](wrapper["mlp"](x)).sum().backward()
    want, seen[:] = list(seen), []
    fusible.convert(wrapper)
    assert isinstance(wrapper["mlp"], ops.Sequential) and isinstance(wrapper["head"], ops.Linear)
    wrapper["head"](wrapper["mlp"](x)).sum().backward()
    assert [name for name, _ in seen] == [name for name, _ in want]
    for (name, got), (_, ref) in zip(seen, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
    for handle in handles:
        handle.remove()
    seen.clear()
    wrapper["head"](wrapper["mlp"](x)).sum().backward()
    assert seen == []


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(x)


def test_a_fused_residual_keeps_the_layers_names_and_its_hooks_arguments():
    """``proj.weight`` stays ``proj.weight`` (named_parameters, attribute, checkpoint); a
    layer with a forward hook keeps it seeing the layer's own input and output (one
    argument, not the residual too): it is wrapped instead, its checkpoint names kept."""
    torch.manual_seed(0)
    plain, hooked = _Residual(), _Residual()
    hooked.load_state_dict(plain.state_dict())
    seen = []
    hooked.proj.register_forward_hook(lambda m, a, o: seen.append((len(a), o.shape)))
    x = torch.randn(2, 8)
    want = plain(x)
    for model in (plain, hooked):
        report = fusible.convert(model)
        assert ("proj", *FUSED) in report.converted
        assert model.state_dict().keys() == {"proj.weight", "proj.bias"}
        torch.testing.assert_close(model(x), want, rtol=2e-6, atol=2e-6)
    assert [n for n, _ in plain.named_parameters()] == ["proj.weight", "proj.bias"]
    assert plain.proj.weight.shape == (8, 8) and plain.proj.in_features == 8
    assert seen == [(1, (2, 8))]
