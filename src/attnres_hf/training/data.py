"""Training text: local `.txt` / `.jsonl` files or `datasets` folders, tokenised and packed into fixed-length blocks."""

import os
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk

from .._checks import check_fraction, check_int, check_paths


def _load_raw(path: Path, text_field: str) -> Dataset:
    if path.is_dir():
        loaded = load_from_disk(str(path))
        if isinstance(loaded, DatasetDict):
            loaded = concatenate_datasets(list(loaded.values()))
    elif path.suffix in (".txt", ".text", ".md"):
        # one example per file: packing joins everything anyway, and line breaks stay part of the text
        loaded = Dataset.from_dict({text_field: [path.read_text(encoding="utf-8", errors="replace")]})
    elif path.suffix in (".jsonl", ".json"):
        if not path.read_text(encoding="utf-8", errors="replace").strip():
            raise ValueError(f"{path} is empty")
        try:
            loaded = load_dataset("json", data_files=str(path), split="train")
        except Exception as error:  # datasets wraps JSON errors in its own generation error
            cause = error.__cause__ or error
            raise ValueError(f"{path} is not valid JSON lines ({type(cause).__name__}: {cause})") from None
    else:
        raise ValueError(f"{path}: unsupported data file (use .txt, .jsonl or a datasets folder from save_to_disk)")
    if text_field not in loaded.column_names:
        raise ValueError(f"{path} has no {text_field!r} column (columns: {', '.join(loaded.column_names)})")
    loaded = loaded.select_columns([text_field])
    bad = next((i for i, text in enumerate(loaded[text_field]) if not isinstance(text, str)), None)
    if bad is not None:
        raise ValueError(f"{path}: row {bad} has a {text_field!r} that is not a string ({loaded[bad][text_field]!r})")
    return loaded


def read_texts(files: list[str | os.PathLike], text_field: str = "text") -> list[str]:
    """The texts of `.txt` files (one text per file), `.jsonl` files and `datasets` folders (`text_field` of each row).

    Raises:
        FileNotFoundError: a path does not exist. ValueError: unsupported, empty or malformed file, missing column.
    """
    files = check_paths("files", files)
    if not isinstance(text_field, str):
        raise TypeError(f"text_field must be a column name (str), got {text_field!r}")
    texts = []
    for file in files:
        path = Path(file)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        texts.extend(_load_raw(path, text_field)[text_field])
    return texts


def packed_lm_dataset(
    files: list[str | os.PathLike],
    tokenizer,
    seq_len: int = 512,
    eval_fraction: float = 0.05,
    text_field: str = "text",
    num_proc: int | None = None,
) -> DatasetDict:
    """Tokenise `files` and pack them into `seq_len`-token blocks, split into `train` and a held-out `eval` tail.

    Documents are joined with the tokenizer's EOS token (when it has one) and cut into consecutive, non-overlapping
    blocks; the last incomplete block is dropped. `eval` is the last `eval_fraction` of the blocks (at least one), so
    train and eval never share text. Each example has `input_ids` and `labels` (equal; the model shifts them).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: an unsupported file type, an empty or malformed `.jsonl`, a missing or non-string text column,
            `seq_len < 2`, or too little text for two blocks.
        TypeError: a setting of the wrong type (`files` takes a path or a list of paths).
    """
    check_int("seq_len", seq_len, 2, "tokens")
    check_fraction("eval_fraction", eval_fraction)
    if not isinstance(text_field, str):
        raise TypeError(f"text_field must be a column name (str), got {text_field!r}")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    paths = [Path(f) for f in check_paths("files", files)]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
    raw = concatenate_datasets([_load_raw(path, text_field) for path in paths])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        return {"input_ids": [tokenizer(text, add_special_tokens=False)["input_ids"] + eos for text in batch[text_field]]}

    def pack(batch):
        stream = [token for ids in batch["input_ids"] for token in ids]
        blocks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=[text_field], num_proc=num_proc, desc="Tokenizing")
    # one batch over the whole stream, so that no tokens are lost between batches
    packed = tokenized.map(pack, batched=True, batch_size=None, desc="Packing")
    if len(packed) < 2:
        raise ValueError(f"need at least 2 blocks of {seq_len} tokens (train + eval), got {len(packed)}: add text")
    num_eval = min(len(packed) - 1, max(1, round(len(packed) * eval_fraction)))
    return DatasetDict(
        train=packed.select(range(len(packed) - num_eval)),
        eval=packed.select(range(len(packed) - num_eval, len(packed))),
    )
