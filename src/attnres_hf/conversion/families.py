"""Supported source families: one key table and one config mapping per `model_type`.

Parameter names of `AttnResForCausalLM` are Llama's, so every table maps a key to itself; the tables exist to
say exactly which keys a family may carry. A source key that no table entry matches is an error, never a silent
skip (the way litgpt's converters work). `{}` stands for a layer index.
"""

import re
from collections.abc import Callable

from transformers import PretrainedConfig

_BACKBONE = (
    "model.embed_tokens.weight",
    "model.layers.{}.self_attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight",
    "model.layers.{}.mlp.gate_proj.weight",
    "model.layers.{}.mlp.up_proj.weight",
    "model.layers.{}.mlp.down_proj.weight",
    "model.layers.{}.input_layernorm.weight",
    "model.layers.{}.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
)
_QKV_BIAS = tuple(f"model.layers.{{}}.self_attn.{p}_proj.bias" for p in "qkv")
_O_BIAS = ("model.layers.{}.self_attn.o_proj.bias",)
_MLP_BIAS = tuple(f"model.layers.{{}}.mlp.{p}_proj.bias" for p in ("gate", "up", "down"))
_QK_NORM = ("model.layers.{}.self_attn.q_norm.weight", "model.layers.{}.self_attn.k_norm.weight")

KEY_TABLES: dict[str, dict[str, str]] = {
    "llama": {k: k for k in _BACKBONE + _QKV_BIAS + _O_BIAS + _MLP_BIAS},
    "mistral": {k: k for k in _BACKBONE},
    "qwen2": {k: k for k in _BACKBONE + _QKV_BIAS},
    "qwen3": {k: k for k in _BACKBONE + _QKV_BIAS + _O_BIAS + _QK_NORM},
}
"""`model_type -> {source key pattern: AttnRes key pattern}`."""

_COMMON_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _llama(config: PretrainedConfig) -> dict:
    return {"attention_bias": config.attention_bias, "mlp_bias": getattr(config, "mlp_bias", False)}


def _mistral(config: PretrainedConfig) -> dict:
    return {"sliding_window": config.sliding_window}  # Mistral slides on every layer when a window is set


def _qwen_layers(config: PretrainedConfig) -> dict:
    # Qwen2/3 configs resolve `use_sliding_window` / `max_window_layers` into `sliding_window` and `layer_types`.
    return {"sliding_window": config.sliding_window, "layer_types": list(config.layer_types)}


def _qwen2(config: PretrainedConfig) -> dict:
    return {"attention_bias": True, "attention_out_bias": False, **_qwen_layers(config)}  # bias on q/k/v only


def _qwen3(config: PretrainedConfig) -> dict:
    return {"attention_bias": config.attention_bias, "use_qk_norm": True, **_qwen_layers(config)}


CONFIG_MAPPINGS: dict[str, Callable[[PretrainedConfig], dict]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
}
"""`model_type -> (source config -> AttnResConfig fields beyond the common Llama ones)`."""

SUPPORTED_MODEL_TYPES = tuple(KEY_TABLES)

GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""`model_type -> general.architecture` of its GGUF files (llama.cpp writes Mistral 7B as `llama`)."""

GGUF_PERMUTED_QK = frozenset({"llama"})
"""GGUF architectures whose q/k rows (weights and biases) llama.cpp stores interleaved per head for its rope."""

# Fields whose presence means the backbone cannot be expressed (mixture-of-experts layers and the like).
_UNSUPPORTED_FEATURES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class UnsupportedSourceError(ValueError):
    """The source checkpoint's family or one of its features has no AttnRes counterpart."""


def check_supported(config: PretrainedConfig) -> str:
    """Return `config.model_type` if it can be retrofitted, else raise `UnsupportedSourceError` saying why."""
    model_type = getattr(config, "model_type", None)
    if model_type not in KEY_TABLES:
        raise UnsupportedSourceError(
            f"unsupported model_type {model_type!r}: retrofit supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for feature in _UNSUPPORTED_FEATURES:
        if getattr(config, feature, None):
            raise UnsupportedSourceError(
                f"{model_type} config has {feature}={getattr(config, feature)!r}: mixture-of-experts layers are not "
                "supported by the AttnRes backbone"
            )
    return model_type


def attnres_config_fields(config: PretrainedConfig) -> dict:
    """AttnResConfig fields that reproduce `config`'s architecture (raises `UnsupportedSourceError`)."""
    model_type = check_supported(config)
    fields = {name: getattr(config, name) for name in _COMMON_FIELDS if hasattr(config, name)}
    fields["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return fields | CONFIG_MAPPINGS[model_type](config)


def map_keys(model_type: str, keys: list[str]) -> dict[str, str]:
    """Map source state-dict keys to AttnRes keys with the family's table.

    Raises:
        KeyError: naming every source key the table does not map.
    """
    table = KEY_TABLES[model_type]
    mapped, unmapped = {}, []
    for key in keys:
        pattern = re.sub(r"\.(\d+)\.", ".{}.", key, count=1)
        target = table.get(pattern)
        if target is None:
            unmapped.append(key)
            continue
        index = re.search(r"\.(\d+)\.", key)
        mapped[key] = target.format(index.group(1)) if index else target
    if unmapped:
        shown = ", ".join(unmapped[:8]) + (f" (+{len(unmapped) - 8} more)" if len(unmapped) > 8 else "")
        raise KeyError(f"{model_type} checkpoint has keys with no AttnRes counterpart: {shown}")
    return mapped
