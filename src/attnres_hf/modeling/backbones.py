"""The backbone blocks of the AttnRes decoder: Llama's rotary embedding, MLP and attention, with Qwen2's q/k/v bias,
Qwen3's q/k norm and Mistral/Qwen sliding windows, and one AttnRes departure (separate key/value inputs for
MUDDFormer and DCA). Parameter names are Llama's, so Llama/Qwen checkpoints convert by identity.

Travels with checkpoints as remote code (a relative import of `modeling_attnres.py`): imports only torch,
transformers and its siblings.
"""

from collections.abc import Callable

import torch
from torch import nn

from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_attnres import AttnResConfig
from .mixing_base import AttnResRMSNorm


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


__all__ = ["AttnResAttention", "AttnResMLP", "AttnResRotaryEmbedding", "apply_rotary_pos_emb", "eager_attention_forward", "repeat_kv", "rotate_half"]
