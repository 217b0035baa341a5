"""`attnres train MODEL --data FILES --method METHOD --output-dir D`: fine-tune with `Trainer`.

METHOD is one of `attnres_hf.training.METHODS` (routers, LoRA, QLoRA, full).

Every `transformers.TrainingArguments` flag is accepted (`_` and `-` both work); `attnres train --help` lists them.
"""

import argparse

from ._common import add_command, misspelt_options

TRAIN_DEFAULTS = {"eval_steps": "50", "save_steps": "50", "logging_steps": "10"}
"""TrainingArguments flags the command fills when not given. Evaluation stays TrainingArguments' default, off
(`eval_strategy no`): it is opt-in with `--eval-strategy steps` (every `--eval-steps`, 50 here, and before the first
step and after the last: `training.train`), since on a real model each pass over the held-out blocks can cost more
than a short run's training steps."""

EVALUATION_HELP = ("evaluation is opt-in: --eval-strategy steps evaluates the held-out blocks (loss, perplexity, "
                   "depth entropy) before the first step, every --eval-steps (default 50) and after the last")


def register(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands, "train", run_train, add_help=False,
        help="fine-tune the routers, LoRA/QLoRA adapters or everything (attnres train --help for all options)",
        description="attnres train MODEL --data FILES --method METHOD --output-dir D [--max-steps N] "
        f"[--seq-len T] [--lr LR] [--resume], plus any transformers TrainingArguments flag; {EVALUATION_HELP}.",
    )
    parser.add_argument("model", nargs="?", help="model folder; --help lists every option")
    parser.set_defaults(pass_through=True)  # the options are HfArgumentParser's, parsed in `run_train`


def train_parser():
    """The parser of the options after MODEL: `AttnResArguments` and `TrainingArguments`."""
    from transformers import HfArgumentParser, TrainingArguments

    from ..training import METHODS, AttnResArguments

    parser = HfArgumentParser(
        (AttnResArguments, TrainingArguments), allow_abbrev=False,  # `--learning 1e-3` is no `--learning_rate`
        usage=f"attnres train MODEL --data FILE [FILE ...] [--method {{{','.join(METHODS)}}}] --output-dir DIR "
        "[--max-steps N] [--seq-len T] [--lr LR] [--resume] [any TrainingArguments flag; _ and - both work]",
        description=f"MODEL: {AttnResArguments.__dataclass_fields__['model'].metadata['help']}, first. "
        f"{EVALUATION_HELP[0].upper()}{EVALUATION_HELP[1:]}.",
    )
    # MODEL is the first argument (as every page writes it); `run_train` hands it on as AttnResArguments' `--model`,
    # which the help does not list as a second way to give it
    parser._option_string_actions["--model"].help = argparse.SUPPRESS
    return parser


def run_train(args: argparse.Namespace) -> int:
    from ..training import DEFAULT_LEARNING_RATES, train

    parser = train_parser()
    # the arguments after `train`, in order: MODEL first (an option argparse does not know would make it take the
    # next value, e.g. --data's, for MODEL)
    rest = list(args.argv[args.argv.index("train") + 1:])
    if not rest or {"-h", "--help"} & set(rest):
        parser.print_help()  # the Trainer options live in TrainingArguments, not in the argparse tree
        return 0
    if rest[0].startswith("-") or any(arg == "--model" or arg.startswith("--model=") for arg in rest):
        raise ValueError("the model folder comes first, as MODEL: attnres train MODEL --data FILE ... "
                         "(attnres train --help lists every option)")
    args.model, args.rest = rest[0], rest[1:]
    argv = ["--learning_rate" if arg == "--lr" else arg.replace("--lr=", "--learning_rate=", 1)
            if arg.startswith("--lr=") else arg for arg in args.rest]
    given = {arg.lstrip("-").split("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    for name, value in TRAIN_DEFAULTS.items():
        if name not in given:
            argv += [f"--{name}", value]
    ours, training_args, unknown = parser.parse_args_into_dataclasses(["--model", args.model, *argv],
                                                                      return_remaining_strings=True)
    if unknown:
        hints = "; ".join([*misspelt_options(parser, unknown), "attnres train --help lists every option"])
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} ({hints})")
    if "learning_rate" not in given:
        training_args.learning_rate = DEFAULT_LEARNING_RATES[ours.method]
    train(ours, training_args)
    return 0
