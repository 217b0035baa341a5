"""flash-linear-attention checkpoints as sources: an fla `TransformerForCausalLM` folder (`model_type: "transformer"`)
read into an AttnRes model, every tensor mapped (`fla_layout.FLA_KEY_MAP`) or the folder refused before anything
loads, and the result checked against fla's own model.

With `attnres_block_size` set in fla's config the checkpoint is an AttnRes model already: its trained pseudo-queries
and key norms are imported, with fla's block size and `attnres_rescale_output=False` (fla does not rescale), and
nothing else may change. Unset, it is a plain residual transformer and converts as any other source does (a retrofit:
zero routers, any block size or depth-mixing method).
"""

import importlib
import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ..modeling import AttnResConfig, AttnResForCausalLM
from ..modeling.depth_mixing import is_depth_mixing_parameter
from .families import UnsupportedSourceError
from .fla_layout import FLA_MODEL_TYPE, backbone_from_fla, fla_block_size, to_attnres_name, to_attnres_tensor
from .hf_source import _quiet_transformers, _shown, folder_tensors
from .retrofit import _check_folder, retrofit, retrofit_config
from .sources import InMemory, SafetensorsFile, Source, TensorRead, stored_tensors
from .verify import verify_conversion

EXACT_TOLERANCE = 1e-4
"""`exact` in a report: max |delta logits| at most this times max |logits| (fp32), and the same top token everywhere.
fp32 runs of the same function through different kernels differ by ~1e-6 of the logits' scale on the tiny models of
the tests (measured: tests/test_fla.py); a wrong tensor or option moves them by far more."""


class FlaSource(NamedTuple):
    folder: Path
    fields: dict  # fla's config.json
    backbone: object  # the transformers config (Llama / Mistral / Qwen2 / Qwen3) that computes fla's backbone
    block_size: int | None  # fla's attnres_block_size: None for a plain transformer
    files: list  # the weight files transformers would load, checked
    index: Path | None


def is_fla_folder(source) -> bool:
    """Whether `source` is a folder whose `config.json` says `model_type: "transformer"` (fla's transformer)."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).is_dir():
        return False
    try:
        return json.loads((Path(source) / "config.json").read_text()).get("model_type") == FLA_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def fla_installed() -> bool:
    """Whether flash-linear-attention is importable (its own model then checks conversions and exports)."""
    return importlib.util.find_spec("fla") is not None


def check_fla_installed() -> str:
    """fla's version; it is needed to check a conversion against fla's own model.

    Raises:
        ImportError: flash-linear-attention (or the Triton it imports) is missing.
    """
    if not fla_installed():
        raise ImportError('reading an fla checkpoint checks it against fla\'s own model, which needs '
                          'flash-linear-attention: pip install "attnres-hf[fla]"')
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-linear-attention")
    except PackageNotFoundError:
        return version("fla-core")


def fla_source(folder: str | os.PathLike) -> FlaSource:
    """Read and check an fla folder's config and weight files (headers only).

    Raises:
        FileNotFoundError, ValueError: a missing folder, config or weights; a truncated or corrupt weight file.
        UnsupportedSourceError (a `ValueError`): naming every fla option that has no exact counterpart
            (`fla_layout.backbone_from_fla`).
    """
    folder = Path(folder)
    files, index = _check_folder(folder)
    fields = json.loads((folder / "config.json").read_text())
    if not isinstance(fields, dict):
        raise ValueError(f"{folder / 'config.json'} is not a JSON object")
    backbone, problems = backbone_from_fla(fields)
    if problems:
        raise UnsupportedSourceError(f"{folder}: this fla transformer has no exact attnres-hf counterpart: "
                                     f"{'; '.join(problems)}")
    try:  # (the field checks above leave transformers' own validation little to find)
        config = AutoConfig.for_model(**backbone)
    except Exception as error:  # huggingface_hub's strict-dataclass validation errors are no ValueError
        raise UnsupportedSourceError(f"{folder / 'config.json'}: the backbone config it gives is invalid "
                                     f"({type(error).__name__}: {str(error).strip().splitlines()[0]})") from None
    return FlaSource(folder, fields, config, fla_block_size(fields.get("attnres_block_size")), files, index)


def check_fla_tensors(source: FlaSource, config: AttnResConfig) -> dict[str, str]:
    """Before loading: every tensor of the folder has attnres-hf's name and shape, and the files fill every weight of
    `config`'s model (the AttnRes ones too when fla's model has AttnRes); returns `{fla name: attnres-hf name}`.

    Raises:
        ValueError: naming the tensors with no counterpart, those of another shape, and the weights no tensor holds
            (an AttnRes checkpoint whose routers some layers lack is refused, not filled with zeros).
    """
    tensors = folder_tensors(source.files, source.index)
    names = {name: to_attnres_name(name) for name in tensors}
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in AttnResForCausalLM(config).state_dict().items()
                    if source.block_size is not None or not is_depth_mixing_parameter(name)}
    problems = []
    unnamed = sorted(name for name, ours in names.items() if ours is None or ours not in expected)
    if unnamed:
        problems.append(f"tensors with no place in the model: {_shown(unnamed)}")
    shapes = [f"{name} {tuple(tensors[name].shape)}" for name, ours in names.items() if ours in expected
              and tuple(to_attnres_tensor(ours, tensors[name]).shape) != expected[ours]]
    if shapes:
        problems.append(f"tensors of another shape than config.json gives: {_shown(sorted(shapes))}")
    missing = set(expected) - set(names.values())
    if source.backbone.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        routers = sorted(name for name in missing if is_depth_mixing_parameter(name))
        if routers:
            problems.append(f"AttnRes tensors missing (fla's config says attnres_block_size {source.block_size}): "
                            f"{_shown(routers)}")
        rest = sorted(missing - set(routers))
        if rest:
            problems.append(f"no tensor for {_shown(rest)}")
    if problems:
        raise ValueError(f"{source.folder}: the weight files do not match the fla transformer its config.json builds; "
                         f"{'; '.join(problems)}")
    return {name: ours for name, ours in names.items()}


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for path in files:
        state |= load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    return state


def checkpoint_dtype(source: FlaSource) -> torch.dtype:
    """The dtype of the fla checkpoint as transformers' `from_pretrained(dtype="auto")` reads it: its config's
    `dtype` (or legacy `torch_dtype`), else the widest floating dtype of its tensors (fla keeps `qk_norm`'s norms in
    fp32 in a bf16 model), read from the files' headers (`.bin` pickles on the meta device)."""
    named = source.fields.get("dtype") or source.fields.get("torch_dtype")
    if isinstance(named, str) and isinstance(getattr(torch, named.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, named.removeprefix("torch."))
    dtypes = set()
    for path in source.files:
        if path.suffix == ".safetensors":
            dtypes |= {entry.dtype for entry in stored_tensors([path]).values() if entry.dtype is not None}
        else:
            dtypes |= {tensor.dtype for tensor in torch.load(path, map_location="meta", weights_only=True).values()}
    dtypes = {dtype for dtype in dtypes if dtype.is_floating_point}
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).bits, default=torch.float32)


