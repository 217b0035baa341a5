"""Attention Residuals in their reference form (Kimi Team, "Attention Residuals", arXiv:2603.15031): the plain
router of Eq. 1-4 that the fast paths are tested against, and the sources each router reads (Eq. 6: the embedding,
the completed blocks, and inside a block its partial sum), with the common source axis and the routing maps that the
routing tools lay the depth weights out on, and the sources' norms.

Travels with checkpoints as remote code (a relative import of `mixing_attnres.py` and `depth_mixing.py`): imports only
torch and its siblings `mixing_base.py` and `ops_naive.py` (whose `attnres` is the reference read).
"""

import torch

from .mixing_base import RoutingMap, stacked_norms, sublayer_name
from .ops_naive import attnres


def naive_attnres(
    sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference AttnRes router (paper Eq. 1-4), written for clarity; the spec the fast path is tested against:
    `ops_naive.attnres` over every source given (the partial sum, if any, last) in fp32.

    `alpha_i = softmax_i(query . RMSNorm(v_i))` (no `1/sqrt(d)`), `h = sum_i alpha_i v_i`, all in fp32.

    Args:
        sources: `n` tensors `v_i` of shape `(batch, seq_len, hidden_size)`, in depth order.
        query: pseudo-query `w_l`, shape `(hidden_size,)`.
        key_norm_weight: weight of the router's key RMSNorm, shape `(hidden_size,)`.
        eps: RMSNorm epsilon.

    Returns:
        `h` of shape `(batch, seq_len, hidden_size)` (fp32) and the depth weights `alpha` of shape
        `(batch, seq_len, n)` (fp32, rows sum to 1).

    Raises:
        ValueError: on no sources.
    """
    return attnres([v.float() for v in sources], query.float(), key_norm_weight.float(), eps=eps)


# ---------------------------------------------------------------------------------------------------------------
# Sources of each router (Eq. 6): the one definition the router, the routing tools and the tests read
# ---------------------------------------------------------------------------------------------------------------


def attnres_source_columns(config, sublayer: int) -> list[int]:
    """Sources of the router before sub-layer `sublayer` (`2 L`: the final router), as columns of the common source
    axis `attnres_source_names(config)`, in the order of its depth weights: the embedding (0), the completed blocks
    (Full AttnRes: sub-layer outputs) and, inside a block, its partial sum (Eq. 6), which takes the column of the
    block it belongs to. A sliding window (`attnres_window=W`) keeps the embedding and the `W` most recent others."""
    size = config.attnres_block_size
    completed = sublayer // size
    columns = list(range(completed + 1)) + ([completed + 1] if sublayer % size else [])
    window = config.attnres_window
    if window is not None and len(columns) - 1 > window:
        columns = [0, *columns[len(columns) - window:]]
    return columns


def attnres_num_sources(config, sublayer: int) -> int:
    """Number of sources of the router before sub-layer `sublayer` (see `attnres_source_columns`)."""
    return len(attnres_source_columns(config, sublayer))


def attnres_source_names(config) -> list[str]:
    """The common source axis: `embedding`, then each sub-layer output (`0.attn`, `0.mlp`, ...; Full AttnRes) or each
    block with its sub-layer range (`block 1 [0.attn-1.mlp]`, ...; Block AttnRes)."""
    size, total = config.attnres_block_size, config.num_sublayers
    if size == 1:
        return ["embedding"] + [sublayer_name(i) for i in range(total)]
    return ["embedding"] + [f"block {n} [{sublayer_name(start)}-{sublayer_name(min(start + size, total) - 1)}]"
                            for n, start in enumerate(range(0, total, size), start=1)]


def attnres_routing_maps(config) -> list[RoutingMap]:
    """One map per router in depth order (`model.layers.0.attn_res`, `model.layers.0.mlp_res`, ...,
    `model.final_res`); one row per head with `attnres_num_heads > 1`."""
    maps = []
    for sublayer in range(config.num_sublayers + 1):
        if sublayer == config.num_sublayers:
            module, label = "model.final_res", "final"
        else:
            kind = "attn" if sublayer % 2 == 0 else "mlp"
            module, label = f"model.layers.{sublayer // 2}.{kind}_res", f"L{sublayer // 2} {kind}"
        heads = config.attnres_num_heads
        rows = [label] if heads == 1 else [f"{label} h{h}" for h in range(heads)]
        maps.append(RoutingMap(module, rows, attnres_source_columns(config, sublayer),
                               partial=sublayer % config.attnres_block_size != 0))
    return maps


def attnres_source_norms(state) -> torch.Tensor:
    """`||v_i||` of every source a router's input state holds (an `AttnResState`, `mixing_attnres.py`): `(batch,
    seq_len, n)` fp32, the completed sources, then the partial block sum."""
    norms = stacked_norms(state.sources)
    if state.partial is not None:
        norms = torch.cat([norms, stacked_norms((state.partial,))], dim=-1)
    return norms
