"""What trains: the depth routers only, LoRA adapters plus the routers, or everything."""

import os
import warnings

import torch
from transformers import PreTrainedModel

from .._checks import check_int
from ..modeling.backbones_moe import expert_gate_modules
from ..modeling.depth_mixing import DEPTH_MIXING, MIXING_MODULE_NAMES, is_depth_mixing_parameter

LORA_R, LORA_ALPHA, LORA_DROPOUT = 16, 32, 0.0
"""The LoRA recipe's defaults (rank, alpha, dropout): `prepare_model`, `lora_config` and `attnres train`'s."""

ROUTER_MODULES = MIXING_MODULE_NAMES
"""Module names of the depth-mixing modules, read from the method records (`DEPTH_MIXING[name].module_names`):
AttnRes routers (`model.layers.N.attn_res`, `model.layers.N.mlp_res`, `model.final_res`) and the rest of the family's
(DenseFormer `dwa`, MUDDFormer `mudd`, DCA `dca` / `final_dca`, mHC `attn_mhc` / `mlp_mhc`). `--method routers` trains
exactly these. A mixture-of-experts model's routing gates (`mlp.gate`, `expert_gate_modules`) route tokens to
experts, not over depth: they are backbone weights, trained by `lora`'s targets only when named, and by `full`."""

METHODS = ("routers", "lora", "qlora", "full")
DEFAULT_LEARNING_RATES = {"routers": 2e-4, "lora": 2e-4, "qlora": 2e-4, "full": 5e-5}
"""Starting points. Routers: one Adam step moves every logit `w . RMSNorm(v)` by up to `lr * hidden_size`, so a
larger rate turns the uniform routing of a retrofit into a sharp one at once and breaks the pretrained model."""


def is_router_parameter(name: str) -> bool:
    """True for the parameters of a depth-mixing module, e.g. `model.layers.3.mlp_res.query`,
    `model.layers.0.dwa.alpha` (a name component is one of `ROUTER_MODULES`)."""
    return is_depth_mixing_parameter(name)


def lora_module_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """Modules PEFT's LoRA can wrap in `model` (linear, embedding and convolution layers), by their last name
    component: `{"q_proj": ["model.layers.0.self_attn.q_proj", ...], ..., "lm_head": ["lm_head"]}`."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    names: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            names.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return dict(sorted(names.items()))


def default_lora_targets(model: PreTrainedModel) -> list[str]:
    """LoRA targets when none are given: every linear layer but the output head (PEFT's `all-linear`) and the
    mixture-of-experts routing gates of the model's family (`expert_gate_modules`, e.g. Qwen2-MoE's
    `shared_expert_gate`), by name. For a Llama-style model: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
    `up_proj`, `down_proj`; the experts' stacked weights (`experts.gate_up_proj`, `experts.down_proj`) are parameters,
    not linear layers, and are not adapted. Depth routers hold no linear layer; they train in full beside the
    adapters."""
    head = model.get_output_embeddings()
    gates = set(expert_gate_modules(model.config))
    linear = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and module is not head and name.rsplit(".", 1)[-1] not in gates]
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in linear))


def check_lora_targets(model: PreTrainedModel, targets: list[str] | str) -> list[str] | str:
    """`targets` if each one names at least one module LoRA can wrap in `model`, matched as PEFT matches them (a name
    equals the module path or ends it after a dot; a single string is a regular expression over whole paths, or
    `"all-linear"`).

    Raises:
        ValueError: a target that matches nothing (a misspelling would otherwise be skipped silently), naming the
            unmatched ones and the valid names of this model; a target naming a depth-mixing module (`ROUTER_MODULES`,
            trained in full through `modules_to_save`; as a regular expression, one that matches a router's path);
            an empty list. TypeError: `targets` is not a string or a list (or set) of strings.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    valid = lora_module_names(model)
    paths = [path for group in valid.values() for path in group]
    if isinstance(targets, (set, frozenset)):  # (PEFT's LoraConfig stores a list as a set)
        targets = sorted(targets)
    named = [targets] if isinstance(targets, str) else list(targets) if isinstance(targets, (list, tuple)) else []
    routers = [t for t in named if isinstance(t, str) and t.rsplit(".", 1)[-1] in ROUTER_MODULES]
    pattern = LoraConfig(target_modules=targets) if isinstance(targets, str) else None
    if pattern is not None and targets != "all-linear":  # a regular expression: the router paths it matches
        routers += [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in ROUTER_MODULES
                    and check_target_module_exists(pattern, name)]
    if routers:
        raise ValueError(f"lora_target_modules names depth-mixing modules ({', '.join(routers)}): they hold no layer "
                         "LoRA adapts and train in full instead (modules_to_save, as lora_config sets); valid "
                         f"names: {', '.join(valid)}")
    if isinstance(targets, str):
        if targets == "all-linear" or any(check_target_module_exists(pattern, p) for p in paths):
            return targets
        hint = (f"; one string is a regular expression over whole module paths: for the module name give a list, "
                f"[{targets!r}]" if targets in valid else "")
        raise ValueError(f"lora_target_modules {targets!r} matches no module of this model{hint}; valid names: "
                         f"{', '.join(valid)}")
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"lora_target_modules must be a list of module names or one regular expression, "
                        f"got {targets!r}")
    if not targets or not all(targets):
        raise ValueError(f"lora_target_modules must name at least one module (valid names: {', '.join(valid)}); "
                         f"got {list(targets)!r}")
    unmatched = [t for t in targets
                 if not any(check_target_module_exists(LoraConfig(target_modules=[t]), p) for p in paths)]
    if unmatched:
        raise ValueError(f"lora_target_modules not found in this model: {', '.join(unmatched)}; valid names: "
                         f"{', '.join(valid)}")
    return list(targets)


