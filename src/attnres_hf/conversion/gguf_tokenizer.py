"""The tokenizer a GGUF file describes, split the way its `tokenizer.ggml.pre` says.

A byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`) gives the same ids as its model's own tokenizer only
with the pre-tokenizer its merges were learned with. llama.cpp names it in `tokenizer.ggml.pre` and keeps one list
of split regexes per name (`llm_tokenizer_bpe` in `src/llama-vocab.cpp`); each regex of the list cuts the pieces
the previous one left, keeping the text between matches. transformers' GGUF loader builds the byte-level regex alone
for names it does not list (SmolLM2's `"smollm"` among them: digits are not split one by one). Here every name of a
family attnres-hf converts gets a `tokenizers` pre-tokenizer made of the same regexes (a `Split` per regex, then
`ByteLevel` without its own regex), and an unknown name is refused, as llama.cpp refuses it. A SentencePiece
vocabulary (`"llama"`) has no split regex in llama.cpp, so its `tokenizer.ggml.pre` does not matter.
"""

import os
import warnings
from pathlib import Path

from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# The original regexes of the models' tokenizer.json files (llama.cpp spells the case-insensitive group out).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # Llama 3 and its derivatives (llama.cpp: LLAMA3)
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    # SmolLM / StarCoder: every digit alone, then GPT-2's regex (llama.cpp: SMOLLM, STARCODER)
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    # Qwen2 / Qwen2.5 / Qwen3 (llama.cpp: QWEN2)
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    # Mistral NeMo and later byte-level Mistral vocabularies (llama.cpp: TEKKEN)
    "tekken": (_TEKKEN,),
    # GPT-2's own regex (llama.cpp: GPT2)
    "gpt-2": (_GPT2,),
    # llama.cpp's fallback for a byte-level vocabulary that names no pre-tokenizer (it warns that quality suffers)
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
"""`tokenizer.ggml.pre -> llama.cpp's split regexes, applied in order` for the byte-level vocabularies of the
families attnres-hf converts."""


def gguf_pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer for a byte-level GGUF vocabulary declaring `tokenizer.ggml.pre = pre`.

    A missing `pre` is llama.cpp's `"default"`, with a `UserWarning`. Raises `ValueError` for a name not in
    `GGUF_PRE_TOKENIZERS`.
    """
    if not pre:  # llama.cpp warns the same way ("missing pre-tokenizer type, using: 'default'")
        warnings.warn("the GGUF tokenizer names no tokenizer.ggml.pre; using llama.cpp's 'default' split, so its token "
                      "ids may differ from the model's own tokenizer", UserWarning, stacklevel=2)
    name = pre or "default"
    if name not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"the GGUF tokenizer declares pre-tokenizer {name!r}, which attnres-hf does not know (known: "
            f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))}); its token ids would differ from the model's own tokenizer"
        )
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in GGUF_PRE_TOKENIZERS[name]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def gguf_tokenizer_kind(path: str | os.PathLike) -> tuple[str | None, str | None]:
    """`(tokenizer.ggml.model, tokenizer.ggml.pre)` of a GGUF file (each `None` when absent)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(path)

    def value(key):
        values = read_field(reader, key)
        return str(values[0]) if values else None

    return value("tokenizer.ggml.model"), value("tokenizer.ggml.pre")


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer of a GGUF file (transformers' conversion), with the pre-tokenizer its file declares.

    Returns `None` if the file holds no tokenizer. Raises `ValueError` for a byte-level vocabulary whose
    `tokenizer.ggml.pre` is unknown (before the slow vocabulary conversion).
    """
    path = Path(path)
    model, pre = gguf_tokenizer_kind(path)
    if model is None:
        return None
    pre_tokenizer = gguf_pre_tokenizer(pre) if model == "gpt2" else None
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer
