"""GGUF sources, read with the `gguf` package: every tensor of the file is in the model or the conversion stops.

transformers' GGUF loader builds the model from its own config mapping and silently skips any file tensor the model
has no parameter for: a Llama file with `blk.N.attn_q.bias` loads without its biases (the mapping never sets
`attention_bias`), a Qwen3 file with `head_dim != 128` ends in a size mismatch (the mapping never reads
`attention.key_length`). This module closes those gaps: the config fields the mapping leaves out are read from the
file's metadata and tensor names (`gguf_config_fields`), a file tensor with no counterpart in the family's key table (`families.backbone_keys`)
stops the conversion naming it (`gguf_tensor_map`), and the loaded weights are compared with the file's own tensors,
dequantised by the `gguf` package and un-permuted independently of transformers (`check_against_gguf`).
"""

import os
from pathlib import Path

import numpy as np
import torch

from .families import GGUF_ARCHITECTURES, GGUF_PERMUTED_QK, backbone_keys

# llama.cpp writes these for Llama 3.1-style rope scaling; transformers' GGUF loader ignores them, so a model built
# from such a file would use unscaled rotary frequencies.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _reader(path: str | os.PathLike):
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader, key: str):
    from transformers.modeling_gguf_pytorch_utils import read_field  # decodes every gguf version's field layout

    values = read_field(reader, key)
    return values[0] if len(values) == 1 else values or None


def gguf_architecture(reader) -> str:
    """The file's `general.architecture` (llama.cpp's name: `llama`, `qwen2`, `qwen3`, ...)."""
    return str(_field(reader, "general.architecture"))


def gguf_config_fields(path: str | os.PathLike, config) -> dict:
    """Config fields transformers' GGUF mapping leaves out, read from the file (`path`) for `config`'s family.

    - `head_dim`: `<arch>.attention.key_length`, else the rows of `blk.0.attn_k.weight` over the key/value heads.
    - `attention_bias`: whether the file has `blk.N.attn_q.bias` (for families whose config has the flag).
    - `mlp_bias`: whether the file has `blk.N.ffn_{gate,up,down}.bias` (Llama's flag).

    Returns only the fields `config` has (a `dict`, possibly empty).
    """
    reader = _reader(path)
    arch = gguf_architecture(reader)
    names = {tensor.name: tensor for tensor in reader.tensors}
    fields = {}
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is None and "blk.0.attn_k.weight" in names:
        rows = int(names["blk.0.attn_k.weight"].shape[-1])  # ggml order: (in_features, out_features)
        key_length = rows // config.num_key_value_heads
    if key_length is not None and hasattr(config, "head_dim"):
        fields["head_dim"] = int(key_length)
    if hasattr(config, "attention_bias"):
        fields["attention_bias"] = any(name.endswith(".attn_q.bias") for name in names)
    if hasattr(config, "mlp_bias"):
        fields["mlp_bias"] = any(name.endswith((".ffn_gate.bias", ".ffn_up.bias", ".ffn_down.bias")) for name in names)
    return fields


def gguf_tensor_map(path: str | os.PathLike, config) -> dict[str, str]:
    """`{GGUF tensor name: HF parameter name}` for every tensor of the file, by the key table of the source `config`'s
    family (`families.backbone_keys`).

    Raises:
        ValueError: naming the file's tensors that have no parameter in a `model_type` model (the conversion would
            drop them), e.g. an unknown tensor or rope frequency factors (`rope_freqs.weight`).
    """
    import gguf

    model_type, num_hidden_layers = config.model_type, config.num_hidden_layers
    reader = _reader(path)
    arch = gguf_architecture(reader)
    arch_id = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None or arch != GGUF_ARCHITECTURES.get(model_type):
        raise ValueError(
            f"{Path(path).name}: GGUF architecture {arch!r} is not the llama.cpp layout of a {model_type} model "
            f"(supported: {', '.join(f'{k} as {v!r}' for k, v in GGUF_ARCHITECTURES.items())})"
        )
    name_map = gguf.get_tensor_name_map(arch_id, num_hidden_layers)
    to_hf = {}
    for hf_name in backbone_keys(config):
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
    unmapped = [tensor.name for tensor in reader.tensors if tensor.name not in to_hf]
    if unmapped:
        why = (
            "rope frequency factors, which transformers' GGUF loader ignores; convert the HF folder instead"
            if set(unmapped) & set(_ROPE_TENSORS)
            else f"no {model_type} parameter holds them"
        )
        raise ValueError(f"{Path(path).name} has tensors the conversion would drop ({why}): {_shown(unmapped)}")
    return {tensor.name: to_hf[tensor.name] for tensor in reader.tensors}


