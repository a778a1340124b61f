"""fusible.layers.TransformerLayer against Hugging Face's own layers (Llama, Qwen2's QKV
bias, Qwen3's q/k norms, BERT's post-norm) in float64, parameters and gradients by name;
its plan (one group, the residuals fused), compiled bitwise, its errors."""

import pytest
import torch

import fusible
from fusible.layers import TransformerLayer, llama_layer_state_dict
from fusible.testing import check_compiled_matches_eager, stage_names

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, HEADS, KV, B, S = 32, 48, 4, 2, 2, 5
# Hugging Face's RMSNorm computes in float32 whatever the input (``.to(torch.float32)``):
# in float64 its layers agree with ours to float32's precision, not float64's
NEAR_FP32 = {"atol": 2e-6, "rtol": 2e-5}


def _hf_decoder_layer(family: str):
    """A small Hugging Face decoder layer (float64, sdpa attention) and its rotary module."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen2.modeling_qwen2 as qwen2
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    config_cls, module = {"llama": (transformers.LlamaConfig, llama),
                          "qwen2": (transformers.Qwen2Config, qwen2),
                          "qwen3": (transformers.Qwen3Config, qwen3)}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}  # Qwen3: wider than hidden/heads
    config = config_cls(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                        num_key_value_heads=KV, rms_norm_eps=1e-6, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer_cls = getattr(module, f"{family.capitalize()}DecoderLayer")
    rotary_cls = getattr(module, f"{family.capitalize()}RotaryEmbedding")
    layer = layer_cls(config, layer_idx=0).double()
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return config, layer, rotary_cls(config)


def _ours_like(config, family: str) -> TransformerLayer:
    theta = config.rope_parameters["rope_theta"]
    return TransformerLayer(
        HIDDEN, FFN, HEADS, num_kv_heads=KV, rotary_base=theta, eps=config.rms_norm_eps,
        head_dim=getattr(config, "head_dim", None) or HIDDEN // HEADS, qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        qk_norm_eps=config.rms_norm_eps, dtype=torch.float64)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_matches_hugging_face_decoder_layers(family):
    config, hf, rotary = _hf_decoder_layer(family)
    ours = _ours_like(config, family)
    ours.load_state_dict(llama_layer_state_dict(hf.state_dict()))
    _compare_with_decoder_layer(ours, hf, rotary, llama_layer_state_dict)


def _compare_with_decoder_layer(ours, hf, rotary, our_names) -> None:
    """Output, input gradient and every parameter's gradient (by name: ``our_names`` maps
    Hugging Face's to ours) of ``ours`` and the decoder layer ``hf`` in float64."""
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_()
    positions = torch.arange(S).expand(B, S)
    out = hf(x_hf, position_ids=positions, position_embeddings=rotary(x_hf, positions))
    want = out[0] if isinstance(out, tuple) else out
    got = ours(x)
    torch.testing.assert_close(got, want, **NEAR_FP32)
    dy = torch.randn_like(got)
    got.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x_hf.grad, **NEAR_FP32)
    named = our_names({name: p.grad for name, p in hf.named_parameters()})
    assert sorted(named) == sorted(n for n, _ in ours.named_parameters())
    for name, grad in named.items():
        torch.testing.assert_close(ours.get_parameter(name).grad, grad, **NEAR_FP32,
                                   msg=lambda m: f"gradient of {name}: {m}")


def _bert_state_dict(hf) -> dict:
    attn, sd = "attention.self.", hf.state_dict()
    out = {"attention_norm.weight": sd["attention.output.LayerNorm.weight"],
           "attention_norm.bias": sd["attention.output.LayerNorm.bias"],
           "output_norm.weight": sd["output.LayerNorm.weight"],
           "output_norm.bias": sd["output.LayerNorm.bias"],
           "proj.weight": sd["attention.output.dense.weight"],
           "proj.bias": sd["attention.output.dense.bias"],
           "fc1.weight": sd["intermediate.dense.weight"], "fc1.bias": sd["intermediate.dense.bias"],
           "fc2.weight": sd["output.dense.weight"], "fc2.bias": sd["output.dense.bias"]}
    for kind in ("weight", "bias"):
        out[f"qkv.{kind}"] = torch.cat([sd[f"{attn}{p}.{kind}"] for p in ("query", "key", "value")])
    return out


def test_post_norm_matches_bert_layer():
    config = transformers.BertConfig(hidden_size=HIDDEN, intermediate_size=FFN,
                                     num_attention_heads=HEADS, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.models.bert.modeling_bert.BertLayer(config).double().eval()
    ours = TransformerLayer(HIDDEN, FFN, HEADS, norm="layernorm", activation="gelu",
                            rotary_base=None, causal=False, residual="post_norm", bias=True,
                            eps=config.layer_norm_eps, dtype=torch.float64)
    ours.load_state_dict(_bert_state_dict(hf))
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64)
    out = hf(x)
    want = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(ours(x), want, atol=1e-12, rtol=0)


def test_one_group_per_layer_with_the_residuals_fused():
    stack = torch.nn.Sequential(*(TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV)
                                  for _ in range(3)))
    x = torch.randn(B, S, HIDDEN, requires_grad=True)
    model_plan = fusible.plan_model(stack, x)
    assert [path for path, _ in model_plan.plans] == ["0", "1", "2"]
    plan = model_plan.plans[0][1]
    forward, backward = stage_names(plan.forward), stage_names(plan.backward)
    # the output projections add their residuals in the GEMM (fc2 in the joint stage
    # that recomputes the activation); the norms take the branch
    assert forward.count("ForwardLinearBiasAdd") == 1, forward
    assert forward[-1] == backward[0] == "RecomputeGluLinear", (forward, backward)
    assert "Attention" in forward and "BackwardAddRMSNorm" in backward, backward
    assert model_plan.totals()["ordinary modules"] == 0


