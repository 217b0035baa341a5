"""Retrofit pretrained checkpoints of the supported families (HF folders, GGUF files) into AttnRes; import and export
flash-linear-attention's AttnRes checkpoints."""

from .families import SUPPORTED_MODEL_TYPES, UnsupportedSourceError
from .convert import convert, load_tokenizer, model_card
from .export import EXPORT_FORMATS, export
from .fla_layout import FLA_KEY_MAP
from .gguf_source import (GGUF_END_TOKENS, check_against_gguf, gguf_config_fields, gguf_stop_token_ids, gguf_tensor_map,
                          read_gguf_tensors, sampled_gguf_tensors)
from .gguf_tokenizer import GGUF_PRE_TOKENIZERS, gguf_pre_tokenizer, load_gguf_tokenizer
from .hf_source import check_folder_tensors, folder_tensors, unused_config_keys
from .retrofit import check_gguf_file, check_torch_file, load_source, load_source_config, retrofit, serializable_copy
from .verify import PROBE_TEXT, verify_conversion

__all__ = [
    "EXPORT_FORMATS",
    "FLA_KEY_MAP",
    "GGUF_END_TOKENS",
    "GGUF_PRE_TOKENIZERS",
    "PROBE_TEXT",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedSourceError",
    "check_against_gguf",
    "check_folder_tensors",
    "check_gguf_file",
    "check_torch_file",
    "convert",
    "export",
    "folder_tensors",
    "gguf_config_fields",
    "gguf_pre_tokenizer",
    "gguf_stop_token_ids",
    "gguf_tensor_map",
    "load_gguf_tokenizer",
    "load_source",
    "load_tokenizer",
    "load_source_config",
    "model_card",
    "read_gguf_tensors",
    "retrofit",
    "sampled_gguf_tensors",
    "serializable_copy",
    "unused_config_keys",
    "verify_conversion",
]
