"""The residual baseline and Attention Residuals (Kimi Team, "Attention Residuals", arXiv:2603.15031, Eq. 1-4 and 6;
the ablation knobs of its Table 4): their depth states, the router module and how their depth weights read.

Travels with checkpoints as remote code (a relative import of `depth_mixing.py`): imports only torch, transformers and
its sibling `mixing_base.py`.
"""

from typing import NamedTuple

import torch
from torch import nn

from transformers import initialization as init

from .mixing_base import AttnResRMSNorm, DepthRead, DepthWrite, RoutingMap, inverse_rms, stacked_norms, sublayer_name


def naive_attnres(
    sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference AttnRes router (paper Eq. 1-4), written for clarity; the spec the fast path is tested against.

    `alpha_i = softmax_i(query . RMSNorm(v_i))` (no `1/sqrt(d)`), `h = sum_i alpha_i v_i`, all in fp32.

    Args:
        sources: `n` tensors `v_i` of shape `(batch, seq_len, hidden_size)`, in depth order.
        query: pseudo-query `w_l`, shape `(hidden_size,)`.
        key_norm_weight: weight of the router's key RMSNorm, shape `(hidden_size,)`.
        eps: RMSNorm epsilon.

    Returns:
        `h` of shape `(batch, seq_len, hidden_size)` (fp32) and the depth weights `alpha` of shape
        `(batch, seq_len, n)` (fp32, rows sum to 1).
    """
    values = torch.stack([v.float() for v in sources], dim=-2)  # (B, T, n, D)
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * key_norm_weight.float()
    weights = torch.softmax(keys @ query.float(), dim=-1)  # (B, T, n)
    return (weights.unsqueeze(-1) * values).sum(-2), weights


class ResidualState(NamedTuple):
    """Standard residual stream (`depth_mixing="residual"`): `h_{l+1} = h_l + f_l(Norm(h_l))`. No modules."""

    hidden: torch.Tensor  # (B, T, D)

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "ResidualState":
        return cls(embeddings)

    def read_attn(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(ResidualState(self.hidden + output))

    def read_mlp(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(ResidualState(self.hidden + output))

    def read_final(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)


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


def attnres_source_norms(state: "AttnResState") -> torch.Tensor:
    """`||v_i||` of every source a router's input state holds: `(batch, seq_len, n)`, completed then partial."""
    norms = stacked_norms(state.sources)
    if state.partial is not None:
        norms = torch.cat([norms, stacked_norms((state.partial,))], dim=-1)
    return norms


class AttnResState(NamedTuple):
    """Depth state of Block AttnRes (paper Eq. 6; Full AttnRes is block size 1)."""

    sources: torch.Tensor  # (B, T, n, D): completed sources b_0 (embedding), b_1 .. b_{n-1} (block sums)
    inv_rms: torch.Tensor  # (B, T, n) fp32: 1/RMS of each completed source, the key norm statistics
    partial: torch.Tensor | None  # (B, T, D): b_n^{i-1}, the sum of the current block so far; None at its start
    eps: float
    block_size: int
    sublayer: int  # the index of the next sub-layer

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "AttnResState":
        eps = config.rms_norm_eps
        sources, statistics = embeddings.unsqueeze(-2), inverse_rms(embeddings, eps).unsqueeze(-1)
        return cls(sources, statistics, None, eps, config.attnres_block_size, 0)

    def begin_sublayer(self) -> "AttnResState":
        """Close the current block when the next sub-layer starts a new one (Eq. 6: `b_n^0` is no source)."""
        if self.sublayer % self.block_size or self.partial is None:
            return self
        # AttnRes: the block's key norm statistics are computed here, once per block, not once per router.
        sources = torch.cat([self.sources, self.partial.unsqueeze(-2)], dim=-2)  # (B, T, n+1, D)
        statistics = torch.cat([self.inv_rms, inverse_rms(self.partial, self.eps).unsqueeze(-1)], dim=-1)
        return self._replace(sources=sources, inv_rms=statistics, partial=None)

    def _add(self, output: torch.Tensor) -> DepthWrite:
        partial = output if self.partial is None else self.partial + output
        return DepthWrite(self._replace(partial=partial, sublayer=self.sublayer + 1))

    def _route(self, router) -> DepthRead:
        state = self.begin_sublayer()
        hidden, weights = router(state)
        return DepthRead(state, hidden, None, (weights,))

    def read_attn(self, mixing) -> DepthRead:
        return self._route(mixing.attn_res)

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return self._add(output)

    def read_mlp(self, mixing) -> DepthRead:
        return self._route(mixing.mlp_res)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        return self._add(output)

    def read_final(self, mixing) -> DepthRead:
        # The last block stays a partial sum: the same sources and numbers as closing it first.
        hidden, weights = mixing.final_res(self)
        return DepthRead(self, hidden, None, (weights,))


class AttnResRouter(nn.Module):
    """Attention over depth sources with a learned pseudo-query (paper Eq. 1-4 and 6), plus the ablation knobs of
    the paper's Table 4 (see `AttnResConfig`).

        logit_i = w_l . RMSNorm(v_i)          (Eq. 2-3; no 1/sqrt(d); fp32)
        alpha   = softmax_i(logit)            (Eq. 2)        h_l = sum_i alpha_i v_i       (Eq. 1)

    Knobs: `attnres_score_fn="sigmoid"` (alpha_i = sigmoid(logit_i), unnormalised); `attnres_key_norm=False`
    (logit_i = w_l . v_i); `attnres_window=W` (embedding + the W most recent sources); `attnres_query=
    "input_dependent"` (w_l + W_l RMSNorm(v_last), `query_proj` zero-initialised); `attnres_num_heads=H` (H slices of
    the hidden axis, each with its slice of the query and its own weights over depth); `attnres_scalar_weights`
    (logit_i = s_{i->l}, a learned scalar per source: input-independent).

    Parameters: `query` (`(hidden_size,)`, zero-initialised: uniform weights at step 0, which the paper requires),
    `key_norm` (an RMSNorm with its own weight), `query_proj` (input-dependent query only) or `logits` (scalar
    weights only, `(n_sources,)`, instead of query and key norm). No `nn.Linear`, so PEFT's `all-linear` leaves
    routers alone.
    """

    def __init__(self, config, sublayer: int):
        super().__init__()
        hidden_size = config.hidden_size
        self.rescale_output = config.attnres_rescale_output
        self.score_fn = config.attnres_score_fn
        self.window = config.attnres_window
        self.num_heads = config.attnres_num_heads
        self.query = self.key_norm = self.query_proj = self.logits = None
        if config.attnres_scalar_weights:
            self.logits = nn.Parameter(torch.zeros(attnres_num_sources(config, sublayer)))
        else:
            self.query = nn.Parameter(torch.zeros(hidden_size))
            if config.attnres_key_norm:
                self.key_norm = AttnResRMSNorm(hidden_size, eps=config.rms_norm_eps)
            if config.attnres_query == "input_dependent":
                self.query_proj = nn.Parameter(torch.zeros(hidden_size, hidden_size))

    def reset_parameters(self, std: float = 0.02) -> None:
        for param in (self.query, self.query_proj, self.logits):
            if param is not None:
                init.zeros_(param)
        if self.key_norm is not None:
            init.ones_(self.key_norm.weight)

    def _logits(self, sources, inv_rms, partial, partial_inv) -> torch.Tensor:
        """Scores `(B, T, n)` (or `(B, T, H, n)` with H heads) of the completed sources, then the partial sum."""
        if self.logits is not None:
            count = sources.shape[-2] + (partial is not None)
            return self.logits.float().expand(*sources.shape[:-2], count)
        query = self.query.float()  # (D,)
        if self.query_proj is not None:  # Table 4 "input-dependent query": a projection of the latest source
            last, last_inv = (partial, partial_inv) if partial is not None else (sources[..., -1, :], inv_rms[..., -1])
            query = query + (last.float() * last_inv.unsqueeze(-1)) @ self.query_proj.float().T  # (B, T, D)
        if self.key_norm is not None:
            # RMSNorm(v) . w = (v / rms(v)) . (w * g): fold the key-norm weight g into the query, so the per-source
            # statistics (`inv_rms`) are shared by every router of a block.
            query = query * self.key_norm.weight.float()
        # Scores of the completed sources, then of the partial block sum (no concatenation of the sources).
        logits = self._scores(sources.float(), query)  # (B, T, n) or (B, T, H, n)
        if self.key_norm is not None:
            logits = logits * (inv_rms if self.num_heads == 1 else inv_rms.unsqueeze(-2))
        if partial is not None:
            partial_logit = self._scores(partial.float().unsqueeze(-2), query)  # (..., 1)
            if self.key_norm is not None:
                scale = partial_inv if self.num_heads == 1 else partial_inv.unsqueeze(-1)
                partial_logit = partial_logit * scale.unsqueeze(-1)
            logits = torch.cat([logits, partial_logit], dim=-1)
        return logits

    def _scores(self, values: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """`values . query` per source: `(B, T, n, D)` -> `(B, T, n)`, or `(B, T, H, n)` per head slice."""
        if self.num_heads == 1:
            return values @ query if query.dim() == 1 else (values @ query.unsqueeze(-1)).squeeze(-1)
        heads = values.unflatten(-1, (self.num_heads, -1))  # (B, T, n, H, D/H)
        query = query.unflatten(-1, (self.num_heads, -1)).expand(*heads.shape[:2], self.num_heads, -1)
        return torch.einsum("btnhe,bthe->bthn", heads, query)

    def forward(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor]:
        """Route `state` into one sub-layer input.

        Returns `h` of shape `(batch, seq_len, hidden_size)` in the sources' dtype and the depth weights in fp32:
        `(batch, seq_len, n_sources)` (`(batch, seq_len, heads, n_sources)` with `attnres_num_heads > 1`), completed
        sources in depth order, then the partial block sum.
        """
        sources, inv_rms, partial = state.sources, state.inv_rms, state.partial
        if self.window is not None:  # Table 4 "sliding window": the embedding and the W most recent sources
            keep = self.window - (partial is not None)
            if sources.shape[-2] - 1 > keep:
                sources = torch.cat([sources[..., :1, :], sources[..., sources.shape[-2] - keep :, :]], dim=-2)
                inv_rms = torch.cat([inv_rms[..., :1], inv_rms[..., inv_rms.shape[-1] - keep :]], dim=-1)
        need_partial_inv = partial is not None and (self.key_norm is not None or self.query_proj is not None)
        partial_inv = inverse_rms(partial, state.eps) if need_partial_inv else None
        logits = self._logits(sources, inv_rms, partial, partial_inv)
        if self.score_fn == "sigmoid":
            weights, factor = torch.sigmoid(logits), 2.0  # sigmoid(0) = 1/2: x2 makes zero scores the residual sum
        else:
            weights, factor = torch.softmax(logits, dim=-1), logits.shape[-1]
        mix = (weights * factor if self.rescale_output else weights).to(sources.dtype)
        n = sources.shape[-2]
        if self.num_heads == 1:
            hidden = (mix[..., None, :n] @ sources).squeeze(-2)  # (B, T, 1, n) @ (B, T, n, D) -> (B, T, D)
            if partial is not None:
                hidden = hidden + mix[..., n:] * partial
        else:
            hidden = torch.einsum("bthn,btnhe->bthe", mix[..., :n], sources.unflatten(-1, (self.num_heads, -1)))
            if partial is not None:
                hidden = hidden + mix[..., n:] * partial.unflatten(-1, (self.num_heads, -1))
            hidden = hidden.flatten(-2)  # (B, T, H, D/H) -> (B, T, D)
        return hidden, weights



class AttnResLayerModules(NamedTuple):
    """The routers of decoder layer `i`: before its attention (sub-layer `2 i`) and before its MLP (`2 i + 1`)."""

    attn_res: AttnResRouter
    mlp_res: AttnResRouter

    @classmethod
    def build(cls, config, layer_idx: int) -> "AttnResLayerModules":
        return cls(AttnResRouter(config, 2 * layer_idx), AttnResRouter(config, 2 * layer_idx + 1))


class AttnResFinalModules(NamedTuple):
    """AttnRes: a final router aggregates all sources before the last norm (paper text; its README pseudocode omits
    it)."""

    final_res: AttnResRouter

    @classmethod
    def build(cls, config) -> "AttnResFinalModules":
        return cls(AttnResRouter(config, config.num_sublayers))
