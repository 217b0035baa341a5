"""The `attnres` command: one module per command family, each adding its sub-commands to one argparse tree.

- `attnres convert SOURCE OUTPUT_DIR`: retrofit a checkpoint of a supported family (HF folder or GGUF file).
- `attnres export --to fla MODEL OUTPUT_DIR`: write an AttnRes model as flash-linear-attention's checkpoint.
- `attnres train MODEL --data FILES --method METHOD --output-dir D`: fine-tune with `Trainer`.
- `attnres eval MODEL` (and `eval prepare-data`, `eval tasks`, `eval perplexity`), `attnres lm-eval ...`: lm-eval.
- `attnres routing MODEL --text ...` (and `routing compare`, `routing dynamics`): read the depth routing.
- `attnres info PATH`: depth mixing, block layout, router counts.
- `attnres serve MODEL [transformers serve options]`: OpenAI-compatible server (`transformers serve`).
- `attnres demo`: the main job on the real SmolLM2-135M-Instruct (`make demo`).

Adding a command family is one module with `register(commands)` and one entry in `COMMAND_MODULES`. Heavy modules
are imported inside the commands. Expected errors (bad input, missing files) end in a one-line message and exit
code 2, as argparse's own usage errors do; Ctrl-C (SIGINT) and SIGTERM in one line each and exit codes 130 and 143.
"""

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

from ._common import unrecognized_arguments, with_default_subcommand

COMMAND_MODULES = ("convert", "export", "train", "eval", "routing", "info", "serve", "demo")
"""Modules of this package that each `register(commands)` a command family, in `attnres --help` order."""

EXPECTED_ERRORS = (OSError, ValueError, KeyError, RuntimeError, ImportError)
"""What the library raises for bad input, missing files, refused opt-ins and a missing extra (`FileNotFoundError`,
`FileExistsError`, `PermissionError` are `OSError`s; `ImportError` names the extra to install): reported in one line,
not as a traceback."""


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="attnres", description="Attention Residuals for Hugging Face transformers",
                                     allow_abbrev=False)  # a prefix of one option is no other option
    parser.add_argument("--version", action="version", version=f"attnres-hf {__version__}")
    parser.commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f".{name}", __name__).register(parser.commands)
    return parser


def _quiet_optional_bitsandbytes_kernel() -> None:
    """Drop bitsandbytes' import-time warning that it could not fetch its optional CPU 4-bit kernel from the Hugging
    Face Hub (`kernels` package): it then runs its built-in kernel, the one this package tests, and every command
    (PEFT imports bitsandbytes) printed the warning on an AVX-512 BF16 CPU. Its other messages are kept."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community"))


def main(argv: list[str] | None = None) -> int:
    """Run `attnres ARGV...` (default `sys.argv[1:]`); returns the exit code."""
    _quiet_optional_bitsandbytes_kernel()
    parser = build_parser()
    argv = with_default_subcommand(parser.commands, list(sys.argv[1:] if argv is None else argv))
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "pass_through", False):
        args.parser.error(unrecognized_arguments(args.parser, rest))  # with "did you mean --block-size?"
    args.rest, args.argv = rest, argv  # `argv`: for a pass-through command that parses its own arguments in order
    previous = _exit_on_sigterm()
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        _silence_stdout()
        return 0
    except EXPECTED_ERRORS as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{args.parser.prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (a staged output folder is already deleted)
        print(f"{args.parser.prog}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Stopped:
        print(f"{args.parser.prog}: stopped (SIGTERM)", file=sys.stderr)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Stopped(SystemExit):
    """`SystemExit(143)`, raised in the main thread by SIGTERM while a command runs (`_exit_on_sigterm`)."""


def _exit_on_sigterm():
    """Make SIGTERM (`kill`, a job scheduler's stop) raise `Stopped` (`SystemExit(143)`) in the main thread, so that a
    command's temporary output folder is deleted as on Ctrl-C (`_io.staged_folder`) instead of the process dying with
    it left behind, and `main` says so in one line; returns the previous handler (`None` off the main thread, where no
    handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise Stopped(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not raise BrokenPipeError again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        pass
