"""The residual baseline and Attention Residuals (Kimi Team, "Attention Residuals", arXiv:2603.15031, Eq. 1-4 and 6;
the ablation knobs of its Table 4): their depth states, the router module and how their depth weights read.

Travels with checkpoints as remote code (a relative import of `depth_mixing.py`): imports only torch, transformers and
its sibling `mixing_base.py`.
"""

import math
from itertools import islice
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.module import _global_forward_pre_hooks

from transformers import initialization as init

from .mixing_base import (AttnResRMSNorm, DepthRead, DepthWrite, RoutingMap, inverse_rms, registered_modules,
                          stacked_norms, sublayer_name)


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
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "ResidualState":
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


# ---------------------------------------------------------------------------------------------------------------
# The source buffer: completed sources written once, in place, read by every router through views
# ---------------------------------------------------------------------------------------------------------------


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without a dispatch when it is one already (a decoded token runs hundreds of these)."""
    return x if x.dtype == dtype else x.to(dtype)


def _scores(values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """`values (n, B, T, D)` (slot-major, contiguous) against `queries (S, D)` -> `(B, T, S, n)`, in the queries'
    dtype: one `(n B T, D) @ (D, S)` product (a view, no copy of the sources in fp32 models)."""
    n, batch, seq, dim = values.shape
    flat = _as(values.reshape(n * batch * seq, dim), queries.dtype)
    return (flat @ queries.T).view(n, batch, seq, -1).permute(1, 2, 3, 0)


def _mix(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`weights (B, T, S, n)` (the values' dtype) times `values (n, B, T, D)` -> `(B, T, S, D)`: one batched product
    over the `B T` positions, reading the sources through a strided view (no copy)."""
    n, batch, seq, dim = values.shape
    per_token = values.reshape(n, batch * seq, dim).transpose(0, 1)  # (B T, n, D), strided view
    return torch.bmm(weights.reshape(batch * seq, -1, n), per_token).view(batch, seq, -1, dim)


class _SourceGrads:
    """The gradients of one forward's source buffer, summed in place (eager training).

    Autograd's own way hands every reader's gradient to each source it read and sums them there: one `(B, T, D)` sum
    per reader per source, two per router (scores and mixing), so Full AttnRes's ~L^2/2 router reads cost ~L^2 such
    sums (they were about 70% of its extra training time). Here a reader's backward adds its mixing term for all the
    slots it read into `grad` `(n_slots, B, T, D)`, one in-place product, and records its scores term (rank `S` per
    slot: `dL/dlogit` times the queries), which `take` adds in one `(B T, K) @ (K, D)` product per slot. `_SourceSlot`
    hands a slot's sum to its source once: every reader of the slot is an autograd consumer of the slot's handle, so
    the engine runs them all before it.

    The sums belong to one backward pass (graph task): `retain_graph` replays and partial `torch.autograd.grad` calls
    each start from zero, and the pass drops them when it ends (they would otherwise live as long as the forward's
    outputs, e.g. through the next forward of a training loop). Tracing (`torch.compile`) keeps autograd's own sums
    (`_store`), which inductor fuses.
    """

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.task, self.grad, self.score_terms = buffer, None, None, []

    @staticmethod
    def applies() -> bool:
        """Eager training with a torch that names the current backward pass (`torch._C._current_graph_task_id`)."""
        return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and hasattr(torch._C, "_current_graph_task_id"))

    def _current(self) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.grad, self.score_terms = task, torch.zeros_like(self.buffer), []
            torch.autograd.Variable._execution_engine.queue_callback(self._release)  # when this pass ends
        return self.grad

    def _release(self) -> None:
        self.grad, self.score_terms = None, []

    def add_scores(self, grad_logits: torch.Tensor, queries: torch.Tensor) -> None:
        """Record a scores reader's term: `grad_logits (B, T, S, n)` and `queries (S, D)` (fp32)."""
        self._current()
        self.score_terms.append((grad_logits, queries))

    def add_mix(self, n: int, grad_values: torch.Tensor, lo: int = 0) -> None:
        """Add `grad_values (n - lo, B, T, D)` (a view is fine) to slots `lo .. n - 1`."""
        self._current()[lo:n].add_(grad_values)

    def add_mix_product(self, n: int, weights: torch.Tensor, grad: torch.Tensor, lo: int = 0) -> None:
        """Add `weights_i * grad` to slot `i` for `i` in `lo .. n - 1`: `weights (n - lo, B, T, 1)`, `grad (B, T, D)`."""
        self._current()[lo:n].addcmul_(weights, grad)

    def take(self, slot: int) -> torch.Tensor | None:
        """Slot `slot`'s summed gradient `(B, T, D)` (buffer dtype), or `None` when no reader ran in this pass."""
        if self.task != torch._C._current_graph_task_id():
            return None
        grad = self.grad[slot]
        terms = [(g[..., slot], q) for g, q in self.score_terms if slot < g.shape[-1]]
        if terms:
            dim = grad.shape[-1]
            coefficients = torch.cat([g.reshape(-1, g.shape[-1]) for g, _ in terms], dim=-1)  # (B T, K) fp32
            queries = torch.cat([q for _, q in terms])  # (K, D) fp32
            if grad.dtype == queries.dtype:
                grad.view(-1, dim).addmm_(coefficients, queries)
            else:  # the product in fp32, added in the buffer's dtype
                grad.view(-1, dim).add_((coefficients @ queries).to(grad.dtype))
        return grad


