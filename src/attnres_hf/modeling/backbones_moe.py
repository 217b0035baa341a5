"""Backbone adapters for mixture-of-experts families and for Kimi Linear, the AttnRes paper's own backbone.

Records of `BackboneAdapter` (`backbones_base.py`; see `backbones.py` for what each field means), joined into
`backbones.BACKBONES`. Every sub-layer is transformers' own module of the source family (Kimi Linear's KDA: our
subclass of it, below), under the family's own parameter names (experts as `mlp.experts.gate_up_proj` /
`mlp.experts.down_proj`, the experts' router as `mlp.gate`), so a checkpoint maps by identity:

| model_type    | attention sub-layer (`self_attn`)                      | MLP sub-layer (`mlp`)                             |
|---------------|--------------------------------------------------------|---------------------------------------------------|
| `kimi_linear` | `KimiLinearDeltaAttention` (KDA) on `linear_attention`  | `KimiLinearMoE` (routed + shared experts) where    |
|               | layers, `KimiLinearAttention` (MLA) on `full_attention` | `mlp_layer_types[i] == "sparse"`, else `KimiLinearMLP` |
| `qwen3_moe`   | `Qwen3MoeAttention`                                    | `Qwen3MoeSparseMoeBlock`, or `Qwen3MoeMLP` on `mlp_only_layers` / off `decoder_sparse_step` |
| `qwen2_moe`   | `Qwen2MoeAttention`                                    | `Qwen2MoeSparseMoeBlock` (with its gated shared expert), or `Qwen2MoeMLP` |
| `mixtral`     | `MixtralAttention`                                     | `MixtralSparseMoeBlock`                           |
| `olmoe`       | `OlmoeAttention`                                       | `OlmoeSparseMoeBlock`                             |

The family's decoder layer decides which module each layer gets (KDA or MLA, MoE or dense MLP), so the layout is the
source's by construction. Every reader of the residual stream in these families is an RMSNorm (`input_layernorm`,
`post_attention_layernorm`, `model.norm`), so a retrofit is exact (see `conversion/retrofit.py`).

The experts' router (`mlp.gate`) routes each token to experts; it is a backbone weight, never a depth router
(`ExpertRouting.gates`). Its logits are recorded from the family's router module with `output_router_logits`, and the
load-balancing loss is the family's own `load_balancing_loss_func`, added to the loss times `router_aux_loss_coef` as
the source model adds it. Kimi Linear's causal LM adds none (it balances its experts with a score-correction bias,
without an auxiliary loss); its router logits are still returned.

Kimi Linear's cache is transformers' hybrid `DynamicCache`: a `LinearAttentionLayer` (convolution and recurrent KDA
states) per `linear_attention` layer and a `DynamicLayer` (the compressed MLA latents) per `full_attention` layer;
depth mixing needs nothing more. The KDA layers are our subclass of transformers' module,
`backbones_kda.KimiLinearDeltaAttentionByDevice`, which takes fla's Triton kernels on CUDA tensors only (transformers
picks them at import for every device once fla is importable, and its own class then fails on CPU);
`dispatch_kda_by_device` gives a transformers Kimi Linear model's KDA modules the subclass (what conversion and
training do to the source models they run), and transformers' module is never modified. Two limits are the source
model's, stated rather than hidden: transformers' `KimiLinearAttention` fails with fewer key/value heads than
attention heads (released checkpoints use equal counts), and MLA derives keys and values from one compressed latent
of one input, so MUDDFormer's and DCA's separate key and value inputs do not exist for it (both are refused on Kimi
Linear).

Travels with checkpoints as remote code (a sibling of `backbones.py`, which imports it): imports only torch,
transformers and its siblings (`backbones_base.py`, `backbones_kda.py` on first use; never `backbones.py`).
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.utils.output_capturing import OutputRecorder

from .backbones_base import BackboneAdapter, SubLayer
from .configuration_kimi_k3 import KimiK3Config, check_kimi_k3
from .lazy_records import LazyModule

# The families' modeling modules, imported when a family is first used (`backbones_base.BackboneTable`).
mixtral = LazyModule("transformers.models.mixtral.modeling_mixtral")
olmoe = LazyModule("transformers.models.olmoe.modeling_olmoe")
qwen2_moe = LazyModule("transformers.models.qwen2_moe.modeling_qwen2_moe")
qwen3_moe = LazyModule("transformers.models.qwen3_moe.modeling_qwen3_moe")


def _import_kda():
    """`backbones_kda` (a relative import statement: the form transformers' remote-code loader follows to copy the
    file along), which imports transformers' Kimi Linear module (and fla where it is installed)."""
    from .backbones_kda import KimiLinearDeltaAttentionByDevice

    return sys.modules[KimiLinearDeltaAttentionByDevice.__module__]


