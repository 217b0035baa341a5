"""The AttnRes read in torch, with the signature of the reference (`ops_naive.attnres`; arXiv:2603.15031, Eq. 1-4
over the sources of Eq. 6): one pass (`attnres`: the completed sources scored in one product and summed in one
batched product, the partial sum joined without concatenating the sources), and two-phase block inference (the
paper's Algorithm 1: `phase1`, every router of a block against the completed sources at once, then `merge`, each
router's online-softmax update with its partial sum; `two_phase` chains them for one router).

Sources are a tensor `(n, batch, seq_len, hidden_size)` (plain autograd), a sequence of `(batch, seq_len,
hidden_size)` tensors (stacked), or the model's `attnres_buffer.SourceBuffer`, read through the buffer's autograd
Functions (no saved copy of the sources, eager training's in-place gradient sums): the same arithmetic either way.
Arithmetic is fp32 (float64 for float64 sources); outputs are in the sources' dtype, depth weights in fp32.

Travels with checkpoints as remote code (a relative import of `ops.py`): imports only torch and its siblings
`attnres_buffer.py`, `attnres_read.py`, `attnres_two_phase.py` and `mixing_base.py`.
"""

from collections.abc import Sequence

import torch

from .attnres_buffer import SourceBuffer, _as, _mix, _read_sources, _scores, _SourceMix, _SourceScores
from .attnres_read import _SourceRead, _SourceStatistics
from .attnres_two_phase import _merge_partial, _merged_weights, _PartialMerge
from .mixing_base import inverse_rms

Sources = torch.Tensor | Sequence[torch.Tensor] | SourceBuffer
"""What the ops read: see the module docstring."""


def _prepared(sources: Sources) -> tuple[torch.Tensor | SourceBuffer, int, torch.dtype]:
    """`(what the products read, n, the sources' dtype)`; a sequence is stacked slot-major `(n, B, T, D)`."""
    if isinstance(sources, SourceBuffer):
        return sources, len(sources.sources), sources.buffer.dtype
    if not isinstance(sources, torch.Tensor):
        if len(sources) == 0:
            raise ValueError("attnres needs at least one source (the embedding)")
        sources = torch.stack(list(sources))  # (n, B, T, D)
    if sources.dim() != 4 or sources.shape[0] == 0:
        raise ValueError(f"sources must be (n, batch, seq_len, hidden_size) with n >= 1, got {tuple(sources.shape)}")
    return sources, sources.shape[0], sources.dtype


def buffered(sources: Sources) -> SourceBuffer:
    """The sources as the fused kernels' autograd Functions read them (`ops_triton.py`, `ops_fla.py`): the model's
    buffer as it is; a tensor `(n, B, T, D)` (or a sequence, stacked) as a contiguous buffer whose slots' gradients
    flow back through `unbind`.

    Raises:
        ValueError: as `attnres`.
    """
    if isinstance(sources, SourceBuffer):
        return sources
    values = _prepared(sources)[0]
    slots = values.unbind(0)
    return SourceBuffer(values.detach().contiguous(), slots, slots, None)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inverse_rms(x: torch.Tensor, eps, compute: torch.dtype) -> torch.Tensor:
    """`1/RMS(x)` over the last axis in `compute` (`mixing_base.inverse_rms` in fp32: its operator calls)."""
    if compute == torch.float32:
        return inverse_rms(x, eps)
    return torch.rsqrt(x.to(compute).pow(2).mean(-1) + eps)


def _holds_statistics(read) -> bool:
    """Whether `read` is the model's buffer holding its sources' key-norm statistics (`_SourceGrads.inv`)."""
    return isinstance(read, SourceBuffer) and read.grads is not None and read.grads.inv is not None


def _source_inverse_rms(read, n: int, eps, compute: torch.dtype) -> torch.Tensor:
    """The completed sources' `1/RMS`, `(B, T, n)`, when no saved statistics were given: the buffer's own
    (`_SourceGrads.inv`, through `_SourceStatistics` with gradients), else computed."""
    if _holds_statistics(read):
        if torch.is_grad_enabled() and any(h.requires_grad for h in read.handles):
            return _SourceStatistics.apply(read.grads, n, *read.handles)
        return read.grads.inv[:n, ..., 0].permute(1, 2, 0)
    if isinstance(read, SourceBuffer):
        return torch.stack([_inverse_rms(source, eps, compute) for source in read.sources], dim=-1)
    return _inverse_rms(read, eps, compute).permute(1, 2, 0)