class FlaStreamSource(Source):
    """An fla folder (`FlaSource`) as a `sources.Source`: read tensor by tensor, fla's names mapped by
    `fla_layout.FLA_KEY_MAP` and each pseudo-query `[1, D]` read as `[D]`, or loaded whole (`load_model`) and checked
    against fla's own model (`verify_against_fla`); its trained routers imported when fla's config has
    `attnres_block_size` (`block_size`)."""

    kind = "fla"

    def __init__(self, source: FlaSource):
        safetensors = all(path.suffix == ".safetensors" for path in source.files)
        super().__init__(source.folder, source.backbone, list(source.files) if safetensors else None)
        self.fla, self.imported_routers, self.block_size = source, source.block_size is not None, source.block_size
        self.names = None  # {fla name: attnres-hf name}, from `check_tensors`

    def described(self) -> str:
        return f"an fla AttnRes model (attnres_block_size {self.block_size})"

    def check_tensors(self, overrides: dict) -> None:
        self.names = check_fla_tensors(self.fla, retrofit_config(self.config, **overrides))

    def reads(self) -> dict[str, TensorRead]:
        reads, files = {}, {}
        for name, entry in self.stored().items():
            ours = to_attnres_name(name)
            if ours is None or entry.dtype is None:  # (`check_fla_tensors` refused the first)
                continue
            if entry.file not in files:  # each file's header read once
                files[entry.file] = SafetensorsFile(entry.file)
            read = TensorRead.stored(files[entry.file], name)
            # a `[1, D]` pseudo-query is ours `[D]`: read whole and reshaped; every other tensor as it is stored
            reshaped = read.mapped(lambda t, o=ours: to_attnres_tensor(o, t))
            reads[ours] = read if reshaped.shape == tuple(entry.shape) else reshaped
        return reads

    def checkpoint_dtype(self) -> torch.dtype:
        return checkpoint_dtype(self.fla)

    def load_model(self, overrides: dict, dtype: torch.dtype | str) -> InMemory:
        """The AttnRes model of the fla checkpoint (`overrides` from `overrides`, its tensors checked by
        `check_tensors`), in fp32, which holds every stored value exactly (bf16, fp16 and mixed checkpoints alike):
        the backbone through a transformers model of its family (`retrofit`), then fla's routers, each pseudo-query
        `[1, D]` as `[D]`. `dtype` `"auto"` is the checkpoint's (`checkpoint_dtype`).

        Raises:
            ImportError: flash-linear-attention is not installed (`check_fla_installed`: the check needs fla's model).
        """
        check_fla_installed()
        source, names = self.fla, self.names or check_fla_tensors(self.fla, retrofit_config(self.config, **overrides))
        state = {names[name]: to_attnres_tensor(names[name], tensor).float()
                 for name, tensor in _read_tensors(source.files).items()}
        backbone_state = {name: tensor for name, tensor in state.items() if not is_depth_mixing_parameter(name)}
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(source.backbone)
        plain.to_empty(device="cpu").float()
        with torch.no_grad():  # rotary frequencies: in no state dict, computed by the family's own initialisation
            for module in plain.modules():
                if module._non_persistent_buffers_set:
                    plain._init_weights(module)
        plain.load_state_dict(backbone_state, strict=not source.backbone.tie_word_embeddings)
        plain.tie_weights()
        if (source.folder / "generation_config.json").is_file():
            plain.generation_config = GenerationConfig.from_pretrained(source.folder)
        model = retrofit(plain.eval(), **overrides)
        if source.block_size is not None:
            routers = {name: tensor for name, tensor in state.items() if is_depth_mixing_parameter(name)}
            model.load_state_dict(routers, strict=False)
        return InMemory(model.eval(), None, self.checkpoint_dtype() if dtype == "auto" else dtype, {})

    def verify(self, loaded: InMemory, input_ids: torch.Tensor) -> dict:
        """`loaded.model` against fla's own model of the folder (`verify_against_fla`)."""
        print(f"Verifying on {input_ids.shape[1]} probe tokens ...", flush=True)
        return verify_against_fla(self.path, loaded.model, input_ids)

    def report_fields(self) -> dict:
        """Whether the routers were imported, and fla's whole `config.json` (its kernel options too; `attnres export
        --to fla` writes it back while the model's architecture is unchanged)."""
        return {"model_type": self.fla.fields["model_type"], "unused_config_keys": [], "format": "fla",
                "imported_routers": self.imported_routers, "fla_config": self.fla.fields}


