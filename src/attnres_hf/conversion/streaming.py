"""Streamed conversion of a checkpoint read through the `sources.Source` interface (an HF safetensors folder, an fla
or a Kimi K3 folder): a checkpoint of any size retrofitted in about one tensor chunk of memory, and verified one module
at a time.

The in-memory path (`retrofit`) loads the source model, builds the AttnRes model beside it and compares the two with
both resident: about 2x the checkpoint's fp32 size, 70 GB for a Llama-3-8B. A retrofit copies every backbone tensor
unchanged and adds the depth-mixing parameters at their residual-model initialisation, so nothing in it needs the
model's weights together:

1. **Plan** (`StreamPlan`): the AttnRes model is built on the meta device (no weight memory); its state dict names,
   shapes and dtypes, less the tied weights `save_pretrained` leaves out, are the output's tensors. Each is either
   read from the source (`Source.reads`: the name map and per-tensor transforms; an HF folder's tensors under the
   names transformers' loading gives them, per-expert MoE tensors stacked by its own operations:
   `hf_stream.converted_reads`) or a parameter of a depth-mixing module, whose value is that module's
   `reset_parameters()` (each module materialised alone: a few vectors), unless the source holds trained routers
   (`Source.imported_routers`). Source tensors transformers' loading drops (a tied head stored beside its
   embedding, old per-layer rotary `inv_freq`) are dropped too. A source whose tensors cannot be read so (a dtype
   the reader does not read, a legacy `.bin`: `Source.not_streamable`; a model tensor no read gives) is not
   streamable; `convert` takes the in-memory path and says why.
2. **Write** (`write_streamed`): the shard plan is huggingface_hub's (`split_torch_state_dict_into_shards`, as
   `save_pretrained` names and fills shards), computed from the meta tensors. Each shard's safetensors header is
   written first (the format's documented layout: an 8-byte little-endian header length, the JSON header, the data),
   then every tensor: a stored tensor of the output's dtype as its bytes, copied file to file inside the kernel
   (`os.copy_file_range`, as `cp` copies), any other in chunks of at most `chunk_bytes`, each read from the source
   file, cast and appended; the index is written last. safetensors' own reader checks each shard before the folder
   is kept.
3. **Verify** (`offloaded.offloaded`): the source and the written output are built on the meta device and
   dispatched by accelerate with each decoder layer offloaded to disk (its weights read, in fp32, from the folder's
   own safetensors files for its forward and dropped after; the embedding and head read only what each forward
   needs), and `verify.verify_offloaded_conversion` compares them: the same logits, in fp32, and the greedy
   continuation, in `new_tokens + 1` forwards (each reads every weight of its model again).

Every read goes through `SafetensorsFile`: plain reads, no memory map (whose touched pages count as resident), into
memory reused from read to read (`sources.BUFFERS`). Peak memory: one decoder layer's fp32 weights (a Llama-3-8B's: 0.87 GB) plus one chunk and the probe's
activations; measured figures are in docs/retrofitting.md ("Checkpoints of any size", written by
`benchmarks/convert_scale.py`).
"""

import copy
import errno
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .sources import BUFFERS, CHUNK_BYTES, SAFETENSORS_DTYPES, Source, TensorRead, generation_config_of  # noqa: F401

STREAM_ABOVE_BYTES = 2**30
"""`convert(stream="auto")` streams a streamable source whose parameters take more than this in fp32 (1 GiB: about
270M parameters); smaller ones take the in-memory path, which generates its greedy continuation from resident
weights."""


@dataclass
class StreamPlan:
    """What a streamed retrofit writes: for each output tensor (in the model's state-dict order) its meta tensor
    (shape, dtype), and where its values come from.

    Attributes:
        config: the `AttnResConfig` of the output (`None`: an export, `export.py`, which writes another layout).
        model: the AttnRes model on the meta device (no weights; its `save_pretrained` writes the config, the
            generation config and the modeling files); `None` for an export.
        targets: `{output name: meta tensor}`, tied weights `save_pretrained` leaves out removed.
        sources: `{output name: TensorRead}` for the tensors read from the source (the backbone's, and the trained
            routers of a source that has them: `Source.imported_routers`; an export's every tensor).
        mixing: `{output name: tensor}`, the other depth-mixing parameters at their residual-model initialisation,
            in the output dtype.
        source: the `Source` read (`None` for an export: the AttnRes folder's own tensors).
    """

    config: object
    model: torch.nn.Module | None
    targets: dict[str, torch.Tensor]
    sources: dict[str, TensorRead]
    mixing: dict[str, torch.Tensor] = field(default_factory=dict)
    source: Source | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes of the output's tensors."""
        return sum(t.numel() * t.element_size() for t in self.targets.values())


