"""Post-training with TRL (`pip install "attnres-hf[trl]"`): its SFT, DPO and GRPO trainers with the depth-mixing
parameters treated as `AttnResTrainer` treats them (`DepthMixingTrainerMixin`: out of weight decay, an optional
`router_learning_rate`), and what TRL would only fail on later (or get wrong silently) checked first, in one line
each (`check_post_training`: dataset columns, LoRA targets, padding-free packing, a reference model it cannot load).

TRL's own trainers take AttnRes models as they are (docs/post-training.md shows both); these add only that handling.
Give a LoRA that also trains the routers as `peft_config=lora_config(model)` (`recipes.lora_config`).
"""

import inspect
import os

try:
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer
except ImportError as error:  # the optional extra
    raise ImportError('post-training needs TRL: pip install "attnres-hf[trl]"') from error

import torch
from datasets import IterableDataset
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from .recipes import check_peft_config
from .trainer import DepthMixingTrainerMixin

READS = {
    "sft": [("messages",), ("conversations",), ("prompt", "completion"), ("input_ids",)],  # and dataset_text_field
    "dpo": [("chosen", "rejected")],
    "grpo": [("prompt",)],
}
"""Per TRL trainer `check_post_training` knows, the column sets it reads a row from (any one suffices); SFT also its
config's `dataset_text_field`."""

KINDS = tuple(READS)
"""The TRL trainers `check_post_training` knows: SFT, DPO, GRPO."""

PADDING_FREE_PACKING = frozenset({"bfd", "bfd_split"})
"""TRL's packing strategies that pack padding-free (one row, sequences told apart by `position_ids`,
`cu_seq_lens_*` and `seq_idx`): every other strategy pads."""


def _columns(dataset) -> list[str] | None:
    """A dataset's column names; for an iterable dataset whose features are unknown (`from_generator`), its first
    row's keys, as TRL reads it. None for what is neither."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, (list, tuple)):
        return list(names)
    if isinstance(dataset, IterableDataset):
        row = next(iter(dataset), None)
        return list(row) if isinstance(row, dict) else None
    return None


def _read_columns(kind: str, args, formatting_func) -> list[tuple[str, ...]] | None:
    """The column sets TRL's `kind` trainer reads a row from (`READS`), or None where it reads what a function
    returns."""
    if kind != "sft":
        return READS[kind]
    return None if formatting_func is not None else [(getattr(args, "dataset_text_field", "text"),), *READS["sft"]]


def _check_columns(kind: str, name: str, dataset, args, formatting_func) -> None:
    if isinstance(dataset, dict):  # several evaluation sets
        for key, value in dataset.items():
            _check_columns(kind, f"{name}[{key!r}]", value, args, formatting_func)
        return
    columns, readable = _columns(dataset), _read_columns(kind, args, formatting_func)
    if columns is not None and readable is not None and not any(set(need) <= set(columns) for need in readable):
        wanted = " or ".join(" + ".join(repr(column) for column in need) for need in readable)
        raise ValueError(f"{name} has columns {columns}; TRL's {kind.upper()} trainer reads {wanted}: rename a "
                         "column (datasets' rename_column)" + (" or give a formatting_func" if kind == "sft" else ""))


def _model_to_check(model, args):
    """The model the checks read: the model given, a PEFT model's base, or for a folder or id (which TRL loads
    itself) a weightless meta-device copy built from its config; None where its config cannot be read here (TRL
    then reports that itself)."""
    if isinstance(model, (str, os.PathLike)):
        init = dict(getattr(args, "model_init_kwargs", None) or {})
        trust = bool(init.get("trust_remote_code", getattr(args, "trust_remote_code", False)))
        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
        except (OSError, ValueError):
            return None
    return model.get_base_model() if isinstance(model, PeftModel) else model


def _has_linear_attention(model) -> bool:
    """Whether the model's backbone has KDA (linear-attention) layers: Kimi Linear and Kimi K3."""
    config = getattr(model.config, "backbone", model.config)
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def _loads_a_reference(kind: str, model, args, peft_config, ref_model) -> bool:
    """Whether TRL will load a reference model from `model.config._name_or_path`: DPO without `ref_model`, PEFT or
    `precompute_ref_log_probs`; GRPO with `beta > 0` without PEFT."""
    if ref_model is not None or peft_config is not None or isinstance(model, PeftModel):
        return False
    if kind == "dpo":
        return not getattr(args, "precompute_ref_log_probs", False)
    return kind == "grpo" and getattr(args, "beta", 0.0) > 0