def key_norm_statistics(sources: Sources, eps: float = 1e-6) -> torch.Tensor:
    """The key norm's statistics of the completed sources, `1/RMS(v_i)` (paper Eq. 3's RMSNorm without its weight):
    `(batch, seq_len, n)` fp32 (float64 for float64 sources), differentiable. The model's buffer gives its own where
    it holds them (Full AttnRes's torch training, `attnres_buffer._SourceGrads.inv`), else they are computed.

    Raises:
        ValueError: as `attnres`.
    """
    read, n, dtype = _prepared(sources)
    return _source_inverse_rms(read, n, eps, _compute_dtype(dtype))


def _read_scores(read, queries: torch.Tensor) -> torch.Tensor:
    """`queries (S, D)` against the completed sources: `(B, T, S, n)` in the queries' dtype."""
    if isinstance(read, SourceBuffer):
        return _read_sources(_SourceScores, _scores, read, queries)
    return _scores(read, queries)


def _read_mix(read, weights: torch.Tensor) -> torch.Tensor:
    """`weights (B, T, S, n)` (the sources' dtype) times the completed sources: `(B, T, S, D)`."""
    if isinstance(read, SourceBuffer):
        return _read_sources(_SourceMix, _mix, read, weights)
    return _mix(read, weights)


def _folded(query: torch.Tensor, key_norm_weight: torch.Tensor | None, compute: torch.dtype) -> torch.Tensor:
    """`query * g` in `compute` (`RMSNorm(v) . w = (v / rms(v)) . (w * g)`: the weight folded into the query, so the
    sources' `1/RMS` statistics serve every router)."""
    query = _as(query, compute)
    return query if key_norm_weight is None else query * _as(key_norm_weight, compute)


