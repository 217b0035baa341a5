"""Continuous batching (transformers' paged KV cache, `generate_batch` / `init_continuous_batching`) for every
`depth_mixing`: each request's greedy tokens equal a lone `generate` of it.

Continuous batching packs the requests of a step into one row of tokens and runs attention through the paged
`ALL_ATTENTION_FUNCTIONS` entries (`paged|sdpa`, `paged|eager`); depth mixing is per token, so it needs no state of
its own there.
"""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from attnres_hf.modeling.configuration_attnres import DEPTH_MIXING_METHODS
from utils import tiny_model

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [9] * 11, [20, 30]]
MAX_NEW_TOKENS = 8
# A small paged cache: the default sizes the cache from the machine's memory and takes ~30 s on CPU to set up.
CB_CONFIG = dict(page_size=16, num_blocks=16, max_batch_tokens=64)


def _generation_config():
    # No end of sequence: every request runs its MAX_NEW_TOKENS, so whole sequences are compared.
    return GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _lone_generate(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return model.generate(ids, generation_config=_generation_config())[0, ids.shape[1] :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [{"depth_mixing": method} for method in DEPTH_MIXING_METHODS]
    + [
        {"depth_mixing": "attnres", "attnres_block_size": 1},
        {"depth_mixing": "attnres", "sliding_window": 4, "use_qk_norm": True, "attention_bias": True},
        {"depth_mixing": "attnres", "attn_implementation": "eager"},
    ],
    ids=[*DEPTH_MIXING_METHODS, "full-attnres", "sliding-qk-norm-bias", "attnres-eager"],
)
def test_generate_batch_equals_lone_generate(overrides):
    overrides = {"attn_implementation": "sdpa", **overrides}
    model = tiny_model(seed=1, **overrides)
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=_generation_config(),
        continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG),
    )
    assert len(outputs) == len(PROMPTS)
    by_prompt = {tuple(out.prompt_ids): out.generated_tokens for out in outputs.values()}
    for prompt in PROMPTS:
        assert by_prompt[tuple(prompt)] == _lone_generate(model, prompt), prompt
    assert model.config._attn_implementation == overrides["attn_implementation"]  # restored after the paged run


def test_manager_streams_requests_added_while_running():
    """`init_continuous_batching`: requests added one by one to a running manager come back whole and right."""
    model = tiny_model(seed=2)
    manager = model.init_continuous_batching(
        generation_config=_generation_config(), continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG)
    )
    manager.start()
    try:
        request_ids = [manager.add_request(prompt, max_new_tokens=MAX_NEW_TOKENS) for prompt in PROMPTS]
        results = {}
        for _ in request_ids:
            result = manager.get_result(timeout=60)
            assert result is not None, "no result within 60 s"
            results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=30)
    for request_id, prompt in zip(request_ids, PROMPTS):
        assert results[request_id].generated_tokens == _lone_generate(model, prompt)
