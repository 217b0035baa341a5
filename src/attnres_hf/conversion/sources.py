"""One interface for the checkpoints a conversion reads (`Source`); their safetensors files are read by
`safetensors_reader`.

A `Source` gives what a streamed conversion (`streaming.stream_plan`) and its check (`offloaded.offloaded`) need,
without reading a weight: the backbone's transformers config (`config`), the stored tensors' names, shapes and dtypes
from the files' headers (`stored`), and for each tensor of the AttnRes model the `TensorRead` that gives its values,
rows at a time: the name map from the checkpoint's names to the model's and the per-tensor transforms (a pseudo-query
`[1, D]` read as `[D]`, K3's convolutions concatenated, per-expert weights stacked, MXFP4 experts dequantised), each
read only when its rows are asked for. It also gives the rest of `convert`'s one sequence: the options the converted
model may take (`overrides`, where a checkpoint with trained routers refuses any that would change them), the check of
its tensors before anything loads, the whole model in memory (`load_model`) and its check (`verify`), and the report's
`source` fields. Implementations: `hf_stream.HFSource` (a transformers folder, safetensors or `.bin`, under the
names transformers' loading gives its tensors), `ModelSource` (a model in memory), `fla_source.FlaStreamSource`,
`k3_source.K3StreamSource` and `gguf_stream.GGUFSource` (each tensor dequantised by the `gguf` package a row range
at a time). `export.py` reads an
AttnRes folder the other way with the same `TensorRead`s, and checks what it wrote by reading it back through the
importer's `Source`.
"""

import abc
import copy
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from .retrofit import _check_overrides, load_source, retrofit, retrofit_config
from .safetensors_reader import (BUFFERS, CHUNK_BYTES, SAFETENSORS_DTYPES, STORED_DTYPES, SafetensorsFile,  # noqa: F401
                                 StoredTensor, safetensors_files, stored_tensors)
from .verify import verify_conversion

