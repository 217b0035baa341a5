"""The source buffer of Attention Residuals (arXiv:2603.15031, Eq. 1-4 and 6): the completed sources of one forward
written once, in place, into a slot-major buffer, and the custom autograd Functions through which the routers read it
(the scores `w . v_i` of Eq. 2-3, the weighted sum of Eq. 1, the key norm's `1/RMS`; a whole read as one Function:
`attnres_read.py`). Their backward reads the buffer instead of saved copies of the sources, and in eager training sums
the sources' gradients in place (`_SourceGrads`), the key norm's statistics' too where it holds them (Full AttnRes).

Travels with checkpoints as remote code (a relative import of `mixing_attnres.py`): imports only torch and its
siblings `mixing_base.py` and `torch_internals.py`.
"""

import math
from functools import cached_property
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .mixing_base import inverse_rms
from .torch_internals import at_graph_task_end, graph_task, graph_tasks_known


# ---------------------------------------------------------------------------------------------------------------
# The source buffer: completed sources written once, in place, read by every router through views
# ---------------------------------------------------------------------------------------------------------------


def _statistics_dtype(buffer: torch.Tensor) -> torch.dtype:
    """The dtype the key norm's statistics and scores are computed in: float64 for a float64 buffer, else fp32."""
    return torch.float64 if buffer.dtype == torch.float64 else torch.float32


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


def _mix_one(buffer: torch.Tensor, n: int, weights: torch.Tensor) -> torch.Tensor:
    """One router's `_mix` of the first `n` slots of `buffer (n_slots, B, T, D)`: `weights (B, T, n)` (the buffer's
    dtype; a view is fine where `B, T` flatten) -> `(B, T, D)`, one `(B T, 1, n) @ (B T, n, D)` product."""
    _, batch, seq, dim = buffer.shape
    per_token = buffer[:n].view(n, batch * seq, dim).transpose(0, 1)
    return torch.bmm(weights.reshape(batch * seq, 1, n), per_token).view(batch, seq, dim)


