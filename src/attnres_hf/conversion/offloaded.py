"""The check of a streamed conversion: a model of a safetensors folder run with its weights on disk, one decoder layer
resident at a time (`offloaded`), so that the source and the output of a conversion of any size compare their logits
in fp32 in about one layer's memory.

The model is built on the meta device and dispatched by accelerate (`dispatch_model`, each decoder layer offloaded to
disk, its weights read from the folder's own files for its forward and dropped after: `FolderWeights`); the embedding
and the head, a model's largest tensors, are replaced by modules that read only what each forward needs
(`RowStreamedEmbedding`, `RowStreamedLinear`). Every read is a `sources.TensorRead`'s (no memory map).
"""

import concurrent.futures
import contextlib
import copy
import itertools
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from .sources import (BUFFERS, CHUNK_BYTES, Source, TensorRead, generation_config_of, identity_reads, safetensors_files,
                      stored_tensors)

READ_AHEAD_BYTES = 2**30
"""How far ahead of the weight being read `FolderWeights` has the kernel fetch the next ones from disk (two of
Llama-3-8B's bf16 decoder layers)."""


def offload_map(model: torch.nn.Module) -> dict[str, str]:
    """A `device_map` for `model` (on the meta device) putting every decoder layer, and every other module that holds
    more than `RESIDENT_BYTES` of weights, on disk (accelerate's hooks read them from the safetensors files for each
    forward), and the rest on the CPU: the top-level modules, each decoder layer on its own. The CPU ones are the
    rotary frequencies, the `RowStreamedEmbedding` and `RowStreamedLinear` (which read their own) and small
    top-level modules (final norms and routers), which `offloaded` loads once: a model may read their weights
    without calling them (fla's reads its final router's), which an offload hook would not see."""
    device_map = {}
    for name, child, is_layer in _leaf_blocks(model):
        size = sum(param.numel() * 4 for param in child.parameters())  # (read in fp32)
        device_map[name] = "disk" if size and (is_layer or size > RESIDENT_BYTES) else "cpu"
    return device_map


RESIDENT_BYTES = 2**26
"""The most fp32 weight bytes a top-level module other than a decoder layer may hold to stay resident (`offload_map`):
64 MiB, a final norm or router of any model (a Llama-3-8B's norm: 16 KiB)."""


def _leaf_blocks(model: torch.nn.Module, prefix: str = ""):
    """`(name, module, is_layer)` of the modules a `device_map` assigns: the model's top-level children, and each
    decoder layer of a `layers` list (`is_layer`)."""
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, torch.nn.ModuleList):
            for index, layer in enumerate(child):
                yield f"{full}.{index}", layer, True
        elif any(isinstance(grandchild, torch.nn.ModuleList) for grandchild in child.children()):
            yield from _leaf_blocks(child, f"{full}.")
        else:
            yield full, child, False


