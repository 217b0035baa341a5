"""AttnRes reads without autograd, in the fewest operator calls (arXiv:2603.15031, Eq. 1-4 and 6; two-phase block
inference, Algorithm 1): what a decoded token and a no-grad prefill run.

At one decoded token every operator call costs about the same, a kernel launch on a GPU, a few microseconds of
dispatch on a CPU, whatever its size; so these reads are written for the fewest calls, over views made once per
forward (`InferenceLayout`): the source buffer as one `(n_slots B T, D)` matrix and as `(B T, n_slots, D)` per
token, each completed source's key-norm scale kept slot-major beside it, and the model's query bank transposed
once. The numbers are the autograd paths' (`attnres_buffer.py`, `attnres_two_phase.py`), up to rounding:

    logit_i = (v_i . w g) / RMS(v_i) = (v_i . w g sqrt(D)) / hypot(sqrt(D eps), ||v_i||)     (Eq. 2-3, key norm)

so a source's scale `hypot(sqrt(D eps), ||v_i||)` is computed once when it is completed (`close`), and
`sqrt(D)` is folded into the transposed bank. Benchmarks: `benchmarks/op_count.py` (docs/speed.md).

Travels with checkpoints as remote code (a relative import of `mixing_attnres.py`): imports only torch and its
sibling `attnres_buffer.py`.
"""

import math
from typing import NamedTuple

import torch

from .attnres_buffer import _as


class InferenceLayout(NamedTuple):
    """Views of one no-grad forward's source buffer and the constants its reads share, made once when the depth
    state starts (`AttnResState.start`), so that a read makes no view it could have made once.

    - `slots`: the buffer's `n_slots` slots, `(B, T, D)` views of `(n_slots, B, T, D)`;
    - `flat`: `(n_slots * B * T, D)`, the buffer as one matrix (a view);
    - `per_token`: `(B * T, n_slots, D)`, the same memory per token (a strided view);
    - `scales`: `(n_slots, B * T, 1)` fp32, slot `i`'s `hypot(sqrt(D eps), ||v_i||)` once it is completed
      (`close`), and `scale_slots`, its `(B, T, 1)` views per slot; `None` and `()` without the key norm;
    - `blocks`: the model's query bank transposed, times `sqrt(D)` with the key norm, split by block: `(D, S)` each
      (the pseudo-queries with their key-norm weights folded in, `_query_bank`), and `columns`, the same per router,
      `(D, 1)` each; `()` when there is no bank (hooks manage the routers' weights: each router folds its own);
    - `tokens`: `B * T`; `root_dim`: `sqrt(D)` (1.0 without the key norm);
    - `buffer`: the buffer the views are of. Accelerate's device hooks (`device_map` over several devices) move the
      state, and with it each of these views, as tensors of their own: the state then rebuilds the views from its
      moved buffer (`for_buffer`).
    """

    slots: tuple[torch.Tensor, ...]
    flat: torch.Tensor
    per_token: torch.Tensor
    scales: torch.Tensor | None
    scale_slots: tuple[torch.Tensor, ...]
    blocks: tuple[torch.Tensor, ...]
    columns: tuple[torch.Tensor, ...]
    tokens: int
    root_dim: float
    buffer: torch.Tensor

    @classmethod
    def build(cls, buffer: torch.Tensor, bank: torch.Tensor | None, key_norm: bool,
              block_size: int) -> "InferenceLayout":
        """`buffer (n_slots, B, T, D)`; `bank (R, D)` fp32 or `None`; `block_size`: `attnres_block_size`."""
        slots, batch, seq, dim = buffer.shape
        tokens = batch * seq
        root_dim = math.sqrt(dim) if key_norm else 1.0
        scales = buffer.new_empty(slots, tokens, 1, dtype=torch.float32) if key_norm else None
        scale_slots = scales.view(slots, batch, seq, 1).unbind(0) if key_norm else ()
        blocks = columns = ()
        if bank is not None:
            bank_t = bank.T * root_dim if key_norm else bank.T
            blocks = bank_t.split(block_size, dim=1) if block_size > 1 else ()
            columns = bank_t.split(1, dim=1) if block_size == 1 else ()
        return cls(*cls._views(buffer), scales, scale_slots, blocks, columns, tokens, root_dim, buffer)

    @staticmethod
    def _views(buffer: torch.Tensor) -> tuple:
        slots, batch, seq, dim = buffer.shape
        return buffer.unbind(0), buffer.view(-1, dim), buffer.view(slots, batch * seq, dim).transpose(0, 1)

    def for_buffer(self, buffer: torch.Tensor) -> "InferenceLayout":
        """This layout over `buffer`, the state's buffer after a device hook moved it (the scales and the bank, moved
        with it, keep their values; the slot views are made again)."""
        scale_slots = () if self.scales is None else self.scales.view(*buffer.shape[:-1], 1).unbind(0)
        slots, flat, per_token = self._views(buffer)
        return self._replace(slots=slots, flat=flat, per_token=per_token, scale_slots=scale_slots, buffer=buffer)