class _SourceGrads:
    """The gradients of one forward's source buffer, summed in place (eager training).

    Autograd's own way hands every reader's gradient to each source it read and sums them there: one `(B, T, D)` sum
    per reader per source, two per router (scores and mixing), so Full AttnRes's ~L^2/2 router reads cost ~L^2 such
    sums (they were about 70% of its extra training time). Here a reader's backward adds its mixing term for all the
    slots it read into `grad` `(n_slots, B, T, D)`, one in-place product, and records its scores term (rank `S` per
    slot: `dL/dlogit` times the queries) in its own columns of `coefficients` `(n_slots, B T, K)` and rows of
    `queries` `(K, D)` (fp32, float64 for a float64 buffer; the columns are the reader's from its forward, `register`,
    where a one-query reader also gives its query), which `take` adds in one `(B T, K) @ (K, D)` product per slot (a
    slot's column of a reader that did not read it is zero): one pass over each slot's sum for all its readers' score
    terms, where adding each reader's in place would pass over all the slots it read once per reader. `_SourceSlot`
    hands a slot's sum to its source once: every reader of the slot is an autograd consumer of the slot's handle, so
    the engine runs them all before it.

    With `eps` (Full AttnRes's torch reads, `AttnResState.start`), it also holds the key norm's statistics: each
    slot's `1/RMS`, `inv` `(n_slots, B, T, 1)` (fp32, float64 for a float64 buffer), written with the slot (`_store`,
    outside autograd) and read by `_SourceRead` as it is. Their gradient is summed in place too (`add_inv`, into
    `inv_grad`), and `take` applies the norm's chain rule `d inv / d v = -inv^3 v / D` once per slot. Autograd's way
    (a Function per source and a concatenation per closed block, both with a backward) cost Full AttnRes about 18
    operator calls per sub-layer.

    The sums belong to one backward pass (graph task, `torch_internals.graph_task`): `retain_graph` replays and
    partial `torch.autograd.grad` calls each start from zero, and the pass drops them when it ends (they would otherwise
    live as long as the forward's outputs, e.g. through the next forward of a training loop). Where a pass has no id
    to use (compiled autograd traces it; a torch without the private names), `open` gives `None` and each reader
    returns one gradient per source to the slot's handle, which autograd sums, as in a traced forward
    (`torch.compile`, which fuses those sums) that makes no `_SourceGrads` at all (`applies`).
    """

    def __init__(self, buffer: torch.Tensor, eps: float | None = None):
        self.buffer, self.task, self.grad, self.eps = buffer, None, None, eps
        self.columns = 0  # the score columns the readers of this forward registered (`register`)
        self.vectors = {}  # {column: query (D,)} of the one-query readers (`register`)
        self.coefficients = self.queries = None  # this pass's score terms (`add_scores`), made on the first one
        slots = buffer.shape[0]
        self.inv = None if eps is None else buffer.new_empty(*buffer.shape[:-1], 1, dtype=_statistics_dtype(buffer))
        self.inv_grad = None  # this pass's gradient of `inv` (`add_inv`)
        # (views made once per forward or pass, not once per read or slot: each slot of the buffer, of the statistics
        # and of their gradient and the sums (`unbind`); the statistics', their gradient's and the sums' slots as
        # `(n_slots, B T, .)`; `by_slot`, `by_slot_t` and `by_token`)
        self.tokens = math.prod(buffer.shape[1:-1])
        self.slots = buffer.unbind(0)
        self.inv_rows = None if eps is None else self.inv.view(slots, -1, 1)
        self.inv_slots = None if eps is None else self.inv.unbind(0)
        self._release()

    @cached_property
    def by_slot(self) -> torch.Tensor:
        """The buffer's slots as `(n_slots, B T, D)` (a view, made on the first read that asks)."""
        return self.buffer.view(self.buffer.shape[0], self.tokens, -1)

    @cached_property
    def by_slot_t(self) -> torch.Tensor:
        """The buffer's slots feature-major, `(n_slots, D, B T)` (a strided view, made on the first read that asks)."""
        return self.by_slot.transpose(1, 2)

    @cached_property
    def by_token(self) -> torch.Tensor:
        """The buffer's slots token-major, `(B T, n_slots, D)` (a strided view, made on the first read that asks)."""
        return self.by_slot.transpose(0, 1)

    def write_statistics(self, slot: int, source: torch.Tensor) -> None:
        """`inv[slot] = 1/RMS(source)`, in `inv`'s dtype: `source (B, T, D)`, the slot's value (`_store`)."""
        with torch.no_grad():
            value = _as(source, self.inv.dtype)
            torch.rsqrt(value.pow(2).mean(-1, keepdim=True).add_(self.eps), out=self.inv_slots[slot])

    def register(self, count: int, query: torch.Tensor | None = None) -> int:
        """A scores reader's first column of `coefficients` (it reads with `count` queries), given in its forward;
        `query (D,)`: a one-query reader's query, the column's row of `queries` (else `add_scores` copies them)."""
        column, self.columns = self.columns, self.columns + count
        if query is not None:
            self.vectors[column] = query
        return column

    @staticmethod
    def applies() -> bool:
        """Eager training with a torch that names its backward passes (`torch_internals.graph_tasks_known`)."""
        return torch.is_grad_enabled() and not torch.compiler.is_compiling() and graph_tasks_known()

    def open(self) -> "_SourceGrads | None":
        """`self`, its sums those of the running backward pass (zeros when the pass first asks), for a reader to add
        into; `None` where this pass cannot sum in place (`torch_internals.graph_task`): the reader returns one gradient
        per source instead."""
        task = graph_task()
        if task is None:
            return None
        if task != self.task:
            self.task, self.grad, self.coefficients, self.queries = task, torch.zeros_like(self.buffer), None, None
            self.grad_rows = self.grad.view(len(self.slots), self.tokens, -1)
            self.grad_slots, self.grad_row_slots = self.grad.unbind(0), self.grad_rows.unbind(0)
            if self.inv is not None:
                self.inv_grad = torch.zeros_like(self.inv)
                self.inv_grad_rows = self.inv_grad.view(self.inv_rows.shape)
                self.inv_grad_slots = self.inv_grad.unbind(0)
            at_graph_task_end(self._release)
        return self

    def _release(self) -> None:
        self.grad = self.coefficients = self.queries = self.inv_grad = self.grad_rows = self.inv_grad_rows = None
        self.grad_slots = self.grad_row_slots = self.inv_grad_slots = self.coefficient_slots = None

    def sum_rows(self, n: int) -> torch.Tensor:
        """The sums of slots `0 .. n - 1` as `(n, B T, D)`, a view (after `open`, as the adders below)."""
        return self.grad_rows[:n]

    def add_inv(self, n: int, grad_inv: torch.Tensor) -> None:
        """Add `grad_inv (n, B T, 1)` (`inv`'s dtype), the gradient of slots `0 .. n - 1`'s statistics."""
        self.inv_grad_rows[:n].add_(grad_inv)

    def sums(self) -> torch.Tensor:
        """`(n_slots, B, T, D)`: the slots' gradient sums of this backward pass (buffer dtype), for a reader that adds
        its whole gradient in place (the fused kernels, `attnres_triton.py`). After `open`, as the adders below."""
        return self.grad

    def add_scores(self, grad_logits: torch.Tensor, queries: torch.Tensor, column: int) -> None:
        """Record a scores reader's term: `grad_logits (B, T, S, n)` and `queries (S, D)` (fp32), in its columns from
        `column` (`register`)."""
        count, n = queries.shape[0], grad_logits.shape[-1]
        terms = grad_logits.permute(3, 0, 1, 2).reshape(n, -1, count)  # (n, B T, S), a view
        self.score_columns(n, column, count).copy_(terms)
        self.queries[column:column + count].copy_(queries)

    def score_columns(self, n: int, column: int, count: int = 1) -> torch.Tensor:
        """Slots `0 .. n - 1`'s rows of a reader's `count` columns from `column` of `coefficients`, `(n, B T, count)`
        (a strided view), for the reader to write its terms into (`add_scores`, or as its product's `out`)."""
        if self.coefficients is None or self.coefficients.shape[-1] < column + count:
            self._widen(max(self.columns, column + count))  # (a reentrant checkpoint's replay registers anew)
        return self.coefficients[:n, :, column:column + count]

    def _widen(self, width: int) -> None:
        """Zero `coefficients` and `queries` of `width` columns, keeping the terms recorded so far, the one-query
        readers' queries in their rows."""
        slots, batch, seq, dim = self.buffer.shape
        dtype = _statistics_dtype(self.buffer)
        coefficients = self.buffer.new_zeros(slots, batch * seq, width, dtype=dtype)
        queries = self.buffer.new_zeros(width, dim, dtype=dtype)
        if self.coefficients is not None:
            coefficients[..., :self.coefficients.shape[-1]].copy_(self.coefficients)
            queries[:self.queries.shape[0]].copy_(self.queries)
        if self.vectors:
            rows = torch.tensor(list(self.vectors), device=queries.device)
            queries.index_copy_(0, rows, torch.stack([_as(v, dtype) for v in self.vectors.values()]))
        self.coefficients, self.queries, self.coefficient_slots = coefficients, queries, coefficients.unbind(0)

    def add_mix(self, n: int, grad_values: torch.Tensor, lo: int = 0) -> None:
        """Add `grad_values (n - lo, B, T, D)` (a view is fine) to slots `lo .. n - 1`."""
        self.grad[lo:n].add_(grad_values)

    def add_mix_product(self, n: int, weights: torch.Tensor, grad: torch.Tensor, lo: int = 0) -> None:
        """Add `weights_i * grad` to slot `i` for `i` in `lo .. n - 1`: `weights (n - lo, B, T, 1)`, `grad (B, T, D)`."""
        self.grad[lo:n].addcmul_(weights, grad)

    def take(self, slot: int) -> torch.Tensor | None:
        """Slot `slot`'s summed gradient `(B, T, D)` (buffer dtype), or `None` when no reader summed in place in this
        pass."""
        task = graph_task()
        if task is None or task != self.task or self.grad is None:
            return None
        grad = self.grad_slots[slot]
        if self.coefficients is not None:
            flat, coefficients = self.grad_row_slots[slot], self.coefficient_slots[slot]  # (B T, D), (B T, K)
            if grad.dtype == coefficients.dtype:
                flat.addmm_(coefficients, self.queries)
            else:  # the product in fp32, added in the buffer's dtype
                flat.add_((coefficients @ self.queries).to(grad.dtype))
        if self.inv_grad is not None:  # the key norm's statistics: d inv / d v = -inv^3 v / D
            coefficient = self.inv_grad_slots[slot] * self.inv_slots[slot].pow(3)
            grad.addcmul_(coefficient, self.slots[slot], value=-1 / grad.shape[-1])
        return grad


