"""Kimi K3 checkpoints as sources: a K3-layout folder (the released multimodal one, or the text-only one `export`
writes; `k3_layout.py`) read into a `kimi_k3` AttnRes model, every tensor mapped or the folder refused before anything
loads.

With `attn_res_block_size` in the text config the checkpoint is an AttnRes model already: its trained pseudo-queries
and key norms are imported, with `attnres_block_size = 2 * attn_res_block_size` and `attnres_rescale_output=False`,
and nothing else may change. Without it, it is K3's architecture with plain residuals and converts as any source does.

The released routed experts are MXFP4 (compressed-tensors' `mxfp4-pack-quantized`: `weight_packed` with two E2M1
values a byte, `weight_scale` one E8M0 exponent per 32 inputs). They are dequantised on load by compressed-tensors
(`pip install "attnres-hf[k3]"`), exactly: every MXFP4 value is a bfloat16 value, and the model holds fp32. Without the
library such a checkpoint is refused before anything loads.
"""

import importlib.util
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import GenerationConfig

from ..modeling import AttnResConfig, AttnResForCausalLM
from ..modeling import backbones
from ..modeling.configuration_kimi_k3 import KimiK3Config
from ..modeling.depth_mixing import is_depth_mixing_parameter
from .families import UnsupportedSourceError
from .hf_source import _shown, folder_tensors
from .k3_layout import (K3_MODEL_TYPE, PREFIXES, SKIPPED_PREFIXES, TEXT_MODEL_TYPE, backbone_from_k3, k3_block_size,
                        k3_parts, k3_text_fields, to_attnres_state_dict, to_attnres_tensor, to_k3_state_dict)
from .mxfp4 import decode_mxfp4
from .retrofit import _check_folder, retrofit, retrofit_config
from .sources import InMemory, SafetensorsFile, Source, TensorRead, continuation, most_common_dtype
from .verify import verify_conversion

K3_ONLY_FIELDS = ("attn_res_block_size", "activation_situ_beta", "activation_situ_linear_beta",
                  "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate")
"""Text-config fields K3 has and Kimi Linear's does not: a `kimi_linear` config with one of them is K3's."""

MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4_ARGS = {"group_size": 32, "num_bits": 4, "type": "float"}
"""The MXFP4 weight arguments K3's experts are read and written with (`mxfp4.GROUP_SIZE`-input blocks)."""
_PACKED, _SCALE = ".weight_packed", ".weight_scale"


class K3Source(NamedTuple):
    folder: Path
    layout: str  # "multimodal" (the release: text under `language_model.`) or "text"
    fields: dict  # the whole config.json
    text_config: dict  # K3's text config (`k3_text_fields`: `fields["text_config"]` with the top level's token ids
    # where it has none, or `fields` for the text layout)
    backbone: KimiK3Config
    block_size: int | None  # attnres_block_size (2 * attn_res_block_size); None without AttnRes
    files: list
    index: Path | None
    mxfp4: bool  # the routed experts are MXFP4
    quantization_config: dict | None = None  # the config's, as declared (MXFP4 experts' only)


