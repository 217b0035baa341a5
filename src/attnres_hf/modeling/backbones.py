"""Backbone adapters: the source family's own transformers classes, driven by the AttnRes depth state.

`BACKBONES` holds one `BackboneAdapter` record per supported `model_type` and is the only list of backbone families:
the config (`AttnResConfig.backbone`), the decoder (`modeling_attnres.py`), the conversion (`conversion/families.py`,
key tables and GGUF layouts), the tests and the docs' table read it. AttnRes keeps none of a family's code: the
decoder builds the family's own decoder layer (`adapter.decoder_layer(config.backbone, layer_idx)`), adopts its
children under their own names (`self_attn`, `mlp`, `input_layernorm`, Phi-3's `qkv_proj` inside `self_attn`,
Gemma's `pre_feedforward_layernorm`, ...) and never calls its `forward`: the depth state replaces the residual adds
(`modeling_attnres.AttnResDecoderLayer`). Parameter names are therefore the family's own and a checkpoint maps by
identity; AttnRes adds only its mixing modules (`attn_res`, `mlp_res`, `final_res`, `dwa`, ...).

How a sub-layer runs (`SubLayer`; paper Eq. 1-6 for what `read`/`write` do):

    x   = state.read_attn(mixing).hidden                       # AttnRes: the depth mix replaces the residual sum
    out = layer.<module>(layer.<norm>(x), ...)                  # the family's pre-norm and sub-layer
    out = layer.<post[0]>(out) ...                              # Gemma's post-norms, Phi-3's residual dropout
    out = out * config.<output_multiplier>                      # Granite's residual_multiplier
    state = state.write_attn(mixing, out)                       # the output joins the depth stream

Why retrofit is exact (DESIGN): a pre-norm family computes `h + f(Norm(h))` where every reader of the stream `h` is
a norm that is scale-invariant up to `eps` (RMSNorm `x / rms(x) * w`, Gemma's `x / rms(x) * (1 + w)`): the attention
and MLP pre-norms and the final norm. AttnRes with zero pseudo-queries feeds each reader the mean (rescaled: the sum)
of sources that partition the residual sum, so every reader sees the same normalised input. Everything applied to a
sub-layer's *output* before it joins the stream (Gemma's post-attention / post-feedforward norms, Phi-3's dropout,
Granite's `residual_multiplier`) is part of that sub-layer's source, and everything applied to the embedding before
the first layer (Gemma's `sqrt(hidden_size)` scale, Granite's `embedding_multiplier`) is part of the embedding
source; what is applied after the final norm (Granite's `logits_scaling`, Gemma's final logit soft-capping) is the
head's. Inside a sub-layer (Granite's `attention_multiplier`, Gemma's attention soft-capping and
`query_pre_attn_scalar`, sliding windows, Qwen3's q/k norms, SmolLM3's no-rope layers) nothing reads the stream.
So each family below is exact at conversion time (tested: `tests/test_backbones.py`). Granite's
`residual_multiplier` in particular is representable exactly: the residual model's stream is
`m_e e + m_r sum_l f_l`, whose terms are exactly the sources AttnRes mixes when each sub-layer writes `m_r f_l`.
A family with a reader of the stream that is not scale-invariant (e.g. a linear map of the un-normalised stream, as
in a parallel block without its own norm) would not be exact; such a family gets no record, and `check_config`
refuses the settings of a registered family that AttnRes cannot serve, naming the reason.

Adding a family (tens of lines): one `BackboneAdapter(...)` (the record type and its defaults are in
`backbones_base.py`) in `_DENSE`, or in a sibling module whose tuple of records `BACKBONES` joins (as
`backbones_moe.MOE_BACKBONES`), naming the family's classes through its modeling module as a `LazyModule` (`llama =
LazyModule("transformers.models.llama.modeling_llama")`, then `llama.LlamaForCausalLM`): `BACKBONES` resolves a
record when the family is first used, so `import attnres_hf` imports no family's modeling code (nor fla, which
transformers' Kimi Linear module imports); config classes are imported as they are (config modules are light). A family of our own modules does the same
with a `LazyModule` whose loader holds a relative import (Kimi K3's, `k3`: its classes subclass Kimi
Linear's; its config is in `configuration_kimi_k3.py`). The record declares:

- `model_type`, `config_class`, `causal_lm` (the family's `*ForCausalLM`, the source of a retrofit),
  `pretrained_model` (its `*PreTrainedModel`, whose `_init_weights` initialises the family's modules, incl.
  non-persistent buffers such as Gemma's `embed_scale` and the rotary frequencies), `decoder_layer`;
- `attention`, `mlp`: `SubLayer(module, norm, post=(), output_multiplier=None)`, the names of the layer's children
  (`module` may be a tuple of candidates: the first the layer has is used, e.g. Kimi Linear's `self_attn` /
  `linear_attn`);
- `norm` (the final norm class), `rotary` (the rotary class, `None` when the family has none) and, when its rotary
  embedding differs per layer type (Gemma3's local/global), `position_embeddings`;
- `embedding` (a factory; default `nn.Embedding`), `embedding_multiplier` (a config field name), `logits`
  (the head's post-processing: soft-capping, scaling);
- `key_value_inputs`: how MUDDFormer / DCA feed separate key and value inputs (`KeyValueInputs`: the k/v projection
  names, or a fused q/k/v projection and its split); `None` refuses those methods for the family;
- `make_cache`, `attention_masks`, `layer_types` (defaults: `DynamicCache(config=...)`, causal / sliding-window
  masks per `layer_types`); `record_outputs` (`_can_record_outputs` entries, e.g. MoE `router_logits`);
  `aux_loss` (MoE load balancing: `aux_loss(config, router_logits, attention_mask) -> scalar`, added to the LM loss
  times `config.router_aux_loss_coef` when `output_router_logits`); `model_output` / `causal_lm_output` (the output
  classes of the family's model and causal LM, `BaseModelOutputWithPast` / `CausalLMOutputWithPast` by default, MoE's
  for the MoE families: the AttnRes outputs are these plus `depth_weights`, so their tuples are the family's
  position by position); `check_config` (refusals, with the reason);
  `gguf_architecture` / `gguf_permuted_qk` / `gguf_norm_offset` (llama.cpp's layout of the family, if transformers'
  GGUF loader reads it: its `general.architecture`, whether its q/k rows are interleaved per head, and the constant
  llama.cpp adds to every `*norm.weight`, 1 for Gemma's `(1 + w)` norms).

Travels with checkpoints as remote code (a relative import of `modeling_attnres.py`): imports only torch,
transformers and its siblings.
"""

