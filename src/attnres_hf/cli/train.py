"""`attnres train MODEL --data FILES --method METHOD --output-dir D`: fine-tune with `Trainer`.

METHOD is one of `attnres_hf.training.METHODS` (routers, LoRA, QLoRA, full).

Every `transformers.TrainingArguments` flag is accepted (`_` and `-` both work); `attnres train --help` lists them.
"""

import argparse

from ._common import add_command

TRAIN_DEFAULTS = {"eval_strategy": "steps", "eval_steps": "50", "save_steps": "50", "logging_steps": "10"}


def register(commands: argparse._SubParsersAction) -> None:
    parser = add_command(
        commands, "train", run_train, add_help=False,
        help="fine-tune the routers, LoRA/QLoRA adapters or everything (attnres train --help for all options)",
        description="attnres train MODEL --data FILES --method METHOD --output-dir D [--max-steps N] "
        "[--seq-len T] [--lr LR] [--resume], plus any transformers TrainingArguments flag.",
    )
    parser.add_argument("model", nargs="?", help="model folder; --help lists every option")
    parser.set_defaults(pass_through=True)  # the options are HfArgumentParser's, parsed in `run_train`


def train_parser():
    """The parser of the options after MODEL: `AttnResArguments` and `TrainingArguments`."""
    from transformers import HfArgumentParser, TrainingArguments

    from ..training import METHODS, AttnResArguments

    return HfArgumentParser(
        (AttnResArguments, TrainingArguments), allow_abbrev=False,  # `--learning 1e-3` is no `--learning_rate`
        usage=f"attnres train MODEL --data FILE [FILE ...] [--method {{{','.join(METHODS)}}}] --output-dir DIR "
        "[--max-steps N] [--seq-len T] [--lr LR] [--resume] [any TrainingArguments flag; _ and - both work]",
    )


def run_train(args: argparse.Namespace) -> int:
    from ..training import DEFAULT_LEARNING_RATES, train

    parser = train_parser()
    # the arguments after `train`, in order: MODEL first, or `--model MODEL` / `--model=MODEL` anywhere (an option
    # argparse does not know makes it take the next value, e.g. --data's, for MODEL)
    rest = list(args.argv[args.argv.index("train") + 1:])
    args.model = None if not rest or rest[0].startswith("-") else rest.pop(0)
    for index, arg in enumerate(rest):
        if arg == "--model" and index + 1 < len(rest):
            args.model = rest[index + 1]
            del rest[index:index + 2]
            break
        if arg.startswith("--model="):
            args.model = arg.split("=", 1)[1]
            del rest[index]
            break
    args.rest = rest
    if args.model is None or args.model in ("-h", "--help") or {"-h", "--help"} & set(args.rest):
        parser.print_help()  # the Trainer options live in TrainingArguments, not in the argparse tree
        return 0
    argv = ["--learning_rate" if arg == "--lr" else arg.replace("--lr=", "--learning_rate=", 1)
            if arg.startswith("--lr=") else arg for arg in args.rest]
    given = {arg.lstrip("-").split("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    for name, value in TRAIN_DEFAULTS.items():
        if name not in given:
            argv += [f"--{name}", value]
    ours, training_args, unknown = parser.parse_args_into_dataclasses(["--model", args.model, *argv],
                                                                      return_remaining_strings=True)
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (attnres train --help lists every option)")
    if "learning_rate" not in given:
        training_args.learning_rate = DEFAULT_LEARNING_RATES[ours.method]
    train(ours, training_args)
    return 0
