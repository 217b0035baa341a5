"""The `attnres` command.

- `attnres convert SOURCE OUTPUT_DIR`: retrofit a Llama/Mistral/Qwen2/Qwen3 checkpoint (HF folder or GGUF file).
- `attnres train MODEL --data FILES --method {routers,lora,full} --output-dir D`: fine-tune with `Trainer`.
- `attnres demo`: the main job on the real SmolLM2-135M-Instruct (`make demo`).
- `attnres info PATH`: depth mixing, block layout (which sub-layers form each block, paper Eq. 6), router counts.

Heavy modules are imported inside the subcommands, so `attnres --help` stays fast.
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


def _convert(args: argparse.Namespace) -> int:
    from .conversion import convert

    overrides = {"attnres_rescale_output": False} if args.paper_mean else {}
    report = convert(
        args.source,
        args.output_dir,
        gguf_file=args.gguf_file,
        attnres_block_size=1 if args.full else args.block_size,
        depth_mixing=args.depth_mixing,
        dtype=args.dtype,
        force=args.force,
        max_shard_size=args.max_shard_size,
        **overrides,
    )
    check = report["verification"]
    print(f"max |delta logits| vs source: {check['max_abs_logit_delta']:.3g} on {check['num_probe_tokens']} tokens")
    print(f"{check['greedy_new_tokens']}-token greedy continuation identical: {check['greedy_match']}")
    print(f"wrote {args.output_dir}")
    return 0


TRAIN_DEFAULTS = {"eval_strategy": "steps", "eval_steps": "50", "save_steps": "50", "logging_steps": "10"}


def _train_parser():
    from transformers import HfArgumentParser, TrainingArguments

    from .training import AttnResArguments

    return HfArgumentParser((AttnResArguments, TrainingArguments), prog="attnres train MODEL")


def _train(args: argparse.Namespace) -> int:
    from .training import DEFAULT_LEARNING_RATES, train

    parser = _train_parser()
    argv = ["--learning_rate" if arg == "--lr" else arg for arg in args.rest]
    given = {arg.lstrip("-").split("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    for name, value in TRAIN_DEFAULTS.items():
        if name not in given:
            argv += [f"--{name}", value]
    ours, training_args = parser.parse_args_into_dataclasses(["--model", args.model, *argv])
    if "learning_rate" not in given:
        training_args.learning_rate = DEFAULT_LEARNING_RATES[ours.method]
    train(ours, training_args)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.output_dir, attnres_block_size=args.block_size, ppl_tokens=args.ppl_tokens)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres", description="Attention Residuals for Hugging Face transformers")
    parser.add_argument("--version", action="version", version=f"attnres-hf {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="describe an AttnRes checkpoint or config (folder or config.json)")
    info.add_argument("path", help="a folder with config.json, or the config.json itself")
    info.set_defaults(func=_info)

    convert = commands.add_parser("convert", help="retrofit a Llama/Mistral/Qwen2/Qwen3 checkpoint into AttnRes")
    convert.add_argument("source", help="an HF model folder, or a .gguf file")
    convert.add_argument("output_dir", help="folder to write (refused if it exists, unless --force)")
    convert.add_argument("--gguf-file", help="GGUF file name inside SOURCE when SOURCE is a folder")
    size = convert.add_mutually_exclusive_group()
    size.add_argument("--block-size", type=int, help="sub-layers per block (even; default about 8 blocks)")
    size.add_argument("--full", action="store_true", help="Full AttnRes (block size 1)")
    convert.add_argument("--depth-mixing", default="attnres", choices=["attnres", "residual"])
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    convert.add_argument("--paper-mean", action="store_true",
                         help="routers output the plain mean of their sources (the paper) instead of the rescaled "
                              "mean that reproduces the source's logits to float noise")
    convert.add_argument("--max-shard-size", default="5GB")
    convert.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")
    convert.set_defaults(func=_convert)

    train = commands.add_parser(
        "train", add_help=False, help="fine-tune: --method routers|lora|full (attnres train --help for all options)",
        description="attnres train MODEL --data FILES --method {routers,lora,full} --output-dir D [--max-steps N] "
        "[--seq-len T] [--lr LR] [--resume], plus any transformers TrainingArguments flag.",
    )
    train.add_argument("model", help="model folder; --help lists every option")
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(func=_train)

    demo = commands.add_parser("demo", help="convert the real SmolLM2-135M-Instruct and check it (make demo)")
    demo.add_argument("--output-dir", default="outputs/demo", help="an earlier demo output there is replaced")
    demo.add_argument("--block-size", type=int, default=None)
    demo.add_argument("--ppl-tokens", type=int, default=4096)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"] and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        _train_parser().print_help()  # the Trainer options live in TrainingArguments, not in this parser
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"attnres {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
