"""GGUF sources of the mixture-of-experts, Phi-3 and Gemma families (`attnres convert file.gguf`).

Each tiny file is written as llama.cpp's `convert_hf_to_gguf.py` writes the family (`gguf_fixtures.write_gguf`:
stacked `ffn_{gate,up,down}_exps` experts, a 1-D shared-expert gate, fused `attn_qkv` / `ffn_up`, Gemma's norms as
`1 + w`, each converter's metadata keys). Each source switches on the fields transformers' GGUF config mapping
drops for that family, with values other than transformers' defaults, so that a dropped field shows: the expert
widths and dense layers (Qwen-MoE), the sliding window and partial rotary (Phi-3), soft-capping and the attention
scale (Gemma2), final soft-capping, linear rope scaling and a global-only file (Gemma3).
"""

import importlib
import re

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
from transformers import Phi3Config, Phi3ForCausalLM
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM

from attnres_hf.conversion import check_against_gguf, load_source_config, retrofit
from attnres_hf.conversion.retrofit import load_source
from gguf_fixtures import write_gguf
from test_convert import _bad_input_error, _report, run_cli

COMMON = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
GEMMA = dict(intermediate_size=48, head_dim=8, query_pre_attn_scalar=8, sliding_window=4)  # llama.cpp's scale: head_dim

SOURCES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=16,
        norm_topk_prob=True)),  # llama.cpp's qwen3moe normalises the top-k weights; it has no dense layers
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(
        intermediate_size=48, sliding_window=5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(**GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, dict(  # llama.cpp: every 6th layer global, scaled rope
        **GEMMA, num_hidden_layers=6, final_logit_softcapping=3.0,
        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)))),
    "gemma3_text-global": (Gemma3TextConfig, Gemma3ForCausalLM, dict(  # no sliding layers: the file holds no window
        **GEMMA, layer_types=["full_attention"] * 2)),
}
"""A tiny source per GGUF kind (name -> config class, causal LM, config): 2 layers (Gemma3: 6), hidden 32."""

IDS = torch.randint(3, 99, (2, 11), generator=torch.Generator().manual_seed(0))  # longer than the windows (4, 5)


def source_model(name: str, **overrides) -> torch.nn.Module:
    config_class, model_class, extra = SOURCES[name]
    torch.manual_seed(0)
    model = model_class(config_class(**{**COMMON, **extra, **overrides})).eval()
    with torch.no_grad():  # norms away from their init, so that a wrong +1 or a dropped norm shows
        for name_, param in model.named_parameters():
            if "norm" in name_:
                param.normal_(0.0 if "gemma" in model.config.model_type else 1.0, 0.2)
    return model


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name", list(SOURCES))
def test_gguf_family_converts_exactly(name, tmp_path):
    """`attnres convert file.gguf`: the AttnRes model's logits equal those of the model transformers' GGUF loader
    builds with the config completed from the file (and the HF original's), every weight equals the file's tensor."""
    source = source_model(name)
    gguf_path = write_gguf(source, tmp_path / f"tiny-{name}.gguf")
    assert run_cli(gguf_path, tmp_path / "out", "--block-size", "2") == 0
    verification = _report(tmp_path / "out")["verification"]
    assert verification["greedy_match"] and verification["max_abs_logit_delta"] <= 1e-5, verification
    tied = source.config.tie_word_embeddings
    assert verification["gguf_tensors"] == len(source.state_dict()) - tied  # a sample of them compared by default
    assert 0 < verification["gguf_tensors_checked"] <= verification["gguf_tensors"]
    assert verification["gguf_max_abs_delta"] == 0.0

    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    gguf_loaded = load_source(gguf_path)  # transformers' own GGUF loader, config completed from the file
    assert (logits(converted) - logits(gguf_loaded)).abs().max().item() <= 1e-5
    assert (logits(converted) - logits(source)).abs().max().item() <= 1e-5  # llama.cpp's file kept the model


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "phi3", "gemma2", "gemma3_text", "gemma3_text-global"])
def test_transformers_gguf_mapping_alone_builds_another_model(name, tmp_path):
    """Without the fields read from the file, transformers' GGUF loader fails or builds a model with other logits:
    what `gguf_config_fields` reads is what makes the conversion exact."""
    source = source_model(name)
    write_gguf(source, tmp_path / "tiny.gguf")
    try:
        plain = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    except (RuntimeError, ValueError):  # e.g. expert weights of another width than its default config's
        return
    assert (logits(plain) - logits(source)).abs().max().item() > 1e-3