def attnres(
    sources: Sources,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    partial: torch.Tensor | None = None,
    key_norm: bool = True,
    eps: float = 1e-6,
    sigmoid: bool = False,
    output_scale: float = 1.0,
    inv_rms: torch.Tensor | None = None,
    return_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One AttnRes read in one pass (paper Eq. 1-4 over the sources of Eq. 6): `ops_naive.attnres`'s arguments,
    shapes and results (see there), `sources` as in this module's docstring. The scores of the completed sources are
    one `(n B T, D) @ (D, 1)` product scaled by their `1/RMS` (`inv_rms`, the saved statistics, else computed), the
    partial sum's is its own, and the weighted sum is one batched product plus the partial sum's share.

    Returns:
        `h (batch, seq_len, hidden_size)` in the sources' dtype and the depth weights `(batch, seq_len, n [+ 1])` in
        fp32 (float64 for float64 sources), or `None` without `return_weights`.

    Raises:
        ValueError: on no sources, or sources not shaped `(n, batch, seq_len, hidden_size)`.
    """
    read, n, dtype = _prepared(sources)
    compute = _compute_dtype(dtype)
    query = _folded(query, key_norm_weight, compute)
    if partial is None and isinstance(read, SourceBuffer) and torch.is_grad_enabled() and (
            query.requires_grad or any(h.requires_grad for h in read.handles)):  # the whole read in one Function
        statistics = key_norm and inv_rms is None and _holds_statistics(read)  # (`_SourceGrads.inv`)
        inv = None
        if key_norm and not statistics:
            inv = inv_rms if inv_rms is not None else _source_inverse_rms(read, n, eps, compute)
        hidden, weights = _SourceRead.apply(read.buffer, read.grads, n, query, inv, statistics, sigmoid, output_scale,
                                            return_weights, *read.handles)
        return hidden, weights.view(n, -1).T.view(*hidden.shape[:-1], n) if return_weights else None
    logits = _read_scores(read, query.unsqueeze(0)).squeeze(-2)  # (B, T, n)
    if key_norm:
        logits = logits * (inv_rms if inv_rms is not None else _source_inverse_rms(read, n, eps, compute))
    if partial is not None:
        logit = _as(partial, compute) @ query  # (B, T)
        if key_norm:
            logit = logit * _inverse_rms(partial, eps, compute)
        logits = torch.cat([logits, logit.unsqueeze(-1)], dim=-1)  # (B, T, n + 1)
    weights = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    mix = _as(weights if output_scale == 1.0 else weights * output_scale, dtype)
    completed = mix if partial is None else mix.narrow(-1, 0, n)
    hidden = _read_mix(read, completed.unsqueeze(-2)).squeeze(-2)  # (B, T, D)
    if partial is not None:
        hidden = hidden + mix.narrow(-1, n, 1) * partial
    return hidden, weights if return_weights else None


def phase1(
    sources: Sources,
    queries: torch.Tensor,
    key_norm_weights: torch.Tensor | None = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
    sigmoid: bool = False,
    inv_rms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Phase 1 of two-phase block inference (paper Algorithm 1): the `S` routers of a block against its completed
    sources, one product for the scores and one for the weighted sums.

    Args:
        sources: the completed sources (this module's docstring).
        queries: the block's pseudo-queries `(S, hidden_size)`.
        key_norm_weights: their key norms' weights `(S, hidden_size)`, or `None` (ones, or folded into `queries`).
        key_norm, eps, sigmoid, inv_rms: as `attnres`'s.

    Returns:
        `probs (B, T, S, n)` fp32 (the softmax over the completed sources; `sigmoid`: each one's sigmoid), `lse
        (B, T, S)` fp32, their logits' log-sum-exp (`None` with `sigmoid`), and `mixed (B, T, S, D)` in the sources'
        dtype, `sum_i probs_i v_i` (float64 throughout for float64 sources).

    Raises:
        ValueError: as `attnres`.
    """
    read, n, dtype = _prepared(sources)
    compute = _compute_dtype(dtype)
    queries = _folded(queries, key_norm_weights, compute)
    logits = _read_scores(read, queries)  # (B, T, S, n)
    if key_norm:
        inv = inv_rms if inv_rms is not None else _source_inverse_rms(read, n, eps, compute)
        logits = logits * inv.unsqueeze(-2)
    if sigmoid:
        probs, lse = torch.sigmoid(logits), None
    else:
        probs, lse = torch.softmax(logits, dim=-1), torch.logsumexp(logits, dim=-1)
    return probs, lse, _read_mix(read, _as(probs, dtype))


def merge(
    probs: torch.Tensor,
    lse: torch.Tensor | None,
    mixed: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
    output_scale: float = 1.0,
    return_weights: bool = True,
    sources: Sources | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Phase 2 (paper Algorithm 1): one router's phase-1 result merged with its block's partial sum. Softmax: the
    completed sources keep `sigmoid(lse - p)` of the mass and the partial sum gets the rest, `p` its logit (the
    online-softmax update); sigmoid scores (`lse` is `None`): `h = mixed + sigmoid(p) partial`.

    Args:
        probs: this router's phase-1 weights `(B, T, n)` fp32; `lse`: `(B, T)` fp32 or `None` (sigmoid scores);
            `mixed`: `(B, T, D)` in the stream dtype (one router's slices of `phase1`'s results).
        partial: the partial sum `(B, T, D)`, in `mixed`'s dtype.
        query, key_norm_weight, key_norm, eps, output_scale, return_weights: as `attnres`'s.
        sources: the completed sources `phase1` read. Given, and with gradients, the merge keeps the partial sum
            and per-token scalars for backward, not `mixed`, which it recomputes from them and `probs`
            (`attnres_two_phase._PartialMerge`, the model's training path; its complement `1 - share` keeps its
            digits where plain autograd's does not, e.g. a bf16 partial sum's gradient).

    Returns:
        `h (B, T, D)` in the partial sum's dtype and the depth weights `(B, T, n + 1)` fp32, or `None`.
    """
    compute = _compute_dtype(partial.dtype)
    query = _folded(query, key_norm_weight, compute)
    arguments = (partial, mixed, query, lse, eps, key_norm)
    if sources is not None and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in arguments[:4]):
        read = buffered(sources)  # (phase 1's weights detached: their gradient flows through `mixed`)
        weights = _as(probs, read.buffer.dtype).detach()
        hidden, logit = _PartialMerge.apply(read.buffer, len(read.sources), weights, *arguments)
    else:
        hidden, logit = _merge_partial(*arguments)[:2]
    if output_scale != 1.0:
        hidden = hidden * output_scale
    return hidden, _merged_weights(probs, lse, logit) if return_weights else None


def two_phase(
    sources: Sources,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    partial: torch.Tensor | None = None,
    key_norm: bool = True,
    eps: float = 1e-6,
    sigmoid: bool = False,
    output_scale: float = 1.0,
    inv_rms: torch.Tensor | None = None,
    return_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attnres` as the two phases compute it for one router (`phase1` with `S = 1`, then `merge`): the same
    arguments and results, the numbers equal to fp32 round-off."""
    probs, lse, mixed = (t if t is None else t.squeeze(2) for t in phase1(
        sources, query.unsqueeze(0), None if key_norm_weight is None else key_norm_weight.unsqueeze(0),
        key_norm=key_norm, eps=eps, sigmoid=sigmoid, inv_rms=inv_rms))
    if partial is None:
        return (mixed if output_scale == 1.0 else mixed * output_scale), probs if return_weights else None
    return merge(probs, lse, mixed, partial, query, key_norm_weight, key_norm=key_norm, eps=eps,
                 output_scale=output_scale, return_weights=return_weights, sources=sources)
