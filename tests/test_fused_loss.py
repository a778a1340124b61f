"""convert(model, fuse_loss=True): a Hugging Face causal LM's training loss by
LinearCrossEntropy on its lm_head weight (no logits made), against the unconverted twin:
the loss and every gradient by name, AdamW steps with the optimizer built before the
conversion, num_items_in_batch, tied embeddings, compiled; the calls it does not take
run the model's own forward."""

import copy

import pytest
import torch

import fusible

transformers = pytest.importorskip("transformers")

VOCAB, B, S = 96, 2, 7
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config,
            "qwen3": lambda **k: transformers.Qwen3Config(head_dim=16, **k)}


def _pair(family, **extra):
    config = FAMILIES[family](**_SIZES, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, copy.deepcopy(model)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt the loss leaves out
    return ids, labels


def _relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_and_every_gradient_match_the_twin_for_five_adamw_steps(family):
    model, twin = _pair(family)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    report = fusible.convert(model, fuse_loss=True)
    assert any("LinearCrossEntropy" in new for _, _, new in report.converted), str(report)
    ids, labels = _batch()
    for step in range(5):
        out = model(input_ids=ids, labels=labels)
        want = twin(input_ids=ids, labels=labels, use_cache=False)
        assert out.logits is None and want.logits is not None
        assert _relative(out.loss, want.loss) < 1e-6, (step, out.loss, want.loss)
        out.loss.backward()
        want.loss.backward()
        if step == 0:
            total = torch.cat([p.grad.flatten() for p in twin.parameters()]).norm()
            grads = dict(twin.named_parameters())
            for name, p in model.named_parameters():
                error = (p.grad - grads[name].grad).norm() / total
                assert error < 1e-6, f"gradient of {name}: {error:.3g}"
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not model.forward.fallbacks


def test_tied_embeddings_and_num_items_in_batch():
    """A tied lm_head (the embedding's weight) gets both gradients; with
    num_items_in_batch the loss is the sum over it, as Hugging Face's."""
    model, twin = _pair("llama", tie_word_embeddings=True)
    fusible.convert(model, fuse_loss=True)
    ids, labels = _batch()
    items = torch.tensor(9)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=items)
    want = twin(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False)
    assert _relative(out.loss, want.loss) < 1e-6
    out.loss.backward()
    want.loss.backward()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _relative(model.lm_head.weight.grad, twin.lm_head.weight.grad) < 1e-6


def test_calls_it_does_not_take_run_the_models_forward():
    """Evaluation, no labels: the model's own forward and its logits (not counted);
    return_dict=False: the same, counted."""
    model, twin = _pair("llama")
    fusible.convert(model, fuse_loss=True)
    ids, labels = _batch()
    assert model(input_ids=ids).logits is not None
    model.eval()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).logits,
                               twin.eval()(input_ids=ids, labels=labels).logits)
    model.train()
    assert isinstance(model(input_ids=ids, labels=labels, return_dict=False), tuple)
    assert dict(model.forward.fallbacks) == {"return_dict=False": 1}


def test_a_model_without_a_known_causal_lm_is_refused():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"convert\(fuse_loss=True\): GPT2LMHeadModel holds no "
                                         r"causal LM whose loss fusible computes"):
        fusible.convert(transformers.GPT2LMHeadModel(config), fuse_loss=True)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_the_loss_is_the_eager_one():
    model, _ = _pair("qwen2")
    fusible.convert(model, fuse_loss=True)
    ids, labels = _batch()
    want = model(input_ids=ids, labels=labels).loss
    got = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=labels)
    assert got.logits is None
    assert torch.equal(got.loss, want)


def test_a_copy_trains_its_own_weights():
    """deepcopy and pickle: the copy's loss reads its own lm_head weight, whose gradient
    it fills; the original's stay untouched."""
    import pickle
    model, _ = _pair("llama")
    fusible.convert(model, fuse_loss=True)
    ids, labels = _batch()
    want = model(input_ids=ids, labels=labels).loss
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        loss = other(input_ids=ids, labels=labels).loss
        assert torch.equal(loss, want)
        loss.backward()
        assert other.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
        assert other.forward.heads["mean"][0].weight is other.lm_head.weight


def test_a_new_lm_head_parameter_is_the_one_read():
    """lm_head given another parameter after convert (resize_token_embeddings does): the
    loss reads it, as the twin given the same one."""
    model, twin = _pair("llama")
    fusible.convert(model, fuse_loss=True)
    new = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    model.lm_head.weight = new
    twin.lm_head.weight = torch.nn.Parameter(new.detach().clone())
    ids, labels = _batch()
    got = model(input_ids=ids, labels=labels).loss
    want = twin(input_ids=ids, labels=labels, use_cache=False).loss
    assert _relative(got, want) < 1e-6


def test_what_the_fused_loss_would_not_read_runs_the_models_forward():
    """An lm_head wrapped after convert (an adapter: its weight property the base's, its
    own weights added), hooks on lm_head, another ignore_index: the model's forward, its
    loss the twin's, the reason counted; the forward shows the model's signature (the
    Trainer picks its columns by it); the head decides FP8 as lm_head says."""
    import inspect
    model, twin = _pair("llama")
    fusible.convert(model, fuse_loss=True)
    assert {"input_ids", "labels", "attention_mask"} <= set(inspect.signature(model.forward).parameters)
    ids, labels = _batch()
    model.lm_head.fp8 = False
    model(input_ids=ids, labels=labels)
    assert model.forward.heads["mean"][0].basic_ops()[0].fp8 is False
    from test_convert_layers import Adapter
    model.lm_head = Adapter(model.lm_head)
    twin.lm_head = Adapter(twin.lm_head)
    twin.lm_head.extra.load_state_dict(model.lm_head.extra.state_dict())
    got = model(input_ids=ids, labels=labels)
    assert got.logits is not None
    assert _relative(got.loss, twin(input_ids=ids, labels=labels, use_cache=False).loss) < 1e-6
    model.lm_head = model.lm_head.base
    handle = model.lm_head.register_forward_hook(lambda *a: None)
    model(input_ids=ids, labels=labels)
    handle.remove()
    model(input_ids=ids, labels=ids, ignore_index=5)
    assert dict(model.forward.fallbacks) == {
        "its lm_head is Adapter (an adapter?), not a plain linear layer": 1,
        "hooks on its lm_head": 1, "ignore_index=5": 1}
