"""Modeling behaviour: gradient checkpointing, half precision, depth-weight outputs, attention backends, PEFT wrapping, tied embeddings."""

import pytest
import torch

from attnres_hf.modeling.depth_mixing import DEPTH_MIXING
from utils import VARIANTS, tiny_model, variant_model


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["default", "non-reentrant", "reentrant-asked"])
@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4"])
def test_gradient_checkpointing_gives_the_same_gradients(block_size, reentrant, input_ids):
    model = tiny_model(attnres_block_size=block_size).train()
    labels = input_ids.clone()

    model(input_ids, labels=labels).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # use_reentrant=True (asked for by older recipes) cannot follow the depth state: it is replaced, not obeyed
    model.gradient_checkpointing_enable(None if reentrant is None else {"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    recomputed_layers = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: recomputed_layers.append(1))
    model(input_ids, labels=labels).loss.backward()
    hook.remove()
    assert len(recomputed_layers) == 2  # forward, then the replay in backward: checkpointing is really on
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert model.model.layers[1].attn_res.query.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(VARIANTS) + ["attnres-full"])
def test_half_precision_forward_stays_finite_on_large_inputs(name, dtype, input_ids):
    overrides = VARIANTS.get(name, {"attnres_block_size": 1})
    model = variant_model(overrides).to(dtype)
    embeds = model.get_input_embeddings()(input_ids)
    embeds = embeds / embeds.abs().amax() * 300  # inputs of magnitude ~300
    with torch.no_grad():
        out = model(inputs_embeds=embeds, output_depth_weights=True, output_hidden_states=True)
    assert out.logits.dtype == dtype and torch.isfinite(out.logits).all()
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    method = DEPTH_MIXING[model.config.depth_mixing]
    for weights in out.depth_weights or ():
        assert weights.dtype == torch.float32 and torch.isfinite(weights).all()  # mixing in fp32 whatever the dtype
        if method.distribution(model.config):
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-4, rtol=0)


def test_depth_weights_are_returned_only_when_asked_and_not_for_the_baseline(input_ids):
    with torch.no_grad():
        assert tiny_model()(input_ids).depth_weights is None
        assert tiny_model(depth_mixing="residual")(input_ids, output_depth_weights=True).depth_weights is None
        weights = tiny_model()(input_ids, output_depth_weights=True).depth_weights
    assert len(weights) == 2 * 3 + 1


def test_output_attentions_with_eager_attention(input_ids):
    model = tiny_model(attn_implementation="eager")
    with torch.no_grad():
        out = model(input_ids, output_attentions=True)
    assert len(out.attentions) == 3
    assert out.attentions[0].shape == (2, 4, input_ids.shape[1], input_ids.shape[1])


def test_eager_and_sdpa_agree(input_ids):
    eager, sdpa = tiny_model(attn_implementation="eager"), tiny_model(attn_implementation="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(eager(input_ids).logits, sdpa(input_ids).logits, atol=1e-5, rtol=1e-5)


def test_peft_all_linear_wraps_projections_but_never_a_router(input_ids):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(target_modules="all-linear", r=4))
    wrapped = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert any(name.endswith("self_attn.q_proj") for name in wrapped)
    assert any(name.endswith("mlp.down_proj") for name in wrapped)
    assert not any("_res" in name for name in wrapped)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_tied_embeddings_share_one_tensor():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = tiny_model(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
