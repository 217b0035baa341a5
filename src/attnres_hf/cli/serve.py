"""`attnres serve [MODEL] [options]`: transformers' own OpenAI-compatible server (`transformers serve`) for AttnRes
folders. Every option is `transformers serve`'s (`attnres serve --help` lists them)."""

import argparse

from ._common import add_command


def register(commands: argparse._SubParsersAction) -> None:
    parser = add_command(commands, "serve", run_serve, add_help=False,
                         help="serve a model folder on /v1/chat/completions and /v1/completions (transformers serve)")
    parser.set_defaults(pass_through=True)  # the options are transformers serve's, parsed by its own command


def run_serve(args: argparse.Namespace) -> int:
    from ..serving import main

    return main(args.rest)
