"""Training recipes on `transformers.Trainer` and PEFT: router-only, LoRA (+ routers) and full fine-tuning."""

from .data import packed_lm_dataset
from .recipes import DEFAULT_LEARNING_RATES, DEFAULT_LORA_TARGETS, METHODS, ROUTER_MODULES, merge_lora, prepare_model
from .trainer import AttnResArguments, AttnResTrainer, depth_entropy, train

__all__ = [
    "AttnResArguments",
    "AttnResTrainer",
    "DEFAULT_LEARNING_RATES",
    "DEFAULT_LORA_TARGETS",
    "METHODS",
    "ROUTER_MODULES",
    "depth_entropy",
    "merge_lora",
    "packed_lm_dataset",
    "prepare_model",
    "train",
]