class _SourceSlot(torch.autograd.Function):
    """Write `source` into `buffer[slot]` and return its handle: a 0-dim tensor the slot's readers take as an input
    (the autograd edge to the source) whose backward hands the source the slot's summed gradient (`_SourceGrads`).
    A leaf source (`inputs_embeds` that requires grad) gets a copy: autograd would keep the slot's view itself as
    its `.grad`, and with it every slot's gradient."""

    @staticmethod
    def forward(ctx, grads, slot, source):
        grads.buffer[slot].copy_(source)
        ctx.grads, ctx.slot, ctx.leaf = grads, slot, source.is_leaf
        ctx.set_materialize_grads(False)
        return source.new_zeros(())

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        grad = ctx.grads.take(ctx.slot)
        return None, None, grad.clone() if ctx.leaf and grad is not None else grad


class _SourceScores(torch.autograd.Function):
    """`_scores(buffer[:n], queries)` whose backward reads the buffer instead of a saved copy of the sources.

    The buffer is written in place (a slot once per forward, before any reader) and is not saved with
    `save_for_backward`, so later writes do not trip autograd's version counter; slots `< n` never change after they
    are read. `inputs` are the `n` slots' autograd handles: `_SourceSlot` handles with `grads` (the gradients are
    summed in `grads`), or the source tensors themselves with `grads=None` (one gradient per source, autograd sums
    them; the traced path)."""

    @staticmethod
    def forward(ctx, buffer, grads, n, queries, *inputs):
        ctx.buffer, ctx.grads, ctx.n = buffer, grads, n
        ctx.save_for_backward(queries)
        return _scores(buffer[:n], queries)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad (B, T, S, n)
        (queries,) = ctx.saved_tensors
        values, n = ctx.buffer[: ctx.n], ctx.n
        grad_queries = None
        if ctx.needs_input_grad[3]:
            flat_grad = grad.permute(3, 0, 1, 2).reshape(n * values.shape[1] * values.shape[2], -1)  # (n B T, S)
            grad_queries = flat_grad.T @ _as(values.reshape(flat_grad.shape[0], -1), queries.dtype)
        needs = ctx.needs_input_grad[4:]
        if not any(needs):
            return None, None, None, grad_queries, *_nones(needs)
        if ctx.grads is not None:
            ctx.grads.add_scores(grad, queries)
            return None, None, None, grad_queries, *_nones(needs)
        flat_grad = grad.permute(3, 0, 1, 2).reshape(n * values.shape[1] * values.shape[2], -1)
        grad_values = (flat_grad @ queries).view(values.shape)
        return None, None, None, grad_queries, *_per_source(grad_values, ctx, n)


