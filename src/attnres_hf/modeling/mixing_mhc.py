"""mHC: manifold-constrained hyper-connections (Xie et al., DeepSeek-AI, arXiv:2512.24880), on Hyper-Connections
(Zhu et al., ICLR 2025): `n` parallel residual streams mixed by doubly-stochastic matrices. Its depth state, module
and how its depth weights read.

Travels with checkpoints as remote code (a relative import of `depth_mixing.py`): imports only torch, transformers and
its sibling `mixing_base.py`.
"""

from typing import NamedTuple

import torch
from torch import nn

from transformers import initialization as init

from .mixing_base import DepthRead, DepthWrite, RoutingMap, rms_normed, sublayer_name


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
        flat = rms_normed(streams.flatten(-2), self.eps)  # (B, T, nD)
        pre = self.alpha_pre.float() * (flat @ self.phi_pre.float()) + self.b_pre.float()
        post = self.alpha_post.float() * (flat @ self.phi_post.float()) + self.b_post.float()
        res = self.alpha_res.float() * (flat @ self.phi_res.float()).unflatten(-1, (n, n)) + self.b_res.float()
        return torch.sigmoid(pre), 2 * torch.sigmoid(post), sinkhorn_knopp(res, self.iterations)

    def forward(self, streams: torch.Tensor):
        """The sub-layer input `H_pre X` `(B, T, D)` (streams' dtype) and the mappings `H_post`, `H_res`."""
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
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "MHCState":
        streams = embeddings.unsqueeze(-2).expand(*embeddings.shape[:-1], config.mhc_num_streams, -1)
        return cls(streams, None)

    def _read(self, connection) -> DepthRead:
        layer_input, h_post, h_res = connection(self.streams)
        return DepthRead(MHCState(self.streams, (h_post, h_res)), layer_input, None, (h_res,))

    def _write(self, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(MHCState(ManifoldHyperConnection.write(self.streams, output, *self.pending), None))

    def read_attn(self, mixing) -> DepthRead:
        return self._read(mixing.attn_mhc)

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return self._write(output)

    def read_mlp(self, mixing) -> DepthRead:
        return self._read(mixing.mlp_mhc)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        return self._write(output)

    def read_final(self, mixing) -> DepthRead:
        return DepthRead(self, self.streams.mean(-2))


class MHCLayerModules(NamedTuple):
    """The hyper-connections around decoder layer `i`'s attention (sub-layer `2 i`) and MLP (`2 i + 1`)."""

    attn_mhc: ManifoldHyperConnection
    mlp_mhc: ManifoldHyperConnection

    @classmethod
    def build(cls, config, layer_idx: int) -> "MHCLayerModules":
        return cls(ManifoldHyperConnection(config, 2 * layer_idx), ManifoldHyperConnection(config, 2 * layer_idx + 1))


def mhc_source_names(config) -> list[str]:
    """mHC mixes streams, not layer outputs: its common axis is the `n` streams."""
    return [f"stream {k}" for k in range(config.mhc_num_streams)]


def mhc_routing_maps(config) -> list[RoutingMap]:
    """One map per sub-layer: `H_res`, row `i` = how much of each stream `j` the new stream `i` keeps."""
    n = config.mhc_num_streams
    return [RoutingMap(f"model.layers.{s // 2}.{'attn' if s % 2 == 0 else 'mlp'}_mhc",
                       [f"L{sublayer_name(s).replace('.', ' ')} s{i}" for i in range(n)], list(range(n)))
            for s in range(config.num_sublayers)]
