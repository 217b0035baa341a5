"""GGUF sources, read with the `gguf` package: every tensor of the file is in the model or the conversion stops.

transformers' GGUF loader builds the model from its own config mapping and silently skips any file tensor the model
has no parameter for: a Llama file with `blk.N.attn_q.bias` loads without its biases (the mapping never sets
`attention_bias`), a Qwen3 file with `head_dim != 128` ends in a size mismatch (the mapping never reads
`attention.key_length`), a Qwen3-MoE file ends in one unless its experts are 768 wide (the mapping never reads
`expert_feed_forward_length`), a Gemma2 file gets the default soft-capping and attention scale whatever the file
says, a Phi-3 file loses its sliding window. This module closes those gaps: the config fields the mapping leaves out
are read from the file's metadata and tensor names (`gguf_config_fields`), a file tensor with no counterpart in the
family's key table (`families.backbone_keys`) stops the conversion naming it (`gguf_tensor_map`), and the loaded
weights are compared with the file's own tensors, dequantised by the `gguf` package and un-permuted (Llama's q/k
rows), un-shifted (Gemma's norms, stored as `1 + w`) and split (mixture-of-experts `gate_up_proj`, stored as
`ffn_gate_exps` and `ffn_up_exps`) independently of transformers (`check_against_gguf`).
"""

import copy
import functools
import os
from pathlib import Path

import numpy as np
import torch

from .families import GGUF_ARCHITECTURES, GGUF_NORM_OFFSETS, GGUF_PERMUTED_QK, backbone_keys

# llama.cpp writes these for Llama 3.1-style rope scaling and Phi-3's long-context rope; transformers' GGUF loader
# ignores them, so a model built from such a file would use unscaled rotary frequencies.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_EXPERT_HALVES = {"ffn_gate_exps": 0, "ffn_up_exps": 1}
"""llama.cpp stores an HF `mlp.experts.gate_up_proj` `(experts, 2 * moe_intermediate, hidden)` as two tensors, its
gate half (first) and its up half, `(experts, moe_intermediate, hidden)` each; the value is the half's index."""

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The layer count by which llama.cpp recognises Gemma 27B, the one size whose attention scale is
`1 / sqrt(hidden_size / num_attention_heads)` instead of `1 / sqrt(head_dim)` (`f_attention_scale` in llama.cpp's
`llama-model.cpp`): a GGUF file holds no `query_pre_attn_scalar`, its reader derives it so."""


GGUF_END_TOKENS = ("eos", "eot", "eom")
"""The `tokenizer.ggml.<name>_token_id` keys of a GGUF file that end generation: end of sequence, of turn (Llama 3's
`<|eot_id|>`, Gemma's `<end_of_turn>`) and of message (Llama 3.1's `<|eom_id|>`); llama.cpp stops on each
(`llama_vocab::is_eog`), transformers' GGUF loader reads the eos id only."""


