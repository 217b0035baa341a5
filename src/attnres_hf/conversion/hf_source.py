"""HF-folder sources: before any weight loads, the folder's tensors must be the weights of the model its config builds.

transformers' `from_pretrained` initialises every weight the files lack at random and drops every tensor the model has
no place for, with a logged warning only: a `config.json` saying 32 layers over safetensors holding 30 loads, its two
extra layers random, the retrofit copies them, and the exactness check compares two equally wrong models. So
`check_folder_tensors` reads the tensor names and shapes from the files' headers (safetensors headers; `.bin` pickles on
the meta device; every shard of an index, which must agree with the shards) and runs transformers' own key renaming
and weight conversions (`convert_and_load_state_dict_in_model`, e.g. per-expert MoE tensors fused into
`gate_up_proj`) into the model built on the meta device, as `from_pretrained` would: no weight data is read. The GGUF
path has the same check (`gguf_source.check_gguf_coverage`).

`unused_config_keys` finds the keys of `config.json` that the family does not use, which transformers keeps or drops
without a word (a misspelt `num_hiden_layers`, a legacy `rope_theta` that `rope_parameters` overrides).
"""

import contextlib
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def read_index(index: Path) -> dict[str, str]:
    """The `weight_map` (`{tensor name: shard file name}`) of a sharded checkpoint's index file.

    Raises:
        ValueError: the file is not JSON with a `weight_map` of names to file names, or it lists a tensor twice in
            two shards (a hand-merged index; a JSON reader keeps one of the two silently), naming it and both.
    """
    twice = []

    def pairs(items: list) -> dict:  # each JSON object's keys in order: a key given twice is seen here only
        out = {}
        for key, value in items:
            if key in out and out[key] != value:
                twice.append((out, f"{key} ({out[key]}, {value})"))
            out[key] = value
        return out

    try:
        weight_map = json.loads(index.read_text(), object_pairs_hook=pairs)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index} is not a valid weight index ({type(error).__name__}: {error})") from None
    twice = [entry for where, entry in twice if where is weight_map]
    if twice:
        raise ValueError(f"{index} lists tensors twice, in two shards: {_shown(twice)}")
    return weight_map


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """`{name: meta tensor of the stored shape}` of one weight file (safetensors header, or a `.bin` pickle read with
    `torch.load(map_location="meta", weights_only=True)`), reading no tensor data."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as handle:  # the dtype plays no part in the check: one for all
            return {name: torch.empty(handle.get_slice(name).get_shape(), device="meta") for name in handle.keys()}
    return dict(torch.load(path, map_location="meta", weights_only=True))


def folder_tensors(files: list[Path], index: Path | None = None) -> dict[str, torch.Tensor]:
    """`{name: meta tensor}` of every tensor of the weight `files` (already checked to be intact) that
    `from_pretrained` loads together. With a sharded checkpoint's `index`, an index that does not name each tensor
    with the shard that holds it (hand-edited or merged repositories) is warned about, not refused: transformers reads
    the index for its list of shards only and loads every tensor of each, as this returns them.

    Raises:
        ValueError: naming the tensors stored in two files (which one loads depends on the order of the files).

    Warns:
        UserWarning: naming the tensors the index lists in a shard that does not hold them, and those a shard holds
            that the index does not list there.
    """
    tensors, where, twice = {}, {}, []
    for path in files:
        for name, tensor in _file_tensors(path).items():
            if name in tensors:
                twice.append(f"{name} ({where[name]}, {path.name})")
            tensors[name], where[name] = tensor, path.name
    if twice:
        raise ValueError(f"{files[0].parent}: the weight files disagree with each other; tensors stored in two files: "
                         f"{_shown(twice)}")
    if index is not None:
        weight_map = read_index(index)
        absent = [f"{name} ({shard})" for name, shard in weight_map.items() if name not in where]
        moved = [f"{name} (index: {shard}, held by {where[name]})" for name, shard in weight_map.items()
                 if name in where and where[name] != shard]
        unlisted = [f"{name} ({where[name]})" for name in where if name not in weight_map]
        problems = [f"{what}: {_shown(names)}" for what, names in (
            ("listed by the index but in no shard", absent), ("in another shard than the index says", moved),
            ("in a shard but not in the index", unlisted)) if names]
        if problems:
            warnings.warn(f"{index.parent}: the weight files disagree with {index.name} (transformers loads every "
                          f"tensor of the shards it lists, as the conversion does); tensors {'; '.join(problems)}",
                          stacklevel=2)
    return tensors


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars and warnings off (a meta-device dry run reports through its return value)."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def check_folder_tensors(config, tensors: dict[str, torch.Tensor], where: str | os.PathLike) -> None:
    """Before loading: the `tensors` (see `folder_tensors`) fill every weight of the model `config` builds (one of a
    tied pair, such as `lm_head` and the embedding, is enough) with the shape it has, and each has a weight, after
    transformers' own key renaming and weight conversions; the model is built on the meta device only.

    Raises:
        ValueError: naming the model's weights no tensor holds (whole layers summarised, with the layer count the
            files hold beside `num_hidden_layers`), the tensors with no weight, those of another shape, and tensors
            transformers' conversions cannot combine (e.g. an expert missing from a fused MoE weight).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    with _quiet_transformers():
        model = _meta_model(config)
        load = LoadStateDictConfig(device_map={"": "meta"}, weight_mapping=get_model_conversion_mapping(model))
        info, _ = convert_and_load_state_dict_in_model(model, dict(tensors), load)
        model._adjust_missing_and_unexpected_keys(info)  # transformers' own exceptions (e.g. legacy inv_freq buffers)
    expected = set(model.state_dict())
    broken = {name: error.strip().splitlines()[-1] for name, error in info.conversion_errors.items()}
    missing = set(info.missing_keys) - set(broken)
    for pair in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if not set(pair) <= missing:  # transformers ties a pair either way round (`tie_weights`): one is enough
            missing -= set(pair)
    missing = sorted(missing)
    problems = []
    if missing:
        problems.append(f"no tensor for {_missing_summary(missing, expected, tensors, config)}")
    if info.unexpected_keys:
        problems.append(f"tensors with no weight in the model: {_shown(sorted(info.unexpected_keys))}")
    if info.mismatched_keys:
        shapes = [f"{name} {tuple(stored)} in the files, {tuple(wanted)} in the model"
                  for name, stored, wanted in sorted(info.mismatched_keys)]
        problems.append(f"shapes differ: {_shown(shapes)}")
    if broken:
        problems.append(f"tensors that cannot be combined: {_shown([f'{k} ({v})' for k, v in sorted(broken.items())])}")
    if problems:
        raise ValueError(f"{where}: the weight files do not cover the {config.model_type} model its config.json "
                         "builds (transformers would initialise what is missing at random and drop the rest); "
                         f"{'; '.join(problems)}")


