"""Check a conversion: the converted model must compute the source's logits and continue text the same way."""

import torch
from transformers import PreTrainedModel

PROBE_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the gallery he could see the "
    "fishing boats returning to the harbour, their lanterns swaying with the swell, and beyond them the dark line "
    "of the open sea. He trimmed the wick, polished the great lens until it shone, and wrote the weather in his "
    "logbook in a small, careful hand. Nobody in the village remembered a night when the light had failed."
)
"""Default probe: a short English paragraph written for this project."""


@torch.no_grad()
def verify_conversion(
    source: PreTrainedModel, converted: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int = 32,
    source_use_cache: bool = True,
) -> dict:
    """Compare `converted` with `source` on `input_ids` (shape `(1, seq_len)`); `source_use_cache=False` generates
    the source's continuation without a KV cache (the converted model's always uses one).

    Returns a dict with `max_abs_logit_delta` and `mean_abs_logit_delta` (over all positions and the vocabulary,
    in logit units, computed in fp32), `source_max_abs_logit` (their scale), `argmax_agreement` (fraction of
    positions whose top token agrees),
    `greedy_match` (whether `new_tokens` greedy tokens are identical), both continuations' token ids, and
    `num_probe_tokens`.
    """
    # each model's forward and generation together: a model offloaded to disk (`offloaded.offloaded`) reads its
    # files once into the page cache, not once per alternation
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    source_logits = source(input_ids).logits.float()
    source_tokens = source.generate(input_ids, use_cache=source_use_cache, **greedy)[0, input_ids.shape[1] :]
    converted_logits = converted(input_ids).logits.float()
    converted_tokens = converted.generate(input_ids, **greedy)[0, input_ids.shape[1] :]
    delta = (source_logits - converted_logits).abs()
    return {
        "num_probe_tokens": int(input_ids.shape[1]),
        "max_abs_logit_delta": delta.max().item(),
        "source_max_abs_logit": source_logits.abs().max().item(),
        "mean_abs_logit_delta": delta.mean().item(),
        "argmax_agreement": (source_logits.argmax(-1) == converted_logits.argmax(-1)).float().mean().item(),
        "greedy_new_tokens": new_tokens,
        "greedy_match": bool(torch.equal(source_tokens, converted_tokens)),
        "source_continuation_ids": source_tokens.tolist(),
        "converted_continuation_ids": converted_tokens.tolist(),
    }
