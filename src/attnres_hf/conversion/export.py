"""`attnres export --to fla`: an AttnRes folder written as flash-linear-attention's own checkpoint.

The folder holds fla's `config.json` (its `TransformerConfig`, `model_type: "transformer"`), the weights under fla's
names (`fla_layout.FLA_KEY_MAP`; pseudo-queries `[hidden]` as fla's `[1, hidden]`), values and dtype unchanged, the
tokenizer, `generation_config.json` and `export_report.json`, which compares fla's model loaded from the written
folder with the AttnRes model (`fla_source.verify_against_fla`). Written to a temporary sibling folder and renamed.
fla's config is the fla checkpoint's own where the folder was converted from one and still describes the same model
(its `conversion_report.json`); otherwise it is derived from the AttnRes config, with that checkpoint's kernel options
(`fuse_norm`, `fuse_swiglu`, `fuse_cross_entropy`, ...: kernels and loss only) if known, else fla's defaults.
"""

import importlib
import json
import os
from pathlib import Path

import torch

from .. import __version__
from .._io import staged_folder
from ..modeling import AttnResConfig, AttnResForCausalLM
from .convert import load_tokenizer
from .families import UnsupportedSourceError
from .fla_layout import KERNEL_OPTIONS, backbone_from_fla, fla_block_size, fla_from_attnres, to_fla_name, to_fla_tensor
from .fla_source import _read_tensors, check_fla_installed, verify_against_fla
from .hf_source import _shown, folder_tensors
from .retrofit import _check_folder, check_max_shard_size, check_output_folder, check_path_argument
from .verify import PROBE_TEXT

EXPORT_FORMATS = ("fla",)
"""What `export` writes: `"fla"`, flash-linear-attention 0.6's `TransformerForCausalLM`."""


def _check(model_dir, output_dir, to, force, max_shard_size, probe_text) -> tuple[Path, Path, int]:
    check_path_argument(model_dir, "model_dir (an AttnRes model folder)")
    check_path_argument(output_dir, "output_dir")
    if to not in EXPORT_FORMATS:
        raise ValueError(f"to must be one of {', '.join(EXPORT_FORMATS)}, got {to!r}")
    if not isinstance(force, bool):
        raise TypeError(f"force must be True or False, got {force!r}")
    max_shard_size = check_max_shard_size(max_shard_size)  # in bytes, as save_pretrained reads a size
    if not isinstance(probe_text, str) or not probe_text.strip():
        raise ValueError(f"probe_text must be a non-empty string, got {probe_text!r}")
    return Path(model_dir), check_output_folder(output_dir, force, model_dir), max_shard_size