@contextlib.contextmanager
def offloaded(folder: "str | os.PathLike | Source", model_class=None, rounded_to: dict | None = None,
              preload: list[str] | None = None):
    """The model saved in `folder` (safetensors), or the backbone model of a `Source` (an fla or K3 folder read
    through its name map and transforms: `Source.reads`), in fp32 with every weight-holding module offloaded to disk
    (`offload_map`), as a context: built on the meta device and dispatched by accelerate (`dispatch_model`) with the
    folder's own safetensors files as its weights (`FolderWeights`), so nothing is read until a module's forward
    loads its weights (cast to fp32) and nothing stays after it; the embedding and head read only what each forward
    needs (`_stream_vocabulary_modules`). `model_class`: the class to load (`None`: the family's causal LM, as
    `AutoModelForCausalLM` maps it; a family transformers lacks, such as `kimi_k3`, too). `rounded_to`: `{weight name:
    dtype}` of weights read rounded to that dtype first (then fp32): a source compared with a conversion that wrote
    its weights in another dtype, as the in-memory check compares before the output is cast. `preload`: class names
    of modules whose forward reads their submodules' weights directly (fla's decoder layer reads its routers'):
    each loads all its weights at its own forward (accelerate's `preload_module_classes`), not each submodule at its.
    A Kimi Linear model's KDA takes fla's kernels on CUDA tensors only (`backbones_moe.dispatch_kda_by_device`).

    transformers' `from_pretrained(device_map=...)` makes the same hooks but reads every tensor once while loading
    (a Llama-3-8B's 16 GB through memory-mapped files, all counted as resident until it returns), and its index-based
    offload reads each tensor through a memory map and casts it whole (a 1 GB bf16 head: 1 GB of mapped pages, 1 GB
    read, 2 GB in fp32 at once).

    Raises:
        ValueError: a weight of the model that no tensor of the folder holds (one line naming it).
    """
    from accelerate import dispatch_model
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig

    from ..modeling import backbones
    from ..modeling.backbones_moe import dispatch_kda_by_device
    from .retrofit import _family_config

    if isinstance(folder, Source):
        config, reads = folder.config, folder.reads()
        model_class = model_class or backbones.BACKBONES[config.model_type].causal_lm
        generation_config, folder = folder.generation_config(), folder.path
    else:
        if model_class is None:
            config = _family_config(Path(folder)) or AutoConfig.from_pretrained(folder)
            model_class = backbones.BACKBONES[config.model_type].causal_lm
        else:
            config = model_class.config_class.from_pretrained(folder)
        reads = identity_reads(stored_tensors(safetensors_files(Path(folder))))
        generation_config = generation_config_of(folder, config)
    if getattr(config, "attnres_implementation", "torch") != "torch":  # a folder saved for the GPU's kernels:
        config = copy.deepcopy(config)  # checked on the CPU with the same arithmetic in torch
        config.attnres_implementation = "torch"
    with torch.device("meta"):
        model = model_class._from_config(copy.deepcopy(config), dtype=torch.float32)
    dispatch_kda_by_device(model)  # a Kimi Linear source checked on the CPU: transformers' KDA would take fla's kernels
    model.generation_config = generation_config
    with torch.no_grad():
        for module in model.modules():  # rotary frequencies and the like: computed, as the family initialises them
            if module._non_persistent_buffers_set:
                for name in module._non_persistent_buffers_set:
                    if module._buffers.get(name) is not None:
                        module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
                model._init_weights(module)  # its parameters are meta tensors: their init does nothing
    params = dict(model.named_parameters(remove_duplicate=False))  # both names of a tied pair
    weights, missing = {}, []
    for name, tensor in model.state_dict().items():
        if tensor.device.type != "meta":
            continue
        if name not in params:  # a persistent buffer: loaded now (small), not offloaded
            if name not in reads:
                missing.append(name)
                continue
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = reads[name].rows(dtype=torch.float32)
        elif name in reads:
            weights[name] = reads[name]
    rounded_to = dict(rounded_to or {})
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied not in weights and source in weights:
            weights[tied] = weights[source]
            if source in rounded_to:
                rounded_to[tied] = rounded_to[source]
    missing += [name for name in params if name not in weights]
    if missing:
        raise ValueError(f"{folder}: no tensor for {', '.join(missing[:4])} in its safetensors files")
    source = FolderWeights(weights, rounded_to)
    _stream_vocabulary_modules(model, source)
    # `scratch`: accelerate's, nothing is written; `BUFFERS.scope()`: each forward reads the same shapes again (layer
    # after layer, model after model), into reused memory
    with tempfile.TemporaryDirectory(prefix="attnres-offload-") as scratch, BUFFERS.scope(), \
            contextlib.closing(source):
        # `state_dict` is read by key for each module's forward; an empty (not None) `offload_index` tells accelerate
        # the weights are already on disk (it would otherwise save the meta model's into `offload_dir`)
        quiet = logging.getLogger("accelerate.big_modeling")  # its "parameters on the meta device" is the point
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        device_map = offload_map(model)
        for name, where in device_map.items():
            for leaf, _ in model.get_submodule(name).named_parameters(prefix=name) if where == "cpu" else ():
                set_module_tensor_to_device(model, leaf, "cpu", value=source[leaf])  # (small: resident)
        try:
            model = dispatch_model(model, device_map=device_map, main_device="cpu",
                                   state_dict=source, offload_dir=scratch, offload_index={},
                                   skip_keys=getattr(model, "_skip_keys_device_placement", None),
                                   preload_module_classes=preload)
        finally:
            quiet.setLevel(level)
        yield model.eval()


