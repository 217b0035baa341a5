"""Streamed conversion of an HF safetensors folder: a checkpoint of any size retrofitted in about one tensor chunk of
memory, and verified one module at a time.

The in-memory path (`retrofit`) loads the source model, builds the AttnRes model beside it and compares the two with
both resident: about 2x the checkpoint's fp32 size, 70 GB for a Llama-3-8B. A retrofit copies every backbone tensor
unchanged and adds the depth-mixing parameters at their residual-model initialisation, so nothing in it needs the
model's weights together:

1. **Plan** (`StreamPlan`): the AttnRes model is built on the meta device (no weight memory); its state dict names,
   shapes and dtypes, less the tied weights `save_pretrained` leaves out, are the output's tensors. Each is either a
   source tensor of the same name (`families.map_keys` is the identity for every supported family) or a parameter of
   a depth-mixing module, whose value is that module's `reset_parameters()` (each module materialised alone: a few
   vectors). Source tensors transformers' loading drops (a tied head stored beside its embedding, old per-layer
   rotary `inv_freq`) are dropped too. A source whose tensors do not hold the model's one by one (per-expert MoE
   tensors that transformers' weight conversions fuse, `.bin` weights) is not streamable; `convert` takes the
   in-memory path and says why.
2. **Write** (`write_streamed`): the shard plan is huggingface_hub's (`split_torch_state_dict_into_shards`, as
   `save_pretrained` names and fills shards), computed from the meta tensors. Each shard's safetensors header is
   written first (the format's documented layout: an 8-byte little-endian header length, the JSON header, the data),
   then every tensor in row chunks of at most `chunk_bytes`, each read from the source file, cast and appended; the
   index is written last. safetensors' own reader checks each shard before the folder is kept.
3. **Verify** (`offloaded.offloaded`): the source and the written output are built on the meta device and
   dispatched by accelerate with each decoder layer offloaded to disk (its weights read, in fp32, from the folder's
   own safetensors files for its forward and dropped after; the embedding and head read only what each forward
   needs), and `verify.verify_conversion` runs on them as on resident models: the same logits, compared in fp32.

Every read goes through `SafetensorsFile`: plain reads of row chunks, no memory map (whose touched pages count as
resident). Peak memory: one decoder layer's fp32 weights (a Llama-3-8B's: 0.87 GB) plus one chunk and the probe's
activations; measured figures are in docs/retrofitting.md ("Checkpoints of any size", written by
`benchmarks/convert_scale.py`).
"""

import copy
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

STREAM_ABOVE_BYTES = 2**30
"""`convert(stream="auto")` streams a streamable source whose parameters take more than this in fp32 (1 GiB: about
270M parameters); smaller ones take the in-memory path, which generates its greedy continuation from resident
weights."""

CHUNK_BYTES = 64 * 2**20
"""The most bytes of one tensor read, cast and written at a time (rows of a large tensor; a row never splits)."""

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
"""The safetensors format's dtype names (its specification, `Dtype` in the safetensors crate) of the dtypes a
retrofit writes."""
_STORED_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


@dataclass
class StreamPlan:
    """What a streamed retrofit writes: for each output tensor (in the model's state-dict order) its meta tensor
    (shape, dtype), and where its values come from.

    Attributes:
        config: the `AttnResConfig` of the output.
        model: the AttnRes model on the meta device (no weights; its `save_pretrained` writes the config, the
            generation config and the modeling files).
        targets: `{output name: meta tensor}`, tied weights `save_pretrained` leaves out removed.
        sources: `{output name: (safetensors file, source tensor name)}` for the backbone's tensors.
        mixing: `{output name: tensor}`, the depth-mixing parameters at their residual-model initialisation, in the
            output dtype.
    """

    config: object
    model: torch.nn.Module
    targets: dict[str, torch.Tensor]
    sources: dict[str, tuple[Path, str]]
    mixing: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        """Bytes of the output's tensors."""
        return sum(t.numel() * t.element_size() for t in self.targets.values())


def safetensors_files(folder: Path) -> list[Path] | None:
    """The safetensors files transformers loads from `folder` (`model.safetensors`, else every shard of
    `model.safetensors.index.json`), or `None` when it loads other weights (`.bin`)."""
    from .hf_source import read_index

    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / shard for shard in sorted(set(read_index(index).values()))]
    return None


def _headers(files: list[Path]) -> dict[str, tuple[Path, list[int], str]]:
    """`{tensor name: (file, shape, safetensors dtype name)}` from the files' headers (no tensor data read)."""
    held = {}
    for path in files:
        for name, entry in SafetensorsFile(path).entries.items():
            held[name] = (path, list(entry["shape"]), entry["dtype"])
    return held


def stored_dtype(source_config, files: list[Path]) -> torch.dtype:
    """The dtype transformers' `from_pretrained(dtype="auto")` reads: the config's `dtype` (`torch_dtype`), else the
    first floating-point tensor's."""
    dtype = getattr(source_config, "dtype", None)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    for _, _, stored in _headers(files).values():
        if _STORED_DTYPES.get(stored, torch.int64).is_floating_point:
            return _STORED_DTYPES[stored]
    return torch.float32


