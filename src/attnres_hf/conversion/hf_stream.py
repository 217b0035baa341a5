"""A transformers model folder read tensor by tensor (`HFSource`): safetensors or PyTorch `.bin` weights, under the
names transformers' own loading gives them.

`from_pretrained` renames a checkpoint's keys and combines some of its tensors on the way into the model
(`transformers.conversion_mapping.get_model_conversion_mapping`: `WeightRenaming`s, e.g. Mixtral's
`block_sparse_moe.` to `mlp.`; `WeightConverter`s, e.g. the per-expert `experts.0.w1.weight`, `experts.0.w3.weight`,
... of an MoE checkpoint stacked and concatenated into one `mlp.experts.gate_up_proj` `[experts, 2 * intermediate,
hidden]`). `converted_reads` applies the same mapping with transformers' own functions (`rename_source_key`, in
`from_pretrained`'s key order) and builds each combined weight with transformers' own operations
(`ConversionOps.convert`), never a copy of their rules:

- expert by expert, when the operations act on each expert alone (`MergeModulelist(dim=0)`, the stacking, then only
  `Concatenate` along a later dimension): row `e` of the weight is the operations run on expert `e`'s tensors, so a
  read holds the rows it asked for (a streamed conversion's row chunks; one expert at a time);
- whole otherwise: the operations run on all of the weight's tensors when any of its rows is read (one weight of the
  model in memory, e.g. a fused QKV split back).

A `.bin` weight file is read through `torch.load(mmap=True, weights_only=True)` for each read (the file's pages
mapped, those of the rows read touched, released after), as transformers reads `.bin` files without copying them;
one in torch's legacy (pre-1.6, not zip) format cannot be mapped, and converts in memory.
"""

import os
from pathlib import Path

import torch

from .hf_source import read_index
from .sources import Source, StoredTensor, TensorRead, identity_reads, safetensors_files, stored_tensors


class HFSource(Source):
    """A transformers model folder (safetensors, or PyTorch `.bin` weights with or without an index) read through
    `converted_reads`: its tensors under the names and in the shapes `from_pretrained` gives the family's model.

    Args:
        folder: the folder; `config`: its config, checked by `retrofit.load_source_config` (the weight files were
            checked there too: `retrofit._check_folder`).
    """

    def __init__(self, folder: str | os.PathLike, config):
        folder = Path(folder)
        files = safetensors_files(folder)
        self.bin_files = None if files is not None else bin_files(folder)
        super().__init__(folder, config, files if files is not None else self.bin_files)

    def not_streamable(self) -> str | None:
        if self.files is None:
            return "it holds no safetensors or .bin weights"
        legacy = [path.name for path in self.bin_files or [] if not _zipped(path)]
        if legacy:  # torch.load(mmap=True) reads only torch.save's zip format (torch >= 1.6)
            return (f"its .bin weights ({', '.join(legacy[:2])}) are in torch's legacy (pre-1.6) format, which "
                    "cannot be memory-mapped")
        reason = super().not_streamable()
        if reason is not None:
            return reason
        return converted_reads(self.config, self.stored(), check_only=True)

    def stored(self) -> dict[str, StoredTensor]:
        if self.bin_files is None:
            return stored_tensors(self.files or [])
        held = {}
        for path in self.bin_files:  # the pickle alone: `map_location="meta"` builds no tensor data
            for name, tensor in torch.load(path, map_location="meta", weights_only=True).items():
                held[name] = StoredTensor(path, tuple(tensor.shape), tensor.dtype)
        return held

    def reads(self) -> dict[str, TensorRead]:
        return converted_reads(self.config, self.stored())

    def report_fields(self) -> dict:
        from .hf_source import unused_config_keys

        return super().report_fields() | {"unused_config_keys": unused_config_keys(self.path / "config.json",
                                                                                     self.config)}


def bin_files(folder: Path) -> list[Path] | None:
    """The `.bin` weight files transformers loads from `folder` (`pytorch_model.bin`, else the shards of
    `pytorch_model.bin.index.json`), or `None`."""
    if (folder / "pytorch_model.bin").is_file():
        return [folder / "pytorch_model.bin"]
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        return [folder / shard for shard in sorted(set(read_index(index).values()))]
    return None


