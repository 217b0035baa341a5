"""Delta Attention Residuals (Luo, Cai and Hu, "Delta Attention Residuals", arXiv:2605.18855): additive routing.

AttnRes *replaces* the residual stream by a softmax over depth. Delta AttnRes keeps the stream and *adds* a learned
depth read to each sub-layer's input, scaled by a gate that starts at zero:

    x_{l+1} = x_l + f_l(Norm(h_l)),      h_l = x_l + g_l * sum_i alpha_{i->l} v_i,
    alpha_{i->l} = softmax_i(w_l . RMSNorm(v_i))                           (AttnRes's router, Eq. 2-3)

with `x_0` the embedding, `g_l` a learned scalar per sub-layer (zero-initialised: `h_l = x_l`, the residual model,
exactly, whatever the pseudo-query) and `v_i` the sources of AttnRes's router before sub-layer `l` (Eq. 6): the
embedding and every sub-layer output (Full, `attnres_block_size=1`), or the embedding, the completed blocks' sums
and the current block's partial sum (Block). The final norm reads the stream `x_{2L}`: no final depth read.

Reading the authors' released code (to learn it, not copied): its Full variant reads the embedding and the sub-layer
outputs, as here; its gate is the `learnable_alpha` option (`(1 - a) x + a (x + read)`, which is `x + a read`); its
Block variant reads the completed blocks without the current block's partial sum. Here Block Delta reads Block
AttnRes's sources, partial sum included, so that the depth weights, routing maps and two-phase inference are Block
AttnRes's own (`AttnResState`); the partial sum is also in the stream, so the read can only reweigh it.

Travels with checkpoints as remote code (a relative import of `depth_mixing.py`): imports only torch, transformers
and its siblings.
"""

from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init

from .attnres_buffer import _as
from .attnres_reference import attnres_routing_maps, attnres_source_norms
from .mixing_attnres import PLAIN_ROUTERS, AttnResRouter, AttnResState
from .mixing_base import DepthRead, DepthWrite, autocast_off, routed_sublayers


@routed_sublayers
class DeltaAttnResState(NamedTuple):
    """Depth state of Delta AttnRes: the residual stream `x_l` and AttnRes's sources (`AttnResState`, whose source
    buffer, two-phase block inference and gradient paths serve the reads unchanged)."""

    hidden: torch.Tensor  # (B, T, D): the residual stream x_l
    depth: AttnResState  # the sources of AttnRes's router before the next sub-layer

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "DeltaAttnResState":
        return cls(embeddings, AttnResState.start(embeddings, config, keep_weights, model))

    def _route(self, router) -> DepthRead:
        state = self._replace(depth=self.depth.begin_sublayer())
        hidden, weights = router(state)
        return DepthRead(state, hidden, None, () if weights is None else (weights,))

    def _add(self, output: torch.Tensor) -> DepthWrite:
        depth = self.depth._add(output).state  # (casts an autocast output to the stream's dtype)
        return DepthWrite(DeltaAttnResState(self.hidden + _as(output, self.hidden.dtype), depth))

    def read_final(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)


class DeltaAttnResRouter(AttnResRouter):
    """AttnRes's router (`AttnResRouter`: pseudo-query `query`, key norm `key_norm`) plus the gate `gate`, a learned
    scalar (shape `()`, zero-initialised), whose read is added to the residual stream: `h = x + gate * sum_i alpha_i
    v_i`. The gate makes the retrofit exact (`h = x` at zero, bit for bit); the pseudo-query gets its first gradient
    once the gate has moved.

    The pseudo-query starts random, `N(0, initializer_range^2)` (AttnRes's starts at zero), as in the authors'
    released code: the sources sum to the stream, so a uniform read is `x / n` and `h = (1 + gate / n) x`, a change
    of scale the sub-layer's pre-norm cancels: the gate's gradient would be only the norm's `eps` effect (1e-5 to 1e-7
    of a weight's on a tiny model), and the routing could not start learning."""

    def __init__(self, config, sublayer: int):
        super().__init__(config, sublayer)
        self.gate = nn.Parameter(torch.zeros(()))

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        init.normal_(self.query, mean=0.0, std=std)
        init.zeros_(self.gate)

    @autocast_off(lambda self, state: state.hidden.device.type)
    def forward(self, state: DeltaAttnResState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sub-layer input `h = x + gate * read`, `(batch, seq_len, hidden_size)` in the stream's dtype, and the
        read's depth weights `(batch, seq_len, n_sources)` fp32 (AttnRes's, `AttnResRouter.forward`; `None` where
        the two-phase path computes none)."""
        read, weights = super().forward(state.depth)
        hidden = state.hidden
        return hidden + _as(self.gate, hidden.dtype) * _as(read, hidden.dtype), weights


PLAIN_ROUTERS.add(DeltaAttnResRouter)  # its queries read ahead of time by phase 1 like AttnRes's


class DeltaAttnResLayerModules(NamedTuple):
    """The routers of decoder layer `i` (AttnRes's attribute names): before its attention and before its MLP."""

    attn_res: DeltaAttnResRouter
    mlp_res: DeltaAttnResRouter

    @classmethod
    def build(cls, config, layer_idx: int) -> "DeltaAttnResLayerModules":
        return cls(DeltaAttnResRouter(config, 2 * layer_idx), DeltaAttnResRouter(config, 2 * layer_idx + 1))


def delta_attnres_routing_maps(config) -> list:
    """AttnRes's routing maps without the final router's (`attnres_routing_maps`): one per sub-layer."""
    return attnres_routing_maps(config)[:-1]


def delta_attnres_source_norms(state: DeltaAttnResState) -> torch.Tensor:
    """`||v_i||` of the sources a router's input state holds, `(batch, seq_len, n)` (`attnres_source_norms`)."""
    return attnres_source_norms(state.depth)
