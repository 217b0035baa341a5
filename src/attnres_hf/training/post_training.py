"""Post-training with TRL (`pip install "attnres-hf[trl]"`): its SFT, DPO and GRPO trainers with the depth-mixing
parameters treated as `AttnResTrainer` treats them (`DepthMixingTrainerMixin`: out of weight decay, an optional
`router_learning_rate`, a LoRA `peft_config` checked against the model before it is wrapped), and the inputs TRL
would only fail on later checked first, in one line each (`check_post_training`).

TRL's own trainers take AttnRes models as they are (docs/post-training.md shows both); these add only that handling.
Give a LoRA that also trains the routers as `peft_config=lora_config(model)` (`recipes.lora_config`).
"""

import inspect

try:
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer
except ImportError as error:  # the optional extra
    raise ImportError('post-training needs TRL: pip install "attnres-hf[trl]"') from error

from transformers import PreTrainedModel

from .trainer import DepthMixingTrainerMixin

PADDING_FREE_PACKING = frozenset({"bfd", "bfd_split"})
"""TRL's packing strategies that pack padding-free (one row, sequences told apart by `position_ids`,
`cu_seq_lens_*` and `seq_idx`): every other strategy pads."""


def _columns(dataset) -> list[str] | None:
    """A dataset's column names (`datasets.Dataset`, `IterableDataset` once its features are known), else None."""
    names = getattr(dataset, "column_names", None)
    return list(names) if isinstance(names, (list, tuple)) else None


def _read_columns(kind: str, args, formatting_func) -> list[tuple[str, ...]] | None:
    """The column sets TRL's `kind` trainer reads a training row from (any one suffices), or None where it reads
    what a function returns."""
    if kind == "sft":
        if formatting_func is not None:
            return None
        return [(getattr(args, "dataset_text_field", "text"),), ("messages",), ("prompt", "completion"), ("input_ids",)]
    if kind == "dpo":
        return [("chosen", "rejected"), ("prompt_ids", "chosen_ids", "rejected_ids")]
    return [("prompt",)]  # GRPO


def _is_padding_free(kind: str, args) -> bool:
    return kind == "sft" and bool(getattr(args, "padding_free", False) or (
        getattr(args, "packing", False) and getattr(args, "packing_strategy", None) in PADDING_FREE_PACKING))


def _has_linear_attention(model: PreTrainedModel) -> bool:
    """Whether the model's backbone has KDA (linear-attention) layers: Kimi Linear and Kimi K3."""
    config = getattr(model.config, "backbone", model.config)
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def check_post_training(kind: str, model, args, train_dataset=None, formatting_func=None) -> None:
    """What TRL's `kind` trainer (`"sft"`, `"dpo"`, `"grpo"`) would fail on only after preparing the data or at the
    first step, checked before it starts, each refused in one line:

    - a training set without the columns the trainer reads (TRL raises `KeyError: 'text'` from deep inside its
      tokenisation): SFT reads `dataset_text_field` (`"text"`), `"messages"`, `"prompt"` + `"completion"` or
      `"input_ids"` (unless a `formatting_func` is given), DPO `"chosen"` + `"rejected"`, GRPO `"prompt"`;
    - padding-free packing (`packing=True` with `packing_strategy="bfd"`, or `padding_free=True`) of a Kimi Linear
      or Kimi K3 backbone off CUDA: their KDA layers keep packed sequences apart only with fla's and `causal_conv1d`'s
      CUDA kernels (`backbones_moe.kda_by_device`), so every CPU step would fail; `packing_strategy="wrapped"`
      packs without it (sequences then attend across their boundaries, as in pre-training).

    Args:
        kind: `"sft"`, `"dpo"` or `"grpo"`.
        model: the model given to the trainer; a model id or folder (which TRL loads itself) is not checked for the
            packing case.
        args: the trainer's config (`SFTConfig`, `DPOConfig`, `GRPOConfig`); None: TRL's defaults.
        train_dataset: a `datasets.Dataset` (an iterable one is checked where its columns are known).
        formatting_func: SFT's, which makes the text from a row itself.

    Raises:
        ValueError: as listed.
    """
    columns = _columns(train_dataset)
    readable = _read_columns(kind, args, formatting_func)
    if columns is not None and readable is not None and not any(set(need) <= set(columns) for need in readable):
        wanted = " or ".join(" + ".join(repr(name) for name in need) for need in readable)
        raise ValueError(f"train_dataset has columns {columns}; TRL's {kind.upper()} trainer reads {wanted}: rename "
                         "a column (datasets' rename_column)" + (" or give a formatting_func" if kind == "sft" else ""))
    if (_is_padding_free(kind, args) and isinstance(model, PreTrainedModel) and _has_linear_attention(model)
            and args.device.type != "cuda"):
        backbone = getattr(model.config, "backbone", model.config).model_type
        raise ValueError(f"padding-free packing of a {backbone} backbone needs CUDA: its KDA "
                         "layers keep packed sequences apart only with fla's and causal_conv1d's CUDA kernels (training "
                         f"here is on {args.device.type}); use packing_strategy='wrapped' (padded packing), or no "
                         "packing")


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
                                bound.get("formatting_func"))
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


__all__ = ["AttnResDPOTrainer", "AttnResGRPOTrainer", "AttnResSFTTrainer", "check_post_training"]