def stream_plan(folder: str | os.PathLike, source_config, dtype: torch.dtype, **overrides) -> StreamPlan | str:
    """The `StreamPlan` of a retrofit of the HF folder `folder` (whose config is `source_config`, already checked by
    `load_source_config`) written in `dtype` with `overrides` (`AttnResConfig` fields), or the reason, one line,
    why its tensors cannot be streamed (then `convert` loads it in memory).

    Raises:
        ValueError, UnsupportedSourceError: invalid overrides (`retrofit_config`).
    """
    from ..modeling import AttnResForCausalLM
    from ..modeling.depth_mixing import MIXING_MODULES
    from .retrofit import retrofit_config

    folder = Path(folder)
    files = safetensors_files(folder)
    if files is None:
        return "its weights are PyTorch .bin files (streaming reads safetensors)"
    source_config = copy.deepcopy(source_config)
    source_config.dtype = dtype  # the backbone config records the written dtype, as `retrofit` of a loaded model's
    config = retrofit_config(source_config, **overrides)
    with torch.device("meta"):
        model = AttnResForCausalLM(config)
    model = model.to(dtype)
    targets = dict(model.state_dict())
    for tied in (getattr(model, "all_tied_weights_keys", None) or {}):  # `save_pretrained` writes one of a tied pair
        targets.pop(tied, None)
    held = _headers(files)
    sources = {name: (path, name) for name, (path, _, _) in held.items()}  # the family's names are the AttnRes model's
    mixing_names = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MIXING_MODULES):
            mixing_names[module_name] = [f"{module_name}.{name}" for name, _ in module.named_parameters()]
    mixing_keys = {key for keys in mixing_names.values() for key in keys}
    backbone = set(targets) - mixing_keys
    absent = sorted(backbone - set(sources))
    if absent:  # e.g. per-expert MoE tensors that transformers' conversions fuse into one
        return ("its tensors are not the AttnRes model's one by one (transformers' weight conversions combine or "
                f"rename them, e.g. per-expert MoE tensors into {absent[0]})")
    # the rest are tensors transformers' loading drops too (`load_source_config` checked that): a tied head stored
    # beside its embedding, old checkpoints' per-layer rotary `inv_freq`
    sources = {name: sources[name] for name in backbone}
    wrong = [name for name in backbone if list(targets[name].shape) != held[sources[name][1]][1]]
    if wrong:
        return f"tensors of another shape than the AttnRes model's ({', '.join(sorted(wrong)[:4])})"
    mixing = {}
    with torch.no_grad():
        for module_name, keys in mixing_names.items():
            module = model.get_submodule(module_name)
            alone = module.to_empty(device="cpu", recurse=True).float()  # this module only; the rest stays meta
            alone.reset_parameters(config.initializer_range)
            for name, tensor in alone.named_parameters():
                key = f"{module_name}.{name}"
                if key in targets:
                    mixing[key] = tensor.detach().to(targets[key].dtype).clone()
            module.to("meta")
    return StreamPlan(config=config, model=model, targets=targets, sources=sources, mixing=mixing)


def _chunks(plan: StreamPlan, name: str, chunk_bytes: int):
    """The values of output tensor `name`, cast to its dtype, as contiguous row chunks of at most `chunk_bytes`
    (a row never splits), read with `SafetensorsFile` (plain reads: no mapped pages counted as resident).

    Raises:
        ValueError: values beyond the output dtype's range (`retrofit.check_representable`: a float16 output).
    """
    target = plan.targets[name]
    if name in plan.mixing:
        yield plan.mixing[name]
        return
    from .retrofit import check_representable

    path, source_name = plan.sources[name]
    reader = SafetensorsFile(path)
    rows = target.shape[0] if target.dim() else 1
    row_bytes = math.prod(target.shape[1:]) * max(target.element_size(), 4)  # the cast may pass through fp32
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, rows, step):
        values = reader.read(source_name, reader.dtype(source_name), start, min(start + step, rows), chunk_bytes)
        check_representable(name, values, target.dtype, path)  # an outlier beyond float16's range: refused, not inf
        yield values.to(target.dtype)