@torch.no_grad()
def verify_against_fla(folder: str | os.PathLike, model: AttnResForCausalLM, input_ids: torch.Tensor,
                       new_tokens: int | None = None, rounded_to: dict | None = None) -> dict:
    """Compare `model` (fp32) with fla's own `TransformerForCausalLM` loaded from `folder` in fp32 on the CPU, its
    CUDA-only kernels replaced by fla's reference functions (`fla_cpu.fla_reference_kernels`): `verify_conversion`'s
    numbers, plus `compared_with`, `relative_max_abs_logit_delta` (over max |logits|) and `exact`
    (`EXACT_TOLERANCE`).

    `new_tokens` given (a streamed conversion): both models offloaded to disk instead, `model` an `offloaded.offloaded`
    model of the written folder and fla's read from `folder`'s own files the same way (one module's weights resident
    at a time), compared in `verify_offloaded_conversion`'s forwards with `new_tokens` greedy tokens; `rounded_to`:
    `{fla tensor name: dtype}` of fla's weights read rounded to the dtype the conversion wrote them in (`offloaded`),
    so that a conversion into a narrower dtype compares the conversion, not the rounding, as the in-memory check does."""
    from .fla_cpu import fla_reference_kernels
    from .offloaded import offloaded
    from .verify import verify_offloaded_conversion

    version = check_fla_installed()
    with fla_reference_kernels() as replaced, _quiet_transformers(), warnings.catch_warnings():
        # fla 0.6 under transformers 5.x: deprecation notices about `past_key_values` on every generate
        warnings.simplefilter("ignore", FutureWarning)
        importlib.import_module("fla.models")  # registers fla's config and model classes with the Auto classes
        # fla 0.6's cached generate is wrong under transformers 5.24, even without AttnRes: generate hands the cache
        # over as `cache=`, which fla's forward ignores, so each step sees its new token alone. Its uncached
        # continuation equals a greedy loop of full forwards (measured), and is the reference here.
        if new_tokens is None:
            reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            result = verify_conversion(reference, model, input_ids, source_use_cache=False)
        else:
            fla_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(folder))]
            # (its decoder layer reads its routers' weights without calling them: loaded whole at its forward)
            with offloaded(folder, fla_class, rounded_to=rounded_to,
                           preload=list(fla_class._no_split_modules or ())) as reference:
                result = verify_offloaded_conversion(reference, model, input_ids, new_tokens, source_use_cache=False)
    relative = result["max_abs_logit_delta"] / max(result["source_max_abs_logit"], 1e-12)
    result |= {
        "compared_with": {"model": f"fla {type(reference).__name__} (flash-linear-attention {version})",
                          "device": "cpu" if new_tokens is None else "cpu, offloaded to disk", "dtype": "float32",
                          "kernels_replaced": replaced,
                          "continuation": "fla's greedy tokens without a KV cache (its cached generate ignores the "
                                          "cache under transformers 5.x); the converted model's "
                                          + ("with one" if new_tokens is None else "teacher-forced (greedy_check)")},
        "relative_max_abs_logit_delta": relative,
        "exact": bool(relative <= EXACT_TOLERANCE and result["argmax_agreement"] == 1.0),
    }
    return result
