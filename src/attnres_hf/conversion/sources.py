"""One interface for the checkpoints a conversion reads tensor by tensor (`Source`), and its safetensors reader.

A `Source` gives what a streamed conversion (`streaming.stream_plan`) and its check (`offloaded.offloaded`) need,
without reading a weight: the backbone's transformers config (`config`), the stored tensors' names, shapes and dtypes
from the files' headers (`stored`), and for each tensor of the AttnRes model the `TensorRead` that gives its values,
rows at a time: the name map from the checkpoint's names to the model's and the per-tensor transforms (a pseudo-query
`[1, D]` read as `[D]`, K3's convolutions concatenated, per-expert weights stacked, MXFP4 experts dequantised), each
read only when its rows are asked for. Implementations: `HFSource` (a transformers folder: the family's names are the
model's, identity reads), `fla_source.FlaStreamSource`, `k3_source.K3StreamSource` and `gguf_source.GGUFSource`
(each tensor dequantised by the `gguf` package a row range at a time). `export.py` reads an AttnRes folder the other
way with the same `TensorRead`s, and checks what it wrote by reading it back through the importer's `Source`.
"""

import abc
import contextlib
import json
import math
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

CHUNK_BYTES = 64 * 2**20
"""The most bytes of one tensor read, cast and written at a time (rows of a large tensor; a row never splits)."""

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
"""The safetensors format's dtype names (its specification, `Dtype` in the safetensors crate) of the dtypes a
retrofit writes."""
STORED_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


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
        stored = STORED_DTYPES.get(code)
        if stored is None:
            raise ValueError(f"{self.path}: tensor {name} has dtype {code}, which streaming does not read")
        return stored

    def read(self, name: str, dtype: torch.dtype, start: int = 0, stop: int | None = None,
             chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
        """Rows `start:stop` (along dim 0; a 0-d tensor has one) of tensor `name`, cast to `dtype`: a contiguous CPU
        tensor (`BUFFERS.empty`: memory reused while a `BUFFERS.scope()` is open), read straight into it when `dtype`
        is the stored one, else `chunk_bytes` of the file at a time and cast, so the memory used is the result plus
        one chunk.

        Raises:
            KeyError: no tensor `name` in the file.
            ValueError: a dtype this reader does not know (`SAFETENSORS_DTYPES`), or the file cut short.
        """
        entry, stored = self.entries[name], self.dtype(name)
        shape = entry["shape"]
        rows = shape[0] if shape else 1
        stop = rows if stop is None else stop
        row_numel = math.prod(shape[1:]) if shape else 1
        out = BUFFERS.empty((stop - start, *shape[1:]) if shape else (), dtype)
        offset = self.data_start + entry["data_offsets"][0] + start * row_numel * stored.itemsize
        if dtype == stored:
            self._read_into(out.view(-1).view(torch.uint8), offset, name)
            return out
        for begin, values in self._chunks(name, offset, (stop - start) * row_numel, stored, chunk_bytes):
            out.view(-1)[begin:begin + values.numel()].copy_(values)
        return out

    def chunks(self, name: str, chunk_bytes: int = CHUNK_BYTES):
        """Tensor `name`'s values, flat and in its stored dtype, `chunk_bytes` at a time (elements in file order, a
        row may split): each chunk is valid until the next is asked for (one buffer, refilled)."""
        entry, stored = self.entries[name], self.dtype(name)
        count = (entry["data_offsets"][1] - entry["data_offsets"][0]) // stored.itemsize
        for _, values in self._chunks(name, self.data_start + entry["data_offsets"][0], count, stored, chunk_bytes):
            yield values

    def byte_range(self, name: str) -> tuple[int, int]:
        """`(offset, length)` of tensor `name`'s bytes in the file."""
        begin, end = self.entries[name]["data_offsets"]
        return self.data_start + begin, end - begin

    def _chunks(self, name: str, offset: int, count: int, stored: torch.dtype, chunk_bytes: int):
        """`(index of its first element, values)` of `count` elements of dtype `stored` from byte `offset`, read
        `chunk_bytes` at a time into one buffer."""
        step = max(1, min(count, chunk_bytes // stored.itemsize))
        buffer = BUFFERS.empty((step,), stored)
        for begin in range(0, count, step):
            values = buffer[:min(step, count - begin)]
            self._read_into(values.view(torch.uint8), offset + begin * stored.itemsize, name)
            yield begin, values

    def _read_into(self, out: torch.Tensor, offset: int, name: str) -> None:
        """Fill the uint8 tensor `out` with the file's bytes from `offset`."""
        view, done = memoryview(out.numpy()), 0
        with self.path.open("rb", buffering=0) as handle:
            handle.seek(offset)
            while done < len(view):
                count = handle.readinto(view[done:])
                if not count:
                    raise ValueError(f"{self.path}: truncated while reading {name}")
                done += count


class ReusedBuffers:
    """Memory for the tensors a streamed conversion reads over and over (the same shapes, layer after layer, model
    after model), reused instead of allocated afresh while a `scope()` is open.

    Fresh memory costs a page fault per page when first written: measured on a 2-core VM, casting bf16 into a fresh
    fp32 tensor ran at 0.44 G values/s, into one already written at 2.5 G values/s. A buffer is handed out again only
    once no tensor uses its memory (the numpy array backing it has no other reference), so a tensor kept by its
    caller is never overwritten; the buffers are dropped when the last scope closes. Outside a scope, `empty` is
    `torch.empty`.
    """

    def __init__(self):
        self.held, self.scopes = {}, 0

    @contextlib.contextmanager
    def scope(self):
        """Reuse buffers inside the `with` block (scopes nest; the buffers go when the outermost one closes)."""
        self.scopes += 1
        try:
            yield self
        finally:
            self.scopes -= 1
            if not self.scopes:
                self.held.clear()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor: a free buffer of exactly its bytes when there is one in scope."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.scopes or not nbytes:
            return torch.empty(shape, dtype=dtype)
        arrays = self.held.setdefault(nbytes, [])
        for array in arrays:
            if sys.getrefcount(array) == 3:  # the list's, the loop's and the call's: no tensor uses it
                break
        else:
            array = numpy.empty(nbytes, numpy.uint8)
            arrays.append(array)
        return torch.from_numpy(array).view(dtype).view(shape)


BUFFERS = ReusedBuffers()
"""The buffers `SafetensorsFile.read` and `streaming.write_streamed` reuse (inside `BUFFERS.scope()`: the writing of
a streamed conversion, and its check, `offloaded.offloaded`)."""


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as a safetensors header lists it: its file, shape and stored dtype (`None`: one streaming does not
    read, e.g. a float8 or 4-bit code the header names)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype | None


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


def stored_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    """`{tensor name: StoredTensor}` of every tensor of the safetensors `files`, from their headers (no data read)."""
    held = {}
    for path in files:
        for name, entry in SafetensorsFile(path).entries.items():
            held[name] = StoredTensor(path, tuple(entry["shape"]), STORED_DTYPES.get(entry["dtype"]))
    return held


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


class Source(abc.ABC):
    """A checkpoint read tensor by tensor: the interface `streaming.stream_plan` and `offloaded.offloaded` read.

    Attributes:
        path: the folder (or file) read.
        config: the transformers config of the backbone (the family whose model the AttnRes model builds on), checked.
        files: its safetensors files.
        imported_routers: whether it holds trained depth-mixing tensors (an fla or K3 AttnRes model), imported as
            they are; otherwise the AttnRes tensors take their residual-model initialisation (a retrofit).
    """

    kind = "hf"
    imported_routers = False

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


class HFSource(Source):
    """A transformers model folder of safetensors weights: its family's tensor names are the AttnRes model's
    (`families.map_keys` is the identity), so every tensor reads as it is stored.

    Args:
        folder: the folder; `config`: its config, checked by `retrofit.load_source_config`.
    """

    def __init__(self, folder: str | os.PathLike, config):
        super().__init__(folder, config, safetensors_files(Path(folder)))

    def reads(self) -> dict[str, TensorRead]:
        return identity_reads(self.stored())


def identity_reads(stored: dict[str, StoredTensor]) -> dict[str, TensorRead]:
    """`{name: TensorRead}` of tensors read under their own names, as stored (each file's header read once)."""
    files, reads = {}, {}
    for name, entry in stored.items():
        if entry.dtype is not None:  # (`Source.not_streamable` names the others)
            if entry.file not in files:
                files[entry.file] = SafetensorsFile(entry.file)
            reads[name] = TensorRead.stored(files[entry.file], name)
    return reads


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