kda = LazyModule(f"{__package__}.backbones_kda", _import_kda)
"""Our KDA subclass's module (`backbones_kda.py`: `KimiLinearDeltaAttentionByDevice`), imported when Kimi Linear or K3
is first used."""


def _import_kimi_linear():
    """transformers' `modeling_kimi_linear`, as `backbones_kda` imports it (fla's warning at import filtered)."""
    modeling_kimi_linear = kda.load().kimi
    _NOT_PASSED_BY_KIMI.update({
        modeling_kimi_linear.KimiLinearDeltaAttention: ("position_ids", "use_cache", "position_embeddings"),
        modeling_kimi_linear.KimiLinearAttention: ("position_embeddings",),
    })
    return modeling_kimi_linear


kimi = LazyModule("transformers.models.kimi_linear.modeling_kimi_linear", _import_kimi_linear)
"""transformers' Kimi Linear module, imported when Kimi Linear or K3 is first used (with `kda`): it imports fla where
fla is installed. `kimi.load()` is the module, never modified here."""


@dataclass(frozen=True)
class ExpertRouting:
    """How a mixture-of-experts family routes tokens to experts, and what its causal LM adds to the loss.

    Attributes:
        router: the experts' router module class; its forward returns `(router_logits, weights, indices)`, the
            logits `(batch * seq_len, num_experts)` being what `output_router_logits` records.
        load_balancing_loss: the family's `load_balancing_loss_func(router_logits, num_experts, top_k,
            attention_mask)`, or `None` when the source causal LM adds no auxiliary loss (Kimi Linear).
        num_experts: the config field holding the number of routed experts.
        gates: names of the modules that compute routing weights (`gate`; Qwen2-MoE's `shared_expert_gate`): not
            depth routers, and left out of the default LoRA targets.
    """

    router: type[nn.Module]
    load_balancing_loss: Callable | None
    num_experts: str = "num_experts"
    gates: tuple[str, ...] = ("gate",)

    def aux_loss(self, config, router_logits: tuple, attention_mask):
        """The family's load-balancing loss of `router_logits` (one `(batch * seq_len, num_experts)` tensor per MoE
        layer) over the tokens `attention_mask` keeps; a scalar, as the source causal LM computes it."""
        return self.load_balancing_loss(router_logits, getattr(config, self.num_experts), config.num_experts_per_tok,
                                        attention_mask)

    def adapter_fields(self) -> dict:
        """The `BackboneAdapter` fields of this routing: the recorder of the router logits, the aux loss, and the
        output classes every transformers MoE model returns (`MoeModelOutputWithPast`, `MoeCausalLMOutputWithPast`)."""
        return {"record_outputs": {"router_logits": OutputRecorder(self.router, index=0)},
                "aux_loss": self.aux_loss if self.load_balancing_loss is not None else None,
                "model_output": MoeModelOutputWithPast, "causal_lm_output": MoeCausalLMOutputWithPast}


_KIMI_ROUTING = ExpertRouting(kimi.KimiLinearTopkRouter, None, num_experts="num_local_experts")  # no aux loss

EXPERT_ROUTING: dict[str, ExpertRouting] = {
    "kimi_linear": _KIMI_ROUTING,
    "kimi_k3": _KIMI_ROUTING,  # K3's router (`backbones_k3.KimiK3TopkRouter`) subclasses Kimi Linear's: one recorder
    "qwen3_moe": ExpertRouting(qwen3_moe.Qwen3MoeTopKRouter, qwen3_moe.load_balancing_loss_func),
    "qwen2_moe": ExpertRouting(qwen2_moe.Qwen2MoeTopKRouter, qwen2_moe.load_balancing_loss_func,
                               gates=("gate", "shared_expert_gate")),
    "mixtral": ExpertRouting(mixtral.MixtralTopKRouter, mixtral.load_balancing_loss_func,
                             num_experts="num_local_experts"),
    "olmoe": ExpertRouting(olmoe.OlmoeTopKRouter, olmoe.load_balancing_loss_func),
}
"""`model_type -> ExpertRouting` of every mixture-of-experts family with an adapter."""


def backbone_model_type(config) -> str:
    """The source family of `config`: an AttnRes config's backbone `model_type`, or `config.model_type`."""
    backbone = getattr(config, "backbone", None)
    return getattr(backbone, "model_type", None) or config.model_type