def expert_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names (from the layer on, e.g. `mlp.experts.gate_up_proj`) of the stacked mixture-of-experts weights of `model`:
    parameters of shape `(num_experts, out, in)` that no linear layer holds, so that `target_modules` cannot reach them
    and PEFT adapts them through `LoraConfig(target_parameters=...)`. Empty for a dense model."""
    return list(dict.fromkeys(name.split(".layers.", 1)[-1].split(".", 1)[-1] for name in _expert_paths(model)))


def _expert_paths(model: torch.nn.Module) -> list[str]:
    """Paths of the stacked expert weights: 3-D parameters of a module named `experts` (not, e.g., Kimi Linear's
    depthwise convolution, also 3-D)."""
    return [name for name, param in model.named_parameters() if param.dim() == 3 and ".experts." in f".{name}"]


def check_lora_target_parameters(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """`targets` if each one ends the path of a stacked expert weight of `model` (`expert_parameter_names`), matched
    as PEFT matches `target_parameters` (the path equals it or ends with it after a dot).

    Raises:
        ValueError: an empty list, an empty name, or a target that matches no stacked expert weight, naming the valid
            ones (none on a dense model). TypeError: `targets` is not a list of strings.
    """
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"lora_target_parameters must be a list of parameter names, got {targets!r}")
    valid = expert_parameter_names(model)
    paths = _expert_paths(model)
    if not targets or not all(t.strip() for t in targets):
        raise ValueError(f"lora_target_parameters must name at least one parameter; got {list(targets)!r}")
    unmatched = [t for t in targets if not any(p == t or p.endswith("." + t) for p in paths)]
    if unmatched:
        raise ValueError(f"lora_target_parameters not found among this model's stacked expert weights: "
                         f"{', '.join(unmatched)}; valid names: {', '.join(valid) or 'none (not a mixture-of-experts model)'}")
    return list(targets)


def prepare_model(
    model: PreTrainedModel,
    method: str,
    lora_r: int = LORA_R,
    lora_alpha: int = LORA_ALPHA,
    lora_dropout: float = LORA_DROPOUT,
    lora_target_modules: list[str] | str | None = None,
    lora_target_parameters: list[str] | None = None,
):
    """Set which parameters train, for `method` in `METHODS`.

    - `routers`: only router pseudo-queries and key norms; every other parameter is frozen.
    - `lora`: PEFT LoRA on `lora_target_modules` (default `default_lora_targets(model)`: every linear layer but the
      head), with the routers trained in full and saved with the adapter (`modules_to_save`). Returns the
      `PeftModel`. The adapters' initial values are random: seed first (`transformers.set_seed`) for repeatable runs.
      `lora_target_parameters` (e.g. `["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`,
      `expert_parameter_names`) adds adapters on a mixture-of-experts model's stacked expert weights, which are
      parameters rather than linear layers (PEFT `target_parameters`); by default the experts are not adapted.
    - `qlora`: `lora` on a 4-bit backbone (load it with `load_kwargs("qlora")`), after PEFT's
      `prepare_model_for_kbit_training`; the depth-mixing modules are unquantized fp32 and train in full. The 4-bit
      layers keep bitsandbytes' dequantize-and-matmul path (`quantization.keep_4bit_layers_trainable`), so that
      evaluations during training leave their gradients intact on every CPU and every layer shape.
    - `full`: everything.

    Raises:
        ValueError: an unknown method, `routers` on a model without routers, `qlora` on a model not loaded in 4 bits,
            a LoRA target that matches no module (see `check_lora_targets`) or no stacked expert weight
            (`check_lora_target_parameters`), or LoRA settings out of range.
            TypeError: `model` is not a `PreTrainedModel`.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if lora_target_parameters is not None and method not in ("lora", "qlora"):
        raise ValueError(f"lora_target_parameters applies to method 'lora' or 'qlora', not {method!r}")
    if method == "full":
        model.requires_grad_(True)
        return model
    if method == "qlora":
        if not getattr(model, "is_loaded_in_4bit", False):
            raise ValueError("method 'qlora' needs a 4-bit model: from_pretrained(folder, **load_kwargs('qlora'))")
        from peft import prepare_model_for_kbit_training

        from ..quantization import keep_4bit_layers_trainable

        keep_4bit_layers_trainable(model)  # evaluations must not repack the weights for a kernel without backward
        model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    if method in ("lora", "qlora"):
        from peft import get_peft_model

        return get_peft_model(model, lora_config(model, lora_r, lora_alpha, lora_dropout, lora_target_modules,
                                                 lora_target_parameters))
    if not _has_router_parameters(model):
        raise ValueError("method 'routers' needs depth routers: this model has depth_mixing='residual'")
    for name, param in model.named_parameters():
        param.requires_grad_(is_router_parameter(name))
    return model