import sys
from collections.abc import Callable

import torch
from torch import nn

from transformers.models.gemma2.configuration_gemma2 import Gemma2Config
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
from transformers.models.granite.configuration_granite import GraniteConfig
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.mistral.configuration_mistral import MistralConfig
from transformers.models.phi3.configuration_phi3 import Phi3Config
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.smollm3.configuration_smollm3 import SmolLM3Config

from .backbones_base import (BackboneAdapter, BackboneTable, KeyValueInputs, SubLayer,
                             default_attention_masks, default_layer_types)
from .backbones_moe import (EXPERT_ROUTING, MOE_BACKBONES,  # mixture-of-experts families and Kimi Linear
                            check_kimi_k3_backbone, kimi, kimi_attention_masks, kimi_cache)
from .configuration_kimi_k3 import KimiK3Config
from .lazy_records import LazyModule

# The families' modeling modules, imported when a family is first used (`BackboneTable`): `import attnres_hf` imports
# none of them.
gemma2 = LazyModule("transformers.models.gemma2.modeling_gemma2")
gemma3 = LazyModule("transformers.models.gemma3.modeling_gemma3")
granite = LazyModule("transformers.models.granite.modeling_granite")
llama = LazyModule("transformers.models.llama.modeling_llama")
mistral = LazyModule("transformers.models.mistral.modeling_mistral")
phi3 = LazyModule("transformers.models.phi3.modeling_phi3")
qwen2 = LazyModule("transformers.models.qwen2.modeling_qwen2")
qwen3 = LazyModule("transformers.models.qwen3.modeling_qwen3")
smollm3 = LazyModule("transformers.models.smollm3.modeling_smollm3")


KEY_VALUE_METHODS = ("muddformer", "dca")
"""Depth-mixing methods whose attention read routes separate key and value inputs (`DepthRead.key_value`); a family
without `key_value_inputs` refuses them. `tests/test_backbones.py` checks this list against the methods' states."""