class _SourceSlot(torch.autograd.Function):
    """Write `source` into `buffer[slot]` and return its handle, the autograd edge to the source that the slot's
    readers take as an input: zeros shaped like the source, one element expanded. Its backward hands the source the
    slot's summed gradient (`_SourceGrads.take`), or, in a pass that cannot sum in place, the readers' per-source
    gradients as autograd summed them into the handle. A leaf source (`inputs_embeds` that requires grad) gets a copy
    of the slot's sum: autograd would keep the slot's view itself as its `.grad`, and with it every slot's gradient."""

    @staticmethod
    def forward(ctx, grads, slot, source):
        grads.slots[slot].copy_(source)
        ctx.grads, ctx.slot, ctx.leaf = grads, slot, source.is_leaf
        ctx.set_materialize_grads(False)
        return source.new_zeros(()).expand(source.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad (B, T, D): the readers' per-source gradients, or None when they summed in place
        summed = ctx.grads.take(ctx.slot)
        if summed is None:  # (autograd's sum of the slot's readers, at least two: its own tensor, no copy needed)
            return None, None, grad
        return None, None, (summed.clone() if ctx.leaf else summed) if grad is None else summed + grad


class _SourceScores(torch.autograd.Function):
    """`_scores(buffer[:n], queries)` whose backward reads the buffer instead of a saved copy of the sources.

    The buffer is written in place (a slot once per forward, before any reader) and is not saved with
    `save_for_backward`, so later writes do not trip autograd's version counter; slots `< n` never change after they
    are read. `inputs` are the `n` slots' autograd handles: `_SourceSlot` handles with `grads` (the gradients are
    summed in `grads` where the pass can, `_SourceGrads.open`), or the source tensors themselves with `grads=None`
    (one gradient per source, autograd sums them; the traced path)."""

    @staticmethod
    def forward(ctx, buffer, grads, n, queries, *inputs):
        ctx.buffer, ctx.grads, ctx.n = buffer, grads, n
        # (one query in fp32: its term is added to the sums in place in backward; else recorded, `add_scores`)
        direct = grads is None or (queries.shape[0] == 1 and buffer.dtype == queries.dtype)
        ctx.column = None if direct else grads.register(queries.shape[0])
        ctx.save_for_backward(queries)
        return _scores(buffer[:n], queries)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad (B, T, S, n)
        (queries,) = ctx.saved_tensors
        values, n = ctx.buffer[: ctx.n], ctx.n
        grad = _as(grad, queries.dtype)  # (autocast computes the forward's product, so its gradient, in its dtype)
        needs = ctx.needs_input_grad[4:]
        grads = ctx.grads.open() if ctx.grads is not None and any(needs) else None
        per_source = any(needs) and grads is None
        grad_queries = flat_grad = None
        if ctx.needs_input_grad[3] or per_source:  # (one permuted copy for both products)
            flat_grad = grad.permute(3, 0, 1, 2).reshape(n * values.shape[1] * values.shape[2], -1)  # (n B T, S)
        if ctx.needs_input_grad[3]:
            grad_queries = flat_grad.T @ _as(values.reshape(flat_grad.shape[0], -1), queries.dtype)
        if not any(needs):
            return None, None, None, grad_queries, *_nones(needs)
        if grads is not None:
            if ctx.column is None:  # slot i += (d L / d score_i) query, in place
                grads.sums()[:n].addcmul_(grad.permute(3, 0, 1, 2), queries[0])
            else:
                grads.add_scores(grad, queries, ctx.column)
            return None, None, None, grad_queries, *_nones(needs)
        grad_values = (flat_grad @ queries).view(values.shape)
        return None, None, None, grad_queries, *_per_source(grad_values, ctx, n)


class _SourceMix(torch.autograd.Function):
    """`_mix(buffer[:n], weights)` whose backward reads the buffer (see `_SourceScores`)."""

    @staticmethod
    def forward(ctx, buffer, grads, n, weights, *inputs):
        ctx.buffer, ctx.grads, ctx.n, ctx.weights_dtype = buffer, grads, n, weights.dtype
        ctx.save_for_backward(weights)
        return _mix(buffer[:n], weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad (B, T, S, D)
        (weights,) = ctx.saved_tensors
        values, n = ctx.buffer[: ctx.n], ctx.n
        batch, seq, dim = values.shape[1:]
        # (autocast computes the forward's product in its own dtype: the gradient arrives in it, not the buffer's)
        grad = _as(grad, values.dtype).reshape(batch * seq, -1, dim)
        weights = _as(weights, values.dtype)
        grad_weights = None
        if ctx.needs_input_grad[3]:
            per_token = values.reshape(n, batch * seq, dim).permute(1, 2, 0)  # (B T, D, n)
            grad_weights = torch.bmm(grad, per_token).view(weights.shape).to(ctx.weights_dtype)
        needs = ctx.needs_input_grad[4:]
        if not any(needs):
            return None, None, None, grad_weights, *_nones(needs)
        flat = weights.reshape(batch * seq, -1, n)
        grads = ctx.grads.open() if ctx.grads is not None else None
        if grads is not None:  # summed in place, from the first slot that needs a gradient
            lo = needs.index(True)
            if flat.shape[1] == 1:  # one router: slot i += w_i * grad
                grads.add_mix_product(n, flat[:, 0, lo:].T.reshape(n - lo, batch, seq, 1), grad.view(batch, seq, dim),
                                      lo)
            else:  # a block's routers: (B T, n, S) @ (B T, S, D), added through a (n, B T, D) view
                product = torch.bmm(flat[..., lo:].transpose(1, 2), grad)
                grads.add_mix(n, product.transpose(0, 1).unflatten(1, (batch, seq)), lo)
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
        ctx.save_for_backward(inv.pow(3).mul_(-1 / buffer.shape[-1]))  # (not the output: saving it costs two aliases)
        return inv

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # d/dx (mean(x^2) + eps)^(-1/2) = -inv^3 x / D
        (slope,) = ctx.saved_tensors  # -inv^3 / D, (B, T)
        value = ctx.buffer[ctx.slot]
        coefficient = grad * slope
        grads = ctx.grads.open() if ctx.grads is not None else None
        if grads is not None:
            grads.add_mix_product(ctx.slot + 1, _as(coefficient, value.dtype).view(1, *grad.shape, 1), value, ctx.slot)
            return None, None, None, None, None
        return None, None, None, None, (coefficient.unsqueeze(-1) * value.float()).to(ctx.buffer.dtype)


def _per_source(grad_values, ctx, n, first: int = 4):
    """One gradient per source tensor (views of `grad_values (n, B, T, D)`), `None` where none is needed; the
    handles are the Function's inputs from `first` on."""
    grad_values = grad_values.to(ctx.buffer.dtype)
    return tuple(g if need else None for g, need in zip(grad_values.unbind(0), ctx.needs_input_grad[first:]))


class SourceBuffer(NamedTuple):
    """The completed sources of one forward as the model holds them, for the ops (`ops.py`) to read: the buffer's
    first `n` slots, read through the autograd Functions above when gradients flow (no saved copy; eager training's
    in-place sums), the plain products otherwise (`_read_sources`). Duck-typed like `AttnResState` for the readers."""

    buffer: torch.Tensor  # (n_slots, B, T, D): slots < n hold the sources
    sources: tuple[torch.Tensor, ...]  # the n completed sources, (B, T, D) each, in depth order
    handles: tuple  # their autograd handles (`_store`)
    grads: "_SourceGrads | None"  # where the readers sum the sources' gradients (eager training), or None


def _read_sources(function, plain, state, other):
    """`function` (an autograd Function above) over the state's completed sources when gradients flow, else the same
    numbers from `plain`."""
    n, handles = len(state.sources), state.handles
    if torch.is_grad_enabled() and (other.requires_grad or any(h.requires_grad for h in handles)):
        return function.apply(state.buffer, state.grads, n, other, *handles)
    return plain(state.buffer[:n], other)


def _store(buffer: torch.Tensor, grads: _SourceGrads | None, slot: int, source: torch.Tensor) -> torch.Tensor:
    """Copy `source` into `buffer[slot]` and return the handle the slot's readers take as their autograd input: a
    `_SourceSlot` handle when `grads` sums the gradients (eager training), else `source` itself (the copy is made
    outside autograd; the readers route one gradient each to `source`)."""
    if grads is not None and source.requires_grad:
        handle = _SourceSlot.apply(grads, slot, source)
    else:
        if torch.is_grad_enabled():
            with torch.no_grad():
                buffer[slot].copy_(source)
        else:
            buffer[slot].copy_(source)
        handle = source
    if grads is not None and grads.inv is not None:
        grads.write_statistics(slot, source)
    return handle


def _source_inverse_rms(buffer, grads, slot, eps, handle):
    """`inverse_rms` of the source in `buffer[slot]` (`handle`: its autograd handle, `_store`), `(B, T)` fp32."""
    if torch.is_grad_enabled() and handle.requires_grad:
        return _SourceInverseRMS.apply(buffer, grads, slot, eps, handle)
    return inverse_rms(buffer[slot], eps)
