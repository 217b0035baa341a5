"""Retrofit: a converted model computes the source's logits (zero queries + RMSNorm scale invariance)."""

import importlib
import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig
from transformers import MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from attnres_hf import AttnResForCausalLM
from attnres_hf.conversion import UnsupportedSourceError, retrofit
from utils import TINY

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SOURCES = {
    "llama-gqa-llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "mistral-sliding": (MistralConfig, MistralForCausalLM, dict(sliding_window=6)),
    "qwen2-qkv-bias": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3-qk-norm": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
}


def make_source(name, tie, seed=0, **extra):
    config_class, model_class, overrides = SOURCES[name]
    torch.manual_seed(seed)
    source = model_class(config_class(**TINY, **overrides, tie_word_embeddings=tie, **extra)).eval()
    with torch.no_grad():  # non-trivial biases and norms, so that a dropped one shows
        for key, param in source.named_parameters():
            if key.endswith("bias") or "norm" in key:
                param.normal_(1.0 if "norm" in key else 0.0, 0.2)
    return source


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4"])
@pytest.mark.parametrize("name", list(SOURCES))
def test_retrofit_reproduces_the_source_logits(name, block_size, tie):
    source = make_source(name, tie)
    model = retrofit(source, attnres_block_size=block_size)
    assert isinstance(model, AttnResForCausalLM) and model.config.tie_word_embeddings == tie
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if n.endswith(".query"))
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        delta = (model(input_ids).logits - source(input_ids).logits).abs().max().item()
    assert delta <= 1e-5, delta


def test_plain_mean_is_the_papers_formulation_and_differs_only_by_eps():
    source = make_source("llama-gqa-llama3-rope", tie=False, rms_norm_eps=1e-6)
    mean = retrofit(source, attnres_block_size=2, attnres_rescale_output=False)
    assert mean.config.attnres_rescale_output is False
    input_ids = torch.randint(3, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        delta = (mean(input_ids).logits - source(input_ids).logits).abs().max().item()
    assert 0 < delta < 1e-2  # an eps effect, not a different function


def test_residual_retrofit_and_config_carry_over():
    source = make_source("qwen2-qkv-bias", tie=False)
    model = retrofit(source, depth_mixing="residual", dtype=torch.float64)
    config = model.config
    assert config.depth_mixing == "residual" and model.dtype == torch.float64
    assert type(config.backbone) is type(source.config)  # the source's own config class: bias on q/k/v, not o_proj
    assert config.rms_norm_eps == source.config.rms_norm_eps and config.num_key_value_heads == 2
    assert torch.equal(model.model.layers[1].self_attn.q_proj.bias, source.model.layers[1].self_attn.q_proj.bias.double())


def test_unsupported_family_is_refused_naming_it():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4))  # mixtral is supported now
    with pytest.raises(UnsupportedSourceError, match="unsupported model_type 'gpt2'"):
        retrofit(gpt2)


