"""The depth-mixing family: how each sub-layer of the decoder reads the outputs of the layers below it.

`DEPTH_MIXING` holds one `DepthMixingMethod` record per `AttnResConfig.depth_mixing` value, and is the only list of
methods: the config, the decoder, the training recipes (`ROUTER_MODULES`, weight decay), the routing tools, the CLI
and the tests read it. Adding a method means adding its state and modules (a `mixing_*.py` sibling) and its record
here. The state contract (`DepthState`, `DepthRead`, `DepthWrite`) is in `mixing_base.py`.

Travels with checkpoints as remote code (a relative import of `modeling_attnres.py`, with its `mixing_*.py` and
`attnres_*.py` siblings): imports only torch and transformers.
"""

import torch
from torch import nn

from .attnres_reference import (attnres_num_sources, attnres_routing_maps, attnres_source_columns,
                                attnres_source_names, naive_attnres)
from .mixing_attnres import (AttnResFinalModules, AttnResLayerModules, AttnResRouter, AttnResState, ResidualState,
                             attnres_source_norms)
from .mixing_base import (AttnResRMSNorm, DepthMixingMethod, DepthRead, DepthState, DepthWrite, RoutingMap,
                          registered_modules, register_modules, stacked_norms)
from .mixing_delta import (DeltaAttnResLayerModules, DeltaAttnResRouter, DeltaAttnResState,
                           delta_attnres_routing_maps, delta_attnres_source_norms)
from .mixing_dense import (DCAFinalModules, DCALayerModules, DCAState, DenseFormerLayerModules, DenseFormerState,
                           DepthWeightedAverage, GRNv3, MUDDLayerModules, MUDDState, MultiwayDynamicDense,
                           dca_routing_maps, dca_to_rows, denseformer_routing_maps, layer_source_names,
                           muddformer_routing_maps)
from .mixing_mhc import (ManifoldHyperConnection, MHCLayerModules, MHCState, mhc_routing_maps, mhc_source_names,
                         sinkhorn_knopp)


def _per_head_rows(weights: torch.Tensor) -> torch.Tensor:
    """AttnRes: `(B, T, n)` -> `(B, T, 1, n)`; per-head weights `(B, T, H, n)` are already one row per head."""
    return weights if weights.dim() == 4 else weights.unsqueeze(-2)