def expert_gate_modules(config) -> tuple[str, ...]:
    """Names of the modules that route tokens to experts in a model of `config` (an AttnRes config over a
    mixture-of-experts backbone, or the family's own config), e.g. `("gate", "shared_expert_gate")` for Qwen2-MoE;
    `()` for a dense family."""
    routing = EXPERT_ROUTING.get(backbone_model_type(config))
    return routing.gates if routing is not None else ()


# ---------------------------------------------------------------------------------------------------------------
# Kimi Linear: KDA / MLA attention layers, the hybrid cache and its masks
# ---------------------------------------------------------------------------------------------------------------


def dispatch_kda_by_device(model: nn.Module) -> nn.Module:
    """`model`, with each of its modules of transformers' own `KimiLinearDeltaAttention` class made a
    `backbones_kda.KimiLinearDeltaAttentionByDevice` in place (fla's KDA kernels on CUDA tensors, transformers' torch
    functions on any other device), and returned: what runs a transformers `KimiLinearForCausalLM` on the CPU with fla
    installed, where transformers' class fails (`backbones_kda` says why).

    An instance-level `__class__` assignment on each such module: the subclass adds no state (same parameters,
    buffers, hooks, state-dict names and outputs), and transformers' class and module stay as they are (other
    instances, and models built later, still take fla's kernels on every device). Modules of a subclass are left as
    they are: ours and Kimi K3's already dispatch by device (a checkpoint's remote-code copy of `backbones_kda` too),
    another's forward is its own. A model without Kimi Linear modules is returned unchanged, and nothing is imported
    when transformers' Kimi Linear module is not (no instance of it can exist then).
    """
    if kimi.name not in sys.modules:
        return model
    transformers_class, by_device = kimi.load().KimiLinearDeltaAttention, kda.load().KimiLinearDeltaAttentionByDevice
    for module in model.modules():
        if type(module) is transformers_class:
            module.__class__ = by_device
    return model


def kimi_attention_masks(config, layer_types, **mask_kwargs) -> dict:
    """Kimi Linear's masks, as `KimiLinearModel` builds them: causal for MLA (`full_attention`) layers, the 2D
    padding mask for KDA (`linear_attention`) layers (`None` when nothing is padded or for a one-token step)."""
    return {"full_attention": create_causal_mask(config=config, **mask_kwargs),
            "linear_attention": create_recurrent_attention_mask(config=config, **mask_kwargs)}


def kimi_cache(config) -> DynamicCache:
    """transformers' hybrid cache for Kimi Linear: recurrent/convolution states for KDA layers, the compressed MLA
    latents for full-attention layers (`DynamicCache` reads `layer_types` of the backbone config)."""
    return DynamicCache(config=getattr(config, "backbone", config))


_NOT_PASSED_BY_KIMI: dict[type, tuple[str, ...]] = {}  # filled when `kimi` loads: KDA's and MLA's classes
"""Keyword arguments the AttnRes decoder gives every attention module that `KimiLinearDecoderLayer` does not give
this one: KDA's keywords reach its kernels (`causal_conv1d_fn`, `chunk_kda`), which take no unknown ones; MLA has
no rope."""


def _called_as_kimi_linear_calls_it(module, args, kwargs):
    """A forward pre-hook (with kwargs) of a Kimi Linear attention module, or of a subclass's (Kimi K3's): drops the
    keyword arguments `KimiLinearDecoderLayer` does not give it."""
    dropped = next(names for kind, names in _NOT_PASSED_BY_KIMI.items() if isinstance(module, kind))
    return args, {name: value for name, value in kwargs.items() if name not in dropped}


def kimi_decoder_layer(config, layer_idx: int, layer_class: type = kimi.KimiLinearDecoderLayer) -> nn.Module:
    """`KimiLinearDecoderLayer` (KDA or MLA by `layer_types`, MoE or dense MLP by `mlp_layer_types`), or a subclass's
    (Kimi K3's), whose attention module is called with the arguments Kimi Linear's own layer gives it (a forward
    pre-hook drops the others); its KDA dispatches by device (`dispatch_kda_by_device`; K3's KDA already does)."""
    layer = dispatch_kda_by_device(layer_class(config, layer_idx))
    layer.self_attn.register_forward_pre_hook(_called_as_kimi_linear_calls_it, with_kwargs=True)
    return layer


def check_kimi_k3_backbone(config) -> None:
    """Kimi Linear's refusals (grouped key/value heads, layer types) and K3's own (`check_kimi_k3`)."""
    check_kimi_linear(config)
    check_kimi_k3(config)


