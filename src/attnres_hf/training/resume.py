"""Resuming a run: refuse, before the model loads, settings that would silently bend the checkpoint's learning-rate
schedule.

`Trainer.train(resume_from_checkpoint=...)` restores the checkpoint's optimizer (whose learning rate is the one the
old schedule reached) and its learning-rate scheduler (whose base rate is the old `learning_rate`), then steps a
scheduler built from the *new* arguments. A resumed run whose `max_steps`, `learning_rate`, `lr_scheduler_type`,
`lr_scheduler_kwargs` or warmup differ from the run that wrote the checkpoint therefore trains on neither schedule:
the new `learning_rate` is ignored, the next step uses the old schedule's rate (0 at the end of a linear decay) and
the rest jumps onto the new curve. A checkpoint at the end of its schedule has nothing left to resume.

The run's schedule settings travel in each checkpoint's `trainer_state.json` (`stateful_callbacks`, written by
`LearningRateSchedule`, transformers' `ExportableState` mechanism); the schedule's length is `trainer_state.json`'s
`max_steps` and its base rate `scheduler.pt`'s `base_lrs`, so checkpoints of plain `Trainer` runs are checked for
those two as well.
"""

import json
import math
from pathlib import Path
from types import SimpleNamespace

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState


def _scheduler_type(args: TrainingArguments) -> str:
    value = args.lr_scheduler_type
    return getattr(value, "value", value)


class LearningRateSchedule(TrainerCallback, ExportableState):
    """Records in every checkpoint's `trainer_state.json` the settings that shape the learning-rate schedule (as
    given: `max_steps` is -1 for a run sized by `num_train_epochs`), for `check_resume_schedule`."""

    def __init__(self, learning_rate: float, lr_scheduler_type: str, lr_scheduler_kwargs: dict | None,
                 warmup_steps: float, max_steps: int, num_train_epochs: float,
                 router_learning_rate: float | None = None):
        self.settings = {"learning_rate": learning_rate, "lr_scheduler_type": lr_scheduler_type,
                         "lr_scheduler_kwargs": lr_scheduler_kwargs or {}, "warmup_steps": warmup_steps,
                         "max_steps": max_steps, "num_train_epochs": num_train_epochs,
                         "router_learning_rate": router_learning_rate}

    @classmethod
    def from_args(cls, args: TrainingArguments, router_learning_rate: float | None = None) -> "LearningRateSchedule":
        return cls(args.learning_rate, _scheduler_type(args), args.lr_scheduler_kwargs, args.warmup_steps,
                   args.max_steps, args.num_train_epochs, router_learning_rate)

    def state(self) -> dict:
        return {"args": dict(self.settings), "attributes": {}}

    def on_train_begin(self, args, state, control, **kwargs):
        # A state resumed from a checkpoint written without this callback has no entry, and the Trainer's checkpoint
        # writer updates existing entries only.
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())


class SameScheduleLength(TrainerCallback):
    """Stops a resumed run before its first step when the Trainer's own count of steps (`max_steps`, or
    `num_train_epochs` x the update steps per epoch) differs from the checkpoint's: the case `check_resume_schedule`
    cannot settle before the data loader exists (a run sized by epochs whose data or batch size changed)."""

    def __init__(self, checkpoint: str, max_steps: int):
        self.checkpoint, self.max_steps = checkpoint, max_steps

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps != self.max_steps:
            raise ValueError(
                f"{self.checkpoint} belongs to a run of {self.max_steps} steps, but these settings make "
                f"{state.max_steps} (num_train_epochs {args.num_train_epochs} over this data and batch size): the "
                f"restored learning-rate schedule cannot continue; resume with --max-steps {self.max_steps}, or start "
                "a new run (another --output-dir) from its weights")


def read_checkpoint_schedule(checkpoint: str | Path) -> dict:
    """What `checkpoint` (a `checkpoint-N` folder) says about its run's schedule: `global_step`, `max_steps`,
    `base_lrs` (from `scheduler.pt`, None without one) and `settings` (`LearningRateSchedule`'s record, None in
    checkpoints of other runs).

    Raises:
        FileNotFoundError: no `trainer_state.json`. ValueError: a `trainer_state.json` that does not parse, or an
            unreadable `scheduler.pt`.
    """
    checkpoint = Path(checkpoint)
    state_file = checkpoint / "trainer_state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"--resume: {checkpoint} has no trainer_state.json (an incomplete checkpoint?); "
                                "remove it to resume from the one before")
    try:
        state = json.loads(state_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--resume: {state_file} is not valid JSON ({error}); remove {checkpoint.name} to resume "
                         "from the checkpoint before it") from None
    record = (state.get("stateful_callbacks") or {}).get(LearningRateSchedule.__name__)
    base_lrs = None
    if (checkpoint / "scheduler.pt").is_file():
        import torch

        try:
            scheduler = torch.load(checkpoint / "scheduler.pt", map_location="cpu", weights_only=True)
        except Exception as error:  # a cut-off or damaged file: torch raises RuntimeError, UnpicklingError, EOFError
            raise ValueError(f"--resume: {checkpoint / 'scheduler.pt'} is unreadable ({type(error).__name__}); remove "
                             f"{checkpoint.name} to resume from the checkpoint before it") from None
        base_lrs = scheduler.get("base_lrs") if isinstance(scheduler, dict) else None
    return {"global_step": int(state.get("global_step", 0)), "max_steps": int(state.get("max_steps", 0)),
            "base_lrs": base_lrs, "settings": record.get("args") if isinstance(record, dict) else None}


