"""Two-phase Block AttnRes in fused Triton kernels (`AttnResConfig.attnres_implementation="triton"`;
arXiv:2603.15031, Algorithm 1, the softmax router of Eq. 1-4 over the sources of Eq. 6): phase 1 of each block (the
scores of its pseudo-queries against the completed sources, their log-sum-exp and weighted sums, one read of each
source with an online softmax) and the merge of the partial sum (phase 2), forward and backward
(`attnres_kernels.py`). Full AttnRes's reads and the final router are the same two kernels with one query.

The autograd Functions read the source buffer as the torch path's do (`attnres_buffer.py`): no copy of the sources
is saved, the sources' gradients are added in place into the forward's gradient sums in eager training
(`_SourceGrads`, in the buffer's dtype, as the torch path's mixing terms), and the merge recomputes its completed
sources' share in backward instead of keeping it.

Travels with checkpoints as remote code (a relative import of `mixing_attnres.py`): imports only torch and its
siblings `attnres_buffer.py`, `mixing_base.py`, `torch_internals.py` and, on first use, `attnres_kernels.py` (Triton;
it travels too).
"""

import sys

import torch
from torch.autograd.function import once_differentiable

from .attnres_buffer import _as, _mix_one, _nones
from .mixing_base import check_implementation
from .torch_internals import tensor_version

_KERNELS = []  # the kernels module once imported (every read asks for it: no import statement per read)


def _kernels():
    """`attnres_kernels`, imported on first use (it imports Triton: seconds, and only where it is installed)."""
    if not _KERNELS:
        try:  # (this form, `from .module import name`, is the one transformers' remote-code loader copies along)
            from .attnres_kernels import INTERPRETED  # noqa: F401
        except ImportError as error:  # (Triton missing, or its interpreter asked for too late: the message says which)
            raise ImportError(str(error)) from error
        _KERNELS.append(sys.modules[f"{__name__.rpartition('.')[0]}.attnres_kernels"])
    return _KERNELS[0]


def require_triton(config) -> None:
    """At model construction: refuse a config the kernels cannot compute (`ValueError`) or Triton not importable
    (`ImportError`), rather than at the first forward."""
    check_implementation(config, "triton")
    _kernels()


def check_device(device: torch.device) -> None:
    """Raise `ValueError` for a device the kernels cannot run on: CUDA, or any device under Triton's interpreter
    (`TRITON_INTERPRET=1` set before the kernels are first imported: `attnres_kernels.INTERPRETED`)."""
    if not (device.type == "cuda" or _kernels().INTERPRETED):
        raise ValueError(f"attnres_implementation='triton' needs CUDA tensors (or TRITON_INTERPRET=1, Triton's "
                         f"interpreter, for tests), got {device.type} tensors; use attnres_implementation='torch' "
                         f"on {device.type}")


def serves(state) -> bool:
    """Whether this read goes to the kernels: not while tracing (`torch.compile` fuses the torch path; a Triton
    launch outside a custom op is a graph break); sources on CUDA, or on any device under Triton's interpreter
    (`TRITON_INTERPRET=1` set before the kernels are first imported: `attnres_kernels.INTERPRETED`).

    Raises:
        ValueError: on sources that are neither CUDA tensors nor interpreted.
    """
    if torch.compiler.is_compiling() or state.buffer.is_meta:  # (meta tensors: shapes only, the torch path's)
        return False
    check_device(state.buffer.device)
    return True


def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def phase1(state, queries: torch.Tensor, inv_rms: torch.Tensor | None, probs: bool = True):
    """Phase 1 over the state's completed sources (`state.buffer[:n]`): `queries (S, D)` fp32 (key-norm weights
    folded in), `inv_rms (B, T, n)` fp32 or `None` without the key norm. Returns `probs (B, T, S, n)` fp32,
    `lse (B, T, S)` fp32 and `mixed (B, T, S, D)` in the buffer's dtype, differentiable in every input. `probs`:
    whether a forward without gradients needs the softmax (`False`: `None` in its place, a launch fewer)."""
    n, handles = len(state.sources), state.handles
    if _grad_needed(queries, inv_rms, *handles):
        return _Phase1.apply(state.buffer, state.grads, n, queries, inv_rms, *handles)
    # (with gradients on, a later merge's backward reads the softmax even where phase 1's inputs need none: frozen
    # sources and routers, a trainable layer after them)
    return _kernels().phase1_forward(state.buffer[:n], None if inv_rms is None else inv_rms.contiguous(),
                                     queries.contiguous(), probs or torch.is_grad_enabled())


