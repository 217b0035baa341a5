"""Read the depth routing an AttnRes model computes: per-token depth weights, contributions and summary numbers.

Every router (`layers.N.attn_res`, `layers.N.mlp_res`, `final_res`) returns a distribution over its sources (paper
Eq. 1-4, 6). To show all routers in one table, sources are placed on a common axis:

- Full AttnRes: `embedding`, then the output of each sub-layer (`0.attn`, `0.mlp`, `1.attn`, ...);
- Block AttnRes: `embedding`, then block `n` (`block 1 [0.attn-3.mlp]`, ...). A router inside block `n` reads the
  block's partial sum, which takes block `n`'s column.

The weights come from the model's own `output_depth_weights`; the value norms `||v_i||` needed for the
contribution map `alpha_i * ||v_i||` (weights alone can mislead: values are not normalised) are read with forward
hooks on the routers, so nothing in `modeling/` knows about this module.
"""

from dataclasses import dataclass

import numpy as np
import torch


def router_names(config) -> list[str]:
    """Routers in depth order: `layers.0.attn_res`, `layers.0.mlp_res`, ..., `final_res`."""
    names = [f"layers.{i}.{kind}_res" for i in range(config.num_hidden_layers) for kind in ("attn", "mlp")]
    return names + ["final_res"]


def _sublayer_name(index: int) -> str:
    return f"{index // 2}.{'attn' if index % 2 == 0 else 'mlp'}"


def source_names(config) -> list[str]:
    """Names of the common source axis (see the module docstring)."""
    size, total = config.attnres_block_size, config.num_sublayers
    if size == 1:
        return ["embedding"] + [_sublayer_name(i) for i in range(total)]
    names = ["embedding"]
    for n, start in enumerate(range(0, total, size), start=1):
        names.append(f"block {n} [{_sublayer_name(start)}-{_sublayer_name(min(start + size, total) - 1)}]")
    return names


def source_columns(config, router_index: int) -> list[int]:
    """Columns of the common source axis that router `router_index` (sub-layer index; `2L` = final router) reads,
    in the order of its depth weights (paper Eq. 6)."""
    size = config.attnres_block_size
    completed = router_index // size
    columns = list(range(completed + 1))  # embedding + completed blocks (Full: sub-layer outputs)
    if router_index % size:
        columns.append(completed + 1)  # the current block's partial sum
    return columns


@dataclass
class RoutingRecord:
    """Depth routing of one input. `weights[r, t, c]` and `value_norms[r, t, c]` are on the common source axis
    (NaN where router `r` cannot read source `c`): shapes `(n_routers, seq_len, n_sources)`, float64."""

    routers: list[str]
    sources: list[str]
    tokens: list[str]
    weights: np.ndarray
    value_norms: np.ndarray
    has_partial: list[bool]  # whether router r reads a partial block sum (its last source)

    @property
    def contributions(self) -> np.ndarray:
        """`alpha_i * ||v_i||`: how much of each source actually reaches the router's output."""
        return self.weights * self.value_norms


@torch.no_grad()
def record_routing(model, input_ids: torch.Tensor, tokenizer=None) -> RoutingRecord:
    """Run `model` (an `AttnResForCausalLM` with `depth_mixing="attnres"`) on one sequence `input_ids`
    (`(seq_len,)` or `(1, seq_len)`) and collect its depth weights and source value norms (L2 norm per token).

    Raises:
        ValueError: for a model without depth routers, a batch of several sequences, or an empty input.
    """
    config = model.config
    if getattr(config, "depth_mixing", None) != "attnres":
        raise ValueError("routing maps need an AttnRes model (depth_mixing='attnres'); this one has no routers")
    if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError(f"record_routing takes one sequence, (seq_len,) or (1, seq_len); got {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("record_routing needs at least one token; the input is empty")
    input_ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    names = router_names(config)
    norms: dict[str, torch.Tensor] = {}

    def hook(name):
        def capture(module, args, output):
            state = args[0]
            parts = [state.sources.float().norm(dim=-1)]  # (1, T, n)
            if state.partial is not None:
                parts.append(state.partial.float().norm(dim=-1, keepdim=True))
            norms[name] = torch.cat(parts, dim=-1)[0]

        return capture

    modules = {f"layers.{i}.{kind}_res": getattr(layer, f"{kind}_res") for i, layer in enumerate(model.model.layers)
               for kind in ("attn", "mlp")} | {"final_res": model.model.final_res}
    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    try:
        out = model(input_ids, output_depth_weights=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    sources = source_names(config)
    seq_len = input_ids.shape[1]
    weights = np.full((len(names), seq_len, len(sources)), np.nan)
    value_norms = np.full_like(weights, np.nan)
    for r, (name, alpha) in enumerate(zip(names, out.depth_weights)):
        columns = source_columns(config, r)
        weights[r][:, columns] = alpha[0].double().cpu().numpy()
        value_norms[r][:, columns] = norms[name].double().cpu().numpy()
    ids = input_ids[0].tolist()
    tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]
    size = config.attnres_block_size
    has_partial = [r % size != 0 for r in range(len(names))]
    return RoutingRecord(names, sources, tokens, weights, value_norms, has_partial)


def summarize(record: RoutingRecord, sink_factor: float = 2.0, sink_cv: float = 0.25) -> dict:
    """Summary numbers per router, averaged over tokens.

    - `entropy` (nats) and `entropy_ratio` (entropy / log(n_sources); 1 = uniform; None with a single source);
    - `embedding_mass`: weight on the embedding source;
    - `recent_mass`: weight on the most recent source (the partial block, or the last completed one);
    - `long_jump_mass`: weight on completed sources older than the previous block, the embedding excluded;
    - `sinks`: sources that take weight regardless of input (depth-wise attention sinks): mean weight at least
      `sink_factor` times uniform and coefficient of variation over tokens below `sink_cv`.
    """
    rows = []
    for r, router in enumerate(record.routers):
        w = record.weights[r]
        readable = ~np.isnan(w[0])
        cols = np.flatnonzero(readable)
        alpha = w[:, cols]  # (T, n)
        n = len(cols)
        entropy = abs(float(-(alpha * np.log(np.clip(alpha, 1e-12, None))).sum(-1).mean()))
        mean, std = alpha.mean(0), alpha.std(0)
        sinks = [record.sources[c] for c, m, s in zip(cols, mean, std) if n > 1 and m >= sink_factor / n
                 and s / max(m, 1e-12) < sink_cv]
        rows.append({
            "router": router,
            "n_sources": n,
            "entropy": entropy,
            "entropy_ratio": entropy / np.log(n) if n > 1 else None,  # undefined for a single source
            "embedding_mass": float(mean[0]),
            "recent_mass": float(mean[-1]),
            # sources older than the previous block: before [last completed, partial] or before [last completed]
            "long_jump_mass": float(mean[1 : n - (2 if record.has_partial[r] else 1)].sum()),
            "sinks": sinks,
        })
    return {"routers": rows,
            "mean_entropy_ratio": float(np.mean([row["entropy_ratio"] for row in rows if row["n_sources"] > 1]))}