def lora_config(
    model: PreTrainedModel,
    r: int = LORA_R,
    lora_alpha: int = LORA_ALPHA,
    lora_dropout: float = LORA_DROPOUT,
    target_modules: list[str] | str | None = None,
    target_parameters: list[str] | None = None,
    routers: bool = True,
):
    """The `peft.LoraConfig` of `prepare_model`'s `lora` recipe for `model`, checked against it: adapters on
    `target_modules` (default `default_lora_targets(model)`: every linear layer but the head) and, on a
    mixture-of-experts model, on the stacked expert weights named by `target_parameters`; with `routers`, the mixing
    modules of the model's method (`DEPTH_MIXING[depth_mixing].module_names`) in `modules_to_save`, so they train in
    full and are saved with the adapter (PEFT keeps the original beside each trained copy: with the adapter disabled,
    as in DPO's implicit reference, the model is the base). Give it to TRL's trainers as `peft_config=`, or to `peft.get_peft_model`.

    Raises:
        ValueError / TypeError: a target that matches nothing or names a depth-mixing module (`check_lora_targets`,
            `check_lora_target_parameters`), or LoRA settings out of range (`check_lora_settings`).
    """
    from peft import LoraConfig

    check_lora_settings(r, lora_alpha, lora_dropout)
    targets = default_lora_targets(model) if target_modules is None else target_modules
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=check_lora_targets(model, targets),
        target_parameters=None if target_parameters is None else check_lora_target_parameters(model, target_parameters),
        # the mixing modules of the model's method (its record's `module_names`)
        modules_to_save=(list(DEPTH_MIXING[model.config.depth_mixing].module_names)
                         if routers and _has_router_parameters(model) else None),
    )


def check_peft_config(model: PreTrainedModel, config) -> None:
    """Check a PEFT LoRA config written by hand (e.g. for TRL's `peft_config=`) against `model` before it is
    applied: its `target_modules` and `target_parameters` as `check_lora_targets` and `check_lora_target_parameters`
    do (PEFT itself skips a misspelt regular expression, or fails on a depth-mixing module with a message naming
    neither), and each of its `modules_to_save` names some module, matched as PEFT matches it (a misspelt one would
    leave, say, every router frozen). Configs of other PEFT methods pass unchecked.

    Raises:
        ValueError / TypeError: as those checks raise; a `modules_to_save` name that matches no module, or one
            name given as a string rather than a list.
    """
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        return
    if config.target_modules is not None:
        check_lora_targets(model, config.target_modules)
    if config.target_parameters:
        check_lora_target_parameters(model, list(config.target_parameters))
    if isinstance(config.modules_to_save, str):
        raise TypeError(f"modules_to_save must be a list of module names, got the string {config.modules_to_save!r}: "
                        f"give [{config.modules_to_save!r}]")
    paths = [name for name, _ in model.named_modules()]
    unmatched = [name for name in config.modules_to_save or ()
                 if not any(path == name or path.endswith("." + name) for path in paths)]
    if unmatched:
        raise ValueError(f"modules_to_save not found in this model: {', '.join(unmatched)} (the depth-mixing modules "
                         f"are {', '.join(ROUTER_MODULES)}; `lora_config(model)` names those this model has)")


