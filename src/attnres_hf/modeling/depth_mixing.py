"""The depth-mixing family: how each sub-layer of the decoder reads the outputs of the layers below it.

`DEPTH_MIXING` holds one `DepthMixingMethod` record per `AttnResConfig.depth_mixing` value, and is the only list of
methods: the config, the decoder, the training recipes (`ROUTER_MODULES`, weight decay), the routing tools, the CLI
and the tests read it. Adding a method means adding its state and modules (a `mixing_*.py` sibling), a `LazyModule`
of that sibling with its loader below, and its record here. The state contract (`DepthState`, `DepthRead`,
`DepthWrite`) is in `mixing_base.py`.

Importing this module imports no method's module: a record names its classes and functions lazily
(`lazy_records`), and `DEPTH_MIXING[name]` imports the method's `mixing_*.py` module when the record is first read;
`AttnResConfig` reads the records as declared (`DEPTH_MIXING.declared`) and so imports none of them.

Travels with checkpoints as remote code (a relative import of `configuration_attnres.py` and `modeling_attnres.py`,
with its `mixing_*.py` and `attnres_*.py` siblings): imports only torch and transformers.
"""

import functools
import inspect

import torch
from torch import nn

from .lazy_records import LazyModule, LazyTable
from .mixing_base import DepthMixingMethod, ResidualState, stacked_norms


# The methods' modules, imported when a method's record is first read (`DEPTH_MIXING[name]`): a configuration reads
# the records as declared (`DEPTH_MIXING.declared`) and imports none of them. Each loader holds a relative import
# statement, the form transformers' remote-code loader follows to copy the file along.
def _import_attnres_reference():
    from .attnres_reference import naive_attnres

    return inspect.getmodule(naive_attnres)


def _import_mixing_attnres():
    from .mixing_attnres import AttnResRouter

    return inspect.getmodule(AttnResRouter)


def _import_mixing_delta():
    from .mixing_delta import DeltaAttnResRouter

    return inspect.getmodule(DeltaAttnResRouter)


def _import_mixing_dense():
    from .mixing_dense import GRNv3

    return inspect.getmodule(GRNv3)


def _import_mixing_mhc():
    from .mixing_mhc import ManifoldHyperConnection

    return inspect.getmodule(ManifoldHyperConnection)