def test_unmapped_source_key_is_an_error_naming_it():
    source = make_source("llama-gqa-llama3-rope", tie=False)
    source.model.layers[0].register_parameter("extra_scale", torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(KeyError, match=r"model\.layers\.0\.extra_scale"):
        retrofit(source)


FAMILY = {
    "delta-attnres": {"depth_mixing": "delta_attnres"},
    "delta-attnres-full": {"depth_mixing": "delta_attnres", "attnres_block_size": 1},
    "denseformer": {"depth_mixing": "denseformer"},
    "denseformer-k2-p2": {"depth_mixing": "denseformer", "denseformer_dilation": 2, "denseformer_period": 2},
    "muddformer": {"depth_mixing": "muddformer"},
    "dca": {"depth_mixing": "dca"},
    "mhc": {"depth_mixing": "mhc"},
    "attnres-sigmoid": {"attnres_score_fn": "sigmoid"},
    "attnres-no-key-norm": {"attnres_key_norm": False},
    "attnres-input-query": {"attnres_query": "input_dependent"},
    "attnres-heads4": {"attnres_num_heads": 4},
    "attnres-scalar": {"attnres_scalar_weights": True},
}


@pytest.mark.parametrize("name", ["llama-gqa-llama3-rope", "qwen3-qk-norm"])
@pytest.mark.parametrize("method", list(FAMILY))
def test_every_family_method_retrofits_exactly(method, name):
    source = make_source(name, tie=True)
    model = retrofit(source, **FAMILY[method])
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        delta = (model(input_ids).logits - source(input_ids).logits).abs().max().item()
    assert delta <= 1e-5, delta


def test_a_sliding_depth_window_is_refused_since_it_cannot_be_exact():
    with pytest.raises(ValueError, match="attnres_window drops all but the most recent sources"):
        retrofit(make_source("qwen2-qkv-bias", tie=False), attnres_window=2)


BAD_ARGUMENTS = {  # retrofit(source, **kwargs) -> (error type, what the one-line message says)
    "block-size-3": (dict(attnres_block_size=3), ValueError, "attnres_block_size must be 1 (Full AttnRes) or a positive even"),
    "block-size-0": (dict(attnres_block_size=0), ValueError, "attnres_block_size must be 1"),
    "block-size-str": (dict(attnres_block_size="2"), ValueError, "attnres_block_size must be one of the types (int, None), got '2'"),
    "block-size-bool": (dict(attnres_block_size=True), ValueError, "attnres_block_size must be one of the types (int, None), got True"),
    "misspelled-field": (dict(attnres_blok_size=2), ValueError, "did you mean 'attnres_block_size'"),
    "unknown-method": (dict(depth_mixing="hyper"), ValueError, "depth_mixing must be one of"),
    "dtype-name": (dict(dtype="float99"), ValueError, "dtype must be 'auto' or a floating point torch dtype"),
    "dtype-int": (dict(dtype=torch.int8), ValueError, "dtype must be 'auto' or a floating point torch dtype"),
    "dtype-float8": (dict(dtype=torch.float8_e4m3fn), ValueError, "is a float8 storage type"),
    "dtype-float8-name": (dict(dtype="float8_e5m2"), ValueError, "is a float8 storage type"),
    "progress-str": (dict(progress="yes"), TypeError, "progress must be True or False"),
    "gguf-file-for-a-model": (dict(gguf_file="x.gguf"), ValueError, "gguf_file applies to a source path"),
}


@pytest.mark.parametrize("kind", list(BAD_ARGUMENTS))
def test_bad_arguments_are_one_line_errors(kind):
    kwargs, error, says = BAD_ARGUMENTS[kind]
    with pytest.raises(error, match=re.escape(says)):
        retrofit(make_source("qwen2-qkv-bias", tie=False), **kwargs)


def _corrupt_config(folder):
    (folder / "config.json").write_text("{not json")


def _truncated_weights(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _no_weights(folder):
    (folder / "model.safetensors").unlink()


def _missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


BAD_FILES = {
    "missing-path": (None, FileNotFoundError, "does not exist"),
    "corrupt-config": (_corrupt_config, ValueError, "config.json is not valid JSON"),
    "truncated-weights": (_truncated_weights, ValueError, "is a truncated or corrupt safetensors file"),
    "no-weights": (_no_weights, FileNotFoundError, "has no model weights"),
    "missing-shard": (_missing_shard, FileNotFoundError, "lists model-00002-of-00002.safetensors, which is missing"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_files_are_refused_before_any_model_loads(kind, tmp_path, monkeypatch):
    damage, error, says = BAD_FILES[kind]
    folder = tmp_path / "source"
    if damage is not None:
        make_source("llama-gqa-llama3-rope", tie=False).save_pretrained(folder)
        damage(folder)
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(error, match=re.escape(says)):
        retrofit(folder)
    for source in (12, b"folder", ""):
        with pytest.raises(TypeError, match="source .* must be a non-empty path"):
            retrofit(source)
