"""Kimi K3's text model (Moonshot AI, July 2026) as a backbone family: `kimi_k3`.

Kimi K3 is the first production model trained with Block AttnRes. Its text model is Kimi Linear (KDA / MLA hybrid,
DeepSeek-V3-style sigmoid router; transformers' `kimi_linear`) with five pieces transformers does not have. Each is
written here, on top of transformers' own Kimi Linear modules, and nothing else is:

| piece (K3 config field)                         | what it computes (K3 technical report; K3's released code)         |
|-------------------------------------------------|---------------------------------------------------------------------|
| SiTU-GLU (`hidden_act: "situ"`,                 | `down(b tanh(g / b) sigmoid(g) * c tanh(u / c))`, `g`, `u` the gate  |
| `activation_situ_beta` b,                       | and up projections, in fp32 (`situ_glu`); `c = None` leaves `u`     |
| `activation_situ_linear_beta` c)                | as it is; a missing `b` is 1. Dense MLP, shared and routed experts  |
| latent MoE (`routed_expert_hidden_size` R,      | the router reads `x`; the experts run on `down(x)` (width R); their |
| `latent_moe_use_norm`)                          | weighted sum is RMS-normalised and projected back: `up(norm(sum))`  |
| MLA output gate (`mla_use_output_gate`)         | `o_proj(attention(x) * sigmoid(g_proj(x)))`, per channel            |
| KDA full-rank output gate                       | the gated output norm's gate is `g_proj(x)` instead of the low-rank |
| (`linear_attn_config.use_full_rank_gate`)       | `g_b_proj(g_a_proj(x))`                                             |
| KDA safe forget gate                            | `g = lower_bound * sigmoid(exp(A_log) (f(x) + dt_bias))`: transformers' |
| (`linear_attn_config.gate_lower_bound`)         | GLM-5-Next forget gate, which has it (`Glm5NextTextForgetGate`)     |

The rest is Kimi Linear's, reused as it is: KDA (`KimiLinearDeltaAttention`: short convolutions, which stay SiLU
whatever `hidden_act` says, the delta rule, the gated output norm), MLA without rotary embedding
(`KimiLinearAttention`; K3's `mla_use_nope: true`), the router (`KimiLinearTopkRouter`: sigmoid scores, the
score-correction bias for the choice only, grouped top-k, renormalised, times `routed_scaling_factor`; K3 skips the
renormalisation when one expert is chosen), the hybrid cache and the masks.

K3's AttnRes itself is attnres-hf's Block AttnRes (`depth_mixing="attnres"`): K3 seals a block every
`attn_res_block_size` decoder layers, attnres-hf counts sub-layers, so `attnres_block_size = 2 * attn_res_block_size`,
with the plain mean (`attnres_rescale_output=False`). `KimiK3Config` describes the backbone only; K3's
`attn_res_block_size` belongs to the AttnRes config (the conversion maps one to the other,
`conversion/k3_layout.py`), and the residual `KimiK3ForCausalLM` here (K3 without AttnRes) is the family's source
model, as every family's is.

Sources: each piece's semantics were learned from K3's released code (`modeling_kimi_linear.py` of the K3 release,
as trimmed in public reference copies), its `config.json`, torchtitan's `kimi_k3` (which numbers the report's
equations: the safe forget gate Eq. 5, the latent MoE Eq. 11) and the sglang, vLLM and llama.cpp ports; none of their
code is used. `tests/k3_reference.py` is the plain reference each is tested against: a float64 forward of K3's
equations that imports neither attnres-hf nor transformers' models (`tests/test_k3.py`, every field flipped).

Parameter names are transformers' Kimi Linear names (`mlp.experts.gate_up_proj`, one `conv1d` for q/k/v); K3's
released names (`block_sparse_moe.experts.{e}.w1`, `q_conv1d`, ...) are mapped by `conversion/k3_layout.py`.

Travels with checkpoints as remote code (a sibling of `backbones.py`, whose record of the family imports it when the
family is first used): imports only torch, transformers and its siblings `backbones_moe.py`, `backbones_kda.py`
(Kimi Linear's KDA by device, which K3's subclasses) and `configuration_kimi_k3.py` (`KimiK3Config`, which a
configuration reads without this module).
"""

import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils.output_capturing import OutputRecorder

with warnings.catch_warnings():  # as `backbones_moe` imports Kimi Linear: fla's import-time warning without a GPU
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

