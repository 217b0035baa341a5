import re

import pytest

from attnres_hf import AttnResConfig, default_attnres_block_size
from attnres_hf.modeling.configuration_attnres import DEPTH_MIXING_METHODS, _AttnResConfigFields
from utils import tiny_config


@pytest.mark.parametrize(
    "overrides, rule",
    [
        pytest.param(dict(attnres_block_size=3), "attnres_block_size must be 1 (Full AttnRes) or a positive even", id="block-size-3"),
        pytest.param(dict(attnres_block_size=0), "attnres_block_size must be 1", id="block-size-0"),
        pytest.param(dict(attnres_block_size=-2), "attnres_block_size must be 1", id="block-size-negative"),
        pytest.param(dict(num_key_value_heads=8), "num_key_value_heads (8) must not exceed num_attention_heads (4)", id="more-kv-heads"),
        pytest.param(dict(num_key_value_heads=3), "must be a multiple of num_key_value_heads", id="kv-heads-not-dividing"),
        pytest.param(dict(depth_mixing="hyper"), f"depth_mixing must be one of {DEPTH_MIXING_METHODS}, got hyper",
                     id="unknown-depth-mixing"),
        pytest.param(dict(hidden_size=30), "not a multiple of the number of attention heads", id="hidden-not-divisible"),  # LlamaConfig's rule
        pytest.param(dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive finite number", id="negative-eps"),
        pytest.param(dict(layer_types=["full_attention"]), "one entry per layer", id="layer-types-length"),
        pytest.param(dict(layer_types=["sliding_attention"] * 3), "sliding_window must be set", id="sliding-without-window"),
        pytest.param(dict(sliding_window=-1), "sliding_window must be a positive number", id="negative-window"),
        pytest.param(dict(head_dim=0), "head_dim must be a positive even integer", id="head-dim-0"),
        pytest.param(dict(hidden_act="nonsense"), "hidden_act must be one of", id="unknown-activation"),
        pytest.param(dict(rope_parameters={"rope_type": "nonsense", "rope_theta": 1e4}), "rope_type", id="unknown-rope"),
    ],
)
def test_bad_config_raises_value_error_naming_the_rule(overrides, rule):
    with pytest.raises(ValueError) as error:
        tiny_config(**overrides)
    assert rule in str(error.value)


@pytest.mark.parametrize("layers, size, blocks", [(30, 8, 8), (32, 8, 8), (2, 2, 2), (12, 4, 6), (64, 16, 8)])
def test_default_block_size_gives_about_eight_blocks(layers, size, blocks):
    config = AttnResConfig(num_hidden_layers=layers)
    assert config.attnres_block_size == default_attnres_block_size(layers) == size
    assert config.num_attnres_blocks == blocks


def test_config_round_trip_and_derived_fields(tmp_path):
    """A flat config with Qwen3's q/k norm becomes a Qwen3 backbone (the flat config's meaning: every layer slides
    when a window is set, head_dim = hidden / heads); the backbone is saved nested and read back as Qwen3Config."""
    config = tiny_config(attnres_block_size=4, attention_bias=True, use_qk_norm=True, sliding_window=5)
    assert config.backbone.model_type == "qwen3" and config.head_dim == 8 and config.attention_bias is True
    assert config.layer_types == ["sliding_attention"] * 3
    config.save_pretrained(tmp_path)
    loaded = AttnResConfig.from_pretrained(tmp_path)
    for key in ("attnres_block_size", "depth_mixing", "sliding_window", "layer_types", "head_dim", "attention_bias"):
        assert getattr(loaded, key) == getattr(config, key)
    assert loaded.model_type == "attnres" and type(loaded.backbone) is type(config.backbone)


def test_full_attnres_and_rope_scaling_are_accepted():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = tiny_config(attnres_block_size=1, rope_parameters=rope)
    assert config.num_attnres_blocks == 6
    assert config.rope_parameters["rope_type"] == "llama3"


def test_rules_are_checked_again_when_a_model_is_built(tmp_path):
    from attnres_hf import AttnResForCausalLM

    config = tiny_config()
    config.attnres_block_size = 5
    with pytest.raises(ValueError, match="attnres_block_size must be 1"):
        AttnResForCausalLM(config)
    AttnResForCausalLM(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attnres_block_size must be 1"):
        AttnResForCausalLM.from_pretrained(tmp_path, attnres_block_size=3)


@pytest.mark.parametrize("name, value, rule", [
    ("attnres_num_heads", 0, "attnres_num_heads must be greater or equal to 1, got 0"),
    ("depth_mixing", "hyper", "depth_mixing must be one of"),
    ("attnres_score_fn", "tanh", "attnres_score_fn must be one of ('softmax', 'sigmoid'), got tanh"),
    ("hidden_size", 32.0, "hidden_size must be int, got float"),
])
def test_declared_field_rules_hold_at_construction_assignment_and_loading(name, value, rule, tmp_path):
    """Types, choices and ranges are declared on the fields (huggingface_hub `@strict`, as `LlamaConfig`) and every
    way a value arrives reports the rule as a one-line `ValueError`."""
    with pytest.raises(ValueError) as error:
        tiny_config(**{name: value})
    assert rule in str(error.value) and "\n" not in str(error.value)
    config = tiny_config()
    with pytest.raises(ValueError, match=re.escape(rule)):
        setattr(config, name, value)
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(rule)):
        AttnResConfig.from_pretrained(tmp_path, **{name: value})


@pytest.mark.parametrize("name, value, rule", [
    ("head_dim", 8.0, "head_dim must be one of the types (int, None), got 8.0"),
    ("attnres_window", True, "attnres_window must be one of the types (int, None), got True"),
    ("sliding_window", 4.0, "sliding_window must be one of the types (int, None), got 4.0"),
    ("eos_token_id", "2", "eos_token_id must be one of the types (int, list[int], None), got '2'"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps must be float, got str (value: '1e-5')"),
    ("attention_dropout", True, "attention_dropout must be one of the types (int, float, None), got True"),
    ("backbone", [1], "backbone must be one of the types (dict, PreTrainedConfig, str, None), got [1]"),
])
def test_wrong_type_for_an_optional_or_union_field_names_the_types(name, value, rule):
    """A field declared as a union (`int | None`, ...) reports the accepted types in one short line, not
    huggingface_hub's "with value ... doesn't match any type in (<class 'int'>, ...). Errors: ..." dump. Backbone
    fields (all but `attnres_window` here) are typed by the family's config class (LlamaConfig for a flat config)."""
    with pytest.raises(ValueError) as error:
        tiny_config(**{name: value})
    assert str(error.value) == rule


@pytest.mark.parametrize("name, value", [
    ("num_hidden_layers", 0), ("num_attention_heads", 0), ("vocab_size", -3), ("intermediate_size", 0),
    ("hidden_size", -8), ("rms_norm_eps", 0.0), ("rms_norm_eps", float("inf")), ("rms_norm_eps", -1e-6),
])
def test_empty_or_negative_sizes_and_a_zero_norm_epsilon_are_refused(name, value, tmp_path):
    """Were accepted (a model of zero layers or a negative vocabulary, an RMSNorm that divides by zero) or failed
    inside the family's config class with a bare ZeroDivisionError (`num_attention_heads=0`): now one `ValueError`
    naming the field, from a flat config, a nested backbone and a saved config.json alike."""
    import json

    with pytest.raises(ValueError, match=f"^{name} must be a positive"):
        tiny_config(**{name: value})
    with pytest.raises(ValueError, match=f"^{name} must be a positive"):
        AttnResConfig(backbone=tiny_config().backbone.to_dict() | {name: value})
    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved["backbone"][name] = value
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=f"^{name} must be a positive"):
        AttnResConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("backbone, rule", [
    (dict(model_type="qwen3_moe", num_experts=2, num_experts_per_tok=4), "num_experts_per_tok (4) must not exceed"),
    (dict(model_type="mixtral", num_local_experts=1), "num_experts_per_tok (2) must not exceed the number of experts"),
    (dict(model_type="qwen3_moe", moe_intermediate_size=0), "moe_intermediate_size must be a positive"),
    (dict(model_type="qwen2_moe", moe_intermediate_size=-4), "moe_intermediate_size must be a positive"),
    (dict(model_type="olmoe", num_experts_per_tok=0), "num_experts_per_tok must be a positive"),
    (dict(model_type="gemma2", query_pre_attn_scalar=0), "query_pre_attn_scalar must be a positive"),
    (dict(model_type="gemma2", final_logit_softcapping=0.0), "final_logit_softcapping=0 divides by zero"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=0), "attn_logit_softcapping=0 divides by zero"),
])
def test_expert_counts_and_gemma_scalars_that_cannot_run_are_refused(backbone, rule):
    """Were accepted and failed only in the forward (`selected index k out of range`, a negative dimension), at
    init (a bare ZeroDivisionError) or gave NaN logits (soft-capping by 0): now one `ValueError` at construction.
    Every family's transformers default config still builds (test_backbones)."""
    with pytest.raises(ValueError, match=re.escape(rule)):
        AttnResConfig(backbone=backbone)


