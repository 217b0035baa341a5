"""What the command modules share: building (sub-)commands and loading a model folder."""

import argparse


def add_command(commands: argparse._SubParsersAction, name: str, func, **kwargs) -> argparse.ArgumentParser:
    """Add the sub-command `name`, run by `func(args) -> exit code`."""
    parser = commands.add_parser(name, allow_abbrev=False, **kwargs)
    parser.set_defaults(func=func, parser=parser)
    return parser


def add_family(commands: argparse._SubParsersAction, name: str, default: str, **kwargs):
    """Add `name` with sub-commands of its own, where `attnres NAME ARGS...` with no sub-command name means
    `attnres NAME DEFAULT ARGS...` (`attnres routing MODEL` = `attnres routing map MODEL`).

    Returns the sub-command collection of the new command.
    """
    family = commands.add_parser(name, allow_abbrev=False, **kwargs)
    family.set_defaults(parser=family)
    family.default_subcommand = default
    family.subcommands = family.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True)
    return family.subcommands


def with_default_subcommand(commands: argparse._SubParsersAction, argv: list[str]) -> list[str]:
    """`argv` with the default sub-command name inserted where a family's arguments start without one."""
    family = commands.choices.get(argv[0]) if argv else None
    default = getattr(family, "default_subcommand", None)
    if default is None or len(argv) < 2 or argv[1] in family.subcommands.choices or argv[1] in ("-h", "--help"):
        return argv
    return [argv[0], default, *argv[1:]]


def misspelt_options(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`"--blok-size: did you mean --block-size?"` for each option of `args` that `parser` does not know and that is
    close to one it does (difflib), in order."""
    import difflib

    known = [option for option, action in parser._option_string_actions.items()
             if option.startswith("--") and action.help != argparse.SUPPRESS]  # never hint a hidden option
    hints = []
    for arg in args:
        option = arg.split("=", 1)[0]
        if option.startswith("--") and option not in known:
            close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{option}: did you mean {close[0]}?")
    return hints


def unrecognized_arguments(parser: argparse.ArgumentParser, rest: list[str]) -> str:
    """The one-line usage error for arguments `parser` does not know, with `misspelt_options`' hints. argparse reads
    the value after an unknown option as a positional (`attnres convert --blok-size 4 SRC OUT` takes `4` for SOURCE),
    so the hint names the option, not what argparse made of its value."""
    hints = misspelt_options(parser, rest)
    return f"unrecognized arguments: {' '.join(rest)}" + (f" ({'; '.join(hints)})" if hints else "")


def load_model_and_tokenizer(path: str, trust_remote_code: bool = False):
    """`(model in eval mode, tokenizer)` from a model folder (`check_tokenizer_folder` first); a transformers Kimi
    Linear model's KDA takes fla's kernels on CUDA tensors only (`backbones_moe.dispatch_kda_by_device`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..modeling.backbones_moe import dispatch_kda_by_device

    check_tokenizer_folder(path, trust_remote_code)
    return (dispatch_kda_by_device(AutoModelForCausalLM.from_pretrained(path)).eval(),
            AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """`--trust-remote-code`: run a model folder's own tokenizer code (Kimi's tokenizers are)."""
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the folder's own tokenizer code (a tokenizer_config.json auto_map, as Kimi's) and the "
                             "config code transformers loads with it; off: such a folder is refused")


def add_writing_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that writes a model folder (`convert`, `export`): `--max-shard-size`,
    `--trust-remote-code` (the tokenizer it copies) and `--force`."""
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest weight file written, e.g. 5GB or 500MB (default 5GB)")
    add_trust_remote_code(parser)
    parser.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer_folder(path: str, trust_remote_code: bool = False) -> None:
    """Raise before anything loads unless the folder `path` holds a tokenizer that loads without asking.

    Raises:
        FileNotFoundError: no tokenizer (transformers' own message for that is about sentencepiece and tiktoken).
        ValueError: the tokenizer is the folder's own code and `trust_remote_code` is false (transformers would ask
            interactively; `conversion.convert.check_tokenizer_code`).
    """
    from pathlib import Path

    from ..conversion.convert import check_tokenizer_code

    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save one into it "
                                "(tokenizer.save_pretrained); attnres convert copies the source's when it has one")
    if Path(path).is_dir():
        check_tokenizer_code(path, trust_remote_code)


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_model_folder(path: str, attnres: bool = False) -> None:
    """Raise before anything loads unless `path` is a model folder (with config.json); with `attnres`, one whose
    model has depth routers (`depth_mixing` one of `ROUTER_METHODS`).

    Raises:
        FileNotFoundError: no folder or no config.json there. ValueError: not an AttnRes model with routers.
    """
    import json
    from pathlib import Path

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json there)")
    if attnres:
        from ..modeling.depth_mixing import ROUTER_METHODS, has_routers

        model_type = json.loads(config_file.read_text()).get("model_type")
        depth_mixing = None
        if model_type == "attnres":
            from ..modeling import AttnResConfig

            depth_mixing = AttnResConfig.from_pretrained(path).depth_mixing
        if depth_mixing is None or not has_routers(depth_mixing):
            raise ValueError(f"{path} has no depth routers (model_type {model_type!r}, depth_mixing {depth_mixing!r}): "
                             f"routing maps read a model with depth_mixing one of {ROUTER_METHODS}; "
                             "`attnres convert SOURCE OUT` makes one")
