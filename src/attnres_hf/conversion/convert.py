"""`attnres convert`: retrofit a checkpoint and write a complete, Hub-ready AttnRes folder, verified first.

The folder holds `model.safetensors` (sharded past `max_shard_size`), `config.json` with `auto_map`, the modeling
files, the tokenizer with its chat template, `generation_config.json`, a model card (`README.md`) and
`conversion_report.json`. It is written to a temporary sibling folder and renamed into place, so an interrupted
run never leaves a half-written `output_dir`.
"""

import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

from .. import __version__
from .._io import staged_folder
from .fla_layout import to_attnres_name
from .fla_source import FlaStreamSource, fla_installed, fla_source, is_fla_folder, verify_against_fla
from .gguf_stream import GGUFSource
from .gguf_tokenizer import load_gguf_tokenizer
from .k3_source import K3StreamSource, is_k3_folder, k3_source
from .model_card import model_card
from .hf_stream import HFSource
from .retrofit import (check_dtype, check_max_shard_size, check_output_folder, check_path_argument, check_representable,
                       load_source_config, split_gguf_path)
from .sources import ModelSource, Source, most_common_dtype
from .sources import continuation as _continuation
from .verify import PROBE_TEXT, verify_offloaded_conversion

STREAMED_NEW_TOKENS = 2
"""Greedy tokens a streamed conversion's check generates: the first comes with the probe's forward, each further one
reads every weight of the source from disk again (at 8B: 16 GB, and as long as the writing), while the output's are
read once (`verify_offloaded_conversion`); two, so the second continues from a generated token through the source's
KV cache. The in-memory check generates 32."""

def load_tokenizer(source: str | os.PathLike, gguf_file: str | None = None, trust_remote_code: bool = False):
    """The source's tokenizer (from the folder, or converted from the GGUF file with the pre-tokenizer the file
    declares, see `load_gguf_tokenizer`), or `None` if it has none.

    Raises:
        ValueError: the folder's tokenizer is its own code (`auto_map` in `tokenizer_config.json`, as Kimi's) and
            `trust_remote_code` is false (never an interactive prompt).
    """
    folder, gguf_file = split_gguf_path(source, gguf_file)
    if gguf_file is not None:
        return load_gguf_tokenizer(folder / gguf_file)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    check_tokenizer_code(folder, trust_remote_code)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=trust_remote_code)


def check_tokenizer_code(folder: str | os.PathLike, trust_remote_code: bool) -> None:
    """Refuse a folder whose tokenizer is its own code unless `trust_remote_code` (checked before any work;
    transformers would otherwise ask interactively), and a `tokenizer_config.json` that cannot be read.

    Raises:
        TypeError: `trust_remote_code` is not a bool.
        ValueError: naming the file: not JSON, not an object, an `auto_map` naming no tokenizer class or in the legacy
            list form (which transformers cannot save again), or remote code without `trust_remote_code`.
    """
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    code = tokenizer_code(Path(folder))
    if code and not trust_remote_code:
        raise ValueError(f"{folder}'s tokenizer is its own code ({code} in tokenizer_config.json's auto_map): pass "
                         "--trust-remote-code (Python: trust_remote_code=True) to run it, and the config code "
                         "transformers loads with it")


def tokenizer_code(folder: Path) -> str | None:
    """The remote-code tokenizer class `tokenizer_config.json` names in its `auto_map`, if any (`None` without the
    file or an `auto_map`); raises `ValueError` for a file transformers cannot read or save again."""
    file = folder / "tokenizer_config.json"
    if not file.is_file():
        return None
    try:
        fields = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{file} is not a JSON object")
    auto_map = fields.get("auto_map")
    if auto_map is None:
        return None
    if not isinstance(auto_map, dict):
        raise ValueError(f"{file}'s auto_map is {type(auto_map).__name__} (the legacy form, which transformers cannot "
                         'save again): write it as {"AutoTokenizer": [slow class or null, fast class or null]}')
    classes = auto_map.get("AutoTokenizer")
    if classes is None:
        return None
    named = [name for name in (classes if isinstance(classes, list) else []) if isinstance(name, str)]
    if not isinstance(classes, list) or len(classes) != 2 or not named:
        raise ValueError(f"{file}'s auto_map AutoTokenizer is {classes!r}: transformers reads [slow class or null, "
                         "fast class or null] with at least one class")
    return named[0]