@pytest.mark.parametrize("name, value", [("rms_norm_eps", 1), ("initializer_range", 0), ("attention_dropout", 0)])
def test_integer_valued_float_fields_in_a_saved_config_still_load(name, value, tmp_path):
    """A config.json with an integer for a float field (as written before `@strict`, or by hand) loads as before."""
    import json

    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {name: value}))
    assert getattr(AttnResConfig.from_pretrained(tmp_path), name) == value


@pytest.mark.parametrize("theta", ["x", None, 0, -1, float("nan"), True])
def test_non_positive_or_non_numeric_rope_theta_is_refused(theta):
    """Was accepted, then the model failed to build (`TypeError: ... 'str' and 'Tensor'`) or built with a
    meaningless rotary frequency (theta <= 0)."""
    with pytest.raises(ValueError, match=r"rope_theta\) must be a positive number"):
        tiny_config(rope_theta=theta)


def test_usual_rope_theta_values_are_accepted():
    assert tiny_config(rope_theta=10000).rope_parameters["rope_theta"] == 10000
    assert tiny_config(rope_theta=5e5).rope_parameters["rope_theta"] == 5e5
    assert tiny_config().rope_parameters["rope_theta"] > 0


def test_validate_and_save_after_a_bad_assignment_and_positional_arguments_raise_one_line_value_errors(tmp_path):
    """A cross-field rule broken by an assignment is reported by `validate()` and `save_pretrained` as the one-line
    `ValueError` of construction (was huggingface_hub's multi-line StrictDataclassClassValidationError, no
    ValueError); positional arguments name `AttnResConfig`, not the private fields class it subclasses."""
    config = tiny_config()
    config.attnres_block_size = 3
    rule = "attnres_block_size must be 1 (Full AttnRes) or a positive even number"
    for check in (config.validate, lambda: config.save_pretrained(tmp_path)):
        with pytest.raises(ValueError) as error:
            check()
        assert str(error.value).startswith(rule) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^AttnResConfig accepts only keyword arguments"):
        AttnResConfig(tiny_config().backbone)
    assert AttnResConfig.__init__.__qualname__ == "AttnResConfig.__init__"
    assert AttnResConfig.__init__.__annotations__ == _AttnResConfigFields.__init__.__annotations__
