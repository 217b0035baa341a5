"""Attention Residuals (Kimi Team, "Attention Residuals", arXiv:2603.15031, Eq. 1-4 and 6;
the ablation knobs of its Table 4): its depth state, the router module and the modules that hold the routers (the
residual baseline's state is `mixing_base.ResidualState`).

The router's pieces are siblings: the read's implementations with one signature and their registry (`ops.py`: the
reference `ops_naive.py`, `ops_torch.py`, the Triton kernels' `ops_triton.py`, fla's `ops_fla.py`), the sources of
each router (`attnres_reference.py`), the source buffer and its autograd Functions (`attnres_buffer.py`), and
two-phase block inference (`attnres_two_phase.py`, the paper's Algorithm 1).

Travels with checkpoints as remote code (a relative import of `depth_mixing.py`): imports only torch, transformers and
its siblings `attnres_*.py`, `mixing_base.py`, `ops.py` and `torch_internals.py`.
"""

from itertools import islice
from typing import NamedTuple

import torch
from torch import nn

from transformers import initialization as init

from .attnres_buffer import SourceBuffer, _SourceGrads, _as, _source_inverse_rms, _store
from .attnres_fla import require_fla
from .attnres_inference import (SdpaLayout, close as close_source, direct as lean_direct, phase1 as lean_phase1,
                                read as sdpa_read, write as sdpa_write)
from .attnres_reference import attnres_num_sources
from .attnres_triton import (add as triton_add, merge as triton_merge, merged as triton_merged,
                             phase1 as triton_phase1, require_triton, serves as triton_serves)
from .attnres_two_phase import (Phase1, _Constants, _global_pre_hooks, _key_norm_reads_directly, _merge_inference,
                                _merged_weights, _BlockRead, _two_phase_applies, rebuilder)
from .mixing_base import (AttnResRMSNorm, DepthRead, DepthWrite, autocast_off, inverse_rms, registered_modules,
                          routed_sublayers, wrapped_modules)
from .ops import get as ops_get
from .ops_torch import merge as torch_merge, phase1 as torch_phase1
from .torch_internals import functorch_active