def _fla_config(model_dir: Path, fields: dict) -> dict:
    """fla's config for the export: the fla checkpoint's own `config.json` where `model_dir` was converted from one
    (its `conversion_report.json`) and describes the same model (the same backbone and block size: training changes
    weights only), so that a round trip gives it back, fields fla leaves unset included; else `fields` with the kernel
    options of that checkpoint, if any; else `fields` (fla's kernel defaults)."""
    try:
        source = json.loads((model_dir / "conversion_report.json").read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return fields
    if not isinstance(source, dict) or source.get("format") != "fla":
        return fields
    original = source.get("fla_config")
    if not isinstance(original, dict):
        return fields
    same = backbone_from_fla(original)[0] == backbone_from_fla(fields)[0] and (
        fla_block_size(original.get("attnres_block_size")) == fields["attnres_block_size"])
    if same:
        return {k: v for k, v in original.items() if k not in ("transformers_version", "model_type")}
    return fields | {name: original[name] for name in KERNEL_OPTIONS if name in original}


def export(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    to: str = "fla",
    force: bool = False,
    max_shard_size: str | int = "5GB",
    probe_text: str = PROBE_TEXT,
) -> dict:
    """Write the AttnRes model in `model_dir` as an fla `TransformerForCausalLM` checkpoint in `output_dir`.

    Exports models fla computes: a Llama backbone (or Mistral's window, Qwen2's q/k/v biases, Qwen3's q/k norms with
    eps 1e-5), `depth_mixing` `"attnres"` (softmax, key norm, static query, one head, no window or scalar weights,
    `attnres_rescale_output=False`) or `"residual"`. Tensors keep their values and dtype: an fla checkpoint converted
    by `convert` and exported again gives back every tensor bit for bit.

    Returns:
        The export report (also `export_report.json`): the tensors written and `verification` (max |delta logits| of
        fla's model loaded from the output against the AttnRes model on `probe_text`, fp32, CPU; `exact`).

    Raises:
        FileExistsError: `output_dir` exists and `force` is false (checked first).
        TypeError, ValueError: a wrong-typed argument, a folder that is not an AttnRes checkpoint.
        UnsupportedSourceError (a `ValueError`): naming every setting fla's transformer does not have.
        FileNotFoundError, ValueError: missing or truncated weight files; a tensor with no fla name.
        ImportError: flash-linear-attention is not installed (the export is checked against fla's model).
    """
    model_dir, output_dir, max_shard_size = _check(model_dir, output_dir, to, force, max_shard_size, probe_text)
    if (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is a PEFT adapter, not a model: merge it into its base first "
                         "(attnres_hf.training.merge_lora), then export the merged folder")
    files, index = _check_folder(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type != AttnResConfig.model_type:
        raise ValueError(f"{model_dir} is not an AttnRes checkpoint (model_type {model_type!r}); `attnres convert` "
                         "makes one")
    config = AttnResConfig.from_pretrained(model_dir)
    fields, problems = fla_from_attnres(config)
    if problems:
        raise UnsupportedSourceError(f"{model_dir}: fla's transformer cannot compute this model: {'; '.join(problems)}")
    names = {name: to_fla_name(name) for name in folder_tensors(files, index)}
    unnamed = sorted(name for name, fla_name in names.items() if fla_name is None)
    if unnamed:
        raise ValueError(f"{model_dir}: tensors with no fla counterpart: {_shown(unnamed)}")
    version = check_fla_installed()
    fields = _fla_config(model_dir, fields)
    state = {names[name]: to_fla_tensor(name, tensor).contiguous() for name, tensor in _read_tensors(files).items()}
    dtype = next(iter(state.values())).dtype
    print(f"Writing {len(state)} tensors as fla's TransformerForCausalLM ...", flush=True)
    from huggingface_hub import save_torch_state_dict

    with staged_folder(output_dir, replace=force) as staging:
        from .fla_cpu import fla_reference_kernels

        with fla_reference_kernels():
            TransformerConfig = importlib.import_module("fla.models").TransformerConfig
            fla_config = TransformerConfig(**({"architectures": ["TransformerForCausalLM"]} | fields
                                              | {"dtype": str(dtype).removeprefix("torch.")}))
        fla_config.save_pretrained(staging)
        save_torch_state_dict(state, staging, max_shard_size=max_shard_size, safe_serialization=True)
        if (model_dir / "generation_config.json").is_file():
            (staging / "generation_config.json").write_bytes((model_dir / "generation_config.json").read_bytes())
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
            input_ids = tokenizer(probe_text, return_tensors="pt").input_ids
        else:
            input_ids = torch.randint(config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        model = AttnResForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        print(f"Verifying on {input_ids.shape[1]} probe tokens against fla's model ...", flush=True)
        verification = verify_against_fla(staging, model, input_ids)
        report = {
            "attnres_hf_version": __version__, "flash_linear_attention_version": version, "to": to,
            "source": str(model_dir), "output_dir": str(output_dir), "dtype": str(dtype).removeprefix("torch."),
            "tensors": len(state), "fla_config": fields, "verification": verification,
        }
        (staging / "export_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
