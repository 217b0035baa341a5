"""A LoRA adapter's base quantisation: recorded when the adapter is saved, checked wherever it meets a base model.

A LoRA adapter is fit to the weights of the base it trained on. A QLoRA adapter trained on an NF4 base with double
quantization corrects *that* base's rounding; on a base rounded another way (`BitsAndBytesConfig(load_in_4bit=True)`
alone is FP4 without double quantization, `load_in_8bit` is int8) its correction is wrong and PEFT loads it without a
word. So `attnres train` writes `base_quantization.json` beside PEFT's `adapter_config.json` in every adapter folder
(the final one and each checkpoint), and `load_adapter` / `merge_lora` compare it with the base before the adapter's
weights load:

- a base quantised the way the adapter's base was: accepted (the compute dtype is free: it does not change the
  stored weights);
- a full-precision base: accepted, whatever the adapter trained on. It holds the weights every quantisation rounds,
  and merging a QLoRA adapter into it is QLoRA's own last step (the merged model then differs from the adapted 4-bit
  model by the base's rounding only);
- a base quantised another way, or a quantised base for an adapter trained on full precision: `ValueError` naming
  both and the fix, unless `allow_other_quantization=True`. An error rather than a warning because the result is a
  silently different model, and a warning among transformers' load-time warnings is easily missed; refusing before
  anything loads loses nothing.

An adapter without the file (written by PEFT alone, or by an older attnres-hf) is not checked: nothing says what its
base was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BASE_QUANTIZATION_FILE = "base_quantization.json"

# What decides a base's stored weights, per quantisation method (transformers' `quant_method`); the other fields
# (compute and storage dtypes, CPU offload, the int8 outlier threshold) change how it computes, not what it holds.
# A method not listed here is compared on its whole config.
_WEIGHT_FIELDS = {
    "bitsandbytes": lambda c: ({"bits": 4, "quant_type": c.get("bnb_4bit_quant_type"),
                                "double_quant": bool(c.get("bnb_4bit_use_double_quant"))}
                               if c.get("load_in_4bit") else {"bits": 8}),
}


def quantization_of(model) -> dict | None:
    """The quantization config (`to_dict()`) a loaded model, or the base of a `PeftModel`, was quantised with;
    `None` for a full-precision model."""
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    return json.loads(json.dumps(quantization if isinstance(quantization, dict) else quantization.to_dict()))


def _weights_key(quantization: dict | None) -> dict | None:
    if quantization is None:
        return None
    method = str(quantization.get("quant_method"))
    fields = _WEIGHT_FIELDS.get(method)
    return {"quant_method": method, **(fields(quantization) if fields else quantization)}


def describe_quantization(quantization: dict | None) -> str:
    """A one-line description: `full precision`, `bitsandbytes 4-bit nf4 with double quantization`, ..."""
    key = _weights_key(quantization)
    if key is None:
        return "full precision (not quantised)"
    if key["quant_method"] == "bitsandbytes":
        if key["bits"] == 8:
            return "bitsandbytes 8-bit (int8)"
        return (f"bitsandbytes 4-bit {key['quant_type']} "
                f"{'with' if key['double_quant'] else 'without'} double quantization")
    return f"{key['quant_method']} {json.dumps({k: v for k, v in key.items() if k != 'quant_method'}, sort_keys=True)}"


def save_base_quantization(model, adapter_dir: str | os.PathLike) -> Path:
    """Write `base_quantization.json` (the base's quantization config, or `null`, and its description) into
    `adapter_dir`; returns its path. `model` is the `PeftModel` being saved (or its base)."""
    quantization = quantization_of(model)
    path = Path(adapter_dir) / BASE_QUANTIZATION_FILE
    record = {"quantization_config": quantization, "description": describe_quantization(quantization)}
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def base_quantization(adapter_dir: str | os.PathLike) -> tuple[bool, dict | None]:
    """`(recorded, quantization_config)`: whether `adapter_dir` records its base's quantisation, and the config
    (`to_dict()` form; `None` for a full-precision base).

    Raises:
        ValueError: the record is not valid JSON or lacks its `quantization_config` entry.
    """
    path = Path(adapter_dir) / BASE_QUANTIZATION_FILE
    if not path.is_file():
        return False, None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(record, dict) or "quantization_config" not in record:
        raise ValueError(f"{path} has no 'quantization_config' entry")
    quantization = record["quantization_config"]
    if quantization is not None and not isinstance(quantization, dict):
        raise ValueError(f"{path}: 'quantization_config' must be an object or null, got {quantization!r}")
    return True, quantization


def base_quantization_config(adapter_dir: str | os.PathLike):
    """The transformers quantization config to load the adapter's base with (`from_pretrained(folder,
    quantization_config=...)`), or `None` for a full-precision base or an adapter that records none."""
    _, quantization = base_quantization(adapter_dir)
    if quantization is None:
        return None
    from transformers.quantizers.auto import AutoQuantizationConfig

    return AutoQuantizationConfig.from_dict(quantization)


def check_base_quantization(quantization: dict | None, adapter_dir: str | os.PathLike,
                            allow_other_quantization: bool = False) -> None:
    """Refuse a base quantised (`quantization`, a config's `to_dict()` or `None`) otherwise than the adapter's base
    was (rules in the module docstring).

    Raises:
        ValueError: the base is quantised and its stored weights differ in kind from the adapter's base, unless
            `allow_other_quantization`; or the record is unreadable.
    """
    recorded, trained_on = base_quantization(adapter_dir)
    if not recorded or quantization is None or allow_other_quantization:
        return
    if _weights_key(quantization) != _weights_key(trained_on):
        raise ValueError(
            f"the adapter in {adapter_dir} was trained on a base in {describe_quantization(trained_on)} "
            f"({BASE_QUANTIZATION_FILE}), but this base is in {describe_quantization(quantization)}: its LoRA "
            "weights correct the rounding of their own base, so on this one the model would be a different one. "
            "Load the base as it was trained (attnres_hf.training.load_adapter(base_folder, adapter_dir) does; or "
            "from_pretrained(folder, quantization_config=base_quantization_config(adapter_dir))), or in full "
            "precision to merge, or pass allow_other_quantization=True"
        )


def check_adapter_dir(adapter_dir) -> None:
    """Raises TypeError for a non-path, FileNotFoundError for a folder without PEFT's `adapter_config.json`."""
    if not isinstance(adapter_dir, (str, os.PathLike)):
        raise TypeError(f"adapter_dir must be a folder path, got {type(adapter_dir).__name__}")
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise FileNotFoundError(f"{adapter_dir} holds no LoRA adapter (adapter_config.json); `attnres train --method "
                                "lora` writes one to its --output-dir")