class _SourceMix(torch.autograd.Function):
    """`_mix(buffer[:n], weights)` whose backward reads the buffer (see `_SourceScores`)."""

    @staticmethod
    def forward(ctx, buffer, grads, n, weights, *inputs):
        ctx.buffer, ctx.grads, ctx.n = buffer, grads, n
        ctx.save_for_backward(weights)
        return _mix(buffer[:n], weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad (B, T, S, D)
        (weights,) = ctx.saved_tensors
        values, n = ctx.buffer[: ctx.n], ctx.n
        batch, seq, dim = values.shape[1:]
        grad = grad.reshape(batch * seq, -1, dim)
        grad_weights = None
        if ctx.needs_input_grad[3]:
            per_token = values.reshape(n, batch * seq, dim).permute(1, 2, 0)  # (B T, D, n)
            grad_weights = torch.bmm(grad, per_token).view(weights.shape)
        needs = ctx.needs_input_grad[4:]
        if not any(needs):
            return None, None, None, grad_weights, *_nones(needs)
        flat = weights.reshape(batch * seq, -1, n)
        if ctx.grads is not None:  # summed in place, from the first slot that needs a gradient
            lo = needs.index(True)
            if flat.shape[1] == 1:  # one router: slot i += w_i * grad
                ctx.grads.add_mix_product(n, flat[:, 0, lo:].T.reshape(n - lo, batch, seq, 1),
                                          grad.view(batch, seq, dim), lo)
            else:  # a block's routers: (B T, n, S) @ (B T, S, D), added through a (n, B T, D) view
                product = torch.bmm(flat[..., lo:].transpose(1, 2), grad)
                ctx.grads.add_mix(n, product.transpose(0, 1).unflatten(1, (batch, seq)), lo)
            return None, None, None, grad_weights, *_nones(needs)
        # (n, B, T, D), slot-major and contiguous: autograd sums each slot's gradient with the source's others
        if flat.shape[1] == 1:  # one router: w_i * grad, a broadcast product
            grad_values = flat[:, 0].T.unsqueeze(-1) * grad[:, 0]
        else:  # a block's routers: (B T, n, S) @ (B T, S, D)
            grad_values = torch.bmm(flat.transpose(1, 2), grad).transpose(0, 1).contiguous()
        return None, None, None, grad_weights, *_per_source(grad_values.view(n, batch, seq, dim), ctx, n)


def _nones(needs) -> tuple:
    """`None` gradients for the handles."""
    return (None,) * len(needs)


class _SourceInverseRMS(torch.autograd.Function):
    """`inverse_rms` of the source in buffer slot `slot`, whose backward reads the slot (no saved copy). `handle`:
    the slot's autograd handle (`_store`); with `grads`, the gradient is added to the slot's sum in place."""

    @staticmethod
    def forward(ctx, buffer, grads, slot, eps, handle):
        ctx.buffer, ctx.grads, ctx.slot = buffer, grads, slot
        inv = inverse_rms(buffer[slot], eps)
        ctx.save_for_backward(inv)
        return inv

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # d/dx (mean(x^2) + eps)^(-1/2) = -inv^3 x / D
        (inv,) = ctx.saved_tensors
        value = ctx.buffer[ctx.slot]
        coefficient = (grad * inv.pow(3) / -value.shape[-1]).unsqueeze(-1)
        if ctx.grads is not None:
            ctx.grads.add_mix_product(ctx.slot + 1, _as(coefficient, value.dtype).unsqueeze(0), value, ctx.slot)
            return None, None, None, None, None
        return None, None, None, None, (coefficient * value.float()).to(ctx.buffer.dtype)


def _merge_partial(partial, mixed, query, lse, eps, key_norm):
    """Phase 2's arithmetic (see `AttnResRouter._merge`): the partial sum's logit `(B, T)` fp32 (and its `1/RMS`, or
    `None` without the key norm), the completed sources' share (softmax; `lse` is their log-sum-exp) or the
    partial sum's sigmoid gate (`lse` is `None`), and the merged router output `(B, T, D)` in the stream dtype."""
    logit = _as(partial, query.dtype) @ query
    inv = inverse_rms(partial, eps) if key_norm else None
    if inv is not None:
        logit = logit * inv
    if lse is None:  # sigmoid scores: h = mixed + sigmoid(p) partial
        share = torch.sigmoid(logit)
        hidden = mixed + _as(share.unsqueeze(-1), partial.dtype) * partial
    else:  # softmax: the completed sources keep sigmoid(lse - p) of the mass (online-softmax update)
        share = torch.sigmoid(lse - logit)
        hidden = torch.lerp(partial, mixed, _as(share.unsqueeze(-1), partial.dtype))
    return hidden, logit, inv, share


def _merge_inference(partial, mixed, query, lse, norm_eps):
    """`_merge_partial`'s merged output `(B, T, D)` alone, in the fewest operations: the no-grad path without depth
    weights (a decoded token runs one per sub-layer, and at one token each operation costs microseconds).

    The key norm enters as `p = (partial . q) sqrt(D) / hypot(sqrt(D eps), ||partial||)` (`norm_eps`: the 0-dim fp32
    tensor `sqrt(D eps)`; `None` without the key norm), which is `(partial . q) rsqrt(mean(partial^2) + eps)`; with
    softmax scores the completed sources' share `sigmoid(lse - p)` takes one fused `addcdiv`."""
    values = _as(partial, torch.float32)
    logit = values @ query  # (B, T): partial . q, before the key norm
    if norm_eps is not None:
        norm = torch.hypot(norm_eps, torch.linalg.vector_norm(values, dim=-1))
        scale = math.sqrt(partial.shape[-1])
        if lse is not None:  # lse - p in one operation
            share = torch.sigmoid(torch.addcdiv(lse, logit, norm, value=-scale))
            return torch.lerp(partial, mixed, _as(share.unsqueeze(-1), partial.dtype))
        logit = torch.div(logit, norm).mul_(scale)
    if lse is None:  # sigmoid scores: h = mixed + sigmoid(p) partial
        return torch.addcmul(mixed, _as(torch.sigmoid(logit).unsqueeze(-1), partial.dtype), partial)
    share = torch.sigmoid(lse - logit)
    return torch.lerp(partial, mixed, _as(share.unsqueeze(-1), partial.dtype))


class _PartialMerge(torch.autograd.Function):
    """Phase 2 of two-phase block inference with gradients (`_merge_partial`), saving for backward the partial sum
    and per-token scalars only: not the completed sources' weighted sum `mixed` (one `(B, T, D)` per router), which
    the softmax backward recomputes from the source buffer and the router's phase-1 weights (`weights`, `(B, T, n)`
    in the buffer's dtype; one small product per router). Returns the merged output and the partial sum's logit
    (differentiable, for the depth weights).

    Backward (`g`: the gradient of `h`; `s`: the share; `p`: the logit; `r = 1/RMS(partial)`; `q`: the folded query):
    softmax `dL/ds = g . (mixed - partial)`, `dL/dp = -s (1 - s) dL/ds = -dL/dlse`, `dL/dpartial = (1 - s) g + ...`,
    `dL/dmixed = s g`; sigmoid `dL/dp = s (1 - s) g . partial`, `dL/dpartial = s g + ...`, `dL/dmixed = g`; then
    through `p = r (partial . q)`: `dL/dq = sum_t dL/dp r partial`, `dL/dpartial += dL/dp (r q - p r^2 partial / D)`.
    """

    @staticmethod
    def forward(ctx, buffer, n, weights, partial, mixed, query, lse, eps, key_norm):
        hidden, logit, inv, share = _merge_partial(partial, mixed, query, lse, eps, key_norm)
        ctx.buffer, ctx.n, ctx.softmax = buffer, n, lse is not None
        ctx.save_for_backward(weights, partial, query, logit, inv, share)
        ctx.set_materialize_grads(False)
        return hidden, logit

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hidden, grad_logit):
        weights, partial, query, logit, inv, share = ctx.saved_tensors
        values = _as(partial, query.dtype)  # the arithmetic in fp32, as in the forward
        grad_partial = grad_mixed = grad_lse = None
        grad_p = grad_logit if grad_logit is not None else torch.zeros_like(logit)
        if grad_hidden is not None:
            grad = _as(grad_hidden, query.dtype)
            if ctx.softmax:
                mixed = _mix(ctx.buffer[: ctx.n], weights.unsqueeze(-2)).squeeze(-2)  # forward's value, recomputed
                grad_share = (grad * (_as(mixed, query.dtype) - values)).sum(-1)
                grad_lse = grad_share * share * (1 - share)
                grad_p = grad_p - grad_lse
                grad_partial, grad_mixed = grad * (1 - share).unsqueeze(-1), grad * share.unsqueeze(-1)
            else:
                grad_p = grad_p + (grad * values).sum(-1) * share * (1 - share)
                grad_partial, grad_mixed = grad * share.unsqueeze(-1), grad
        if inv is not None:  # p = r (partial . q) with r = (mean(partial^2) + eps)^(-1/2)
            coefficient = grad_p * inv
            grad_values = (coefficient.unsqueeze(-1) * query
                           - (coefficient * logit * inv / values.shape[-1]).unsqueeze(-1) * values)
        else:
            coefficient = grad_p
            grad_values = coefficient.unsqueeze(-1) * query
        grad_query = coefficient.reshape(-1) @ values.reshape(-1, values.shape[-1])
        grad_partial = grad_values if grad_partial is None else grad_partial + grad_values
        grad_mixed = None if grad_mixed is None else _as(grad_mixed, ctx.buffer.dtype)
        return None, None, None, _as(grad_partial, partial.dtype), grad_mixed, grad_query, grad_lse, None, None