def stream_plan(source: Source, dtype: torch.dtype, auto: bool = False, **overrides) -> StreamPlan | str:
    """The `StreamPlan` of a conversion of `source` (its config already checked) written in `dtype` (`auto`: the
    checkpoint's own, `Source.checkpoint_dtype`, with the tensors it keeps in another dtype, `Source.kept_dtypes`)
    with `overrides` (`AttnResConfig` fields, already the source's: `Source.overrides`), or the reason,
    one line, why its tensors cannot be streamed (then `convert` loads it in memory).

    Raises:
        ValueError, UnsupportedSourceError: invalid overrides (`retrofit_config`).
    """
    from ..modeling import AttnResForCausalLM
    from ..modeling.depth_mixing import MIXING_MODULES
    from .retrofit import retrofit_config

    reason = source.not_streamable()
    if reason is not None:
        return reason
    source_config = copy.deepcopy(source.config)
    source_config.dtype = dtype  # the backbone config records the written dtype, as `retrofit` of a loaded model's
    config = retrofit_config(source_config, **overrides)
    with torch.device("meta"):
        model = AttnResForCausalLM(config)
    model = model.to(dtype)
    targets = dict(model.state_dict())
    for tied in (getattr(model, "all_tied_weights_keys", None) or {}):  # `save_pretrained` writes one of a tied pair
        targets.pop(tied, None)
    for name, kept in source.kept_dtypes(dtype, auto).items():  # K3's fp32 tensors of a bf16 checkpoint
        if name in targets:
            targets[name] = torch.empty_like(targets[name], dtype=kept)
    reads = source.reads()
    mixing_names = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MIXING_MODULES):
            mixing_names[module_name] = [f"{module_name}.{name}" for name, _ in module.named_parameters()]
    mixing_keys = {key for keys in mixing_names.values() for key in keys}
    backbone = set(targets) - mixing_keys
    absent = sorted(backbone - set(reads))
    if absent:  # a source kind whose reads do not give every backbone tensor of the model
        return f"its tensors do not give every tensor of the AttnRes model (no read for {absent[0]})"
    # the rest are tensors transformers' loading drops too (`load_source_config` checked that): a tied head stored
    # beside its embedding, old checkpoints' per-layer rotary `inv_freq`
    imported = mixing_keys & set(reads) if source.imported_routers else set()
    sources = {name: reads[name] for name in targets if name in backbone or name in imported}
    wrong = [name for name, read in sources.items() if tuple(targets[name].shape) != tuple(read.shape)]
    if wrong:
        return f"tensors of another shape than the AttnRes model's ({', '.join(sorted(wrong)[:4])})"
    mixing = {}
    with torch.no_grad():
        for module_name, keys in mixing_names.items():
            if not set(keys) - imported:
                continue
            module = model.get_submodule(module_name)
            alone = module.to_empty(device="cpu", recurse=True).float()  # this module only; the rest stays meta
            alone.reset_parameters(config.initializer_range)
            for name, tensor in alone.named_parameters():
                key = f"{module_name}.{name}"
                if key in targets and key not in imported:
                    mixing[key] = tensor.detach().to(targets[key].dtype).clone()
            module.to("meta")
    return StreamPlan(config=config, model=model, targets=targets, sources=sources, mixing=mixing, source=source)


@dataclass(frozen=True)
class ByteRange:
    """Bytes of a file written unchanged: `length` bytes from `offset` of `path`."""

    path: Path
    offset: int
    length: int