_METHODS = (
    DepthMixingMethod(
        name="residual",
        title="standard residual stream (the baseline)",
        card="Standard residual connections: the backbone's own model (the baseline of the family).",
        state=ResidualState,
    ),
    DepthMixingMethod(
        name="attnres",
        title="Attention Residuals (Kimi Team, arXiv:2603.15031)",
        card="Attention Residuals (Kimi Team, arXiv:2603.15031): each sub-layer reads a softmax over depth of earlier "
        "sources with a learned pseudo-query (Full or Block AttnRes, Eq. 1-6).",
        state=AttnResState,
        layer_modules=AttnResLayerModules,
        final_modules=AttnResFinalModules,
        module_classes=(AttnResRouter,),
        # the pseudo-query encodes the uniform (residual) routing at 0; the key norm is a norm; scalar logits too
        no_weight_decay=("query", "key_norm.weight", "logits"),
        config_fields=("attnres_score_fn", "attnres_key_norm", "attnres_window", "attnres_query",
                       "attnres_num_heads", "attnres_scalar_weights"),
        depth_weights="one `(batch, seq_len, n_sources)` per router (`layers.0.attn_res`, `layers.0.mlp_res`, ..., "
        "`final_res`); `(batch, seq_len, heads, n_sources)` with `attnres_num_heads > 1`",
        routing_maps=attnres_routing_maps,
        source_names=attnres_source_names,
        source_norms=attnres_source_norms,
        to_rows=_per_head_rows,
        distribution=lambda config: config.attnres_score_fn == "softmax",
    ),
    DepthMixingMethod(
        name="delta_attnres",
        title="Delta Attention Residuals (Luo, Cai and Hu, arXiv:2605.18855)",
        card="Delta Attention Residuals (Luo, Cai and Hu, arXiv:2605.18855): the residual stream kept, each sub-layer "
        "input adds AttnRes's softmax over depth, scaled by a zero-initialised gate (Full or Block).",
        state=DeltaAttnResState,
        layer_modules=DeltaAttnResLayerModules,
        module_classes=(DeltaAttnResRouter,),
        # AttnRes's router parameters, and the gate: 0 is the residual model
        no_weight_decay=("query", "key_norm.weight", "gate"),
        depth_weights="one `(batch, seq_len, n_sources)` per router (`layers.0.attn_res`, `layers.0.mlp_res`, ...): "
        "AttnRes's sources, before the gate",
        routing_maps=delta_attnres_routing_maps,
        source_names=attnres_source_names,
        source_norms=delta_attnres_source_norms,
        to_rows=_per_head_rows,
        distribution=lambda config: True,
    ),
    DepthMixingMethod(
        name="denseformer",
        title="DenseFormer (Pagliardini et al., NeurIPS 2024)",
        card="DenseFormer (Pagliardini et al., NeurIPS 2024): a depth-weighted average of the embedding and earlier "
        "layer outputs after each layer.",
        state=DenseFormerState,
        layer_modules=DenseFormerLayerModules,
        module_classes=(DepthWeightedAverage,),
        no_weight_decay=("alpha",),  # alpha_{i,i} = 1 is the residual path
        config_fields=("denseformer_dilation", "denseformer_period"),
        depth_weights="one `(batch, seq_len, n)` per DWA (static alphas, broadcast)",
        routing_maps=denseformer_routing_maps,
        source_names=layer_source_names,
        source_norms=stacked_norms,
    ),
    DepthMixingMethod(
        name="muddformer",
        title="MUDDFormer (Xiao et al., ICML 2025)",
        card="MUDDFormer (Xiao et al., ICML 2025): multiway dynamic dense connections build separate query, key, "
        "value and residual inputs from all earlier layer outputs.",
        state=MUDDState,
        layer_modules=MUDDLayerModules,
        module_classes=(MultiwayDynamicDense,),
        no_weight_decay=("static_weights",),  # 1 on the current layer output is the residual path
        depth_weights="one `(batch, seq_len, C, n)` per layer (`C = 4` streams q, k, v, r; 1 after the last layer)",
        routing_maps=muddformer_routing_maps,
        source_names=layer_source_names,
        source_norms=stacked_norms,
        to_rows=lambda weights: weights,
    ),
    DepthMixingMethod(
        name="dca",
        title="DeepCrossAttention (Heddes et al., ICML 2025)",
        card="DeepCrossAttention (Heddes et al., ICML 2025): GRN-v3 builds each layer's query, key and value inputs "
        "from the embedding and all earlier layer outputs.",
        state=DCAState,
        layer_modules=DCALayerModules,
        final_modules=DCAFinalModules,
        module_classes=(GRNv3,),
        no_weight_decay=("bias",),  # ones: the residual sum
        depth_weights="one `(batch, seq_len, C, n, hidden_size)` per GRN (`C = 3` per layer, 1 for `final_dca`)",
        routing_maps=dca_routing_maps,
        source_names=layer_source_names,
        source_norms=stacked_norms,
        to_rows=dca_to_rows,
    ),
    DepthMixingMethod(
        name="mhc",
        title="mHC: manifold-constrained hyper-connections (Xie et al., DeepSeek-AI, arXiv:2512.24880)",
        card="mHC (DeepSeek-AI, arXiv:2512.24880): parallel residual streams mixed by doubly-stochastic "
        "(Sinkhorn-Knopp) matrices around every sub-layer.",
        state=MHCState,
        layer_modules=MHCLayerModules,
        module_classes=(ManifoldHyperConnection,),
        # the static logits encode the residual read/write/mix; the alphas are gates
        no_weight_decay=("b_pre", "b_post", "b_res", "alpha_pre", "alpha_post", "alpha_res"),
        config_fields=("mhc_num_streams", "mhc_sinkhorn_iterations"),
        depth_weights="`H_res`, `(batch, seq_len, n_streams, n_streams)`, per sub-layer",
        routing_maps=mhc_routing_maps,
        source_names=mhc_source_names,
        source_norms=stacked_norms,
        to_rows=lambda weights: weights,
        distribution=lambda config: True,
    ),
)

DEPTH_MIXING: dict[str, DepthMixingMethod] = {method.name: method for method in _METHODS}
"""`depth_mixing` value -> its record: the one list of depth-mixing methods."""

MIXING_MODULES = tuple(cls for method in _METHODS for cls in method.module_classes)
"""Module classes that hold depth-mixing parameters; each has `reset_parameters()` (its residual-model init)."""

