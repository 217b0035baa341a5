"""Generation with the standard KV cache: AttnRes needs no cache of its own (routing is per token)."""

import pytest
import torch
from transformers import DynamicCache

from utils import VARIANTS, tiny_model, variant_model

MODELS = {
    **VARIANTS,  # every method of the family and AttnRes under every knob, mixing parameters trained-like
    "attnres-full": dict(attnres_block_size=1),
    "attnres-full-window2": dict(attnres_block_size=1, attnres_window=2),
    "qwen-like": dict(attnres_block_size=2, sliding_window=4, use_qk_norm=True, attention_bias=True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_incremental_decoding_and_generate_equal_a_full_recompute(name, input_ids):
    model = variant_model(MODELS[name])
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        prefix = model(input_ids[:, :6], cache=cache, use_cache=True)
        steps = [prefix.logits]
        for position in range(6, input_ids.shape[1]):
            out = model(input_ids[:, position:position + 1], cache=prefix.cache, use_cache=True)
            assert out.cache is cache and cache.get_seq_length() == position + 1
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    generated = model.generate(input_ids[:1], max_new_tokens=5, min_new_tokens=5, do_sample=False)
    recomputed = model.generate(input_ids[:1], max_new_tokens=5, min_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(generated, recomputed)


def test_past_key_values_is_accepted_as_the_former_name_of_cache(input_ids):
    model = tiny_model()
    with torch.no_grad():
        first = model(input_ids[:, :-1], use_cache=True)
        with pytest.warns(FutureWarning):
            step = model(input_ids[:, -1:], past_key_values=first.cache, use_cache=True)
        full = model(input_ids).logits
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_generate_reuses_the_cache_and_matches_a_recompute(attn_implementation, input_ids):
    model = tiny_model(attn_implementation=attn_implementation)
    seen_lengths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen_lengths.append(out.shape[1]))
    cached = model.generate(input_ids[:1], max_new_tokens=8, do_sample=False, min_new_tokens=8)
    hook.remove()
    # Prefill once, then one token per step: the cache is read, not recomputed.
    assert seen_lengths == [input_ids.shape[1]] + [1] * 7
    recomputed = model.generate(input_ids[:1], max_new_tokens=8, do_sample=False, min_new_tokens=8, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    model = tiny_model(attnres_block_size=2)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 99, (length,), generator=generator) for length in (9, 5, 7)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = prompt
        attention_mask[row, width - len(prompt):] = 1
    batched = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                             min_new_tokens=6, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0)
        assert torch.equal(batched[row, width:], alone[0, len(prompt):])


def test_sampling_is_reproducible_with_a_seed(input_ids):
    model = tiny_model()
    torch.manual_seed(7)
    first = model.generate(input_ids, do_sample=True, top_k=20, max_new_tokens=5, min_new_tokens=5)
    torch.manual_seed(7)
    second = model.generate(input_ids, do_sample=True, top_k=20, max_new_tokens=5, min_new_tokens=5)
    assert first.shape == (2, input_ids.shape[1] + 5) and torch.equal(first, second)


def test_generate_from_inputs_embeds_matches_input_ids(input_ids):
    model = tiny_model()
    embeds = model.get_input_embeddings()(input_ids[:1])
    from_ids = model.generate(input_ids[:1], max_new_tokens=5, do_sample=False, min_new_tokens=5)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert torch.equal(from_embeds[0], from_ids[0, input_ids.shape[1]:])