def _per_source(grad_values, ctx, n):
    """One gradient per source tensor (views of `grad_values (n, B, T, D)`), `None` where none is needed."""
    grad_values = grad_values.to(ctx.buffer.dtype)
    return tuple(g if need else None for g, need in zip(grad_values.unbind(0), ctx.needs_input_grad[4:]))


def _read_sources(function, plain, state, other):
    """`function` (an autograd Function above) over the state's completed sources when gradients flow, else the same
    numbers from `plain`."""
    n, handles = len(state.sources), state.handles
    if torch.is_grad_enabled() and (other.requires_grad or any(h.requires_grad for h in handles)):
        return function.apply(state.buffer, state.grads, n, other, *handles)
    return plain(state.buffer[:n], other)


def _two_phase_applies(config) -> bool:
    """Whether the two-phase block path (and the source buffer) serves this router configuration."""
    return (config.attnres_num_heads == 1 and config.attnres_window is None and config.attnres_query == "static"
            and not config.attnres_scalar_weights)


class Phase1(NamedTuple):
    """Phase 1 of two-phase block inference for the routers of sub-layers `start .. stop - 1` (one block): their
    scores against the block's completed sources, computed once when the block starts.

    - `probs`: `(B, T, S, n)` fp32: softmax over the completed sources (sigmoid: each source's sigmoid);
    - `lse`: `(B, T, S)` fp32: the log-sum-exp of those logits (softmax only; the online-softmax statistics that the
      running max and normaliser reduce to);
    - `mixed`: `(B, T, S, D)` in the stream dtype: `sum_i probs_i v_i`, the completed sources' share of each router's
      output before the partial sum joins;
    - `queries`: `(S, D)` fp32, the block's query bank (pseudo-queries with their key-norm weights folded in);
    - `bank`: `(2 L, D)` fp32, the model's query bank (`_query_bank`), of which `queries` are the block's rows;
    - `eps`: the key norm's epsilon as a 0-dim fp32 tensor (see `inverse_rms`); both made once per forward
      (`_Constants`).

    Each is kept as a tuple of the `S` routers' views (`unbind`), which a merge picks by position.
    """

    start: int
    stop: int
    queries: tuple[torch.Tensor, ...]
    probs: tuple[torch.Tensor, ...]
    lse: tuple[torch.Tensor, ...] | None
    mixed: tuple[torch.Tensor, ...]
    bank: torch.Tensor
    eps: torch.Tensor


def _forward_is_plain(module: nn.Module) -> bool:
    """Whether nothing stands between `module`'s forward and its parameters: no forward pre-hook (torch's pruning
    computes a weight in one) and no replaced `forward` (accelerate's hooks, which bring an offloaded module's weights
    in for its forward only, or move them to its device). Then its parameters, read outside its forward, are what
    its forward would read. (Forward hooks run after the forward, so they do not count; hooks registered for every
    module: `_global_pre_hooks`.)"""
    return not (module._forward_pre_hooks or "forward" in module.__dict__)


def _global_pre_hooks() -> bool:
    """Whether forward pre-hooks are registered for every module (`register_module_forward_pre_hook`)."""
    return bool(_global_forward_pre_hooks)


def _key_norm_reads_directly(key_norm: nn.Module) -> bool:
    """Whether a router's key norm holds its weight as a plain parameter that its forward reads as is (no
    parametrization, which changes the class; `_forward_is_plain`)."""
    return type(key_norm) is AttnResRMSNorm and _forward_is_plain(key_norm)


def _reads_directly(router: "AttnResRouter") -> bool:
    """Whether `router`'s and its key norm's parameters can be read outside their forwards (global hooks aside)."""
    key_norm = router._modules.get("key_norm")
    return _forward_is_plain(router) and (key_norm is None or _key_norm_reads_directly(key_norm))