def _warmup(warmup_steps: float, max_steps: int) -> int:
    return TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=warmup_steps), max_steps)


def check_resume_schedule(checkpoint: str | Path, args: TrainingArguments,
                          router_learning_rate: float | None = None) -> dict:
    """Raise unless resuming `checkpoint` with `args` (and the depth-mixing parameters' `router_learning_rate`)
    continues the checkpoint's learning-rate schedule unchanged; return `read_checkpoint_schedule(checkpoint)`.

    Raises:
        ValueError: the checkpoint's schedule already ended (`global_step >= max_steps`), or `args` change its
            length (`max_steps`; a run sized by steps resumed with `max_steps` unset, or by epochs with another
            `num_train_epochs`), its `learning_rate`, `router_learning_rate` (its optimizer's parameter groups too:
            set or unset), `lr_scheduler_type`, `lr_scheduler_kwargs` or its warmup length in steps. The message
            names the checkpoint's step and `max_steps` and the settings to resume with (or to start a new run from
            the checkpoint's weights). A run sized by epochs whose data or batch size changed is caught by
            `SameScheduleLength` when the Trainer starts, before the first step.
        FileNotFoundError: the checkpoint has no `trainer_state.json`.
    """
    found = read_checkpoint_schedule(checkpoint)
    step, total = found["global_step"], found["max_steps"]
    where = f"{checkpoint} (step {step} of max_steps {total})"
    new_run = "start a new run (another --output-dir) from its weights, which gets a schedule of its own"
    if total > 0 and step >= total:
        longer = (f" (--max-steps {args.max_steps} cannot extend it: the restored optimizer and scheduler carry on "
                  "from the rate the schedule ended at)") if args.max_steps > total else ""
        raise ValueError(f"--resume: {where} is the end of its run's learning-rate schedule: nothing is left to "
                         f"resume{longer}. To train further, {new_run}")
    settings = found["settings"] or {}
    changes = []
    if args.max_steps > 0 and args.max_steps != total:
        changes.append(("--max-steps", args.max_steps, total))
    elif args.max_steps <= 0 and settings.get("max_steps", -1) > 0:
        changes.append(("--max-steps", "unset (the run sized by --num_train_epochs)", total))
    elif args.max_steps <= 0 and settings.get("num_train_epochs", args.num_train_epochs) != args.num_train_epochs:
        changes.append(("--num_train_epochs", args.num_train_epochs, settings["num_train_epochs"]))
    old_lr = settings.get("learning_rate")
    if old_lr is None and found["base_lrs"]:
        old_lr = found["base_lrs"][0]
    if old_lr is not None and not math.isclose(args.learning_rate, old_lr, rel_tol=1e-9, abs_tol=0.0):
        changes.append(("--lr", args.learning_rate, old_lr))
    if settings:
        if _scheduler_type(args) != settings["lr_scheduler_type"]:
            changes.append(("--lr_scheduler_type", _scheduler_type(args), settings["lr_scheduler_type"]))
        if (args.lr_scheduler_kwargs or {}) != settings["lr_scheduler_kwargs"]:
            changes.append(("--lr_scheduler_kwargs", f"'{json.dumps(args.lr_scheduler_kwargs or {})}'",
                            f"'{json.dumps(settings['lr_scheduler_kwargs'])}'"))
        old_router = settings.get("router_learning_rate")  # (absent from checkpoints before it existed: unset)
        if (old_router is None) != (router_learning_rate is None) or (
                old_router is not None and not math.isclose(router_learning_rate, old_router, rel_tol=1e-9)):
            changes.append(("--router_learning_rate", "unset" if router_learning_rate is None else router_learning_rate,
                            "unset" if old_router is None else old_router))
        new, old = _warmup(args.warmup_steps, total), _warmup(settings["warmup_steps"], total)
        if new != old:  # the warmup's length in steps over the checkpoint's schedule (a ratio or a count)
            changes.append(("--warmup_steps", args.warmup_steps, settings["warmup_steps"]))
    if changes:
        listed = "; ".join(f"{flag} {new} (the checkpoint's run: {old})" for flag, new, old in changes)
        again = " ".join(f"{flag} {old}" for flag, _, old in changes)
        raise ValueError(
            f"--resume: {where} cannot continue its learning-rate schedule with {listed}. The Trainer restores the "
            f"checkpoint's optimizer and scheduler, so the run would silently train on a mix of the two schedules "
            f"(and ignore a new learning rate). Resume with the run's settings ({again}), or {new_run}"
        )
    return found
