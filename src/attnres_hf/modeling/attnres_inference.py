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
    `layout.scales[slot]` (`norm_eps`: the 0-dim fp32 tensor `sqrt(D eps)`); an `SdpaLayout`'s: `close_key`."""
    if type(layout) is SdpaLayout:
        return close_key(layout, slot, source)
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


SDPA_TOKENS = 64
"""The most tokens (`B * T`) a forward may have for its reads to be `SdpaLayout`'s single-query attention. Measured
on a 2-core CPU (hidden 576, 9 sources, 2 threads), one read: 5.5 us against 8.4 us for `direct`'s product, softmax
and weighted sum at one token, 30 us against 46 at 32, 53 against 57 at 64, even at 128, 3.4x slower at 512 (one
thread: even at 8 tokens, slower above); above it, the two-phase path scores each completed block once per block,
not once per read."""


def sdpa_serves(tokens: int, sigmoid: bool, bank: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether a lean forward over `tokens` tokens of a `dtype` stream reads through `SdpaLayout`: softmax scores (a
    sigmoid is no attention), a query bank (each router's query padded once), at most `SDPA_TOKENS` tokens, and fp32
    or wider. A bf16 or fp16 stream keeps the other reads, whose partial block sums are rounded to the stream's
    dtype at each sub-layer as the autograd paths' are: `SdpaLayout`'s, in fp32, moved a bf16 model's logits by up to
    2.2% of their scale from the depth-weights path's (tests/test_inference_sdpa.py), where the other reads' stay
    within 0.5%. Not while `torch.compile` traces: inductor fuses the other reads' products, softmax and sums into a
    few kernels, while attention stays one opaque call each (measured, whole-model compiled decode at the
    SmolLM2-135M shape on a 2-core CPU: Block 1.082x Llama's, Full 1.164x, against 1.024x and 1.066x without)."""
    return (not sigmoid and bank is not None and tokens <= SDPA_TOKENS and dtype.itemsize >= 4
            and not torch.compiler.is_compiling())


class SdpaLayout(NamedTuple):
    """The sources and their keys for reads as single-query attention, one `scaled_dot_product_attention` call each
    (a fused kernel): with the key norm folded into the query (`w g`, `_query_bank`), a read is, per token,

        logit_i = (w g sqrt(D)) . k_i,  k_i = v_i / hypot(sqrt(D eps), ||v_i||) = v_i / (sqrt(D) RMS(v_i))
        h = sum_i softmax_i(logit) v_i                                              (Eq. 1-4, scale 1)

    so each source's key `k_i` is written once, when it is completed (`close`), and the partial block sum's when a
    read takes it (`read`). The sum lives in its slot, `partial + output` written there (`write`), so closing a
    block copies nothing.

    `buffer`: `(K, B, T, n_slots, D + pad)`, `K` 2 with the key norm (values, keys), else 1 (the keys are the
    values); token-major, so that each token's sources are one `(n_slots, D + pad)` matrix; fp32 for bf16 and fp16
    streams: attention takes one dtype for the query, keys and values, and bf16 keys and queries moved the logits by
    2^-9 of their size (a read's output by up to 1.4% of its scale where the fp32-logit reads' moved by 0.35%,
    tests/test_inference_sdpa.py); the outputs are cast to the stream dtype (`dtype`), one call per read, and the
    partial sums add up in fp32 (more exact than the stream's bf16 sum, which the other paths keep, so the models
    read through this layout in fp32 and wider only: `sdpa_serves`). The pad
    (1 to 8 columns, `D + pad` a multiple of 8, which GPU attention kernels align to) holds `sqrt(D eps)` in its
    first value column and zeros elsewhere: a key's `||v_i||` over the padded row is `hypot(sqrt(D eps), ||v_i||)`
    in one call, and the queries' pad is zero, so the pad adds nothing to a logit (its share of an output is
    dropped).

    - `values`: per slot, `(B, T, D)` views (written), `rows` the same with the pad, `(B, T, D + pad)`;
    - `keys`: per slot, `(B, T, D + pad)` views of the keys, `()` without the key norm;
    - `prefixes`: `(keys, values)` over slots `0 .. c - 1` as `(B, T, c, D + pad)` views, at `c - 2` (`c >= 2`);
    - `queries`: per bank row, `(B, T, 1, D + pad)` in the buffer's dtype, `sqrt(D)` folded in with the key norm (a
      stride-0 expansion);
    - `root_dim`: `sqrt(D)` (1.0 without the key norm); `dtype`: the stream's (the sources').

    Made once per forward (`build`); `for_buffer` makes the views again over a moved buffer, as
    `InferenceLayout.for_buffer`."""

    values: tuple[torch.Tensor, ...]
    rows: tuple[torch.Tensor, ...]
    keys: tuple[torch.Tensor, ...]
    prefixes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    queries: tuple[torch.Tensor, ...]
    root_dim: float
    dtype: torch.dtype
    buffer: torch.Tensor

    @classmethod
    def build(cls, sources: torch.Tensor, bank: torch.Tensor, key_norm: bool, eps: float) -> "SdpaLayout":
        """`sources (n, B, T, D)`: the completed sources' buffer (its shape and dtype: this layout has a slot more, for
        the partial sum); `bank (R, D)` fp32 (`_query_bank`); `eps`: the key norm's."""
        slots, batch, seq, dim = sources.shape
        padded = dim + 8 - dim % 8
        buffer = sources.new_zeros(1 + key_norm, batch, seq, slots + 1, padded,
                                   dtype=sources.dtype if sources.dtype.itemsize >= 4 else torch.float32)
        root_dim = math.sqrt(dim) if key_norm else 1.0
        if key_norm:
            buffer[0, ..., dim].fill_(math.sqrt(dim * eps))
        queries = torch.nn.functional.pad(bank * root_dim if key_norm else bank, (0, padded - dim))
        queries = _as(queries, buffer.dtype).view(-1, 1, 1, 1, padded).expand(-1, batch, seq, 1, padded)
        return cls(*cls._views(buffer, dim), queries.unbind(0), root_dim, sources.dtype, buffer)

    @staticmethod
    def _views(buffer: torch.Tensor, dim: int) -> tuple:
        values, keys = buffer.unbind(0) if len(buffer) == 2 else (buffer[0], None)
        prefixes = []
        for count in range(2, values.shape[2] + 1):
            prefix = values[:, :, :count]
            prefixes.append((prefix if keys is None else keys[:, :, :count], prefix))
        return (values[..., :dim].unbind(2), values.unbind(2), () if keys is None else keys.unbind(2),
                tuple(prefixes))

    def for_buffer(self, buffer: torch.Tensor) -> "SdpaLayout":
        """This layout over `buffer`, the state's buffer after a device hook moved it (the queries, moved with it,
        keep their values)."""
        return self._replace(**dict(zip(("values", "rows", "keys", "prefixes"),
                                        self._views(buffer, self.values[0].shape[-1]))), buffer=buffer)

    def query(self, folded: torch.Tensor) -> torch.Tensor:
        """The `(B, T, 1, D + pad)` query of a router without a bank row (the final one) from its `folded (D,)` fp32
        (`AttnResRouter._folded_query`)."""
        padded = self.rows[0].shape[-1]
        query = torch.nn.functional.pad(folded * self.root_dim, (0, padded - folded.shape[-1]))
        return _as(query, self.buffer.dtype).expand(*self.rows[0].shape[:-1], 1, padded)


def write(layout: SdpaLayout, slot: int, partial: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    """The partial block sum `partial + output` (`output` alone at a block's start) written into slot `slot`: the
    slot's `(B, T, D)` view, the state's new partial sum."""
    target = layout.values[slot]
    return target.copy_(output) if partial is None else torch.add(target, output, out=target)


def close_key(layout: SdpaLayout, slot: int, source: torch.Tensor) -> None:
    """Slot `slot`'s key from its value (`source (B, T, D)`, copied there first unless it is the slot's view: the
    embedding, or a state a device hook moved), two calls: its padded row's norm and the quotient."""
    if source is not layout.values[slot]:
        layout.values[slot].copy_(source)
    if layout.keys:
        row = layout.rows[slot]
        torch.div(row, torch.linalg.vector_norm(row, dim=-1, keepdim=True), out=layout.keys[slot])


def read(layout: SdpaLayout, count: int, query: torch.Tensor, partial_slot: int | None) -> torch.Tensor:
    """One router over slots `0 .. count - 1` (the last one the partial sum at `partial_slot` when not `None`, its
    key written first): `(B, T, D)` in the stream dtype, the attention's output without the pad (a view in fp32). A
    lone source is its own read (softmax over one logit: weight 1)."""
    if partial_slot is not None:
        close_key(layout, partial_slot, layout.values[partial_slot])
    if count == 1:
        return _as(layout.values[0], layout.dtype)
    keys, values = layout.prefixes[count - 2]
    hidden = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=1.0)  # (B, T, 1, D + pad)
    batch, seq, _, padded = hidden.shape
    return _as(hidden.as_strided((batch, seq, layout.values[0].shape[-1]), (seq * padded, padded, 1)), layout.dtype)
