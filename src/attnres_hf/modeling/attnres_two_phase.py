"""Two-phase block inference of Block AttnRes (arXiv:2603.15031, Algorithm 1, over the sources of Eq. 6). Phase 1:
when a block starts, every router of the block is scored against the completed sources at once (`Phase1`), with the
model's query bank and the constants made once per forward (`_query_bank`, `_Constants`) and the checks that reading
the routers' weights outside their own forwards is sound (`_forward_is_plain`). Phase 2: each sub-layer merges its
block's partial sum into its phase-1 result, an online-softmax update (`_merge_partial`, `_merge_inference`, and
`_PartialMerge` with gradients).

Travels with checkpoints as remote code (a relative import of `mixing_attnres.py`): imports only torch and its
siblings `attnres_buffer.py`, `attnres_inference.py`, `mixing_base.py` and `torch_internals.py`.
"""

import functools
import math
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .attnres_buffer import _as, _mix_one
from .attnres_inference import InferenceLayout, SdpaLayout, sdpa_serves
from .mixing_base import AttnResRMSNorm, inverse_rms
from .torch_internals import forwards_plain, global_pre_hooks


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
    return forwards_plain((module,))


def _global_pre_hooks() -> bool:
    """Whether forward pre-hooks are registered for every module (`register_module_forward_pre_hook`; `True` where
    torch's table of them is unknown: `torch_internals.global_pre_hooks`)."""
    return global_pre_hooks()


def _key_norm_reads_directly(key_norm: nn.Module) -> bool:
    """Whether a router's key norm holds its weight as a plain parameter that its forward reads as is (no
    parametrization, which changes the class; `_forward_is_plain`)."""
    return type(key_norm) is AttnResRMSNorm and _forward_is_plain(key_norm)


def _query_bank(layers, routers) -> torch.Tensor | None:
    """`(len(routers), D)` fp32: each router's pseudo-query with its key-norm weight folded in (see
    `AttnResRouter._logits`), stacked once per forward for every block's phase 1; `None` when a hook intercepts the
    forward of a decoder layer (or of a module a wrapped layer wraps, `mixing_base.wrapped_modules`: the caller
    passes them with `layers`), a router or its key norm (`_forward_is_plain`).

    Phase 1 reads the routers of a block's later layers before they run, and the bank every router before any layer
    runs, which is only sound while nothing manages their weights: under accelerate's offload (`device_map` with disk
    or CPU offload, `max_memory`) a module's weights are there during its own forward only, a layer on another device
    holds its routers there, and FSDP2's `fully_shard` of the decoder layers gathers a layer's sharded parameters in
    its pre-forward hook. Then there is no bank and every router takes the direct path, reading its own weights in its
    own forward (the same numbers)."""
    # (`_forward_is_plain` and `_key_norm_reads_directly` in one pass over the modules, about 150, without a call per
    # module; the modules' dictionaries, not attribute access: `nn.Module.__getattr__` costs a microsecond)
    key_norms = [r._modules.get("key_norm") for r in routers]
    with_norm = [k for k in key_norms if k is not None]
    if (_global_pre_hooks() or not forwards_plain(layers) or not forwards_plain(routers)
            or not forwards_plain(with_norm) or not all(type(k) is AttnResRMSNorm for k in with_norm)):
        return None
    bank = _as(torch.stack([r._parameters["query"] for r in routers]), torch.float32)
    if with_norm:
        bank = bank * _as(torch.stack([k._parameters["weight"] for k in with_norm]), torch.float32)
    return bank