reference = LazyModule("attnres_reference", _import_attnres_reference)
attnres = LazyModule("mixing_attnres", _import_mixing_attnres)
delta = LazyModule("mixing_delta", _import_mixing_delta)
dense = LazyModule("mixing_dense", _import_mixing_dense)
mhc = LazyModule("mixing_mhc", _import_mixing_mhc)


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
        state=attnres.AttnResState,
        layer_modules=attnres.AttnResLayerModules,
        final_modules=attnres.AttnResFinalModules,
        module_classes=(attnres.AttnResRouter,),
        # the pseudo-query encodes the uniform (residual) routing at 0; the key norm is a norm; scalar logits too
        no_weight_decay=("query", "key_norm.weight", "logits"),
        config_fields=("attnres_score_fn", "attnres_key_norm", "attnres_window", "attnres_query",
                       "attnres_num_heads", "attnres_scalar_weights"),
        depth_weights="one `(batch, seq_len, n_sources)` per router (`layers.0.attn_res`, `layers.0.mlp_res`, ..., "
        "`final_res`); `(batch, seq_len, heads, n_sources)` with `attnres_num_heads > 1`",
        routing_maps=reference.attnres_routing_maps,
        source_names=reference.attnres_source_names,
        source_norms=reference.attnres_source_norms,
        to_rows=_per_head_rows,
        distribution=lambda config: config.attnres_score_fn == "softmax",
    ),
    DepthMixingMethod(
        name="delta_attnres",
        title="Delta Attention Residuals (Luo, Cai and Hu, arXiv:2605.18855)",
        card="Delta Attention Residuals (Luo, Cai and Hu, arXiv:2605.18855): the residual stream kept, each sub-layer "
        "input adds AttnRes's softmax over depth, scaled by a zero-initialised gate (Full or Block).",
        state=delta.DeltaAttnResState,
        layer_modules=delta.DeltaAttnResLayerModules,
        module_classes=(delta.DeltaAttnResRouter,),
        # AttnRes's router parameters, and the gate: 0 is the residual model
        no_weight_decay=("query", "key_norm.weight", "gate"),
        depth_weights="one `(batch, seq_len, n_sources)` per router (`layers.0.attn_res`, `layers.0.mlp_res`, ...): "
        "AttnRes's sources, before the gate",
        routing_maps=delta.delta_attnres_routing_maps,
        source_names=reference.attnres_source_names,
        source_norms=delta.delta_attnres_source_norms,
        to_rows=_per_head_rows,
        distribution=lambda config: True,
    ),
    DepthMixingMethod(
        name="denseformer",
        title="DenseFormer (Pagliardini et al., NeurIPS 2024)",
        card="DenseFormer (Pagliardini et al., NeurIPS 2024): a depth-weighted average of the embedding and earlier "
        "layer outputs after each layer.",
        state=dense.DenseFormerState,
        layer_modules=dense.DenseFormerLayerModules,
        module_classes=(dense.DepthWeightedAverage,),
        no_weight_decay=("alpha",),  # alpha_{i,i} = 1 is the residual path
        config_fields=("denseformer_dilation", "denseformer_period"),
        depth_weights="one `(batch, seq_len, n)` per DWA (static alphas, broadcast)",
        routing_maps=dense.denseformer_routing_maps,
        source_names=dense.layer_source_names,
        source_norms=stacked_norms,
    ),
    DepthMixingMethod(
        name="muddformer",
        title="MUDDFormer (Xiao et al., ICML 2025)",
        card="MUDDFormer (Xiao et al., ICML 2025): multiway dynamic dense connections build separate query, key, "
        "value and residual inputs from all earlier layer outputs.",
        state=dense.MUDDState,
        layer_modules=dense.MUDDLayerModules,
        module_classes=(dense.MultiwayDynamicDense,),
        no_weight_decay=("static_weights",),  # 1 on the current layer output is the residual path
        depth_weights="one `(batch, seq_len, C, n)` per layer (`C = 4` streams q, k, v, r; 1 after the last layer)",
        routing_maps=dense.muddformer_routing_maps,
        source_names=dense.layer_source_names,
        source_norms=stacked_norms,
        to_rows=lambda weights: weights,
    ),
    DepthMixingMethod(
        name="dca",
        title="DeepCrossAttention (Heddes et al., ICML 2025)",
        card="DeepCrossAttention (Heddes et al., ICML 2025): GRN-v3 builds each layer's query, key and value inputs "
        "from the embedding and all earlier layer outputs.",
        state=dense.DCAState,
        layer_modules=dense.DCALayerModules,
        final_modules=dense.DCAFinalModules,
        module_classes=(dense.GRNv3,),
        no_weight_decay=("bias",),  # ones: the residual sum
        depth_weights="one `(batch, seq_len, C, n, hidden_size)` per GRN (`C = 3` per layer, 1 for `final_dca`)",
        routing_maps=dense.dca_routing_maps,
        source_names=dense.layer_source_names,
        source_norms=stacked_norms,
        to_rows=dense.dca_to_rows,
    ),
    DepthMixingMethod(
        name="mhc",
        title="mHC: manifold-constrained hyper-connections (Xie et al., DeepSeek-AI, arXiv:2512.24880)",
        card="mHC (DeepSeek-AI, arXiv:2512.24880): parallel residual streams mixed by doubly-stochastic "
        "(Sinkhorn-Knopp) matrices around every sub-layer.",
        state=mhc.MHCState,
        layer_modules=mhc.MHCLayerModules,
        module_classes=(mhc.ManifoldHyperConnection,),
        # the static logits encode the residual read/write/mix; the alphas are gates
        no_weight_decay=("b_pre", "b_post", "b_res", "alpha_pre", "alpha_post", "alpha_res"),
        config_fields=("mhc_num_streams", "mhc_sinkhorn_iterations"),
        depth_weights="`H_res`, `(batch, seq_len, n_streams, n_streams)`, per sub-layer",
        routing_maps=mhc.mhc_routing_maps,
        source_names=mhc.mhc_source_names,
        source_norms=stacked_norms,
        to_rows=lambda weights: weights,
        distribution=lambda config: True,
    ),
)