from .backbones_kda import KimiLinearDeltaAttentionByDevice
from .backbones_moe import kimi as _kimi_linear
from .backbones_moe import kimi_decoder_layer
from .configuration_kimi_k3 import SITU, KimiK3Config, check_kimi_k3, token_id_problem

kimi = _kimi_linear.load()  # transformers' module (this module is imported on first use)


MLA_LATENT_NORM_EPS = 1e-6
"""The eps of MLA's latent norms (`q_a_layernorm`, `kv_a_layernorm`), whatever `rms_norm_eps` says: K3's released
`modeling_kimi_linear.py` builds them as `KimiRMSNorm(rank)`, the class's default eps (DeepSeek-V3's MLA, which it
adapts, does the same), while its other norms pass `eps=config.rms_norm_eps`. Read in two public copies of the release's
file (commit c5d1dd4): Ascend/MindSpeed-MM `mindspeed_mm/fsdp/models/kimi_k3/modeling_kimi_linear.py`, 576469377/
MiniFrontier `minifrontier/models/minikimik3/upstream_layers.py`; NVIDIA NeMo Automodel's K3 does the same.
torchtitan's `kimi_k3` (pull request #4281) and an MLX port build them at `rms_norm_eps`, so their logits differ from
the release's (and ours) wherever `rms_norm_eps` is not 1e-6: at the release's 1e-5, by 2e-5 to 4.5e-4 of the
logits' scale on tiny models; at `rms_norm_eps` 0.1, by 0.6 of it (`tests/test_k3.py`)."""

def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU, K3's MLP activation (`hidden_act: "situ"`, its released code's `SituAndMul`): `beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up /
    linear_beta)`, computed in fp32 and returned in `gate`'s dtype; `beta=None` is 1, `linear_beta=None` leaves `up`
    unbounded. `gate`, `up`: `(..., intermediate)`."""
    beta = 1.0 if beta is None else beta
    g, u = gate.float(), up.float()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * u).to(gate.dtype)


class KimiK3MLP(kimi.KimiLinearMLP):
    """Kimi Linear's gated MLP (`gate_proj`, `up_proj`, `down_proj`), with SiTU-GLU when `hidden_act` is `"situ"`."""

    def __init__(self, config, intermediate_size=None):
        nn.Module.__init__(self)  # KimiLinearMLP's own __init__ looks `hidden_act` up in ACT2FN, which has no SiTU
        self.config, self.hidden_size = config, config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = None if config.hidden_act == SITU else ACT2FN[config.hidden_act]

    def forward(self, x):
        if self.act_fn is not None:
            return super().forward(x)
        config = self.config
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), config.activation_situ_beta,
                                       config.activation_situ_linear_beta))


@use_experts_implementation
class KimiK3Experts(nn.Module):
    """The routed experts as 3D tensors (transformers' layout: `gate_up_proj` `(E, 2 I, R)`, `down_proj`
    `(E, R, I)`, R the latent width), with SiTU-GLU; every experts implementation of transformers (eager, batched,
    grouped) applies it through `_apply_gate`."""

    def __init__(self, config):
        super().__init__()
        width = config.routed_expert_hidden_size or config.hidden_size
        self.num_experts, self.intermediate_dim = config.num_local_experts, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, width))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, width, self.intermediate_dim))
        self.act_fn = None if config.hidden_act == SITU else ACT2FN[config.hidden_act]

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act_fn is not None:
            return self.act_fn(gate) * up
        return situ_glu(gate, up, self.config.activation_situ_beta, self.config.activation_situ_linear_beta)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """`hidden_states` `(tokens, R)`, `top_k_index` / `top_k_weights` `(tokens, k)` -> `(tokens, R)`: the
        experts' outputs weighted by the router, summed per token in fp32 (the eager implementation; Kimi Linear's
        applies `act_fn(gate) * up` itself rather than `_apply_gate`, so SiTU needs this one)."""
        output = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            hidden = self._apply_gate(F.linear(hidden_states[token], self.gate_up_proj[expert]))
            hidden = F.linear(hidden, self.down_proj[expert]).float() * top_k_weights[token, slot, None].float()
            output.index_add_(0, token, hidden)  # summed in fp32 and cast once, as K3 combines its experts
        return output.to(hidden_states.dtype)


