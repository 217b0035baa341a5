"""The outputs of the AttnRes models: the backbone family's own output class (dense: `BaseModelOutputWithPast`,
`CausalLMOutputWithPast`; mixture-of-experts: `MoeModelOutputWithPast`, `MoeCausalLMOutputWithPast`, as the
family's adapter names them) plus `depth_weights`, whose tuple form is the family's, position by position, then
`depth_weights`.

Travels with checkpoints as remote code (a relative import of `modeling_attnres.py`): imports only torch and
transformers.
"""

from dataclasses import dataclass

import torch

from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast, MoeCausalLMOutputWithPast,
                                           MoeModelOutputWithPast)


class _DepthWeightsLast:
    """`depth_weights`, fp32 tensors in depth order when `output_depth_weights=True`, as the method's record says
    (`DEPTH_MIXING[name].depth_weights`): AttnRes: one `(batch, seq_len, n_sources)` per router (`layers.0.attn_res`,
    `layers.0.mlp_res`, ..., `final_res`; `(batch, seq_len, heads, n_sources)` with `attnres_num_heads > 1`);
    DenseFormer: one `(batch, seq_len, n)` per DWA; MUDDFormer: one `(batch, seq_len, C, n)` per layer; DCA: one
    `(batch, seq_len, C, n, hidden_size)` per GRN; mHC: `H_res`, `(batch, seq_len, n_streams, n_streams)`, per
    sub-layer. `None` for the residual baseline.

    The tuple form (`return_dict=False`, `output[i]`) is the family's tuple, position by position, then
    `depth_weights`. A model output's tuple lists its non-`None` entries in the order they were set: `forward` sets
    some fields, then transformers' `capture_outputs` appends what it records (attentions, router logits, a family's
    hidden states) in `_can_record_outputs` order, after `depth_weights`. `_tuple_order` is the order the family's
    own model ends up with; an entry it does not list (router logits asked of a dense model) goes before
    `depth_weights`."""

    _tuple_order: tuple[str, ...] = ()

    def to_tuple(self) -> tuple:
        rank = {name: i for i, name in enumerate(self._tuple_order)}
        unlisted = len(self._tuple_order) - 1.5  # between the last listed entry and `depth_weights`
        return tuple(self[k] for k in sorted(self.keys(), key=lambda k: rank.get(k, unlisted)))


@dataclass
class AttnResModelOutputWithPast(_DepthWeightsLast, BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` (a dense family's) plus `depth_weights` (see `_DepthWeightsLast`)."""

    depth_weights: tuple[torch.Tensor, ...] | None = None

    _tuple_order = ("last_hidden_state", "cache", "hidden_states", "attentions", "depth_weights")


@dataclass
class AttnResMoeModelOutputWithPast(_DepthWeightsLast, MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` (a mixture-of-experts family's: `router_logits` per MoE layer with
    `output_router_logits=True`) plus `depth_weights`."""

    depth_weights: tuple[torch.Tensor, ...] | None = None

    # transformers' MoE models record `router_logits` first (their `_can_record_outputs` order)
    _tuple_order = ("last_hidden_state", "cache", "router_logits", "hidden_states", "attentions", "depth_weights")


@dataclass
class AttnResCausalLMOutputWithPast(_DepthWeightsLast, CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` (a dense family's) plus `depth_weights`."""

    depth_weights: tuple[torch.Tensor, ...] | None = None

    _tuple_order = ("loss", "logits", "cache", "hidden_states", "attentions", "depth_weights")


@dataclass
class AttnResMoeCausalLMOutputWithPast(_DepthWeightsLast, MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (a mixture-of-experts family's: `router_logits`, and the load-balancing
    `aux_loss`, a scalar already in `loss` times `router_aux_loss_coef` when `labels` are given; none for Kimi
    Linear) plus `depth_weights`."""

    depth_weights: tuple[torch.Tensor, ...] | None = None

    _tuple_order = ("loss", "aux_loss", "logits", "cache", "hidden_states", "attentions", "router_logits",
                    "depth_weights")


DEPTH_WEIGHTS_OUTPUTS = {output.__bases__[1]: output for output in (
    AttnResModelOutputWithPast, AttnResMoeModelOutputWithPast, AttnResCausalLMOutputWithPast,
    AttnResMoeCausalLMOutputWithPast)}
"""A family's output class (its adapter's `model_output` / `causal_lm_output`) -> the AttnRes one."""


__all__ = ["AttnResCausalLMOutputWithPast", "AttnResModelOutputWithPast", "AttnResMoeCausalLMOutputWithPast",
           "AttnResMoeModelOutputWithPast", "DEPTH_WEIGHTS_OUTPUTS"]