class DepthMixingTable(LazyTable):
    """`depth_mixing` value -> `DepthMixingMethod` (`lazy_records.LazyTable`): `table[name]` imports the method's
    module on first use; `declared(name)` is the record as written (its plain fields: `name`, `title`, `card`,
    `no_weight_decay`, `config_fields`, `depth_weights`), with nothing imported."""

    record_type = DepthMixingMethod
    key_field = "name"


DEPTH_MIXING: DepthMixingTable = DepthMixingTable({method.name: method for method in _METHODS})
"""`depth_mixing` value -> its record: the one list of depth-mixing methods. `DEPTH_MIXING[name]` imports the
method's modules; `DEPTH_MIXING.declared(name)` reads the record without them (what `AttnResConfig` does)."""


def has_routers(depth_mixing: str) -> bool:
    """Whether the method's mixing modules are AttnRes routers (`AttnResRouter`: a pseudo-query's softmax over depth
    sources): AttnRes and Delta AttnRes, the models the router tools read (entropy, the contradiction probe)."""
    router = attnres.AttnResRouter.resolve()
    return any(issubclass(cls, router) for cls in DEPTH_MIXING[depth_mixing].module_classes)


@functools.cache
def _mixing_modules() -> tuple[type, ...]:
    return tuple(cls for method in DEPTH_MIXING.values() for cls in method.module_classes)


@functools.cache
def _mixing_module_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for method in DEPTH_MIXING.values() for name in method.module_names))


@functools.cache
def _router_methods() -> tuple[str, ...]:
    return tuple(name for name in DEPTH_MIXING if has_routers(name))


_DERIVED = {"MIXING_MODULES": _mixing_modules, "MIXING_MODULE_NAMES": _mixing_module_names,
            "ROUTER_METHODS": _router_methods}


def __getattr__(name: str):
    """The tables derived from every resolved record (reading one imports every method's module, hence on first use):

    - `MIXING_MODULES`: module classes that hold depth-mixing parameters; each has `reset_parameters()` (its
      residual-model init).
    - `MIXING_MODULE_NAMES`: attribute names of every method's mixing modules (`attn_res`, `mlp_res`, `final_res`,
      `dwa`, ...), each once (Delta AttnRes's routers have AttnRes's names).
    - `ROUTER_METHODS`: the `depth_mixing` methods whose models have depth routers (`has_routers`), in
      `DEPTH_MIXING`'s order.
    """
    if name in _DERIVED:
        return _DERIVED[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _parts(name: str) -> list[str]:
    return name.split(".")


def depth_mixing_module(name: str) -> str | None:
    """The mixing-module attribute name inside the parameter or module name `name` (e.g. `mlp_res` for
    `model.layers.3.mlp_res.query`, also under PEFT's `modules_to_save` wrappers), or `None`."""
    names = _mixing_module_names()
    return next((part for part in _parts(name) if part in names), None)


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
    return any(".".join(rest) in method.no_weight_decay for method in DEPTH_MIXING.values()
               if module in method.module_names)


def modules_to_not_convert(config) -> list[str]:
    """Module names a quantizer must keep in full precision for `config` (transformers' `modules_to_not_convert`
    matches them as name components): the method's mixing modules, whose tiny weights decide the depth routing."""
    return list(DEPTH_MIXING[config.depth_mixing].module_names)


__all__ = [
    "DEPTH_MIXING",
    "MIXING_MODULES",
    "MIXING_MODULE_NAMES",
    "ROUTER_METHODS",
    "DepthMixingTable",
    "depth_mixing_module",
    "depth_mixing_parameters",
    "has_routers",
    "is_depth_mixing_parameter",
    "is_no_weight_decay_parameter",
    "modules_to_not_convert",
    "num_depth_mixing_parameters",
]
