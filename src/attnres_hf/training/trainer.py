"""`attnres train`: router-only, LoRA and full fine-tuning on `transformers.Trainer`."""

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
    enable_full_determinism,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from .._checks import check_fraction, check_int, check_learning_rate, check_model_source, check_paths
from ..modeling.backbones_moe import dispatch_kda_by_device
from ..modeling.depth_mixing import DEPTH_MIXING, has_routers, is_depth_mixing_parameter
from .adapters import save_base_quantization
from .data import packed_lm_dataset
from .recipes import (
    LORA_ALPHA,
    LORA_DROPOUT,
    LORA_R,
    METHODS,
    check_lora_settings,
    check_lora_target_parameters,
    check_lora_targets,
    is_router_parameter,
    load_kwargs,
    prepare_model,
)
from .resume import LearningRateSchedule, SameScheduleLength, check_resume_schedule


@dataclass
class AttnResArguments:
    """What to train on and how; the optimisation itself is `transformers.TrainingArguments`.

    Raises (at construction):
        TypeError: a field of the wrong type (`data` takes a path or a list of paths). ValueError: a value out of
            range (an unknown `method`, `seq_len < 2`, `eval_fraction` outside (0, 1), bad LoRA settings).
    """

    model: str = field(metadata={"help": "AttnRes model folder (or any causal LM folder for lora/full)"})
    data: list[str] = field(metadata={"help": ".txt / .jsonl files or datasets folders (save_to_disk)"})
    method: Literal[METHODS] = field(default="routers", metadata={"help": "what trains"})
    seq_len: int = field(default=512, metadata={"help": "tokens per packed training block"})
    eval_fraction: float = field(default=0.05, metadata={"help": "held-out tail of the blocks, for eval"})
    text_field: str = field(default="text", metadata={"help": "text column of .jsonl files and datasets"})
    lora_r: int = LORA_R
    lora_alpha: int = LORA_ALPHA
    lora_dropout: float = LORA_DROPOUT
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "module names (default: every linear layer but the head); each must exist. "
                                "One value that is not a name is PEFT's string form: 'all-linear', or a regular "
                                "expression over whole module paths"})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "mixture-of-experts models: stacked expert weights to adapt as well, e.g. "
                                "mlp.experts.gate_up_proj mlp.experts.down_proj"})
    router_learning_rate: float | None = field(default=None, metadata={
        "help": "the depth-mixing parameters' own peak learning rate (routers, gates, DWAs, ...; the same schedule), "
        "e.g. 5e-3 beside --learning_rate 5e-5 for --method full, as Delta AttnRes's fine-tuning recipe; "
        "default: --learning_rate"})
    entropy_batches: int = field(default=4, metadata={"help": "eval batches used for the depth-weight entropy"})
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint in output_dir"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "run the model folder's own code (its tokenizer's, as Kimi's; a model that is not AttnRes)"})
    output_router_logits: bool | None = field(
        default=None, metadata={"help": "mixture-of-experts models: add the experts' load-balancing loss "
                                "(router_aux_loss_coef * aux_loss) to the training loss, as transformers' MoE models "
                                "do with this config flag; default: the model config's value"})

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a model folder path, got {type(self.model).__name__}")
        self.model = str(self.model)
        self.data = check_paths("data", self.data)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        check_int("seq_len", self.seq_len, 2, "tokens")
        check_int("entropy_batches", self.entropy_batches, 0)
        check_learning_rate("router_learning_rate", self.router_learning_rate)
        if self.output_router_logits is not None and not isinstance(self.output_router_logits, bool):
            raise TypeError(f"output_router_logits must be True, False or None, got {self.output_router_logits!r}")
        for name, kind in (("text_field", str), ("resume", bool), ("trust_remote_code", bool)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be {kind.__name__}, got {getattr(self, name)!r}")
        check_fraction("eval_fraction", self.eval_fraction)
        check_lora_settings(self.lora_r, self.lora_alpha, self.lora_dropout)
        if self.lora_target_modules is not None:
            if isinstance(self.lora_target_modules, tuple):
                self.lora_target_modules = list(self.lora_target_modules)
            if not isinstance(self.lora_target_modules, (list, str)) or not all(
                    isinstance(t, str) for t in self.lora_target_modules):
                raise TypeError("lora_target_modules must be a list of module names or one regular expression, got "
                                f"{self.lora_target_modules!r}")
            if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1 and \
                    not re.fullmatch(r"[\w.]+", self.lora_target_modules[0]):
                # the command line gives a list: one value that is no module name is PEFT's string form
                # (`target_modules="all-linear"`, or a regular expression), as prepare_model takes it
                self.lora_target_modules = self.lora_target_modules[0]
            names = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
            if not names or not all(name.strip() for name in names):
                raise ValueError("lora_target_modules must name at least one module, and no name may be empty "
                                 f"(leave it unset for every linear layer but the head); got {self.lora_target_modules!r}")
        if self.lora_target_parameters is not None:
            if isinstance(self.lora_target_parameters, tuple):
                self.lora_target_parameters = list(self.lora_target_parameters)
            if not isinstance(self.lora_target_parameters, list) or not all(
                    isinstance(t, str) for t in self.lora_target_parameters):
                raise TypeError(f"lora_target_parameters must be a list of parameter names, got "
                                f"{self.lora_target_parameters!r}")
            if not self.lora_target_parameters or not all(t.strip() for t in self.lora_target_parameters):
                raise ValueError("lora_target_parameters must name at least one parameter, and no name may be empty; "
                                 f"got {self.lora_target_parameters!r}")
            if self.method not in ("lora", "qlora"):
                raise ValueError(f"lora_target_parameters applies to --method lora or qlora, not {self.method!r}")


def depth_entropy(model, batches) -> dict:
    """Mean entropy (nats) of the depth weights over routers and tokens, and the same as a fraction of the uniform
    distribution's entropy `log(n_sources)` (1.0 = uniform, as at a retrofit; 0 = one source). Routers with a single
    source are skipped."""
    depth_mixing = getattr(model.config, "depth_mixing", None)
    if depth_mixing not in DEPTH_MIXING or not has_routers(depth_mixing):  # a baseline or a model without routers
        return {}
    entropies, ratios = [], []
    with torch.no_grad():
        for batch in batches:
            out = model(input_ids=batch["input_ids"], output_depth_weights=True)
            for weights in out.depth_weights:
                if weights.shape[-1] < 2:
                    continue
                entropy = -(weights * weights.clamp_min(1e-12).log()).sum(-1).mean().item()
                entropies.append(entropy)
                ratios.append(entropy / math.log(weights.shape[-1]))
    if not entropies:
        return {}
    return {"depth_entropy": sum(entropies) / len(entropies), "depth_entropy_ratio": sum(ratios) / len(ratios)}


class DepthMixingTrainerMixin:
    """What every trainer of an AttnRes model (transformers' `Trainer` or TRL's, `post_training`) does with the
    depth-mixing parameters: keeps them out of weight decay (like norms and biases), optionally gives them a peak
    learning rate of their own (`router_learning_rate`), and records a PEFT adapter's base quantisation beside it.
    Put it before the trainer class: `class MyTrainer(DepthMixingTrainerMixin, Trainer)`.

    Raises:
        ValueError / TypeError: `router_learning_rate` is not a positive number, or is set for a model without
            depth-mixing parameters (at construction, for a model given as an object; else when the optimizer is
            made, also when they are all frozen).
    """

    def __init__(self, *args, router_learning_rate: float | None = None, **kwargs):
        check_learning_rate("router_learning_rate", router_learning_rate)
        model = kwargs.get("model", args[0] if args else None)
        if router_learning_rate is not None and isinstance(model, torch.nn.Module) and not any(
                is_depth_mixing_parameter(name) for name, _ in model.named_parameters()):
            raise ValueError("router_learning_rate is set, but the model has no depth-mixing parameters "
                             f"(depth_mixing {getattr(model.config, 'depth_mixing', None)!r})")
        self.router_learning_rate = router_learning_rate
        super().__init__(*args, **kwargs)
        if self.args.device.type == "cpu":
            self.args.dataloader_pin_memory = False  # nothing to pin to; torch warns on every dataloader

    def get_decay_parameter_names(self, model) -> list[str]:
        # Each method's record declares what weight decay must not pull towards zero: parameters whose initial value
        # encodes the residual path (mHC `b_pre`, DenseFormer `alpha`, ...) and the biases, gates, scales and norms
        # of its mixing modules (`DEPTH_MIXING[name].no_weight_decay`).
        from ..modeling.depth_mixing import is_no_weight_decay_parameter

        return [name for name in super().get_decay_parameter_names(model) if not is_no_weight_decay_parameter(name)]

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Trainer's optimizer; with `router_learning_rate`, each of its parameter groups split in two, the
        depth-mixing parameters (`is_depth_mixing_parameter`) in a group of their own at that peak learning rate
        (the scheduler, made after the optimizer, scales each group from its own)."""
        optimizer = super().create_optimizer(model)
        if self.router_learning_rate is None or any(group.get("depth_mixing") for group in optimizer.param_groups):
            return optimizer
        names = {id(param): name for name, param in (self.model if model is None else model).named_parameters()}
        routers = []
        for group in optimizer.param_groups:
            mixing = [p for p in group["params"] if is_depth_mixing_parameter(names.get(id(p), ""))]
            moved = {id(p) for p in mixing}
            group["params"] = [p for p in group["params"] if id(p) not in moved]
            if mixing:
                routers.append({**group, "params": mixing, "lr": self.router_learning_rate, "depth_mixing": True})
        if not routers:
            raise ValueError("router_learning_rate is set, but the model has no trainable depth-mixing parameters "
                             f"(depth_mixing {getattr(self.model.config, 'depth_mixing', None)!r}, or all frozen)")
        # (before any step: no optimizer state to move; a group left empty is dropped, so that the logged learning
        # rate, the first group's, is the routers' when they alone train)
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
        for group in routers:
            optimizer.add_param_group(group)
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)
        # An adapter folder (the final one and each checkpoint) records its base's quantisation, which
        # `load_adapter` / `merge_lora` check the base against (`adapters`).
        from peft import PeftModel

        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(model, PeftModel) and self.args.should_save:
            save_base_quantization(model, output_dir if output_dir is not None else self.args.output_dir)


class AttnResTrainer(DepthMixingTrainerMixin, Trainer):
    """`Trainer` that keeps router pseudo-queries out of weight decay (like norms and biases) and logs, at each
    evaluation, perplexity and the entropy of the depth weights (how far routing has moved from uniform). On a
    mixture-of-experts model that returns the experts' load-balancing loss (`aux_loss`, with
    `output_router_logits`), the training logs carry its mean over the logged steps as `aux_loss` (the `loss` already
    includes `router_aux_loss_coef * aux_loss`, as the model computes it)."""

    def __init__(self, *args, entropy_batches: int = 4, router_learning_rate: float | None = None, **kwargs):
        self.entropy_batches = entropy_batches
        self._aux_losses: list[torch.Tensor] = []
        super().__init__(*args, router_learning_rate=router_learning_rate, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux_loss = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        if aux_loss is not None and model.training:  # the experts' load-balancing loss, for the logs
            self._aux_losses.append(aux_loss.detach().float())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._aux_losses:  # a training log entry: the mean aux loss since the last one
            logs = {**logs, "aux_loss": torch.stack(self._aux_losses).mean().item()}
            self._aux_losses.clear()
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Without `compute_metrics` the logits are never used: keeping them (vocab x tokens per batch) is slow.
        return super().prediction_step(model, inputs, prediction_loss_only or self.compute_metrics is None, ignore_keys)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        extra = {}
        if f"{metric_key_prefix}_loss" in metrics:
            extra[f"{metric_key_prefix}_perplexity"] = math.exp(min(metrics[f"{metric_key_prefix}_loss"], 50.0))
        if self.entropy_batches:
            loader = self.get_eval_dataloader(eval_dataset)
            batches = [b for _, b in zip(range(self.entropy_batches), loader)]
            model = self.accelerator.unwrap_model(self.model)
            was_training = model.training
            model.eval()
            extra |= {f"{metric_key_prefix}_{k}": v for k, v in depth_entropy(model, batches).items()}
            model.train(was_training)
        if extra:
            self.log(extra)
            metrics |= extra
        return metrics


def _eval_at(log_history: list[dict], step: int | None = None) -> dict:
    """Merge the log entries of the evaluation at `step` (default: the first evaluation); loss, perplexity and
    entropy are logged separately. `{}` if there was none."""
    entries = [e for e in log_history if any(k.startswith("eval_") for k in e)]
    if not entries:
        return {}
    step = entries[0].get("step") if step is None else step
    return {k: v for e in entries if e.get("step") == step for k, v in e.items()}


def _count(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _check_before_loading(args: AttnResArguments) -> None:
    """What can be checked from the folder and the config alone: files, the method against the model, LoRA targets
    (on a weightless `meta`-device copy of the model)."""
    check_model_source(args.model)
    for file in args.data:
        if not Path(file).exists():
            raise FileNotFoundError(f"data file not found: {file}")
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    if args.method == "routers" and getattr(config, "depth_mixing", "residual") == "residual":
        raise ValueError(f"method 'routers' needs depth routers: {args.model} has none (model_type "
                         f"{config.model_type!r}, depth_mixing {getattr(config, 'depth_mixing', None)!r}); convert it "
                         "with `attnres convert`, or train with --method lora or full")
    if args.output_router_logits and not hasattr(config, "router_aux_loss_coef"):
        raise ValueError(f"output_router_logits: {args.model} has no mixture-of-experts load-balancing loss "
                         f"(model_type {config.model_type!r} has no router_aux_loss_coef)")
    if args.method in ("lora", "qlora") and (args.lora_target_modules, args.lora_target_parameters) != (None, None):
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)
        if args.lora_target_modules is not None:
            check_lora_targets(skeleton, args.lora_target_modules)
        if args.lora_target_parameters is not None:
            check_lora_target_parameters(skeleton, args.lora_target_parameters)


def train(args: AttnResArguments, training_args: TrainingArguments, callbacks: list | None = None) -> dict:
    """Fine-tune `args.model` on `args.data` with `args.method`; returns the summary (also `train_summary.json`).

    `callbacks` are extra `TrainerCallback`s. The final model (or LoRA adapter with its routers) and the tokenizer
    are saved to `training_args.output_dir`; checkpoints every `save_steps`. With `args.resume`, training continues
    from the last checkpoint there with its optimizer, scheduler, RNG and data order, so the loss trajectory is that
    of an uninterrupted run. Resuming keeps the checkpoint's learning-rate schedule: the same `max_steps` (or
    `num_train_epochs`), `learning_rate`, `lr_scheduler_type`, `lr_scheduler_kwargs` and warmup; anything else is
    refused (`check_resume_schedule`), since the Trainer would silently mix the two schedules.

    Evaluation follows `training_args.eval_strategy` (TrainingArguments' default `"no"`: none, and the summary's
    `eval_*` and `depth_entropy_ratio_after` are `None`). With `"steps"` or `"epoch"`, the held-out blocks are also
    evaluated before the first step (a fresh run) and after the last (the Trainer's own evaluation at the last step
    when its schedule made one, else one more), which the summary's `eval_*_before` / `_after` report.

    Every random draw (weights the checkpoint lacks, LoRA adapters, data order, dropout) comes after seeding with
    `training_args.seed` (`full_determinism` honoured), so two runs with the same settings give identical losses
    and weights.

    Raises:
        TypeError: `args` / `training_args` of the wrong class.
        FileNotFoundError: a missing model folder or data file, or `resume` without a checkpoint.
        FileExistsError: checkpoints of an earlier run in `output_dir` without `resume`.
        ValueError: bad data, `method="routers"` on a model without depth routers, a LoRA target that matches no
            module, or `resume` from a checkpoint at the end of its schedule or with settings that change its
            learning-rate schedule.

    All of these are raised before the model's weights load, but for a run sized by `num_train_epochs` resumed on
    other data or batch sizes (its step count is known once the Trainer starts: raised before the first step).
    """
    if not isinstance(args, AttnResArguments):
        raise TypeError(f"args must be AttnResArguments, got {type(args).__name__}")
    if not isinstance(training_args, TrainingArguments):
        raise TypeError(f"training_args must be transformers.TrainingArguments, got {type(training_args).__name__}")
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of TrainerCallback, got {type(callbacks).__name__}")
    started = time.perf_counter()
    existing = get_last_checkpoint(training_args.output_dir) if Path(training_args.output_dir).is_dir() else None
    if args.resume and existing is None:
        raise FileNotFoundError(f"--resume: no checkpoint-* folder in {training_args.output_dir}")
    if existing is not None and not args.resume:
        raise FileExistsError(
            f"{training_args.output_dir} holds checkpoints of an earlier run ({Path(existing).name}); pass --resume to "
            "continue it, or choose another --output-dir"
        )
    checkpoint = existing if args.resume else None
    resumed = (check_resume_schedule(checkpoint, training_args, args.router_learning_rate)
               if checkpoint is not None else None)
    _check_before_loading(args)
    if checkpoint is not None and training_args.process_index == 0:
        print(f"Resuming from {checkpoint}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    data = packed_lm_dataset(args.data, tokenizer, args.seq_len, args.eval_fraction, args.text_field)
    # Seed before the model exists: the Trainer seeds again in its __init__, too late for the LoRA adapters'
    # initial values (and any weight the checkpoint lacks).
    (enable_full_determinism if training_args.full_determinism else set_seed)(training_args.seed)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, trust_remote_code=args.trust_remote_code, dtype=torch.float32, **load_kwargs(args.method)
    )
    dispatch_kda_by_device(model)  # a transformers Kimi Linear model: fla's KDA kernels on CUDA tensors only
    if args.output_router_logits is not None:  # the MoE load-balancing loss enters the training loss (or not)
        model.config.output_router_logits = args.output_router_logits
    model = prepare_model(model, args.method, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules,
                          args.lora_target_parameters)

    trainer = AttnResTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        data_collator=default_data_collator,
        processing_class=tokenizer,
        entropy_batches=args.entropy_batches,
        router_learning_rate=args.router_learning_rate,
        callbacks=[*(callbacks or []), LearningRateSchedule.from_args(training_args, args.router_learning_rate),
                   *([SameScheduleLength(checkpoint, resumed["max_steps"])] if resumed else [])],
    )
    # The held-out loss before training comes from the Trainer's own first evaluation (`eval_on_start`): calling
    # `evaluate()` before `train()` under DDP desynchronises the replicas' first optimizer step.
    evaluating = training_args.eval_strategy != "no"  # opt-in, as in TrainingArguments
    training_args.eval_on_start = evaluating and checkpoint is None
    result = trainer.train(resume_from_checkpoint=checkpoint)
    before = _eval_at(trainer.state.log_history) if evaluating else {}
    # the Trainer evaluated at the last step if eval_steps divides it (or per epoch): not a second pass of the same
    after = (_eval_at(trainer.state.log_history, trainer.state.global_step) or trainer.evaluate()) if evaluating else {}
    trainer.save_model()
    trainable, total = _count(model)
    summary = {
        "method": args.method,
        "trainable_parameters": trainable,
        "total_parameters": total,
        # the routers' trained parameters (under PEFT the trained copies, not the frozen originals kept beside them)
        "router_parameters": sum(p.numel() for n, p in model.named_parameters()
                                 if is_router_parameter(n) and p.requires_grad),
        "steps": trainer.state.global_step,
        "tokens_seen": trainer.state.global_step * training_args.train_batch_size
        * training_args.gradient_accumulation_steps * args.seq_len * training_args.world_size,
        "train_loss": result.training_loss,
        "aux_loss_last": next((e["aux_loss"] for e in reversed(trainer.state.log_history) if "aux_loss" in e), None),
        "eval_loss_before": before.get("eval_loss"),
        "eval_perplexity_before": before.get("eval_perplexity"),
        "eval_loss_after": after.get("eval_loss"),
        "eval_perplexity_after": after.get("eval_perplexity"),
        "depth_entropy_ratio_after": after.get("eval_depth_entropy_ratio"),
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    if trainer.is_world_process_zero():
        Path(training_args.output_dir, "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(format_summary(summary))
    _settle_gloo(trainer.accelerator)
    return summary


def _settle_gloo(accelerator) -> None:
    """Before a multi-process gloo run returns towards interpreter exit: every process waits for the others, then
    pauses 0.2 s. torch's gloo threads can release a finished collective's work (which takes the GIL) after the main
    thread has moved on; if the interpreter is finalising by then, the process aborts ("terminate called without an
    active exception", SIGABRT) and the launcher stops the others, perhaps while one still writes its files. Measured
    with DeepSpeed ZeRO-3 on 2 CPU processes: about 1 run in 6 without this, none in 30 with it
    (pytorch/pytorch#190489: no fix in torch 2.13; destroying the process group first did not help)."""
    import torch.distributed as dist

    if accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized() \
            and dist.get_backend() == "gloo":
        accelerator.wait_for_everyone()
        time.sleep(0.2)


def format_summary(summary: dict) -> str:
    def number(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"method                {summary['method']}",
        f"trainable parameters  {summary['trainable_parameters']:,} of {summary['total_parameters']:,} "
        f"(routers: {summary['router_parameters']:,})",
        f"steps / tokens seen   {summary['steps']} / {summary['tokens_seen']:,}",
        f"eval loss             {number(summary['eval_loss_before'], '.4f')} -> {number(summary['eval_loss_after'], '.4f')}"
        "  (held-out last blocks of the training data)",
        f"eval perplexity       {number(summary['eval_perplexity_before'], '.3f')} -> "
        f"{number(summary['eval_perplexity_after'], '.3f')}",
        f"depth entropy / max   {number(summary['depth_entropy_ratio_after'], '.4f')} (1 = uniform routing)",
        f"wall time             {summary['wall_time_s']:.0f} s",
    ]
    if summary["eval_loss_before"] is None and summary["eval_loss_after"] is None:  # evaluation is opt-in
        lines[3:6] = ["eval                  not evaluated (--eval-strategy steps, TrainingArguments(eval_strategy="
                      "'steps'), evaluates the held-out blocks before, during and after)"]
    if summary.get("aux_loss_last") is not None:  # a mixture-of-experts model trained with its load-balancing loss
        lines.insert(-1, f"experts' aux loss     {summary['aux_loss_last']:.4f} (last logged, load balancing)")
    return "\n".join(lines)
