"""Training recipes on `transformers.Trainer` and PEFT: router-only, LoRA (+ routers) and full fine-tuning."""

from .adapters import base_quantization_config, check_base_quantization, load_adapter
from .data import packed_lm_dataset
from .recipes import (
    DEFAULT_LEARNING_RATES,
    METHODS,
    ROUTER_MODULES,
    check_lora_target_parameters,
    check_lora_targets,
    check_peft_config,
    default_lora_targets,
    expert_parameter_names,
    lora_config,
    lora_module_names,
    merge_lora,
    prepare_model,
)
from .trainer import AttnResArguments, AttnResTrainer, DepthMixingTrainerMixin, depth_entropy, train

__all__ = [
    "AttnResArguments",
    "AttnResDPOTrainer",
    "AttnResGRPOTrainer",
    "AttnResSFTTrainer",
    "AttnResTrainer",
    "DEFAULT_LEARNING_RATES",
    "DepthMixingTrainerMixin",
    "METHODS",
    "ROUTER_MODULES",
    "base_quantization_config",
    "check_base_quantization",
    "check_lora_target_parameters",
    "check_lora_targets",
    "check_peft_config",
    "check_post_training",
    "default_lora_targets",
    "depth_entropy",
    "expert_parameter_names",
    "load_adapter",
    "lora_config",
    "lora_module_names",
    "merge_lora",
    "packed_lm_dataset",
    "prepare_model",
    "train",
]


_POST_TRAINING = ("AttnResDPOTrainer", "AttnResGRPOTrainer", "AttnResSFTTrainer", "check_post_training")
"""`post_training`'s names: it imports TRL, so on first use."""


def __getattr__(name: str):
    if name in _POST_TRAINING:
        from . import post_training

        return getattr(post_training, name)
    if name == "DEFAULT_LORA_TARGETS":  # deprecated; recipes warns
        from . import recipes

        return recipes.DEFAULT_LORA_TARGETS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