def _config(source) -> dict | None:
    try:
        fields = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def is_family_folder(source) -> bool:
    """Whether `source` is a folder `KimiK3ForCausalLM.save_pretrained` wrote (the `kimi_k3` family's own source
    model: `model_type: "kimi_k3"` with the flat fields of `KimiK3Config`, not K3's nested `text_config`)."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).is_dir() or (fields := _config(source)) is None:
        return False
    return fields.get("model_type") == K3_MODEL_TYPE and "text_config" not in fields and "linear_num_heads" in fields


def is_k3_folder(source) -> bool:
    """Whether `source` is a folder of K3's layout: `config.json` says `model_type: "kimi_k3"` (the release), or
    `kimi_linear` with a field only K3 has (`K3_ONLY_FIELDS`, SiTU, K3's KDA gate options)."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).is_dir() or (fields := _config(source)) is None:
        return False
    if fields.get("model_type") == K3_MODEL_TYPE:
        return not is_family_folder(source)
    linear = fields.get("linear_attn_config")
    return fields.get("model_type") == TEXT_MODEL_TYPE and (
        any(name in fields for name in K3_ONLY_FIELDS) or fields.get("hidden_act") == "situ"
        or isinstance(linear, dict) and bool({"use_full_rank_gate", "gate_lower_bound"} & set(linear)))


def check_mxfp4_quantization(declared, where) -> dict:
    """`declared` (a `quantization_config`) when it is compressed-tensors' `mxfp4-pack-quantized` in the blocks K3's
    experts are read and written in (`group_size` 32, 4-bit floats, where it says); else `UnsupportedSourceError`, one
    line naming `where` (the file it came from)."""
    if not isinstance(declared, dict):
        raise UnsupportedSourceError(f"{where}: quantization_config must be an object, got {type(declared).__name__}")
    groups = declared.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(group, dict) for group in groups.values()):
        raise UnsupportedSourceError(f"{where}: quantization_config's config_groups must be an object of objects, got "
                                     f"{json.dumps(groups)[:80]}")
    groups = list(groups.values())
    formats = {declared.get("format")} | {group.get("format") for group in groups}
    if declared.get("quant_method") != "compressed-tensors" or formats - {None} != {MXFP4_FORMAT}:
        raise UnsupportedSourceError(f"{where}: quantization_config is not compressed-tensors' "
                                     f"{MXFP4_FORMAT} (K3's MXFP4 experts), the only quantization read here: "
                                     f"quant_method {declared.get('quant_method')!r}, format {sorted(map(str, formats))}")
    weights = [group["weights"] for group in groups if isinstance(group.get("weights"), dict)]
    other = sorted({f"{key} {args[key]!r}" for args in weights for key, value in MXFP4_ARGS.items()
                    if key in args and args[key] != value})
    if other:
        raise UnsupportedSourceError(f"{where}: quantization_config declares MXFP4 other than K3's experts' "
                                     f"({', '.join(other)}; read and written here: "
                                     f"{', '.join(f'{k} {v!r}' for k, v in MXFP4_ARGS.items())})")
    return declared


def _quantization(source_fields: dict, text: dict, folder: Path) -> dict | None:
    """The config's `quantization_config` when it declares MXFP4 experts, else `None`; raises
    `UnsupportedSourceError` for any other quantization."""
    declared = text.get("quantization_config") or source_fields.get("quantization_config")
    return None if declared is None else check_mxfp4_quantization(declared, folder / "config.json")


def k3_source(folder: str | os.PathLike) -> K3Source:
    """Read and check a K3 folder's config and weight files (headers only).

    Raises:
        FileNotFoundError, ValueError: a missing folder, config or weights; a truncated or corrupt weight file; a
            multimodal config without `text_config`; an `attn_res_block_size` that is not a positive integer.
        UnsupportedSourceError (a `ValueError`): naming every text-config field or value not implemented, and any
            quantization other than MXFP4 experts.
    """
    folder = Path(folder)
    files, index = _check_folder(folder)
    fields = _config(folder)
    if fields is None:
        raise ValueError(f"{folder / 'config.json'} is not a JSON object")
    layout = "multimodal" if fields.get("model_type") == K3_MODEL_TYPE else "text"
    text = k3_text_fields(fields)
    if not isinstance(text, dict):
        raise ValueError(f"{folder / 'config.json'} is Kimi K3's multimodal config without a text_config object: the "
                         "text model's fields are what attnres-hf reads")
    if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise UnsupportedSourceError(f"{folder / 'config.json'}: K3's text_config has model_type "
                                     f"{text.get('model_type')!r}, not {TEXT_MODEL_TYPE!r}")
    quantization = _quantization(fields, text, folder)
    try:
        block_size = k3_block_size(text.get("attn_res_block_size"))
    except ValueError as error:
        raise ValueError(f"{folder / 'config.json'}: {error}") from None
    backbone, problems = backbone_from_k3(text)
    if problems:
        raise UnsupportedSourceError(f"{folder}: K3 text config with no exact attnres-hf counterpart: "
                                     f"{'; '.join(problems)}")
    return K3Source(folder, layout, fields, text, backbone, block_size, files, index, quantization is not None,
                    quantization)


