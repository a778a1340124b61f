"""fusible.convert on Hugging Face decoder models: each decoder layer of the families the
built-in layer converters know (Llama, Qwen2, Qwen3, Mistral, Phi-3, GPT-NeoX with both
residuals) runs as one TransformerLayer plan with the layer's own parameters, against the
unconverted twin (logits, loss, every gradient by name, AdamW steps with the optimizer
built before the conversion), the calls it does not take falling back; a user's own
converter."""

import copy
import pickle

import pytest
import torch

import fusible
from fusible.models.decoder_layers import FusedLayerForward
from fusible.models.layer_converter import causal_mask, hf_rotary_tables

transformers = pytest.importorskip("transformers")

VOCAB, B, S = 96, 2, 7
FAMILIES = {
    "llama": lambda **k: transformers.LlamaConfig(**k),
    "qwen2": lambda **k: transformers.Qwen2Config(**k),  # q/k/v biases
    "qwen3": lambda **k: transformers.Qwen3Config(head_dim=16, **k),  # q/k norms
    "mistral": lambda **k: transformers.MistralConfig(**k),
    "gemma": lambda **k: transformers.GemmaConfig(head_dim=8, **k),  # 1 + w norms, GeGLU
    "phi3": lambda **k: transformers.Phi3Config(pad_token_id=0, **k),  # fused q/k/v, gate/up
    "gpt_neox": lambda **k: transformers.GPTNeoXConfig(  # per-head QKV, parallel residual
        **{**k, "num_key_value_heads": None}),
    "gpt_neox_sequential": lambda **k: transformers.GPTNeoXConfig(
        use_parallel_residual=False, **{**k, "num_key_value_heads": None}),
    "gpt2": lambda **k: transformers.GPT2Config(  # Conv1D projections, learned positions
        n_embd=k["hidden_size"], n_inner=k["intermediate_size"], n_layer=2, n_head=4,
        vocab_size=k["vocab_size"], resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
        bos_token_id=0, eos_token_id=0),
}


def _model(family: str, attn="sdpa", **extra):
    config = FAMILIES[family](vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                              num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, **extra)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases away from their initial values
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return model


def _ids():
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def _step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_decoder_layer_fused_and_equal_to_the_twin(family):
    model = _model(family)
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    fused = [p for p, _, new in report.converted if new.startswith("TransformerLayer")]
    assert [p.rsplit(".", 1)[-1] for p in fused] == ["0", "1"], str(report)
    assert "fx could not trace" not in str(report)  # no residual add left outside the layers
    ids = _ids()
    got, want = _step(model, ids), _step(twin, ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"gradient of {name}: {m}")
    for layer in getattr(model.base_model, "layers", None) or model.base_model.h:
        assert isinstance(layer.forward, FusedLayerForward) and not layer.forward.fallbacks


def test_an_optimizer_built_before_trains_every_weight():
    model = _model("qwen2")
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    fusible.convert(model)
    ids = _ids()
    for _ in range(5):
        for m, opt in zip((model, twin), optimizers):
            _step(m, ids)
            opt.step()
            opt.zero_grad(set_to_none=True)
    twin_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert not torch.equal(p, initial[name]), f"{name} did not train"
        # Adam divides by the gradients' running magnitude: float rounding of the
        # smallest gradients shows after a few steps (lr 1e-2: 5e-2 of motion at most)
        torch.testing.assert_close(p, twin_params[name], atol=1e-3, rtol=1e-3,
                                   msg=lambda m: f"{name} after 5 steps: {m}")


def test_state_dict_keys_order_and_loading_unchanged():
    model, twin = _model("qwen3"), _model("qwen3")
    keys = list(model.state_dict())
    fusible.convert(model)
    assert list(model.state_dict()) == keys
    model.load_state_dict(twin.state_dict())
    twin_params = dict(twin.named_parameters())
    assert all(torch.equal(p, twin_params[n]) for n, p in model.named_parameters())


def test_calls_it_does_not_take_run_the_original_code():
    model = _model("llama")
    twin = copy.deepcopy(model)
    fusible.convert(model)
    ids, mask = _ids(), torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # padding
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                               twin(input_ids=ids, attention_mask=mask).logits)
    counts = model.model.layers[0].forward.fallbacks
    assert counts == {"an attention mask": 1}
    model(input_ids=ids, use_cache=True)  # asked for, in training too
    assert counts["a KV cache"] == 1
    model.eval()
    generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, twin.eval().generate(ids, max_new_tokens=3, do_sample=False))


