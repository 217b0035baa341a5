"""AttnRes: a Llama/Qwen decoder whose residual stream is replaced by Attention Residuals.

Kimi Team, "Attention Residuals", arXiv:2603.15031 (2026). A pre-norm transformer computes
`h_{l+1} = h_l + f_l(Norm(h_l))`. AttnRes instead feeds sub-layer `l` a softmax mix over depth of earlier
*sources* (Eq. 1-4): `h_l = sum_i alpha_{i->l} v_i`, `alpha_{i->l} = softmax_i(w_l . RMSNorm(v_i))`, where `w_l`
is a learned pseudo-query. Block AttnRes (Eq. 6) uses as sources the embedding, the sums of completed blocks of
`S` sub-layers and the running sum of the current block.

The classes follow `transformers`' `modeling_llama.py` in data-flow order; departures from Llama carry an
`# AttnRes:` comment. The depth-mixing family (`depth_mixing`: residual, AttnRes, DenseFormer, MUDDFormer, DCA, mHC)
is in the sibling `depth_mixing.py` (one record per method) and its `mixing_*.py` siblings. This file travels with
checkpoints as remote code: it imports only torch, transformers and those siblings.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_attnres import AttnResConfig
from .depth_mixing import (DEPTH_MIXING, MIXING_MODULES, AttnResRMSNorm, AttnResRouter, AttnResState, naive_attnres,
                           num_depth_mixing_parameters, register_modules, registered_modules)

logger = logging.get_logger(__name__)


# AttnRes: depth mixing (residual, AttnRes and its family) lives in `depth_mixing.py`, a sibling that travels with
# this file as remote code.

# ---------------------------------------------------------------------------------------------------------------
# Backbone: Llama blocks (with Qwen2 q/k/v bias, Qwen3 q/k norm and Mistral/Qwen sliding windows).
# ---------------------------------------------------------------------------------------------------------------


class AttnResRotaryEmbedding(nn.Module):
    """Rotary position embedding (Llama's, incl. scaled variants such as `rope_type="llama3"`)."""

    def __init__(self, config: AttnResConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = self.config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(self.config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: AttnResConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class AttnResMLP(nn.Module):
    def __init__(self, config: AttnResConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, num_key_value_heads, seq_len, head_dim) -> (batch, num_attention_heads, seq_len, head_dim)"""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class AttnResAttention(nn.Module):
    """Multi-head attention with grouped-query heads (Llama), optional q/k/v bias (Qwen2), q/k norm (Qwen3) and
    sliding window (Mistral, Qwen2/3), dispatched through transformers' attention interface."""

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_out_bias)
        if config.use_qk_norm:
            self.q_norm = AttnResRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = AttnResRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        key_value_states: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`key_value_states`: separate (normed) inputs of `k_proj` and `v_proj`, `(batch, seq_len, hidden_size)`
        each (MUDDFormer, DCA); `None` projects `hidden_states` for all three, as Llama."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # AttnRes: MUDDFormer and DCA route a different depth mix into each of q, k and v.
        key_input, value_input = key_value_states if key_value_states is not None else (hidden_states, hidden_states)
        query_states = self.q_proj(hidden_states).view(hidden_shape)  # (B, T, nh, hd)
        key_states = self.k_proj(key_input).view(hidden_shape)  # (B, T, nkv, hd)
        value_states = self.v_proj(value_input).view(hidden_shape).transpose(1, 2)  # (B, nkv, T, hd)
        if self.config.use_qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """One attention and one MLP sub-layer (sub-layers `2 i` and `2 i + 1`) that read their inputs from, and write
    their outputs to, the depth state of `config.depth_mixing` instead of the residual sum. The method's record builds
    its mixing modules (`record.layer_modules`), registered under their names (`attn_res`/`mlp_res`, `dwa`, ...)."""

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = AttnResAttention(config=config, layer_idx=layer_idx)
        self.mlp = AttnResMLP(config)
        self.input_layernorm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # AttnRes: the depth-mixing modules of this layer (paper Eq. 1-4, 6 for AttnRes).
        self._mixing_type = DEPTH_MIXING[config.depth_mixing].layer_modules
        register_modules(self, self._mixing_type.build(config, layer_idx))

    def forward(
        self,
        state,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple:
        """Returns the new depth state, this layer's attention (query) input `(batch, seq_len, hidden_size)` (its
        entry in `hidden_states`) and the tuple of depth weights its mixing computed (empty for the residual)."""
        mixing = registered_modules(self, self._mixing_type)
        # AttnRes: the attention input(s) come from the depth state, not the residual sum.
        attn_read = state.read_attn(mixing)
        key_value_states = None
        if attn_read.key_value is not None:  # one pre-norm per sub-layer, applied to each routed stream
            key_value_states = tuple(self.input_layernorm(x) for x in attn_read.key_value)
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(attn_read.hidden),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            key_value_states=key_value_states,
            **kwargs,
        )
        attn_write = attn_read.state.write_attn(mixing, hidden_states)

        mlp_read = attn_write.state.read_mlp(mixing)
        hidden_states = self.mlp(self.post_attention_layernorm(mlp_read.hidden))
        mlp_write = mlp_read.state.write_mlp(mixing, hidden_states)
        weights = (*attn_read.depth_weights, *attn_write.depth_weights, *mlp_read.depth_weights,
                   *mlp_write.depth_weights)
        return mlp_write.state, attn_read.hidden, weights


class AttnResPreTrainedModel(PreTrainedModel):
    config: AttnResConfig
    config_class = AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"attentions": AttnResAttention}

    def __init__(self, config: AttnResConfig, *args, **kwargs):
        config.validate_architecture()  # also after `from_pretrained(..., attnres_block_size=...)` or a setattr
        super().__init__(config, *args, **kwargs)

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint, every_n_layers: int = 1
    ):
        # AttnRes: a decoder layer passes its depth state as a NamedTuple of tensors; reentrant checkpointing only
        # tracks tensors given directly, so it would silently cut the gradient at every layer. Use non-reentrant.
        keywords = getattr(gradient_checkpointing_func, "keywords", {})
        if enable and keywords.get("use_reentrant"):
            logger.warning_once(
                "AttnRes needs non-reentrant activation checkpointing (use_reentrant=True cannot follow the depth "
                "state between layers); using use_reentrant=False."
            )
            gradient_checkpointing_func = functools.partial(
                gradient_checkpointing_func.func, *gradient_checkpointing_func.args, **{**keywords, "use_reentrant": False}
            )
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, every_n_layers)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self._auto_class is not None:
            # AttnRes: name both heads in `auto_map`, so `AutoModel` and `AutoModelForCausalLM` both load the folder
            # with `trust_remote_code=True` (transformers only writes the saved class's own entry).
            self.config.auto_map = {
                **(getattr(self.config, "auto_map", None) or {}),
                "AutoModel": "modeling_attnres.AttnResModel",
                "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
            }
        return super().save_pretrained(save_directory, *args, **kwargs)

    def num_depth_mixing_parameters(self) -> int:
        """Number of depth-mixing parameters this model holds (AttnRes: router queries, key norms, `query_proj` or
        scalar logits; the family: DWAs, MUDD connections, GRN-v3s, hyper-connections), counted on the modules."""
        return num_depth_mixing_parameters(self)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # AttnRes: every mixing module starts as the residual model (AttnRes: zero pseudo-queries, uniform depth
        # weights at step 0, which the paper requires; see each module's `reset_parameters`).
        if isinstance(module, MIXING_MODULES):
            module.reset_parameters(self.config.initializer_range)