def _query_bank(layers, routers) -> torch.Tensor | None:
    """`(len(routers), D)` fp32: each router's pseudo-query with its key-norm weight folded in (see
    `AttnResRouter._logits`), stacked once per forward for every block's phase 1; `None` when a hook intercepts the
    forward of a decoder layer, a router or its key norm (`_forward_is_plain`).

    Phase 1 reads the routers of a block's later layers before they run, and the bank every router before any layer
    runs, which is only sound while nothing manages their weights: under accelerate's offload (`device_map` with disk
    or CPU offload, `max_memory`) a module's weights are there during its own forward only, a layer on another device
    holds its routers there, and FSDP2's `fully_shard` of the decoder layers gathers a layer's sharded parameters in
    its pre-forward hook. Then there is no bank and every router takes the direct path, reading its own weights in its
    own forward (the same numbers)."""
    if (_global_pre_hooks() or not all(_forward_is_plain(layer) for layer in layers)
            or not all(_reads_directly(router) for router in routers)):
        return None
    # (the modules' dictionaries, not attribute access: `nn.Module.__getattr__` costs a microsecond, 120 per forward)
    bank = _as(torch.stack([r._parameters["query"] for r in routers]), torch.float32)
    if routers[0]._modules.get("key_norm") is not None:
        weights = [r._modules["key_norm"]._parameters["weight"] for r in routers]
        bank = bank * _as(torch.stack(weights), torch.float32)
    return bank


class _Constants(NamedTuple):
    """What every router of one forward shares, made once when the state starts (only when every router is a plain
    `AttnResRouter`): `bank`, the model's query bank `(2 L, D)` fp32 (`_query_bank`; `None` for Full AttnRes, which
    has no phase 1, and when hooks manage the routers' weights: each router folds its own query when it reads);
    `eps`, the key norm's epsilon as a 0-dim fp32 tensor (see `inverse_rms`); `norm_eps`, `sqrt(D eps)` as one (see
    `_merge_inference`); `key_norm` and `sigmoid`: whether the routers have a key norm and sigmoid scores (the
    config's, so that phase 1 needs no router). Tensors and flags only: the state that holds them crosses
    accelerate's device hooks, which move what has a `.to`."""

    bank: torch.Tensor | None
    eps: torch.Tensor
    norm_eps: torch.Tensor
    key_norm: bool
    sigmoid: bool

    @classmethod
    def build(cls, config, layers, routers, like: torch.Tensor) -> "_Constants":
        eps = config.rms_norm_eps
        bank = _query_bank(layers, routers) if config.attnres_block_size > 1 else None
        return cls(bank, torch.full((), eps, device=like.device),
                   torch.full((), math.sqrt(like.shape[-1] * eps), device=like.device), config.attnres_key_norm,
                   config.attnres_score_fn == "sigmoid")


