"""The dense-connection members of the depth-mixing family, each over the embedding and every earlier layer output:
DenseFormer (depth-weighted averages), MUDDFormer (multiway dynamic dense connections) and DeepCrossAttention
(GRN-v3 on the q/k/v inputs). Their depth states, modules and how their depth weights read.

Travels with checkpoints as remote code (a relative import of `depth_mixing.py`): imports only torch, transformers and
its sibling `mixing_base.py`.
"""

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from transformers import initialization as init

from .mixing_base import DepthRead, DepthWrite, RoutingMap, rms_normed


def layer_source_names(config) -> list[str]:
    """The common source axis of the dense methods: `embedding`, then the output of each decoder layer."""
    return ["embedding"] + [f"layer {i}" for i in range(config.num_hidden_layers)]


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
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "DenseFormerState":
        return cls(embeddings, (embeddings,))

    def read_attn(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(self._replace(hidden=self.hidden + output))

    def read_mlp(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        block_output = self.hidden + output  # B_i
        states = (*self.states, block_output)
        if mixing.dwa is None:
            return DepthWrite(DenseFormerState(block_output, states))
        hidden, weights = mixing.dwa(states)
        return DepthWrite(DenseFormerState(hidden, states), (weights,))

    def read_final(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)


class DenseFormerLayerModules(NamedTuple):
    """The DWA after decoder layer `i`; `None` when the period `p` skips it."""

    dwa: DepthWeightedAverage | None

    @classmethod
    def build(cls, config, layer_idx: int) -> "DenseFormerLayerModules":
        has_dwa = (layer_idx + 1) % config.denseformer_period == 0
        return cls(DepthWeightedAverage(config, layer_idx) if has_dwa else None)


def denseformer_routing_maps(config) -> list[RoutingMap]:
    """One map per DWA (after layer `i`, over the states `B_j`, `j in S_i`)."""
    return [RoutingMap(f"model.layers.{i}.dwa", [f"L{i} dwa"], denseformer_sources(config, i))
            for i in range(config.num_hidden_layers) if (i + 1) % config.denseformer_period == 0]


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
        normed = rms_normed(states[-1], self.eps)  # (B, T, D)
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
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "MUDDState":
        return cls((embeddings,) * len(MUDD_STREAMS), (embeddings,), None)

    def read_attn(self, mixing) -> DepthRead:
        query, key, value, _ = self.streams
        return DepthRead(self, query, (key, value))

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(self._replace(attn_sum=self.streams[3] + output))

    def read_mlp(self, mixing) -> DepthRead:
        return DepthRead(self, self.attn_sum)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        states = (*self.states, self.attn_sum + output)
        streams, weights = mixing.mudd(states)
        return DepthWrite(MUDDState(streams, states, None), (weights,))

    def read_final(self, mixing) -> DepthRead:
        return DepthRead(self, self.streams[0])


class MUDDLayerModules(NamedTuple):
    """The MUDD connection after decoder layer `i` (one stream after the last layer)."""

    mudd: MultiwayDynamicDense

    @classmethod
    def build(cls, config, layer_idx: int) -> "MUDDLayerModules":
        return cls(MultiwayDynamicDense(config, layer_idx, last=layer_idx == config.num_hidden_layers - 1))


def muddformer_routing_maps(config) -> list[RoutingMap]:
    """One map per MUDD connection, one row per stream (`q`, `k`, `v`, `r`; the last layer's: `out`)."""
    last = config.num_hidden_layers - 1
    return [RoutingMap(f"model.layers.{i}.mudd",
                       [f"L{i} mudd out"] if i == last else [f"L{i} mudd {c[0]}" for c in MUDD_STREAMS],
                       list(range(i + 2))) for i in range(config.num_hidden_layers)]


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
        # each output row-major (`DepthRead`): einsum may return the hidden axis strided, which bitsandbytes' AVX-512
        # BF16 4-bit CPU kernel misreads as row-major (relative logit error ~1 on a 4-bit DCA model)
        return outputs.to(sources[0].dtype).movedim(-2, 0).contiguous().unbind(0), weights


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
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "DCAState":
        return cls((embeddings,), None, None, keep_weights)

    def read_attn(self, mixing) -> DepthRead:
        (query, key, value), weights = mixing.dca(self.sources, self.keep_weights)
        return DepthRead(self._replace(query_input=query), query, (key, value), () if weights is None else (weights,))

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(self._replace(attn_output=output))

    def read_mlp(self, mixing) -> DepthRead:
        return DepthRead(self, self.query_input + self.attn_output)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(DCAState((*self.sources, self.attn_output + output), None, None, self.keep_weights))

    def read_final(self, mixing) -> DepthRead:
        (hidden,), weights = mixing.final_dca(self.sources, self.keep_weights)
        return DepthRead(self, hidden, None, () if weights is None else (weights,))


class DCALayerModules(NamedTuple):
    """The GRN-v3 that builds decoder layer `i`'s query, key and value inputs."""

    dca: GRNv3

    @classmethod
    def build(cls, config, layer_idx: int) -> "DCALayerModules":
        return cls(GRNv3(config, num_sources=layer_idx + 1, num_outputs=3))


class DCAFinalModules(NamedTuple):
    """The GRN-v3 that builds the input of the final norm."""

    final_dca: GRNv3

    @classmethod
    def build(cls, config) -> "DCAFinalModules":
        return cls(GRNv3(config, num_sources=config.num_hidden_layers + 1, num_outputs=1))


def dca_routing_maps(config) -> list[RoutingMap]:
    """One map per GRN-v3, one row per output (`q`, `k`, `v`; `final_dca`: `out`)."""
    maps = [RoutingMap(f"model.layers.{i}.dca", [f"L{i} dca {c}" for c in "qkv"], list(range(i + 1)))
            for i in range(config.num_hidden_layers)]
    return maps + [RoutingMap("model.final_dca", ["final dca"], list(range(config.num_hidden_layers + 1)))]


def dca_to_rows(weights: torch.Tensor) -> torch.Tensor:
    """`(batch, seq_len, C, n, hidden_size)` -> `(batch, seq_len, C, n)`: the mean weight over features (GRN-v3
    weights are per feature; a map per feature would have `hidden_size` rows per output)."""
    return weights.mean(-1)
