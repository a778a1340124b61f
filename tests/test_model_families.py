"""Every model family convert knows, end to end on CPU from small random configs: each
decoder layer fused whole, the first step against the unconverted twin (logits, loss,
every gradient by name), 20 AdamW steps with the optimizer built before the conversion,
compiled with no graph break the original does not have, and FP8 GEMMs under
fusible.autocast(). The families and what they get: docs/guide.md ("Whole models")."""

import copy

import pytest
import torch

import fusible
from fusible.models.decoder_layers import FusedLayerForward

transformers = pytest.importorskip("transformers")

VOCAB, B, S, STEPS, LR = 96, 2, 7, 20, 1e-3
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


def _hf(config_fn, model_cls=None, **extra):
    def build():
        config = config_fn(**{**_SIZES, **extra})
        if "attn_implementation" not in extra:
            config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        cls = model_cls or transformers.AutoModelForCausalLM.from_config
        return cls(config)
    return build


def _gpt2(**k):
    return transformers.GPT2Config(n_embd=k["hidden_size"], n_inner=k["intermediate_size"],
                                   n_layer=2, n_head=4, vocab_size=k["vocab_size"],
                                   resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
                                   bos_token_id=0, eos_token_id=0)


def _bert(**k):
    return transformers.BertConfig(**{**k, "num_key_value_heads": None},
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _neox(**k):
    return transformers.GPTNeoXConfig(**{**k, "num_key_value_heads": None})


class _NanoGPT(torch.nn.Module):
    """nanoGPT's model layout (transformer.wte/wpe/h/ln_f, lm_head), blocks of
    tests/test_convert_layers.py's nanoGPT code."""

    def __init__(self):
        super().__init__()
        from test_convert_layers import _NanoBlock, _NanoLayerNorm
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(VOCAB, 32), wpe=torch.nn.Embedding(16, 32),
            h=torch.nn.ModuleList(_NanoBlock() for _ in range(2)),
            ln_f=_NanoLayerNorm(32, True)))
        self.lm_head = torch.nn.Linear(32, VOCAB, bias=False)

    def forward(self, ids):
        x = self.transformer.wte(ids) + self.transformer.wpe(torch.arange(ids.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _torchtitan():
    from torchtitan_style import Transformer
    torch.manual_seed(0)
    return Transformer()


FAMILIES = {
    "llama": _hf(transformers.LlamaConfig),
    "qwen2": _hf(transformers.Qwen2Config),
    "qwen3": _hf(transformers.Qwen3Config, head_dim=16),
    "mistral": _hf(transformers.MistralConfig),
    "gemma": _hf(transformers.GemmaConfig, head_dim=8),
    # soft-capped attention (its default 50; on CUDA the flex kernel)
    "gemma2": _hf(transformers.Gemma2Config, head_dim=16, attn_implementation="eager"),
    "gemma3": _hf(transformers.Gemma3TextConfig, head_dim=8, sliding_window=16,  # q/k norms,
                  layer_types=["sliding_attention", "full_attention"]),  # a rope per type
    "phi3": _hf(transformers.Phi3Config, pad_token_id=0),
    "gpt2": _hf(_gpt2),
    "gpt_neox": _hf(_neox),
    "bert": _hf(_bert, transformers.BertForMaskedLM),
    "nanogpt": lambda: (torch.manual_seed(0), _NanoGPT())[1],
    "torchtitan": _torchtitan,
}


def _spread(model):
    """Norm weights and biases away from their initial values (ones, zeros)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return model


def _ids(seq=S):
    return torch.randint(0, VOCAB, (B, seq), generator=torch.Generator().manual_seed(1))


def _loss(model, ids, run=None):
    """``(logits, loss)`` of one forward of ``run`` (``model`` compiled; ``model`` when
    None): the model's own loss where it computes one."""
    args, kwargs = _call(model, ids)
    out = (model if run is None else run)(*args, **kwargs)
    if isinstance(model, transformers.PreTrainedModel):
        return out.logits, out.loss
    return out, torch.nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten())


def _to_bf16(model):
    """Floating parameters and buffers in bf16 (``.to(bfloat16)`` would also cast a
    complex rotary table to a real one)."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.bfloat16)
    return model


def _relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _fused_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedLayerForward)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_fused_and_twenty_adamw_steps_match(family):
    """The first step within 1e-6 of the twin (logits and loss relative; each gradient
    within 1e-6 of the whole gradient's norm: a norm weight's gradient can be a thousand
    times smaller than the rest); then 20 AdamW steps, the optimizers built before the
    conversion: losses within 1e-5 and every weight within 5% of the most Adam can move
    it (lr x steps). A weight that stopped training would be off by all of that. Entries
    whose gradient is float32 noise (its RMS over the steps under 1e-6 of the first
    step's whole gradient: the key bias, to which softmax is blind) are left out: Adam's
    steps there follow the noise, in the twin as much (the twin's gradient decides: a
    weight the converted model stopped training keeps its twin's signal)."""
    model = _spread(FAMILIES[family]())
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, twin)]
    report = fusible.convert(model)
    fused = [p for p, _, new in report.converted if new.startswith("TransformerLayer")]
    assert len(fused) == 2 and len(_fused_layers(model)) == 2, str(report)
    ids = _ids()
    for step in range(STEPS):
        results = []
        for m, opt in zip((model, twin), optimizers):
            logits, loss = _loss(m, ids)
            loss.backward()
            results.append((logits.detach(), loss.detach(),
                            {n: p.grad.clone() for n, p in m.named_parameters()}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (logits, loss, grads), (want_logits, want_loss, want_grads) = results
        assert _relative(loss, want_loss) < (1e-6 if step == 0 else 1e-5), (step, loss, want_loss)
        if step == 0:
            assert _relative(logits, want_logits) < 1e-6
            total = torch.cat([g.flatten() for g in want_grads.values()]).norm()
            for name, grad in grads.items():
                error = (grad - want_grads[name]).norm() / total
                assert error < 1e-6, f"gradient of {name}: {error:.3g} of the whole gradient"
    twin_params = dict(twin.named_parameters())
    beta2 = optimizers[1].defaults["betas"][1]
    for name, p in model.named_parameters():
        twin_p = twin_params[name]
        rms = (optimizers[1].state[twin_p]["exp_avg_sq"] / (1 - beta2 ** STEPS)).sqrt()
        signal = rms > 1e-6 * total
        moved = (p - twin_p).abs()[signal].max().item() if signal.any() else 0.0
        assert moved <= 0.05 * LR * STEPS, f"{name} after {STEPS} steps: {moved:.3g} apart"
    for layer in _fused_layers(model):
        assert not layer.forward.fallbacks, dict(layer.forward.fallbacks)


def _call(model, ids) -> tuple:
    """The model's call as ``(args, kwargs)``: Hugging Face models by keyword."""
    if isinstance(model, transformers.PreTrainedModel):
        return (), dict(input_ids=ids, labels=ids, **({} if "Bert" in type(model).__name__
                                                       else {"use_cache": False}))
    return (ids,), {}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_with_no_new_graph_break_and_the_fused_layers_run(family):
    """aot_eager: the converted model breaks its graph no more often than the original
    (torch._dynamo.explain), runs its fused layers compiled, and computes the eager
    logits."""
    model = _spread(FAMILIES[family]())
    twin = copy.deepcopy(model)
    fusible.convert(model)
    args, kwargs = _call(model, _ids())
    original = torch._dynamo.explain(twin)(*args, **kwargs).graph_break_count
    torch._dynamo.reset()
    converted = torch._dynamo.explain(model)(*args, **kwargs).graph_break_count
    assert converted <= original, (converted, original)
    torch._dynamo.reset()
    want, _ = _loss(model, _ids())
    got, _ = _loss(model, _ids(), torch.compile(model, backend="aot_eager"))
    assert _relative(got, want) < 1e-6
    for layer in _fused_layers(model):
        assert not layer.forward.fallbacks, dict(layer.forward.fallbacks)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_runs_every_fused_layer_gemm_in_fp8(family):
    """bf16 under fusible.autocast(): each fused layer's four GEMMs and every other
    converted linear layer in FP8 (plan_model counts them), the loss within FP8's reach
    of the bf16 twin's."""
    model = _to_bf16(_spread(FAMILIES[family]()))
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    linears = sum(new.startswith("Linear") for _, _, new in report.converted)
    ids = _ids(8)  # FP8 GEMMs take a multiple of 16 tokens
    args, kwargs = _call(model, ids)
    with fusible.autocast():
        totals = fusible.plan_model(model, *args, **kwargs).totals()
        _, got = _loss(model, ids)
    assert totals["FP8 GEMMs"] == 4 * 2 + linears, (totals, str(report))
    _, want = _loss(twin, ids)
    assert abs(got.item() - want.item()) < 0.05 * abs(want.item())


@pytest.mark.usefixtures("fresh_dynamo")
def test_inductor_compiles_a_converted_model_with_its_fused_layers():
    """The representative Inductor run (the other families compile with aot_eager above):
    a converted Llama under torch.compile's default backend runs its fused layers (each
    stage a custom op, opaque to Inductor) and computes the eager logits and gradients."""
    model = _spread(FAMILIES["llama"]())
    fusible.convert(model)
    ids = _ids()
    want, want_loss = _loss(model, ids)
    want_loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got, loss = _loss(model, ids, torch.compile(model))
    loss.backward()
    assert _relative(got, want) < 1e-5
    for name, p in model.named_parameters():
        assert _relative(p.grad, want_grads[name]) < 1e-4, name
    for layer in _fused_layers(model):
        assert not layer.forward.fallbacks, dict(layer.forward.fallbacks)


_HF_FAMILIES = [f for f in FAMILIES if f not in ("nanogpt", "torchtitan")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", _HF_FAMILIES)
def test_bf16_model_on_cuda_fuses_every_layer_and_trains_like_its_twin(family):
    """A bf16 model on CUDA (what users train): convert fuses every layer (its probe
    runs a float32 copy, which CUDA's attention kernels do not take: the probe attends by
    the formulas), the fused layers run with no fallback, and the loss and every gradient
    of a step stay within bf16's reach of the unconverted twin's."""
    model = _to_bf16(_spread(FAMILIES[family]()).cuda())
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    assert len(_fused_layers(model)) == 2, str(report)
    ids = _ids(16).cuda()
    grads = []
    for m in (model, twin):
        _, loss = _loss(m, ids)
        loss.backward()
        grads.append((loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()}))
    (loss, got), (want_loss, want) = grads
    assert _relative(loss, want_loss) < 1e-2, (loss, want_loss)
    total = torch.cat([g.flatten() for g in want.values()]).norm()
    for name, grad in got.items():
        assert (grad - want[name]).norm() / total < 3e-2, name
    for layer in _fused_layers(model):
        assert not layer.forward.fallbacks, dict(layer.forward.fallbacks)


def test_the_mark_goes_on_the_hf_model_that_builds_the_mask_not_a_module_inside_it():
    """BERT's model builds the whole mask (always for the eager attention, and under
    torch.compile) and hands it to its encoder, which takes an attention mask too: the
    plain-call mark goes on the BertModel, so a call without a mask runs the fused layers
    and computes what the twin does; a padding mask still runs the original code."""
    model = _spread(_hf(_bert, transformers.BertForMaskedLM, attn_implementation="eager")())
    twin = copy.deepcopy(model)
    report = fusible.convert(model)
    marked = [p for p, _, new in report.converted if new.startswith("plain calls marked")]
    assert marked == ["bert"], str(report)
    ids = _ids()
    got, want = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert _relative(got, want) < 1e-6
    assert all(not layer.forward.fallbacks for layer in _fused_layers(model))
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    assert _relative(model(input_ids=ids, attention_mask=padded).logits,
                     twin(input_ids=ids, attention_mask=padded).logits) < 1e-6
    assert _fused_layers(model)[0].forward.fallbacks == {"an attention mask": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_llama_at_real_head_width_on_cuda_trains_like_its_twin(compiled, fresh_dynamo):
    """Llama-3's attention shape (head_dim 128, four query heads per kv head, 512 tokens)
    in bf16 on CUDA, where the fused layers attend with cuDNN: ten AdamW steps, eager and
    compiled, stay within bf16's reach of the unconverted twin's losses (a wrong gradient
    anywhere would pull them apart within a few steps: the 8B benchmark's compiled model
    once ended 1.1 above its twin)."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    fusible.convert(model)
    ids = torch.randint(0, 512, (2, 512), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for m in (model, twin):
        run = torch.compile(m) if compiled and m is model else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(10):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 0.02 * losses[1], losses
    for layer in _fused_layers(model):
        assert not layer.forward.fallbacks, dict(layer.forward.fallbacks)