def check_kimi_linear(config) -> None:
    """Refuse the Kimi Linear settings transformers' own model cannot run (raises `ValueError` naming why)."""
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"kimi_linear with num_key_value_heads ({config.num_key_value_heads}) != num_attention_heads "
            f"({config.num_attention_heads}): transformers' KimiLinearAttention (MLA) fails on grouped key/value "
            "heads (released Kimi Linear checkpoints use equal counts)"
        )
    unknown = sorted(set(config.layer_types) - {"linear_attention", "full_attention"})
    if unknown or len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"kimi_linear layer_types must hold one 'linear_attention' or 'full_attention' per layer "
                         f"({config.num_hidden_layers}), got {config.layer_types!r}")


_LAYOUT = dict(attention=SubLayer("self_attn", "input_layernorm"), mlp=SubLayer("mlp", "post_attention_layernorm"))
_TESTED = ("exact retrofit (every method), cached generation, save/reload (native, remote code), gradient "
           "checkpointing, router logits and aux loss")

MOE_BACKBONES = (
    BackboneAdapter(
        "kimi_linear", KimiLinearConfig, kimi.KimiLinearForCausalLM, kimi.KimiLinearPreTrainedModel,
        kimi_decoder_layer, norm=kimi.KimiLinearRMSNorm, rotary=None,  # MLA without rope (NoPE), KDA
        attention_class=kimi.KimiLinearAttention,
        key_value_inputs=None,  # MLA: keys and values come from one latent of one input (no k/v inputs to route)
        make_cache=kimi_cache, attention_masks=kimi_attention_masks, check_config=check_kimi_linear,
        tested=_TESTED + " (KDA/MLA hybrid cache; MUDDFormer and DCA refused)",
        **EXPERT_ROUTING["kimi_linear"].adapter_fields(), **_LAYOUT,
    ),
    BackboneAdapter(
        "qwen3_moe", Qwen3MoeConfig, qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.Qwen3MoePreTrainedModel,
        qwen3_moe.Qwen3MoeDecoderLayer, norm=qwen3_moe.Qwen3MoeRMSNorm, rotary=qwen3_moe.Qwen3MoeRotaryEmbedding,
        attention_class=qwen3_moe.Qwen3MoeAttention, tested=_TESTED, gguf_architecture="qwen3moe",
        **EXPERT_ROUTING["qwen3_moe"].adapter_fields(), **_LAYOUT,
    ),
    BackboneAdapter(
        "qwen2_moe", Qwen2MoeConfig, qwen2_moe.Qwen2MoeForCausalLM, qwen2_moe.Qwen2MoePreTrainedModel,
        qwen2_moe.Qwen2MoeDecoderLayer, norm=qwen2_moe.Qwen2MoeRMSNorm, rotary=qwen2_moe.Qwen2MoeRotaryEmbedding,
        attention_class=qwen2_moe.Qwen2MoeAttention, tested=_TESTED, gguf_architecture="qwen2moe",
        **EXPERT_ROUTING["qwen2_moe"].adapter_fields(), **_LAYOUT,
    ),
    BackboneAdapter(
        "mixtral", MixtralConfig, mixtral.MixtralForCausalLM, mixtral.MixtralPreTrainedModel,
        mixtral.MixtralDecoderLayer, norm=mixtral.MixtralRMSNorm, rotary=mixtral.MixtralRotaryEmbedding,
        attention_class=mixtral.MixtralAttention, tested=_TESTED + " (sliding window)",
        **EXPERT_ROUTING["mixtral"].adapter_fields(), **_LAYOUT,
    ),
    BackboneAdapter(
        "olmoe", OlmoeConfig, olmoe.OlmoeForCausalLM, olmoe.OlmoePreTrainedModel, olmoe.OlmoeDecoderLayer,
        norm=olmoe.OlmoeRMSNorm, rotary=olmoe.OlmoeRotaryEmbedding, attention_class=olmoe.OlmoeAttention,
        tested=_TESTED, **EXPERT_ROUTING["olmoe"].adapter_fields(), **_LAYOUT,
    ),
)
"""The adapters of this module, joined into `backbones.BACKBONES`."""


__all__ = ["EXPERT_ROUTING", "ExpertRouting", "MOE_BACKBONES", "backbone_model_type", "check_kimi_k3_backbone",
           "check_kimi_linear", "dispatch_kda_by_device", "expert_gate_modules", "kimi_attention_masks", "kimi_cache",
           "kimi_decoder_layer"]