def _meta_model(config):
    """The family's own causal LM of `config` (what `AutoModelForCausalLM` maps it to; `kimi_k3` has no Auto entry)
    on the meta device, built from a copy of `config` (`from_config` sets the attention and experts implementations
    in it): no weight memory."""
    from ..modeling import backbones

    with _quiet_transformers(), torch.device("meta"):
        return backbones.BACKBONES[config.model_type].causal_lm._from_config(copy.deepcopy(config))


def _missing_summary(missing: list[str], expected: set[str], tensors: dict, config) -> str:
    """The missing weights, whole layers as `layers 30, 31 (every weight)`, with the layers the files hold."""
    layer_of = {name: int(m.group(1)) for name in expected if (m := _LAYER.search(name))}
    per_layer = {}
    for name, layer in layer_of.items():
        per_layer.setdefault(layer, set()).add(name)
    gone = sorted(layer for layer, names in per_layer.items() if names <= set(missing))
    rest = [name for name in missing if layer_of.get(name) not in gone]
    parts = [_shown(rest)] if rest else []
    if gone:
        held = sorted({int(m.group(1)) for name in tensors if (m := _LAYER.search(name))})
        span = f"{held[0]}-{held[-1]}" if held else "none"
        parts.insert(0, f"every weight of layer(s) {_shown([str(n) for n in gone])} (config.json: num_hidden_layers "
                        f"{getattr(config, 'num_hidden_layers', '?')}; the files hold {len(held)} layers, {span})")
    return "; ".join(parts)


def _shown(names: list[str], count: int = 6) -> str:
    return ", ".join(names[:count]) + (f" (+{len(names) - count} more)" if len(names) > count else "")


@functools.lru_cache(maxsize=32)
def _module_source(name: str) -> str:
    return inspect.getsource(sys.modules[name])


def _read_by_model_code(config, key: str) -> bool:
    """Whether the family's transformers model file or its AttnRes backbone adapter reads `key` from a config
    (`config.key`, `getattr(config, "key", ...)`): some families read fields their config class does not declare
    (Qwen3-MoE's `head_dim`)."""
    from ..modeling import backbones, backbones_base

    modules = (backbones.BACKBONES[config.model_type].causal_lm.__module__, backbones.__name__, backbones_base.__name__)
    pattern = rf"config\.{re.escape(key)}\b|getattr\(\s*[\w.]*config\s*,\s*[\"']{re.escape(key)}[\"']"
    return any(re.search(pattern, _module_source(name)) for name in modules)


def unused_config_keys(config_file: str | os.PathLike, config) -> list[str]:
    """Keys of `config_file` (a `config.json`) that `config`'s family does not use: no field of its config class,
    not read by its model's code, and removing the key changes nothing in the config transformers builds from the
    file (an unknown or misspelt key, another tool's key, or a legacy key that a newer one overrides, e.g. `rope_theta`
    beside `rope_parameters`), each with the field it may be a misspelling of (`"num_hiden_layers
    (num_hidden_layers?)"`). A legacy key transformers reads (`rope_theta` alone, `torch_dtype`) and an alias of the
    class's `attribute_map` count as used, and so do transformers' private bookkeeping (`_name_or_path`, the GGUF
    loader's `_model_name_or_path`) and special-token ids (`unk_token_id`: read by tokenizers and generation, not by
    the model)."""
    raw = json.loads(Path(config_file).read_text())
    cls = type(config)
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    with _quiet_transformers():
        built = cls.from_dict(raw).to_dict()
        unused = []
        for key in raw:
            if key in fields or key == "model_type" or key.startswith("_") or key.endswith("_token_id"):
                continue
            if _read_by_model_code(config, key):
                continue
            try:
                without = cls.from_dict({k: v for k, v in raw.items() if k != key}).to_dict()
            except (ValueError, TypeError, KeyError):  # the config cannot do without it: used
                continue
            if without == {k: v for k, v in built.items() if k != key}:
                hint = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.8)
                unused.append(f"{key} ({hint[0]}?)" if hint else key)
    return unused
