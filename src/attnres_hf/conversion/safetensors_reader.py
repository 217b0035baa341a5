"""The safetensors format read without a memory map (`SafetensorsFile`): a tensor's rows read with plain file reads
into fresh tensors or memory reused from read to read (`BUFFERS`), and the tensors a folder's headers list
(`stored_tensors`), for the streamed conversion's `sources.Source`s.
"""

import contextlib
import json
import math
import os
import struct
import sys
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

    def will_need(self, name: str) -> None:
        """Ask the kernel to read tensor `name`'s bytes into the page cache in the background
        (`posix_fadvise(POSIX_FADV_WILLNEED)`), so a later `read` finds them there; nothing where the platform has no
        `posix_fadvise`. The pages are the kernel's cache, not this process's memory."""
        if hasattr(os, "posix_fadvise"):
            offset, length = self.byte_range(name)
            descriptor = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(descriptor)

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
