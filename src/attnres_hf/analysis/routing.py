"""Read the depth routing a model computes: per-token depth weights, contributions and summary numbers.

Every depth-weight tensor the model returns with `output_depth_weights=True` (AttnRes: one per router, paper Eq. 1-4,
6) is laid out as rows of weights over one common source axis, exactly as the method's record says
(`DEPTH_MIXING[name].routing_maps`, `source_names`); nothing here recounts sources:

- AttnRes, Full: `embedding`, then the output of each sub-layer (`0.attn`, `0.mlp`, `1.attn`, ...); Block AttnRes:
  `embedding`, then block `n` (`block 1 [0.attn-3.mlp]`, ...). A router inside block `n` reads the block's partial
  sum, which takes block `n`'s column; a sliding window (`attnres_window`) leaves the dropped sources empty; with
  `attnres_num_heads = H` each router has one row per head (`L0 attn h0`, ...).
- DenseFormer, MUDDFormer, DCA: `embedding`, then each layer output; one row per DWA, per MUDD stream (q, k, v, r),
  per GRN-v3 output (q, k, v; DCA's per-feature weights are averaged over features). mHC: the streams; one row per
  new stream of each sub-layer's `H_res`.

The value norms `||v_i||` needed for the contribution map `alpha_i * ||v_i||` (weights alone can mislead: values are
not normalised) are read with forward hooks on the mixing modules, so nothing in `modeling/` knows about this module.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from ..modeling.depth_mixing import DEPTH_MIXING
from ..modeling.mixing_base import RoutingMap


def routing_maps(config) -> list[RoutingMap]:
    """The model's depth-weight tensors as maps (module, row labels, source columns), in output order.

    Raises:
        ValueError: for a method that returns no depth weights (`depth_mixing="residual"`) or a config that is not an
            AttnRes one.
    """
    method = DEPTH_MIXING.get(getattr(config, "depth_mixing", None))
    if method is None or method.routing_maps is None:
        with_weights = [name for name, m in DEPTH_MIXING.items() if m.routing_maps is not None]
        raise ValueError(
            f"routing maps need a model whose depth mixing returns depth weights (depth_mixing one of {with_weights}); "
            f"this one has depth_mixing={getattr(config, 'depth_mixing', None)!r}"
        )
    return method.routing_maps(config)


def router_names(config) -> list[str]:
    """Mixing modules in output order, e.g. `layers.0.attn_res`, `layers.0.mlp_res`, ..., `final_res` (AttnRes)."""
    return [m.module.removeprefix("model.") for m in routing_maps(config)]


def source_names(config) -> list[str]:
    """Names of the common source axis (see the module docstring)."""
    routing_maps(config)  # the same error for a method without depth weights
    return DEPTH_MIXING[config.depth_mixing].source_names(config)


def source_columns(config, router_index: int) -> list[int]:
    """Columns of the common source axis that depth-weight tensor `router_index` reads, in the order of its last axis
    (AttnRes: router `router_index`, the sub-layer index; `2L` = the final router; paper Eq. 6)."""
    return routing_maps(config)[router_index].columns


@dataclass
class RoutingRecord:
    """Depth routing of one input. `weights[r, t, c]` and `value_norms[r, t, c]` are on the common source axis
    (NaN where row `r` cannot read source `c`): shapes `(n_rows, seq_len, n_sources)`, float64. A row is a router
    (AttnRes; one per head with several heads) or one output of a mixing module (see the module docstring)."""

    routers: list[str]
    sources: list[str]
    tokens: list[str]
    weights: np.ndarray
    value_norms: np.ndarray
    has_partial: list[bool]  # whether row r reads a partial block sum (its last source)
    distribution: bool = True  # whether every row sums to 1 (softmax, Sinkhorn); entropies need it
    modules: list[str] = field(default_factory=list)  # the module that computed each row

    @property
    def contributions(self) -> np.ndarray:
        """`alpha_i * ||v_i||`: how much of each source actually reaches the router's output."""
        return self.weights * self.value_norms


def _submodule(model: torch.nn.Module, path: str) -> torch.nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:  # a bare `AttnResModel` rather than the causal LM
        return model.get_submodule(path.removeprefix("model."))