class KimiK3TopkRouter(kimi.KimiLinearTopkRouter):
    """Kimi Linear's router (DeepSeek-V3's `noaux_tc`), renormalising the chosen weights only when more than one
    expert is chosen, as K3 does (`moe_renormalize` with `num_experts_per_token > 1`)."""

    def __init__(self, config):
        super().__init__(config)
        self.norm_topk_prob = config.norm_topk_prob and config.num_experts_per_tok > 1


class KimiK3MoE(nn.Module):
    """K3's latent MoE: the router (`gate`) reads `x`; the routed experts run on `routed_expert_down_proj(x)`, their
    weighted sum is RMS-normalised (`routed_expert_norm`, with `latent_moe_use_norm`) and projected back
    (`routed_expert_up_proj`); the shared experts (one MLP `num_shared_experts` experts wide) read `x`. Without
    `routed_expert_hidden_size` it is Kimi Linear's MoE. `(batch, seq_len, hidden)` -> the same."""

    def __init__(self, config):
        super().__init__()
        self.gate = KimiK3TopkRouter(config)
        self.experts = KimiK3Experts(config)
        latent = config.routed_expert_hidden_size
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent, bias=False) if latent else None
        self.routed_expert_norm = (kimi.KimiLinearRMSNorm(latent, eps=config.rms_norm_eps)
                                   if latent and config.latent_moe_use_norm else None)
        self.routed_expert_up_proj = nn.Linear(latent, config.hidden_size, bias=False) if latent else None
        shared = config.n_shared_experts
        self.shared_experts = (KimiK3MLP(config, intermediate_size=config.moe_intermediate_size * shared)
                               if shared else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        _, weights, indices = self.gate(hidden_states)
        routed = hidden_states.reshape(-1, shape[-1])
        if self.routed_expert_down_proj is not None:
            routed = self.routed_expert_down_proj(routed)
        routed = self.experts(routed, indices, weights)
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        if self.routed_expert_up_proj is not None:
            routed = self.routed_expert_up_proj(routed)
        routed = routed.view(shape)
        return routed if self.shared_experts is None else routed + self.shared_experts(hidden_states)


class KimiK3DeltaAttention(KimiLinearDeltaAttentionByDevice):
    """Kimi Linear's KDA (ours: fla's kernels on CUDA tensors only, `backbones_kda`) with K3's two options: the safe
    forget gate (`linear_lower_bound`: transformers' GLM-5-Next gate, whose `A_log` is `(heads,)`) and the full-rank
    output gate `g_proj` (`linear_use_full_rank_gate`). The short convolutions use SiLU whatever `hidden_act` is (SiTU
    is the MLPs'). The convolutions, the forget gate's `A_log` / `dt_bias` and the output norm are fp32 under any
    `dtype`, as K3 stores them."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.activation = "silu"
        self.forget_gate = Glm5NextTextForgetGate(config)  # reads `linear_lower_bound`; None is Kimi Linear's gate
        self.conv1d.float(), self.o_norm.float()  # fp32 in any dtype, as K3 keeps them (the gate's are already)
        if config.linear_use_full_rank_gate:
            del self.g_a_proj, self.g_b_proj
            self.g_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)

    # transformers' forward computes the output gate as `g_b_proj(g_a_proj(x))`: with the full-rank gate that is
    # `g_proj(x)` followed by the identity.
    @property
    def g_a_proj(self):
        return self._modules.get("g_proj") or self._modules["g_a_proj"]

    @property
    def g_b_proj(self):
        return nn.Identity() if "g_proj" in self._modules else self._modules["g_b_proj"]


class KimiK3Attention(kimi.KimiLinearAttention):
    """Kimi Linear's MLA (no rotary embedding) with K3's per-channel sigmoid output gate before `o_proj`
    (`mla_use_output_gate`): `o_proj(attention(x) * sigmoid(g_proj(x)))`, `g_proj` `(heads * v_head_dim, hidden)`.
    Its latent norms run at `MLA_LATENT_NORM_EPS` (the release's), not `rms_norm_eps`."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        # Set here rather than left to Kimi Linear's default, which is the release's today but not a promise of it
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = MLA_LATENT_NORM_EPS
        gated = config.mla_use_output_gate
        self.g_proj = nn.Linear(self.hidden_size, self.num_heads * self.v_head_dim, bias=False) if gated else None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, cache=None, **kwargs):
        if self.g_proj is None:
            return super().forward(hidden_states, attention_mask, cache=cache, **kwargs)
        # Kimi Linear's MLA up to `o_proj` (its forward applies `o_proj` inside), then the gate. Not a hook on `o_proj`:
        # PEFT replaces `o_proj` by its LoRA layer, whose adapter branch a hook on the base layer would not gate.
        batch_size, seq_length = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        query = query.view(batch_size, seq_length, -1, self.qk_head_dim).transpose(1, 2)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim],
                                     dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, self.kv_lora_rank)
        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
        if cache is not None:  # the compressed latents are cached, as Kimi Linear caches them
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
        key, value = self.expand_kv(kv_nope, k_rot)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    kimi.eager_attention_forward)
        output, weights = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                                    dropout=0.0 if not self.training else self.attention_dropout, **kwargs)
        output = output.reshape(batch_size, seq_length, -1) * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(output), weights