def per_type_position_embeddings(rotary, hidden_states, position_ids, layer_types) -> dict:
    """One rotary embedding per layer type (Gemma3: local and global frequencies)."""
    return {layer_type: rotary(hidden_states, position_ids, layer_type) for layer_type in set(layer_types)}


def scaled_embedding(embedding_class) -> Callable:
    """Gemma's embedding: `sqrt(hidden_size)` times the table, in the family's own class (`embed_scale` buffer)."""
    return lambda config: embedding_class(config.vocab_size, config.hidden_size, config.pad_token_id,
                                          embed_scale=config.hidden_size**0.5)


def soft_capped_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """Gemma's final logit soft-capping `cap * tanh(logits / cap)` (none when `final_logit_softcapping` is None)."""
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def scaled_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """Granite's head: logits divided by `logits_scaling`."""
    return logits / config.logits_scaling


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _check_gemma3(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("gemma3 with use_bidirectional_attention=True (an embedding model, not a causal LM) is not "
                         "supported: AttnRes backbones are causal decoders")


_LLAMA_LAYOUT = dict(
    attention=SubLayer("self_attn", "input_layernorm"),
    mlp=SubLayer("mlp", "post_attention_layernorm"),
)
_SANDWICH_LAYOUT = dict(  # Gemma: post-norms on each sub-layer's output
    attention=SubLayer("self_attn", "input_layernorm", post=("post_attention_layernorm",)),
    mlp=SubLayer("mlp", "pre_feedforward_layernorm", post=("post_feedforward_layernorm",)),
)

_DENSE = (
    BackboneAdapter(
        "llama", LlamaConfig, llama.LlamaForCausalLM, llama.LlamaPreTrainedModel, llama.LlamaDecoderLayer,
        norm=llama.LlamaRMSNorm, rotary=llama.LlamaRotaryEmbedding, attention_class=llama.LlamaAttention,
        gguf_architecture="llama", gguf_permuted_qk=True, **_LLAMA_LAYOUT,
    ),
    BackboneAdapter(
        "mistral", MistralConfig, mistral.MistralForCausalLM, mistral.MistralPreTrainedModel,
        mistral.MistralDecoderLayer, norm=mistral.MistralRMSNorm, rotary=mistral.MistralRotaryEmbedding,
        attention_class=mistral.MistralAttention, gguf_architecture="llama", gguf_permuted_qk=True, **_LLAMA_LAYOUT,
    ),
    BackboneAdapter(
        "qwen2", Qwen2Config, qwen2.Qwen2ForCausalLM, qwen2.Qwen2PreTrainedModel, qwen2.Qwen2DecoderLayer,
        norm=qwen2.Qwen2RMSNorm, rotary=qwen2.Qwen2RotaryEmbedding, attention_class=qwen2.Qwen2Attention,
        gguf_architecture="qwen2", **_LLAMA_LAYOUT,
    ),
    BackboneAdapter(
        "qwen3", Qwen3Config, qwen3.Qwen3ForCausalLM, qwen3.Qwen3PreTrainedModel, qwen3.Qwen3DecoderLayer,
        norm=qwen3.Qwen3RMSNorm, rotary=qwen3.Qwen3RotaryEmbedding, attention_class=qwen3.Qwen3Attention,
        gguf_architecture="qwen3", **_LLAMA_LAYOUT,
    ),
    BackboneAdapter(
        "smollm3", SmolLM3Config, smollm3.SmolLM3ForCausalLM, smollm3.SmolLM3PreTrainedModel,
        smollm3.SmolLM3DecoderLayer, norm=smollm3.SmolLM3RMSNorm, rotary=smollm3.SmolLM3RotaryEmbedding,
        attention_class=smollm3.SmolLM3Attention, **_LLAMA_LAYOUT,
    ),
    BackboneAdapter(
        "granite", GraniteConfig, granite.GraniteForCausalLM, granite.GranitePreTrainedModel,
        granite.GraniteDecoderLayer, norm=granite.GraniteRMSNorm, rotary=granite.GraniteRotaryEmbedding,
        attention_class=granite.GraniteAttention,
        attention=SubLayer("self_attn", "input_layernorm", output_multiplier="residual_multiplier"),
        mlp=SubLayer("mlp", "post_attention_layernorm", output_multiplier="residual_multiplier"),
        embedding_multiplier="embedding_multiplier", logits=scaled_logits,
    ),
    BackboneAdapter(
        "phi3", Phi3Config, phi3.Phi3ForCausalLM, phi3.Phi3PreTrainedModel, phi3.Phi3DecoderLayer,
        norm=phi3.Phi3RMSNorm, rotary=phi3.Phi3RotaryEmbedding, attention_class=phi3.Phi3Attention,
        attention=SubLayer("self_attn", "input_layernorm", post=("resid_attn_dropout",)),
        mlp=SubLayer("mlp", "post_attention_layernorm", post=("resid_mlp_dropout",)), gguf_architecture="phi3",
        key_value_inputs=KeyValueInputs(fused="qkv_proj", fused_sizes=lambda config: (
            config.num_attention_heads * _head_dim(config), config.num_key_value_heads * _head_dim(config),
            config.num_key_value_heads * _head_dim(config))),
    ),
    BackboneAdapter(
        "gemma2", Gemma2Config, gemma2.Gemma2ForCausalLM, gemma2.Gemma2PreTrainedModel, gemma2.Gemma2DecoderLayer,
        norm=gemma2.Gemma2RMSNorm, rotary=gemma2.Gemma2RotaryEmbedding, attention_class=gemma2.Gemma2Attention,
        embedding=scaled_embedding(gemma2.Gemma2TextScaledWordEmbedding), logits=soft_capped_logits,
        gguf_architecture="gemma2", gguf_norm_offset=1.0, **_SANDWICH_LAYOUT,
    ),
    BackboneAdapter(
        "gemma3_text", Gemma3TextConfig, gemma3.Gemma3ForCausalLM, gemma3.Gemma3PreTrainedModel,
        gemma3.Gemma3DecoderLayer, norm=gemma3.Gemma3RMSNorm, rotary=gemma3.Gemma3RotaryEmbedding,
        attention_class=gemma3.Gemma3Attention, position_embeddings=per_type_position_embeddings,
        embedding=scaled_embedding(gemma3.Gemma3TextScaledWordEmbedding), logits=soft_capped_logits,
        check_config=_check_gemma3, gguf_architecture="gemma3", gguf_norm_offset=1.0, **_SANDWICH_LAYOUT,
    ),
)


def _import_k3():
    """`backbones_k3`, whose classes subclass Kimi Linear's (a relative import statement: the form transformers'
    remote-code loader follows to copy the file along)."""
    from .backbones_k3 import KimiK3ForCausalLM

    return sys.modules[KimiK3ForCausalLM.__module__]


k3 = LazyModule(f"{__package__}.backbones_k3", _import_k3)
"""Kimi K3's modules (`backbones_k3.py`), imported when the family is first used."""

_K3 = (
    BackboneAdapter(  # Kimi K3's text model: Kimi Linear with K3's pieces (`backbones_k3.py`)
        "kimi_k3", KimiK3Config, k3.KimiK3ForCausalLM, k3.KimiK3PreTrainedModel, k3.k3_decoder_layer,
        attention=SubLayer("self_attn", "input_layernorm"), mlp=SubLayer("mlp", "post_attention_layernorm"),
        norm=kimi.KimiLinearRMSNorm, rotary=None, attention_class=k3.KimiK3Attention,
        key_value_inputs=None,  # MLA: keys and values come from one latent of one input (as Kimi Linear)
        make_cache=kimi_cache, attention_masks=kimi_attention_masks, check_config=check_kimi_k3_backbone,
        **EXPERT_ROUTING["kimi_k3"].adapter_fields(),
    ),
)

BACKBONES: BackboneTable = BackboneTable({adapter.model_type: adapter for adapter in (*_DENSE, *MOE_BACKBONES, *_K3)})
"""`model_type` of a backbone config -> its adapter: the one list of backbone families. A family's modeling code is
imported when its adapter is first read (`BACKBONES[model_type]`, `backbone_adapter`); `BACKBONES.declared` reads a
record without it."""

DEFAULT_BACKBONE = "llama"
"""The backbone of a config that names none (and of legacy flat AttnRes configs without Qwen/Mistral features)."""


def backbone_record(config) -> BackboneAdapter:
    """The record of `config`'s backbone (an `AttnResConfig`, or a family config itself) as declared, without the
    family's modeling code (`BACKBONES.declared`): what a config reads (`config_class`, `check_config`,
    `key_value_inputs`, `model_type`).

    Raises:
        ValueError: if the family has no adapter, naming the supported ones.
    """
    backbone = getattr(config, "backbone", config)
    model_type = getattr(backbone, "model_type", None)
    if model_type not in BACKBONES:
        raise ValueError(
            f"unsupported backbone model_type {model_type!r}: AttnRes supports {', '.join(BACKBONES)}"
        )
    return BACKBONES.declared(model_type)


def backbone_adapter(config) -> BackboneAdapter:
    """The adapter of `config`'s backbone (an `AttnResConfig`, or a family config itself), its classes resolved: the
    family's modeling code is imported the first time, and its recorders join `recorded_outputs()`.

    Raises:
        ValueError: if the family has no adapter, naming the supported ones.
    """
    model_type = backbone_record(config).model_type
    adapter = BACKBONES[model_type]
    if model_type not in _RECORDING:
        _add_recorders(adapter)
        _RECORDING.add(model_type)
    return adapter


def init_backbone_weights(adapter: BackboneAdapter, config, module: nn.Module) -> None:
    """Initialise `module` (a backbone module) as the family's `PreTrainedModel._init_weights` does (Gemma's zero
    norm weights and `embed_scale`, rotary frequencies, MoE experts, ...), with the backbone config."""
    # The family's method reads only `self.config` (and calls up to `PreTrainedModel._init_weights`); an instance
    # without `__init__` holding the config is enough.
    proxy = adapter.pretrained_model.__new__(adapter.pretrained_model)
    object.__setattr__(proxy, "config", config)
    adapter.pretrained_model._init_weights(proxy, module)


_RECORDED_OUTPUTS: dict = {}
_RECORDING: set[str] = set()


def recorded_outputs() -> dict:
    """`_can_record_outputs` of the AttnRes models: transformers keys that table by model class, and one AttnRes class
    serves every backbone, so each key maps to the list of the recorders of every family served so far
    (`backbone_adapter` adds a family's the first time it serves one, before any model of it is built). One dict,
    extended in place: transformers keeps the class's dict object (`PreTrainedModel.__init__`), and a family's
    modeling code is imported only when the family is used."""
    return _RECORDED_OUTPUTS


def _add_recorders(adapter: BackboneAdapter) -> None:
    merge_recorders(_RECORDED_OUTPUTS, adapter.can_record_outputs())


def merge_recorders(table: dict, recorders: dict) -> None:
    """Add `recorders` (`key -> recorder or list of recorders`, a family's `_can_record_outputs`) to `table` (`key ->
    list`, lists extended in place) so that every module is recorded once whatever order the families come in: a
    recorder `table` covers already is dropped, and one that covers recorders of `table` (of their base class)
    replaces them."""
    for key, recorder in recorders.items():
        kept = table.setdefault(key, [])
        for new in recorder if isinstance(recorder, list) else [recorder]:
            if not any(_records(known, new) for known in kept):
                kept[:] = [known for known in kept if not _records(new, known)] + [new]


def _records(known, recorder) -> bool:
    """Whether `known` already records what `recorder` records: the same recorder, or one of a base class (modules
    are matched with `isinstance`: Kimi K3's attention and router subclass Kimi Linear's, and would be recorded
    twice). A recorder is a module class or an `OutputRecorder`."""
    def fields(r):
        return (r, 0, None) if isinstance(r, type) else (r.target_class, r.index, r.layer_name)

    (known_class, *known_rest), (new_class, *new_rest) = fields(known), fields(recorder)
    return known == recorder or (known_rest == new_rest and issubclass(new_class, known_class))


__all__ = ["BACKBONES", "BackboneAdapter", "DEFAULT_BACKBONE", "KEY_VALUE_METHODS", "KeyValueInputs", "SubLayer",
           "backbone_adapter", "backbone_record", "default_attention_masks", "default_layer_types",
           "init_backbone_weights", "recorded_outputs"]
