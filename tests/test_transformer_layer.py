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
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_()
    positions = torch.arange(S).expand(B, S)
    want = hf(x_hf, position_ids=positions,
              position_embeddings=rotary(x_hf, positions))
    got = ours(x)
    torch.testing.assert_close(got, want, **NEAR_FP32)
    dy = torch.randn_like(got)
    got.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x_hf.grad, **NEAR_FP32)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    named = llama_layer_state_dict(hf_grads)
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
    # the output projections add their residuals in the GEMM; the norms take the branch
    assert forward.count("ForwardLinearBiasAdd") == 2, forward
    assert "Attention" in forward and "BackwardAddRMSNorm" in backward, backward
    assert model_plan.totals()["ordinary modules"] == 0


def test_compiled_is_bitwise_eager(fresh_dynamo):
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, qk_norm=True)
    check_compiled_matches_eager(layer, torch.randn(B, S, HIDDEN, requires_grad=True))


@pytest.mark.parametrize("kwargs, match", [
    ({"norm": "batchnorm"}, "norm"), ({"activation": "tanh"}, "activation"),
    ({"residual": "parallel"}, "residual"), ({"num_heads": 5}, "not a multiple of num_heads 5"),
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