class _Constants(NamedTuple):
    """What every router of one forward shares, made once when the state starts (only when every router is a plain
    `AttnResRouter`): `bank`, the model's query bank `(2 L, D)` fp32 (`_query_bank`; `None` for Full AttnRes, which
    has no phase 1, and when hooks manage the routers' weights: each router folds its own query when it reads);
    `eps`, the key norm's epsilon as a 0-dim fp32 tensor (see `inverse_rms`); `norm_eps`, `sqrt(D eps)` as one (see
    `_merge_inference`); `key_norm` and `sigmoid`: whether the routers have a key norm and sigmoid scores (the
    config's, so that phase 1 needs no router); `layout`: the views and constants of the fewest-calls reads
    (`attnres_inference.InferenceLayout`, or `SdpaLayout` for softmax scores over few tokens, `sdpa_serves`; no-grad
    forwards without depth weights that the torch implementation computes, else `None`), with `rows`, the bank's
    rows (`eps` and `norm_eps` are `None` and `rows` empty with an `SdpaLayout`, whose reads take none of them).
    Tensors and flags only: the state that holds them crosses accelerate's device hooks, which move what has a
    `.to`."""

    bank: torch.Tensor | None
    eps: torch.Tensor | None
    norm_eps: torch.Tensor | None
    key_norm: bool
    sigmoid: bool
    layout: InferenceLayout | SdpaLayout | None = None
    rows: tuple[torch.Tensor, ...] = ()

    @classmethod
    def build(cls, config, layers, routers, buffer: torch.Tensor, lean: bool = False) -> "_Constants":
        """`buffer`: the forward's source buffer `(n_slots, B, T, D)`; `lean`: whether its reads take the
        fewest-calls path (`attnres_inference.py`)."""
        eps = config.rms_norm_eps
        bank = _query_bank(layers, routers) if config.attnres_block_size > 1 or lean else None
        if lean and sdpa_serves(math.prod(buffer.shape[1:-1]), config.attnres_score_fn == "sigmoid", bank,
                                buffer.dtype):
            # (its reads need neither epsilon tensor nor the bank's rows)
            return cls(bank, None, None, config.attnres_key_norm, False,
                       SdpaLayout.build(buffer, bank, config.attnres_key_norm, eps))
        layout = InferenceLayout.build(buffer, bank, config.attnres_key_norm, config.attnres_block_size) if lean else None
        return cls(bank, torch.full((), eps, device=buffer.device),
                   torch.full((), math.sqrt(buffer.shape[-1] * eps), device=buffer.device), config.attnres_key_norm,
                   config.attnres_score_fn == "sigmoid", layout, bank.unbind(0) if lean and bank is not None else ())


def _merge_partial(partial, mixed, query, lse, eps, key_norm):
    """Phase 2's arithmetic (see `AttnResRouter._merge`): the merged router output `(B, T, D)` in the stream dtype, the
    partial sum's logit `(B, T)` fp32, then, as `(B, T, 1)` fp32 columns (what backward reads), that logit, its
    `1/RMS` (`None` without the key norm), the completed sources' share (softmax; `lse (B, T)` is their
    log-sum-exp) or the partial sum's sigmoid gate (`lse` is `None`), and that share's complement `1 - share`
    (computed as a sigmoid of its own: `1 - sigmoid(x)` in fp32 loses the digits of a small complement, which
    backward multiplies gradients by). `eps`: the key norm's epsilon, a 0-dim fp32 tensor (`_Constants`)."""
    values = _as(partial, query.dtype)
    logit = (values * query).sum(-1, keepdim=True)  # (B, T, 1)
    inv = None
    if key_norm:  # rsqrt(mean(partial^2) + eps)
        inv = torch.rsqrt(torch.add(eps, (values * values).sum(-1, keepdim=True), alpha=1 / values.shape[-1]))
        logit = logit * inv
    if lse is None:  # sigmoid scores: h = mixed + sigmoid(p) partial
        share, complement = torch.sigmoid(logit), torch.sigmoid(-logit)
        hidden = torch.addcmul(mixed, _as(share, partial.dtype), partial)
    else:  # softmax: the completed sources keep sigmoid(lse - p) of the mass (online-softmax update)
        lse = lse.unsqueeze(-1)
        share, complement = torch.sigmoid(lse - logit), torch.sigmoid(logit - lse)
        hidden = torch.lerp(partial, mixed, _as(share, partial.dtype))
    return hidden, logit.squeeze(-1), logit, inv, share, complement


