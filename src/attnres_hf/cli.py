"""The `attnres` command.

`attnres info PATH` describes an AttnRes checkpoint or config: depth mixing, block layout (which sub-layers form
each block, paper Eq. 6) and parameter counts. Conversion, evaluation, training and routing commands are added by
their own modules.
"""

import argparse
import sys

from . import __version__
from .modeling import AttnResConfig


def block_layout(config: AttnResConfig) -> list[list[str]]:
    """Sub-layer names per block, e.g. `[["0.attn", "0.mlp"], ["1.attn", "1.mlp"]]` for block size 2.

    Sub-layer `2 i` is the attention of layer `i` and `2 i + 1` its MLP; block `n` holds sub-layers
    `[n S, (n + 1) S)`, the last block possibly partial.
    """
    names = [f"{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}" for i in range(config.num_sublayers)]
    size = config.attnres_block_size
    return [names[start : start + size] for start in range(0, len(names), size)]


def _info(args: argparse.Namespace) -> int:
    config = AttnResConfig.from_pretrained(args.path)
    print(f"model_type          {config.model_type}")
    print(f"depth_mixing        {config.depth_mixing}")
    print(f"layers / sub-layers {config.num_hidden_layers} / {config.num_sublayers}")
    print(f"hidden_size         {config.hidden_size}")
    if config.depth_mixing == "attnres":
        kind = "Full AttnRes" if config.attnres_block_size == 1 else "Block AttnRes"
        print(f"block size          {config.attnres_block_size} sub-layers ({kind}, {config.num_attnres_blocks} blocks)")
        print(f"routers             {config.num_sublayers + 1} (attn_res and mlp_res per layer, final_res)")
        print(f"router parameters   {(config.num_sublayers + 1) * 2 * config.hidden_size:,}")
        for index, block in enumerate(block_layout(config), start=1):
            print(f"  block {index:>3}: {' '.join(block)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres", description="Attention Residuals for Hugging Face transformers")
    parser.add_argument("--version", action="version", version=f"attnres-hf {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="describe an AttnRes checkpoint or config (folder or config.json)")
    info.add_argument("path", help="a folder with config.json, or the config.json itself")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError) as error:
        print(f"attnres {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
