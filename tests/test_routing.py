"""The model's routing (fast path) against the paper's equations written out by hand with `naive_attnres`."""

import pytest
import torch

from attnres_hf import naive_attnres
from utils import tiny_model

BLOCK_SIZES = [pytest.param(1, id="full"), pytest.param(2, id="block2"), pytest.param(4, id="block4-partial-last"),
               pytest.param(6, id="block6-one-block"), pytest.param(8, id="block8-larger-than-model")]


def eq6_sources(embedding, outputs, sublayer, block_size):
    """Sources of sub-layer `sublayer` (Eq. 6): the embedding, every completed block sum, and the current block's
    partial sum when the sub-layer is not the first of its block. `outputs[k]` is the raw output of sub-layer k."""
    completed = sublayer // block_size
    sources = [embedding] + [sum(outputs[b * block_size:(b + 1) * block_size]) for b in range(completed)]
    if outputs[completed * block_size:sublayer]:
        sources.append(sum(outputs[completed * block_size:sublayer]))
    return sources


def reference_forward(model, input_ids):
    """The whole model, sub-layer by sub-layer, with sources built from Eq. 6 and routed by `naive_attnres`."""
    config, inner = model.config, model.model
    embedding = inner.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1])[None]
    position_embeddings = inner.rotary_emb(embedding, position_ids)
    outputs, weights, routed = [], [], []
    routers = [r for layer in inner.layers for r in (layer.attn_res, layer.mlp_res)] + [inner.final_res]
    for sublayer, router in enumerate(routers):
        sources = eq6_sources(embedding, outputs, sublayer, config.attnres_block_size)
        hidden, alpha = naive_attnres(sources, router.query, router.key_norm.weight, config.rms_norm_eps)
        if config.attnres_rescale_output:
            hidden = hidden * len(sources)
        routed.append(hidden)
        weights.append(alpha)
        if sublayer == len(routers) - 1:
            break
        layer = inner.layers[sublayer // 2]
        if sublayer % 2 == 0:  # sdpa with no mask is causal
            out = layer.self_attn(layer.input_layernorm(hidden), position_embeddings, None)[0]
        else:
            out = layer.mlp(layer.post_attention_layernorm(hidden))
        outputs.append(out)
    logits = model.lm_head(inner.norm(routed[-1]))
    return logits, weights, routed, outputs, embedding


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_zero_queries_route_the_mean_of_eq6_sources(block_size, input_ids):
    model = tiny_model(attnres_block_size=block_size, routers=False)
    captured = []
    hooks = [m.register_forward_hook(lambda mod, args, out: captured.append(out[0]))
             for name, m in model.named_modules() if name.endswith("_res")]
    with torch.no_grad():
        out = model(input_ids, output_depth_weights=True)
        _, _, _, outputs, embedding = reference_forward(model, input_ids)
    for hook in hooks:
        hook.remove()
    order = [r for layer in model.model.layers for r in (layer.attn_res, layer.mlp_res)] + [model.model.final_res]
    assert len(captured) == len(order) == 2 * model.config.num_hidden_layers + 1
    for sublayer, hidden in enumerate(captured):
        sources = eq6_sources(embedding, outputs, sublayer, block_size)
        torch.testing.assert_close(hidden, torch.stack(sources).mean(0), atol=1e-6, rtol=1e-5)
        weights = out.depth_weights[sublayer]
        assert weights.shape == (*input_ids.shape, len(sources))
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / len(sources)))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("rescale", [False, True], ids=["mean", "rescaled"])
def test_fast_path_matches_naive_on_outputs_weights_and_gradients(block_size, rescale, input_ids):
    model = tiny_model(attnres_block_size=block_size, attnres_rescale_output=rescale, attn_implementation="sdpa")
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(2))

    out = model(input_ids, output_depth_weights=True)
    (out.logits @ projection).square().mean().backward()
    fast_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    ref_logits, ref_weights, _, _, _ = reference_forward(model, input_ids)
    (ref_logits @ projection).square().mean().backward()

    torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert len(out.depth_weights) == len(ref_weights)
    for fast, ref in zip(out.depth_weights, ref_weights):
        torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)
    # Every query gets a gradient, except the first router's: it has one source, so its softmax is constant.
    assert fast_grads["model.layers.0.attn_res.query"].abs().sum() == 0
    assert all(fast_grads[n].abs().sum() > 0 for n in fast_grads if n.endswith(".query") and ".0.attn_res" not in n)
    for name, param in model.named_parameters():
        torch.testing.assert_close(fast_grads[name], param.grad, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_rescaled_zero_queries_give_the_residual_sum(input_ids):
    """With `attnres_rescale_output`, zero queries reproduce the residual stream exactly (the retrofit property)."""
    model = tiny_model(attnres_block_size=2, attnres_rescale_output=True, routers=False)
    with torch.no_grad():
        _, _, routed, outputs, embedding = reference_forward(model, input_ids)
    for sublayer, hidden in enumerate(routed):
        torch.testing.assert_close(hidden, embedding + sum(outputs[:sublayer]), atol=1e-5, rtol=1e-5)


def test_naive_attnres_docstring_contract():
    sources = [torch.randn(2, 3, 8) for _ in range(4)]
    hidden, weights = naive_attnres(sources, torch.zeros(8), torch.ones(8), 1e-6)
    assert hidden.shape == (2, 3, 8) and hidden.dtype == torch.float32
    assert weights.shape == (2, 3, 4)
    torch.testing.assert_close(hidden, torch.stack(sources).mean(0))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3))


def test_key_norm_statistics_are_computed_once_per_block(input_ids, monkeypatch):
    """Completed-block key norms come from the state (once per block), never recomputed per router."""
    from attnres_hf.modeling import attnres_buffer, attnres_inference, attnres_two_phase, mixing_attnres, ops_torch, \
        ops_triton

    # (the two-phase reads; the attention reads of few tokens, `SdpaLayout`, write each completed source's key once)
    monkeypatch.setattr(attnres_inference, "SDPA_TOKENS", 0)
    calls, merges, closed = [], [], []
    original, merge, close = mixing_attnres.inverse_rms, attnres_two_phase._merge_inference, mixing_attnres.close_source
    for module in (attnres_buffer, attnres_two_phase, mixing_attnres, ops_torch, ops_triton):  # every one calling it
        monkeypatch.setattr(module, "inverse_rms", lambda x, eps: calls.append(x.shape) or original(x, eps))
    # (patched where the router looks them up)
    monkeypatch.setattr(mixing_attnres, "_merge_inference", lambda *a: merges.append(1) or merge(*a))
    monkeypatch.setattr(mixing_attnres, "close_source", lambda *a: closed.append(1) or close(*a))
    model = tiny_model(attnres_block_size=2, num_hidden_layers=4)
    with torch.no_grad():
        model(input_ids)
        # without depth weights (`attnres_inference.py`): each completed source's scale once, when it is closed, 1
        # (embedding) + 3 block closures (blocks 1-3; block 4 stays partial); each router with a partial source
        # takes its norm in `_merge_inference`: the MLP router of each layer and the final router
        assert len(closed) == 1 + 3 and not calls and len(merges) == 4 + 1
        calls.clear(), merges.clear(), closed.clear()
        # with depth weights: the completed sources' statistics once each (`inverse_rms`), the final router's partial
        # sum's too; the merges take their partial sum's norm in `_merge_partial`
        model(input_ids, output_depth_weights=True)
        assert len(calls) == 1 + 3 + 1 and not merges and not closed