class KimiK3DecoderLayer(kimi.KimiLinearDecoderLayer):
    """Kimi Linear's decoder layer (its residual forward) with K3's modules: KDA or gated MLA by `layer_types`, the
    latent MoE or the SiTU MLP by `mlp_layer_types`."""

    def __init__(self, config, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # Kimi Linear's own __init__ builds its own modules
        self.hidden_size = config.hidden_size
        self.block_type = config.layer_types[layer_idx]
        self.self_attn = (KimiK3Attention(config, layer_idx) if self.block_type == "full_attention"
                          else KimiK3DeltaAttention(config, layer_idx))
        self.mlp = KimiK3MoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else KimiK3MLP(config)
        self.input_layernorm = kimi.KimiLinearRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = kimi.KimiLinearRMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiK3PreTrainedModel(kimi.KimiLinearPreTrainedModel):
    """Kimi Linear's, initialising K3's modules too (the safe forget gate's `A_log` at 0, as GLM-5-Next's)."""

    config_class = KimiK3Config
    config: KimiK3Config
    _no_split_modules = ["KimiK3DecoderLayer"]
    # K3 keeps these in fp32 inside its bf16 checkpoint too (its KDA convolutions, gate parameters, output norm)
    _keep_in_fp32_modules_strict = [*kimi.KimiLinearPreTrainedModel._keep_in_fp32_modules_strict, "A_log", "conv1d",
                                    "o_norm"]
    _can_record_outputs = {"router_logits": OutputRecorder(KimiK3TopkRouter, index=0),
                           "hidden_states": KimiK3DecoderLayer, "attentions": KimiK3Attention}

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Glm5NextTextForgetGate):
            if module.safe_gate_lower_bound is not None:
                init.zeros_(module.A_log)
            else:
                init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
            init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
            dt = module.dt_bias.exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus, as Kimi Linear
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)


class KimiK3Model(KimiK3PreTrainedModel, kimi.KimiLinearModel):
    """Kimi Linear's model (its forward) over K3's decoder layers: K3 without AttnRes."""

    def __init__(self, config: KimiK3Config):
        KimiK3PreTrainedModel.__init__(self, config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = kimi.KimiLinearRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()


class KimiK3ForCausalLM(KimiK3PreTrainedModel, kimi.KimiLinearForCausalLM):
    """K3's text model without AttnRes (the `kimi_k3` family's source model; K3 itself is the AttnRes model of this
    backbone): Kimi Linear's causal LM over `KimiK3Model`, whose head is the embedding with `tie_word_embeddings`
    (Kimi Linear's declares no tied weights, so its head stays untied whatever the config says)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiK3Config):
        KimiK3PreTrainedModel.__init__(self, config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def k3_decoder_layer(config, layer_idx: int) -> nn.Module:
    """K3's decoder layer (`KimiK3DecoderLayer`), built as Kimi Linear's are (`backbones_moe.kimi_decoder_layer`):
    the adapter's `decoder_layer` (`backbones.BACKBONES`)."""
    return kimi_decoder_layer(config, layer_idx, layer_class=KimiK3DecoderLayer)


__all__ = ["MLA_LATENT_NORM_EPS", "KimiK3Attention", "KimiK3Config", "KimiK3DecoderLayer",
           "KimiK3DeltaAttention", "KimiK3Experts", "KimiK3ForCausalLM", "KimiK3MLP", "KimiK3MoE", "KimiK3Model",
           "KimiK3PreTrainedModel", "KimiK3TopkRouter", "check_kimi_k3", "k3_decoder_layer", "situ_glu",
           "token_id_problem"]