def _chunks(plan: StreamPlan, name: str, chunk_bytes: int):
    """The values of output tensor `name`, in its dtype and file order: a `ByteRange` when they are a source file's
    stored bytes (`TensorRead.stored_in`, the same dtype: copied, no cast), else contiguous chunks of at most
    `chunk_bytes` of the source's (a stored tensor's elements in file order, refilling one buffer: each chunk is
    written before the next is read; another read's rows, a row never splitting), each cast to the output dtype.

    Raises:
        ValueError: values beyond the output dtype's range (`retrofit.check_representable`: a float16 output).
    """
    target = plan.targets[name]
    if name in plan.mixing:
        yield plan.mixing[name]
        return
    from .retrofit import check_representable

    read = plan.sources[name]
    if read.stored_in is not None:
        file, stored_name = read.stored_in
        if read.dtype == target.dtype:
            yield ByteRange(file.path, *file.byte_range(stored_name))
            return
        out = None
        for values in file.chunks(stored_name, chunk_bytes):
            check_representable(name, values, target.dtype, read.where)  # an outlier beyond float16's range: refused
            out = BUFFERS.empty(values.shape, target.dtype) if out is None else out
            yield out[:values.numel()].copy_(values)
        return
    rows = read.num_rows
    row_bytes = math.prod(target.shape[1:]) * max(target.element_size(), 4)  # the cast may pass through fp32
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, rows, step):
        values = read.rows(start, min(start + step, rows))
        check_representable(name, values, target.dtype, read.where)
        yield values.to(target.dtype)


def _write_all(out, data) -> None:
    """Write all of `data` (bytes-like) to the unbuffered file `out`."""
    view = memoryview(data).cast("B")
    while view:
        view = view[out.write(view):]


def _copy_range(part: ByteRange, out, chunk_bytes: int) -> None:
    """Append `part` to the unbuffered file `out`: copied inside the kernel (`os.copy_file_range`, as `cp` does),
    or read and written `chunk_bytes` at a time where the platform or the file systems do not allow it.

    Raises:
        ValueError: the source file ends before the range does.
    """
    truncated = f"{part.path}: truncated while copying bytes {part.offset}-{part.offset + part.length}"
    with part.path.open("rb", buffering=0) as source:
        offset, left = part.offset, part.length
        copy = getattr(os, "copy_file_range", None)
        while left and copy is not None:
            try:
                count = copy(source.fileno(), out.fileno(), left, offset)
            except OSError as error:  # e.g. another file system (EXDEV) or none of its own (ENOSYS): the plain way
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                break
            if not count:
                raise ValueError(truncated)
            offset, left = offset + count, left - count
        buffer = BUFFERS.empty((min(left, chunk_bytes),), torch.uint8) if left else None
        source.seek(offset)
        while left:
            view = buffer[:min(left, chunk_bytes)]
            count = source.readinto(memoryview(view.numpy()))
            if not count:
                raise ValueError(truncated)
            _write_all(out, view.numpy()[:count])
            left -= count


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
    its source (`_chunks`: a stored tensor of the output's dtype copied as bytes, any other in chunks of at most
    `chunk_bytes`, `CHUNK_BYTES`); return the weight files.

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
    with bar, BUFFERS.scope():
        for file_name, names in split.filename_to_tensors.items():
            path = folder / file_name
            with path.open("wb", buffering=0) as out:
                _write_all(out, _header(names, plan.targets))
                for name in names:
                    for chunk in _chunks(plan, name, chunk_bytes):
                        if isinstance(chunk, ByteRange):
                            _copy_range(chunk, out, chunk_bytes)
                            bar.update(chunk.length)
                        else:
                            _write_all(out, chunk.reshape(-1).view(torch.uint8).numpy())
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
        # `save_pretrained`'s count: the parameters (each of a tied pair once), not the persistent buffers; an export
        # (no model) writes huggingface_hub's `save_torch_state_dict` index, without one
        counted = {"total_parameters": plan.model.num_parameters()} if plan.model is not None else {}
        index = {"metadata": {**counted, **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def write_folder_files(plan: StreamPlan, folder: str | os.PathLike, generation_config=None) -> None:
    """The folder's config files, as `save_pretrained` writes them (`config.json` with `auto_map` and `dtype`,
    `generation_config.json` (the source's when given), the modeling files), from the meta model: no weights."""
    if generation_config is not None:
        plan.model.generation_config = copy.deepcopy(generation_config)
    plan.model.save_pretrained(folder, state_dict={})  # an empty state dict: no weight file is written