def _write_folder(folder: Path, model, tokenizer, report: dict, max_shard_size: str) -> None:
    model.save_pretrained(folder, max_shard_size=max_shard_size)  # with the source's generation config (`retrofit`)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    model_card(report).save(folder / "README.md")
    (folder / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")


def _check_arguments(source, output_dir, gguf_file, attnres_block_size, depth_mixing, force, probe_text, tokenizer,
                     source_name, max_shard_size, verify_all, stream) -> None:
    """Types and values of `convert`'s own arguments (one-line `TypeError`/`ValueError`), before any file is read."""
    if not isinstance(source, PreTrainedModel):
        check_path_argument(source, "source (an HF folder, a .gguf file or a PreTrainedModel)")
    check_path_argument(output_dir, "output_dir")
    if gguf_file is not None and not isinstance(gguf_file, str):
        raise TypeError(f"gguf_file must be a file name (str) or None, got {gguf_file!r}")
    if attnres_block_size is not None and (not isinstance(attnres_block_size, int) or isinstance(attnres_block_size, bool)):
        raise TypeError(f"attnres_block_size must be an int (1 = Full AttnRes, or an even number), got {attnres_block_size!r}")
    if not isinstance(depth_mixing, str):
        raise TypeError(f"depth_mixing must be a method name (str), got {depth_mixing!r}")
    if not isinstance(force, bool):
        raise TypeError(f"force must be True or False, got {force!r}")
    if not isinstance(probe_text, str) or not probe_text.strip():
        raise ValueError(f"probe_text must be a non-empty string, got {probe_text!r}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must be a transformers tokenizer or None, got {type(tokenizer).__name__}")
    if source_name is not None and not isinstance(source_name, str):
        raise TypeError(f"source_name must be a str or None, got {source_name!r}")
    if not isinstance(verify_all, bool):
        raise TypeError(f"verify_all must be True or False, got {verify_all!r}")
    if not isinstance(stream, bool) and stream != "auto":
        raise TypeError(f"stream must be True, False or 'auto', got {stream!r}")
    check_max_shard_size(max_shard_size)


def convert(
    source: str | os.PathLike | PreTrainedModel,
    output_dir: str | os.PathLike,
    gguf_file: str | None = None,
    attnres_block_size: int | None = None,
    depth_mixing: str = "attnres",
    dtype: str = "float32",
    force: bool = False,
    probe_text: str = PROBE_TEXT,
    tokenizer=None,
    source_name: str | None = None,
    max_shard_size: str = "5GB",
    trust_remote_code: bool = False,
    verify_all: bool = False,
    stream: bool | str = "auto",
    **config_overrides,
) -> dict:
    """Retrofit `source` into AttnRes, verify it against the source, and write a complete folder to `output_dir`.

    Args:
        source: an HF folder, a `.gguf` file (or folder + `gguf_file`), an in-memory `PreTrainedModel`, or a
            flash-linear-attention `TransformerForCausalLM` folder (`model_type: "transformer"`; `fla_source`): with
            `attnres_block_size` in its config its trained routers are imported as they are (no option may change
            them), and the report compares the result with fla's own model (`verify_against_fla`: `compared_with`,
            `exact`).
        attnres_block_size: sub-layers per block (1 = Full AttnRes; default about 8 blocks).
        depth_mixing: one of `DEPTH_MIXING_METHODS` (`"attnres"`, `"residual"`, `"denseformer"`, `"muddformer"`,
            `"dca"`, `"mhc"`); every one starts exactly as the source.
        dtype: dtype of the written weights (`float32`, `bfloat16`, `float16`, any floating torch dtype or its name,
            or `"auto"`: the source's, as transformers' `from_pretrained(dtype="auto")` reads it); verification always
            runs in fp32.
        force: replace an existing `output_dir`.
        tokenizer: for an in-memory source; loaded from the source otherwise.
        source_name: how the report and model card name the source (e.g. its Hub id); default: its path.
        trust_remote_code: run the source folder's own tokenizer code (a `tokenizer_config.json` `auto_map`, as
            Kimi's tokenizers have); without it such a folder is refused (`load_tokenizer`).
        verify_all: a GGUF source: compare every weight of the loaded and the converted model with the file's
            dequantised tensors. Default: every kind of tensor in the first and the last block
            (`sampled_gguf_tensors`; SmolLM2: 20 of 272 weights), which checks each rule of the file-to-model
            mapping; the report's `gguf_tensors_checked` of `gguf_tensors` says which. The logits are compared
            either way.
        stream: a folder of safetensors weights (HF, flash-linear-attention or Kimi K3) or a GGUF file (`sources`:
            every weight written also compared with the file's dequantised tensor): `True` converts it
            streamed (`streaming`: read tensor by tensor through its `sources.Source`, written shard by shard as it is
            read; checked with every module offloaded to disk, one module's weights resident at a time, and a 2-token
            greedy continuation, `STREAMED_NEW_TOKENS`: a retrofit's logits against the source's backbone model read
            through the same `Source`; an fla or K3 AttnRes checkpoint's every written tensor against the
            checkpoint's, since their own code does not run in a streamed check), `False` in memory (source and
            AttnRes model resident: about twice the fp32 size of the model), `"auto"` (default) streamed when the
            model's parameters exceed `STREAM_ABOVE_BYTES` in fp32 (1 GiB) and its tensors can be streamed. The
            report's `conversion.mode` says which ran, `conversion.why` why (streamed: `conversion.seconds`, the
            writing's and the check's wall time). A model in memory is converted in memory.
        **config_overrides: further `AttnResConfig` fields (e.g. `attnres_rescale_output=False`).

    Returns:
        The conversion report (also written as `conversion_report.json`).

    Raises:
        FileExistsError: `output_dir` exists and `force` is false (checked before any work).
        TypeError, ValueError: a wrong-typed or invalid argument (checked before any file is read).
        FileNotFoundError, ValueError, KeyError: see `retrofit`; raised before anything is written (an HF folder
            whose tensors do not cover the model its config builds is a `ValueError` naming them; the config keys its
            family does not use are a warning and the report's `source.unused_config_keys`). From a GGUF file,
            a tensor of the file that the model would drop, or a converted weight that is not the file's tensor
            (compared in fp32 after dequantisation) is a `ValueError` naming it. From an fla folder: every fla option
            without an exact counterpart, a tensor with no place, of another shape or missing (`ValueError`), an
            option that would change its trained routers (`ValueError`), fla not installed (`ImportError`).
            `stream=True` for a source that cannot be streamed is a `ValueError` saying why.
    """
    _check_arguments(source, output_dir, gguf_file, attnres_block_size, depth_mixing, force, probe_text, tokenizer,
                     source_name, max_shard_size, verify_all, stream)
    output_dir = check_output_folder(output_dir, force, *([] if isinstance(source, PreTrainedModel) else [source]))
    if tokenizer is None and not isinstance(source, PreTrainedModel) and Path(source).is_dir():
        check_tokenizer_code(source, trust_remote_code)
    target_dtype = check_dtype(dtype, auto=True)

    overrides = dict(config_overrides, depth_mixing=depth_mixing)
    if attnres_block_size is not None:
        overrides["attnres_block_size"] = attnres_block_size
    if stream is True and isinstance(source, PreTrainedModel):
        raise ValueError("stream=True: a model in memory is converted in memory (streaming reads safetensors folders "
                         "and GGUF files)")
    opened = open_source(source, gguf_file, verify_all)  # fails fast on an unsupported family or a bad file
    overrides = opened.overrides(**overrides)  # invalid options fail here, and any that would change trained routers
    opened.check_tensors(overrides)
    in_memory = isinstance(source, PreTrainedModel)  # its tokenizer is the caller's; it has no files to stream
    if tokenizer is None and opened.kind == "gguf":  # built from the file's vocabulary: not instant
        print(f"Converting the tokenizer of {opened.path.name} ...", flush=True)
    if not in_memory:
        tokenizer = tokenizer or load_tokenizer(source, gguf_file, trust_remote_code)
    name = source_name or (opened.name if in_memory else str(source))
    source_fields = _source_fields(name, opened, tokenizer, source, gguf_file)
    plan, mode = (None, opened.not_streamable()) if in_memory else _streaming_choice(opened, target_dtype, stream,
                                                                                      overrides)
    if plan is not None:
        return _convert_streamed(plan, output_dir, tokenizer, probe_text, force, mode, source_fields, max_shard_size)

    # verified here on the CPU in torch; the kernels the output is for (`attnres_implementation`) named in its config
    implementation = overrides.get("attnres_implementation", "torch")
    loaded = opened.load_model(overrides | {"attnres_implementation": "torch"} if implementation != "torch"
                               else overrides, target_dtype)
    model, target_dtype = loaded.model, loaded.dtype
    for key, tensor in model.state_dict().items():  # an outlier beyond a float16 output's range: refused, not inf
        check_representable(key, tensor, loaded.kept.get(key, target_dtype), name)

    input_ids = _probe_ids(tokenizer, probe_text, model.config.vocab_size)
    verification = opened.verify(loaded, input_ids)
    if tokenizer is not None:
        for which in ("source", "converted"):
            if f"{which}_continuation_ids" in verification:
                verification[f"{which}_continuation"] = tokenizer.decode(verification[f"{which}_continuation_ids"])
    kept = {key: tensor.detach().to(loaded.kept[key], copy=True) for key, tensor in model.state_dict().items()
            if key in loaded.kept}  # K3's fp32 tensors of a bf16 checkpoint
    model = model.to(target_dtype)
    model.config.backbone.dtype = target_dtype  # the written dtype, not the fp32 the source was verified in
    model.config.attnres_implementation = implementation
    for key, tensor in model.state_dict(keep_vars=True).items():  # parameters and buffers
        if key in kept:
            tensor.data = kept[key]
    dtype = most_common_dtype(model.state_dict().values())  # K3 keeps a few tensors fp32: the most values'
    report = _report(source_fields, output_dir, dtype, model.config, verification, {"mode": "in-memory", "why": mode})
    with staged_folder(output_dir, replace=force) as staging:
        _write_folder(staging, model, tokenizer, report, max_shard_size)
    return report


def open_source(source: str | os.PathLike | PreTrainedModel, gguf_file: str | None = None,
                verify_all: bool = False) -> Source:
    """The `sources.Source` of `source`, its kind chosen from what it is: a model in memory (`ModelSource`), a
    flash-linear-attention transformer folder (`fla_source.FlaStreamSource`), a Kimi K3 folder
    (`k3_source.K3StreamSource`), a GGUF file (`gguf_stream.GGUFSource`) or a transformers folder (`HFSource`); its
    config and files checked (headers only, no weight read).

    Raises:
        FileNotFoundError, ValueError: a missing folder, config or weights; a truncated or corrupt weight file; tensors
            that do not fill the model its config builds (naming them).
        UnsupportedSourceError (a `ValueError`): a family, or an fla or K3 option, with no exact counterpart here.
    """
    if isinstance(source, PreTrainedModel):
        return ModelSource(source)
    if gguf_file is None and is_fla_folder(source):  # refuses every fla option with no exact counterpart
        return FlaStreamSource(fla_source(source))
    if gguf_file is None and is_k3_folder(source):  # refuses every K3 field or value with no exact counterpart
        return K3StreamSource(k3_source(source))
    config = load_source_config(source, gguf_file)
    folder, file_name = split_gguf_path(source, gguf_file)
    return HFSource(source, config) if file_name is None else GGUFSource(folder / file_name, config, verify_all)


def _report(source_fields: dict, output_dir, dtype: torch.dtype, config, verification: dict, mode: dict) -> dict:
    """The conversion report (`conversion_report.json`)."""
    return {
        "attnres_hf_version": __version__,
        "source": source_fields,
        "output_dir": str(output_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "conversion": mode,
        "config": {
            "depth_mixing": config.depth_mixing,
            "attnres_block_size": config.attnres_block_size,
            "num_attnres_blocks": config.num_attnres_blocks,
            "num_sublayers": config.num_sublayers,
            "attnres_rescale_output": config.attnres_rescale_output,
        },
        "verification": verification,
    }


def _streaming_choice(source, target_dtype, stream, overrides) -> tuple:
    """`(plan, mode)`: the `StreamPlan` when this `sources.Source` converts streamed (else `None`), and why each
    way."""
    from .streaming import STREAM_ABOVE_BYTES, stream_plan

    if stream is False:
        return None, "requested (stream=False)"
    auto = target_dtype == "auto"
    plan = stream_plan(source, source.checkpoint_dtype() if auto else target_dtype, auto, **overrides)
    if isinstance(plan, str):
        if stream is True:
            raise ValueError(f"{source.path} cannot be converted streamed: {plan}")
        return None, f"not streamable: {plan}"
    fp32_bytes = sum(tensor.numel() for tensor in plan.targets.values()) * 4
    if stream is True:
        return plan, {"mode": "streamed", "why": "requested (stream=True)"}
    if fp32_bytes <= STREAM_ABOVE_BYTES:
        return None, f"{fp32_bytes / 2**30:.2f} GiB in fp32, at most STREAM_ABOVE_BYTES ({STREAM_ABOVE_BYTES / 2**30:g} GiB)"
    return plan, {"mode": "streamed", "why": f"{fp32_bytes / 2**30:.2f} GiB in fp32, over STREAM_ABOVE_BYTES "
                                            f"({STREAM_ABOVE_BYTES / 2**30:g} GiB)"}


def _source_fields(name: str, opened: Source, tokenizer, source, gguf_file: str | None = None) -> dict:
    """The report's `source` record: `name`, `gguf_file`, the source's own fields (`Source.report_fields`) and the
    folder's tokenizer code."""
    folder = not isinstance(source, PreTrainedModel) and Path(source).is_dir()
    fields = opened.report_fields()
    return {"name": name, "gguf_file": gguf_file, "model_type": fields.pop("model_type"),
            "unused_config_keys": fields.pop("unused_config_keys"),
            "tokenizer_code": tokenizer_code(Path(source)) if tokenizer is not None and folder else None, **fields}


def _convert_streamed(plan, output_dir, tokenizer, probe_text, force, mode, source_fields: dict,
                      max_shard_size="5GB") -> dict:
    """`convert` of a folder read through a `sources.Source`, streamed (`streaming`): the weights written shard by
    shard into the staging folder, then checked with every module offloaded to disk (`offloaded`): a retrofit's
    logits against the source's backbone model read through the same `Source`; a source with trained routers (an fla
    or K3 AttnRes model) every written tensor against the source's, and fla's the written folder's logits against
    fla's own model of the source folder (`verify_against_fla`, offloaded too), K3's the converted model's greedy
    continuation (no model of K3's own code runs here). The report's `conversion.seconds`: each phase's wall time."""
    from ..modeling import AttnResForCausalLM
    from .offloaded import offloaded
    from .streaming import write_folder_files, write_streamed

    input_ids = _probe_ids(tokenizer, probe_text, plan.config.vocab_size)
    with staged_folder(output_dir, replace=force) as staging:
        start = time.perf_counter()
        write_folder_files(plan, staging, generation_config=plan.source.generation_config())
        print(f"Writing {len(plan.targets)} tensors ({plan.num_bytes / 2**30:.2f} GiB), streamed from the source "
              "files ...", flush=True)
        write_streamed(plan, staging, max_shard_size, progress=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        written = time.perf_counter()
        against_fla = plan.source.kind == "fla" and plan.source.imported_routers and fla_installed()
        if against_fla:
            print(f"Checking every tensor written against the checkpoint's, and the written folder's logits on "
                  f"{input_ids.shape[1]} probe tokens and {STREAMED_NEW_TOKENS} greedy tokens against fla's own model, "
                  "both offloaded to disk ...", flush=True)
        elif plan.source.imported_routers:
            print(f"Checking every tensor written against the checkpoint's, and a {STREAMED_NEW_TOKENS}-token greedy "
                  "continuation of the written folder offloaded to disk ...", flush=True)
        else:
            print(f"Verifying on {input_ids.shape[1]} probe tokens, the source and the written folder offloaded to "
                  f"disk (one module's weights resident at a time; {STREAMED_NEW_TOKENS} greedy tokens) ...",
                  flush=True)
        # the source's weights as they were written (a conversion into another dtype compares the conversion, not
        # the rounding, as the in-memory check does before the output is cast)
        rounded = {name: plan.targets[name].dtype for name, read in plan.sources.items()
                   if plan.targets[name].dtype != read.dtype and plan.targets[name].dtype != torch.float32}
        with offloaded(staging, AttnResForCausalLM) as model:
            if against_fla:  # fla's own model too
                fla_rounded = {name: rounded[ours] for name in plan.source.stored()
                               if (ours := to_attnres_name(name)) in rounded}  # (fla's names)
                verification = _written_tensors_check(plan, staging) | verify_against_fla(
                    plan.source.path, model, input_ids, new_tokens=STREAMED_NEW_TOKENS, rounded_to=fla_rounded) | {
                    "logits_compared": "yes", "source_weights_rounded_to": sorted(
                        {str(d).removeprefix("torch.") for d in fla_rounded.values()})}
            elif plan.source.imported_routers:
                verification = _written_tensors_check(plan, staging) | _continuation(
                    model, input_ids, STREAMED_NEW_TOKENS)
            else:
                with offloaded(plan.source, rounded_to=rounded) as source_model:
                    verification = verify_offloaded_conversion(source_model, model, input_ids,
                                                               new_tokens=STREAMED_NEW_TOKENS)
                verification["source_weights_rounded_to"] = sorted({str(d).removeprefix("torch.")
                                                                    for d in rounded.values()})
        if plan.source.kind == "gguf":  # every weight written against the file's dequantised tensor
            print(f"Checking every weight written against {plan.source.path.name} ...", flush=True)
            checked = _written_tensors_check(plan, staging)
            verification |= {"gguf_tensors_checked": checked["tensors_checked"],
                             "gguf_tensors": checked["tensors_checked"],
                             "gguf_max_abs_delta": checked["max_abs_tensor_delta"]}
        if tokenizer is not None:
            for which in ("source", "converted"):
                if f"{which}_continuation_ids" in verification:
                    verification[f"{which}_continuation"] = tokenizer.decode(verification[f"{which}_continuation_ids"])
        dtype = most_common_dtype(plan.targets.values())
        seconds = {"write": round(written - start, 2), "verify": round(time.perf_counter() - written, 2)}
        report = _report(source_fields, output_dir, dtype, plan.config, verification, mode | {"seconds": seconds})
        model_card(report).save(staging / "README.md")
        (staging / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _written_tensors_check(plan, folder: Path) -> dict:
    """Every tensor written into `folder` from the source (`plan.sources`) against the source's, as read through its
    `Source` (`sources.max_read_delta`: row chunks, fp32): `tensors_checked`, `max_abs_tensor_delta`,
    `tensors_identical`, and `logits_compared` (no: the source's own code does not run here)."""
    from .sources import identity_reads, max_read_delta, safetensors_files, stored_tensors

    written = identity_reads(stored_tensors(safetensors_files(folder)))
    delta = max_read_delta(plan.sources, written, {name: plan.targets[name].dtype for name in plan.sources})
    why = {"fla": "flash-linear-attention is not installed (pip install \"attnres-hf[fla]\"), whose own model the "
                  "logits are compared with",
           "k3": "Kimi K3's own model does not run here"}.get(plan.source.kind, "the source's own model does not run")
    return {"tensors_checked": len(plan.sources), "max_abs_tensor_delta": delta, "tensors_identical": delta == 0.0,
            "logits_compared": f"no: the written tensors are compared with the checkpoint's; {why}"}



def _probe_ids(tokenizer, probe_text: str, vocab_size: int) -> torch.Tensor:
    """The probe's token ids `(1, seq_len)`: `probe_text` tokenized, or 64 fixed pseudo-random ids without a
    tokenizer."""
    if tokenizer is not None:
        return tokenizer(probe_text, return_tensors="pt").input_ids
    print("The source has no tokenizer: the probe is 64 random token ids, and the output will have none "
          "(save one into it for text commands such as attnres routing)", flush=True)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (1, 64), generator=generator)
