"""Retrofit a pretrained model of a supported family (`SUPPORTED_MODEL_TYPES`: Llama, Mistral, Qwen2/3, SmolLM3,
Granite, Phi-3, Gemma2/3, ...) into AttnRes, exactly at conversion time.

Why it is exact (per family: `attnres_hf.modeling.backbones`): every reader of the residual stream of a supported
pre-norm model is a norm that is scale-invariant up to `eps`. With zero pseudo-queries an AttnRes router returns the *mean* of its sources, and the
sources (Full: embedding and every sub-layer output; Block: embedding and block sums, paper Eq. 6) partition the
residual sum. So copying every weight unchanged and zeroing the routers gives the same normalised inputs, the same
sub-layer outputs and the same logits: exactly when `eps = 0`, up to an `eps` effect otherwise. Retrofitted models
default to `attnres_rescale_output=True` (router output times its number of sources), which removes that `eps`
effect (max |delta logits| ~1e-4 instead of ~4e-2 on SmolLM2-135M); pass `attnres_rescale_output=False` for the
paper's plain mean.

The rest of the depth-mixing family is exact for the same reason or exactly by construction: each mixing module's
`reset_parameters()` is an initialisation under which the model *is* the residual model (DenseFormer: weight 1 on
the current state; MUDDFormer: static weights on the current layer, `w2 = 0`; DCA: GRN-v3 bias ones, `w = 0`; mHC:
equal streams, read weights summing to 1, `H_post = 1`; AttnRes knobs: zero queries / scalars, with the output
rescaled to the sum). The exception is `attnres_window`: a window drops sources, so no initialisation reproduces the
residual model and `retrofit` refuses it.
"""

import copy
import dataclasses
import difflib
import json
import os
import pickle
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from ..modeling import AttnResConfig, AttnResForCausalLM
from ..modeling.backbones import BACKBONES
from ..modeling.backbones_moe import dispatch_kda_by_device
from ..modeling.depth_mixing import MIXING_MODULES
from .families import attnres_config_fields, check_supported, map_keys
from .gguf_source import check_against_gguf, check_gguf_coverage, gguf_config_fields, gguf_stop_token_ids
from .hf_source import check_folder_tensors, folder_tensors, read_index, unused_config_keys

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: str | os.PathLike) -> Path:
    """Check that `path` is a readable, complete GGUF file; return it as a `Path`.

    Raises:
        FileNotFoundError: if it does not exist.
        ValueError: if it is not GGUF (wrong magic bytes), or is truncated or corrupt (its tensors overrun the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except Exception as error:  # GGUFReader raises struct/index/value errors on cut-off headers
        raise ValueError(f"{path} is a truncated or corrupt GGUF file ({type(error).__name__}: {error})") from None
    if end > path.stat().st_size:
        raise ValueError(f"{path} is a truncated GGUF file: tensors need {end} bytes, the file has {path.stat().st_size}")
    return path


def check_path_argument(value, name: str, optional: bool = False) -> None:
    """Raise `TypeError` unless `value` is a path (`str` / `os.PathLike`), or `None` when `optional`."""
    if optional and value is None:
        return
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, str) and not value:
        raise TypeError(f"{name} must be a non-empty path (str or os.PathLike), got {value!r}")


def check_max_shard_size(value) -> int:
    """`value` (a size such as `"5GB"`, read as `save_pretrained` reads it, or a number of bytes) in bytes.

    Raises:
        TypeError, ValueError: neither a size nor a number of bytes (one line).
    """
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise TypeError(f"max_shard_size must be a size such as '5GB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        return value
    from transformers.utils.hub import convert_file_size_to_int

    try:
        return convert_file_size_to_int(value)
    except ValueError:
        raise ValueError(f"max_shard_size must be a size such as '5GB' or '500MB', got {value!r}") from None


def check_output_folder(output_dir: str | os.PathLike, force: bool, *inputs: str | os.PathLike) -> Path:
    """The folder a command writes (`staged_folder`), checked before any work: it may exist only with `force` and
    only as a folder, and may not hold the current folder or any of `inputs` (replacing it would delete them).

    Raises:
        FileExistsError: it exists without `force`, or is a file. ValueError: it holds the current folder or an input.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not force:
        raise FileExistsError(f"{output_dir} already exists; pass --force to replace it")
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir} is a file, not a folder; choose another output folder")
    target = output_dir.resolve()
    if any(target == p or target in p.parents for p in (Path.cwd().resolve(), *(Path(i).resolve() for i in inputs))):
        raise ValueError(f"{output_dir} contains the current folder or the source; choose another output folder")
    return output_dir


