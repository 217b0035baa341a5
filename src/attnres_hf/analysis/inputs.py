"""Text into the token ids the routing tools read: the tokenizer's special tokens once, or the model's chat template."""

import torch


def encode_text(tokenizer, text: str, chat: bool = False, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of `text`, `(seq_len,)` int64, as the model sees it in use.

    - `chat=False`: the tokenizer's own special tokens are added (a BOS where the tokenizer adds one), and never
      twice: a text that already starts with the BOS token (e.g. a prompt rendered with the chat template) keeps
      its own and gets no second.
    - `chat=True`: `text` is the user turn of a conversation, rendered with the tokenizer's chat template with the
      assistant's generation prompt (as `generate` would be fed; one BOS, whatever the template writes).

    `max_tokens` keeps the first `max_tokens` ids.

    Raises:
        TypeError: `text` is not a string. ValueError: an empty text, `max_tokens < 1`, or `chat=True` with a
            tokenizer that has no chat template.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError("the input is empty: give a non-empty text")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; drop --chat (chat=False) to read the text as is")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:  # the text brought its own BOS
        ids = ids[1:]
    return torch.tensor(ids[:max_tokens], dtype=torch.long)