@dataclass(frozen=True)
class TensorRead:
    """How the values of one tensor (of the AttnRes model, or of an export's layout) are read from files, rows (dim 0)
    at a time, into fresh contiguous CPU tensors.

    Attributes:
        shape: the tensor's shape in the model.
        dtype: the dtype its values are stored in (what `dtype="auto"` writes).
        where: the file (or files) it is read from, for messages.
        read_rows: `(start, stop, dtype) -> tensor` of rows `start:stop` in `dtype`, `(stop - start, *shape[1:])`
            (a 0-d tensor has one row and is returned 0-d).
        stored_in: `(file, name)` when the values are tensor `name` of a safetensors file exactly as stored
            (`stored`): a writer may copy its bytes (`streaming.write_streamed`); `None` for a computed tensor.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str
    read_rows: Callable[[int, int, torch.dtype], torch.Tensor]
    stored_in: "tuple[SafetensorsFile, str] | None" = None

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def rows(self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `start:stop` (default: all) in `dtype` (default: the stored one), a contiguous CPU tensor."""
        return self.read_rows(start, self.num_rows if stop is None else stop, dtype or self.dtype)

    @classmethod
    def stored(cls, file: SafetensorsFile, name: str) -> "TensorRead":
        """Tensor `name` of a safetensors file as it is stored (plain row-range reads, `SafetensorsFile.read`).

        Raises:
            KeyError: no tensor `name` in the file; ValueError: a dtype the reader does not know.
        """
        return cls(tuple(file.entries[name]["shape"]), file.dtype(name), str(file.path),
                   lambda start, stop, dtype: file.read(name, dtype, start, stop), (file, name))

    @classmethod
    def whole(cls, shape, dtype: torch.dtype, where: str, load: Callable[[], torch.Tensor]) -> "TensorRead":
        """A tensor computed whole by `load()` (in its stored dtype) when any of its rows is read: for small tensors
        built from stored ones (a reshaped pseudo-query, a concatenated convolution)."""

        def read_rows(start, stop, out_dtype):
            values = load()
            return (values if values.dim() == 0 else values[start:stop]).to(out_dtype).contiguous()

        return cls(tuple(shape), dtype, where, read_rows)

    def mapped(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> "TensorRead":
        """This (small) tensor through `transform`, a function of the whole tensor that keeps its values (a reshape:
        a pseudo-query `[1, D]` as `[D]` and back, `_names.query_as_ours`), read whole when any of its rows is read;
        its shape is `transform`'s of a meta tensor.

        Raises:
            whatever `transform` raises of the meta tensor (e.g. torch's `RuntimeError` for a reshape to another size).
        """
        shape = transform(torch.empty(self.shape, dtype=self.dtype, device="meta")).shape
        return TensorRead.whole(shape, self.dtype, self.where, lambda: transform(self.rows()))

    @classmethod
    def stacked(cls, shape, dtype: torch.dtype, where: str, row: Callable[[int], torch.Tensor]) -> "TensorRead":
        """A tensor whose row `i` is `row(i)` (e.g. expert `i` of a stacked MoE weight, read from its own tensors):
        only the rows asked for are read."""

        def read_rows(start, stop, out_dtype):
            out = torch.empty((stop - start, *shape[1:]), dtype=out_dtype)
            for i in range(start, stop):
                out[i - start] = row(i)
            return out

        return cls(tuple(shape), dtype, where, read_rows)


class InMemory(NamedTuple):
    """A source's AttnRes model loaded whole (`Source.load_model`), with what its check compares it with.

    Attributes:
        model: the AttnRes model, fp32 (which holds every stored value of a 16- or 32-bit checkpoint exactly).
        reference: what `Source.verify` compares `model` with, each kind's own: the backbone model it retrofits (fp32),
            or an imported checkpoint's read tensors (`k3_source.K3Model`), or `None` (fla: its own model is loaded
            from the folder by `fla_source.verify_against_fla`).
        dtype: the dtype the weights are written in (`"auto"` resolved to the checkpoint's).
        kept: `{tensor name: dtype}` of the tensors written in another dtype than `dtype` (K3's fp32 ones).
    """

    model: torch.nn.Module
    reference: object
    dtype: torch.dtype
    kept: dict


class Source(abc.ABC):
    """A checkpoint a conversion reads: the interface `convert`'s one sequence (`overrides`, `check_tensors`, then
    streamed through `streaming.stream_plan` and `offloaded.offloaded`, or `load_model` and `verify` in memory, and
    `report_fields`) reads, each kind implementing its own part.

    Attributes:
        path: the folder (or file) read.
        config: the transformers config of the backbone (the family whose model the AttnRes model builds on), checked.
        files: its safetensors files (`None`: it cannot be read tensor by tensor, `not_streamable` says why).
        imported_routers: whether it holds trained depth-mixing tensors (an fla or K3 AttnRes model), imported as
            they are, with `block_size` its `attnres_block_size`; otherwise the AttnRes tensors take their
            residual-model initialisation (a retrofit).
    """

    kind = "hf"
    imported_routers = False
    block_size = None

    def __init__(self, path: str | os.PathLike, config, files: list[Path] | None):
        self.path, self.config, self.files = Path(path), config, files

    def not_streamable(self) -> str | None:
        """Why this source cannot be read tensor by tensor (one line), or `None`."""
        if self.files is None:
            return "its weights are PyTorch .bin files (streaming reads safetensors)"
        unread = sorted(name for name, entry in self.stored().items() if entry.dtype is None)
        if unread:
            return f"tensors of a dtype streaming does not read ({', '.join(unread[:4])})"
        return None

    def stored(self) -> dict[str, StoredTensor]:
        """`{checkpoint tensor name: StoredTensor}` from the headers (no tensor data read)."""
        return stored_tensors(self.files or [])

    @abc.abstractmethod
    def reads(self) -> dict[str, TensorRead]:
        """`{AttnRes model tensor name: TensorRead}`: the name map and the per-tensor transforms, each source kind's
        own. Tensors the model has no place for are left out (the caller finds the model's tensors without a read)."""

    def checkpoint_dtype(self) -> torch.dtype:
        """The dtype `dtype="auto"` writes: transformers' `from_pretrained(dtype="auto")`'s, the config's `dtype`
        (`torch_dtype`), else the first floating-point tensor's."""
        dtype = getattr(self.config, "dtype", None)
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
        for entry in self.stored().values():
            if entry.dtype is not None and entry.dtype.is_floating_point:
                return entry.dtype
        return torch.float32

    def kept_dtypes(self, dtype: torch.dtype, auto: bool) -> dict[str, torch.dtype]:
        """`{AttnRes tensor name: dtype}` of the tensors written in another dtype than `dtype` (the output's; `auto`:
        it is the checkpoint's own); none by default."""
        return {}

    def generation_config(self):
        """The generation config `from_pretrained` gives the source model (`generation_config_of`)."""
        return generation_config_of(self.path, self.config)

    def described(self) -> str:
        """What the checkpoint is, for the message refusing an option that would change its imported routers."""
        return f"an AttnRes model (attnres_block_size {self.block_size})"

    def overrides(self, **overrides) -> dict:
        """The retrofit options (`AttnResConfig` fields) of the converted model, checked with `retrofit_config`: any
        for a retrofit; for a checkpoint with trained routers (`imported_routers`) its block size with the plain mean,
        as it was trained (`attnres_rescale_output=False`: neither fla nor K3 rescales), and nothing else.

        Raises:
            ValueError: an unknown or invalid option, or one that would change an imported model (naming it and the
                checkpoint's value).
            UnsupportedSourceError (a `ValueError`): a backbone attnres-hf does not support.
        """
        if not self.imported_routers:
            retrofit_config(self.config, **overrides)
            return dict(overrides)
        _check_overrides(overrides)  # unknown fields first
        wanted = {"depth_mixing": "attnres", "attnres_block_size": self.block_size, "attnres_rescale_output": False}
        imported = retrofit_config(self.config, **wanted)
        changed = [f"{name}={value!r} (the checkpoint's is {getattr(imported, name, None)!r})"
                   for name, value in overrides.items() if getattr(imported, name, None) != value]
        if changed:
            raise ValueError(f"{self.path} is {self.described()} with trained routers, imported as they are: "
                             f"{', '.join(changed)} would change it; convert without these options, then fine-tune")
        return wanted

    def check_tensors(self, overrides: dict) -> None:
        """Before anything loads: the checkpoint's tensors are the weights of the model `overrides` (from `overrides`)
        builds. A transformers folder's and a GGUF file's were checked against their config when the source was made
        (`retrofit.load_source_config`), so nothing is left to check here; fla and K3 check theirs.

        Raises:
            ValueError: naming the tensors with no place, of another shape, and the weights no tensor holds.
        """

    def load_backbone(self, dtype: torch.dtype | str) -> tuple[torch.nn.Module, torch.dtype]:
        """`(source model, output dtype)`: the backbone model in fp32 (`retrofit.load_source`) and the written dtype
        (`"auto"`: the checkpoint's, as transformers' `from_pretrained(dtype="auto")` reads it).

        Raises:
            ValueError: a truncated or corrupt weight file (naming the folder).
        """
        model = load_source(self.path, dtype="auto" if dtype == "auto" else torch.float32, config=self.config)
        if dtype == "auto":  # the checkpoint's own dtype is written; verification still runs in fp32
            dtype, model = model.dtype, model.float()
        return model, dtype

    def load_model(self, overrides: dict, dtype: torch.dtype | str) -> InMemory:
        """The AttnRes model of the whole checkpoint in memory (`overrides` from `overrides`; `dtype` the output's, or
        `"auto"`): a retrofit (`retrofit.retrofit`) of the backbone `load_backbone` gives; fla and K3 import theirs.

        Raises:
            ValueError: a truncated or corrupt weight file.
        """
        backbone, dtype = self.load_backbone(dtype)
        return InMemory(retrofit(backbone, progress=True, **overrides), backbone, dtype, {})

    def verify(self, loaded: InMemory, input_ids: torch.Tensor) -> dict:
        """The in-memory check of `loaded.model` (fp32) on the probe `input_ids` `(1, seq_len)`: a retrofit's logits
        and greedy continuation against the backbone's (`verify.verify_conversion`); fla and K3 check theirs."""
        print(f"Verifying on {input_ids.shape[1]} probe tokens ...", flush=True)
        return verify_conversion(loaded.reference, loaded.model, input_ids)

    def report_fields(self) -> dict:
        """The report's `source` fields this source knows: `model_type` (the backbone family's, or the checkpoint
        format's), `unused_config_keys` (`config.json` keys its family does not use: a transformers folder's), and
        each kind's own (fla's and K3's `format`, `imported_routers`, config)."""
        return {"model_type": self.config.model_type, "unused_config_keys": []}


class ModelSource(Source):
    """A transformers model in memory (a `PreTrainedModel` of a supported family): converted in memory, never streamed
    (its tensors are read under their own names, `reads`, but it has no files to write from tensor by tensor).

    Args:
        model: the model; it is not changed (a copy is made for an fp32 check of a 16-bit model). It has no `path`
            (`"."`) nor `files` (`None`); the report names it by `name`.
    """

    kind = "model"

    def __init__(self, model):
        super().__init__(".", model.config, None)
        self.model = model

    @property
    def name(self) -> str:
        """How the report names it: the model's `name_or_path`, else "in-memory model"."""
        return str(self.model.config._name_or_path or "in-memory model")

    def not_streamable(self) -> str:
        return "streaming reads files (this source is a model in memory)"

    def reads(self) -> dict[str, TensorRead]:
        return {name: TensorRead.whole(tensor.shape, tensor.dtype, self.name, lambda t=tensor: t.detach())
                for name, tensor in self.model.state_dict().items()}

    def generation_config(self):
        return self.model.generation_config

    def load_backbone(self, dtype: torch.dtype | str) -> tuple[torch.nn.Module, torch.dtype]:
        # verification runs in fp32; never change the caller's model in place
        model = self.model if self.model.dtype == torch.float32 else copy.deepcopy(self.model).float()
        return model.eval(), self.model.dtype if dtype == "auto" else dtype


def identity_reads(stored: dict[str, StoredTensor]) -> dict[str, TensorRead]:
    """`{name: TensorRead}` of tensors read under their own names, as stored (each file's header read once)."""
    files, reads = {}, {}
    for name, entry in stored.items():
        if entry.dtype is not None:  # (`Source.not_streamable` names the others)
            if entry.file not in files:
                files[entry.file] = SafetensorsFile(entry.file)
            reads[name] = TensorRead.stored(files[entry.file], name)
    return reads


def most_common_dtype(tensors) -> torch.dtype:
    """The floating dtype holding the most values of `tensors` (a bf16 checkpoint with a few fp32 tensors is bf16)."""
    counts = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get, default=torch.float32)