@routed_sublayers
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
    "input_dependent"`, `attnres_scalar_weights`), and every forward under a `torch.func` transform, keep the direct
    path over a stacked `(B, T, n, D)` tensor, grown by one source per closed block (`stacked`); the numbers are the
    same either way.

    Training memory (Kimi K3's recipe, eager, the two-phase path): the block sums are built once and shared through
    the buffer, and the reads' outputs are rebuilt in backward for the sub-layers' norms instead of kept
    (`DepthRead.recompute`, `AttnResRouter._merge`), so each sub-layer keeps its partial sum where a residual model
    keeps its stream (tests/test_training_memory.py).

    Gradient checkpointing: a replayed layer rewrites its block's slot with the same values, after every reader of
    that slot ran its backward; the state itself is immutable.

    The state holds tensors and plain values only, no module: it is a decoder layer's input, which accelerate's hooks
    move to the layer's device (`device_map`), calling `.to` on whatever has one. When hooks manage the routers'
    weights (offload), each router reads its own in its own forward, and phase 1 is not run (`_query_bank`).
    """

    sources: tuple[torch.Tensor, ...]  # completed sources b_0 (embedding), b_1 .. b_{n-1} (block sums), (B, T, D)
    inv_rms: torch.Tensor | None  # (B, T, n) fp32: 1/RMS of each source (None: `constants.layout`'s, `grads.inv`)
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
    implementation: str = "torch"  # `attnres_implementation`: who computes the direct reads (`ops.get`)
    merged: tuple | None = None  # the next router's merge, made with the last add, and what it read (`triton_add`)

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "AttnResState":
        """`model`: the `AttnResModel` whose layers this forward runs; its routers give the two-phase path its
        per-block query bank (`_query_bank`; without it, or when hooks manage the routers' weights, every router takes
        the direct path: same numbers). The state keeps no reference to them."""
        eps, size = config.rms_norm_eps, config.attnres_block_size
        # (`torch.func` transforms take neither the buffer's in-place writes nor its Functions; the reference: stacked)
        implementation = config.attnres_implementation
        if not _two_phase_applies(config) or implementation == "naive" or functorch_active(embeddings):
            statistics = inverse_rms(embeddings, eps).unsqueeze(-1)
            return cls((embeddings,), statistics, None, eps, size, 0, None, embeddings.unsqueeze(-2), None,
                       keep_weights, implementation=implementation)
        slots = 1 + max(config.num_sublayers - 1, 0) // size  # the embedding and every block closed before the end
        buffer = embeddings.new_empty(slots, *embeddings.shape)
        statistics = size == 1 and implementation != "triton" and config.attnres_key_norm  # (Full's: `_SourceGrads`)
        grads = _SourceGrads(buffer, eps if statistics else None) if _SourceGrads.applies() else None
        constants = None
        if model is not None:  # (iterating, not slicing `model.layers`: a slice builds a new ModuleList)
            layers = tuple(islice(model.layers, config.num_hidden_layers))
            routers = [router for layer in layers for router in registered_modules(layer, AttnResLayerModules)]
            key_norm = config.attnres_key_norm  # (a router's own key norm against the config's: see PLAIN_ROUTERS)
            if all(type(r) in PLAIN_ROUTERS and (r._modules.get("key_norm") is not None) == key_norm for r in routers):
                # the fewest-calls reads (`attnres_inference.py`): no autograd, no depth weights, the torch reads
                lean = not (torch.is_grad_enabled() or keep_weights or config.attnres_implementation != "torch")
                layers += wrapped_modules(layers, AttnResLayerModules)  # (whose hooks `_query_bank` checks too)
                constants = _Constants.build(config, layers, routers, buffer, lean)
        if constants is not None and constants.layout is not None:
            close_source(constants.layout, 0, embeddings, constants.norm_eps)
            handle, statistics, buffer = embeddings, None, constants.layout.buffer
        else:
            handle = _store(buffer, grads, 0, embeddings)
            statistics = None if grads is not None and grads.inv is not None else _source_inverse_rms(
                buffer, grads, 0, eps, handle).unsqueeze(-1)
        state = cls((embeddings,), statistics, None, eps, size, 0, buffer, None, None, keep_weights,
                    (handle,), grads, constants, config.attnres_implementation)
        return state._start_block()

    @autocast_off(lambda self: self.sources[0].device.type)
    def _start_block(self) -> "AttnResState":
        """Phase 1 for the block starting at `self.sublayer`: every router of the block against the completed
        sources, one product for the scores and one for the weighted sums (`Phase1`; `ops_torch.phase1`, or the
        Triton kernel), with the query bank and epsilon tensors the state made when it started (`_Constants`)."""
        # (no constants: no model given, or routers wrapped by another library, PEFT's modules_to_save: the direct
        # path, the same numbers)
        constants = self.constants
        bank = constants.bank if constants is not None else None
        start = self.sublayer
        if bank is None or start >= len(bank):
            return self if self.phase1 is None else self._replace(phase1=None)
        stop, eps = min(start + self.block_size, len(bank)), constants.eps
        if constants.layout is not None:  # no autograd, no depth weights (`attnres_inference.phase1`)
            if self.block_size == 1 or type(constants.layout) is SdpaLayout:  # each read a direct one (`_direct`)
                return self
            lse, mixed = lean_phase1(constants.layout, len(self.sources), start // self.block_size,
                                     constants.sigmoid, self.sources[0].shape)
            rows = constants.rows[start:stop]
            return self._replace(phase1=Phase1(start, stop, rows, (None,) * len(rows), lse, mixed, bank, eps))
        queries = bank[start:stop]  # (S, D): the block's query bank
        if self.implementation == "triton" and triton_serves(self):  # the fused kernel (`attnres_triton.py`)
            probs, lse, mixed = triton_phase1(self, queries, self.inv_rms if constants.key_norm else None,
                                              probs=self.keep_weights)  # (`None` in inference: not read)
            probs = (None,) * len(queries) if probs is None else probs.unbind(-2)
            return self._replace(phase1=Phase1(start, stop, queries.unbind(0), probs, lse.unbind(-1),
                                               mixed.unbind(-2), bank, eps))
        probs, lse, mixed = torch_phase1(self.source_buffer(), queries, key_norm=constants.key_norm, eps=self.eps,
                                         sigmoid=constants.sigmoid, inv_rms=self.inv_rms)
        return self._replace(phase1=Phase1(start, stop, queries.unbind(0), probs.unbind(-2),
                                           None if lse is None else lse.unbind(-1), mixed.unbind(-2), bank, eps))

    def source_buffer(self) -> SourceBuffer:
        """The completed sources as the ops read them (`ops.py`): the buffer, the sources and their autograd handles."""
        return SourceBuffer(self.buffer, self.sources, self.handles, self.grads)

    def on_its_buffer(self) -> "AttnResState":
        """The state whose buffer accelerate's device hooks moved (a `device_map` over several devices calls `.to` on
        each tensor it holds, so views of the buffer and the buffer become tensors of their own): the fewest-calls
        views made again from the moved buffer (`InferenceLayout.for_buffer`), and the in-place gradient sums, kept
        with the first buffer, left for autograd's own per-source sums from here on (the readers' handles take
        both). The state itself when nothing moved."""
        buffer, constants, grads = self.buffer, self.constants, self.grads
        if constants is not None and constants.layout is not None and constants.layout.buffer is not buffer:
            self = self._replace(constants=constants._replace(layout=constants.layout.for_buffer(buffer)))
        if grads is not None and grads.buffer is not buffer:
            self = self._replace(grads=None)
        return self

    def begin_sublayer(self) -> "AttnResState":
        """Close the current block when the next sub-layer starts a new one (Eq. 6: `b_n^0` is no source)."""
        self = self.on_its_buffer()
        if self.sublayer % self.block_size or self.partial is None:
            return self
        # AttnRes: the block's key norm statistics are computed here, once per block, not once per router.
        slot, partial = len(self.sources), self.partial
        handles = self.handles
        if self.constants is not None and self.constants.layout is not None:  # (`attnres_inference.close`)
            close_source(self.constants.layout, slot, partial, self.constants.norm_eps)
            state = self._replace(sources=(*self.sources, partial), partial=None, handles=(*handles, partial))
            return state._start_block()
        inv_rms, stacked = self.inv_rms, None
        if self.buffer is not None:
            handles = (*handles, _store(self.buffer, self.grads, slot, partial))
            eps = self.constants.eps if self.constants is not None else self.eps
            if inv_rms is not None:  # (else the buffer's accumulator holds them, `_SourceGrads.inv`)
                inv = _source_inverse_rms(self.buffer, self.grads, slot, eps, handles[-1])
                inv_rms = torch.cat([inv_rms, inv[..., None]], -1)
        else:
            inv_rms = torch.cat([inv_rms, inverse_rms(partial, self.eps)[..., None]], -1)
            stacked = torch.cat([self.stacked, partial.unsqueeze(-2)], dim=-2)  # (B, T, n+1, D)
        state = self._replace(sources=(*self.sources, partial), inv_rms=inv_rms, partial=None, stacked=stacked,
                              handles=handles)
        return state._start_block() if self.buffer is not None else state

    def _add(self, output: torch.Tensor) -> DepthWrite:
        output = _as(output, self.sources[0].dtype)  # (under autocast the stream keeps its dtype, as Llama's residual)
        layout = self.constants.layout if self.constants is not None else None
        if type(layout) is SdpaLayout:  # (the sum in its slot of the buffer: `attnres_inference.write`)
            partial, merged = sdpa_write(layout, len(self.sources), self.partial, output), None
        elif self.partial is not None and self.implementation == "triton":  # (with the next merge, if it can)
            partial, merged = triton_add(self, output)
        else:
            partial, merged = output if self.partial is None else self.partial + output, None
        return DepthWrite(self._replace(partial=partial, sublayer=self.sublayer + 1, merged=merged))

    def _route(self, router) -> DepthRead:
        state = self.begin_sublayer()
        hidden, weights = router(state)
        return DepthRead(state, hidden, None, () if weights is None else (weights,), rebuilder(hidden))

    def read_final(self, mixing) -> DepthRead:
        # The last block stays a partial sum: the same sources and numbers as closing it first.
        hidden, weights = mixing.final_res(self)
        return DepthRead(self, hidden, None, () if weights is None else (weights,))


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
        if config.attnres_implementation == "fla":
            require_fla(config)
        elif config.attnres_implementation == "triton":
            require_triton(config)

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

    @autocast_off(lambda self, state: state.sources[0].device.type)
    def forward(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor]:
        """Route `state` into one sub-layer input.

        Returns `h` of shape `(batch, seq_len, hidden_size)` in the sources' dtype and the depth weights in fp32:
        `(batch, seq_len, n_sources)` (`(batch, seq_len, heads, n_sources)` with `attnres_num_heads > 1`), completed
        sources in depth order, then the partial block sum. With the two-phase path and `output_depth_weights`
        off, a router may return `None` for the weights (they are not computed).

        Three paths, the same numbers (tests/test_two_phase.py): the two-phase merge (Block AttnRes inside a block
        whose phase 1 the state computed), the direct read of the source buffer (Full AttnRes, the final router, a
        model that gave the state no routers; fla's fused kernel with `attnres_implementation="fla"`), and the
        stacked path for the knobs the buffer does not serve (`attnres_num_heads > 1`, `attnres_window`,
        `attnres_query="input_dependent"`, `attnres_scalar_weights`), which also holds the reference's reads
        (`attnres_implementation="naive"`).
        """
        if state.buffer is None:
            return self._stacked_forward(state)
        state = state.on_its_buffer()  # (this router's own device hook may have moved it)
        phase1 = state.phase1
        if phase1 is not None and phase1.start <= state.sublayer < phase1.stop:
            return self._merge(state, phase1, state.sublayer - phase1.start)
        return self._direct(state)

    def _folded_query(self) -> torch.Tensor:
        """`w_l * g` (fp32, `(D,)`): the pseudo-query with the key-norm weight folded in (see `_logits`); the weight
        read in the key norm's forward when a hook intercepts it (`_forward_is_plain`, `AttnResRMSNorm.forward`)."""
        query = _as(self.query, torch.float32)
        return query if self._modules.get("key_norm") is None else self._fold_key_norm(query)

    def _query_and_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pseudo-query and the key norm's weight as the ops take them (`ops.py`): the parameters themselves, or,
        when a hook intercepts the key norm (`_fold_key_norm`), the query with the weight folded in and `None`."""
        key_norm = self._modules.get("key_norm")
        if key_norm is None or (_key_norm_reads_directly(key_norm) and not _global_pre_hooks()):
            return self.query, None if key_norm is None else key_norm._parameters["weight"]
        return key_norm(_as(self.query, torch.float32), normalize=False), None

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

    def _direct(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One router over the source buffer (views of it, no stacking) and the partial sum: one call of the read of
        `attnres_implementation` (`ops.get`; the torch one, the Triton kernels, fla's fused kernel), or the
        fewest-calls read without autograd and depth weights (`_direct_lean`)."""
        if state.constants is not None and state.constants.layout is not None:
            return self._direct_lean(state)
        partial, key_norm = state.partial, self.key_norm is not None
        query, weight = self._query_and_weight()
        count = len(state.sources) + (partial is not None)
        read = ops_get(state.implementation, state.buffer.device)
        return read(state.source_buffer(), query, weight,
                    partial=partial, key_norm=key_norm, eps=state.eps, sigmoid=self.score_fn == "sigmoid",
                    output_scale=self._rescale(count) if self.rescale_output else 1.0,
                    inv_rms=state.inv_rms if key_norm else None, return_weights=state.keep_weights)

    def _direct_lean(self, state: AttnResState) -> tuple[torch.Tensor, None]:
        """`_direct` in the fewest operator calls (`attnres_inference.direct`; no autograd, no depth weights): the
        query from the bank's transpose when this router has a row there, the partial sum merged as in phase 2; or,
        over an `SdpaLayout` (softmax, few tokens), one attention call over the sources, the partial sum included."""
        constants, partial, count = state.constants, state.partial, len(state.sources)
        layout, sublayer = constants.layout, state.sublayer
        if type(layout) is SdpaLayout:  # (softmax scores, few tokens: single-query attention, `attnres_inference.read`)
            query = layout.queries[sublayer] if sublayer < len(layout.queries) else layout.query(self._folded_query())
            hidden = sdpa_read(layout, count + (partial is not None), query, None if partial is None else count)
            count += partial is not None
            return (hidden * self._rescale(count) if self.rescale_output and count > 1 else hidden), None
        if sublayer < len(layout.columns) and partial is None:  # (Full AttnRes: every router but the final one)
            query = layout.columns[sublayer]
        else:
            folded = self._folded_query()
            query = (folded * layout.root_dim if self.key_norm is not None else folded).unsqueeze(-1)
        lse, hidden = lean_direct(layout, count, query, constants.sigmoid, state.sources[0].shape, partial is not None)
        if partial is not None:
            count += 1
            norm_eps = constants.norm_eps if self.key_norm is not None else None
            hidden = _merge_inference(partial, hidden, folded, lse, norm_eps)
        if self.rescale_output:
            hidden = hidden * self._rescale(count)
        return hidden, None

    def _merge(self, state: AttnResState, phase1: Phase1, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Phase 2 (paper Algorithm 1): router `j` of the block merges the partial sum into its phase-1 result.

        Softmax: with `lse` the log-sum-exp of the completed sources' logits and `p` the partial sum's logit, the
        completed sources keep the share `sigmoid(lse - p)` of the softmax mass and the partial sum gets
        `sigmoid(p - lse)`, so `h = lerp(partial, mixed_j, sigmoid(lse - p))`: the online-softmax update (running
        max and normaliser folded into `lse`). Sigmoid scores: `h = mixed_j + sigmoid(p) partial`. With gradients
        the merge is `_PartialMerge`, which keeps the partial sum for backward but not `mixed_j` (recomputed), and
        the block's first read is `_BlockRead`, which keeps nothing; both outputs are rebuilt in backward for the
        sub-layer's norm (`DepthRead.normed`), which then keeps no copy of them: a block's training memory is the
        residual stream's (Kimi K3's recipe). Without gradients and depth weights the merge is `_merge_inference`
        (the same numbers in fewer operations).
        """
        probs, mixed, partial = phase1.probs[j], phase1.mixed[j], state.partial
        count = len(state.sources)
        if partial is None:  # the block's first sub-layer: the completed sources only
            hidden, weights = mixed, probs
            if torch.is_grad_enabled() and mixed.requires_grad:  # its own storage, which backward rebuilds: the
                # sub-layer's norm must not keep the block's whole (B, T, S, D) phase-1 sum alive, nor this copy
                hidden = mixed.clone() if torch.compiler.is_compiling() else _BlockRead.apply(
                    state.buffer, count, _as(probs, state.buffer.dtype).detach(), mixed)
        else:
            count += 1
            lse, query = phase1.lse[j] if phase1.lse is not None else None, phase1.queries[j]
            key_norm, scale = self.key_norm is not None, self._rescale(count) if self.rescale_output else 1.0
            if state.merged is not None and (hidden := triton_merged(state)) is not None:  # (`attnres_triton.add`)
                weights = None
            elif state.implementation == "triton" and lse is not None and triton_serves(state):
                hidden, logit = triton_merge(state, probs, partial, mixed, query, lse, state.eps, key_norm)
                weights = _merged_weights(probs, lse, logit) if state.keep_weights else None
            elif state.keep_weights or (torch.is_grad_enabled() and any(
                    t is not None and t.requires_grad for t in (partial, mixed, query, lse))):
                # (with gradients `_PartialMerge`, which recomputes `mixed` from the sources in backward)
                return torch_merge(probs, lse, mixed, partial, query, key_norm=key_norm, eps=phase1.eps,
                                   output_scale=scale, return_weights=state.keep_weights,
                                   sources=state.source_buffer())
            else:  # inference: the output alone
                hidden, weights = _merge_inference(partial, mixed, query, lse,
                                                   state.constants.norm_eps if key_norm else None), None
        if self.rescale_output:
            hidden = hidden * self._rescale(count)
        return hidden, weights

    def _stacked_forward(self, state: AttnResState) -> tuple[torch.Tensor, torch.Tensor]:
        """The direct router over stacked sources `(B, T, n, D)`, for every knob (see `forward`), or the reference's
        read (`attnres_implementation="naive"`: `ops_naive.attnres` over the sources as the state holds them)."""
        sources, inv_rms, partial = state.stacked, state.inv_rms, state.partial
        if state.implementation == "naive":
            query, weight = self._query_and_weight()
            count = len(state.sources) + (partial is not None)
            return ops_get("naive", sources.device)(
                state.sources, query, weight, partial=partial, key_norm=self.key_norm is not None, eps=state.eps,
                sigmoid=self.score_fn == "sigmoid", output_scale=self._rescale(count) if self.rescale_output else 1.0)
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


PLAIN_ROUTERS = {AttnResRouter}
"""Router classes whose reads phase 1 may compute ahead of time (`_Constants`); any other (a subclass that changes the
read, PEFT's `modules_to_save` wrapper), and a router whose key norm is not the config's, takes the direct path."""


class AttnResLayerModules(NamedTuple):
    """The routers of decoder layer `i`: before its attention (sub-layer `2 i`) and before its MLP (`2 i + 1`)."""

    attn_res: AttnResRouter
    mlp_res: AttnResRouter

    @classmethod
    def build(cls, config, layer_idx: int) -> "AttnResLayerModules":
        return cls(AttnResRouter(config, 2 * layer_idx), AttnResRouter(config, 2 * layer_idx + 1))


class AttnResFinalModules(NamedTuple):
    """AttnRes: a final router reads all sources before the last norm (paper text; its README pseudocode omits it)."""

    final_res: AttnResRouter

    @classmethod
    def build(cls, config) -> "AttnResFinalModules":
        return cls(AttnResRouter(config, config.num_sublayers))