class AttnResState(NamedTuple):
    """Depth state of Block AttnRes (paper Eq. 6; Full AttnRes is block size 1).

    Sources live in one buffer per forward, `(n_slots, batch, seq_len, hidden_size)` slot-major (slot 0: the
    embedding, slot k: block k's sum, written in place once, when the block closes); routers read views of it, so no
    source is re-stacked or copied per router, and backward keeps the sources once (custom autograd Functions read
    the buffer instead of saving copies): Full AttnRes's training memory grows like the residual stream's. In eager
    training the readers sum the sources' gradients in place (`_SourceGrads`), each handed to its source once. Block
    AttnRes with `S > 1` runs the paper's two-phase inference (Algorithm 1): when a block starts, the routers of its
    `S` sub-layers are scored against the completed sources in one product (`Phase1`), and each sub-layer merges
    only its partial sum, an online-softmax update (`AttnResRouter` docstring).

    Configurations the buffer does not serve (`attnres_num_heads > 1`, `attnres_window`, `attnres_query=
    "input_dependent"`, `attnres_scalar_weights`) keep the direct path over a stacked `(B, T, n, D)` tensor, grown
    by one source per closed block (`stacked`); the numbers are the same either way.

    Gradient checkpointing: a replayed layer rewrites its block's slot with the same values, after every reader of
    that slot ran its backward; the state itself is immutable.

    The state holds tensors and plain values only, no module: it is a decoder layer's input, which accelerate's hooks
    move to the layer's device (`device_map`), calling `.to` on whatever has one. When hooks manage the routers'
    weights (offload), each router reads its own in its own forward, and phase 1 is not run (`_query_bank`).
    """

    sources: tuple[torch.Tensor, ...]  # completed sources b_0 (embedding), b_1 .. b_{n-1} (block sums), (B, T, D)
    inv_rms: torch.Tensor  # (B, T, n) fp32: 1/RMS of each completed source, the key norm statistics
    partial: torch.Tensor | None  # (B, T, D): b_n^{i-1}, the sum of the current block so far; None at its start
    eps: float
    block_size: int
    sublayer: int  # the index of the next sub-layer
    buffer: torch.Tensor | None = None  # (n_slots, B, T, D): slots < len(sources) hold the sources (fast path)
    stacked: torch.Tensor | None = None  # (B, T, n, D): the sources stacked (the knobs the buffer does not serve)
    phase1: Phase1 | None = None  # the current block's phase 1 (two-phase path only)
    keep_weights: bool = True  # whether merged routers also return their depth weights
    handles: tuple = ()  # the autograd handles of the completed sources, read by the buffer's readers (`_store`)
    grads: _SourceGrads | None = None  # where the buffer's readers sum the sources' gradients (eager training)
    constants: _Constants | None = None  # made once per forward when every router is a plain `AttnResRouter`

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "AttnResState":
        """`model`: the `AttnResModel` whose layers this forward runs; its routers give the two-phase path its
        per-block query bank (`_query_bank`; without it, or when hooks manage the routers' weights, every router takes
        the direct path: same numbers). The state keeps no reference to them."""
        eps, size = config.rms_norm_eps, config.attnres_block_size
        if not _two_phase_applies(config):
            statistics = inverse_rms(embeddings, eps).unsqueeze(-1)
            return cls((embeddings,), statistics, None, eps, size, 0, None, embeddings.unsqueeze(-2), None,
                       keep_weights)
        slots = 1 + max(config.num_sublayers - 1, 0) // size  # the embedding and every block closed before the end
        buffer = embeddings.new_empty(slots, *embeddings.shape)
        grads = _SourceGrads(buffer) if _SourceGrads.applies() else None
        handle = _store(buffer, grads, 0, embeddings)
        statistics = _source_inverse_rms(buffer, grads, 0, eps, handle).unsqueeze(-1)
        constants = None
        if model is not None:  # (iterating, not slicing `model.layers`: a slice builds a new ModuleList)
            layers = tuple(islice(model.layers, config.num_hidden_layers))
            routers = [router for layer in layers for router in registered_modules(layer, AttnResLayerModules)]
            if all(type(r) is AttnResRouter for r in routers):
                constants = _Constants.build(config, layers, routers, embeddings)
        state = cls((embeddings,), statistics, None, eps, size, 0, buffer, None, None, keep_weights,
                    (handle,), grads, constants)
        return state._start_block()

    def _start_block(self) -> "AttnResState":
        """Phase 1 for the block starting at `self.sublayer`: every router of the block against the completed
        sources, one product for the scores and one for the weighted sums (`Phase1`), with the query bank and
        epsilon tensors the state made when it started (`_Constants`)."""
        # (no constants: no model given, or routers wrapped by another library, PEFT's modules_to_save: the direct
        # path, the same numbers)
        constants = self.constants
        bank = constants.bank if constants is not None else None
        start = self.sublayer
        if bank is None or start >= len(bank):
            return self if self.phase1 is None else self._replace(phase1=None)
        stop, eps = min(start + self.block_size, len(bank)), constants.eps
        queries = bank[start:stop]  # (S, D): the block's query bank
        logits = _read_sources(_SourceScores, _scores, self, queries)  # (B, T, S, n)
        if constants.key_norm:
            logits = logits * self.inv_rms.unsqueeze(-2)
        if constants.sigmoid:
            probs, lse = torch.sigmoid(logits), None
        else:
            probs, lse = torch.softmax(logits, dim=-1), torch.logsumexp(logits, dim=-1)
        mixed = _read_sources(_SourceMix, _mix, self, _as(probs, self.buffer.dtype))
        return self._replace(phase1=Phase1(start, stop, queries.unbind(0), probs.unbind(-2),
                                           None if lse is None else lse.unbind(-1), mixed.unbind(-2), bank, eps))

    def begin_sublayer(self) -> "AttnResState":
        """Close the current block when the next sub-layer starts a new one (Eq. 6: `b_n^0` is no source)."""
        if self.sublayer % self.block_size or self.partial is None:
            return self
        # AttnRes: the block's key norm statistics are computed here, once per block, not once per router.
        slot, partial = len(self.sources), self.partial
        handles = self.handles
        if self.buffer is not None:
            handles = (*handles, _store(self.buffer, self.grads, slot, partial))
            eps = self.constants.eps if self.constants is not None else self.eps
            inv, stacked = _source_inverse_rms(self.buffer, self.grads, slot, eps, handles[-1]), None
        else:
            inv = inverse_rms(partial, self.eps)
            stacked = torch.cat([self.stacked, partial.unsqueeze(-2)], dim=-2)  # (B, T, n+1, D)
        state = self._replace(sources=(*self.sources, partial), inv_rms=torch.cat([self.inv_rms, inv[..., None]], -1),
                              partial=None, stacked=stacked, handles=handles)
        return state._start_block() if self.buffer is not None else state

    def _add(self, output: torch.Tensor) -> DepthWrite:
        partial = output if self.partial is None else self.partial + output
        return DepthWrite(self._replace(partial=partial, sublayer=self.sublayer + 1))

    def _route(self, router) -> DepthRead:
        state = self.begin_sublayer()
        hidden, weights = router(state)
        return DepthRead(state, hidden, None, () if weights is None else (weights,))

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
        return DepthRead(self, hidden, None, () if weights is None else (weights,))


def _store(buffer: torch.Tensor, grads: _SourceGrads | None, slot: int, source: torch.Tensor) -> torch.Tensor:
    """Copy `source` into `buffer[slot]` and return the handle the slot's readers take as their autograd input: a
    `_SourceSlot` handle when `grads` sums the gradients (eager training), else `source` itself (the copy is made
    outside autograd; the readers route one gradient each to `source`)."""
    if grads is not None and source.requires_grad:
        return _SourceSlot.apply(grads, slot, source)
    if torch.is_grad_enabled():
        with torch.no_grad():
            buffer[slot].copy_(source)
    else:
        buffer[slot].copy_(source)
    return source


def _source_inverse_rms(buffer, grads, slot, eps, handle):
    """`inverse_rms` of the source in `buffer[slot]` (`handle`: its autograd handle, `_store`), `(B, T)` fp32."""
    if torch.is_grad_enabled() and handle.requires_grad:
        return _SourceInverseRMS.apply(buffer, grads, slot, eps, handle)
    return inverse_rms(buffer[slot], eps)