@torch.no_grad()
def continuation(model, input_ids: torch.Tensor, new_tokens: int = 32) -> dict:
    """The converted model's probe size and greedy continuation of `input_ids` `(1, seq_len)` (the check of a source
    whose own code does not run here): `num_probe_tokens`, `greedy_new_tokens`, `converted_continuation_ids`."""
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    tokens = model.generate(input_ids, **greedy)[0, input_ids.shape[1]:]
    return {"num_probe_tokens": int(input_ids.shape[1]), "greedy_new_tokens": new_tokens,
            "converted_continuation_ids": tokens.tolist()}


def generation_config_of(folder: str | os.PathLike, config):
    """The generation config `from_pretrained` gives a model of `folder`: its `generation_config.json`, else the one
    derived from `config`."""
    from transformers import GenerationConfig

    if (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(config)


@torch.no_grad()
def max_read_delta(reads: dict[str, TensorRead], others: dict[str, TensorRead],
                   dtypes: dict[str, torch.dtype] | None = None, chunk_bytes: int = CHUNK_BYTES) -> float:
    """The largest |a - b| over the tensors of `reads`, each against the tensor of the same name in `others`, compared
    in fp32 row chunks of at most `chunk_bytes` (fp32 holds every value of the 16- and 32-bit float dtypes read);
    `dtypes`: the dtype each tensor of `reads` is cast to first (as it was written).

    Raises:
        ValueError: a tensor of `reads` that `others` lacks or holds in another shape (naming it).
    """
    worst = 0.0
    for name, read in reads.items():
        other = others.get(name)
        if other is None or tuple(other.shape) != tuple(read.shape):
            found = "absent" if other is None else f"of shape {tuple(other.shape)}"
            raise ValueError(f"{read.where}: tensor {name} {tuple(read.shape)} is {found} in what was read back")
        step = max(1, chunk_bytes // max(4 * math.prod(read.shape[1:]), 1))
        for start in range(0, read.num_rows, step):
            stop = min(start + step, read.num_rows)
            ours = read.rows(start, stop).to((dtypes or {}).get(name, read.dtype)).float()
            theirs = other.rows(start, stop, torch.float32)
            worst = max(worst, float((ours - theirs).abs_().max()) if ours.numel() else 0.0)
    return worst