def test_eager_attention_masks_of_plain_calls_are_the_causal_pattern():
    """The eager attention gets a whole causal mask on every call: in a plain call (no
    attention mask, positions or cache) it is the layer's own pattern, and the fused layer
    runs; with padding the original code runs. Both against the unconverted twin."""
    model = _model("llama", attn="eager")
    twin = copy.deepcopy(model)
    fusible.convert(model)
    ids = _ids()
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits,
                               twin(input_ids=ids, use_cache=False).logits,
                               atol=1e-5, rtol=1e-5)
    forward = model.model.layers[0].forward
    assert not forward.fallbacks and not forward.plain_calls.active  # marked for the call only
    padded = torch.ones(B, S, dtype=torch.long)
    padded[1, :3] = 0
    torch.testing.assert_close(model(input_ids=ids, attention_mask=padded, use_cache=False).logits,
                               twin(input_ids=ids, attention_mask=padded, use_cache=False).logits,
                               atol=1e-5, rtol=1e-5)
    assert forward.fallbacks == {"an attention mask": 1}


def test_a_layer_computing_otherwise_is_left_with_the_probe_error():
    model = _model("llama", hidden_act="gelu")  # not the SwiGLU the fused layer computes
    report = fusible.convert(model)
    left = {p: why for p, _, why in report.left}
    assert "computes other than the fused layer on a probe input (max error" in \
        left["model.layers.0"]
    assert "forward" not in model.model.layers[0].__dict__


def test_one_plan_per_layer_compiled_copied_and_pickled(fresh_dynamo):
    model = _model("llama")
    fusible.convert(model)
    ids = _ids()
    plans = [p for p, _ in fusible.plan_model(model, input_ids=ids, use_cache=False).plans]
    assert plans[:2] == ["model.layers.0", "model.layers.1"]
    eager = model(input_ids=ids, use_cache=False).logits
    compiled = torch.compile(model, backend="aot_eager")
    # (compiled, transformers hands the layers its causal mask: they run the original
    # code, which for this Llama gives the fused layer's bits)
    assert torch.equal(compiled(input_ids=ids, use_cache=False).logits, eager)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        layer = other.model.layers[0]
        assert layer.forward._owner() is layer
        assert torch.equal(other(input_ids=ids, use_cache=False).logits, eager)


def test_fp8_runs_each_fused_layers_four_gemms_in_fp8():
    model = _model("qwen3").to(torch.bfloat16)
    twin = copy.deepcopy(model)
    fusible.convert(model)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with fusible.autocast():
        totals = fusible.plan_model(model, input_ids=ids, use_cache=False).totals()
        got = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert totals["FP8 GEMMs"] == 2 * 4 + 1  # four per layer, and the converted lm_head
    want = twin(input_ids=ids, labels=ids, use_cache=False).loss
    assert abs(got.item() - want.item()) < 0.05 * abs(want.item())


class _MyBlock(torch.nn.Module):
    """A user's own pre-norm block: no rotary embedding, one QKV weight, SwiGLU."""

    def __init__(self, hidden=32, ffn=48, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-6), torch.nn.RMSNorm(hidden,
                                                                                     eps=1e-6)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class _MyBlockConverter(fusible.LayerConverter):
    name = "my_block"

    def recognise(self, layer):
        if not isinstance(layer, _MyBlock):
            return None
        return dict(hidden_size=32, ffn_hidden_size=48, num_heads=layer.heads,
                    rotary_base=None, eps=layer.norm1.eps)

    def parameters(self, layer, spec):
        return {"input_norm.weight": layer.norm1.weight, "qkv.weight": layer.qkv.weight,
                "proj.weight": layer.out.weight, "mlp_norm.weight": layer.norm2.weight,
                "fc1.weight": layer.gate_up.weight, "fc2.weight": layer.down.weight}

    def probe_kwargs(self, layer, spec, x, positions):
        return {}


def test_a_users_own_layer_converter():
    converter = fusible.register_layer_converter(_MyBlockConverter())
    try:
        with pytest.raises(ValueError, match="'my_block' is registered already"):
            fusible.register_layer_converter(_MyBlockConverter())
        torch.manual_seed(0)
        model = torch.nn.Sequential(_MyBlock(), _MyBlock())
        twin = copy.deepcopy(model)
        report = fusible.convert(model)
        assert [p for p, _, new in report.converted if new.startswith("TransformerLayer")] \
            == ["0", "1"]
        x = torch.randn(2, 5, 32, requires_grad=True)
        torch.testing.assert_close(model(x), twin(x), atol=1e-5, rtol=1e-5)
    finally:
        fusible.unregister_layer_converter(converter.name)
    assert "my_block" not in fusible.registered_layer_converters()