@dataclass
class AttnResModelOutputWithPast(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus `depth_weights`, fp32 tensors in depth order when `output_depth_weights=True`,
    as the method's record says (`DEPTH_MIXING[name].depth_weights`): AttnRes: one `(batch, seq_len, n_sources)` per
    router (`layers.0.attn_res`, `layers.0.mlp_res`, ..., `final_res`; `(batch, seq_len, heads, n_sources)` with
    `attnres_num_heads > 1`); DenseFormer: one `(batch, seq_len, n)` per DWA; MUDDFormer: one `(batch, seq_len, C, n)`
    per layer; DCA: one `(batch, seq_len, C, n, hidden_size)` per GRN; mHC: `H_res`, `(batch, seq_len, n_streams,
    n_streams)`, per sub-layer. `None` for the residual baseline."""

    depth_weights: tuple[torch.Tensor, ...] | None = None


@dataclass
class AttnResCausalLMOutputWithPast(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus `depth_weights` (see `AttnResModelOutputWithPast`)."""

    depth_weights: tuple[torch.Tensor, ...] | None = None


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        # AttnRes: the method's final mixing (AttnRes: `final_res`, DCA: `final_dca`) builds the last norm's input.
        self._mixing_type = DEPTH_MIXING[config.depth_mixing].final_modules
        register_modules(self, self._mixing_type.build(config))
        self.norm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = AttnResRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        # AttnRes: every depth-mixing module keeps fp32 under any `dtype` and is never quantized (bitsandbytes and
        # torchao skip what `_keep_in_fp32_modules` names), so routing is computed at full precision.
        mixing = {name.rsplit(".", 1)[-1] for name, module in self.named_modules() if isinstance(module, MIXING_MODULES)}
        self._keep_in_fp32_modules = self._keep_in_fp32_modules_strict = mixing
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_depth_weights: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResModelOutputWithPast:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch, seq_len)`), inputs_embeds (`(batch, seq_len,
            hidden_size)`): exactly one of the two.
            cache (`Cache`): the KV cache (`past_key_values` is accepted as its former name). AttnRes needs no
                cache of its own: depth routing is per token.
            output_hidden_states (`bool`): return the embeddings, each layer's routed input and the final normed
                state (`num_hidden_layers + 1` tensors; for `depth_mixing="residual"` this is Llama's tuple).
            output_depth_weights (`bool`): return `depth_weights` (see `AttnResModelOutputWithPast`; AttnRes:
                one `(batch, seq_len, n_sources)` fp32 tensor per router, rows summing to 1 with softmax).

        Raises:
            ValueError: if both or neither of `input_ids` and `inputs_embeds` are given.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": position_ids,
            }
            mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
            if "sliding_attention" in self.config.layer_types:
                mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)

        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        state = DEPTH_MIXING[self.config.depth_mixing].state.start(inputs_embeds, self.config, bool(output_depth_weights))
        hidden_states, depth_weights = [], []
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            state, layer_input, layer_depth_weights = decoder_layer(
                state,
                attention_mask=mask_mapping[self.config.layer_types[decoder_layer.layer_idx]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
            hidden_states.append(layer_input)
            depth_weights += layer_depth_weights

        final = state.read_final(registered_modules(self, self._mixing_type))
        last_hidden_state = self.norm(final.hidden)
        depth_weights += final.depth_weights
        return AttnResModelOutputWithPast(
            last_hidden_state=last_hidden_state,
            cache=cache,
            hidden_states=(*hidden_states, last_hidden_state) if output_hidden_states else None,
            depth_weights=tuple(depth_weights) if output_depth_weights and depth_weights else None,
        )


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResCausalLMOutputWithPast:
        r"""
        Causal LM forward: arguments as `AttnResModel.forward`, plus `labels` (`(batch, seq_len)`, -100 ignored;
        shifted inside the loss) and `logits_to_keep` (keep the logits of the last N positions, or of the given
        indices). Returns `logits` of shape `(batch, seq_len, vocab_size)` in the model dtype.
        """
        outputs: AttnResModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return AttnResCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            depth_weights=outputs.depth_weights,
        )


__all__ = [
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
    "AttnResRouter",
    "AttnResState",
    "naive_attnres",
]