class FolderWeights(Mapping):
    """`{weight name: fp32 tensor}` read from the files when asked (`sources.TensorRead`: plain reads, no memory
    map): what accelerate's offload hooks read a module's weights from before its forward and drop after it. Each
    weight read whole has the kernel fetch the next `READ_AHEAD_BYTES` of stored weights in the background
    (`_read_ahead`), so the next layer's reads from disk overlap this layer's compute. `close()` stops that.

    Args:
        reads: `{weight name: TensorRead}`.
        rounded_to: `{weight name: dtype}` of weights read in that dtype, then cast to fp32 (`offloaded`).
    """

    def __init__(self, reads: dict[str, TensorRead], rounded_to: dict | None = None):
        self.reads, self.rounded_to = reads, rounded_to or {}
        self._order = {name: index for index, name in enumerate(reads)}
        self._stored = [read.stored_in for read in reads.values()]  # (file, name) or None (computed: not advised)
        self._ends = list(itertools.accumulate(0 if where is None else where[0].byte_range(where[1])[1]
                                               for where in self._stored))  # stored bytes up to and with each
        self._last = self._ahead = len(self._stored)  # the last weight read whole; the first not yet advised
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="attnres-read-ahead")

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.read(key)

    def __contains__(self, key) -> bool:  # `Mapping`'s would read the tensor (accelerate asks before each read)
        return key in self.reads

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows `start:stop` of weight `key` in fp32 (`TensorRead.rows`; rounded to `rounded_to[key]` first)."""
        if start == 0:
            self._read_ahead(self._order[key])
        rounded = self.rounded_to.get(key, torch.float32)
        if rounded == torch.float32:
            return self.reads[key].rows(start, stop, torch.float32)
        return self.reads[key].rows(start, stop, rounded).float()

    def _read_ahead(self, index: int) -> None:
        """Have the kernel fetch the stored weights after weight `index` (`READ_AHEAD_BYTES` of them, in the order of
        `reads`, the model's state-dict order, which its forward follows layer by layer) into the page cache in the
        background (`SafetensorsFile.will_need`, from one worker thread, so no read waits on it), so that reading the
        next layer's weights from disk overlaps this layer's compute. Advised bytes are read once per pass."""
        if index <= self._last:  # the first read of a pass over the weights (the next forward)
            self._ahead = index + 1
        self._last, ahead = index, max(self._ahead, index + 1)
        while ahead < len(self._stored) and self._ends[ahead - 1] - self._ends[index] < READ_AHEAD_BYTES:
            if self._stored[ahead] is not None:
                self._reader.submit(self._stored[ahead][0].will_need, self._stored[ahead][1])
            ahead += 1
        self._ahead = ahead

    def close(self) -> None:
        """Stop reading ahead (the worker thread ends; advice not yet given is dropped)."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    def rows(self, key: str, indices: list[int]) -> torch.Tensor:
        """The rows `indices` of weight `key` in fp32, `(len(indices), *row shape)`."""
        return torch.cat([self.read(key, i, i + 1) for i in indices]) if indices else self.read(key, 0, 0)

    def __iter__(self):
        return iter(self.reads)

    def __len__(self) -> int:
        return len(self.reads)


def _stream_vocabulary_modules(model: torch.nn.Module, source: "FolderWeights") -> None:
    """Replace `model`'s input embedding and output head, when they are plain `nn.Embedding` / `nn.Linear` (a
    family's own subclass, e.g. a scaled embedding, is left to accelerate's hooks), by modules that read only what each
    forward needs from `source`: the embedding rows of the ids, the head in row chunks. They are a model's largest
    tensors (a Llama-3-8B's: 2.1 GB each in fp32, more than a decoder layer's 0.87 GB)."""
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is torch.nn.Embedding and embedding.max_norm is None:
        model.set_input_embeddings(RowStreamedEmbedding(source, names[id(embedding.weight)], embedding.weight.shape))
    if type(head) is torch.nn.Linear:
        bias = names[id(head.bias)] if head.bias is not None else None
        model.set_output_embeddings(RowStreamedLinear(source, names[id(head.weight)], bias, head.weight.shape))


class RowStreamedEmbedding(torch.nn.Module):
    """An fp32 `nn.Embedding` whose table stays on disk: each forward reads the rows of the ids it looks up.

    Args:
        source: the weights (`FolderWeights`); `name`: the table's name in it; `shape`: `(vocab_size, hidden_size)`.
    Input: integer ids of any shape; output: fp32 `(*ids.shape, hidden_size)`, as `F.embedding` of the whole table.
    """

    def __init__(self, source: "FolderWeights", name: str, shape):
        super().__init__()
        self.source, self.name, self.num_embeddings, self.embedding_dim = source, name, shape[0], shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, position = torch.unique(input_ids, return_inverse=True)
        rows = self.source.rows(self.name, ids.tolist())
        return rows[position]


class RowStreamedLinear(torch.nn.Module):
    """An fp32 `nn.Linear` whose weight stays on disk: each forward reads it `CHUNK_BYTES` of output rows at a time
    (a model's head: each chunk of the vocabulary's logits from its rows).

    Args:
        source: the weights (`FolderWeights`); `name`, `bias`: the weight's and bias's names in it (`bias` `None`:
            none); `shape`: `(out_features, in_features)`.
    Input: fp32 `(..., in_features)`; output: fp32 `(..., out_features)`, as `F.linear` with the whole weight.
    """

    def __init__(self, source: "FolderWeights", name: str, bias: str | None, shape):
        super().__init__()
        self.source, self.name, self.bias_name = source, name, bias
        self.out_features, self.in_features = shape

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        step = max(1, CHUNK_BYTES // (4 * self.in_features))
        bias = self.source[self.bias_name] if self.bias_name is not None else None
        hidden = hidden.float()
        out = hidden.new_empty((*hidden.shape[:-1], self.out_features))
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            weight = self.source.read(self.name, start, stop)
            out[..., start:stop] = torch.nn.functional.linear(
                hidden, weight, None if bias is None else bias[start:stop])
        return out