def _merged_weights(probs, lse, logit):
    """The depth weights `(B, T, n + 1)` fp32 of a merged read: the completed sources' phase-1 weights `probs
    (B, T, n)` times their share, then the partial sum's (softmax: `lse` their log-sum-exp; sigmoid scores: `lse` is
    `None` and each weight is its own sigmoid), from the partial sum's logit `(B, T)`."""
    if lse is None:
        return torch.cat([probs, torch.sigmoid(logit)[..., None]], dim=-1)
    return torch.cat([probs * torch.sigmoid(lse - logit)[..., None], torch.sigmoid(logit - lse)[..., None]], dim=-1)


def _merge_inference(partial, mixed, query, lse, norm_eps):
    """`_merge_partial`'s merged output `(B, T, D)` alone, in the fewest operations: the no-grad path without depth
    weights (a decoded token runs one per sub-layer, and at one token each operation costs microseconds).

    The key norm enters as `p = (partial . q) sqrt(D) / hypot(sqrt(D eps), ||partial||)` (`norm_eps`: the 0-dim fp32
    tensor `sqrt(D eps)`; `None` without the key norm), which is `(partial . q) rsqrt(mean(partial^2) + eps)`; with
    softmax scores the completed sources' share `sigmoid(lse - p)` takes one fused `addcdiv`. `lse`: `(B, T, 1)`
    (`attnres_inference.phase1`) or `(B, T)` (`Phase1`), fp32; `None` for sigmoid scores."""
    values = _as(partial, torch.float32)
    if lse is not None and lse.dim() < partial.dim():
        lse = lse.unsqueeze(-1)
    logit = (values * query).sum(-1, keepdim=True)  # (B, T, 1): partial . q, before the key norm
    if norm_eps is not None:
        norm = torch.hypot(norm_eps, torch.linalg.vector_norm(values, dim=-1, keepdim=True))
        scale = math.sqrt(partial.shape[-1])
        if lse is not None:  # lse - p in one operation
            share = torch.sigmoid(torch.addcdiv(lse, logit, norm, value=-scale))
            return torch.lerp(partial, mixed, _as(share, partial.dtype))
        logit = torch.div(logit, norm).mul_(scale)
    if lse is None:  # sigmoid scores: h = mixed + sigmoid(p) partial
        return torch.addcmul(mixed, _as(torch.sigmoid(logit), partial.dtype), partial)
    return torch.lerp(partial, mixed, _as(torch.sigmoid(lse - logit), partial.dtype))


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
        hidden, logit, *columns = _merge_partial(partial, mixed, query, lse, eps, key_norm)
        ctx.buffer, ctx.n, ctx.softmax = buffer, n, lse is not None
        ctx.save_for_backward(weights, partial, query, *columns)
        ctx.rebuild_inputs = (weights, partial, columns[2])  # (taken by `rebuilder`: the arguments of `rebuild`)
        ctx.set_materialize_grads(False)
        return hidden, logit

    @staticmethod
    def rebuild(ctx, weights, partial, share) -> torch.Tensor:
        """The merged output `(B, T, D)` again (`DepthRead.recompute`, for the sub-layer's norm's backward, which runs
        before this Function's): `mixed` recomputed from the buffer and `weights` (and kept on `ctx` for the softmax
        backward, which needs it next), merged with the partial sum by its `share` `(B, T, 1)` fp32."""
        ctx.mixed = mixed = _mix_one(ctx.buffer, ctx.n, weights)
        if ctx.softmax:
            return torch.lerp(partial, mixed, _as(share, partial.dtype))
        return torch.addcmul(mixed, _as(share, partial.dtype), partial)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hidden, grad_logit):
        weights, partial, query, logit, inv, share, complement = ctx.saved_tensors  # (B, T, 1) columns but `weights`
        mixed, ctx.mixed = getattr(ctx, "mixed", None), None  # (`rebuild`'s, when the norm's backward called it)
        values = _as(partial, query.dtype)  # the arithmetic in fp32, as in the forward
        grad_mixed = grad_lse = None
        grad_p = None if grad_logit is None else grad_logit.unsqueeze(-1)  # (B, T, 1)
        if grad_hidden is not None:
            grad = _as(grad_hidden, query.dtype)
            if ctx.softmax:
                if mixed is None:  # the forward's value, recomputed
                    mixed = _mix_one(ctx.buffer, ctx.n, weights)
                grad_lse = (grad * (_as(mixed, query.dtype) - values)).sum(-1, keepdim=True) * (share * complement)
                grad_p = -grad_lse if grad_p is None else grad_p - grad_lse
                grad_mixed, kept = grad * share, complement  # `kept`: the partial sum's own share of the output
                grad_lse = grad_lse.squeeze(-1)
            else:
                term = (grad * values).sum(-1, keepdim=True) * (share * complement)
                grad_p = term if grad_p is None else grad_p + term
                grad_mixed, kept = grad, share
        if grad_p is None:  # (no gradient reached either output: autograd does not call backward then)
            grad_p = torch.zeros_like(logit)
        if inv is not None:  # p = r (partial . q) with r = (mean(partial^2) + eps)^(-1/2)
            coefficient = grad_p * inv
            grad_values = torch.addcmul(coefficient * query, coefficient * logit * inv, values,
                                        value=-1 / values.shape[-1])
        else:
            coefficient = grad_p
            grad_values = coefficient * query
        grad_query = (coefficient * values).sum(tuple(range(values.dim() - 1)))
        grad_partial = grad_values if grad_hidden is None else torch.addcmul(grad_values, grad, kept)
        grad_mixed = None if grad_mixed is None else _as(grad_mixed, ctx.buffer.dtype)
        return None, None, None, _as(grad_partial, partial.dtype), grad_mixed, grad_query, grad_lse, None, None