class _NoTrainingConverter(_MyBlockConverter):
    """An override of ``fallback`` taking the layer alone (its signature before the
    module walk was handed to it)."""

    name = "my_block_eval_only"

    def fallback(self, layer):
        return "trained by the original code" if layer.training else None


def test_a_converters_own_fallback_taking_the_layer_alone_is_called():
    converter = fusible.register_layer_converter(_NoTrainingConverter())
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(_MyBlock())
        twin = copy.deepcopy(model)
        fusible.convert(model)
        x = torch.randn(2, 5, 32)
        torch.testing.assert_close(model.train()(x), twin(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.eval()(x), twin(x), atol=1e-5, rtol=1e-5)
        assert model[0].forward.fallbacks == {"trained by the original code": 1}
    finally:
        fusible.unregister_layer_converter(converter.name)


def test_dropout_in_training_runs_the_original_code():
    """GPT-2's dropouts (p=0.1): in training the original code (the fused layer applies
    none), in evaluation the fused layer; the model's positional cache argument binds."""
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB,
                                     bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    twin = copy.deepcopy(model).eval()
    fusible.convert(model)
    counts = model.transformer.h[0].forward.fallbacks
    model.train()(input_ids=_ids(), use_cache=False)
    assert counts == {"dropout in training (p=[0.1])": 1}
    got = model.eval()(input_ids=_ids(), use_cache=False).logits
    torch.testing.assert_close(got, twin(input_ids=_ids(), use_cache=False).logits,
                               atol=1e-5, rtol=1e-5)
    assert counts == {"dropout in training (p=[0.1])": 1}  # evaluation: fused


def test_bert_encoder_layers_post_norm_and_bidirectional():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    assert [p for p, _, new in report.converted if new.startswith("TransformerLayer")] == \
        ["encoder.layer.0", "encoder.layer.1"]
    ids = _ids()
    got, want = (m(input_ids=ids).last_hidden_state for m in (model, twin))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None or grads[name].grad is not None:  # the pooler has none
            torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"gradient of {name}: {m}")
    assert not model.encoder.layer[0].forward.fallbacks
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, 5:] = 0
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state,
                               twin(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert model.encoder.layer[0].forward.fallbacks == {"an attention mask": 1}


def test_a_compiled_converted_layer_is_bitwise_its_eager_self(fresh_dynamo):
    """The fused layer under torch.compile, given the tensors its graph holds (the
    concatenated weights are not the TransformerLayer's attributes: the ops check what the
    graph gives them)."""
    model = _model("qwen3")
    fusible.convert(model)
    layer = model.model.layers[0]
    x, positions = torch.randn(B, S, 32, requires_grad=True), torch.arange(S)[None]
    run = lambda h: layer(h, position_ids=positions)  # noqa: E731
    eager = run(x)
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager) and not layer.forward.fallbacks


class _NanoLayerNorm(torch.nn.Module):
    """nanoGPT's LayerNorm: an optional bias, epsilon 1e-5 in its forward."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(ndim))
        self.bias = torch.nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias,
                                              1e-5)


class _NanoAttention(torch.nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = torch.nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout, self.resid_dropout = torch.nn.Dropout(0.0), torch.nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class _NanoMLP(torch.nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc = torch.nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = torch.nn.GELU()
        self.c_proj = torch.nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = torch.nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _NanoBlock(torch.nn.Module):
    def __init__(self, n_embd=32, n_head=4, bias=True):
        super().__init__()
        self.ln_1, self.ln_2 = _NanoLayerNorm(n_embd, bias), _NanoLayerNorm(n_embd, bias)
        self.attn, self.mlp = _NanoAttention(n_embd, n_head, bias), _NanoMLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_blocks(bias):
    """nanoGPT's own code: its blocks fused whole (bias=True), or left with the reason and
    their linear layers, norms and activations converted one by one (bias=False)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_NanoBlock(bias=bias), _NanoBlock(bias=bias))
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    fused = [p for p, _, new in report.converted if new.startswith("TransformerLayer")]
    assert fused == (["0", "1"] if bias else []), str(report)
    if not bias:
        assert "bias=False: a LayerNorm without bias" in dict(
            (p, why) for p, _, why in report.left)["0"]
    x = torch.randn(B, S, 32, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    torch.testing.assert_close(model(x), twin(x_twin), atol=1e-5, rtol=1e-5)
    model(x).sum().backward()
    twin(x_twin).sum().backward()
    torch.testing.assert_close(x.grad, x_twin.grad, atol=1e-5, rtol=1e-5)
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"gradient of {name}: {m}")