MIXING_MODULE_NAMES = tuple(dict.fromkeys(name for method in _METHODS for name in method.module_names))
"""Attribute names of every method's mixing modules (`attn_res`, `mlp_res`, `final_res`, `dwa`, ...), each once
(Delta AttnRes's routers have AttnRes's names)."""


def has_routers(depth_mixing: str) -> bool:
    """Whether the method's mixing modules are AttnRes routers (`AttnResRouter`: a pseudo-query's softmax over depth
    sources): AttnRes and Delta AttnRes, the models the router tools read (entropy, the contradiction probe)."""
    return any(issubclass(cls, AttnResRouter) for cls in DEPTH_MIXING[depth_mixing].module_classes)


ROUTER_METHODS = tuple(name for name in DEPTH_MIXING if has_routers(name))
"""The `depth_mixing` methods whose models have depth routers (`has_routers`), in `DEPTH_MIXING`'s order."""


def _parts(name: str) -> list[str]:
    return name.split(".")


def depth_mixing_module(name: str) -> str | None:
    """The mixing-module attribute name inside the parameter or module name `name` (e.g. `mlp_res` for
    `model.layers.3.mlp_res.query`, also under PEFT's `modules_to_save` wrappers), or `None`."""
    return next((part for part in _parts(name) if part in MIXING_MODULE_NAMES), None)


def is_depth_mixing_parameter(name: str) -> bool:
    """True for a parameter of a depth-mixing module, e.g. `model.layers.3.mlp_res.query`, `model.layers.0.dwa.alpha`."""
    return depth_mixing_module(name) is not None


def depth_mixing_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's depth-mixing parameters by name (what `--method routers` trains)."""
    return {name: param for name, param in model.named_parameters() if is_depth_mixing_parameter(name)}


def num_depth_mixing_parameters(model_or_config) -> int:
    """Number of depth-mixing parameters (routers, DWAs, ...): counted on a model's own parameters, or for a config
    on the modules its method's record builds (on the meta device: no memory, any model size)."""
    if isinstance(model_or_config, nn.Module):
        return sum(param.numel() for param in depth_mixing_parameters(model_or_config).values())
    config, method = model_or_config, DEPTH_MIXING[model_or_config.depth_mixing]
    with torch.device("meta"):
        modules = [*(module for layer_idx in range(config.num_hidden_layers)
                     for module in method.layer_modules.build(config, layer_idx)), *method.final_modules.build(config)]
    return sum(param.numel() for module in modules if module is not None for param in module.parameters())


def is_no_weight_decay_parameter(name: str) -> bool:
    """True for a depth-mixing parameter its method keeps out of weight decay (`no_weight_decay`): the parameters
    whose initial value encodes the residual path, and every bias, gate, scale and norm weight of a mixing module."""
    module = depth_mixing_module(name)
    if module is None:
        return False
    parts = _parts(name)
    rest = parts[len(parts) - parts[::-1].index(module):]  # inside the mixing module
    if rest[:1] == ["original_module"]:  # PEFT's `modules_to_save` wrapper: the frozen original ...
        rest = rest[1:]
    elif rest[:1] == ["modules_to_save"]:  # ... and the trained copy, per adapter
        rest = rest[2:]
    # (a module name several methods share, AttnRes's routers': any of their lists)
    return any(".".join(rest) in method.no_weight_decay for method in _METHODS if module in method.module_names)


def modules_to_not_convert(config) -> list[str]:
    """Module names a quantizer must keep in full precision for `config` (transformers' `modules_to_not_convert`
    matches them as name components): the method's mixing modules, whose tiny weights decide the depth routing."""
    return list(DEPTH_MIXING[config.depth_mixing].module_names)


__all__ = [
    "DEPTH_MIXING",
    "MIXING_MODULES",
    "MIXING_MODULE_NAMES",
    "ROUTER_METHODS",
    "AttnResRMSNorm",
    "AttnResRouter",
    "AttnResState",
    "DeltaAttnResRouter",
    "DepthMixingMethod",
    "DepthRead",
    "DepthState",
    "DepthWrite",
    "RoutingMap",
    "attnres_num_sources",
    "attnres_source_columns",
    "depth_mixing_module",
    "depth_mixing_parameters",
    "has_routers",
    "is_depth_mixing_parameter",
    "is_no_weight_decay_parameter",
    "modules_to_not_convert",
    "naive_attnres",
    "num_depth_mixing_parameters",
    "register_modules",
    "registered_modules",
    "sinkhorn_knopp",
]
