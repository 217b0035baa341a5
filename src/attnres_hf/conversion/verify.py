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
    # each model's forward and generation together (a model offloaded to disk reads its files once into the page
    # cache, not once per alternation; `verify_offloaded_conversion` runs it in fewer forwards)
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    source_logits = source(input_ids).logits.float()
    source_tokens = source.generate(input_ids, use_cache=source_use_cache, **greedy)[0, input_ids.shape[1] :]
    converted_logits = converted(input_ids).logits.float()
    converted_tokens = converted.generate(input_ids, **greedy)[0, input_ids.shape[1] :]
    return _compared(source_logits, converted_logits, source_tokens.tolist(), converted_tokens.tolist(), new_tokens)


def _compared(source_logits: torch.Tensor, converted_logits: torch.Tensor, source_tokens: list[int],
              converted_tokens: list[int], new_tokens: int) -> dict:
    """The report fields of `verify_conversion` from both models' probe logits (fp32) and continuations."""
    delta = (source_logits - converted_logits).abs()
    return {
        "num_probe_tokens": int(source_logits.shape[1]),
        "max_abs_logit_delta": delta.max().item(),
        "source_max_abs_logit": source_logits.abs().max().item(),
        "mean_abs_logit_delta": delta.mean().item(),
        "argmax_agreement": (source_logits.argmax(-1) == converted_logits.argmax(-1)).float().mean().item(),
        "greedy_new_tokens": new_tokens,
        "greedy_match": source_tokens == converted_tokens,
        "source_continuation_ids": source_tokens,
        "converted_continuation_ids": converted_tokens,
    }


@torch.no_grad()
def verify_offloaded_conversion(source: PreTrainedModel, converted: PreTrainedModel, input_ids: torch.Tensor,
                                new_tokens: int = 4, source_use_cache: bool = True) -> dict:
    """`verify_conversion`'s check for models whose every forward reads all their weights from disk
    (`offloaded.offloaded`), in `new_tokens + 1` forwards instead of `2 * new_tokens + 2`: the same report fields.

    - The source: one forward over `input_ids` gives the probe's logits and the first greedy token; `new_tokens - 1`
      one-token steps on its KV cache (`source_use_cache=False`: forwards over the whole sequence) give the rest.
    - The converted model: one forward over the probe followed by the source's first `new_tokens - 1` greedy tokens
      (teacher-forced). Its first `seq_len` positions' logits are its probe logits (a causal model's logits at a
      position do not depend on later tokens); the argmax at the last `new_tokens` positions is what its greedy
      generation would pick after the source's tokens so far. The two greedy generations are identical if and only
      if every one of these argmaxes is the source's token there: `greedy_match`.
    - Greedy, for both models: the argmax of each step's logits with the end-of-sequence ids of the model's
      generation config excluded (as `generate(min_new_tokens=new_tokens)` excludes them); no other logits
      processor (a generation config's repetition penalty, say) applies.
    - `converted_continuation_ids`: the converted model's own greedy tokens up to and including its first
      disagreement with the source's (all `new_tokens` of them when `greedy_match`): after a disagreement, the
      teacher-forced argmax follows the source's token, not the converted model's, so it is not reported.
      `greedy_check` says this in the report.
    """
    seq_len = input_ids.shape[1]
    banned = _eos_ids(source)
    output = source(input_ids, use_cache=source_use_cache)
    source_logits = output.logits.float()
    tokens = [_greedy(source_logits[0, -1], banned)]
    for _ in range(new_tokens - 1):
        if source_use_cache:
            output = source(torch.tensor([[tokens[-1]]]), past_key_values=output.past_key_values, use_cache=True)
        else:
            output = source(torch.cat([input_ids, torch.tensor([tokens])], dim=1), use_cache=False)
        tokens.append(_greedy(output.logits[0, -1].float(), banned))
    forced = torch.cat([input_ids, torch.tensor([tokens[:-1]], dtype=input_ids.dtype)], dim=1)
    logits = converted(forced, use_cache=False).logits.float()
    banned = _eos_ids(converted)
    converted_tokens = []
    for position, token in zip(range(seq_len - 1, seq_len - 1 + new_tokens), tokens):
        converted_tokens.append(_greedy(logits[0, position], banned))
        if converted_tokens[-1] != token:
            break
    return _compared(source_logits, logits[:, :seq_len], tokens, converted_tokens, new_tokens) | {
        "greedy_check": "the source generated its tokens; the converted model's were checked teacher-forced in one "
                        "forward (its argmax at each continuation position after the source's tokens so far); "
                        "its continuation is reported up to its first disagreement"}


def _eos_ids(model) -> set[int]:
    """The end-of-sequence ids of `model`'s generation config (none: an empty set)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _greedy(logits: torch.Tensor, banned: set[int]) -> int:
    """The argmax of one position's `logits` (vocabulary,) with the ids `banned` excluded."""
    if banned:
        logits = logits.clone()
        logits[[i for i in banned if 0 <= i < logits.shape[-1]]] = -float("inf")
    return int(logits.argmax())