def add(state, output: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """The partial block sum `state.partial + output (B, T, D)` and, when the next router merges it into its phase-1
    result on the kernels (`merge`: softmax scores, no gradients, no depth weights), that router's merged output
    `(B, T, D)` (before `attnres_rescale_output`), computed in the same launch as the sum (the add that replaces a
    residual stream's, fused into the merge: a launch fewer per sub-layer in decode), with the sum it read and that
    sum's count of in-place writes (`AttnResState.merged`; `merged` takes it); `None` in its place otherwise (an
    output that only broadcasts against the sum, a partial sum whose writes are not counted: `tensor_version`).

    The next router reads only its phase-1 row (`state.phase1`), made when the block started from the same query
    bank, so the result is the one its own merge computes."""
    partial, phase1, row = state.partial, state.phase1, state.sublayer + 1
    if (phase1 is None or phase1.lse is None or not phase1.start <= row < phase1.stop or state.keep_weights
            or output.shape != partial.shape or output.dtype != partial.dtype or tensor_version(partial) is None
            or _grad_needed(partial, output, phase1.mixed[0]) or not serves(state)):
        return partial + output, None
    row -= phase1.start
    hidden, _, summed = _kernels().merge_forward(partial.contiguous(), phase1.mixed[row], phase1.queries[row],
                                                 phase1.lse[row], float(state.eps), state.constants.key_norm,
                                                 output=output)
    return summed, (hidden, summed, tensor_version(summed))


def merged(state) -> torch.Tensor | None:
    """The merged output `add` computed for this router, while the state's partial sum is still the one it read
    (the same tensor, written no more since: a hook that steers the partial sum, in place or by replacing it, gets
    the merge computed again from what it left); `None` otherwise."""
    if state.merged is None:
        return None
    hidden, partial, version = state.merged
    return hidden if partial is state.partial and tensor_version(partial) == version else None


def merge(state, weights, partial, mixed, query, lse, eps: float, key_norm: bool):
    """The merge of the partial sum `(B, T, D)` into a router's phase-1 result (`mixed (B, T, D)`, `lse (B, T)`;
    `weights (B, T, n)` fp32 its phase-1 depth weights, for backward): `hidden (B, T, D)` in the partial sum's dtype
    and the partial sum's logit `(B, T)` fp32."""
    if _grad_needed(partial, mixed, query, lse):
        return _Merge.apply(state.buffer, len(state.sources), weights, partial, mixed, query, lse, float(eps),
                            key_norm)
    return _kernels().merge_forward(partial.contiguous(), mixed, query.contiguous(), lse, float(eps), key_norm)


class _Phase1(torch.autograd.Function):
    """`phase1` with gradients, reading the source buffer (`_SourceScores`): `inputs` are the `n` slots' handles."""

    @staticmethod
    def forward(ctx, buffer, grads, n, queries, inv_rms, *inputs):
        queries = queries.contiguous()
        inv_rms = None if inv_rms is None else inv_rms.contiguous()
        probs, lse, mixed = _kernels().phase1_forward(buffer[:n], inv_rms, queries)
        ctx.buffer, ctx.grads, ctx.n = buffer, grads, n
        ctx.save_for_backward(queries, inv_rms, probs)
        ctx.set_materialize_grads(False)
        return probs, lse, mixed

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_probs, grad_lse, grad_mixed):
        queries, inv_rms, probs = ctx.saved_tensors
        values, n = ctx.buffer[: ctx.n], ctx.n
        needs = ctx.needs_input_grad[5:]
        target, accumulate = None, False
        if any(needs):
            grads = ctx.grads.open() if ctx.grads is not None else None
            if grads is not None:  # added to the slots' sums in place (`_SourceGrads.sums`)
                target, accumulate = grads.sums()[:n], True
            else:
                target = torch.empty_like(values)
        grad_inv, grad_queries = _kernels().phase1_backward(values, inv_rms, queries, probs, grad_mixed, grad_lse,
                                                            grad_probs, target, accumulate)
        grad_queries = grad_queries if ctx.needs_input_grad[3] else None
        grad_inv = grad_inv if ctx.needs_input_grad[4] else None
        if not any(needs) or accumulate:
            return None, None, None, grad_queries, grad_inv, *_nones(needs)
        return None, None, None, grad_queries, grad_inv, *(g if need else None for g, need in zip(target, needs))


class _Merge(torch.autograd.Function):
    """`merge` with gradients. Like the torch path's `_PartialMerge`, it keeps the partial sum and per-token scalars
    for backward but not the router's share of phase 1 (`mixed`, one `(B, T, D)` per router), which backward
    recomputes from the source buffer and the phase-1 weights (`weights (B, T, n)`)."""

    @staticmethod
    def forward(ctx, buffer, n, weights, partial, mixed, query, lse, eps, key_norm):
        partial, query = partial.contiguous(), query.contiguous()
        hidden, logit = _kernels().merge_forward(partial, mixed, query, lse, eps, key_norm)
        ctx.buffer, ctx.n, ctx.eps, ctx.key_norm, ctx.mixed_dtype = buffer, n, eps, key_norm, mixed.dtype
        ctx.save_for_backward(weights, partial, query, lse, logit)
        ctx.set_materialize_grads(False)
        return hidden, logit

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hidden, grad_logit):
        weights, partial, query, lse, logit = ctx.saved_tensors
        mixed = partial  # (not read without grad_hidden)
        if grad_hidden is not None:  # the forward's value, recomputed: (B, T, D)
            mixed = _mix_one(ctx.buffer, ctx.n, _as(weights, ctx.buffer.dtype))
        grad_partial, grad_mixed, grad_lse, grad_query = _kernels().merge_backward(
            partial, mixed, query, lse, logit, grad_hidden, grad_logit, ctx.eps, ctx.key_norm)
        if grad_mixed is not None:
            grad_mixed = _as(grad_mixed, ctx.mixed_dtype)
        return None, None, None, grad_partial, grad_mixed, grad_query, grad_lse, None, None