def close(layout: InferenceLayout, slot: int, source: torch.Tensor, norm_eps: torch.Tensor) -> None:
    """Write the completed `source (B, T, D)` into the buffer's slot `slot` and its key-norm scale into
    `layout.scales[slot]` (`norm_eps`: the 0-dim fp32 tensor `sqrt(D eps)`)."""
    layout.slots[slot].copy_(source)
    if layout.scales is not None:
        norms = torch.linalg.vector_norm(_as(source, torch.float32), dim=-1, keepdim=True)
        torch.hypot(norm_eps, norms, out=layout.scale_slots[slot])


def _logits(layout: InferenceLayout, n: int, queries_t: torch.Tensor) -> torch.Tensor:
    """`(n, B T, S)` fp32: the completed sources' logits against `queries_t (D, S)` (`sqrt(D)` folded in with the
    key norm)."""
    values = _as(layout.flat[: n * layout.tokens], torch.float32)
    logits = (values @ queries_t).view(n, layout.tokens, -1)
    return logits if layout.scales is None else logits / layout.scales[:n]


def _mix(layout: InferenceLayout, n: int, weights: torch.Tensor) -> torch.Tensor:
    """`(B T, S, D)` in the buffer's dtype: `sum_i weights[i] v_i`, `weights (n, B T, S)` fp32."""
    per_token = layout.per_token[:, :n]
    return torch.bmm(_as(weights.permute(1, 2, 0), per_token.dtype), per_token)


def phase1(layout: InferenceLayout, n: int, block: int, sigmoid: bool, shape: torch.Size):
    """Phase 1 of block `block` (its `S` routers' queries: `layout.blocks[block]`) over the `n` completed sources:
    `(lse, mixed)`, each a tuple of the block's `S` routers' tensors: `lse` `(B, T, 1)` fp32, the log-sum-exp of
    each router's logits (softmax; `None` for sigmoid scores), `mixed` `(B, T, D)` in the buffer's dtype, the
    completed sources' weighted sum. `shape`: the sources' `(B, T, D)`."""
    logits = _logits(layout, n, layout.blocks[block])  # (n, B T, S)
    if sigmoid:
        probs, lse = torch.sigmoid(logits), None
    else:
        probs = torch.softmax(logits, dim=0)
        lse = torch.logsumexp(logits, dim=0).view(*shape[:-1], -1, 1).unbind(-2)
    mixed = _mix(layout, n, probs).view(*shape[:-1], -1, shape[-1]).unbind(-2)
    return lse, mixed


def direct(layout: InferenceLayout, n: int, query: torch.Tensor, sigmoid: bool, shape: torch.Size,
           need_lse: bool):
    """One router over the `n` completed sources: `(lse, mixed)` as `phase1`'s for one router (`lse` `None` unless
    `need_lse`), `query (D, 1)` fp32 with `sqrt(D)` folded in with the key norm."""
    logits = _logits(layout, n, query)
    if sigmoid:
        probs, lse = torch.sigmoid(logits), None
    else:
        probs = torch.softmax(logits, dim=0)
        lse = torch.logsumexp(logits, dim=0).view(*shape[:-1], 1) if need_lse else None
    return lse, _mix(layout, n, probs).view(shape)