def check_lora_settings(lora_r: int, lora_alpha: float, lora_dropout: float) -> None:
    """Raises TypeError/ValueError unless `lora_r` is a positive integer, `lora_alpha` a positive number and
    `lora_dropout` a probability in [0, 1)."""
    check_int("lora_r (the adapter rank)", lora_r, 1)
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or lora_alpha <= 0:
        raise ValueError(f"lora_alpha must be a positive number, got {lora_alpha!r}")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout must be a probability in [0, 1), got {lora_dropout!r}")


def load_kwargs(method: str) -> dict:
    """Extra `from_pretrained` arguments a method needs: `qlora` loads the backbone in 4 bits
    (`attnres_hf.quantization.qlora_quantization_config`); the others need none."""
    if method == "qlora":
        from ..quantization import qlora_quantization_config

        return {"quantization_config": qlora_quantization_config()}
    return {}


def _has_router_parameters(model: torch.nn.Module) -> bool:
    return any(is_router_parameter(name) for name, _ in model.named_parameters())


def merge_lora(base_model: str | os.PathLike | PreTrainedModel, adapter_dir: str | os.PathLike, output_dir=None,
               tokenizer=None, force: bool = False, allow_other_quantization: bool = False):
    """Merge a LoRA adapter (with its trained routers) into its base model; return the plain AttnRes model, and
    save it to `output_dir` when given.

    A folder `base_model` loads in full precision, the usual base to merge a QLoRA adapter into (`adapters`: a
    quantised `PreTrainedModel` must be quantised as the adapter's base was). The output folder is complete, like
    `attnres convert`'s: weights, `config.json` with `auto_map` and the modeling files, `generation_config.json`, and
    the tokenizer with its chat template (`tokenizer`, else the one `attnres train` saved with the adapter, else the
    base folder's), so it chats, serves and evaluates as the base does. It is written to a temporary folder and
    renamed into place.

    Raises:
        TypeError: `base_model` is neither a folder path nor a `PreTrainedModel`, or a path of the wrong type.
        FileNotFoundError: no `adapter_config.json` in `adapter_dir`, no base model folder, or (with `output_dir`) no
            tokenizer in `adapter_dir` nor the base folder and none given.
        FileExistsError: `output_dir` exists and `force` is false.
        ValueError: a quantised base the adapter was not trained on (`check_base_quantization`).

    All checked before any weight loads.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .adapters import check_adapter_dir, check_base_quantization, quantization_of

    if not isinstance(base_model, (str, os.PathLike, PreTrainedModel)):
        raise TypeError(f"base_model must be a model folder or a PreTrainedModel, got {type(base_model).__name__}")
    check_adapter_dir(adapter_dir)
    if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
        raise TypeError(f"output_dir must be a folder path, got {type(output_dir).__name__}")
    if not isinstance(base_model, PreTrainedModel) and not os.path.isfile(os.path.join(base_model, "config.json")):
        raise FileNotFoundError(f"{base_model} is not a model folder (no config.json there)")
    if isinstance(base_model, PreTrainedModel):
        check_base_quantization(quantization_of(base_model), adapter_dir, allow_other_quantization)
    if output_dir is not None:
        if os.path.exists(output_dir) and not force:
            raise FileExistsError(f"{output_dir} already exists; pass force=True to replace it")
        if tokenizer is None:
            base_folder = base_model if not isinstance(base_model, PreTrainedModel) else base_model.name_or_path
            source = next((folder for folder in (adapter_dir, base_folder) if _has_tokenizer(folder)), None)
            if source is None:
                raise FileNotFoundError(
                    f"no tokenizer in {adapter_dir} nor in the base folder: the merged folder could not be chatted "
                    "with or served; pass tokenizer=")
            tokenizer = AutoTokenizer.from_pretrained(source)
    if not isinstance(base_model, PreTrainedModel):
        base_model = AutoModelForCausalLM.from_pretrained(base_model)
    merged = PeftModel.from_pretrained(base_model, adapter_dir).merge_and_unload()
    if output_dir is not None:
        from .._io import staged_folder

        with staged_folder(output_dir, replace=force) as staging:
            merged.save_pretrained(staging)  # with generation_config.json
            tokenizer.save_pretrained(staging)
    return merged


def _has_tokenizer(folder) -> bool:
    return bool(folder) and any(os.path.isfile(os.path.join(folder, name))
                                for name in ("tokenizer.json", "tokenizer_config.json"))


def __getattr__(name: str):
    if name == "DEFAULT_LORA_TARGETS":  # deprecated: the targets come from the model
        warnings.warn("DEFAULT_LORA_TARGETS is deprecated; the default LoRA targets come from the model: "
                      "default_lora_targets(model)", FutureWarning, stacklevel=2)
        return ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
