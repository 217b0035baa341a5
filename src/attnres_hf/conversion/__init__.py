"""Retrofit pretrained Llama / Mistral / Qwen2 / Qwen3 checkpoints (HF folders, GGUF files) into AttnRes."""

from .families import SUPPORTED_MODEL_TYPES, UnsupportedSourceError
from .convert import convert, load_tokenizer, model_card
from .retrofit import check_gguf_file, load_source, load_source_config, retrofit, serializable_copy
from .verify import PROBE_TEXT, verify_conversion

__all__ = [
    "PROBE_TEXT",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedSourceError",
    "check_gguf_file",
    "convert",
    "load_source",
    "load_tokenizer",
    "load_source_config",
    "model_card",
    "retrofit",
    "serializable_copy",
    "verify_conversion",
]
