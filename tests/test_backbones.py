"""Every backbone family of `BACKBONES`, at model-tester size: exact retrofit from the transformers model, every
depth-mixing method, cached generation, save/reload (native and remote code), flat (pre-backbone) configs."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.conversion import UnsupportedSourceError, retrofit
from attnres_hf.modeling.backbones import BACKBONES, KEY_VALUE_METHODS, KeyValueInputs
from attnres_hf.modeling.depth_mixing import DEPTH_MIXING, is_depth_mixing_parameter
from attnres_hf.modeling.mixing_base import registered_modules
from utils import METHODS, OTHER_PROCESS_ATOL, perturb_mixing

BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY_BACKBONES = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=4),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
    "qwen3": dict(head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "smollm3": dict(no_rope_layer_interval=2),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=4.0),
    "phi3": dict(),
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4, final_logit_softcapping=3.0,
                        layer_types=["sliding_attention", "full_attention"] * 2),
}
"""A tiny source config per family (the features that make it differ from Llama switched on)."""

FAMILIES = list(TINY_BACKBONES)
"""The dense families; the mixture-of-experts ones and Kimi Linear are tested in `test_backbones_moe.py`."""
IDS = torch.randint(3, 99, (2, 11), generator=torch.Generator().manual_seed(0))  # longer than the windows (4)


def test_every_family_has_a_tiny_config():
    from test_backbones_moe import SOURCES

    assert set(TINY_BACKBONES) | set(SOURCES) == set(BACKBONES) and not set(TINY_BACKBONES) & set(SOURCES)


def source_model(family: str, seed: int = 0):
    """The family's own transformers model, its norms moved off their initialisation (so that a norm applied in the
    wrong place, or missed, shows)."""
    adapter = BACKBONES[family]
    torch.manual_seed(seed)
    model = adapter.causal_lm(adapter.config_class(**BASE, **TINY_BACKBONES[family])).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


ATTNRES = {"block": {"attnres_block_size": 2}, "full": {"attnres_block_size": 1}}


@pytest.mark.parametrize("variant", list(ATTNRES))
@pytest.mark.parametrize("family", FAMILIES)
def test_retrofit_is_exact_with_the_family_parameter_names(family, variant):
    source = source_model(family)
    model = retrofit(source, **ATTNRES[variant])
    assert type(model.config.backbone) is type(source.config)
    names = set(model.state_dict())
    assert set(source.state_dict()) <= names  # identity: the family's own names
    assert all(is_depth_mixing_parameter(name) for name in names - set(source.state_dict()))
    assert (logits(model) - logits(source)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_retrofits_exactly_and_runs_trained_like(family, method):
    source = source_model(family)
    model = retrofit(source, **METHODS[method])
    reference = logits(source)
    assert (logits(model) - reference).abs().max().item() <= 1e-5
    if method != "residual":
        perturb_mixing(model)
        moved = logits(model)
        assert torch.isfinite(moved).all() and (moved - reference).abs().max().item() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(ATTNRES))
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_generation_equals_full_recompute(family, variant):
    model = retrofit(source_model(family), **ATTNRES[variant])
    perturb_mixing(model)
    prompt = IDS[:1, :5]
    # min_new_tokens: the retrofit stops at the source's EOS, as the source does; all 10 tokens are compared
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    recomputed = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape[1] == 15 and torch.equal(cached, recomputed)


REMOTE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.modules["attnres_hf"] = None  # only the checkpoints' own files may be used
    from transformers import AutoModelForCausalLM
    folders, ids = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2]))
    out = {}
    for family, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out[family] = model(ids).logits.tolist()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_save_and_reload_native_and_as_remote_code(tmp_path):
    """Every family, Block AttnRes with trained-like routers: native reload and remote code (without the package,
    one fresh process for all families) give identical logits."""
    folders, expected = {}, {}
    for family in FAMILIES:
        model = retrofit(source_model(family), attnres_block_size=2)
        perturb_mixing(model)
        folders[family] = str(tmp_path / family)
        model.save_pretrained(folders[family])
        expected[family] = logits(model)
        loaded = AutoModelForCausalLM.from_pretrained(folders[family]).eval()
        assert type(loaded) is AttnResForCausalLM and type(loaded.config.backbone) is type(model.config.backbone)
        torch.testing.assert_close(logits(loaded), expected[family], atol=0, rtol=0)
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, json.dumps(folders), json.dumps(IDS.tolist())],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    for family in FAMILIES:
        torch.testing.assert_close(torch.tensor(remote[family]), expected[family], atol=OTHER_PROCESS_ATOL, rtol=0)


FLAT = {  # flat (pre-backbone) AttnRes config fields -> the family they describe
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(attention_bias=True, attention_out_bias=False, sliding_window=4,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
    "qwen3": dict(use_qk_norm=True, head_dim=16),
    "mistral": dict(sliding_window=4),
}


@pytest.mark.parametrize("family", list(FLAT))
def test_a_flat_checkpoint_of_before_backbones_loads_with_its_logits(family, tmp_path):
    """A config.json as AttnRes wrote it before backbones (backbone fields at the top level, no `backbone`) loads as
    the family its fields describe, with identical logits."""
    model = AttnResForCausalLM(AttnResConfig(**BASE, **FLAT[family], attnres_block_size=2)).eval()
    assert model.config.backbone.model_type == family
    perturb_mixing(model)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    flat = {key: value for key, value in saved.items() if key != "backbone"} | BASE | FLAT[family]
    path.write_text(json.dumps(flat))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.backbone.model_type == family
    torch.testing.assert_close(logits(loaded), logits(model), atol=0, rtol=0)


def test_flat_configs_no_family_expresses_are_refused_naming_why():
    with pytest.raises(ValueError, match="Mistral layout"):
        AttnResConfig(**BASE, sliding_window=4, layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(ValueError, match="only the Qwen2 layout"):
        AttnResConfig(**BASE, attention_bias=False, attention_out_bias=True)
    with pytest.raises(ValueError, match="unsupported backbone model_type 'gpt2'"):  # mixtral is supported now
        AttnResConfig(backbone={"model_type": "gpt2"})


def test_backbone_by_model_type_with_flat_fields_and_assignment_through_the_config():
    config = AttnResConfig(backbone="gemma2", **BASE, head_dim=8, query_pre_attn_scalar=8)
    assert type(config.backbone).__name__ == "Gemma2Config" and config.hidden_size == 32
    config.final_logit_softcapping = 7.0  # a backbone field: assigned on the backbone
    assert config.backbone.final_logit_softcapping == 7.0 and "final_logit_softcapping" not in vars(config)
    with pytest.raises(ValueError, match="hidden_size must be int"):
        config.hidden_size = 32.0


def test_an_unsupported_setting_of_a_family_is_refused_naming_why():
    gemma3 = BACKBONES["gemma3_text"]
    source = gemma3.causal_lm(gemma3.config_class(**BASE, **TINY_BACKBONES["gemma3_text"],
                                                  use_bidirectional_attention=True))
    with pytest.raises(UnsupportedSourceError, match="use_bidirectional_attention=True"):
        retrofit(source)


def test_key_value_methods_are_the_methods_whose_attention_read_routes_keys_and_values():
    """`KEY_VALUE_METHODS` (which backbones without `key_value_inputs` refuse) matches what each state does."""
    routed = []
    for name, method in DEPTH_MIXING.items():
        config = AttnResConfig(**BASE, **METHODS[name])
        layer = AttnResForCausalLM(config).model.layers[0]
        state = method.state.start(torch.randn(1, 3, 32), config)
        if state.read_attn(registered_modules(layer, method.layer_modules)).key_value is not None:
            routed.append(name)
    assert tuple(routed) == KEY_VALUE_METHODS


def test_fused_qkv_routing_equals_separate_projections():
    """Phi-3's fused `qkv_proj` with separate key/value inputs computes what Llama's separate projections do with the
    same weights (the separate path is checked against a written-out attention in test_depth_family)."""
    torch.manual_seed(0)
    llama, phi3 = BACKBONES["llama"], BACKBONES["phi3"]
    llama_config, phi3_config = llama.config_class(**BASE), phi3.config_class(**BASE)
    for config in (llama_config, phi3_config):
        config._attn_implementation = "eager"
    separate, fused = llama.attention_class(llama_config, 0), phi3.attention_class(phi3_config, 0)
    with torch.no_grad():
        fused.qkv_proj.weight.copy_(torch.cat([separate.q_proj.weight, separate.k_proj.weight, separate.v_proj.weight]))
        fused.o_proj.weight.copy_(separate.o_proj.weight)
    query, key, value = torch.randn(3, 2, 5, 32).unbind(0)
    rope = llama.rotary(config=llama_config)(query, torch.arange(5)[None])
    outputs = []
    for adapter, config, attention in ((llama, llama_config, separate), (phi3, phi3_config, fused)):
        with adapter.key_value_inputs.routed(attention, config, key, value):
            outputs.append(attention(query, rope, None)[0])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-6, rtol=1e-5)
    plain = separate(query, rope, None)[0]
    assert (outputs[0] - plain).abs().max() > 1e-3  # the routed inputs were used
    assert isinstance(phi3.key_value_inputs, KeyValueInputs) and phi3.key_value_inputs.fused == "qkv_proj"


def test_the_docs_list_every_family():
    """docs/backbones.md has a row per family (GGUF column: exactly those with a GGUF layout), and the README's
    support table names every family."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    page = (root / "docs" / "backbones.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    assert set(BACKBONES) == rows - {"model_type"}  # the header names the column
    gguf = {line.split("|")[1].strip().strip("`") for line in page.splitlines()
            if line.startswith("| `") and line.rstrip(" |").endswith(("yes", "yes (as `llama`)"))}
    assert gguf == {name for name, adapter in BACKBONES.items() if adapter.gguf_architecture}
    (row,) = [line for line in (root / "README.md").read_text().splitlines() if line.startswith("| backbones")]
    named = set(re.findall(r"`(\w+)`", row.split("|")[2]))
    assert named == set(BACKBONES), named ^ set(BACKBONES)


KEY_VALUE_KINDS = list({BACKBONES[family].key_value_inputs: family for family in reversed(FAMILIES)}.values())
"""One family per kind of key/value routing (separate projections, fused q/k/v)."""


@pytest.mark.parametrize("family", KEY_VALUE_KINDS)
def test_gradient_checkpointing_keeps_the_gradients_with_routed_keys_and_values(family):
    """MUDDFormer routes separate k/v inputs through hooks set for the call; a checkpointed layer replays them."""
    model = retrofit(source_model(family), depth_mixing="muddformer")
    perturb_mixing(model)
    model.train()
    model.config.backbone.attention_dropout = 0.0
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(IDS, labels=IDS).loss.backward()
        grads.append({name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)