FIELDS = [  # (source, config overrides, fields read back from its file)
    ("qwen3_moe", {}, dict(moe_intermediate_size=16, head_dim=16)),
    ("qwen2_moe", {}, dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, qkv_bias=True)),
    ("qwen2_moe", dict(qkv_bias=False), dict(qkv_bias=False)),
    ("phi3", {}, dict(sliding_window=5)),
    ("phi3", dict(sliding_window=None), dict(sliding_window=None)),  # llama.cpp writes 0
    ("gemma2", {}, dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=8)),
    ("gemma3_text", {}, dict(final_logit_softcapping=3.0, query_pre_attn_scalar=8, sliding_window=4)),
    ("gemma3_text-global", {}, dict(layer_types=["full_attention"] * 2, query_pre_attn_scalar=8)),
]


@pytest.mark.parametrize("name, overrides, fields", FIELDS)
def test_fields_read_from_the_file(name, overrides, fields, tmp_path):
    """What each kind's file holds and transformers' GGUF mapping drops, read back into the source config."""
    config = load_source_config(write_gguf(source_model(name, **overrides), tmp_path / "tiny.gguf"))
    assert {key: getattr(config, key) for key in fields} == fields
    if name == "phi3":
        assert config.rope_parameters["partial_rotary_factor"] == 0.5  # rope.dimension_count 4 of head_dim 8
    if name == "gemma3_text":  # linear scaling on the global layers only, as llama.cpp applies it
        assert config.rope_parameters["full_attention"] | {"rope_theta": None} == dict(
            rope_type="linear", factor=4.0, rope_theta=None)
        assert config.rope_parameters["sliding_attention"]["rope_type"] == "default"


@pytest.mark.parametrize("name, depth_27b", [("gemma2", 46), ("gemma3_text-global", 62)])
def test_gemma_27b_attention_scale_is_llama_cpps(name, depth_27b, tmp_path):
    """A GGUF file holds no `query_pre_attn_scalar`; llama.cpp derives it: hidden / heads at Gemma 27B's layer
    count, else head_dim (transformers' loader leaves its default, 256)."""
    from types import SimpleNamespace

    from attnres_hf.conversion import gguf_config_fields

    path = write_gguf(source_model(name), tmp_path / "g.gguf")
    header = source_model(name).config.to_dict()  # head_dim 8, 4 heads; only the header is read

    def scalar(**shape):
        return gguf_config_fields(path, SimpleNamespace(**{**header, **shape}))["query_pre_attn_scalar"]

    assert scalar(num_hidden_layers=depth_27b, hidden_size=48) == 48 // 4
    assert scalar(num_hidden_layers=depth_27b - 4, hidden_size=48) == 8


def test_q8_0_moe_gguf_holds_the_files_dequantised_experts(tmp_path):
    """A Q8_0 Qwen3-MoE file: each half of every `gate_up_proj` and every `down_proj` is the file's dequantised
    expert tensor, bit for bit; the retrofit equals transformers' GGUF-loaded model."""
    source = source_model("qwen3_moe", moe_intermediate_size=32)  # rows of whole Q8_0 blocks (32 values)
    gguf_path = write_gguf(source, tmp_path / "q8.gguf", "Q8_0")
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    assert {tensors[f"blk.1.ffn_{w}_exps.weight"].tensor_type.name for w in ("gate", "up", "down")} == {"Q8_0"}
    model = retrofit(gguf_path, attnres_block_size=2)
    state = model.state_dict()

    def dequantised(name):
        return torch.tensor(gguf.dequantize(tensors[name].data, tensors[name].tensor_type))

    gate, up = state["model.layers.1.mlp.experts.gate_up_proj"].chunk(2, dim=1)
    torch.testing.assert_close(gate, dequantised("blk.1.ffn_gate_exps.weight"), atol=0, rtol=0)
    torch.testing.assert_close(up, dequantised("blk.1.ffn_up_exps.weight"), atol=0, rtol=0)
    torch.testing.assert_close(state["model.layers.1.mlp.experts.down_proj"], dequantised("blk.1.ffn_down_exps.weight"),
                               atol=0, rtol=0)
    config = load_source_config(gguf_path)
    checked = len(source.state_dict()) - source.config.tie_word_embeddings
    assert check_against_gguf(model, gguf_path, config) == {"gguf_tensors_checked": checked, "gguf_tensors": checked,
                                                            "gguf_max_abs_delta": 0.0}
    assert (logits(model) - logits(load_source(gguf_path))).abs().max().item() <= 1e-5
    assert (logits(model) - logits(source)).abs().max().item() < 0.05  # the 8-bit rounding, nothing dropped


