"""fusible.layers.CausalLM against Hugging Face's LlamaForCausalLM on the same weights:
the loss and every gradient by name, tied and untied embeddings; one plan per layer."""

import pytest
import torch

import fusible
from fusible.layers import CausalLM
from fusible.testing import check_compiled_matches_eager

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV, B, S = 64, 32, 48, 2, 4, 2, 2, 7


def _pair(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        tie_word_embeddings=tied, rms_norm_eps=1e-6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).double()
    ours = CausalLM(VOCAB, HIDDEN, FFN, LAYERS, HEADS, num_kv_heads=KV, eps=1e-6,
                    rotary_base=config.rope_parameters["rope_theta"], tie_embeddings=tied,
                    dtype=torch.float64)
    ours.load_state_dict(CausalLM.state_dict_from_llama(hf.state_dict()))
    return hf, ours


@pytest.mark.parametrize("tied", [False, True])
def test_loss_and_gradients_match_llama_for_causal_lm(tied):
    hf, ours = _pair(tied)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 2] = -100
    want = hf(input_ids=ids, labels=labels).loss
    got = ours(ids, labels)
    # Hugging Face computes its norms and its loss in float32 whatever the model's dtype
    torch.testing.assert_close(got.float(), want, atol=2e-6, rtol=2e-6)
    want.backward()
    got.backward()
    hf_grads = CausalLM.state_dict_from_llama({n: p.grad for n, p in hf.named_parameters()})
    ours_named = dict(ours.named_parameters())
    assert sorted(hf_grads) == sorted(ours_named)  # tied: both name the embedding only
    for name, p in ours_named.items():
        torch.testing.assert_close(p.grad, hf_grads[name], atol=2e-6, rtol=2e-5,
                                   msg=lambda m: f"gradient of {name}: {m}")
    logits = ours.logits(ids)
    torch.testing.assert_close(logits, hf(input_ids=ids).logits, atol=2e-6, rtol=2e-5)


def test_one_group_per_layer_and_the_head():
    _, ours = _pair(False)
    ids = torch.randint(0, VOCAB, (B, S))
    plans = fusible.plan_model(ours.float(), ids, ids).plans
    assert [path for path, _ in plans] == ["layers.0", "layers.1", "head"]
    assert [s.name for s in plans[-1][1].forward] == ["RMSNorm", "LinearCrossEntropy"]


def test_compiled_is_bitwise_eager(fresh_dynamo):
    _, ours = _pair(True)
    ids = torch.randint(0, VOCAB, (B, S))
    check_compiled_matches_eager(ours.float(), ids, ids)