@pytest.mark.parametrize("softcapping", [None, 0.5])
def test_gemma2_sandwich_layers(softcapping):
    """Gemma 2: a norm after each branch (the "sandwich" residual). Its model offers the
    eager attention only, whose causal mask makes every model call run the original code;
    the fused layer, called without a mask, computes the same. Soft-capped attention (the
    default; a cap of 0.5 here, where the capping changes the scores a lot) too."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        attn_logit_softcapping=softcapping, final_logit_softcapping=None,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            if "q_proj" in name or "k_proj" in name:  # scores of a few units: capped hard
                p.normal_(0.0, 0.5)
    layer = model.model.layers[0]
    twin = copy.deepcopy(layer)
    fusible.convert(model)
    assert isinstance(layer.forward, FusedLayerForward)
    assert layer.forward.fused.residual == "sandwich"
    assert layer.forward.fused.attention.softcap == softcapping
    x, positions = torch.randn(B, S, 32), torch.arange(S)[None]
    want = twin(x, attention_mask=causal_mask(twin, x), position_ids=positions,
                position_embeddings=hf_rotary_tables(layer.forward.spec, positions[0],
                                                     x.dtype))
    torch.testing.assert_close(layer(x, position_ids=positions), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_torchtitan_style_blocks(qk_norm):
    """torchtitan's Llama layout (tests/torchtitan_style.py): blocks called
    ``block(h, freqs_cis, attention_masks, positions)`` positionally, nn.RMSNorm, interleaved
    rotary pairs from the root's complex table (Llama 3.1-rescaled frequencies, which the
    fused layer takes as given tables), fused whole; against the twin, and an optimizer
    built before the conversion."""
    from torchtitan_style import Transformer
    torch.manual_seed(0)
    model = Transformer(qk_norm=qk_norm)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    report = fusible.convert(model)
    fused = [p for p, _, new in report.converted if new.startswith("TransformerLayer")]
    assert fused == ["layers.0", "layers.1"], str(report)
    assert model.layers["0"].forward.spec["rotary_interleaved"]
    ids = _ids()
    for step in range(3):
        outs = []
        for m, opt in zip((model, twin), optimizers):
            logits = m(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
            outs.append((logits, loss, {n: p.grad.clone() for n, p in m.named_parameters()}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (got, got_loss, got_grads), (want, want_loss, want_grads) = outs
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
        for name, grad in got_grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"step {step}, gradient of {name}: {m}")
    for layer in model.layers.values():
        assert not layer.forward.fallbacks
    positions = torch.arange(S).flip(0)[None].expand(B, S)  # the original code, the same
    torch.testing.assert_close(model(ids, positions=positions), twin(ids, positions=positions))
    assert "positions" in str(dict(model.layers["0"].forward.fallbacks))


def test_compiled_models_run_the_fused_layers(fresh_dynamo):
    """transformers builds the whole causal mask while dynamo traces, which would send
    every compiled call to the original code: convert marks the model's plain calls (no
    attention mask, positions or cache), whose masks are the layers' own pattern, so the
    compiled model runs the fused layers and computes what the eager one does. An attention
    mask given still falls back."""
    model = _model("llama")
    report = fusible.convert(model)
    assert "plain calls marked" in dict((p, new) for p, _, new in report.converted)["model"]
    ids = _ids()
    want = model(input_ids=ids, use_cache=False).logits
    compiled = torch.compile(model, backend="aot_eager")
    got = compiled(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    layer = model.model.layers[0]
    assert not layer.forward.fallbacks
    padded = torch.ones(B, S, dtype=torch.long)
    padded[0, :2] = 0
    twin = _model("llama")
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=padded,
                                        use_cache=False).logits,
                               twin(input_ids=ids, attention_mask=padded, use_cache=False).logits,
                               rtol=1e-5, atol=1e-5)
    assert layer.forward.fallbacks["an attention mask"] >= 1


def test_a_training_step_compiled_on_its_first_call_compiles_once(fresh_dynamo):
    """The benchmark's way: convert, compile, train; no eager call first. The first
    compiled call finds each thread's plain-call mark already set (dynamo guards on it) and
    the fused layers in the model's training mode (no retrace on the second step)."""
    model, twin = _model("llama"), _model("llama")
    fusible.convert(model, fuse_loss=True)
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss,
                             backend="aot_eager")
    ids = _ids()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            loss = compiled(ids)
            loss.backward()
    want = twin(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert not model.model.layers[0].forward.fallbacks


def test_a_training_call_builds_no_kv_cache_and_runs_fused():
    """transformers builds a KV cache unless told not to; a training-mode call that says
    nothing about it gets use_cache=False (no cache for a step to read), so the fused
    layers run; in evaluation mode the cache is built, and the original code fills it."""
    model = _model("llama")
    twin = copy.deepcopy(model)
    fusible.convert(model)
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    assert out.past_key_values is None
    torch.testing.assert_close(out.loss, twin(input_ids=ids, labels=ids).loss)
    forward = model.model.layers[0].forward
    assert not forward.fallbacks
    model.eval()
    assert model(input_ids=ids).past_key_values is not None
    assert forward.fallbacks == {"a KV cache": 1}


class _Scorer(torch.nn.Module):
    """A user's wrapper that builds the padding mask itself from the ids (pad id 0)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = (input_ids != 0).long()
        return self.lm(input_ids=input_ids, attention_mask=attention_mask,
                       use_cache=False).logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_mask_built_above_the_model_is_not_taken_for_the_pattern(attn):
    """The mark goes on the innermost module that builds the layers' mask (LlamaModel): a
    wrapper above it that makes a padding mask of its own hands it down, and the layers
    run their original code with it."""
    model = _Scorer(_model("llama", attn=attn))
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    assert "plain calls marked" in dict((p, new) for p, _, new in report.converted)["lm.model"]
    ids = torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    ids[0, :3] = 0
    torch.testing.assert_close(model(ids), twin(ids), atol=1e-5, rtol=1e-5)
    assert model.lm.model.layers[0].forward.fallbacks == {"an attention mask": 1}


def test_the_plain_mark_is_per_thread():
    """A plain call under way in one thread says nothing of another thread's call."""
    import threading
    model = _model("llama")
    fusible.convert(model)
    calls = model.model.layers[0].forward.plain_calls
    seen = []
    calls.active = True
    try:
        worker = threading.Thread(target=lambda: seen.append(calls.active))
        worker.start()
        worker.join()
    finally:
        calls.active = False
    assert seen == [False]
    assert pickle.loads(pickle.dumps(model)).model.layers[0].forward.plain_calls.active is False


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "dynamic", "factor": 2.0},  # the sequence is past max_position_embeddings
    {"rope_type": "linear", "factor": 2.0},
], ids=lambda r: r["rope_type"])
def test_other_rotary_types_take_the_models_own_tables(rope):
    """Rotary types fusible does not compute (YaRN's, with its attention factor folded in
    the tables; dynamic NTK; linear) fuse too: the attention takes the model's own
    position_embeddings as its tables (rotary_tables=True); against the twin."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rope_parameters={**rope, "rope_theta": 10000.0})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    fused = [p for p, _, new in report.converted if new.startswith("TransformerLayer")]
    assert fused == ["model.layers.0", "model.layers.1"], str(report)
    assert model.model.layers[0].forward.spec["rotary_tables"]
    ids = torch.randint(0, VOCAB, (B, 40), generator=torch.Generator().manual_seed(1))
    got, want = _step(model, ids), _step(twin, ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"gradient of {name}: {m}")
    assert not model.model.layers[0].forward.fallbacks


def test_the_probe_refuses_a_layer_no_attention_kernel_of_its_device_runs():
    """The probe of a 16-bit layer computes a float32 copy by the formulas, so it checks
    apart that a kernel of the layer's own device and dtype takes its heads: a bf16 layer
    with head_dim 4 on CUDA is refused (every call would raise), on the CPU taken."""
    from types import SimpleNamespace
    from fusible.models.decoder_layers import FusedLayerForward
    def fused(head_dim):  # the fused layer's attention decides
        return SimpleNamespace(fused=SimpleNamespace(attention=fusible.ops.Attention(
            8, head_dim=head_dim)))
    on = lambda device: SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16)  # noqa: E731
    why = FusedLayerForward._kernel_refusal(fused(4), on("cuda"))
    assert "no attention kernel on cuda fits" in why and "head_dim 4" in why, why
    assert FusedLayerForward._kernel_refusal(fused(4), on("cpu")) is None
    assert FusedLayerForward._kernel_refusal(fused(128), on("cuda")) is None


class _RemoteStack(torch.nn.Module):
    """A model's own module taking the mask it is handed (remote code's layout)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(2))
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden_states, attention_mask=None):
        s = hidden_states.shape[1]
        positions = torch.arange(s)[None]
        tables = self.rotary(hidden_states, positions)
        mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None] \
            & attention_mask[:, None, None, :].bool()
        mask = mask | torch.eye(s, dtype=torch.bool)  # no empty rows
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=mask, position_ids=positions,
                                  position_embeddings=tables)
        return hidden_states


