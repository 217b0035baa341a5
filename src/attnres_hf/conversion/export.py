"""`attnres export --to fla|k3-layout`: an AttnRes folder written as another implementation's own checkpoint.

`--to k3-layout`: a `kimi_k3` model in Kimi K3's text-only layout (`k3_layout.py`): K3's text `config.json`
(`model_type: "kimi_linear"`, `attn_res_block_size` half the `attnres_block_size`), K3's tensor names under `model.` /
`lm_head.weight`, values and dtype unchanged, the tokenizer, `generation_config.json` and `export_report.json`, which
checks that `attnres convert` reads the written folder back into the same tensors. The text config is the K3
checkpoint's own where the folder was converted from one and still describes the same model.

`--to fla`:
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
from .convert import check_tokenizer_code, load_tokenizer, most_common_dtype
from .families import UnsupportedSourceError
from .fla_layout import KERNEL_OPTIONS, backbone_from_fla, fla_block_size, fla_from_attnres, to_fla_name, to_fla_tensor
from .fla_source import _read_tensors, check_fla_installed, verify_against_fla
from .hf_source import _shown, folder_tensors
from .retrofit import _check_folder, check_max_shard_size, check_output_folder, check_path_argument
from .verify import PROBE_TEXT

EXPORT_FORMATS = ("fla", "k3-layout")
"""What `export` writes: `"fla"`, flash-linear-attention 0.6's `TransformerForCausalLM`; `"k3-layout"`, Kimi K3's
text model (its `KimiLinearForCausalLM` names and config)."""


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


def _copy_generation_config_and_tokenizer(model_dir: Path, staging: Path, trust_remote_code: bool):
    """The AttnRes folder's `generation_config.json` and tokenizer, written into the export; returns the tokenizer
    (`None` when the folder has none)."""
    if (model_dir / "generation_config.json").is_file():
        (staging / "generation_config.json").write_bytes((model_dir / "generation_config.json").read_bytes())
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    return tokenizer


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
    trust_remote_code: bool = False,
) -> dict:
    """Write the AttnRes model in `model_dir` as an fla `TransformerForCausalLM` checkpoint in `output_dir`, or (`to=
    "k3-layout"`) a `kimi_k3` model as Kimi K3's text checkpoint (`_export_k3`).

    Exports models fla computes: a Llama backbone (or Mistral's window, Qwen2's q/k/v biases, Qwen3's q/k norms with
    eps 1e-5), `depth_mixing` `"attnres"` (softmax, key norm, static query, one head, no window or scalar weights,
    `attnres_rescale_output=False`) or `"residual"`. Tensors keep their values and dtype: an fla checkpoint converted
    by `convert` and exported again gives back every tensor bit for bit.

    Returns:
        The export report (also `export_report.json`): the tensors written and `verification` (max |delta logits| of
        fla's model loaded from the output against the AttnRes model on `probe_text`, fp32, CPU; `exact`).

    `trust_remote_code` runs the folder's own tokenizer code (copied there from a source with one, as Kimi's);
    without it such a folder is refused before anything is read.

    Raises:
        FileExistsError: `output_dir` exists and `force` is false (checked first).
        TypeError, ValueError: a wrong-typed argument, a folder that is not an AttnRes checkpoint, a tokenizer that
            is its own code without `trust_remote_code`.
        UnsupportedSourceError (a `ValueError`): naming every setting fla's transformer does not have.
        FileNotFoundError, ValueError: missing or truncated weight files; a tensor with no fla name.
        ImportError: flash-linear-attention is not installed (the export is checked against fla's model).
    """
    model_dir, output_dir, max_shard_size = _check(model_dir, output_dir, to, force, max_shard_size, probe_text)
    if (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is a PEFT adapter, not a model: merge it into its base first "
                         "(attnres_hf.training.merge_lora), then export the merged folder")
    files, index = _check_folder(model_dir)
    check_tokenizer_code(model_dir, trust_remote_code)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type != AttnResConfig.model_type:
        raise ValueError(f"{model_dir} is not an AttnRes checkpoint (model_type {model_type!r}); `attnres convert` "
                         "makes one")
    config = AttnResConfig.from_pretrained(model_dir)
    if to == "k3-layout":
        return _export_k3(model_dir, output_dir, config, files, force, max_shard_size, trust_remote_code)
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
        tokenizer = _copy_generation_config_and_tokenizer(model_dir, staging, trust_remote_code)
        if tokenizer is not None:
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


def _k3_text_config(model_dir: Path, fields: dict) -> dict:
    """K3's text config for the export: the K3 checkpoint's own where `model_dir` was converted from one
    (`conversion_report.json`) and describes the same model (training changes weights only), else `fields`."""
    from .k3_layout import backbone_from_k3, k3_block_size

    try:
        source = json.loads((model_dir / "conversion_report.json").read_text())["source"]
        original = source["k3_text_config"] if source.get("format") == "k3" else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return fields
    if not isinstance(original, dict):
        return fields
    def architecture(text: dict):  # `use_cache` is off in a training run's config: not the architecture
        return backbone_from_k3({k: v for k, v in text.items() if k != "use_cache"})[0], k3_block_size(
            text.get("attn_res_block_size"))

    same = architecture(original) == architecture(fields)
    return {k: v for k, v in original.items() if k != "quantization_config"} if same else fields


def _export_k3(model_dir: Path, output_dir: Path, config: AttnResConfig, files: list, force: bool,
               max_shard_size: int, trust_remote_code: bool) -> dict:
    """`export(..., to="k3-layout")`: see the module docstring. Raises `UnsupportedSourceError` naming every setting
    K3's model does not have (another backbone, method or knob, a Full or odd block size, a rescaled router output)."""
    from huggingface_hub import save_torch_state_dict

    from .k3_layout import k3_from_backbone, remote_code_files, to_k3_state_dict
    from .k3_source import check_k3_tensors, k3_source, read_k3_tensors

    problems = []
    if config.backbone.model_type != "kimi_k3":
        problems.append(f"backbone {config.backbone.model_type!r} (K3's layout holds the kimi_k3 backbone)")
    if config.depth_mixing not in ("attnres", "residual"):
        problems.append(f"depth_mixing {config.depth_mixing!r} (K3 has Block AttnRes, or plain residuals)")
    attnres = config.depth_mixing == "attnres"
    if attnres:
        defaults = AttnResConfig.__dataclass_fields__
        knobs = ("attnres_score_fn", "attnres_key_norm", "attnres_window", "attnres_query", "attnres_num_heads",
                 "attnres_scalar_weights")
        problems += [f"{name}={getattr(config, name)!r} (K3's router: {defaults[name].default!r})" for name in knobs
                     if getattr(config, name) != defaults[name].default]
        if config.attnres_rescale_output:
            problems.append("attnres_rescale_output=True (K3 mixes with the plain softmax: a retrofit rescales; "
                            "convert with attnres_rescale_output=False)")
    if problems:
        raise UnsupportedSourceError(f"{model_dir}: Kimi K3's model cannot compute this one: {'; '.join(problems)}")
    fields, problems = k3_from_backbone(config.backbone, config.attnres_block_size if attnres else None)
    if problems:
        raise UnsupportedSourceError(f"{model_dir}: Kimi K3's model cannot compute this one: {'; '.join(problems)}")
    derived = fields
    fields = _k3_text_config(model_dir, fields)
    config_source = ("the K3 checkpoint's own (conversion_report.json)" if fields is not derived else
                     "derived from the model's config (no conversion_report.json from a K3 checkpoint of the same "
                     "architecture in the folder)")
    state = to_k3_state_dict(_read_tensors(files), config.backbone, layout="text")
    # the model's dtype (K3 keeps a few tensors fp32 in a bf16 model)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else most_common_dtype(state.values())
    print(f"Writing {len(state)} tensors in Kimi K3's text layout ...", flush=True)
    with staged_folder(output_dir, replace=force) as staging:
        (staging / "config.json").write_text(json.dumps(fields | {"dtype": str(dtype).removeprefix("torch.")},
                                                        indent=2) + "\n")
        save_torch_state_dict(state, staging, max_shard_size=max_shard_size, safe_serialization=True)
        _copy_generation_config_and_tokenizer(model_dir, staging, trust_remote_code)
        written = k3_source(staging)  # the written folder, read as `attnres convert` reads it
        check_k3_tensors(written, AttnResConfig.from_dict(config.to_dict()))
        back = read_k3_tensors(written)
        identical = set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
        report = {
            "attnres_hf_version": __version__, "to": "k3-layout", "source": str(model_dir),
            "output_dir": str(output_dir), "dtype": str(dtype).removeprefix("torch."), "tensors": len(state),
            "k3_text_config": fields, "k3_text_config_source": config_source,
            "k3_remote_code_files": remote_code_files(fields),
            "verification": {"read_back_by_attnres_convert": True, "tensors_identical": identical,
                             "logits_compared": "no: no Kimi K3 runtime runs here"},
        }
        if not identical:
            raise RuntimeError(f"the K3 folder written for {model_dir} does not read back into the same tensors; "
                               "please report this")
        (staging / "export_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