class AttnResRouter(nn.Module):
    """Attention over depth sources with a learned pseudo-query (paper Eq. 1-4 and 6), plus the ablation knobs of
    the paper's Table 4 (see `AttnResConfig`).

        logit_i = w_l . RMSNorm(v_i)          (Eq. 2-3; no 1/sqrt(d); fp32)
        alpha   = softmax_i(logit)            (Eq. 2)        h_l = sum_i alpha_i v_i       (Eq. 1)

    Knobs: `attnres_score_fn="sigmoid"` (alpha_i = sigmoid(logit_i), unnormalised); `attnres_key_norm=False`
    (logit_i = w_l . v_i); `attnres_window=W` (embedding + the W most recent sources); `attnres_query=
    "input_dependent"` (w_l + W_l RMSNorm(v_last) / d, `query_proj` zero-initialised; the 1/d keeps Adam's step on
    the `d x d` entries of `W_l` from moving the logits `d` times faster than the pseudo-query's); `attnres_num_heads=H` (H slices of
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
            # AttnRes: W_l / d. Adam moves each of the d^2 entries of W_l by ~lr per step, which moves a logit by up
            # to lr * d^2 (lr * d through w_l): without the 1/d the projection trains d times "hotter" than the
            # pseudo-query and the routing collapses onto one source (benchmarks/input_dependent_query.py).
            projected = (last.float() * last_inv.unsqueeze(-1)) @ self.query_proj.float().T  # (B, T, D)
            query = query + projected / self.query_proj.shape[-1]
        if self.key_norm is not None:
            # RMSNorm(v) . w = (v / rms(v)) . (w * g): fold the key-norm weight g into the query, so the per-source
            # statistics (`inv_rms`) are shared by every router of a block.
            query = self._fold_key_norm(query)
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
        sources in depth order, then the partial block sum. With the two-phase path and `output_depth_weights`
        off, a router after the first of its block returns `None` for the weights (they are not computed).

        Three paths, the same numbers (tests/test_two_phase.py): the two-phase merge (Block AttnRes inside a block
        whose phase 1 the state computed), the direct read of the source buffer (Full AttnRes, the final router, a
        model that gave the state no routers), and the stacked path for the knobs the buffer does not serve
        (`attnres_num_heads > 1`, `attnres_window`, `attnres_query="input_dependent"`, `attnres_scalar_weights`).
        """
        if state.buffer is None:
            return self._stacked_forward(state)
        phase1 = state.phase1
        if phase1 is not None and phase1.start <= state.sublayer < phase1.stop:
            return self._merge(state, phase1, state.sublayer - phase1.start)
        return self._direct(state)

    def _folded_query(self) -> torch.Tensor:
        """`w_l * g` (fp32, `(D,)`): the pseudo-query with the key-norm weight folded in (see `_logits`); the weight
        read in the key norm's forward when a hook intercepts it (`_forward_is_plain`, `AttnResRMSNorm.forward`)."""
        query = _as(self.query, torch.float32)
        return query if self._modules.get("key_norm") is None else self._fold_key_norm(query)

    def _fold_key_norm(self, query: torch.Tensor) -> torch.Tensor:
        """`query * g`, fp32 `(..., D)`, `g` the key norm's weight: read in the key norm's forward
        (`AttnResRMSNorm.forward(normalize=False)`) when a hook intercepts it (accelerate's offload loads a module's
        weights for its own forward only), else directly (the same product, without a module call)."""
        key_norm = self._modules["key_norm"]
        if _key_norm_reads_directly(key_norm) and not _global_pre_hooks():
            return query * _as(key_norm._parameters["weight"], torch.float32)
        return key_norm(query, normalize=False)

    def _rescale(self, count: int) -> float:
        """`attnres_rescale_output`'s factor over `count` sources: 2 for sigmoid scores (sigmoid(0) = 1/2: zero
        scores give the residual sum), `count` for softmax (uniform weights give the sum)."""
        return 2.0 if self.score_fn == "sigmoid" else float(count)

    def _weights(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The depth weights from `logits (..., n)` fp32 (softmax over the sources, or each one's sigmoid), and the
        mixing weights in `dtype` (times `_rescale(n)` with `attnres_rescale_output`)."""
        weights = torch.sigmoid(logits) if self.score_fn == "sigmoid" else torch.softmax(logits, dim=-1)
        return weights, _as(weights * self._rescale(logits.shape[-1]) if self.rescale_output else weights, dtype)

    def _partial_logit(self, partial: torch.Tensor, query: torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
        """The partial block sum's logit `(B, T)` fp32 (`eps`: a float or a 0-dim tensor, see `inverse_rms`)."""
        logit = _as(partial, torch.float32) @ query
        return logit * inverse_rms(partial, eps) if self.key_norm is not None else logit

    def _direct(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor]:
        """One router over the source buffer (views of it, no stacking) and the partial sum."""
        if state.constants is not None and not torch.is_grad_enabled():
            return self._direct_inference(state)
        partial, buffer, n = state.partial, state.buffer, len(state.sources)
        query = self._folded_query()
        logits = _read_sources(_SourceScores, _scores, state, query.unsqueeze(0)).squeeze(-2)  # (B, T, n)
        if self.key_norm is not None:
            logits = logits * state.inv_rms
        if partial is not None:
            logits = torch.cat([logits, self._partial_logit(partial, query, state.eps).unsqueeze(-1)], dim=-1)
        weights, mix = self._weights(logits, buffer.dtype)
        completed = mix if partial is None else mix.narrow(-1, 0, n)
        hidden = _read_sources(_SourceMix, _mix, state, completed.unsqueeze(-2)).squeeze(-2)
        if partial is not None:
            hidden = hidden + mix.narrow(-1, n, 1) * partial
        return hidden, weights

    def _direct_inference(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor]:
        """`_direct` without autograd, in fewer operations (a decoded token of Full AttnRes runs one per sub-layer):
        the epsilon is a tensor (`_Constants`), and the scores and the weighted sum are one product each over views
        of the buffer."""
        partial, buffer, n, constants = state.partial, state.buffer, len(state.sources), state.constants
        query = self._folded_query()  # (this router's own: the forward that loads its weights)
        values = buffer[:n]  # (n, B, T, D), a view
        logits = (_as(values, torch.float32) @ query).permute(1, 2, 0)  # (B, T, n)
        if self.key_norm is not None:
            logits = logits * state.inv_rms
        if partial is not None:
            logits = torch.cat([logits, self._partial_logit(partial, query, constants.eps).unsqueeze(-1)], dim=-1)
        weights, mix = self._weights(logits, buffer.dtype)
        batch, seq, dim = partial.shape if partial is not None else state.sources[0].shape
        completed = mix if partial is None else mix.narrow(-1, 0, n)
        per_token = values.view(n, batch * seq, dim).transpose(0, 1)  # (B T, n, D), strided view
        hidden = torch.bmm(completed.reshape(batch * seq, 1, n), per_token).view(batch, seq, dim)
        if partial is not None:
            hidden = torch.addcmul(hidden, mix.narrow(-1, n, 1), partial)
        return hidden, weights

    def _merge(self, state: AttnResState, phase1: Phase1, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Phase 2 (paper Algorithm 1): router `j` of the block merges the partial sum into its phase-1 result.

        Softmax: with `lse` the log-sum-exp of the completed sources' logits and `p` the partial sum's logit, the
        completed sources keep the share `sigmoid(lse - p)` of the softmax mass and the partial sum gets
        `sigmoid(p - lse)`, so `h = lerp(partial, mixed_j, sigmoid(lse - p))`: the online-softmax update (running
        max and normaliser folded into `lse`). Sigmoid scores: `h = mixed_j + sigmoid(p) partial`. With gradients
        the merge is `_PartialMerge`, which keeps the partial sum for backward but not `mixed_j` (recomputed), so a
        block's training memory is one partial sum per router more than the residual stream's. Without gradients
        and depth weights it is `_merge_inference` (the same numbers in fewer operations).
        """
        probs, mixed, partial = phase1.probs[j], phase1.mixed[j], state.partial
        count = len(state.sources)
        if partial is None:  # the block's first sub-layer: the completed sources only
            hidden, weights = mixed, probs
            if torch.is_grad_enabled() and mixed.requires_grad:  # its own storage: the sub-layer's norm saves it,
                hidden = mixed.clone()  # which must not keep the block's whole (B, T, S, D) phase-1 sum alive
        else:
            count += 1
            lse = phase1.lse[j] if phase1.lse is not None else None
            arguments = (partial, mixed, phase1.queries[j], lse, phase1.eps, self.key_norm is not None)
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in arguments[:4]):
                mix_weights = _as(probs, state.buffer.dtype)  # phase 1's, for backward to recompute `mixed`
                hidden, logit = _PartialMerge.apply(state.buffer, len(state.sources), mix_weights, *arguments)
            elif not state.keep_weights:  # inference: the output alone
                norm_eps = state.constants.norm_eps if self.key_norm is not None else None
                hidden = _merge_inference(partial, mixed, phase1.queries[j], lse, norm_eps)
            else:
                hidden, logit, _, _ = _merge_partial(*arguments)
            weights = None
            if state.keep_weights:
                if lse is None:
                    weights = torch.cat([probs, torch.sigmoid(logit)[..., None]], dim=-1)
                else:
                    completed_share, partial_share = torch.sigmoid(lse - logit), torch.sigmoid(logit - lse)
                    weights = torch.cat([probs * completed_share.unsqueeze(-1), partial_share.unsqueeze(-1)], dim=-1)
        if self.rescale_output:
            hidden = hidden * self._rescale(count)
        return hidden, weights

    def _stacked_forward(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor]:
        """The direct router over stacked sources `(B, T, n, D)`, for every knob (see `forward`)."""
        sources, inv_rms, partial = state.stacked, state.inv_rms, state.partial
        if self.window is not None:  # Table 4 "sliding window": the embedding and the W most recent sources
            keep = self.window - (partial is not None)
            if sources.shape[-2] - 1 > keep:
                sources = torch.cat([sources[..., :1, :], sources[..., sources.shape[-2] - keep :, :]], dim=-2)
                inv_rms = torch.cat([inv_rms[..., :1], inv_rms[..., inv_rms.shape[-1] - keep :]], dim=-1)
        need_partial_inv = partial is not None and (self.key_norm is not None or self.query_proj is not None)
        partial_inv = inverse_rms(partial, state.eps) if need_partial_inv else None
        logits = self._logits(sources, inv_rms, partial, partial_inv)
        weights, mix = self._weights(logits, sources.dtype)
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