def _dequantised_names(tensors: dict, source: K3Source) -> dict:
    """`tensors` with each MXFP4 `weight_packed` / `weight_scale` pair as one `.weight` of the unpacked shape (meta
    tensors: shapes only). Raises `ValueError` for a pair with a part missing, quantised tensors outside the routed
    experts, or packed tensors the config does not declare."""
    packed = {name.removesuffix(_PACKED) for name in tensors if name.endswith(_PACKED)}
    scales = {name.removesuffix(_SCALE) for name in tensors if name.endswith(_SCALE)}
    where = f"{source.folder}:"
    if packed and not source.mxfp4:
        raise ValueError(f"{where} MXFP4 tensors ({_shown(sorted(packed))}) but no quantization_config declares them")
    if packed ^ scales:
        raise ValueError(f"{where} MXFP4 tensors without their other half (weight_packed with weight_scale): "
                         f"{_shown(sorted(packed ^ scales))}")
    stray = sorted(name for name in packed if ".block_sparse_moe.experts." not in name)
    if stray:
        raise ValueError(f"{where} MXFP4 tensors outside the routed experts (K3 quantises only those): {_shown(stray)}")
    shapes = [f"{name} ({tuple(tensors[name + _PACKED].shape)} packed, {tuple(tensors[name + _SCALE].shape)} scales)"
              for name in sorted(packed) if tensors[name + _PACKED].dim() != 2 or tuple(tensors[name + _SCALE].shape)
              != (tensors[name + _PACKED].shape[0], tensors[name + _PACKED].shape[1] * 2 // 32)]
    if shapes:
        raise ValueError(f"{where} MXFP4 tensors whose scales are not one per 32 inputs (K3's group size): "
                         f"{_shown(shapes)}")
    out = {name: tensor for name, tensor in tensors.items() if not name.endswith((_PACKED, _SCALE))}
    for name in packed:
        rows, half = tensors[name + _PACKED].shape
        out[name + ".weight"] = torch.empty(rows, 2 * half, device="meta")
    return out


def check_k3_tensors(source: K3Source, config: AttnResConfig) -> None:
    """Before loading: every text tensor of the folder has a place and the shape `config`'s model gives it, and the
    files fill every weight (the AttnRes ones too when the checkpoint has AttnRes; layer 0's inert attention router
    may be absent, and is then zero).

    Raises:
        ValueError: naming the tensors with no place, of another shape, and the weights no tensor holds.
    """
    tensors = _dequantised_names(folder_tensors(source.files, source.index), source)
    state, unplaced = to_attnres_state_dict(tensors, source.backbone, source.layout)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in AttnResForCausalLM(config).state_dict().items()
                    if source.block_size is not None or not is_depth_mixing_parameter(name)}
    problems = []
    routers = sorted(name for name in state if is_depth_mixing_parameter(name) and name not in expected)
    if routers and source.block_size is None:
        problems.append(f"AttnRes tensors, but the config has no attn_res_block_size: {_shown(routers)}")
    if unplaced:
        problems.append(f"tensors with no place in K3's text model (K3 names): {_shown(sorted(unplaced))}")
    extra = sorted(name for name in state if name not in expected and name not in routers)
    if extra:  # e.g. layers past num_hidden_layers (multi-token-prediction layers) or another config's modules
        problems.append(f"tensors the model config.json builds does not have (attnres-hf names): {_shown(extra)}")
    shapes = sorted(f"{name} {tuple(t.shape)} (expected {expected[name]})" for name, t in state.items()
                    if name in expected and tuple(t.shape) != expected[name])
    if shapes:
        problems.append(f"tensors of another shape than config.json gives (attnres-hf names): {_shown(shapes)}")
    missing = set(expected) - set(state) - set(_INERT) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        problems.append(f"no tensor for (attnres-hf names) {_shown(sorted(missing))}")
    if problems:
        raise ValueError(f"{source.folder}: the weight files do not match the Kimi K3 model its config.json builds; "
                         f"{'; '.join(problems)}")


_INERT = ("model.layers.0.attn_res.query", "model.layers.0.attn_res.key_norm.weight")
"""Layer 0's attention router: it reads one source (the embedding), so its weights never act (K3 keeps them)."""


def check_compressed_tensors() -> str:
    """compressed-tensors' version (it dequantises K3's MXFP4 experts).

    Raises:
        ImportError: it is not installed.
    """
    if importlib.util.find_spec("compressed_tensors") is None:
        raise ImportError("this Kimi K3 checkpoint's routed experts are MXFP4, which compressed-tensors dequantises: "
                          'pip install "attnres-hf[k3]"')
    from importlib.metadata import version

    return version("compressed-tensors")


def read_k3_tensors(source: K3Source) -> dict[str, torch.Tensor]:
    """Every text tensor of the folder under K3's names, MXFP4 experts dequantised (bf16) under `.weight`; the
    vision tensors are not read."""
    from safetensors import safe_open

    if source.mxfp4:
        check_compressed_tensors()
    raw = {}
    for path in source.files:
        with safe_open(path, "pt") as handle:
            raw |= {name: handle.get_tensor(name) for name in handle.keys() if not name.startswith(SKIPPED_PREFIXES)}
    packed = [name.removesuffix(_PACKED) for name in raw if name.endswith(_PACKED)]
    for name in packed:
        raw[name + ".weight"] = decode_mxfp4(raw.pop(name + _PACKED), raw.pop(name + _SCALE))
    return raw


class K3Model(NamedTuple):
    """What an in-memory K3 conversion's check compares with (`InMemory.reference`)."""

    plain: "KimiK3ForCausalLM"  # the K3 model without AttnRes it was built from (the source of a retrofit)
    tensors: dict  # the tensors read (`read_k3_tensors`), for `verify_k3_tensors`


@torch.no_grad()
def verify_k3_tensors(model: AttnResForCausalLM, tensors: dict[str, torch.Tensor], layout: str) -> dict:
    """The imported model written back in K3's layout (`to_k3_state_dict`) against the tensors read: every one equal
    (compared in fp32, which holds each stored value exactly): `tensors_checked`, `tensors_not_written_back`,
    `max_abs_tensor_delta`, `tensors_identical`. No K3 code runs here, so this checks the mapping, not the forward
    (which `tests/test_k3.py` checks against an independent reference of K3's equations)."""
    # what K3's layout has a name for (another method's parameters, or AttnRes knobs K3 has not, are not K3's)
    back = to_k3_state_dict(model.state_dict(), model.config.backbone, layout, strict=False)
    checked = [name for name in tensors if name in back]
    delta = max((float((back[name].float() - tensors[name].float()).abs().max()) for name in checked), default=0.0)
    absent = sorted(set(tensors) - set(back))
    return {"tensors_checked": len(checked), "tensors_not_written_back": absent, "max_abs_tensor_delta": delta,
            "tensors_identical": delta == 0.0 and not absent}


class K3StreamSource(Source):
    """A K3 folder (`K3Source`) as a `sources.Source`: read tensor by tensor, K3's names mapped by
    `k3_layout.k3_parts`, pseudo-queries reshaped and `A_log` unpadded (`to_attnres_tensor`), the three convolutions
    concatenated, and each routed expert's weights read (MXFP4 ones dequantised by compressed-tensors, one expert at a
    time) when its row of the stacked `gate_up_proj` / `down_proj` is read; or loaded whole (`load_model`). Its
    trained routers are imported when the text config has `attn_res_block_size` (`block_size` is twice it)."""

    kind = "k3"

    def __init__(self, source: K3Source):
        safetensors = all(path.suffix == ".safetensors" for path in source.files)
        super().__init__(source.folder, source.backbone, list(source.files) if safetensors else None)
        self.k3, self.imported_routers, self.block_size = source, source.block_size is not None, source.block_size

    def described(self) -> str:
        return (f"a Kimi K3 AttnRes model (attn_res_block_size {self.block_size // 2} decoder layers = "
                f"attnres_block_size {self.block_size})")

    def check_tensors(self, overrides: dict) -> None:
        check_k3_tensors(self.k3, retrofit_config(self.config, **overrides))

    def load_model(self, overrides: dict, dtype: torch.dtype | str) -> InMemory:
        """The AttnRes model of the K3 checkpoint in fp32 (which holds every stored value exactly): the backbone
        through `KimiK3ForCausalLM` (`retrofit`), then K3's routers, each pseudo-query `[1, D]` as `[D]`. K3 keeps some
        tensors in fp32 inside its bf16 checkpoint: `"auto"` (the dtype holding most values) keeps each one's stored
        dtype, and a 16-bit `dtype` leaves K3's fp32 ones fp32 (as the model keeps them under any dtype): `kept`.

        Raises:
            ImportError: MXFP4 experts without compressed-tensors (`check_compressed_tensors`).
        """
        source = self.k3
        tensors = read_k3_tensors(source)
        state, _ = to_attnres_state_dict(tensors, source.backbone, source.layout)
        stored = {name: tensor.dtype for name, tensor in state.items()}
        state = {name: tensor.float() for name, tensor in state.items()}
        with torch.device("meta"):
            plain = backbones.k3.load().KimiK3ForCausalLM(source.backbone)  # (imported here: fla, transformers' GLM)
        plain.to_empty(device="cpu").float()
        plain.load_state_dict({n: t for n, t in state.items() if not is_depth_mixing_parameter(n)},
                              strict=not source.backbone.tie_word_embeddings)
        plain.tie_weights()
        if (source.folder / "generation_config.json").is_file():  # the source's stop tokens and defaults go along
            plain.generation_config = GenerationConfig.from_pretrained(source.folder)
        model = retrofit(plain.eval(), **overrides)
        if source.block_size is not None:
            model.load_state_dict({n: t for n, t in state.items() if is_depth_mixing_parameter(n)}, strict=False)
        if dtype == "auto":
            dtype = most_common_dtype(tensors.values())
            kept = {name: kept for name, kept in stored.items() if kept != dtype}
        else:
            kept = {name: kept for name, kept in stored.items() if kept == torch.float32 and dtype.itemsize < 4}
        return InMemory(model.eval(), K3Model(plain, tensors), dtype, kept)

    def verify(self, loaded: InMemory, input_ids: torch.Tensor) -> dict:
        """Every imported tensor written back in K3's layout against the checkpoint's (`verify_k3_tensors`), with the
        converted model's greedy continuation (its routers trained: no K3 runtime runs here to compare logits with);
        a retrofit of K3's architecture also against the K3 model it was built from (`verify_conversion`)."""
        model, tensors = loaded.model, loaded.reference.tensors
        if self.imported_routers:
            print(f"Checking every tensor written back against the checkpoint's (and a {input_ids.shape[1]}-token "
                  "greedy continuation) ...", flush=True)
            return (verify_k3_tensors(model, tensors, self.k3.layout) | continuation(model, input_ids)
                    | {"logits_compared": "no: no Kimi K3 runtime runs here; the forward is tested against an "
                                          "independent reference of K3's equations (attnres-hf's tests/test_k3.py)"})
        print(f"Verifying on {input_ids.shape[1]} probe tokens ...", flush=True)
        return verify_conversion(loaded.reference.plain, model, input_ids) | verify_k3_tensors(model, tensors,
                                                                                               self.k3.layout)

    def report_fields(self) -> dict:
        """Its layout, whether its routers were imported, whether its experts were MXFP4 and the `quantization_config`
        declaring them, and its text config (`attnres export --to k3-layout` writes them back: the config while the
        model's architecture is unchanged, MXFP4 experts while their values are MXFP4 values)."""
        return {"model_type": "kimi_k3", "unused_config_keys": [], "format": "k3", "layout": self.k3.layout,
                "imported_routers": self.imported_routers, "mxfp4_experts": self.k3.mxfp4,
                "k3_quantization_config": self.k3.quantization_config, "k3_text_config": self.k3.text_config}

    def _tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """`{K3 name: (shape, dtype)}` of the text tensors, each MXFP4 pair as its `.weight` (bfloat16)."""
        out = {}
        for name, entry in self.stored().items():
            if name.startswith(SKIPPED_PREFIXES) or name.endswith(_SCALE):
                continue
            if name.endswith(_PACKED):
                out[name.removesuffix(_PACKED) + ".weight"] = ((entry.shape[0], 2 * entry.shape[1]), torch.bfloat16)
            else:
                out[name] = (entry.shape, entry.dtype)
        return out

    def reads(self) -> dict[str, TensorRead]:
        if self.k3.mxfp4:
            check_compressed_tensors()
        stored, tensors, files = self.stored(), self._tensors(), {}

        def file(name: str) -> SafetensorsFile:  # each file's header read once
            path = stored[name].file
            if path not in files:
                files[path] = SafetensorsFile(path)
            return files[path]

        def load(name: str) -> torch.Tensor:  # one K3 tensor as stored (an MXFP4 one dequantised, bfloat16)
            base = name.removesuffix(".weight")
            if base + _PACKED not in stored:
                return file(name).read(name, file(name).dtype(name))
            return decode_mxfp4(file(base + _PACKED).read(base + _PACKED, torch.uint8),
                               file(base + _SCALE).read(base + _SCALE, torch.uint8))

        parts, _ = k3_parts(tensors, self.config, self.k3.layout)
        reads = {}
        for ours, (how, names) in parts.items():
            if how == "one":
                shape, _ = tensors[names]
                # the shape `to_attnres_tensor` gives (a pseudo-query reshaped, `A_log` unpadded; its shape checked)
                ours_shape = tuple(to_attnres_tensor(ours, torch.empty(shape, device="meta"), self.config, names).shape)
                read = TensorRead.stored(file(names), names)
                reads[ours] = read if ours_shape == tuple(shape) else read.mapped(
                    lambda t, o=ours, n=names: to_attnres_tensor(o, t, self.config, n))
            elif how == "cat":
                shapes = [tensors[name][0] for name in names]
                shape = (sum(s[0] for s in shapes), *shapes[0][1:])
                reads[ours] = TensorRead.whole(shape, tensors[names[0]][1], f"{self.path} ({', '.join(names)})",
                                               lambda n=names: torch.cat([load(name) for name in n]))
            else:
                shapes = [tensors[name][0] for name in names[0]]
                shape = (len(names), sum(s[0] for s in shapes), *shapes[0][1:])
                reads[ours] = TensorRead.stacked(shape, tensors[names[0][0]][1], f"{self.path} ({ours})",
                                                 lambda e, n=names: torch.cat([load(name) for name in n[e]]))
        return reads

    def checkpoint_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the text tensors' values (K3 keeps a few tensors fp32 in a bf16
        checkpoint; MXFP4 experts count as bfloat16, which holds them exactly)."""
        counts = {}
        for shape, dtype in self._tensors().values():
            if dtype is not None and dtype.is_floating_point:
                counts[dtype] = counts.get(dtype, 0) + int(torch.Size(shape).numel())
        return max(counts, key=counts.get, default=torch.float32)

    def kept_dtypes(self, dtype: torch.dtype, auto: bool) -> dict[str, torch.dtype]:
        """`auto`: every tensor in its stored dtype; a 16-bit `dtype`: K3's fp32 tensors stay fp32 (as the model keeps
        them under any dtype)."""
        if not auto and dtype.itemsize >= 4:
            return {}
        stored = {name: read.dtype for name, read in self.reads().items()}
        if auto:
            return {name: kept for name, kept in stored.items() if kept != dtype}
        return {name: kept for name, kept in stored.items() if kept == torch.float32}


__all__ = ["K3Model", "K3Source", "K3StreamSource", "K3_ONLY_FIELDS", "MXFP4_ARGS", "MXFP4_FORMAT", "PREFIXES",
           "check_compressed_tensors", "check_k3_tensors", "check_mxfp4_quantization", "is_family_folder",
           "is_k3_folder", "k3_source", "read_k3_tensors", "verify_k3_tensors"]