def test_compiled_is_bitwise_eager(fresh_dynamo):
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, qk_norm=True)
    check_compiled_matches_eager(layer, torch.randn(B, S, HIDDEN, requires_grad=True))


@pytest.mark.parametrize("kwargs, match", [
    ({"norm": "batchnorm"}, "norm"), ({"activation": "tanh"}, "activation"),
    ({"residual": "hourglass"}, "residual"), ({"num_heads": 5}, "not a multiple of num_heads 5"),
    ({"num_heads": 0}, "num_heads"), ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
])
def test_errors_name_the_argument_and_value(kwargs, match):
    args = {"hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_heads": HEADS, **kwargs}
    with pytest.raises(ValueError, match=match):
        TransformerLayer(**args)


def test_hugging_face_names_refuse_what_has_no_place():
    with pytest.raises(KeyError, match=r"no TransformerLayer place for \['mlp.extra'\]"):
        llama_layer_state_dict({"mlp.extra": torch.zeros(1)})
    with pytest.raises(KeyError, match="qkv.weight needs all of"):
        llama_layer_state_dict({"self_attn.q_proj.weight": torch.zeros(1)})


def test_fp8_runs_the_four_gemms_in_fp8_and_compiles_bitwise(fresh_dynamo):
    """Under fusible.autocast the QKV, output and MLP GEMMs run in FP8 around the bf16
    attention (CPU emulation), eager and compiled alike."""
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, dtype=torch.bfloat16)
    x = torch.randn(B, 8, HIDDEN, dtype=torch.bfloat16, requires_grad=True)  # 16 tokens
    with fusible.autocast():
        totals = fusible.plan_model(layer, x).totals()
        assert totals["FP8 GEMMs"] == 4 and totals["fusible groups"] == 1
        check_compiled_matches_eager(layer, x)


def _neox_state_dict(sd: dict, heads: int) -> dict:
    """GPT-NeoX's fused QKV rows go per head (q, k, v of head 0, then head 1...); ours q
    heads, then k, then v."""
    out = {"input_norm.weight": sd["input_layernorm.weight"],
           "input_norm.bias": sd["input_layernorm.bias"],
           "mlp_norm.weight": sd["post_attention_layernorm.weight"],
           "mlp_norm.bias": sd["post_attention_layernorm.bias"],
           "proj.weight": sd["attention.dense.weight"], "proj.bias": sd["attention.dense.bias"],
           "fc1.weight": sd["mlp.dense_h_to_4h.weight"], "fc1.bias": sd["mlp.dense_h_to_4h.bias"],
           "fc2.weight": sd["mlp.dense_4h_to_h.weight"], "fc2.bias": sd["mlp.dense_4h_to_h.bias"]}
    w, b = sd["attention.query_key_value.weight"], sd["attention.query_key_value.bias"]
    out["qkv.weight"] = w.view(heads, 3, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)
    out["qkv.bias"] = b.view(heads, 3, -1).transpose(0, 1).reshape(b.shape)
    return out


def test_parallel_residual_matches_gpt_neox_layer():
    """GPT-NeoX: y = x + attn(ln1(x)) + mlp(ln2(x)), partial rotary, biases, exact GELU."""
    from transformers.models.gpt_neox import modeling_gpt_neox as neox
    config = transformers.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_attention_heads=HEADS, hidden_dropout=0.0,
                                        attention_dropout=0.0, use_parallel_residual=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = neox.GPTNeoXLayer(config, 0).double()
    rotary = neox.GPTNeoXRotaryEmbedding(config)
    fraction = config.rope_parameters.get("partial_rotary_factor", 1.0)
    ours = TransformerLayer(HIDDEN, FFN, HEADS, norm="layernorm", activation="gelu",
                            residual="parallel", bias=True, eps=config.layer_norm_eps,
                            rotary_base=config.rope_parameters["rope_theta"],
                            rotary_fraction=fraction, dtype=torch.float64)
    assert fraction < 1  # partial rotary, GPT-NeoX's default
    ours.load_state_dict(_neox_state_dict(hf.state_dict(), HEADS))
    _compare_with_decoder_layer(ours, hf, rotary, lambda sd: _neox_state_dict(sd, HEADS))


@pytest.mark.parametrize("residual", ["parallel", "parallel_shared_norm"])
def test_parallel_residuals_against_their_formula(residual):
    """y = x + attention branch(norm1(x)) + MLP branch(norm2(x)), norm2 = norm1 when shared:
    the layer against its own modules run one by one; compiled bitwise."""
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, residual=residual,
                             dtype=torch.float64)
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64)
    norm2 = layer.input_norm if residual.endswith("shared_norm") else layer.mlp_norm
    attention = layer.proj(layer.attention(layer.qkv(layer.input_norm(x))))
    mlp = layer.fc2(layer.activation(layer.fc1(norm2(x))))
    torch.testing.assert_close(layer(x), x + attention + mlp, atol=1e-12, rtol=0)
    assert not hasattr(layer, "mlp_norm") or residual == "parallel"
    check_compiled_matches_eager(layer.float(), torch.randn(B, S, HIDDEN, requires_grad=True))