def check_gguf_coverage(path: str | os.PathLike, config) -> None:
    """Before loading: every tensor of the file has a weight in the model `config` builds, and every weight of that
    model (the tied `lm_head` excepted) has a tensor in the file. Builds the model on the meta device only.

    Raises:
        ValueError: naming the tensors that would be dropped, or the weights the file does not hold.
    """
    from transformers import AutoModelForCausalLM

    mapping = gguf_tensor_map(path, config)
    with torch.device("meta"):
        expected = set(AutoModelForCausalLM.from_config(config).state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    name = Path(path).name
    dropped = [gguf_name for gguf_name, hf_name in mapping.items() if hf_name not in expected]
    if dropped:
        raise ValueError(f"{name} has tensors the conversion would drop (the {config.model_type} model its metadata "
                         f"describes has no weight for them): {_shown(dropped)}")
    missing = sorted(expected - set(mapping.values()))
    if missing:
        raise ValueError(f"{name} holds no tensor for the {config.model_type} model's {_shown(missing)}")


def _shown(names: list[str], count: int = 6) -> str:
    return ", ".join(names[:count]) + (f" (+{len(names) - count} more)" if len(names) > count else "")


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (`LlamaModel.permute` in convert_hf_to_gguf.py)."""
    shape = weights.shape
    return weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_gguf_tensors(path: str | os.PathLike, config):
    """Yield `(GGUF name, HF name, tensor)` for every tensor of the file: dequantised to fp32 by the `gguf`
    package, Llama-layout q/k rows un-permuted, in HF shape `(out_features, in_features)` / `(features,)`.

    Raises `ValueError` like `gguf_tensor_map`.
    """
    from gguf import dequantize

    reader = _reader(path)
    mapping = gguf_tensor_map(path, config)
    permuted = gguf_architecture(reader) in GGUF_PERMUTED_QK
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weights = weights.reshape([int(n) for n in reversed(tensor.shape)])
        if permuted and ".attn_q." in tensor.name:
            weights = _unpermute(weights, config.num_attention_heads)
        elif permuted and ".attn_k." in tensor.name:
            weights = _unpermute(weights, config.num_key_value_heads)
        yield tensor.name, mapping[tensor.name], torch.from_numpy(weights)


@torch.no_grad()
def check_against_gguf(model: torch.nn.Module, path: str | os.PathLike, source_config=None, complete: bool = False
                       ) -> dict:
    """Compare `model`'s weights with the file's own tensors, one by one (see `read_gguf_tensors`).

    Args:
        model: a model with HF Llama/Qwen parameter names (the GGUF-loaded source or its AttnRes retrofit).
        source_config: the source family's config (default: `model.config`; required for an AttnRes model, e.g.
            `load_source_config(path)`).
        complete: also require every weight of `model` to come from the file (the tied `lm_head` excepted); use it
            for the source model, whose every weight must be the file's.

    Returns:
        `{"gguf_tensors_checked": int, "gguf_max_abs_delta": float}` (the delta in fp32 weight units; 0.0 when the
        weights are the file's).

    Raises:
        ValueError: a file tensor with no weight in `model`, of another shape, or with other values; with
            `complete`, a weight of `model` that no file tensor holds.
    """
    config = source_config or model.config
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"pass source_config (the GGUF source's config) to check a {config.model_type} model")
    state = model.state_dict()
    name = Path(path).name
    worst, seen = 0.0, set()
    for gguf_name, hf_name, weights in read_gguf_tensors(path, config):
        if hf_name not in state:
            raise ValueError(f"{name}: tensor {gguf_name} ({hf_name}) has no weight in the model; it would be dropped")
        target = state[hf_name]
        if tuple(target.shape) != tuple(weights.shape):
            raise ValueError(f"{name}: tensor {gguf_name} has shape {tuple(weights.shape)}, the model's {hf_name} "
                             f"{tuple(target.shape)}")
        delta = (target.float() - weights).abs().max().item() if weights.numel() else 0.0
        if delta > 0 and target.dtype == torch.float32:
            raise ValueError(f"{name}: the model's {hf_name} differs from tensor {gguf_name} by up to {delta:.3g}")
        worst, seen = max(worst, delta), seen | {hf_name}
    if complete:
        tied = getattr(config, "tie_word_embeddings", False)
        missing = [k for k in state if k not in seen and not (tied and k == "lm_head.weight")]
        if missing:
            raise ValueError(f"{name} holds no tensor for the model's {_shown(missing)}")
    return {"gguf_tensors_checked": len(seen), "gguf_max_abs_delta": worst}