def split_gguf_path(source: str | os.PathLike, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """`(folder, gguf_file)` for transformers' loaders: a `.gguf` path is split into its folder and file name."""
    check_path_argument(source, "source")
    if gguf_file is not None and (not isinstance(gguf_file, str) or not gguf_file):
        raise TypeError(f"gguf_file must be the GGUF file name inside the source folder (a str), got {gguf_file!r}")
    path = Path(source)
    if gguf_file is None and path.suffix == ".gguf":
        return path.parent, path.name
    return path, gguf_file


def _check_safetensors(path: Path) -> None:
    try:
        with safe_open(path, "pt"):  # reads the header and checks the file covers every tensor it lists
            pass
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is a truncated or corrupt safetensors file ({error})") from None


ZIP_MAGIC = b"PK\x03\x04"
LEGACY_TORCH_MAGIC = b"\x8a\n" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
"""The first pickled object of a legacy (pre-1.6) `torch.save` file: torch's magic number as a long."""


def _is_legacy_torch_pickle(start: bytes) -> bool:
    """Whether `start` (a file's first bytes) opens a legacy `torch.save` pickle: the pickle protocol header (2 by
    default, any `pickle_protocol` >= 2 that `torch.save` was given), a protocol-4+ frame header, then the magic."""
    if len(start) < 2 or start[0] != 0x80 or start[1] < 2:
        return False
    body = start[11:] if start[1] >= 4 and start[2:3] == b"\x95" else start[2:]  # FRAME opcode + 8-byte length
    return body.startswith(LEGACY_TORCH_MAGIC)


def _first_line(error: Exception, limit: int = 200) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def check_torch_file(path: str | os.PathLike) -> Path:
    """Check that `path` is a complete, intact PyTorch `.bin` state dict, as `torch.save` writes it; return it as a
    `Path`. Nothing in it runs: a `torch.save` zip archive is checked record by record against its CRC-32 checksums
    (a flipped byte in a tensor loads silently otherwise) and its pickle is read by `torch.load(weights_only=True,
    map_location="meta")`, which builds no tensor data and refuses anything but tensors and plain containers; a
    legacy (pre-1.6, not zip) pickle has no checksums and is read the same way, which finds a cut-off file.

    Raises:
        FileNotFoundError: if it does not exist. ValueError: a truncated or corrupt file (naming the failing record),
            a file that is not a PyTorch checkpoint, or one whose pickle holds more than tensors (transformers loads
            `.bin` files with `weights_only=True` and would refuse it) or no state dict.
    """
    import zipfile
    import zlib

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"PyTorch weight file not found: {path}")
    with path.open("rb") as handle:
        start = handle.read(64)
    head = start[:16]
    if not head:
        raise ValueError(f"{path} is empty: a truncated PyTorch checkpoint")
    zipped = head.startswith(ZIP_MAGIC)
    if start.startswith(b"version https://git-lfs"):
        raise ValueError(f"{path} is a Git LFS pointer, not the weights: fetch them (git lfs pull)")
    if not zipped and not _is_legacy_torch_pickle(start):
        raise ValueError(f"{path} is not a PyTorch checkpoint: neither a torch.save zip archive nor a legacy torch "
                         f"pickle (its first bytes are {head[:8]!r})")
    if zipped:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()  # reads every record and compares its CRC-32
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, ValueError) as error:
            reason = ("its zip directory is missing: the file is cut off" if "not a zip file" in str(error)
                      else f"its zip archive is unreadable: {_first_line(error)}")
            raise ValueError(f"{path} is a truncated or corrupt PyTorch checkpoint ({reason})") from None
        if bad is not None:
            raise ValueError(f"{path} is a corrupt PyTorch checkpoint: its record {bad} fails its CRC-32 check "
                             "(damaged bytes); download or save it again")
    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's reason follows "WeightsUnpickler error:", on its line or the next non-empty one
        _, marker, after = str(error).partition("WeightsUnpickler error:")
        lines = [line.strip() for line in after.splitlines() if line.strip()]
        reason = lines[0] if marker and lines else _first_line(error)
        raise ValueError(f"{path} holds more than tensors: torch.load(weights_only=True), as transformers loads "
                         f".bin files, refuses it ({reason}); re-save its state dict with safetensors") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as error:
        kind = "checkpoint" if zipped else "checkpoint (legacy format, which has no checksums)"
        raise ValueError(f"{path} is a truncated or corrupt PyTorch {kind} ({_first_line(error)})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict (a mapping of names to tensors)")
    others = [f"{k}: {type(v).__name__}" for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise ValueError(f"{path} is not a state dict of tensors: {', '.join(others[:4])}")
    return path


def _check_shards(folder: Path, index: Path, check_file) -> list[Path]:
    """Check each file that the index `index` maps weights to with `check_file`; return them."""
    shards = sorted(set(read_index(index).values()))
    for shard in shards:
        if not (folder / shard).is_file():
            raise FileNotFoundError(f"{index} lists {shard}, which is missing from {folder}")
        check_file(folder / shard)
    return [folder / shard for shard in shards]


def _check_folder(folder: Path) -> tuple[list[Path], Path | None]:
    """Check an HF folder's config and weight files (headers only) before anything loads; return the weight files
    transformers will load and their index (`None` for a single file)."""
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist: pass an HF model folder or a .gguf file")
    if not folder.is_dir():
        raise ValueError(f"{folder} is neither a model folder nor a .gguf file")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        json.loads((folder / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON ({error}); re-save the model") from None
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise FileNotFoundError(f"{folder} has no model weights (looked for {', '.join(WEIGHT_FILES)})")
    # the files transformers will load, in its order of preference (WEIGHT_FILES)
    if (folder / "model.safetensors").is_file():
        _check_safetensors(folder / "model.safetensors")
        return [folder / "model.safetensors"], None
    if (folder / "model.safetensors.index.json").is_file():
        index = folder / "model.safetensors.index.json"
        return _check_shards(folder, index, _check_safetensors), index
    if (folder / "pytorch_model.bin").is_file():
        return [check_torch_file(folder / "pytorch_model.bin")], None
    index = folder / "pytorch_model.bin.index.json"
    return _check_shards(folder, index, check_torch_file), index


def _family_config(folder: Path):
    """The config of a folder of a family transformers' Auto classes do not know (`kimi_k3`: its own
    `save_pretrained`), read with the family's own config class; `None` for every other folder."""
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type in CONFIG_MAPPING_NAMES or model_type not in BACKBONES:
        return None
    return BACKBONES[model_type].config_class.from_pretrained(folder)


def load_source_config(source: str | os.PathLike, gguf_file: str | None = None):
    """Read the source's config and check its family is supported, without loading weights.

    `source` is an HF folder, or a `.gguf` file (or a folder plus `gguf_file`). Raises `FileNotFoundError`,
    `ValueError` (not GGUF / truncated), or `UnsupportedSourceError` (a `ValueError`) before anything heavy runs. The
    source's tensors must be the weights of the model its config builds (read from the headers, see
    `hf_source.check_folder_tensors` and `gguf_source.check_gguf_coverage`: a `ValueError` names the weights no tensor
    holds, the tensors no weight takes, those of another shape, and a sharded index that disagrees with its shards);
    `config.json` keys the family's config class does not use are named in a `UserWarning`
    (`hf_source.unused_config_keys`).
    """
    path, gguf_file = split_gguf_path(source, gguf_file)
    if gguf_file is not None:
        gguf_path = check_gguf_file(path / gguf_file)
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
        check_supported(config)
        # fields transformers' GGUF mapping leaves out (biases, head_dim), and every tensor must have a home
        for name, value in gguf_config_fields(gguf_path, config).items():
            setattr(config, name, value)
        check_gguf_coverage(gguf_path, config)
        return config
    files, index = _check_folder(path)
    try:
        config = _family_config(path) or AutoConfig.from_pretrained(path)
    except (KeyError, ValueError) as error:  # e.g. a model_type transformers does not know
        raise ValueError(f"{path / 'config.json'} cannot be read as a transformers config ({error})") from None
    check_supported(config)
    unused = unused_config_keys(path / "config.json", config)
    if unused:  # reported, not refused: many real configs carry keys of other tools (e.g. transformers.js_config)
        warnings.warn(f"{path / 'config.json'} has keys that {type(config).__name__} and its model do not use "
                      "(ignored): "
                      f"{', '.join(unused)}", UserWarning, stacklevel=2)
    # every weight of the model the config builds has its tensor in the files, and every tensor a weight
    check_folder_tensors(config, folder_tensors(files, index), path)
    return config


def load_source(
    source: str | os.PathLike, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
    verify_all: bool = False, *, config=None,
) -> PreTrainedModel:
    """Load a causal LM of a supported family (`SUPPORTED_MODEL_TYPES`) from an HF folder or a GGUF file (families with
    a `GGUF_ARCHITECTURES` entry) in `dtype`, or with `"auto"` in the dtype transformers' `from_pretrained` reads
    from the checkpoint.

    The family and files are checked first (see `load_source_config`). A GGUF file is dequantised by transformers'
    GGUF loader with the config completed from the file, then its weights are compared with the file's own tensors
    (`check_against_gguf`, in fp32): every tensor of the file is in the model, or a `ValueError` names it; the values
    of a sample of tensors (every kind, in the first and last block: `sampled_gguf_tensors`) are compared, of every
    tensor with `verify_all` (each dequantised on the CPU: minutes for a large file). The GGUF
    model's generation config stops on every end token of the file (`gguf_stop_token_ids`), as llama.cpp does.

    `config`: what `load_source_config(source, gguf_file)` returned, where the caller has it (reading a GGUF file's
    config parses the whole file: ~10 s for SmolLM2's on 2 cores); read here when `None`. A Kimi Linear model's KDA
    takes fla's kernels on CUDA tensors only (`backbones_moe.dispatch_kda_by_device`): it runs on the CPU too.
    """
    dtype = check_dtype(dtype, auto=True)
    if not isinstance(verify_all, bool):
        raise TypeError(f"verify_all must be True or False, got {verify_all!r}")
    config = load_source_config(source, gguf_file) if config is None else config
    path, gguf_file = split_gguf_path(source, gguf_file)
    try:
        if gguf_file is None:
            family = _family_config(path)  # a family transformers does not have (kimi_k3)
            causal_lm = BACKBONES[family.model_type].causal_lm if family is not None else AutoModelForCausalLM
            return dispatch_kda_by_device(causal_lm.from_pretrained(path, dtype=dtype)).eval()
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, config=config,
                                                     dtype="auto" if dtype == "auto" else torch.float32)
    except (SafetensorError, EOFError, pickle.UnpicklingError) as error:  # truncated or corrupt weight files
        raise ValueError(f"{path}: the weights cannot be read, the file is truncated or corrupt ({error})") from None
    check_against_gguf(model, path / gguf_file, complete=True, sample=not verify_all, progress=verify_all)
    stop = gguf_stop_token_ids(path / gguf_file)
    if stop:  # transformers' GGUF loader reads the eos id only; llama.cpp stops on every one
        model.generation_config.eos_token_id = stop if len(stop) > 1 else stop[0]
    return (model if dtype == "auto" else model.to(dtype)).eval()


def check_dtype(dtype, auto: bool = False) -> torch.dtype | str:
    """`dtype` (a `torch.dtype` or its name) as a floating point `torch.dtype`, else a one-line `ValueError`; with
    `auto`, also transformers' `"auto"` (returned as is: the checkpoint's dtype, from its config, else its weights)."""
    if auto and isinstance(dtype, str) and dtype == "auto":
        return dtype
    given = dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if not dtype.startswith("_") else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        also = "'auto' or " if auto else ""
        raise ValueError(f"dtype must be {also}a floating point torch dtype such as float32 or bfloat16, got {given!r}")
    if dtype.itemsize < 2:  # torch's float8 kinds: storage types, whose matmuls CPU and most GPUs do not run
        raise ValueError(f"dtype {given!r} is a float8 storage type, which a model cannot compute in: load float8 "
                         f"weights with a quantization config (e.g. transformers' FineGrainedFP8Config)")
    return dtype



def check_representable(name: str, values: torch.Tensor, dtype: torch.dtype, where: str | os.PathLike = "") -> None:
    """Before `values` (any float dtype) are written as `dtype`: a one-line `ValueError` naming tensor `name` when a
    finite value of it is beyond `dtype`'s range (it would be written as inf: a float16 output of a bf16 or fp32
    checkpoint with outliers above 65504), else nothing. Integer and equal-or-wider dtypes pass unchecked."""
    if not (values.is_floating_point() and dtype.is_floating_point) or torch.finfo(dtype).max >= torch.finfo(
            values.dtype).max:
        return
    finite = values[torch.isfinite(values)]
    largest = finite.abs().max().item() if finite.numel() else 0.0
    if largest > torch.finfo(dtype).max:
        raise ValueError(f"{where}{': ' if where else ''}tensor {name} holds values up to {largest:.4g}, beyond "
                         f"{str(dtype).removeprefix('torch.')}'s range ({torch.finfo(dtype).max:g}): they would be "
                         "written as inf; convert to bfloat16 or float32")

_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(AttnResConfig))


def _check_overrides(config_overrides: dict) -> None:
    unknown = sorted(set(config_overrides) - _CONFIG_FIELDS)
    if unknown:
        hints = [difflib.get_close_matches(name, _CONFIG_FIELDS, n=1) for name in unknown]
        hint = "".join(f"; did you mean {h[0]!r} for {n!r}?" for n, h in zip(unknown, hints) if h)
        raise ValueError(f"unknown AttnResConfig field(s) {', '.join(map(repr, unknown))}{hint}")


def retrofit_config(source_config, **config_overrides) -> AttnResConfig:
    """The `AttnResConfig` a retrofit of a model with `source_config` gets: the source's architecture, the rescaled
    router output (exact at conversion time), then `config_overrides`. Raises `ValueError` on invalid overrides and
    `UnsupportedSourceError` on an unsupported source, before any weight is touched."""
    _check_overrides(config_overrides)
    fields = attnres_config_fields(source_config)
    fields |= {"attnres_rescale_output": True, "architectures": ["AttnResForCausalLM"]}
    config = AttnResConfig(**(fields | config_overrides), attn_implementation=source_config._attn_implementation)
    if config.depth_mixing == "attnres" and config.attnres_window is not None:
        raise ValueError(
            "attnres_window drops all but the most recent sources, so no initialisation reproduces the residual "
            "model: a retrofit with it would not compute the source's logits (train such a model from scratch)"
        )
    return config


def serializable_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain copy of a GGUF-loaded model that `save_pretrained` accepts.

    transformers marks a model loaded from GGUF with a quantizer and refuses to save it ("The model is quantized
    with gguf and is not serializable"), although its weights are dequantised. The copy is the same class, built
    from the config without `quantization_config`, holding the same weights and generation config (the file's stop
    tokens, see `load_source`).
    """
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config).to(model.dtype)
    plain.load_state_dict(model.state_dict())
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def retrofit(
    source: PreTrainedModel | str | os.PathLike,
    gguf_file: str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: bool = False,
    **config_overrides,
) -> AttnResForCausalLM:
    """Turn a pretrained residual model into an `AttnResForCausalLM` that computes the same logits.

    Args:
        source: a `PreTrainedModel` of a supported family (a GGUF-loaded one too), an HF folder, or a
            `.gguf` file (or a folder with `gguf_file`).
        dtype: dtype of the result (`torch.float32` when loading from disk; the source's dtype otherwise); `"auto"`:
            the source's, read from disk as transformers' `from_pretrained(dtype="auto")` reads it.
        progress: print a line before the weights are copied.
        **config_overrides: `AttnResConfig` fields, e.g. `depth_mixing="residual"` / `"denseformer"` /
            `"muddformer"` / `"dca"` / `"mhc"`, `attnres_block_size=1` (Full AttnRes; default about 8 blocks),
            `attnres_rescale_output=False` (the paper's plain mean), an AttnRes ablation knob.

    Returns:
        The AttnRes model in eval mode, with every backbone weight copied unchanged, every depth-mixing module at
        its residual-model initialisation (AttnRes: zero pseudo-queries) and a copy of the source's generation config
        (its stop tokens: generation stops where the source's stops).

    Raises:
        UnsupportedSourceError (a `ValueError`): unsupported `model_type` or a feature such as MoE layers.
        KeyError: a source weight the family's key table does not map.
        ValueError: invalid or unknown config overrides (incl. `attnres_window`, which cannot be exact), a bad
            `dtype`, a malformed / truncated GGUF, safetensors or PyTorch `.bin` file (`check_torch_file`), a GGUF
            tensor the model would drop, an HF folder whose tensors do not cover the model its config builds (see
            `load_source_config`).
        TypeError: `source` is neither a model nor a path, or `progress` is not a bool.
        FileNotFoundError: a missing path, or a folder without config or weights.
    """
    if not isinstance(source, PreTrainedModel):
        check_path_argument(source, "source (a PreTrainedModel, an HF folder or a .gguf file)")
    if dtype is not None:
        dtype = check_dtype(dtype, auto=True)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    if not isinstance(source, PreTrainedModel):
        # check the family, the files and the options before any weight loads
        retrofit_config(load_source_config(source, gguf_file), **config_overrides)
        source = load_source(source, gguf_file, dtype=dtype or torch.float32)
    elif gguf_file is not None:
        raise ValueError("gguf_file applies to a source path, not to an in-memory model")
    config = retrofit_config(source.config, **config_overrides)

    # source names -> AttnRes names (identity for every supported family; an unmapped key raises KeyError)
    mapped = map_keys(source.config, list(source.state_dict()))
    state = {mapped[key]: tensor for key, tensor in source.state_dict().items()}
    dtype = next(source.parameters()).dtype if dtype is None or dtype == "auto" else dtype
    with torch.device("meta"):  # no random init: every weight is copied or set below
        model = AttnResForCausalLM(config)
    model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():  # non-persistent buffers (rotary frequencies, Gemma's embed_scale) are in no state dict:
        for module in model.modules():  # the family's own initialisation computes them (in fp32)
            if module._non_persistent_buffers_set:
                model._init_weights(module.float())
    model.tie_weights()
    targets = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(targets[k].shape)}" for k, v in state.items()
             if k in targets and targets[k].shape != v.shape]
    if wrong:
        raise ValueError(f"source and AttnRes shapes differ: {', '.join(wrong[:4])}")
    mixing = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if isinstance(module, MIXING_MODULES):  # the residual-model initialisation of each method (exact)
                module.reset_parameters(config.initializer_range)
                mixing |= {f"{module_name}.{name}" for name, _ in module.named_parameters()}
    if progress:
        print(f"Copying {len(state)} tensors into AttnResForCausalLM ...", flush=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [key for key in missing if key not in mixing]
    if unexpected:  # a source weight the AttnRes config has no place for (e.g. a bias the config turned off)
        raise KeyError(f"{source.config.model_type} checkpoint weights with no AttnRes parameter: "
                       f"{', '.join(unexpected[:8])}")
    if missing:  # would keep uninitialised memory
        raise KeyError(f"{source.config.model_type} checkpoint has no weight for {', '.join(missing[:8])}")
    if getattr(source, "generation_config", None) is not None:
        # the source's own: every stop token it declares (a generation_config.json's eos list, a GGUF file's eot/eom,
        # see `load_source`), where the model config holds one id; sampling defaults too
        model.generation_config = copy.deepcopy(source.generation_config)
    return model.eval()