class _BlockRead(torch.autograd.Function):
    """The first read of a block with gradients: router `j`'s phase-1 sum `mixed (B, T, D)` (a view of the block's
    `(B, T, S, D)` sum) as a tensor of its own (contiguous), which backward rebuilds from the source buffer and the
    router's phase-1 weights `weights (B, T, n)` (buffer dtype, detached, as `_PartialMerge`'s) instead of keeping it
    (`rebuild`; the sub-layer's norm would keep it otherwise). The gradient passes through to `mixed`."""

    @staticmethod
    def forward(ctx, buffer, n, weights, mixed):
        ctx.buffer, ctx.n, ctx.rebuild_inputs = buffer, n, (weights,)
        return mixed.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def rebuild(ctx, weights) -> torch.Tensor:
        """The output `(B, T, D)` again (`DepthRead.recompute`)."""
        return _mix_one(ctx.buffer, ctx.n, weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return None, None, None, grad


def rebuilder(hidden: torch.Tensor):
    """`DepthRead.recompute` for a router's output `hidden`: the rebuild of the Function that made it
    (`_PartialMerge`, `_BlockRead`), or `None` for any other (the direct reads, a rescaled output, no gradients,
    traced code). The rebuild holds its inputs itself, taken from the Function's node (which then no longer holds
    them), so it needs no saved tensor of the node (compiled autograd moves those out of it before its graph runs),
    and a read whose rebuild is dropped (`DepthRead.normed` under a checkpoint's hooks) keeps nothing alive."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    node = hidden.grad_fn
    function = getattr(type(node), "_forward_cls", None)  # (a custom Function's backward node names its Function)
    if function not in (_PartialMerge, _BlockRead):
        return None
    inputs, node.rebuild_inputs = node.rebuild_inputs, None
    return functools.partial(function.rebuild, node, *inputs)