def _zipped(path: Path) -> bool:
    """Whether a `.bin` file is in `torch.save`'s zip format (the one `torch.load(mmap=True)` reads)."""
    from .retrofit import ZIP_MAGIC

    with path.open("rb") as handle:
        return handle.read(len(ZIP_MAGIC)) == ZIP_MAGIC


def _bin_read(stored: StoredTensor, name: str) -> TensorRead:
    """Tensor `name` of a `.bin` file, its rows read through a memory map of the file for each read."""

    def read_rows(start, stop, dtype):
        state = torch.load(stored.file, map_location="cpu", mmap=True, weights_only=True)
        tensor = state[name]
        values = tensor if tensor.dim() == 0 else tensor[start:stop]
        return values.to(dtype, copy=True).contiguous()

    return TensorRead(stored.shape, stored.dtype, str(stored.file), read_rows)


def converted_reads(config, stored: dict[str, StoredTensor], check_only: bool = False):
    """`{model tensor name: TensorRead}` of a folder's `stored` tensors after transformers' key renaming and weight
    conversions for `config`'s family (see the module docstring); with `check_only`, the reason (one line) why they
    cannot be read so, or `None`.

    A weight built by a `WeightConverter` has the shape its operations give on the meta device, so a tensor missing
    from a group (an expert) or of another shape shows as a shape the streamed plan refuses (`stream_plan`), as
    `retrofit.check_folder_tensors` refuses it before.
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    from transformers.conversion_mapping import get_model_conversion_mapping

    from .hf_source import _meta_model

    model = _meta_model(config)
    mapping = get_model_conversion_mapping(model)
    renamings = [w for w in mapping if isinstance(w, WeightRenaming)]
    converters = [w for w in mapping if isinstance(w, WeightConverter)]
    meta = model.state_dict()
    plain, groups = {}, {}
    for key in sorted(stored, key=dot_natural_key):  # `from_pretrained`'s order: experts 0, 1, ..., 10
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if pattern is None:
            plain[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        if len(converter.target_patterns) != 1:
            return (f"transformers' weight conversions split {key} into several weights, which streaming does not "
                    "read") if check_only else {}
        groups.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(key)
    if check_only:
        return None
    reads = identity_reads({key: entry for key, entry in stored.items() if entry.file.suffix != ".bin"})
    reads |= {key: _bin_read(entry, key) for key, entry in stored.items()
              if entry.file.suffix == ".bin" and entry.dtype is not None}
    converted = {target: reads[key] for target, key in plain.items() if key in reads}
    for target, (converter, keys) in groups.items():
        converted[target] = _converted_read(converter, keys, reads, config, target)
    return converted


def _converted_read(converter, keys: dict[str, list[str]], reads: dict[str, TensorRead], config,
                    target: str) -> TensorRead:
    """The `TensorRead` of weight `target`, built by `converter`'s operations from the tensors `keys` (`{source
    pattern: checkpoint keys in loading order}`) read through `reads`."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    per_expert = (len(ops) >= 1 and type(ops[0]) is MergeModulelist and ops[0].dim == 0
                  and all(type(op) is Concatenate and op.dim >= 1 for op in ops[1:])
                  and len({len(names) for names in keys.values()}) == 1)

    def run(tensors: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        for op in ops:
            tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                                 target_patterns=converter.target_patterns, full_layer_name=target, model=None,
                                 config=config, missing_keys=None)
        (values,) = tensors.values()
        return values

    first = reads[next(iter(keys.values()))[0]]
    shape = tuple(run({pattern: [torch.empty(reads[k].shape, dtype=reads[k].dtype, device="meta") for k in names]
                       for pattern, names in keys.items()}).shape)
    where = first.where
    if per_expert:
        def row(e: int) -> torch.Tensor:
            return run({pattern: [reads[names[e]].rows()] for pattern, names in keys.items()})[0]

        return TensorRead.stacked(shape, first.dtype, where, row)
    return TensorRead.whole(shape, first.dtype, where, lambda: run(
        {pattern: [reads[k].rows() for k in names] for pattern, names in keys.items()}))
