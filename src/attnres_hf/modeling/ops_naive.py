"""The AttnRes read in its reference form (Kimi Team, "Attention Residuals", arXiv:2603.15031, Eq. 1-4 over the
sources of Eq. 6): every source stacked, key-normed, scored and summed in plain torch, in fp32 or wider (float64
inputs stay float64, for the tests' exact references). The spec the other implementations of the one signature
(`ops.py`: `ops_torch.py`, `ops_triton.py`, `ops_fla.py`) are tested against, as fla's `naive_attnres` is for its
`fused_attnres`.

Travels with checkpoints as remote code (a relative import of `ops.py` and `attnres_reference.py`): imports only
torch.
"""

from collections.abc import Sequence

import torch


def attnres(
    sources: torch.Tensor | Sequence[torch.Tensor],
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
    """One AttnRes read (paper Eq. 1-4; Block AttnRes's sources, Eq. 6: the completed ones, then the partial sum).

        logit_i = query . RMSNorm(v_i)       (Eq. 2-3; no 1/sqrt(d); without the key norm: query . v_i)
        alpha   = softmax_i(logit)           (Eq. 2; `sigmoid`: alpha_i = sigmoid(logit_i), Table 4)
        h       = output_scale * sum_i alpha_i v_i                                                  (Eq. 1)

    Computed in `promote(sources' dtype, float32)`: fp32 for fp32, bf16 and fp16 sources, float64 for float64 ones.

    Args:
        sources: the `n` completed sources, `(n, batch, seq_len, hidden_size)` slot-major, or a sequence of `n`
            `(batch, seq_len, hidden_size)` tensors, in depth order; any float dtype, one for all.
        query: the pseudo-query `w_l`, `(hidden_size,)`.
        key_norm_weight: the key RMSNorm's weight `(hidden_size,)`; `None`: a weight of ones (or folded into
            `query` already: `RMSNorm(v) . w = (v / rms(v)) . (w * g)`).
        partial: the current block's partial sum `b_n^{i-1}` `(batch, seq_len, hidden_size)` (Eq. 6), the last
            source; `None` at a block's start and in Full AttnRes.
        key_norm: whether the keys are RMS-normalised (the paper's router; `False`: Table 4's ablation).
        eps: the key norm's epsilon.
        sigmoid: sigmoid scores instead of the softmax over the sources.
        output_scale: multiplies the mixing weights, not the returned depth weights (`attnres_rescale_output`).
        inv_rms: the completed sources' `1/RMS`, `(batch, seq_len, n)` (saved statistics; computed when `None`).
        return_weights: whether to return the depth weights (`None` in their place otherwise).

    Returns:
        `h (batch, seq_len, hidden_size)` in the sources' dtype and the depth weights `alpha (batch, seq_len, n
        [+ 1])` in the computing dtype (completed sources in depth order, then the partial sum; softmax rows sum
        to 1), or `None`.

    Raises:
        ValueError: on no sources.
    """
    if len(sources) == 0:
        raise ValueError("attnres needs at least one source (the embedding)")
    listed = list(sources.unbind(0)) if isinstance(sources, torch.Tensor) else list(sources)
    dtype = listed[0].dtype
    compute = torch.promote_types(dtype, torch.float32)
    values = torch.stack([v.to(compute) for v in listed], dim=-2)  # (B, T, n, D)
    inverse = torch.rsqrt(values.pow(2).mean(-1) + eps) if inv_rms is None else inv_rms.to(compute)  # (B, T, n)
    if partial is not None:
        part = partial.to(compute)
        values = torch.cat([values, part.unsqueeze(-2)], dim=-2)  # (B, T, n + 1, D)
        inverse = torch.cat([inverse, torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + eps)], dim=-1)
    keys = values * inverse.unsqueeze(-1) if key_norm else values
    if key_norm and key_norm_weight is not None:
        keys = keys * key_norm_weight.to(compute)
    logits = keys @ query.to(compute)  # (B, T, n [+ 1])
    weights = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    hidden = ((weights * output_scale).unsqueeze(-1) * values).sum(-2)
    return hidden.to(dtype), weights if return_weights else None