def test_an_altered_expert_half_is_caught_against_the_file(tmp_path):
    gguf_path = write_gguf(source_model("qwen2_moe"), tmp_path / "moe.gguf")
    model, config = retrofit(gguf_path), load_source_config(gguf_path)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[2, -1, 0] += 1e-3  # the up half's last row
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj differs from tensor "
                                         r"blk\.1\.ffn_up_exps\.weight"):
        check_against_gguf(model, gguf_path, config)


BAD_FILES = {  # kind -> (source, write_gguf arguments, what the one-line error says)
    "moe-expert-missing": ("qwen3_moe", dict(drop=("blk.1.ffn_up_exps.weight",)),
                           "holds no tensor for the qwen3_moe model's model.layers.1.mlp.experts.gate_up_proj "
                           "(blk.1.ffn_up_exps.weight)"),
    "moe-down-missing": ("qwen2_moe", dict(drop=("blk.0.ffn_down_exps.weight",)),
                         "holds no tensor for the qwen2_moe model's model.layers.0.mlp.experts.down_proj "
                         "(blk.0.ffn_down_exps.weight)"),
    "shared-expert-missing": ("qwen2_moe", dict(drop=("blk.1.ffn_gate_inp_shexp.weight",)),
                              "model.layers.1.mlp.shared_expert_gate.weight (blk.1.ffn_gate_inp_shexp.weight)"),
    "router-in-a-dense-family": ("gemma2", dict(extra_tensors={"blk.0.ffn_gate_inp.weight": np.ones((4, 32),
                                                                                                  np.float32)}),
                                 "has tensors the conversion would drop (no gemma2 parameter holds them): "
                                 "blk.0.ffn_gate_inp.weight"),
    "phi3-long-rope": ("phi3", dict(extra_tensors={"rope_factors_long.weight": np.ones(2, np.float32),
                                                   "rope_factors_short.weight": np.ones(2, np.float32)}),
                       "has tensors the conversion would drop (rope frequency factors"),
    "gemma3-yarn-rope": ("gemma3_text-global", dict(metadata={"gemma3.rope.scaling.type": "yarn",
                                                              "gemma3.rope.scaling.factor": 8.0}),
                         "declares 'yarn' rope scaling, which transformers' GGUF loader ignores"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_a_bad_family_gguf_is_refused_before_loading(kind, tmp_path, capsys, monkeypatch):
    name, arguments, says = BAD_FILES[kind]
    gguf_path = write_gguf(source_model(name), tmp_path / "bad.gguf", **arguments)
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights were loaded"))
    error = _bad_input_error(capsys, gguf_path, tmp_path / "out")
    assert "bad.gguf" in error and says in error, error
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=re.escape(says)):
        retrofit(gguf_path)


def test_a_mixtral_gguf_is_refused_naming_its_experts(tmp_path, capsys):
    """llama.cpp writes Mixtral as `llama` with expert tensors; transformers' GGUF loader reads it as a dense Llama
    and would drop the experts, so the conversion stops, naming them."""
    torch.manual_seed(0)
    source = MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                              num_experts_per_tok=2, sliding_window=None)).eval()
    gguf_path = write_gguf(source, tmp_path / "mixtral.gguf")
    assert gguf.GGUFReader(gguf_path).fields["general.architecture"].contents() == "llama"
    error = _bad_input_error(capsys, gguf_path, tmp_path / "out")
    assert "has tensors the conversion would drop (no llama parameter holds them): " in error
    assert "blk.0.ffn_gate_inp.weight" in error and "blk.0.ffn_gate_exps.weight" in error, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, key", [("qwen2_moe", "expert_used_count"), ("qwen3_moe", "expert_used_count"),
                                       ("qwen2_moe", "expert_count")])
def test_an_moe_gguf_without_its_expert_counts_is_refused(name, key, tmp_path, capsys, monkeypatch):
    """Without `<arch>.expert_used_count` transformers' loader falls back to its config default (Qwen2-MoE: top 4),
    and its own GGUF-loaded model routes the same wrong way, so the exactness check alone would pass (found: max
    |Δ logits| 6e-7 against that model, 0.18 against the original); without `expert_count` it fails on shapes. Both
    are refused before loading, naming the key."""
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, f"add_{key}", lambda *a, **k: None)
    gguf_path = write_gguf(source_model(name), tmp_path / "bad.gguf")
    monkeypatch.undo()
    retrofit_module = importlib.import_module("attnres_hf.conversion.retrofit")
    monkeypatch.setattr(retrofit_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights were loaded"))
    says = f"has expert tensors but no {name.replace('_', '')}.{key}"
    error = _bad_input_error(capsys, gguf_path, tmp_path / "out")
    assert says in error, error
    assert not (tmp_path / "out").exists()
