"""The record of a backbone family (`BackboneAdapter`) and its parts: sub-layers by the names of the layer's children
(`SubLayer`), separate key/value inputs of an attention module (`KeyValueInputs`, `KeyValueRouting`), and the defaults
a record takes (masks, layer types, rotary embedding, token embedding).

The records themselves are in `backbones.py` (dense families, and `BACKBONES`, the one table of every family, whose
docstring says what each field means and how to add a family) and `backbones_moe.py` (mixture-of-experts families and
Kimi Linear); both import this module, which imports neither.

Travels with checkpoints as remote code (a relative import of `backbones.py` and `backbones_moe.py`): imports only
torch and transformers.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .lazy_records import LazyTable


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


def plain_embedding(config) -> nn.Module:
    return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)


def _no_check(config) -> None:
    return None


@dataclass(frozen=True)
class BackboneAdapter:
    """Everything AttnRes needs to know about one backbone family (see `backbones.py`'s docstring for how to add
    one)."""

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
    model_output: type = BaseModelOutputWithPast
    causal_lm_output: type = CausalLMOutputWithPast
    check_config: Callable = _no_check
    gguf_architecture: str | None = None
    gguf_permuted_qk: bool = False
    gguf_norm_offset: float = 0.0
    tested: str = ""  # kept for compatibility; what is tested is docs/backbones.md's table (checked by test_backbones)

    def can_record_outputs(self) -> dict:
        """This family's `_can_record_outputs` entries: its attention weights, plus `record_outputs`."""
        return {"attentions": self.attention_class, **self.record_outputs}


class BackboneTable(LazyTable):
    """`model_type -> BackboneAdapter` (`lazy_records.LazyTable`): `table[model_type]` imports the family's modeling
    code on first use; `declared(model_type)` is the record as declared, for what needs no family code
    (`config_class`, `check_config`, `key_value_inputs`)."""

    record_type = BackboneAdapter
    key_field = "model_type"