def test_a_remote_code_model_that_builds_padding_is_not_marked():
    """A PreTrainedModel outside transformers (remote code) may build a padding mask from
    the pad token when given none: the mark goes on the innermost module, which receives
    that mask, and the padded call runs the original layers."""
    transformers = pytest.importorskip("transformers")

    class Outer(transformers.PreTrainedModel):
        config_class = transformers.LlamaConfig
        _supports_sdpa = True

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.stack = _RemoteStack(config)
            self.post_init()

        def forward(self, input_ids, attention_mask=None):
            if attention_mask is None:
                attention_mask = input_ids != self.config.pad_token_id
            return self.stack(self.embed(input_ids), attention_mask)

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Outer(config).eval()
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    marked = [p for p, _, new in report.converted if new.startswith("plain calls marked")]
    assert marked == ["stack"], str(report)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    ids[0, :4] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids), twin(ids), atol=1e-5, rtol=1e-5)
    assert model.stack.layers[0].forward.fallbacks == {"an attention mask": 1}


class Adapter(torch.nn.Module):
    """An adapter library's wrapper of a linear layer: its ``weight`` the base's, its
    own weights added to the output."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.extra = torch.nn.Linear(base.in_features, base.out_features, bias=False)
        torch.nn.init.normal_(self.extra.weight)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        return self.base(x) + self.extra(x)


def test_a_layer_changed_after_conversion_runs_its_original_code():
    """A projection wrapped after convert (as an adapter library does: a module of another
    kind holding the original) would be ignored by the fused layer, which reads the
    weights it knew: the layer runs its original code instead, saying why, and the
    wrapper's own weight trains. FSDP2's subclasses of the layer's classes are the same
    kinds."""
    model = _model("llama")
    fusible.convert(model)
    attn = model.model.layers[0].self_attn
    attn.q_proj = Adapter(attn.q_proj)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    forward = model.model.layers[0].forward
    assert list(forward.fallbacks) == ["its modules changed since conversion (an adapter "
                                       "added?): the fused layer would not compute them; "
                                       "convert the model again"]
    assert attn.q_proj.extra.weight.grad is not None
    assert not model.model.layers[1].forward.fallbacks
    layer = model.model.layers[1]
    layer.__class__ = type("FSDPLlamaDecoderLayer", (type(layer),), {})
    model(input_ids=ids, labels=ids)
    assert not layer.forward.fallbacks


def test_hooks_inside_a_layer_and_a_change_after_unpickling_run_its_original_code():
    """A hook on a module inside a fused layer (the fused layer would skip it) and a
    module swapped after the model was pickled (the kinds at conversion travel with it)
    both run the original layer, saying why; plan_model's own hooks do not count."""
    model = _model("llama")
    fusible.convert(model)
    ids = _ids()
    assert [p for p, _ in fusible.plan_model(model, input_ids=ids, use_cache=False).plans][:1] \
        == ["model.layers.0"]
    seen = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, a, out: seen.append(out.shape))
    model(input_ids=ids, use_cache=False)
    handle.remove()
    assert seen and dict(model.model.layers[0].forward.fallbacks) == {
        "hooks on its modules (the fused layer would not run them)": 1}
    copy_ = pickle.loads(pickle.dumps(model))
    copy_.model.layers[1].mlp.act_fn = torch.nn.GELU()
    copy_(input_ids=ids, use_cache=False)
    assert "its modules changed since conversion" in str(dict(copy_.model.layers[1].forward.fallbacks))