def check_post_training(kind: str, model, args=None, train_dataset=None, eval_dataset=None, formatting_func=None,
                        peft_config=None, ref_model=None) -> None:
    """What TRL's `kind` trainer would fail on only after preparing the data or at the first step, or get wrong
    silently, checked before it starts, each refused in one line:

    - a training or evaluation set without the columns the trainer reads (TRL raises `KeyError: 'text'` from deep
      inside its tokenisation): SFT reads `dataset_text_field` (`"text"`), `"messages"`, `"conversations"`,
      `"prompt"` + `"completion"` or `"input_ids"` (unless a `formatting_func` is given), DPO `"chosen"` +
      `"rejected"`, GRPO `"prompt"`;
    - a LoRA `peft_config` whose targets name a depth-mixing module or match nothing, or whose `modules_to_save`
      match nothing (PEFT fails on the first with a message naming neither, and skips the others silently):
      `recipes.check_peft_config`;
    - padding-free packing (`packing=True` with `packing_strategy="bfd"`, or `padding_free=True`) of a Kimi Linear
      or Kimi K3 backbone off CUDA: their KDA layers keep packed sequences apart only with fla's and `causal_conv1d`'s
      CUDA kernels (elsewhere `backbones_kda.KimiLinearDeltaAttentionByDevice` refuses them), so every CPU step
      would fail; `packing_strategy="wrapped"` packs without it (sequences then attend across their boundaries, as in
      pre-training);
    - a reference model TRL would load from `model.config._name_or_path` (DPO without `ref_model`, PEFT or
      `precompute_ref_log_probs`; GRPO with `beta > 0` without PEFT) for a model that has none (made or retrofitted
      in memory): TRL fails with a hub error about an empty repository id.

    Args:
        kind: `"sft"`, `"dpo"` or `"grpo"` (`KINDS`).
        model: the model given to the trainer: a `PreTrainedModel`, a `peft.PeftModel`, or a folder or model id
            (its config is read; nothing loads).
        args: the trainer's config (`SFTConfig`, `DPOConfig`, `GRPOConfig`); None: TRL's defaults.
        train_dataset: a `datasets` dataset (map-style or iterable).
        eval_dataset: one, or a dict of them (each is checked).
        formatting_func: SFT's, which makes the text from a row itself.
        peft_config: the trainer's `peft_config`.
        ref_model: DPO's `ref_model`.

    Raises:
        ValueError: as listed, or an unknown `kind`. TypeError: a `peft_config` target of the wrong type.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    _check_columns(kind, "train_dataset", train_dataset, args, formatting_func)
    _check_columns(kind, "eval_dataset", eval_dataset, args, formatting_func)
    checked = _model_to_check(model, args)
    if checked is None:
        return
    if peft_config is not None:
        check_peft_config(checked, peft_config)
    padding_free = kind == "sft" and bool(getattr(args, "padding_free", False) or (
        getattr(args, "packing", False) and getattr(args, "packing_strategy", None) in PADDING_FREE_PACKING))
    if padding_free and _has_linear_attention(checked) and args.device.type != "cuda":
        backbone = getattr(checked.config, "backbone", checked.config).model_type
        raise ValueError(f"padding-free packing of a {backbone} backbone needs CUDA: its KDA layers keep packed "
                         "sequences apart only with fla's and causal_conv1d's CUDA kernels (training here is on "
                         f"{args.device.type}); use packing_strategy='wrapped' (padded packing), or no packing")
    if (not isinstance(model, (str, os.PathLike)) and _loads_a_reference(kind, model, args, peft_config, ref_model)
            and not getattr(checked.config, "_name_or_path", "")):
        options = ("ref_model=, a peft_config (its implicit reference) or precompute_ref_log_probs=True"
                   if kind == "dpo"
                   else "a peft_config (its implicit reference) or beta=0")
        raise ValueError(f"TRL's {kind.upper()} trainer loads its reference model from model.config._name_or_path, "
                         f"which this in-memory model does not have: pass {options}, or save_pretrained the model "
                         "and pass its folder")


class _Checked:
    """Runs `check_post_training` for `kind` before the TRL trainer `trl_trainer` prepares anything, on its arguments
    given by keyword or in its positional order."""

    kind: str
    trl_trainer: type

    def __init__(self, *args, **kwargs):
        given = {key: value for key, value in kwargs.items() if key != "router_learning_rate"}
        try:
            bound = inspect.signature(self.trl_trainer.__init__).bind_partial(self, *args, **given).arguments
        except TypeError:  # arguments TRL's trainer does not take: its own error, from its own __init__
            bound = None
        if bound is not None:
            check_post_training(self.kind, bound.get("model"), bound.get("args"), bound.get("train_dataset"),
                                bound.get("eval_dataset"), bound.get("formatting_func"), bound.get("peft_config"),
                                bound.get("ref_model"))
        super().__init__(*args, **kwargs)


class AttnResSFTTrainer(_Checked, DepthMixingTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` (supervised fine-tuning: plain text, packing, chat templates, completion-only and
    assistant-only loss) with `DepthMixingTrainerMixin`'s handling of the depth-mixing parameters and
    `check_post_training`'s checks; takes `router_learning_rate=` besides SFTTrainer's arguments."""

    kind, trl_trainer = "sft", SFTTrainer


class AttnResDPOTrainer(_Checked, DepthMixingTrainerMixin, DPOTrainer):
    """TRL's `DPOTrainer` (direct preference optimisation, with a reference model or, under a PEFT config, the
    adapter-disabled model as the implicit reference: PEFT keeps each trained router's original beside it, so the
    reference routes as the base did) with `DepthMixingTrainerMixin`'s handling of the depth-mixing parameters and
    `check_post_training`'s checks; takes `router_learning_rate=` besides DPOTrainer's arguments."""

    kind, trl_trainer = "dpo", DPOTrainer


class AttnResGRPOTrainer(_Checked, DepthMixingTrainerMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` (group relative policy optimisation over sampled completions and reward functions; on a
    CPU, transformers' generation) with `DepthMixingTrainerMixin`'s handling of the depth-mixing parameters and
    `check_post_training`'s checks; takes `router_learning_rate=` besides GRPOTrainer's arguments."""

    kind, trl_trainer = "grpo", GRPOTrainer


__all__ = ["KINDS", "AttnResDPOTrainer", "AttnResGRPOTrainer", "AttnResSFTTrainer", "check_post_training"]
