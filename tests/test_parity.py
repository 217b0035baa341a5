"""`depth_mixing="residual"` is the backbone itself: same weights, same logits as transformers' models."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from attnres_hf import AttnResConfig, AttnResForCausalLM
from utils import TINY

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama-gqa-llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE), {}),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True), {}),
    "llama-bias": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True), {}),
    "mistral-sliding": (MistralConfig, MistralForCausalLM, dict(sliding_window=4), {}),
    "qwen2-qkv-bias": (Qwen2Config, Qwen2ForCausalLM, {}, dict(attention_bias=True, attention_out_bias=False)),
    "qwen2-sliding": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
                      dict(attention_bias=True, attention_out_bias=False, sliding_window=4,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    "qwen3-qk-norm": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16), dict(use_qk_norm=True)),
}


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_residual_equals_transformers_model(case, attn_implementation):
    config_class, model_class, source_overrides, our_overrides = CASES[case]
    torch.manual_seed(0)
    source_config = config_class(**{**TINY, **source_overrides}, attn_implementation=attn_implementation)
    source = model_class(source_config).eval()
    with torch.no_grad():  # make biases and norm weights non-trivial so that a dropped one shows
        for name, param in source.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)

    fields = {k: getattr(source_config, k) for k in TINY if k != "vocab_size"} | {"vocab_size": TINY["vocab_size"]}
    fields |= {k: getattr(source_config, k, None) for k in ("head_dim", "rope_parameters", "rms_norm_eps", "tie_word_embeddings")}
    fields |= {k: v for k, v in source_overrides.items() if k in ("attention_bias", "mlp_bias", "sliding_window")}
    config = AttnResConfig(**(fields | our_overrides), depth_mixing="residual", attn_implementation=attn_implementation)
    ours = AttnResForCausalLM(config).eval()
    missing, unexpected = ours.load_state_dict(source.state_dict(), strict=True)
    assert not missing and not unexpected

    input_ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    with torch.no_grad():
        expected = source(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        actual = ours(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-5, rtol=0)
    assert len(actual.hidden_states) == len(expected.hidden_states)
    for ours_state, theirs in zip(actual.hidden_states, expected.hidden_states):
        torch.testing.assert_close(ours_state, theirs, atol=1e-5, rtol=0)


def test_residual_mode_has_exactly_llamas_parameters():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY))
    ours = AttnResForCausalLM(AttnResConfig(**TINY, depth_mixing="residual"))
    assert set(ours.state_dict()) == set(llama.state_dict())