def load_adapter(base_model, adapter_dir: str | os.PathLike, allow_other_quantization: bool = False,
                 **from_pretrained_kwargs):
    """Load a LoRA adapter (with its trained routers) on its base, quantised as the adapter's base was; returns the
    `peft.PeftModel` in eval mode.

    Args:
        base_model: a model folder, loaded with the quantization config the adapter records
            (`base_quantization_config`) unless `quantization_config` is among `from_pretrained_kwargs`; or a
            loaded `PreTrainedModel`.
        adapter_dir: the adapter folder (`attnres train --method lora|qlora --output-dir`).
        allow_other_quantization: skip the check of the base's quantisation against the adapter's.
        from_pretrained_kwargs: more arguments for `AutoModelForCausalLM.from_pretrained` (`dtype`, `device_map`, a
            `quantization_config` with another compute dtype, ...).

    Raises:
        TypeError / FileNotFoundError: `base_model` is neither a folder nor a `PreTrainedModel`, no adapter in
            `adapter_dir`, no `config.json` in the base folder. ValueError: the base is quantised otherwise than the
            adapter's base (`check_base_quantization`). All before any weight loads.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from ..modeling.backbones_moe import dispatch_kda_by_device

    if not isinstance(base_model, (str, os.PathLike, PreTrainedModel)):
        raise TypeError(f"base_model must be a model folder or a PreTrainedModel, got {type(base_model).__name__}")
    check_adapter_dir(adapter_dir)
    if not isinstance(base_model, PreTrainedModel):
        if not os.path.isfile(os.path.join(base_model, "config.json")):
            raise FileNotFoundError(f"{base_model} is not a model folder (no config.json there)")
        if "quantization_config" not in from_pretrained_kwargs:
            from_pretrained_kwargs["quantization_config"] = base_quantization_config(adapter_dir)
        asked = from_pretrained_kwargs["quantization_config"]
        asked = None if asked is None else json.loads(json.dumps(asked.to_dict()))
        check_base_quantization(asked, adapter_dir, allow_other_quantization)
        # (a transformers Kimi Linear base: fla's KDA kernels on CUDA tensors only, as `attnres train` trained it)
        base_model = dispatch_kda_by_device(AutoModelForCausalLM.from_pretrained(base_model, **from_pretrained_kwargs))
    check_base_quantization(quantization_of(base_model), adapter_dir, allow_other_quantization)
    return PeftModel.from_pretrained(base_model, adapter_dir).eval()