@torch.no_grad()
def record_routing(model, input_ids: torch.Tensor, tokenizer=None) -> RoutingRecord:
    """Run `model` (an `AttnResForCausalLM` whose depth mixing returns depth weights: AttnRes with any knob,
    DenseFormer, MUDDFormer, DCA, mHC) on one sequence `input_ids` (`(seq_len,)` or `(1, seq_len)`) and collect its
    depth weights and source value norms (L2 norm per token), laid out by the method's record.

    Raises:
        ValueError: for a model without depth weights, a batch of several sequences, an empty input, ids that are
            not integers or lie outside the model's vocabulary.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"record_routing takes an AttnResForCausalLM model, got {type(model).__name__}")
    config = model.config
    maps = routing_maps(config)
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"record_routing takes a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"record_routing takes integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError(f"record_routing takes one sequence, (seq_len,) or (1, seq_len); got {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("record_routing needs at least one token; the input is empty")
    vocab = model.get_input_embeddings().num_embeddings
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(
            f"record_routing takes token ids in [0, {vocab - 1}] (the model's vocabulary), got ids from "
            f"{int(input_ids.min())} to {int(input_ids.max())}: was the text encoded with another tokenizer?"
        )
    method = DEPTH_MIXING[config.depth_mixing]
    input_ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    norms: dict[str, torch.Tensor] = {}

    def capture(path):
        def hook(module, args, output):
            norms[path] = method.source_norms(args[0])[0]  # (T, n): one norm per source the module was given

        return hook

    handles = [_submodule(model, m.module).register_forward_hook(capture(m.module)) for m in maps]
    try:
        out = model(input_ids, output_depth_weights=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if out.depth_weights is None or len(out.depth_weights) != len(maps):
        raise ValueError(f"the model returned {len(out.depth_weights or ())} depth-weight tensors where its "
                         f"depth_mixing={config.depth_mixing!r} record describes {len(maps)}")

    sources = method.source_names(config)
    rows = [label for m in maps for label in m.rows]
    weights = np.full((len(rows), input_ids.shape[1], len(sources)), np.nan)
    value_norms = np.full_like(weights, np.nan)
    row = 0
    for routing_map, tensor in zip(maps, out.depth_weights):
        alpha = method.to_rows(tensor)[0].double().cpu().numpy()  # (T, rows, n)
        source_norm = norms[routing_map.module][:, routing_map.columns].double().cpu().numpy()  # (T, n)
        for k in range(len(routing_map.rows)):
            weights[row][:, routing_map.columns] = alpha[:, k]
            value_norms[row][:, routing_map.columns] = source_norm
            row += 1
    ids = input_ids[0].tolist()
    tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]
    has_partial = [m.partial for m in maps for _ in m.rows]
    modules = [m.module for m in maps for _ in m.rows]
    return RoutingRecord(rows, sources, tokens, weights, value_norms, has_partial, method.distribution(config), modules)


def summarize(record: RoutingRecord, sink_factor: float = 2.0, sink_cv: float = 0.25) -> dict:
    """Summary numbers per row (router), averaged over tokens.

    - `entropy` (nats) and `entropy_ratio` (entropy / log(n_sources); 1 = uniform; None with a single source, and
      both None when the rows are not distributions: sigmoid scores, DenseFormer/MUDDFormer/DCA weights);
    - `embedding_mass`: weight on the first source it reads (the embedding; mHC: its first stream);
    - `recent_mass`: weight on the most recent source (the partial block, or the last completed one);
    - `long_jump_mass`: weight on completed sources older than the previous block, the embedding excluded;
    - `sinks`: sources that take weight regardless of input (depth-wise attention sinks): mean weight at least
      `sink_factor` times uniform and coefficient of variation over tokens below `sink_cv`.
    """
    rows = []
    for r, router in enumerate(record.routers):
        w = record.weights[r]
        cols = np.flatnonzero(~np.isnan(w[0]))
        alpha = w[:, cols]  # (T, n)
        n = len(cols)
        entropy = None
        if record.distribution:
            entropy = abs(float(-(alpha * np.log(np.clip(alpha, 1e-12, None))).sum(-1).mean()))
        mean, std = alpha.mean(0), alpha.std(0)
        sinks = [record.sources[c] for c, m, s in zip(cols, mean, std) if n > 1 and m >= sink_factor / n
                 and s / max(abs(m), 1e-12) < sink_cv]
        rows.append({
            "router": router,
            "n_sources": n,
            "entropy": entropy,
            "entropy_ratio": entropy / np.log(n) if entropy is not None and n > 1 else None,
            "embedding_mass": float(mean[0]),
            "recent_mass": float(mean[-1]),
            # sources older than the previous block: before [last completed, partial] or before [last completed]
            "long_jump_mass": float(mean[1 : n - (2 if record.has_partial[r] else 1)].sum()),
            "sinks": sinks,
        })
    ratios = [row["entropy_ratio"] for row in rows if row["entropy_ratio"] is not None]
    return {"routers": rows, "mean_entropy_ratio": float(np.mean(ratios)) if ratios else None}
