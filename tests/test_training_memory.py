"""Training memory of Block AttnRes against Llama's, counted deterministically: the bytes a training step keeps for
backward (distinct storages that autograd's saved-tensor hooks see, parameters excluded, plus the source buffer, which
the buffer's readers keep on their contexts instead). Kimi K3's recipe (the block representations built once and
shared, the reads recomputed in backward: `DepthRead.normed`, `_PartialMerge.rebuild`, `_BlockRead`) keeps the depth
mixing at a residual's memory: each sub-layer keeps its block's partial sum where Llama keeps its residual stream, and
the first read of each block, rebuilt from the buffer, keeps nothing where Llama keeps the stream, which pays for the
buffer's slots. The peak at the SmolLM2-135M shape is `benchmarks/overhead.py`'s `memory` column."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf import AttnResConfig, AttnResForCausalLM

from utils import FOUR_BIT_SHAPE, TINY

SHAPE = dict(TINY, **FOUR_BIT_SHAPE, num_hidden_layers=4)
BATCH, SEQ = 2, 16


def kept_bytes(model, input_ids: torch.Tensor) -> int:
    """Bytes a training step's forward leaves allocated for its backward: the allocator's live bytes when the forward
    returns the loss (`torch.profiler` memory events, as `benchmarks/overhead.py` counts its CPU peak), which are
    what autograd saved, the source buffer, the logits and the loss. (Saved-tensor hooks would not see past the
    reads' own, `DepthRead.normed`.)"""
    from torch.profiler import ProfilerActivity, profile

    model.train()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
    live = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    loss.backward()
    return live


STREAMS_OVER_LLAMA = 4
"""The most bytes Block AttnRes's forward may keep for backward beyond Llama's, in `(B, T, D)` fp32 activations, at
`SHAPE` (hidden 64, 4 layers, 8 sub-layers): the final read is a direct one, not rebuilt, so it keeps the last partial
sum and the final norm keeps its input (2); the rest are the reads' per-token statistics, `(B, T, 1)` columns and
`(B, T, S, n)` phase-1 weights, each a 64th of a stream or a few at this width (measured: +3.47 streams with blocks
of 2, +3.02 with blocks of 4; +11.47 and +11.02 before the reads were rebuilt in backward, when every read after the
first of its block kept its partial sum besides the norm's copy of its output)."""


@pytest.mark.parametrize("block_size", [2, 4])
def test_block_attnres_keeps_a_residuals_memory_for_backward(block_size):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model = AttnResForCausalLM(AttnResConfig(**SHAPE, attnres_block_size=block_size))
    model.load_state_dict(llama.state_dict(), strict=False)
    input_ids = torch.randint(3, SHAPE["vocab_size"], (BATCH, SEQ))
    llama_bytes, attnres_bytes = kept_bytes(llama, input_ids), kept_bytes(model, input_ids)
    stream = BATCH * SEQ * SHAPE["hidden_size"] * 4  # one (B, T, D) fp32 activation
    assert attnres_bytes - llama_bytes <= STREAMS_OVER_LLAMA * stream, (
        f"Block AttnRes (blocks of {block_size}) keeps {attnres_bytes} bytes for backward, Llama {llama_bytes}: "
        f"{(attnres_bytes - llama_bytes) / stream:.2f} (B, T, D) activations more (at most {STREAMS_OVER_LLAMA})")


def test_without_the_hooks_query_the_reads_are_kept_with_the_same_gradients(monkeypatch):
    """Where torch does not say whether saved-tensor hooks are active (`torch_internals.top_saved_tensors_hooks`
    missing), the reads' outputs are kept for backward instead of rebuilt: more memory, the same gradients (up to
    the rounding of the rebuilt `mixed`, a product of one router instead of the block's)."""
    from attnres_hf.modeling import torch_internals

    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(**SHAPE, attnres_block_size=4))
    for name, parameter in model.named_parameters():  # routed: non-uniform depth weights
        if name.endswith("res.query"):
            parameter.data.normal_()
    input_ids = torch.randint(3, SHAPE["vocab_size"], (BATCH, SEQ))

    def step():
        model.zero_grad()
        kept = kept_bytes(model, input_ids)
        return kept, {name: p.grad.clone() for name, p in model.named_parameters()}

    rebuilt_bytes, rebuilt_grads = step()
    monkeypatch.setattr(torch_internals, "top_saved_tensors_hooks", None)
    kept, grads = step()
    stream = BATCH * SEQ * SHAPE["hidden_size"] * 4
    assert kept - rebuilt_bytes >= 8 * stream  # every sub-layer's read: 8 in 4 layers
    for name, grad in grads.items():
        torch.testing.assert_close(rebuilt_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
