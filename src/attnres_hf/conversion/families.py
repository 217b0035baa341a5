"""Supported source families, read from the backbone adapters (`attnres_hf.modeling.backbones.BACKBONES`).

An AttnRes model is built from the source family's own classes, so its backbone parameter names are the family's
and every source key maps to itself. The key table of a source is therefore derived, not written: the parameter
names of the AttnRes model its config builds (`backbone_keys`, on the meta device). A source key outside that table is
an error, never a silent skip (the way litgpt's converters work); so is a weight of the AttnRes backbone that the
source does not hold. The config mapping is the source config itself, nested as `AttnResConfig.backbone`.
"""

import copy
import functools
import json

import torch
from transformers import PretrainedConfig

from ..modeling.backbones import BACKBONES
from ..modeling.depth_mixing import is_depth_mixing_parameter

SUPPORTED_MODEL_TYPES = tuple(BACKBONES)
"""Source `model_type`s that retrofit and `attnres convert` accept (one per backbone adapter)."""

# The records as declared (`BACKBONES.immediate`): reading llama.cpp's layout of each family imports no family's
# modeling code. A record behind a loader (Kimi K3's, whose module imports fla) has no GGUF layout and is not read.
_GGUF_RECORDS = BACKBONES.immediate()

GGUF_ARCHITECTURES: dict[str, str] = {
    adapter.model_type: adapter.gguf_architecture for adapter in _GGUF_RECORDS if adapter.gguf_architecture
}
"""`model_type -> general.architecture` of its GGUF files (llama.cpp writes Mistral 7B as `llama`)."""

GGUF_PERMUTED_QK = frozenset(adapter.gguf_architecture for adapter in _GGUF_RECORDS if adapter.gguf_permuted_qk)
"""GGUF architectures whose q/k rows (weights and biases) llama.cpp stores interleaved per head for its rope."""

GGUF_NORM_OFFSETS: dict[str, float] = {
    adapter.gguf_architecture: adapter.gguf_norm_offset for adapter in _GGUF_RECORDS if adapter.gguf_norm_offset
}
"""GGUF architecture -> the constant llama.cpp adds to every `*norm.weight` (Gemma's `(1 + w)` norms: 1)."""


class UnsupportedSourceError(ValueError):
    """The source checkpoint's family or one of its features has no AttnRes counterpart."""


def check_supported(config: PretrainedConfig) -> str:
    """Return `config.model_type` if it can be retrofitted, else raise `UnsupportedSourceError` saying why (an
    unsupported family, or a setting its adapter refuses)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BACKBONES:
        raise UnsupportedSourceError(
            f"unsupported model_type {model_type!r}: retrofit supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        BACKBONES.declared(model_type).check_config(config)
    except ValueError as error:
        raise UnsupportedSourceError(str(error)) from None
    return model_type


def attnres_config_fields(config: PretrainedConfig) -> dict:
    """AttnResConfig fields that reproduce `config`'s architecture: the config itself as the backbone (a copy; raises
    `UnsupportedSourceError`)."""
    check_supported(config)
    backbone = copy.deepcopy(config)
    for name in ("quantization_config", "auto_map", "architectures"):  # the source checkpoint's, not the backbone's
        if name in vars(backbone):
            delattr(backbone, name)
    return {"backbone": backbone}


@functools.lru_cache(maxsize=32)
def _keys(config_json: str) -> tuple[str, ...]:
    from ..modeling import AttnResConfig, AttnResForCausalLM

    config = AttnResConfig(backbone=json.loads(config_json), depth_mixing="residual")
    with torch.device("meta"):
        model = AttnResForCausalLM(config)
    return tuple(name for name in model.state_dict() if not is_depth_mixing_parameter(name))


def backbone_keys(config: PretrainedConfig) -> tuple[str, ...]:
    """The state-dict keys of the backbone an AttnRes model of source `config` holds (its key table: every key the
    source may carry; the family's own names). Built on the meta device (no memory)."""
    check_supported(config)
    fields = attnres_config_fields(config)["backbone"].to_dict()
    return _keys(json.dumps(fields, sort_keys=True, default=str))


def map_keys(config: PretrainedConfig, keys: list[str]) -> dict[str, str]:
    """Map source state-dict keys to AttnRes keys: the identity, over the table `backbone_keys(config)`.

    Raises:
        KeyError: naming every source key the table does not hold.
    """
    table = set(backbone_keys(config))
    unmapped = [key for key in keys if key not in table]
    if unmapped:
        shown = ", ".join(unmapped[:8]) + (f" (+{len(unmapped) - 8} more)" if len(unmapped) > 8 else "")
        raise KeyError(f"{config.model_type} checkpoint has keys with no AttnRes counterpart: {shown}")
    return {key: key for key in keys}
