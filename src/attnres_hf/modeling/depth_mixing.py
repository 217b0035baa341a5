"""The depth-mixing family: how each sub-layer of the decoder reads the outputs of the layers below it.

One `AttnResConfig.depth_mixing` value is one *state* class in `DEPTH_MIXING`. The state is an immutable
`NamedTuple` of tensors (so a gradient-checkpointed layer can be replayed on it) that the decoder layer drives:

    state, (q_in, k_in, v_in), w = state.read_attn(layer)    # input(s) of the attention (k_in/v_in None: = q_in)
    state = state.write_attn(layer, attention_output)
    state, x, w = state.read_mlp(layer)                      # input of the MLP
    state, w = state.write_mlp(layer, mlp_output)
    hidden, w = state.read_final(model)                      # input of the final norm

Each method returns the depth weights it computed (a tuple, empty when there are none). A state also says which
mixing modules it needs (`layer_modules`, `final_modules`), and each module has `reset_parameters()`: the
initialisation under which the model is exactly the residual model (the one `retrofit` uses).

Sub-layers: attention and MLP each count as one (a "layer" in the AttnRes paper); `num_hidden_layers = L` gives
`2 L`. All mixing weights, norms, softmax and sigmoid run in fp32; outputs are cast back to the stream's dtype.

Travels with checkpoints as remote code (a relative import of `modeling_attnres.py`): imports only torch and
transformers.
"""

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from transformers import initialization as init


class AttnResRMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in fp32 (Llama's `LlamaRMSNorm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`1 / RMS(x)` over the last axis in fp32: `(..., d) -> (...)`."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def _rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / RMS(x)` in fp32, without a learned scale."""
    return x.float() * _inv_rms(x, eps).unsqueeze(-1)


# ---------------------------------------------------------------------------------------------------------------
# Residual baseline and Attention Residuals (Kimi Team, arXiv:2603.15031, Eq. 1-4 and 6; ablations of Table 4)
# ---------------------------------------------------------------------------------------------------------------


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
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "ResidualState":
        return cls(embeddings)

    @staticmethod
    def layer_modules(config, layer_idx: int) -> dict[str, nn.Module]:
        return {}

    @staticmethod
    def final_modules(config) -> dict[str, nn.Module]:
        return {}

    def read_attn(self, layer):
        return self, (self.hidden, None, None), ()

    def write_attn(self, layer, output: torch.Tensor) -> "ResidualState":
        return ResidualState(self.hidden + output)

    def read_mlp(self, layer):
        return self, self.hidden, ()

    def write_mlp(self, layer, output: torch.Tensor):
        return ResidualState(self.hidden + output), ()

    def read_final(self, model):
        return self.hidden, ()


def attnres_num_sources(config, sublayer: int) -> int:
    """Sources of the router before sub-layer `sublayer` (`2 L` = the final router): the embedding, the completed
    blocks and, inside a block, its partial sum (Eq. 6), cut to `1 + attnres_window` by a sliding window."""
    size = config.attnres_block_size
    count = 1 + sublayer // size + (1 if sublayer % size else 0)
    return count if config.attnres_window is None else min(count, 1 + config.attnres_window)


class AttnResState(NamedTuple):
    """Depth state of Block AttnRes (paper Eq. 6; Full AttnRes is block size 1)."""

    sources: torch.Tensor  # (B, T, n, D): completed sources b_0 (embedding), b_1 .. b_{n-1} (block sums)
    inv_rms: torch.Tensor  # (B, T, n) fp32: 1/RMS of each completed source, the key norm statistics
    partial: torch.Tensor | None  # (B, T, D): b_n^{i-1}, the sum of the current block so far; None at its start
    eps: float

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "AttnResState":
        eps = config.rms_norm_eps
        return cls(embeddings.unsqueeze(-2), _inv_rms(embeddings, eps).unsqueeze(-1), None, eps)

    @staticmethod
    def layer_modules(config, layer_idx: int) -> dict[str, nn.Module]:
        return {"attn_res": AttnResRouter(config, 2 * layer_idx), "mlp_res": AttnResRouter(config, 2 * layer_idx + 1)}

    @staticmethod
    def final_modules(config) -> dict[str, nn.Module]:
        # AttnRes: a final router aggregates all sources before the last norm (paper text; its README pseudocode
        # omits it).
        return {"final_res": AttnResRouter(config, config.num_sublayers)}

    def begin_sublayer(self, index: int, block_size: int) -> "AttnResState":
        """Close the current block when sub-layer `index` starts a new one (Eq. 6: `b_n^0` is no source)."""
        if index % block_size or self.partial is None:
            return self
        # AttnRes: the block's key norm statistics are computed here, once per block, not once per router.
        sources = torch.cat([self.sources, self.partial.unsqueeze(-2)], dim=-2)  # (B, T, n+1, D)
        inv_rms = torch.cat([self.inv_rms, _inv_rms(self.partial, self.eps).unsqueeze(-1)], dim=-1)
        return AttnResState(sources, inv_rms, None, self.eps)

    def add(self, output: torch.Tensor) -> "AttnResState":
        partial = output if self.partial is None else self.partial + output
        return self._replace(partial=partial)

    def read_attn(self, layer):
        state = self.begin_sublayer(2 * layer.layer_idx, layer.block_size)
        hidden, weights = layer.attn_res(state)
        return state, (hidden, None, None), (weights,)

    def write_attn(self, layer, output: torch.Tensor) -> "AttnResState":
        return self.add(output)

    def read_mlp(self, layer):
        state = self.begin_sublayer(2 * layer.layer_idx + 1, layer.block_size)
        hidden, weights = layer.mlp_res(state)
        return state, hidden, (weights,)

    def write_mlp(self, layer, output: torch.Tensor):
        return self.add(output), ()

    def read_final(self, model):
        hidden, weights = model.final_res(self)
        return hidden, (weights,)


class AttnResRouter(nn.Module):
    """Attention over depth sources with a learned pseudo-query (paper Eq. 1-4 and 6), plus the ablation knobs of
    the paper's Table 4 (see `AttnResConfig`).

        logit_i = w_l . RMSNorm(v_i)          (Eq. 2-3; no 1/sqrt(d); fp32)
        alpha   = softmax_i(logit)            (Eq. 2)        h_l = sum_i alpha_i v_i       (Eq. 1)

    Knobs: `attnres_score_fn="sigmoid"` (alpha_i = sigmoid(logit_i), unnormalised); `attnres_key_norm=False`
    (logit_i = w_l . v_i); `attnres_window=W` (embedding + the W most recent sources); `attnres_query=
    "input_dependent"` (w_l + W_l RMSNorm(v_last), `query_proj` zero-initialised); `attnres_num_heads=H` (H slices of
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
            query = query + (last.float() * last_inv.unsqueeze(-1)) @ self.query_proj.float().T  # (B, T, D)
        if self.key_norm is not None:
            # RMSNorm(v) . w = (v / rms(v)) . (w * g): fold the key-norm weight g into the query, so the per-source
            # statistics (`inv_rms`) are shared by every router of a block.
            query = query * self.key_norm.weight.float()
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
        sources in depth order, then the partial block sum.
        """
        sources, inv_rms, partial = state.sources, state.inv_rms, state.partial
        if self.window is not None:  # Table 4 "sliding window": the embedding and the W most recent sources
            keep = self.window - (partial is not None)
            if sources.shape[-2] - 1 > keep:
                sources = torch.cat([sources[..., :1, :], sources[..., sources.shape[-2] - keep :, :]], dim=-2)
                inv_rms = torch.cat([inv_rms[..., :1], inv_rms[..., inv_rms.shape[-1] - keep :]], dim=-1)
        need_partial_inv = partial is not None and (self.key_norm is not None or self.query_proj is not None)
        partial_inv = _inv_rms(partial, state.eps) if need_partial_inv else None
        logits = self._logits(sources, inv_rms, partial, partial_inv)
        if self.score_fn == "sigmoid":
            weights, factor = torch.sigmoid(logits), 2.0  # sigmoid(0) = 1/2: x2 makes zero scores the residual sum
        else:
            weights, factor = torch.softmax(logits, dim=-1), logits.shape[-1]
        mix = (weights * factor if self.rescale_output else weights).to(sources.dtype)
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


# ---------------------------------------------------------------------------------------------------------------
# DenseFormer (Pagliardini et al., "DenseFormer: Enhancing Information Flow in Transformers via Depth Weighted
# Averaging", NeurIPS 2024)
# ---------------------------------------------------------------------------------------------------------------


def denseformer_sources(config, layer_idx: int) -> list[int]:
    """Indices `j` of the states `B_j` the DWA after layer `layer_idx` averages (paper Sec. 3, dilation `k`):
    `j in 0 .. i` with `j = i (mod k)`, where `i = layer_idx + 1` (state `B_0` is the embedding)."""
    i, k = layer_idx + 1, config.denseformer_dilation
    return [j for j in range(i + 1) if (i - j) % k == 0]


class DepthWeightedAverage(nn.Module):
    """DenseFormer's Depth-Weighted Average after decoder layer `i` (paper Eq. 1, Sec. 3):

        B_i = Block_i(X_{i-1})   (the layer's output, its own residual adds included; B_0 = embedding)
        X_i = sum_{j in S_i} alpha_{i,j} B_j          S_i = {j <= i : j = i (mod k)} (dilation k)

    `alpha` (`(|S_i|,)`, static learned scalars, fp32 mix) is initialised to `alpha_{i,i} = 1`, the others 0, so
    that `X_i = B_i`: the residual model. With period `p` a DWA follows only layers with `i = 0 (mod p)`; the others
    pass `B_i` on. Parameter: `layers.N.dwa.alpha` (layer `N = i - 1`).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.source_indices = denseformer_sources(config, layer_idx)
        self.alpha = nn.Parameter(torch.zeros(len(self.source_indices)))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        identity = torch.zeros(len(self.source_indices))
        identity[-1] = 1.0  # weight 1 on the current state
        init.copy_(self.alpha, identity)

    def forward(self, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`states`: `B_0 .. B_i`, each `(batch, seq_len, hidden_size)`. Returns `X_i` (their dtype) and the weights
        `(batch, seq_len, |S_i|)` (fp32, the static alphas broadcast)."""
        values = torch.stack([states[j] for j in self.source_indices], dim=-2)  # (B, T, n, D)
        alpha = self.alpha.float()
        hidden = torch.einsum("n,btnd->btd", alpha, values.float()).to(values.dtype)
        return hidden, alpha.expand(*values.shape[:2], -1)


class DenseFormerState(NamedTuple):
    """DenseFormer: standard pre-norm layers whose output passes through a DWA (see `DepthWeightedAverage`)."""

    hidden: torch.Tensor  # (B, T, D): X, the stream the current layer reads and adds to
    states: tuple  # B_0 .. B_i: the embedding and every layer output so far

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "DenseFormerState":
        return cls(embeddings, (embeddings,))

    @staticmethod
    def layer_modules(config, layer_idx: int) -> dict[str, nn.Module]:
        has_dwa = (layer_idx + 1) % config.denseformer_period == 0
        return {"dwa": DepthWeightedAverage(config, layer_idx) if has_dwa else None}

    @staticmethod
    def final_modules(config) -> dict[str, nn.Module]:
        return {}

    def read_attn(self, layer):
        return self, (self.hidden, None, None), ()

    def write_attn(self, layer, output: torch.Tensor) -> "DenseFormerState":
        return self._replace(hidden=self.hidden + output)

    def read_mlp(self, layer):
        return self, self.hidden, ()

    def write_mlp(self, layer, output: torch.Tensor):
        block_output = self.hidden + output  # B_i
        states = (*self.states, block_output)
        if layer.dwa is None:
            return DenseFormerState(block_output, states), ()
        hidden, weights = layer.dwa(states)
        return DenseFormerState(hidden, states), (weights,)

    def read_final(self, model):
        return self.hidden, ()


# ---------------------------------------------------------------------------------------------------------------
# MUDDFormer (Xiao et al., "MUDDFormer: Breaking Residual Bottlenecks in Transformers via Multiway Dynamic Dense
# Connections", ICML 2025)
# ---------------------------------------------------------------------------------------------------------------

MUDD_STREAMS = ("query", "key", "value", "residual")


class MultiwayDynamicDense(nn.Module):
    """MUDD connection after decoder layer `i` (paper Sec. 2.2-2.3, Eq. 4-6):

        A_i   = GELU(RMSNorm(X_i) W_1) W_2 + a_i              (per token: C x (i+2) weights; RMSNorm without scale)
        X_i^c = sum_{j=0}^{i+1} A_i[c, j] X_j                  c in (query, key, value, residual)

    `X_0` is the embedding, `X_j` the output of layer `j - 1` (its own residual adds included). The next layer
    reads `Norm(X^q)`, `Norm(X^k)`, `Norm(X^v)` as the inputs of its q, k and v projections and adds its attention
    output to `X^r`. After the last layer `C = 1`: one stream, the input of the final norm. Hidden width of the
    weight MLP `C (i+2)` (the reference code's default before its optional rounding to 64).

    Parameters (`layers.N.mudd.*`): `w1` `(C (i+2), hidden_size)` (normal, `initializer_range`), `w2`
    `(C (i+2), C (i+2))` (zero) and the static weights `static_weights` `(C, i+2)` (1 on the current layer's
    output, 0 elsewhere), so that at initialisation every stream is `X_{i+1}`: the residual model. Weights in fp32.
    """

    def __init__(self, config, layer_idx: int, last: bool):
        super().__init__()
        self.num_streams = 1 if last else len(MUDD_STREAMS)
        self.num_sources = layer_idx + 2
        self.eps = config.rms_norm_eps
        width = self.num_streams * self.num_sources
        self.w1 = nn.Parameter(torch.empty(width, config.hidden_size))
        self.w2 = nn.Parameter(torch.empty(width, width))
        self.static_weights = nn.Parameter(torch.empty(self.num_streams, self.num_sources))
        self.reset_parameters(config.initializer_range)

    def reset_parameters(self, std: float = 0.02) -> None:
        init.normal_(self.w1, mean=0.0, std=std)
        init.zeros_(self.w2)
        static = torch.zeros(self.num_streams, self.num_sources)
        static[:, -1] = 1.0
        init.copy_(self.static_weights, static)

    def forward(self, states: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """`states`: `X_0 .. X_{i+1}`, each `(batch, seq_len, hidden_size)`. Returns the `C` streams (their dtype)
        and the weights `A_i`, `(batch, seq_len, C, i+2)` in fp32."""
        normed = _rms_normed(states[-1], self.eps)  # (B, T, D)
        dynamic = F.gelu(normed @ self.w1.float().T) @ self.w2.float().T  # (B, T, C (i+2))
        weights = dynamic.unflatten(-1, (self.num_streams, self.num_sources)) + self.static_weights.float()
        values = torch.stack(states, dim=-2)  # (B, T, i+2, D)
        streams = (weights @ values.float()).to(values.dtype)  # (B, T, C, i+2) @ (B, T, i+2, D) -> (B, T, C, D)
        return streams.unbind(-2), weights


class MUDDState(NamedTuple):
    """MUDDFormer: the next layer reads four streams built by `MultiwayDynamicDense` from all layer outputs."""

    streams: tuple  # (X^q, X^k, X^v, X^r), each (B, T, D); one tensor after the last layer
    states: tuple  # X_0 (embedding) .. X_i: every layer output so far
    attn_sum: torch.Tensor | None  # X^r + attention output, the MLP's input and residual

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "MUDDState":
        return cls((embeddings,) * len(MUDD_STREAMS), (embeddings,), None)

    @staticmethod
    def layer_modules(config, layer_idx: int) -> dict[str, nn.Module]:
        return {"mudd": MultiwayDynamicDense(config, layer_idx, last=layer_idx == config.num_hidden_layers - 1)}

    @staticmethod
    def final_modules(config) -> dict[str, nn.Module]:
        return {}

    def read_attn(self, layer):
        query, key, value, _ = self.streams
        return self, (query, key, value), ()

    def write_attn(self, layer, output: torch.Tensor) -> "MUDDState":
        return self._replace(attn_sum=self.streams[3] + output)

    def read_mlp(self, layer):
        return self, self.attn_sum, ()

    def write_mlp(self, layer, output: torch.Tensor):
        states = (*self.states, self.attn_sum + output)
        streams, weights = layer.mudd(states)
        return MUDDState(streams, states, None), (weights,)

    def read_final(self, model):
        return self.streams[0], ()


# ---------------------------------------------------------------------------------------------------------------
# DeepCrossAttention (Heddes et al., "DeepCrossAttention: Supercharging Transformer Residual Connections", ICML 2025)
# ---------------------------------------------------------------------------------------------------------------


def _relu_trainable_at_zero(x: torch.Tensor) -> torch.Tensor:
    """`ReLU(x)`, with the subgradient 1 (not torch's 0) at `x = 0`. The forward is ReLU's; the derivative differs
    only on the kink. With torch's convention a zero-initialised `w` in `ReLU(w . k)` never receives a gradient, so
    DCA's input-dependent part would stay dead from its (residual-exact) initialisation on."""
    return torch.where(x >= 0, x, torch.zeros_like(x))


class GRNv3(nn.Module):
    """Generalised residual network v3 (DCA paper Sec. 3): input-dependent, dimension-wise weights over the stack
    `G = (y_0, .., y_t)` of the embedding and the previous layer outputs:

        a_{c,i} = b_{c,i} + ReLU(w_c . RMSNorm(y_i))     (b: per source and feature; w . RMSNorm(y_i): per source)
        x_c     = sum_i a_{c,i} * y_i                      (elementwise over the hidden axis)

    one output `c` per consumer: query, key and value inputs of a DCA layer (`C = 3`), or the final output (`C = 1`).
    RMSNorm without scale (folded into `w`). Parameters: `proj` `(C, hidden_size)` (the `w_c`, zero) and `bias`
    `(C, t+1, hidden_size)` (ones), so that at initialisation `x_c = sum_i y_i`: the residual stream. ReLU's
    derivative at 0 is taken as 1 so that the zero `w_c` can train (see `_relu_trainable_at_zero`).
    """

    def __init__(self, config, num_sources: int, num_outputs: int):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.proj = nn.Parameter(torch.zeros(num_outputs, config.hidden_size))
        self.bias = nn.Parameter(torch.ones(num_outputs, num_sources, config.hidden_size))

    def reset_parameters(self, std: float = 0.02) -> None:
        init.zeros_(self.proj)
        init.ones_(self.bias)

    def forward(self, sources: tuple[torch.Tensor, ...], keep_weights: bool = False):
        """`sources`: `y_0 .. y_t`, each `(batch, seq_len, hidden_size)`. Returns the `C` outputs (their dtype) and,
        with `keep_weights`, the weights `(batch, seq_len, C, t+1, hidden_size)` in fp32 (else `None`)."""
        values = torch.stack(sources, dim=-2).float()  # (B, T, n, D)
        normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)
        dynamic = _relu_trainable_at_zero(normed @ self.proj.float().T).transpose(-1, -2)  # (B, T, C, n)
        # sum_i (b_{c,i} + s_{c,i}) * y_i, without materialising the (B, T, C, n, D) weights
        outputs = torch.einsum("cnd,btnd->btcd", self.bias.float(), values) + dynamic @ values  # (B, T, C, D)
        weights = self.bias.float() + dynamic.unsqueeze(-1) if keep_weights else None
        return outputs.to(sources[0].dtype).unbind(-2), weights


class DCAState(NamedTuple):
    """DeepCrossAttention: each layer reads its q/k/v inputs through a `GRNv3` over the stack of the embedding and
    all previous layer outputs; the attention output is added to the query input (the layer's residual), the MLP
    reads that sum, and the layer's output `y = attention + MLP` joins the stack. A final GRN-v3 (`final_dca`)
    builds the input of the final norm."""

    sources: tuple  # y_0 (embedding), y_1 .. y_i (layer outputs: attention + MLP)
    query_input: torch.Tensor | None  # the current layer's query input (its residual)
    attn_output: torch.Tensor | None
    keep_weights: bool

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "DCAState":
        return cls((embeddings,), None, None, keep_weights)

    @staticmethod
    def layer_modules(config, layer_idx: int) -> dict[str, nn.Module]:
        return {"dca": GRNv3(config, num_sources=layer_idx + 1, num_outputs=3)}

    @staticmethod
    def final_modules(config) -> dict[str, nn.Module]:
        return {"final_dca": GRNv3(config, num_sources=config.num_hidden_layers + 1, num_outputs=1)}

    def read_attn(self, layer):
        (query, key, value), weights = layer.dca(self.sources, self.keep_weights)
        return self._replace(query_input=query), (query, key, value), () if weights is None else (weights,)

    def write_attn(self, layer, output: torch.Tensor) -> "DCAState":
        return self._replace(attn_output=output)

    def read_mlp(self, layer):
        return self, self.query_input + self.attn_output, ()

    def write_mlp(self, layer, output: torch.Tensor):
        return DCAState((*self.sources, self.attn_output + output), None, None, self.keep_weights), ()

    def read_final(self, model):
        (hidden,), weights = model.final_dca(self.sources, self.keep_weights)
        return hidden, () if weights is None else (weights,)


# ---------------------------------------------------------------------------------------------------------------
# mHC (Xie et al., DeepSeek-AI, "mHC: Manifold-Constrained Hyper-Connections", arXiv:2512.24880), on
# Hyper-Connections (Zhu et al., ICLR 2025)
# ---------------------------------------------------------------------------------------------------------------


def sinkhorn_knopp(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Doubly-stochastic projection of `exp(logits)` (mHC Eq. 8-9): alternately normalise rows and columns,
    `iterations` times, in fp32. `(..., n, n) -> (..., n, n)`; columns sum to 1 exactly, rows to 1 up to the
    Sinkhorn residual. Run in the log domain (the same iterates): `exp` of very negative logits would otherwise
    leave denormal floats that slow CPUs by orders of magnitude, and could underflow a row to zero."""
    log_matrix = logits.float()
    for _ in range(iterations):
        log_matrix = log_matrix - torch.logsumexp(log_matrix, dim=-1, keepdim=True)  # rows sum to 1
        log_matrix = log_matrix - torch.logsumexp(log_matrix, dim=-2, keepdim=True)  # columns sum to 1
    return log_matrix.exp()


MHC_PRE_INIT = 0.7
"""Initial read weight of sub-layer `l` on stream `l mod n` (the others share the rest): Hyper-Connections' one-hot
read, softened so that `sigmoid` can train it. The weights sum to 1, so with equal streams the sub-layer input is
exactly the residual stream."""
MHC_RES_INIT_LOGIT = -1.0
"""Initial off-diagonal logit of `H^res` (diagonal 0): diagonal-dominant, leaning towards Hyper-Connections'
`A_r = I`, but not close to it: a near-identity matrix is nearly decomposable, where Sinkhorn-Knopp converges slowly
(with -4 and perturbed logits, 20 iterations leave row sums off by up to 1e-2; with -1, by ~1e-6)."""
MHC_GATE_INIT = 0.01
"""Initial gating factors `alpha^pre`, `alpha^post`, `alpha^res` (mHC: small)."""


class ManifoldHyperConnection(nn.Module):
    """mHC around one sub-layer `F` (mHC Eq. 3 and 5-9). The stream `X` is `(n, hidden_size)` per token:

        x~     = RMSNorm(vec X)                                     (1 x nD; RMSNorm without scale)
        H~pre  = alpha_pre x~ phi_pre + b_pre       H_pre  = sigmoid(H~pre)            (1 x n)
        H~post = alpha_post x~ phi_post + b_post    H_post = 2 sigmoid(H~post)         (1 x n)
        H~res  = alpha_res mat(x~ phi_res) + b_res  H_res  = Sinkhorn-Knopp(H~res)     (n x n, doubly stochastic)
        X'     = H_res X + H_post^T F(H_pre X)

    Parameters (`layers.N.attn_mhc.*`, `layers.N.mlp_mhc.*`): `phi_pre`, `phi_post` `(nD, n)`, `phi_res`
    `(nD, n n)` (zero), `alpha_pre`, `alpha_post`, `alpha_res` (scalars, 0.01), `b_pre` (the softened one-hot read,
    `MHC_PRE_INIT`), `b_post` (0: `H_post = 1`), `b_res` (`(n, n)`, diagonal-dominant, `MHC_RES_INIT_LOGIT`).
    The streams start as `n` copies of the embedding (Hyper-Connections); since the rows of `H_res` and `H_pre`
    sum to 1 and `H_post = 1`, the streams stay equal to the residual stream at initialisation: the residual model
    exactly. The gates and the static logits are this library's choice (the paper gives no numbers we could check).
    Softmax-free: sigmoid, Sinkhorn and the mixes run in fp32.
    """

    def __init__(self, config, sublayer: int):
        super().__init__()
        n, width = config.mhc_num_streams, config.mhc_num_streams * config.hidden_size
        self.num_streams, self.sublayer = n, sublayer
        self.iterations = config.mhc_sinkhorn_iterations
        self.eps = config.rms_norm_eps
        self.phi_pre = nn.Parameter(torch.empty(width, n))
        self.phi_post = nn.Parameter(torch.empty(width, n))
        self.phi_res = nn.Parameter(torch.empty(width, n * n))
        self.alpha_pre = nn.Parameter(torch.empty(()))
        self.alpha_post = nn.Parameter(torch.empty(()))
        self.alpha_res = nn.Parameter(torch.empty(()))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        n = self.num_streams
        for phi in (self.phi_pre, self.phi_post, self.phi_res):
            init.zeros_(phi)
        for alpha in (self.alpha_pre, self.alpha_post, self.alpha_res):
            init.constant_(alpha, MHC_GATE_INIT)
        read = torch.full((n,), (1 - MHC_PRE_INIT) / (n - 1))
        read[self.sublayer % n] = MHC_PRE_INIT
        init.copy_(self.b_pre, torch.logit(read.double()).float())
        init.zeros_(self.b_post)
        init.copy_(self.b_res, MHC_RES_INIT_LOGIT * (1 - torch.eye(n)))

    def mappings(self, streams: torch.Tensor):
        """`streams` `(batch, seq_len, n, hidden_size)` -> `H_pre` `(B, T, n)`, `H_post` `(B, T, n)`, `H_res`
        `(B, T, n, n)`, all fp32."""
        n = self.num_streams
        flat = _rms_normed(streams.flatten(-2), self.eps)  # (B, T, nD)
        pre = self.alpha_pre.float() * (flat @ self.phi_pre.float()) + self.b_pre.float()
        post = self.alpha_post.float() * (flat @ self.phi_post.float()) + self.b_post.float()
        res = self.alpha_res.float() * (flat @ self.phi_res.float()).unflatten(-1, (n, n)) + self.b_res.float()
        return torch.sigmoid(pre), 2 * torch.sigmoid(post), sinkhorn_knopp(res, self.iterations)

    def read(self, streams: torch.Tensor):
        """The sub-layer input `H_pre X` `(B, T, D)` (streams' dtype) and the mappings."""
        h_pre, h_post, h_res = self.mappings(streams)
        layer_input = (h_pre.unsqueeze(-2) @ streams.float()).squeeze(-2).to(streams.dtype)
        return layer_input, h_post, h_res

    @staticmethod
    def write(streams: torch.Tensor, output: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
        """`X' = H_res X + H_post^T F(...)`: `(B, T, n, D)` in the streams' dtype."""
        mixed = h_res @ streams.float() + h_post.unsqueeze(-1) * output.float().unsqueeze(-2)
        return mixed.to(streams.dtype)


class MHCState(NamedTuple):
    """mHC: `n` parallel residual streams, one `ManifoldHyperConnection` per sub-layer; the final norm reads the
    mean of the streams (Hyper-Connections sum them; the mean differs only by the final RMSNorm's `eps` and keeps
    the initialisation exactly the residual model)."""

    streams: torch.Tensor  # (B, T, n, D)
    pending: tuple | None  # (H_post, H_res) of the sub-layer being computed

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False) -> "MHCState":
        streams = embeddings.unsqueeze(-2).expand(*embeddings.shape[:-1], config.mhc_num_streams, -1)
        return cls(streams, None)

    @staticmethod
    def layer_modules(config, layer_idx: int) -> dict[str, nn.Module]:
        return {"attn_mhc": ManifoldHyperConnection(config, 2 * layer_idx),
                "mlp_mhc": ManifoldHyperConnection(config, 2 * layer_idx + 1)}

    @staticmethod
    def final_modules(config) -> dict[str, nn.Module]:
        return {}

    def _read(self, connection):
        layer_input, h_post, h_res = connection.read(self.streams)
        return MHCState(self.streams, (h_post, h_res)), layer_input, (h_res,)

    def _write(self, output):
        return MHCState(ManifoldHyperConnection.write(self.streams, output, *self.pending), None)

    def read_attn(self, layer):
        state, layer_input, weights = self._read(layer.attn_mhc)
        return state, (layer_input, None, None), weights

    def write_attn(self, layer, output: torch.Tensor) -> "MHCState":
        return self._write(output)

    def read_mlp(self, layer):
        return self._read(layer.mlp_mhc)

    def write_mlp(self, layer, output: torch.Tensor):
        return self._write(output), ()

    def read_final(self, model):
        return self.streams.mean(-2), ()


DEPTH_MIXING = {
    "residual": ResidualState,
    "attnres": AttnResState,
    "denseformer": DenseFormerState,
    "muddformer": MUDDState,
    "dca": DCAState,
    "mhc": MHCState,
}
"""`depth_mixing` -> its state class (which also names the mixing modules it needs)."""

MIXING_MODULES = (AttnResRouter, DepthWeightedAverage, MultiwayDynamicDense, GRNv3, ManifoldHyperConnection)
"""Module classes that hold depth-mixing parameters; each has `reset_parameters()` (its residual-model init)."""

__all__ = ["DEPTH_MIXING", "MIXING_MODULES", "AttnResRMSNorm", "naive_attnres", "sinkhorn_knopp"]