class SafetensorsFile:
    """One safetensors file, its tensors read by row ranges with plain file reads into fresh tensors.

    safetensors' own reader memory-maps the file: every page a read touches counts as resident memory until the file
    is closed (a Llama-3-8B's 1 GB head read through `safe_open` costs its 1 GB of mapped pages on top of the tensor
    and its fp32 copy). This reads the format's documented layout (an 8-byte little-endian header length, the JSON
    header, the data; little-endian values, as every platform torch runs on stores them) in chunks into the output.

    Raises (at construction):
        ValueError: a file too short for its header or for the tensors the header lists (one line naming it).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with self.path.open("rb") as handle:
            head = handle.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if 8 + length > size:
                raise ValueError(f"{self.path}: truncated or not safetensors (its header does not fit in the file)")
            try:
                entries = json.loads(handle.read(length))
            except ValueError as error:
                raise ValueError(f"{self.path}: its safetensors header is not JSON ({error})") from None
        entries.pop("__metadata__", None)
        self.entries, self.data_start = entries, 8 + length
        end = max((entry["data_offsets"][1] for entry in entries.values()), default=0)
        if self.data_start + end > size:
            raise ValueError(f"{self.path}: truncated ({size} bytes; its tensors end at byte {self.data_start + end})")

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor `name`.

        Raises:
            ValueError: a dtype this reader does not know (`SAFETENSORS_DTYPES`).
        """
        code = self.entries[name]["dtype"]
        stored = _STORED_DTYPES.get(code)
        if stored is None:
            raise ValueError(f"{self.path}: tensor {name} has dtype {code}, which streaming does not read")
        return stored

    def read(self, name: str, dtype: torch.dtype, start: int = 0, stop: int | None = None,
             chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
        """Rows `start:stop` (along dim 0; a 0-d tensor has one) of tensor `name`, cast to `dtype`: a contiguous CPU
        tensor, read `chunk_bytes` of the file at a time, so the memory used is the result plus one chunk.

        Raises:
            KeyError: no tensor `name` in the file.
            ValueError: a dtype this reader does not know (`SAFETENSORS_DTYPES`).
        """
        entry, stored = self.entries[name], self.dtype(name)
        shape = entry["shape"]
        rows = shape[0] if shape else 1
        stop = rows if stop is None else stop
        row_numel = math.prod(shape[1:]) if shape else 1
        row_bytes = row_numel * stored.itemsize
        out = torch.empty((stop - start, *shape[1:]) if shape else (), dtype=dtype)
        flat = out.view(-1)
        step = max(1, chunk_bytes // max(row_bytes, 1))
        buffer = torch.empty(min(step, stop - start) * row_bytes, dtype=torch.uint8)
        with self.path.open("rb", buffering=0) as handle:
            handle.seek(self.data_start + entry["data_offsets"][0] + start * row_bytes)
            for first in range(start, stop, step):
                count = min(step, stop - first) * row_bytes
                view = buffer[:count]
                if handle.readinto(memoryview(view.numpy())) != count:
                    raise ValueError(f"{self.path}: truncated while reading {name}")
                begin = (first - start) * row_numel
                flat[begin:begin + count // stored.itemsize].copy_(view.view(stored))
        return out


def _header(names: list[str], targets: dict[str, torch.Tensor]) -> bytes:
    """A safetensors header for `names` laid out in that order, padded to 8 bytes as the format requires."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        tensor = targets[name]
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streamed(plan: StreamPlan, folder: str | os.PathLike, max_shard_size: int | str = "5GB",
                   chunk_bytes: int = CHUNK_BYTES, progress: bool = False) -> list[Path]:
    """Write `plan`'s tensors into `folder` as `save_pretrained` shards them (`model.safetensors`, or
    `model-0000K-of-0000N.safetensors` with `model.safetensors.index.json`, written last), each tensor streamed from
    its source in chunks of at most `chunk_bytes` (`CHUNK_BYTES`); return the weight files.

    Raises:
        ValueError: a written shard that safetensors' reader refuses, or whose tensors are not the plan's, or a source
            value beyond the output dtype's range (one line naming the file or tensor).
        OSError: the disk is full or unwritable (the caller's staging folder is then deleted, `_io.staged_folder`).
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import SafetensorError, safe_open
    from tqdm.auto import tqdm

    folder = Path(folder)
    split = split_torch_state_dict_into_shards(plan.targets, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    written = []
    bar = tqdm(total=plan.num_bytes, unit="B", unit_scale=True, desc="Writing AttnRes weights", disable=not progress)
    with bar:
        for file_name, names in split.filename_to_tensors.items():
            path = folder / file_name
            with path.open("wb") as out:
                out.write(_header(names, plan.targets))
                for name in names:
                    for chunk in _chunks(plan, name, chunk_bytes):
                        out.write(chunk.reshape(-1).view(torch.uint8).numpy().data)
                        bar.update(chunk.numel() * chunk.element_size())
            try:
                with safe_open(path, "pt") as handle:
                    stored = set(handle.keys())
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{path}: the written shard is not valid safetensors ({error})") from None
            if stored != set(names):
                raise ValueError(f"{path}: the written shard holds other tensors than planned")
            written.append(path)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in plan.targets.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def write_folder_files(plan: StreamPlan, folder: str | os.PathLike, generation_config=None) -> None:
    """The folder's config files, as `save_pretrained` writes them (`config.json` with `auto_map` and `dtype`,
    `generation_config.json` (the source's when given), the modeling files), from the meta model: no weights."""
    if generation_config is not None:
        plan.model.generation_config = copy.deepcopy(generation_config)
    plan.model.save_pretrained(folder, state_dict={})  # an empty state dict: no weight file is written


def generation_config_of(folder: str | os.PathLike, config):
    """The generation config `from_pretrained` gives a model of `folder`: its `generation_config.json`, else the one
    derived from `config`."""
    from transformers import GenerationConfig

    if (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(config)
