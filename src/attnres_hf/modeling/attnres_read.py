"""Full AttnRes's read of the source buffer as one autograd Function (arXiv:2603.15031, Eq. 1-4 over the sources
of Eq. 6: scores, softmax or sigmoid, weighted sum; `_SourceRead`), and the key norm's statistics that the buffer's
accumulator holds for it, as a tensor for the reads that take them as an input (`_SourceStatistics`). Both read the
buffer instead of saved copies of the sources and, in eager training, sum the sources' gradients in place
(`attnres_buffer._SourceGrads`).

Travels with checkpoints as remote code (a relative import of `ops_torch.py`): imports only torch and its sibling
`attnres_buffer.py`.
"""

import torch
from torch.autograd.function import once_differentiable

from .attnres_buffer import _as, _nones, _per_source, _SourceGrads


class _SourceRead(torch.autograd.Function):
    """One router's whole read of the buffer's first `n` slots without a partial sum (Full AttnRes; a Block model's
    direct reads of completed sources): the scores `w . v_i` (times the sources' `1/RMS` `inv` with the key norm),
    their softmax (or sigmoid) over the sources and the weighted sum, in one Function whose backward reads the buffer
    (see `_SourceScores`) in few operator calls: the weights' gradient in one batched product, the softmax's backward
    in three calls, the query's in one batched product, and the sources' terms added to their sums in place
    (`_SourceGrads`: the mixing term directly, the score term written into the read's column of the score terms,
    which each slot adds once for all its readers), or returned per source where the pass cannot sum in place.

    Inputs: `query (D,)` fp32 (float64 for a float64 buffer; the key-norm weight folded in), `inv (B, T, n)` in the
    query's dtype or `None`, `statistics` (with `inv` `None`: the key norm's statistics are `grads.inv`, their gradient
    summed by `grads.add_inv`), `sigmoid`, `scale` (`output_scale`), `return_weights`, then the slots' handles.
    Returns `h (B, T, D)` in the buffer's dtype and, with `return_weights`, the depth weights slot-major, `(n, B T, 1)`
    in the query's dtype (differentiable: their gradient joins the output's), else `None`."""

    @staticmethod
    def forward(ctx, buffer, grads, n, query, inv, statistics, sigmoid, scale, return_weights, *handles):
        _, batch, seq, dim = buffer.shape
        # (n, D, B T), (B T, n, D): views. The scores as n `(1, D) @ (D, B T)` products: on a CPU faster than one
        # `(n B T, D) @ (D,)` product (`mv`), which reads the same rows (docs/speed.md)
        by_slot_t, by_token = _by_slot_t(buffer, grads, n), _by_token(buffer, grads, n)
        raw = torch.bmm(query.expand(n, 1, dim), _as(by_slot_t, query.dtype)).view(n, -1, 1)  # (n, B T, 1)
        # (the statistics' slots, never written again once read: kept on ctx, not saved, as the buffer)
        inv_t = grads.inv_rows[:n] if statistics else None if inv is None else inv.reshape(-1, n).T.unsqueeze(-1)
        logits = raw if inv_t is None else raw * inv_t
        weights = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=0)  # (n, B T, 1)
        mix = _as(weights if scale == 1.0 else weights * scale, buffer.dtype)
        # (token-major weights: with a batch stride of 1, CPU `bmm` copied each token's row, a loop over B T)
        hidden = torch.bmm(mix.permute(1, 2, 0).contiguous(), by_token).view(batch, seq, dim)
        ctx.column = None if grads is None else grads.register(1, query)  # (its score terms' column, `_SourceGrads`)
        ctx.buffer, ctx.grads, ctx.n, ctx.sigmoid, ctx.scale = buffer, grads, n, sigmoid, scale
        ctx.by_slot_t, ctx.by_token, ctx.statistics = by_slot_t, by_token, inv_t if statistics else None
        ctx.save_for_backward(query, weights, None if inv_t is None else raw, None if statistics else inv_t)
        ctx.set_materialize_grads(False)
        return hidden, weights if return_weights else None  # (saving an output costs two aliases: only if asked)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hidden, grad_weights):
        query, weights, raw, inv_t = ctx.saved_tensors  # weights (n, B T, 1)
        n, buffer, scale = ctx.n, ctx.buffer, ctx.scale
        statistics = ctx.statistics is not None
        inv_t = ctx.statistics if statistics else inv_t
        _, batch, seq, dim = buffer.shape
        grad = None if grad_hidden is None else _as(grad_hidden, buffer.dtype).reshape(-1, 1, dim)  # (B T, 1, D)
        grad_w = None if grad_weights is None else _as(grad_weights, weights.dtype)
        if grad is not None:  # d h / d weight_i = scale v_i: one (B T, 1, D) @ (B T, D, n) product
            from_hidden = torch.bmm(grad, ctx.by_token.transpose(1, 2)).permute(2, 0, 1)  # (n, B T, 1)
            from_hidden = _as(from_hidden, weights.dtype) if scale == 1.0 else _as(from_hidden, weights.dtype) * scale
            grad_w = from_hidden if grad_w is None else grad_w + from_hidden
        if ctx.sigmoid:  # d sigmoid(x) = s (1 - s)
            grad_logits = weights * (1 - weights) * grad_w  # (the weights first: their layout, slot-major)
        else:  # softmax: w * (g - sum_i w_i g_i)
            product = weights * grad_w
            grad_logits = torch.addcmul(product, weights, product.sum(0, keepdim=True), value=-1)
        needs = ctx.needs_input_grad[9:]
        sums = ctx.grads.open() if ctx.grads is not None and any(needs) else None
        # d L / d (w . v_i), (n, B T, 1): with in-place sums, written into this read's column of the score terms
        # (`_SourceGrads.score_columns`, a strided view), which `take` adds to each slot's sum
        if sums is not None:
            columns = sums.score_columns(n, ctx.column)
            coefficients = columns.copy_(grad_logits) if inv_t is None else torch.mul(grad_logits, inv_t, out=columns)
        else:
            coefficients = grad_logits if inv_t is None else grad_logits * inv_t
        grad_query = grad_inv = None
        if ctx.needs_input_grad[3]:  # n (1, B T) @ (B T, D) products (the strided column read in place), summed
            keys = _as(ctx.by_slot_t, query.dtype).transpose(1, 2)  # (n, B T, D)
            grad_query = torch.bmm(coefficients.transpose(1, 2), keys).sum((0, 1))
        if inv_t is not None and not statistics and ctx.needs_input_grad[4]:
            grad_inv = (grad_logits * raw).permute(1, 2, 0).view(batch, seq, n)
        nones = (None, None, None, grad_query, grad_inv, None, None, None, None)
        if not any(needs):
            return *nones, *_nones(needs)
        mix = _as(weights if scale == 1.0 else weights * scale, buffer.dtype)  # (n, B T, 1)
        grad = None if grad is None else grad.transpose(0, 1)  # (1, B T, D)
        if sums is not None:  # slot i += mix_i grad, in place (all n: slots none needs are never handed theirs)
            if grad is not None:
                sums.sum_rows(n).addcmul_(mix, grad)
            if statistics:  # d L / d inv_i (`take` applies the norm's chain rule)
                sums.add_inv(n, grad_logits * raw)
            return *nones, *_nones(needs)
        grad_values = coefficients * query  # (n, B T, D)
        if grad is not None:
            grad_values = torch.addcmul(grad_values, mix, grad)
        if statistics:  # d inv / d v = -inv^3 v / D
            grad_values = torch.addcmul(grad_values, grad_logits * raw * inv_t.pow(3), ctx.by_slot_t.transpose(1, 2),
                                        value=-1 / dim)
        return *nones, *_per_source(grad_values.view(n, batch, seq, dim), ctx, n, first=9)


