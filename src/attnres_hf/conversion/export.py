"""`attnres export --to fla|k3-layout`: an AttnRes folder written as another implementation's own checkpoint.

`--to k3-layout`: a `kimi_k3` model in Kimi K3's text-only layout (`k3_layout.py`): K3's text `config.json`
(`model_type: "kimi_linear"`, `attn_res_block_size` half the `attnres_block_size`), K3's tensor names under `model.` /
`lm_head.weight`, values and dtype unchanged, the tokenizer, `generation_config.json` and `export_report.json`, which
checks that `attnres convert` reads the written folder back into the same tensors. The text config is the K3
checkpoint's own where the folder was converted from one and still describes the same model. Routed experts imported
from K3's MXFP4 (`conversion_report.json`) are written as MXFP4 again (`experts`, `_k3_experts`): `weight_packed` /
`weight_scale` encoded by compressed-tensors (`mxfp4.encode_mxfp4`, each checked to decode to the model's values bit
for bit, one expert tensor at a time) under the checkpoint's own `quantization_config`.

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
import math
import os
from pathlib import Path

import torch

from .. import __version__
from .._io import staged_folder
from ..modeling import AttnResConfig, AttnResForCausalLM
from ._names import is_pseudo_query, query_as_theirs
from .convert import check_tokenizer_code, load_tokenizer
from .families import UnsupportedSourceError
from .fla_layout import (KERNEL_OPTIONS, backbone_from_fla, fla_block_size, fla_from_attnres, to_fla_name,
                         to_fla_tensor)
from .fla_source import _read_tensors, check_fla_installed, verify_against_fla
from .hf_source import _shown, folder_tensors
from .retrofit import _check_folder, check_max_shard_size, check_output_folder, check_path_argument
from .sources import TensorRead, identity_reads, max_read_delta, most_common_dtype, stored_tensors
from .verify import PROBE_TEXT

EXPERT_FORMATS = ("mxfp4", "unquantized")
"""How `export(..., to="k3-layout")` writes routed experts: `"mxfp4"`, compressed-tensors' `mxfp4-pack-quantized`
(`weight_packed` / `weight_scale`) as K3's release stores them; `"unquantized"`, `.weight` tensors with the model's
values and dtype."""

EXPORT_FORMATS = ("fla", "k3-layout")
"""What `export` writes: `"fla"`, flash-linear-attention 0.6's `TransformerForCausalLM`; `"k3-layout"`, Kimi K3's
text model (its `KimiLinearForCausalLM` names and config)."""


def _check(model_dir, output_dir, to, force, max_shard_size, probe_text, stream, experts) -> tuple[Path, Path, int]:
    if not isinstance(stream, bool) and stream != "auto":
        raise TypeError(f"stream must be True, False or 'auto', got {stream!r}")
    check_path_argument(model_dir, "model_dir (an AttnRes model folder)")
    check_path_argument(output_dir, "output_dir")
    if to not in EXPORT_FORMATS:
        raise ValueError(f"to must be one of {', '.join(EXPORT_FORMATS)}, got {to!r}")
    if experts is not None and experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts!r}")
    if experts is not None and to != "k3-layout":
        raise ValueError(f"experts ({experts!r}) says how Kimi K3's layout stores routed experts: only for "
                         "to='k3-layout'")
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
    stream: bool | str = "auto",
    experts: str | None = None,
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

    `stream`: `True` writes the export tensor by tensor (`streaming.write_streamed`: each tensor read from the
    folder in row chunks, renamed and reshaped per tensor, one expert of a stacked MoE weight at a time) and checks
    it by reading the written folder back as `attnres convert` reads it (`sources.Source`), every tensor against the
    folder's, row chunks at a time: no model is loaded, so fla's logits are not compared; `False` in memory (the
    folder's tensors, the export's and, for fla, both models resident); `"auto"` (default) streamed when the
    tensors exceed `streaming.STREAM_ABOVE_BYTES` in fp32. The report's `export` says which ran and why.

    `experts` (`to="k3-layout"`; `EXPERT_FORMATS`): `"mxfp4"` writes each routed expert as compressed-tensors'
    MXFP4 (`weight_packed` uint8 `[out, in / 2]`, `weight_scale` uint8 `[out, in / 32]`) under the `quantization_config`
    of the K3 checkpoint the folder was imported from; `"unquantized"` as `.weight` (values and dtype unchanged);
    `None` (default): `"mxfp4"` when the experts were imported from MXFP4 (`conversion_report.json`), else
    `"unquantized"`. Nothing is rounded: an expert whose values are not MXFP4 values (fine-tuned since) is refused
    by name, suggesting `experts="unquantized"`. MXFP4 that compressed-tensors made from weights comes back byte for
    byte; a block whose stored scale was larger than compressed-tensors picks for its values (every code at most 3,
    or all zero, as another encoder may write) comes back with compressed-tensors' scale: its values, other bytes.
    The report's `experts` says which ran and why.

    Raises:
        FileExistsError: `output_dir` exists and `force` is false (checked first).
        TypeError, ValueError: a wrong-typed argument, a folder that is not an AttnRes checkpoint, a tokenizer that
            is its own code without `trust_remote_code`.
        UnsupportedSourceError (a `ValueError`): naming every setting fla's transformer does not have.
        FileNotFoundError, ValueError: missing or truncated weight files; a tensor with no fla name.
        ImportError: flash-linear-attention is not installed (the export is checked against fla's model);
            compressed-tensors is not installed for MXFP4 experts.
        ValueError: `experts="mxfp4"` for a folder not imported from MXFP4 experts; an expert not exactly MXFP4
            (naming it; a streamed export finds it while writing, and its staging folder is deleted).
    """
    model_dir, output_dir, max_shard_size = _check(model_dir, output_dir, to, force, max_shard_size, probe_text,
                                                   stream, experts)
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
    mode = _streaming_mode(files, stream)
    if to == "k3-layout":
        return _export_k3(model_dir, output_dir, config, files, force, max_shard_size, trust_remote_code, mode,
                          experts)
    fields, problems = fla_from_attnres(config)
    if problems:
        raise UnsupportedSourceError(f"{model_dir}: fla's transformer cannot compute this model: {'; '.join(problems)}")
    names = {name: to_fla_name(name) for name in folder_tensors(files, index)}
    unnamed = sorted(name for name, fla_name in names.items() if fla_name is None)
    if unnamed:
        raise ValueError(f"{model_dir}: tensors with no fla counterpart: {_shown(unnamed)}")
    version = check_fla_installed()
    fields = _fla_config(model_dir, fields)
    if mode["mode"] == "streamed":
        reads = {names[name]: read.mapped(query_as_theirs) if is_pseudo_query(name) else read
                 for name, read in _folder_reads(files).items()}
        dtype, count = next(iter(reads.values())).dtype, len(reads)
    else:
        state = {names[name]: to_fla_tensor(name, tensor).contiguous() for name, tensor in _read_tensors(files).items()}
        dtype, count = next(iter(state.values())).dtype, len(state)
    print(f"Writing {count} tensors as fla's TransformerForCausalLM ({mode['mode']}) ...", flush=True)
    from huggingface_hub import save_torch_state_dict

    with staged_folder(output_dir, replace=force) as staging:
        from .fla_cpu import fla_reference_kernels

        with fla_reference_kernels():
            TransformerConfig = importlib.import_module("fla.models").TransformerConfig
            fla_config = TransformerConfig(**({"architectures": ["TransformerForCausalLM"]} | fields
                                              | {"dtype": str(dtype).removeprefix("torch.")}))
        fla_config.save_pretrained(staging)
        if mode["mode"] == "streamed":
            _write_streamed(reads, staging, max_shard_size)
        else:
            save_torch_state_dict(state, staging, max_shard_size=max_shard_size, safe_serialization=True)
        tokenizer = _copy_generation_config_and_tokenizer(model_dir, staging, trust_remote_code)
        if tokenizer is not None:
            input_ids = tokenizer(probe_text, return_tensors="pt").input_ids
        else:
            input_ids = torch.randint(config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        if mode["mode"] == "streamed":  # read back as `attnres convert` reads it: every tensor the folder's; then
            # the logits of both, offloaded to disk (one module's weights resident at a time)
            from .convert import STREAMED_NEW_TOKENS
            from .fla_source import FlaStreamSource, check_fla_tensors, fla_source
            from .offloaded import offloaded

            written = fla_source(staging)
            check_fla_tensors(written, config)
            verification = _read_back(_folder_reads(files), FlaStreamSource(written).reads())
            print(f"Verifying on {input_ids.shape[1]} probe tokens against fla's model, both offloaded to disk ...",
                  flush=True)
            with offloaded(model_dir, AttnResForCausalLM) as model:
                verification |= verify_against_fla(staging, model, input_ids, new_tokens=STREAMED_NEW_TOKENS) | {
                    "logits_compared": "yes"}
        else:
            model = AttnResForCausalLM.from_pretrained(  # (checked on the CPU: torch's arithmetic, whatever kernels
                model_dir, dtype=torch.float32, attnres_implementation="torch").eval()  # the folder was saved for)
            print(f"Verifying on {input_ids.shape[1]} probe tokens against fla's model ...", flush=True)
            verification = verify_against_fla(staging, model, input_ids)
        report = {
            "attnres_hf_version": __version__, "flash_linear_attention_version": version, "to": to,
            "source": str(model_dir), "output_dir": str(output_dir), "dtype": str(dtype).removeprefix("torch."),
            "tensors": count, "export": mode, "fla_config": fields, "verification": verification,
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

    try:
        same = architecture(original) == architecture(fields)
    except (ValueError, TypeError):  # a record K3 cannot read (edited) does not describe this model
        return fields
    return {k: v for k, v in original.items() if k != "quantization_config"} if same else fields


def _k3_experts(model_dir: Path, experts: str | None) -> tuple[dict | None, dict]:
    """How `export(..., to="k3-layout", experts=...)` writes the routed experts: the `quantization_config` to write
    them under (the K3 checkpoint's own, from `conversion_report.json`; `None`: unquantised), and the report's record.

    Raises:
        ValueError: `experts="mxfp4"` for a folder whose experts were not imported from MXFP4 (no config to write);
            a recorded `quantization_config` that is not K3's MXFP4 (`k3_source.check_mxfp4_quantization`: edited).
        ImportError: MXFP4 experts without compressed-tensors.
    """
    try:
        source = json.loads((model_dir / "conversion_report.json").read_text())["source"]
        mxfp4 = source.get("format") == "k3" and source.get("mxfp4_experts") is True
        declared = source.get("k3_quantization_config") or (source.get("k3_text_config") or {}).get(
            "quantization_config") if mxfp4 else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        mxfp4, declared = False, None
    if experts == "unquantized":
        return None, {"format": "unquantized", "why": "requested (experts='unquantized'): .weight, values unchanged"}
    if declared is not None:  # as the import checked it (an edited record is refused before anything is written)
        from .k3_source import check_mxfp4_quantization

        check_mxfp4_quantization(declared, model_dir / "conversion_report.json")
    else:
        why = ("imported from MXFP4 experts, but conversion_report.json records no quantization_config (converted "
               "before attnres-hf recorded it: convert the K3 checkpoint again to export MXFP4)" if mxfp4 else
               "not imported from MXFP4 experts (conversion_report.json)")
        if experts == "mxfp4":
            raise ValueError(f"{model_dir}: experts='mxfp4' writes the experts as the MXFP4 K3 checkpoint they were "
                             f"imported from declares them, and this folder is {why}; export with --experts "
                             "unquantized")
        return None, {"format": "unquantized", "why": why}
    from .k3_source import check_compressed_tensors

    check_compressed_tensors()
    return declared, {
        "format": "mxfp4", "why": "requested (experts='mxfp4')" if experts else
        "imported from MXFP4 experts (conversion_report.json); --experts unquantized writes .weight",
        "how": "compressed-tensors' scale choice and MXFP4PackedCompressor, each expert decoded again and equal to "
               "the model's values bit for bit; a block whose checkpoint scale was larger than compressed-tensors "
               "picks for its values (every code at most 3, or all zero) is written with compressed-tensors' scale: "
               "the same values, other bytes"}


def _export_k3(model_dir: Path, output_dir: Path, config: AttnResConfig, files: list, force: bool,
               max_shard_size: int, trust_remote_code: bool, mode: dict, experts: str | None) -> dict:
    """`export(..., to="k3-layout")`: see the module docstring. Raises `UnsupportedSourceError` naming every setting
    K3's model does not have (another backbone, method or knob, a Full or odd block size, a rescaled router output)."""
    from huggingface_hub import save_torch_state_dict

    from .k3_layout import k3_from_backbone, remote_code_files, to_k3_state_dict
    from .mxfp4 import check_mxfp4_shapes, mxfp4_reads, mxfp4_state
    from .k3_source import K3StreamSource, check_k3_tensors, k3_source, read_k3_tensors

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
    quantization, expert_record = _k3_experts(model_dir, experts)
    config_source = ("the K3 checkpoint's own (conversion_report.json)" if fields is not derived else
                     "derived from the model's config (no conversion_report.json from a K3 checkpoint of the same "
                     "architecture in the folder)")
    streamed = mode["mode"] == "streamed"
    if streamed:
        reads = _k3_reads(_folder_reads(files), config.backbone)
        tensors = {name: torch.empty(read.shape, dtype=read.dtype, device="meta") for name, read in reads.items()}
    else:
        tensors = values = to_k3_state_dict(_read_tensors(files), config.backbone, layout="text")
    # the model's dtype (K3 keeps a few tensors fp32 in a bf16 model)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else most_common_dtype(tensors.values())
    if quantization is not None:  # each expert encoded (streamed: as it is written), checked to decode to its values
        fields = fields | {"quantization_config": quantization}
        check_mxfp4_shapes(tensors)
        if streamed:
            reads = mxfp4_reads(reads)
            tensors = {name: torch.empty(read.shape, dtype=read.dtype, device="meta") for name, read in reads.items()}
        else:
            print("Encoding the routed experts as MXFP4 (compressed-tensors) ...", flush=True)
            tensors = mxfp4_state(values)
    state = tensors
    print(f"Writing {len(tensors)} tensors in Kimi K3's text layout ({mode['mode']}) ...", flush=True)
    with staged_folder(output_dir, replace=force) as staging:
        (staging / "config.json").write_text(json.dumps(fields | {"dtype": str(dtype).removeprefix("torch.")},
                                                        indent=2) + "\n")
        if streamed:
            _write_streamed(reads, staging, max_shard_size)
        else:
            save_torch_state_dict(state, staging, max_shard_size=max_shard_size, safe_serialization=True)
        _copy_generation_config_and_tokenizer(model_dir, staging, trust_remote_code)
        written = k3_source(staging)  # the written folder, read as `attnres convert` reads it
        check_k3_tensors(written, AttnResConfig.from_dict(config.to_dict()))
        if streamed:  # every tensor read back (attnres-hf names) against the folder's, row chunks at a time
            identical = _read_back(_folder_reads(files), K3StreamSource(written).reads())["tensors_identical"]
        else:
            back = read_k3_tensors(written)  # MXFP4 experts decoded (bf16), compared in the model's dtype
            encoded = set(values) - set(state)
            identical = set(back) == set(values) and all(torch.equal(back[n].to(values[n].dtype), values[n])
                                                         and (back[n].dtype == values[n].dtype or n in encoded)
                                                         for n in values)
        report = {
            "attnres_hf_version": __version__, "to": "k3-layout", "source": str(model_dir),
            "output_dir": str(output_dir), "dtype": str(dtype).removeprefix("torch."), "tensors": len(tensors),
            "export": mode, "experts": expert_record, "k3_text_config": fields, "k3_text_config_source": config_source,
            "k3_remote_code_files": remote_code_files(fields),
            "verification": {"read_back_by_attnres_convert": True, "tensors_identical": identical,
                             "logits_compared": "no: no Kimi K3 runtime runs here"},
        }
        if not identical:
            raise RuntimeError(f"the K3 folder written for {model_dir} does not read back into the same tensors; "
                               "please report this")
        (staging / "export_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _streaming_mode(files: list[Path], stream) -> dict:
    """`{"mode", "why"}` of an export of the weight `files` (`export`'s `stream`).

    Raises:
        ValueError: `stream=True` for `.bin` weights (streaming reads safetensors).
    """
    from .streaming import STREAM_ABOVE_BYTES

    if stream is False:
        return {"mode": "in-memory", "why": "requested (stream=False)"}
    if any(path.suffix != ".safetensors" for path in files):
        if stream is True:
            raise ValueError(f"{files[0].parent} cannot be exported streamed: its weights are PyTorch .bin files "
                             "(streaming reads safetensors)")
        return {"mode": "in-memory", "why": "not streamable: .bin weights"}
    if stream is True:
        return {"mode": "streamed", "why": "requested (stream=True)"}
    fp32_bytes = 4 * sum(math.prod(entry.shape) for entry in stored_tensors(files).values())
    size = f"{fp32_bytes / 2**30:.2f} GiB in fp32"
    if fp32_bytes <= STREAM_ABOVE_BYTES:
        return {"mode": "in-memory", "why": f"{size}, at most STREAM_ABOVE_BYTES ({STREAM_ABOVE_BYTES / 2**30:g} GiB)"}
    return {"mode": "streamed", "why": f"{size}, over STREAM_ABOVE_BYTES ({STREAM_ABOVE_BYTES / 2**30:g} GiB)"}


def _folder_reads(files: list[Path]) -> dict[str, TensorRead]:
    """The AttnRes folder's tensors, read lazily under their own names, in the files' order (as `_read_tensors`)."""
    return identity_reads(stored_tensors(files))


def _k3_reads(folder: dict[str, TensorRead], backbone) -> dict[str, TensorRead]:
    """K3's text-layout tensors of the AttnRes folder's (`k3_layout.k3_export_parts`), each read lazily: one-to-one
    tensors in row chunks, the others (a pseudo-query, `A_log`, a convolution part) whole, each routed expert's from
    its own row of the stacked tensor.

    Raises:
        ValueError: naming the tensors K3's layout has no name for.
    """
    from .k3_layout import expand_experts, k3_export_parts, k3_piece

    parts, unnamed = k3_export_parts(folder, layout="text")
    if unnamed:
        raise ValueError(f"tensors with no name in K3's layout: {', '.join(sorted(unnamed)[:6])}")
    reads = {}
    for k3, (name, how, index) in parts.items():
        source = folder[name]
        experts = expand_experts({k3: (name, how, index)}, source.shape[0]) if how.endswith("_proj") else {
            k3: (name, how, index)}
        for k3_name, (_, part, e) in experts.items():
            if part == "one":
                reads[k3_name] = source
                continue
            expert = part in ("gate", "up", "down")
            meta = torch.empty(source.shape, dtype=source.dtype, device="meta")
            shape = tuple(k3_piece(part, e, meta[e] if expert else meta, backbone).shape)
            reads[k3_name] = TensorRead.whole(shape, source.dtype, source.where, lambda s=source, p=part, i=e, x=expert:
                                              k3_piece(p, i, s.rows(i, i + 1)[0] if x else s.rows(), backbone))
    return reads


def _write_streamed(reads: dict[str, TensorRead], folder: Path, max_shard_size: int) -> None:
    """The export's tensors written shard by shard as `save_torch_state_dict` names and fills them
    (`streaming.write_streamed`), each read from the AttnRes folder in row chunks."""
    from .streaming import StreamPlan, write_streamed

    targets = {name: torch.empty(read.shape, dtype=read.dtype, device="meta") for name, read in reads.items()}
    write_streamed(StreamPlan(config=None, model=None, targets=targets, sources=reads), folder, max_shard_size)


def _read_back(folder: dict[str, TensorRead], back: dict[str, TensorRead]) -> dict:
    """The streamed export's check: the written folder read back as `attnres convert` reads it (`back`, attnres-hf
    names) against the AttnRes folder's tensors (`folder`), every one, in row chunks (`sources.max_read_delta`)."""
    delta = max_read_delta(folder, back)
    return {"read_back_by_attnres_convert": True, "tensors_checked": len(folder), "max_abs_tensor_delta": delta,
            "tensors_identical": delta == 0.0 and set(back) == set(folder)}
