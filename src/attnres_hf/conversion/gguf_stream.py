"""GGUF files as `sources.Source`s (`GGUFSource`): read tensor by tensor for a streamed conversion, or loaded whole
by transformers' GGUF loader (`retrofit.load_source`), each way checked against the file's own dequantised tensors
by the rules of `gguf_source`."""

import copy
import math
import os
from pathlib import Path

import torch

from .gguf_source import (_expert_half, _reader, check_against_gguf, gguf_architecture, gguf_rows, gguf_stop_token_ids,
                          gguf_tensor_map)
from .retrofit import load_source
from .sources import InMemory, Source, StoredTensor, TensorRead, generation_config_of


def checked(verify_all: bool) -> str:
    """What the GGUF weight check reads, for the progress lines."""
    return "every weight" if verify_all else "a sample of the weights (each tensor kind in the first and last block)"


class GGUFSource(Source):
    """A GGUF file read tensor by tensor (`sources.Source`), by the same rules as `read_gguf_tensors`: each tensor
    dequantised by the `gguf` package a row range at a time (a quantised row is whole blocks), Llama-layout q/k rows
    un-permuted whole heads at a time, Gemma's norm offset subtracted, an MoE `gate_up_proj` read from its two halves
    (`ffn_gate_exps`, `ffn_up_exps`), a tensor stored in another shape of the same size (Qwen2-MoE's 1-D shared-expert
    gate) reshaped. Reads go through the `gguf` reader's read-only memory map of the file.

    Args:
        path: the `.gguf` file; `config`: its config, checked by `retrofit.load_source_config`.
        verify_all: loaded whole (`load_model`), every weight of the loaded and the converted model is compared with
            the file's dequantised tensors; else a sample (`gguf_source.sampled_gguf_tensors`). A streamed
            conversion compares every weight it writes.
    """

    kind = "gguf"

    def __init__(self, path: str | os.PathLike, config, verify_all: bool = False):
        super().__init__(path, config, [Path(path)])
        self.verify_all = verify_all

    def stored(self) -> dict[str, StoredTensor]:
        return {tensor.name: StoredTensor(self.path, tuple(int(n) for n in reversed(tensor.shape)), torch.float32)
                for tensor in _reader(self.path).tensors}  # dequantised: fp32

    def checkpoint_dtype(self) -> torch.dtype:
        """fp32, the dtype of the dequantised tensors, unless the config names another (as transformers' GGUF loading
        under `dtype="auto"` reads it)."""
        dtype = getattr(self.config, "dtype", None)
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32

    def generation_config(self):
        """The generation config of the GGUF-loaded model (`retrofit.load_source`): stops on every end token of the
        file (`gguf_stop_token_ids`), as llama.cpp does."""
        config = generation_config_of(self.path.parent, self.config)
        stop = gguf_stop_token_ids(self.path)
        if stop:
            config.eos_token_id = stop if len(stop) > 1 else stop[0]
        return config

    def reads(self) -> dict[str, TensorRead]:
        from transformers import AutoModelForCausalLM

        reader, config, where = _reader(self.path), self.config, str(self.path)
        mapping = gguf_tensor_map(self.path, config)
        arch = gguf_architecture(reader)
        with torch.device("meta"):  # the shapes the model gives each weight (on a copy: from_config edits it)
            expected = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(copy.deepcopy(config))
                        .state_dict().items()}
        reads, halves = {}, {}
        for tensor in reader.tensors:
            hf_name, half = mapping[tensor.name], _expert_half(tensor.name)
            shape, dtype, read_rows = gguf_rows(tensor, config, arch)
            read = TensorRead(shape, dtype, where, read_rows)
            wanted = expected.get(hf_name, read.shape)
            if half is not None:
                halves.setdefault(hf_name, {})[half] = read
            elif read.shape != wanted and math.prod(read.shape) == math.prod(wanted):
                reads[hf_name] = read.mapped(lambda values, s=wanted: values.reshape(s))
            else:
                reads[hf_name] = read
        for hf_name, pair in halves.items():  # stacked experts (E, 2 I, H): the gate half first
            gate, up = pair[0], pair[1]
            reads[hf_name] = TensorRead((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), torch.float32, where,
                                        lambda start, stop, dtype, g=gate, u=up: torch.cat(
                                            [g.rows(start, stop, dtype), u.rows(start, stop, dtype)], dim=1))
        return reads

    def load_backbone(self, dtype: torch.dtype | str) -> tuple[torch.nn.Module, torch.dtype]:
        """The model transformers' GGUF loader builds (dequantised, fp32; checked against the file,
        `retrofit.load_source`), and the output dtype (`"auto"`: `checkpoint_dtype`; transformers refuses `.float()`
        of a GGUF model)."""
        print(f"Loading {self.path.name} (dequantising; {checked(self.verify_all)} checked against the file) ...",
              flush=True)
        model = load_source(self.path.parent, self.path.name, dtype=torch.float32, verify_all=self.verify_all,
                            config=self.config)
        return model, self.checkpoint_dtype() if dtype == "auto" else dtype

    def verify(self, loaded: InMemory, input_ids: torch.Tensor) -> dict:
        """The retrofit's check (`Source.verify`), then the converted model's weights against the file's dequantised
        tensors (`check_against_gguf`: a sample, or every weight with `verify_all`)."""
        verification = super().verify(loaded, input_ids)
        print(f"Checking {checked(self.verify_all)} of the converted model against {self.path.name} ...", flush=True)
        return verification | check_against_gguf(loaded.model, self.path, source_config=loaded.reference.config,
                                                 sample=not self.verify_all, progress=self.verify_all)