class _SourceStatistics(torch.autograd.Function):
    """The key norm's statistics of the buffer's first `n` slots (`_SourceGrads.inv`) as a tensor `(B, T, n)`, for
    the reads that take them as an input (a partial sum's read): their gradient is summed in place
    (`_SourceGrads.add_inv`), or, where the pass cannot, handed to each source as `-inv^3 v / D` times it."""

    @staticmethod
    def forward(ctx, grads, n, *handles):
        ctx.grads, ctx.n, ctx.buffer = grads, n, grads.buffer
        return grads.inv[:n].permute(1, 2, 3, 0).reshape(*grads.buffer.shape[1:-1], n)  # (a copy: its own tensor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # (B, T, n)
        grads, n = ctx.grads, ctx.n
        terms = grad.reshape(-1, n).T.unsqueeze(-1)  # (n, B T, 1)
        sums = grads.open()
        if sums is not None:
            sums.add_inv(n, terms)
            return None, None, *_nones(ctx.needs_input_grad[2:])
        values = grads.buffer[:n]
        coefficients = (terms * grads.inv_rows[:n].pow(3)).view(*values.shape[:-1], 1)
        return None, None, *_per_source(coefficients * values * (-1 / values.shape[-1]), ctx, n, first=2)


def _by_slot_t(buffer: torch.Tensor, grads: _SourceGrads | None, n: int) -> torch.Tensor:
    """The buffer's first `n` slots feature-major, `(n, D, B T)` (a strided view)."""
    if grads is not None:
        return grads.by_slot_t[:n]
    return buffer[:n].view(n, -1, buffer.shape[-1]).transpose(1, 2)


def _by_token(buffer: torch.Tensor, grads: _SourceGrads | None, n: int) -> torch.Tensor:
    """The buffer's first `n` slots token-major, `(B T, n, D)` (a strided view)."""
    if grads is not None:
        return grads.by_token[:, :n]
    return buffer[:n].view(n, -1, buffer.shape[-1]).transpose(0, 1)
