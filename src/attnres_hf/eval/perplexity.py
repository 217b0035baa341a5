"""Token-level perplexity of a causal LM over a long text, with a sliding window."""

import math

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`(begin, first_scored, end)` per window: the model reads tokens `[begin, end)` and is scored on positions
    `[first_scored, end)`, each predicted from the tokens before it in the window. Every position from 1 to
    `num_tokens - 1` is scored exactly once; the first window scores `window - 1` tokens, later ones `stride`."""
    windows, scored_until = [], 1
    while scored_until < num_tokens:
        end = min(window if scored_until == 1 else scored_until + stride, num_tokens)
        windows.append((max(0, end - window), scored_until, end))
        scored_until = end
    return windows


@torch.no_grad()
def perplexity(
    model: PreTrainedModel, input_ids: torch.Tensor, window: int = 512, stride: int | None = None, progress: bool = True
) -> dict:
    """Perplexity of `model` on one token sequence, scored with a sliding window (see `sliding_windows`).

    Args:
        input_ids: `(seq_len,)` or `(1, seq_len)` token ids.
        window: tokens per forward pass (at most the model's context).
        stride: new tokens scored per window after the first, `1 <= stride <= window - 1`; each keeps
            `window - stride` tokens of context. Default `window - 1`: windows overlap by the one token that
            predicts the next.

    Returns:
        `{"perplexity": exp(mean NLL), "nll": mean negative log-likelihood in nats per token, "tokens": count}`;
        cross-entropy summed in fp32.

    Raises:
        TypeError: `model` is not a torch module, `input_ids` not an integer tensor, `window`/`stride` not integers.
        ValueError: fewer than 2 tokens, `input_ids` with more than one sequence, ids outside the model's
            vocabulary, `window` below 2, or `stride` out of range (0 included).
    """
    from .checks import check_type

    check_type("model", model, torch.nn.Module)
    check_type("input_ids", input_ids, torch.Tensor)
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    check_type("window", window, int)
    check_type("stride", stride, int, optional=True)
    if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError(f"input_ids must be one sequence, (seq_len,) or (1, seq_len), got shape {tuple(input_ids.shape)}")
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    input_ids = input_ids.reshape(-1)
    stride = window - 1 if stride is None else stride
    if input_ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be between 1 and window - 1 ({window - 1}), got {stride}")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is not None and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(
            f"input_ids must be token ids in [0, {vocab - 1}] (the model's vocabulary), got ids from "
            f"{int(input_ids.min())} to {int(input_ids.max())}: was the text encoded with another tokenizer?"
        )
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for begin, first, end in tqdm(sliding_windows(input_ids.numel(), window, stride), desc="Perplexity",
                                  unit="window", disable=not progress):
        chunk = input_ids[begin:end].to(device)[None]
        logits = model(chunk, use_cache=False).logits[0].float()  # logits[j] predicts position begin + j + 1
        scored = logits[first - begin - 1 : end - begin - 1]
        total_nll += torch.nn.functional.cross_entropy(scored, chunk[0, first - begin :], reduction="sum").item()
        total_tokens += end - first
    mean = total_nll / total_tokens
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": total_tokens}
