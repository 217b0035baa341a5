"""What trains: the depth routers only, LoRA adapters plus the routers, or everything."""

import os

import torch
from transformers import PreTrainedModel

from ..modeling.depth_mixing import MIXING_MODULE_NAMES, is_depth_mixing_parameter

ROUTER_MODULES = MIXING_MODULE_NAMES
"""Module names of the depth-mixing modules, read from the method records (`DEPTH_MIXING[name].module_names`):
AttnRes routers (`model.layers.N.attn_res`, `model.layers.N.mlp_res`, `model.final_res`) and the rest of the family's
(DenseFormer `dwa`, MUDDFormer `mudd`, DCA `dca` / `final_dca`, mHC `attn_mhc` / `mlp_mhc`). `--method routers` trains
exactly these."""

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""LoRA targets for `model_type="attnres"` (PEFT ships none for it): every attention and MLP projection."""

METHODS = ("routers", "lora", "qlora", "full")
DEFAULT_LEARNING_RATES = {"routers": 2e-4, "lora": 2e-4, "qlora": 2e-4, "full": 5e-5}
"""Starting points. Routers: one Adam step moves every logit `w . RMSNorm(v)` by up to `lr * hidden_size`, so a
larger rate turns the uniform routing of a retrofit into a sharp one at once and breaks the pretrained model."""


def is_router_parameter(name: str) -> bool:
    """True for the parameters of a depth-mixing module, e.g. `model.layers.3.mlp_res.query`,
    `model.layers.0.dwa.alpha` (a name component is one of `ROUTER_MODULES`)."""
    return is_depth_mixing_parameter(name)


def prepare_model(
    model: PreTrainedModel,
    method: str,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    lora_target_modules: list[str] | None = None,
):
    """Set which parameters train, for `method` in `METHODS`.

    - `routers`: only router pseudo-queries and key norms; every other parameter is frozen.
    - `lora`: PEFT LoRA on `lora_target_modules` (default `DEFAULT_LORA_TARGETS`), with the routers trained in full
      and saved with the adapter (`modules_to_save`). Returns the `PeftModel`.
    - `qlora`: `lora` on a 4-bit backbone (load it with `load_kwargs("qlora")`), after PEFT's
      `prepare_model_for_kbit_training`; the depth-mixing modules are unquantized fp32 and train in full.
    - `full`: everything.

    Raises:
        ValueError: an unknown method, `routers` on a model without routers, or `qlora` on a model not loaded in 4 bits.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "full":
        model.requires_grad_(True)
        return model
    if method == "qlora":
        if not getattr(model, "is_loaded_in_4bit", False):
            raise ValueError("method 'qlora' needs a 4-bit model: from_pretrained(folder, **load_kwargs('qlora'))")
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    if method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            task_type="CAUSAL_LM",
            r=lora_r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=list(lora_target_modules or DEFAULT_LORA_TARGETS),
            modules_to_save=list(ROUTER_MODULES) if _has_router_parameters(model) else None,
        )
        return get_peft_model(model, config)
    if not _has_router_parameters(model):
        raise ValueError("method 'routers' needs depth routers: this model has depth_mixing='residual'")
    for name, param in model.named_parameters():
        param.requires_grad_(is_router_parameter(name))
    return model


def load_kwargs(method: str) -> dict:
    """Extra `from_pretrained` arguments a method needs: `qlora` loads the backbone in 4 bits
    (`attnres_hf.quantization.qlora_quantization_config`); the others need none."""
    if method == "qlora":
        from ..quantization import qlora_quantization_config

        return {"quantization_config": qlora_quantization_config()}
    return {}


def _has_router_parameters(model: torch.nn.Module) -> bool:
    return any(is_router_parameter(name) for name, _ in model.named_parameters())


def merge_lora(base_model: str | os.PathLike | PreTrainedModel, adapter_dir: str | os.PathLike, output_dir=None):
    """Merge a LoRA adapter (with its trained routers) into its base model; return the plain AttnRes model, and
    save it to `output_dir` when given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not isinstance(base_model, PreTrainedModel):
        base_model = AutoModelForCausalLM.from_pretrained(base_model)
    merged = PeftModel.from_pretrained(base_model, adapter_dir).merge_and_unload()
    if output_dir is not None:
        merged.save_pretrained(output_dir)
    return merged
