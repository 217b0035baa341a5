"""Backbone adapters: the source family's own transformers classes, driven by the AttnRes depth state.

`BACKBONES` holds one `BackboneAdapter` record per supported `model_type` and is the only list of backbone families:
the config (`AttnResConfig.backbone`), the decoder (`modeling_attnres.py`), the conversion (`conversion/families.py`,
key tables and GGUF layouts), the tests and the README's table read it. AttnRes keeps none of a family's code: the
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

Adding a family (tens of lines): one `BackboneAdapter(...)` in `_DENSE` (or in a sibling module whose tuple of
records is joined into `BACKBONES` at the bottom of this file), declaring:

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
  times `config.router_aux_loss_coef` when `output_router_logits`); `check_config` (refusals, with the reason);
  `gguf_architecture` / `gguf_permuted_qk` / `gguf_norm_offset` (llama.cpp's layout of the family, if transformers'
  GGUF loader reads it: its `general.architecture`, whether its q/k rows are interleaved per head, and the constant
  llama.cpp adds to every `*norm.weight`, 1 for Gemma's `(1 + w)` norms).

Travels with checkpoints as remote code (a relative import of `modeling_attnres.py`): imports only torch,
transformers and its siblings.
"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma2 import modeling_gemma2 as gemma2
from transformers.models.gemma2.configuration_gemma2 import Gemma2Config
from transformers.models.gemma3 import modeling_gemma3 as gemma3
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
from transformers.models.granite import modeling_granite as granite
from transformers.models.granite.configuration_granite import GraniteConfig
from transformers.models.llama import modeling_llama as llama
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.mistral.configuration_mistral import MistralConfig
from transformers.models.phi3 import modeling_phi3 as phi3
from transformers.models.phi3.configuration_phi3 import Phi3Config
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.smollm3 import modeling_smollm3 as smollm3
from transformers.models.smollm3.configuration_smollm3 import SmolLM3Config


@dataclass(frozen=True)
class SubLayer:
    """One sub-layer of a family's decoder layer, by the names of the layer's children.

    - `module`: the sub-layer (`"self_attn"`, `"mlp"`), or a tuple of candidates (the first the layer has).
    - `norm`: its pre-norm, the reader of the depth stream (must be scale-invariant for an exact retrofit).
    - `post`: modules applied, in order, to its output before the output joins the stream (Gemma's
      `post_attention_layernorm` / `post_feedforward_layernorm`, Phi-3's `resid_attn_dropout`).
    - `output_multiplier`: a config field the output is multiplied by before it joins the stream (Granite's
      `residual_multiplier`).
    """

    module: str | tuple[str, ...]
    norm: str
    post: tuple[str, ...] = ()
    output_multiplier: str | None = None

    def module_name(self, layer: nn.Module) -> str:
        """The name of this sub-layer's module in `layer` (the first candidate `layer` has)."""
        names = (self.module,) if isinstance(self.module, str) else self.module
        found = next((name for name in names if name in layer._modules), None)
        if found is None:
            raise ValueError(f"{type(layer).__name__} has none of the sub-layer modules {names}")
        return found


@dataclass(frozen=True)
class KeyValueInputs:
    """How an attention module takes separate key and value inputs (MUDDFormer's and DCA's k/v streams).

    - `key`, `value`: the names (inside the attention module) of the key and value input projections; their input is
      replaced by the routed stream (a forward pre-hook, on the PEFT wrapper when there is one: see `KeyValueRouting`).
    - `fused`: the name of a fused q/k/v projection (Phi-3's `qkv_proj`) instead, with `fused_sizes(config)` the
      `(q, k, v)` widths of its output: the projection runs on each input and the k and v slices are swapped in.
    """

    key: str = "k_proj"
    value: str = "v_proj"
    fused: str | None = None
    fused_sizes: Callable | None = None

    def projections(self) -> tuple[str, ...]:
        """The names of the projections whose input (or output slices) the routing replaces."""
        return (self.key, self.value) if self.fused is None else (self.fused,)

    @contextlib.contextmanager
    def routed(self, attention: nn.Module, config, key_input: torch.Tensor, value_input: torch.Tensor):
        """Within the block, `attention`'s key/value projections read `key_input` / `value_input`
        (`(batch, seq_len, hidden_size)` each) instead of the attention's `hidden_states` (a decoder layer keeps a
        `KeyValueRouting` instead, whose hooks stay installed)."""
        routing = KeyValueRouting(self, attention, config)
        routing.route(attention, key_input, value_input)
        try:
            yield
        finally:
            routing.remove()


class _ProjectionHook:
    """The hook on one key/value projection (a callable object, not a closure: `copy.deepcopy` and pickling of
    the model carry it over to the copy's own `KeyValueRouting`)."""

    def __init__(self, routing: "KeyValueRouting", name: str):
        self.routing, self.name = routing, name

    def __call__(self, module, args, output=None):
        routed = self.routing.slot[0]
        if routed is None:
            return None
        spec = self.routing.spec
        if spec.fused is None:  # a forward pre-hook: the projection reads its routed input
            return (routed[(spec.key, spec.value).index(self.name)], *args[1:])
        q, k, _ = spec.fused_sizes(self.routing.config)  # a forward hook: splice in the k and v slices
        keys, values = module.forward(routed[0]), module.forward(routed[1])  # `forward`: without this hook
        return torch.cat([output[..., :q], keys[..., q : q + k], values[..., q + k :]], dim=-1)


class KeyValueRouting:
    """The separate key/value inputs of one attention module (MUDDFormer, DCA): `route(attention, key_input,
    value_input)` sets them (`(batch, seq_len, hidden_size)` each) for the next call, `clear()` unsets them.

    The hooks are installed at construction, and again only when a projection module was replaced (PEFT wraps
    `k_proj` in a LoRA layer: the wrapper gets the hook, so its adapter reads the routed input too), so a compiled
    model traces the hooks, not their registration (which breaks the graph)."""

    def __init__(self, spec: KeyValueInputs, attention: nn.Module, config):
        self.spec, self.config, self.slot, self.hooked = spec, config, [None], {}
        self.install(attention)

    def install(self, attention: nn.Module) -> None:
        for name in self.spec.projections():
            module = attention.get_submodule(name)
            if name in self.hooked and self.hooked[name][0] is module:
                continue
            if name in self.hooked:
                self.hooked[name][1].remove()
            hook = _ProjectionHook(self, name)
            handle = module.register_forward_hook(hook) if self.spec.fused else module.register_forward_pre_hook(hook)
            self.hooked[name] = (module, handle)

    def route(self, attention: nn.Module, key_input: torch.Tensor, value_input: torch.Tensor) -> None:
        self.install(attention)
        self.slot[0] = (key_input, value_input)

    def clear(self) -> None:
        self.slot[0] = None

    def remove(self) -> None:
        self.clear()
        for _, handle in self.hooked.values():
            handle.remove()
        self.hooked = {}


KEY_VALUE_METHODS = ("muddformer", "dca")
"""Depth-mixing methods whose attention read routes separate key and value inputs (`DepthRead.key_value`); a family
without `key_value_inputs` refuses them. `tests/test_backbones.py` checks this list against the methods' states."""


def default_layer_types(config) -> list[str]:
    """`config.layer_types` when the family has them, else every layer sliding when `sliding_window` is set
    (Mistral, Phi-3) or full attention (Llama)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


def default_attention_masks(config, layer_types, **mask_kwargs) -> dict:
    """`{layer type: mask}` for the layer types present: causal, and sliding-window causal (transformers' own)."""
    masks = {}
    if "full_attention" in layer_types:
        masks["full_attention"] = create_causal_mask(config=config, **mask_kwargs)
    if "sliding_attention" in layer_types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(config=config, **mask_kwargs)
    return masks


def shared_position_embeddings(rotary, hidden_states, position_ids, layer_types) -> dict:
    """One rotary embedding `(cos, sin)` for every layer type (Llama and most families)."""
    if rotary is None:
        return dict.fromkeys(layer_types)
    embeddings = rotary(hidden_states, position_ids)
    return dict.fromkeys(layer_types, embeddings)


def per_type_position_embeddings(rotary, hidden_states, position_ids, layer_types) -> dict:
    """One rotary embedding per layer type (Gemma3: local and global frequencies)."""
    return {layer_type: rotary(hidden_states, position_ids, layer_type) for layer_type in set(layer_types)}


def plain_embedding(config) -> nn.Module:
    return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)


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


def _no_check(config) -> None:
    return None


def _check_gemma3(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("gemma3 with use_bidirectional_attention=True (an embedding model, not a causal LM) is not "
                         "supported: AttnRes backbones are causal decoders")


@dataclass(frozen=True)
class BackboneAdapter:
    """Everything AttnRes needs to know about one backbone family (see the module docstring for how to add one)."""

    model_type: str
    config_class: type
    causal_lm: type
    pretrained_model: type
    decoder_layer: type
    attention: SubLayer
    mlp: SubLayer
    norm: type
    rotary: type | None
    attention_class: type
    position_embeddings: Callable = shared_position_embeddings
    embedding: Callable = plain_embedding
    embedding_multiplier: str | None = None
    logits: Callable | None = None
    key_value_inputs: KeyValueInputs | None = KeyValueInputs()
    make_cache: Callable = field(default=lambda config: DynamicCache(config=config))
    attention_masks: Callable = default_attention_masks
    layer_types: Callable = default_layer_types
    record_outputs: dict = field(default_factory=dict)
    aux_loss: Callable | None = None
    check_config: Callable = _no_check
    gguf_architecture: str | None = None
    gguf_permuted_qk: bool = False
    gguf_norm_offset: float = 0.0
    tested: str = ""  # kept for compatibility; what is tested is the README's table (checked by test_backbones)

    def can_record_outputs(self) -> dict:
        """This family's `_can_record_outputs` entries: its attention weights, plus `record_outputs`."""
        return {"attentions": self.attention_class, **self.record_outputs}


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

BACKBONES: dict[str, BackboneAdapter] = {adapter.model_type: adapter for adapter in _DENSE}
"""`model_type` of a backbone config -> its adapter: the one list of backbone families."""

DEFAULT_BACKBONE = "llama"
"""The backbone of a config that names none (and of legacy flat AttnRes configs without Qwen/Mistral features)."""


def backbone_adapter(config) -> BackboneAdapter:
    """The adapter of `config`'s backbone (an `AttnResConfig`, or a family config itself).

    Raises:
        ValueError: if the family has no adapter, naming the supported ones.
    """
    backbone = getattr(config, "backbone", config)
    model_type = getattr(backbone, "model_type", None)
    if model_type not in BACKBONES:
        raise ValueError(
            f"unsupported backbone model_type {model_type!r}: AttnRes supports {', '.join(BACKBONES)}"
        )
    return BACKBONES[model_type]


def init_backbone_weights(adapter: BackboneAdapter, config, module: nn.Module) -> None:
    """Initialise `module` (a backbone module) as the family's `PreTrainedModel._init_weights` does (Gemma's zero
    norm weights and `embed_scale`, rotary frequencies, MoE experts, ...), with the backbone config."""
    # The family's method reads only `self.config` (and calls up to `PreTrainedModel._init_weights`); an instance
    # without `__init__` holding the config is enough.
    proxy = adapter.pretrained_model.__new__(adapter.pretrained_model)
    object.__setattr__(proxy, "config", config)
    adapter.pretrained_model._init_weights(proxy, module)


def recorded_outputs() -> dict:
    """`_can_record_outputs` for every family at once (transformers keys that table by model class, and one AttnRes
    class serves every backbone): each key maps to the list of every family's recorders."""
    table = {}
    for adapter in BACKBONES.values():
        for key, recorder in adapter.can_record_outputs().items():
            recorders = recorder if isinstance(recorder, list) else [recorder]
            table.setdefault(key, [])
            table[key] += [r for r in recorders if r not in table[key]]
    return table


# Mixture-of-experts families and Kimi Linear: a sibling module (it imports `BackboneAdapter` and `SubLayer` above).
from .backbones_moe import MOE_BACKBONES  # noqa: E402

BACKBONES.update({adapter.model_type: adapter for adapter in MOE_BACKBONES})

__all__ = ["BACKBONES", "BackboneAdapter", "DEFAULT_BACKBONE", "KEY_VALUE_METHODS", "KeyValueInputs", "SubLayer",
           "backbone_adapter", "default_attention_masks", "default_layer_types", "init_backbone_weights",
           "recorded_outputs"]