def _reader(path: str | os.PathLike):
    """The file's `GGUFReader`, parsed once per file version: parsing reads every metadata field in Python (SmolLM2's
    49,152-token vocabulary: about 10 s on a 2-core machine), and one conversion reads the file in several steps
    (config fields, tensor map, coverage, stop tokens, the weight check). A file rewritten in place (another size or
    modification time) is parsed again."""
    stat = Path(path).stat()
    return _parsed_reader(str(Path(path).resolve()), stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed_reader(path: str, inode: int, mtime_ns: int, ctime_ns: int, size: int):
    from gguf import GGUFReader

    return GGUFReader(path)  # read-only memory map: the tensors are read when dequantised


def _field(reader, key: str):
    from transformers.modeling_gguf_pytorch_utils import read_field  # decodes every gguf version's field layout

    values = read_field(reader, key)
    return values[0] if len(values) == 1 else values or None


def gguf_architecture(reader) -> str:
    """The file's `general.architecture` (llama.cpp's name: `llama`, `qwen2`, `qwen3`, ...)."""
    return str(_field(reader, "general.architecture"))


def gguf_stop_token_ids(path: str | os.PathLike) -> list[int]:
    """The end-token ids a GGUF file declares (`GGUF_END_TOKENS`, in that order, each once; `[]` if none)."""
    reader = _reader(path)
    ids = [_field(reader, f"tokenizer.ggml.{name}_token_id") for name in GGUF_END_TOKENS]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def gguf_config_fields(path: str | os.PathLike, config) -> dict:
    """Config fields transformers' GGUF mapping leaves out, read from the file (`path`) for `config`'s family.

    - `head_dim`: `<arch>.attention.key_length`, else the rows of `blk.0.attn_k.weight` over the key/value heads.
    - `attention_bias` / `qkv_bias` (Qwen2-MoE): whether the file has `blk.N.attn_q.bias`.
    - `mlp_bias`: whether the file has `blk.N.ffn_{gate,up,down}.bias` (Llama's flag).
    - `moe_intermediate_size`, `shared_expert_intermediate_size`: `<arch>.expert_feed_forward_length` /
      `expert_shared_feed_forward_length`, else the width of `ffn_down_exps` / `ffn_down_shexp`.
    - `attn_logit_softcapping`, `final_logit_softcapping`: `<arch>.attn_logit_softcapping` /
      `final_logit_softcapping` when the file has them (Gemma2, Gemma3).
    - `query_pre_attn_scalar` (Gemma): as llama.cpp derives it, `head_dim`, or `hidden_size // num_attention_heads`
      for the 27B layer counts (`_GEMMA_27B_LAYERS`).
    - `sliding_window`: `<arch>.attention.sliding_window`, 0 meaning none (Phi-3); a Gemma3 file without a window
      has only global layers (`layer_types`), as llama.cpp reads it.
    - `rope_parameters`: Phi-3's `partial_rotary_factor` (`rope.dimension_count` over `head_dim`), and linear rope
      scaling (`rope.scaling.type` / `factor`; Gemma3: on its global layers only, as llama.cpp applies it).

    Returns only the fields `config` has (a `dict`, possibly empty).

    Raises:
        ValueError: the file declares rope scaling other than linear (transformers' GGUF loader ignores it and the
            model would rotate with unscaled frequencies; no exact model can be built from the file), or it has
            expert tensors but no `<arch>.expert_count` / `expert_used_count`.
    """
    reader = _reader(path)
    arch = gguf_architecture(reader)
    names = {tensor.name: tensor for tensor in reader.tensors}

    def meta(key):
        return _field(reader, f"{arch}.{key}")

    def width(suffix):  # the inner size of an FFN from its down projection, ggml order (in_features, out, ...)
        tensor = next((names[n] for n in names if n.endswith(suffix)), None)
        return None if tensor is None else int(tensor.shape[0])

    fields = {}
    key_length = meta("attention.key_length")
    if key_length is None and "blk.0.attn_k.weight" in names:
        rows = int(names["blk.0.attn_k.weight"].shape[-1])  # ggml order: (in_features, out_features)
        key_length = rows // config.num_key_value_heads
    if key_length is not None and hasattr(config, "head_dim"):
        fields["head_dim"] = int(key_length)
    head_dim = fields.get("head_dim") or getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    for flag in ("attention_bias", "qkv_bias"):
        if hasattr(config, flag):
            fields[flag] = any(name.endswith(".attn_q.bias") for name in names)
    if hasattr(config, "mlp_bias"):
        fields["mlp_bias"] = any(name.endswith((".ffn_gate.bias", ".ffn_up.bias", ".ffn_down.bias")) for name in names)

    # mixture of experts: the expert counts must be in the file (transformers falls back to its config defaults,
    # e.g. Qwen2-MoE top-4 of 60, and its own GGUF-loaded model then shares the wrong routing: llama.cpp requires them)
    if any(name.endswith("_exps.weight") for name in names):
        for key in ("expert_count", "expert_used_count"):
            if meta(key) is None:
                raise ValueError(f"{Path(path).name} has expert tensors but no {arch}.{key}: the experts' routing "
                                 "cannot be read from the file (llama.cpp requires the key too)")
    # the expert widths (llama.cpp's qwen2moe / qwen3moe layouts have experts in every layer,
    # as transformers' default `mlp_only_layers=[]`, `decoder_sparse_step=1` say)
    for field, key, suffix in (("moe_intermediate_size", "expert_feed_forward_length", ".ffn_down_exps.weight"),
                               ("shared_expert_intermediate_size", "expert_shared_feed_forward_length",
                                ".ffn_down_shexp.weight")):
        size = meta(key) if meta(key) is not None else width(suffix)
        if hasattr(config, field) and size is not None:
            fields[field] = int(size)

    # Gemma: soft-capping, the attention scale, global-only files
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hasattr(config, field) and meta(field) is not None:
            fields[field] = float(meta(field))
    if hasattr(config, "query_pre_attn_scalar") and arch in _GEMMA_27B_LAYERS:
        is_27b = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
        fields["query_pre_attn_scalar"] = config.hidden_size // config.num_attention_heads if is_27b else head_dim
    window = meta("attention.sliding_window")
    if hasattr(config, "sliding_window") and window is not None:
        fields["sliding_window"] = int(window) or None
    if arch == "gemma3" and not window:  # llama.cpp: sliding layers only with a window (Gemma3Model omits it else)
        fields["layer_types"] = ["full_attention"] * config.num_hidden_layers

    # rotary: Phi-3's partial rotation, linear scaling; any other scaling cannot be built exactly
    rope = copy.deepcopy(getattr(config, "rope_parameters", None) or {})
    rotary_dims = meta("rope.dimension_count")
    if arch == "phi3" and rotary_dims is not None and int(rotary_dims) != head_dim:
        rope["partial_rotary_factor"] = int(rotary_dims) / head_dim
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(
                f"{Path(path).name} declares {scaling!r} rope scaling, which transformers' GGUF loader ignores (the "
                "model it builds would rotate with unscaled frequencies); convert the HF folder instead"
            )
        scaled = rope.get("full_attention", rope)  # Gemma3: llama.cpp scales the global layers only
        scaled.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    if rope != (getattr(config, "rope_parameters", None) or {}):
        fields["rope_parameters"] = rope
    return fields


def _gguf_table(config, arch: str) -> dict[str, str]:
    """`{GGUF tensor name: HF parameter name}` for every backbone key of `config`'s family, in llama.cpp's names (an
    HF `mlp.experts.gate_up_proj` has two: `ffn_gate_exps` and `ffn_up_exps`, see `_EXPERT_HALVES`)."""
    import gguf

    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    table = {}
    for hf_name in backbone_keys(config):
        if hf_name.endswith(".mlp.experts.gate_up_proj"):
            block = hf_name.split(".")[2]
            table |= {f"blk.{block}.{half}.weight": hf_name for half in _EXPERT_HALVES}
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:  # stacked expert tensors have no suffix in HF; llama.cpp names them `.weight`
            table[gguf_name if gguf_name.endswith((".weight", ".bias")) else f"{gguf_name}.weight"] = hf_name
    return table


def _expert_half(gguf_name: str) -> int | None:
    """Which half of an HF `gate_up_proj` the GGUF tensor holds (0: gate, 1: up), or `None`."""
    return _EXPERT_HALVES.get(gguf_name.split(".")[-2])


def gguf_tensor_map(path: str | os.PathLike, config) -> dict[str, str]:
    """`{GGUF tensor name: HF parameter name}` for every tensor of the file, by the key table of the source `config`'s
    family (`families.backbone_keys`). Two tensors map to a mixture-of-experts `gate_up_proj`: its gate and up halves.

    Raises:
        ValueError: naming the file's tensors that have no parameter in a `model_type` model (the conversion would
            drop them), e.g. an unknown tensor or rope frequency factors (`rope_freqs.weight`).
    """
    import gguf

    model_type = config.model_type
    reader = _reader(path)
    arch = gguf_architecture(reader)
    arch_id = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None or arch != GGUF_ARCHITECTURES.get(model_type):
        raise ValueError(
            f"{Path(path).name}: GGUF architecture {arch!r} is not the llama.cpp layout of a {model_type} model "
            f"(supported: {', '.join(f'{k} as {v!r}' for k, v in GGUF_ARCHITECTURES.items())})"
        )
    to_hf = _gguf_table(config, arch)
    unmapped = [tensor.name for tensor in reader.tensors if tensor.name not in to_hf]
    if unmapped:
        why = (
            "rope frequency factors, which transformers' GGUF loader ignores; convert the HF folder instead"
            if set(unmapped) & set(_ROPE_TENSORS)
            else f"no {model_type} parameter holds them"
        )
        raise ValueError(f"{Path(path).name} has tensors the conversion would drop ({why}): {_shown(unmapped)}")
    return {tensor.name: to_hf[tensor.name] for tensor in reader.tensors}


def _complete(mapping: dict[str, str]) -> set[str]:
    """The HF parameters `mapping` (see `gguf_tensor_map`) fills completely (a `gate_up_proj` needs both halves)."""
    halves = {}
    for gguf_name, hf_name in mapping.items():
        half = _expert_half(gguf_name)
        halves.setdefault(hf_name, set()).update({half} if half is not None else set(_EXPERT_HALVES.values()))
    return {hf_name for hf_name, held in halves.items() if held == set(_EXPERT_HALVES.values())}


def check_gguf_coverage(path: str | os.PathLike, config) -> None:
    """Before loading: every tensor of the file has a weight in the model `config` builds, and every weight of that
    model (the tied `lm_head` excepted) has its tensor(s) in the file. Builds the model on the meta device only.

    Raises:
        ValueError: naming the tensors that would be dropped, or the weights the file does not hold (with the GGUF
            tensors that would hold them, e.g. a missing expert tensor `blk.1.ffn_up_exps.weight`).
    """
    from transformers import AutoModelForCausalLM

    mapping = gguf_tensor_map(path, config)
    with torch.device("meta"):  # on a copy: from_config sets the attention and experts implementations in it
        expected = set(AutoModelForCausalLM.from_config(copy.deepcopy(config)).state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    name = Path(path).name
    dropped = [gguf_name for gguf_name, hf_name in mapping.items() if hf_name not in expected]
    if dropped:
        raise ValueError(f"{name} has tensors the conversion would drop (the {config.model_type} model its metadata "
                         f"describes has no weight for them): {_shown(dropped)}")
    missing = sorted(expected - _complete(mapping))
    if missing:
        table = _gguf_table(config, gguf_architecture(_reader(path)))
        wanted = {hf_name: [g for g, h in table.items() if h == hf_name and g not in mapping] for hf_name in missing}
        shown = [f"{hf_name} ({', '.join(wanted[hf_name])})" if wanted[hf_name] else hf_name for hf_name in missing]
        raise ValueError(f"{name} holds no tensor for the {config.model_type} model's {_shown(shown)}")


def _shown(names: list[str], count: int = 6) -> str:
    return ", ".join(names[:count]) + (f" (+{len(names) - count} more)" if len(names) > count else "")


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (`LlamaModel.permute` in convert_hf_to_gguf.py)."""
    shape = weights.shape
    return weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def sampled_gguf_tensors(names) -> list[str]:
    """The GGUF tensors a sampled weight check reads, of the file's tensor `names`, in file order: every tensor
    outside the blocks (embedding, final norm, output head) and each kind of block tensor (`blk.N.attn_q.weight`,
    `blk.N.ffn_gate_exps.weight`, ...) in the first and the last block that holds it. The mapping from the file to
    the model is one rule per kind (un-permuted q/k rows, Gemma's norm offset, expert halves, shapes), so the sample
    checks every rule, at both ends of the layer numbering; the middle blocks' values are what `complete=True`
    reading adds."""
    names, ends = list(names), {}
    for name in names:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
            low, high = ends.get(".".join(parts[2:]), (int(parts[1]), int(parts[1])))
            ends[".".join(parts[2:])] = (min(low, int(parts[1])), max(high, int(parts[1])))
    return [name for name in names
            if not (name.startswith("blk.") and name.split(".")[1].isdigit())
            or int(name.split(".")[1]) in ends[".".join(name.split(".")[2:])]]


def read_gguf_tensors(path: str | os.PathLike, config, only: set[str] | None = None):
    """Yield `(GGUF name, HF name, tensor)` for every tensor of the file (or those named in `only`): dequantised to fp32 by the `gguf`
    package, Llama-layout q/k rows un-permuted, Gemma's norm offset (`families.GGUF_NORM_OFFSETS`) subtracted, in HF
    shape `(out_features, in_features)` / `(features,)` / `(experts, out, in)`. An expert `ffn_gate_exps` /
    `ffn_up_exps` tensor is one half of its HF `gate_up_proj` (split along dim 1, gate first).

    Raises `ValueError` like `gguf_tensor_map`.
    """
    reader = _reader(path)
    mapping = gguf_tensor_map(path, config)
    arch = gguf_architecture(reader)
    for tensor in reader.tensors:
        if only is not None and tensor.name not in only:
            continue
        shape, _, read_rows = gguf_rows(tensor, config, arch)
        yield tensor.name, mapping[tensor.name], read_rows(0, shape[0] if shape else 1, torch.float32)


@torch.no_grad()
def check_against_gguf(model: torch.nn.Module, path: str | os.PathLike, source_config=None, complete: bool = False,
                       sample: bool = False, progress: bool = False) -> dict:
    """Compare `model`'s weights with the file's own tensors, one by one (see `read_gguf_tensors`).

    Args:
        model: a model with the source family's HF parameter names (the GGUF-loaded source or its AttnRes retrofit).
        source_config: the source family's config (default: `model.config`; required for an AttnRes model, e.g.
            `load_source_config(path)`).
        complete: also require every weight of `model` to come from the file (the tied `lm_head` excepted); use it
            for the source model, whose every weight must be the file's. Read from the file's tensor names: it holds
            with `sample` too.
        sample: compare the tensors of `sampled_gguf_tensors` only (every kind of tensor, in the first and last
            block: SmolLM2's 20 of 272, each dequantised on the CPU) instead of all.
        progress: a tqdm bar over the tensors read.

    Returns:
        `{"gguf_tensors_checked": int, "gguf_tensors": int, "gguf_max_abs_delta": float}`: the model weights compared
        and those the file holds (equal unless `sample`), and the largest delta in fp32 weight units (0.0 when the
        weights are the file's).

    Raises:
        ValueError: a file tensor with no weight in `model`, of another shape, or with other values; with
            `complete`, a weight of `model` that no file tensor holds.
    """
    from tqdm.auto import tqdm

    config = source_config or model.config
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"pass source_config (the GGUF source's config) to check a {config.model_type} model")
    state = model.state_dict()
    name = Path(path).name
    mapping = gguf_tensor_map(path, config)
    only = set(sampled_gguf_tensors(mapping)) if sample else set(mapping)
    worst, seen = 0.0, {}
    tensors = tqdm(read_gguf_tensors(path, config, only), total=len(only), disable=not progress, unit="tensor",
                   desc=f"Checking {'a sample of ' if sample else ''}the weights against {name}")
    for gguf_name, hf_name, weights in tensors:
        if hf_name not in state:
            raise ValueError(f"{name}: tensor {gguf_name} ({hf_name}) has no weight in the model; it would be dropped")
        target, half = state[hf_name], _expert_half(gguf_name)
        if half is not None:  # one half of a stacked gate_up_proj
            target = target.chunk(2, dim=1)[half]
        if tuple(target.shape) != tuple(weights.shape):
            if [n for n in target.shape if n != 1] != [n for n in weights.shape if n != 1]:
                raise ValueError(f"{name}: tensor {gguf_name} has shape {tuple(weights.shape)}, the model's "
                                 f"{hf_name} {tuple(target.shape)}")
            weights = weights.reshape(target.shape)  # e.g. Qwen2-MoE's shared-expert gate, stored 1-D
        delta = (target.float() - weights).abs().max().item() if weights.numel() else 0.0
        if delta > 0 and target.dtype == torch.float32:
            raise ValueError(f"{name}: the model's {hf_name} differs from tensor {gguf_name} by up to {delta:.3g}")
        worst = max(worst, delta)
        seen[gguf_name] = hf_name
    if complete:
        tied = getattr(config, "tie_word_embeddings", False)
        missing = [k for k in state if k not in _complete(mapping) and not (tied and k == "lm_head.weight")]
        if missing:
            raise ValueError(f"{name} holds no tensor for the model's {_shown(missing)}")
    for gguf_name, hf_name in mapping.items():  # a tensor the sample skipped still needs its weight in the model
        if hf_name not in state:
            raise ValueError(f"{name}: tensor {gguf_name} ({hf_name}) has no weight in the model; it would be dropped")
    return {"gguf_tensors_checked": len(set(seen.values())), "gguf_tensors": len(set(mapping.values())),
            "gguf_max_abs_delta": worst}


def gguf_rows(tensor, config, arch: str) -> tuple:
    """`(shape, dtype, read_rows)` of a GGUF tensor (the reader's): its HF shape `(out_features, in_features)` /
    `(features,)` / `(experts, out, in)`, fp32, and `read_rows(start, stop, dtype)`, its rows `start:stop` (dim 0)
    dequantised by the `gguf` package, Llama-layout q/k rows un-permuted (whole heads read), Gemma's norm offset
    (`families.GGUF_NORM_OFFSETS`) subtracted: the fields of a `sources.TensorRead` (`gguf_stream`)."""
    from gguf import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    heads = None
    if arch in GGUF_PERMUTED_QK and ".attn_q." in tensor.name:
        heads = config.num_attention_heads
    elif arch in GGUF_PERMUTED_QK and ".attn_k." in tensor.name:
        heads = config.num_key_value_heads
    offset = GGUF_NORM_OFFSETS.get(arch, 0.0) if tensor.name.endswith("norm.weight") else 0.0
    per_head = shape[0] // heads if heads else 1

    def read_rows(start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        first, last = start // per_head * per_head, -(-stop // per_head) * per_head
        values = dequantize(tensor.data[first:last], tensor.tensor_type).astype(np.float32)
        values = values.reshape(last - first, *shape[1:])  # (rows, *HF row shape)
        if heads:
            values = _unpermute(values, (last - first) // per_head)
        if offset:
            values = values - np.float32(offset)
        return torch.from_numpy(np.ascontiguousarray(values[start - first:stop - first])).to(dtype)

    return shape, torch.float32, read_rows
