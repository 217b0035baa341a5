"""The `attnres` command.

- `attnres convert SOURCE OUTPUT_DIR`: retrofit a Llama/Mistral/Qwen2/Qwen3 checkpoint (HF folder or GGUF file).
- `attnres train MODEL --data FILES --method {routers,lora,full} --output-dir D`: fine-tune with `Trainer`.
- `attnres routing MODEL --text ...` (and `routing compare`, `routing dynamics`): read the depth routing.
- `attnres demo`: the main job on the real SmolLM2-135M-Instruct (`make demo`).
- `attnres info PATH`: depth mixing, block layout (which sub-layers form each block, paper Eq. 6), router counts.

Heavy modules are imported inside the subcommands, so `attnres --help` stays fast.
"""

import argparse
import sys

from . import __version__
from .modeling import AttnResConfig
from .modeling.configuration_attnres import DEPTH_MIXING_METHODS


def block_layout(config: AttnResConfig) -> list[list[str]]:
    """Sub-layer names per block, e.g. `[["0.attn", "0.mlp"], ["1.attn", "1.mlp"]]` for block size 2.

    Sub-layer `2 i` is the attention of layer `i` and `2 i + 1` its MLP; block `n` holds sub-layers
    `[n S, (n + 1) S)`, the last block possibly partial.
    """
    names = [f"{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}" for i in range(config.num_sublayers)]
    size = config.attnres_block_size
    return [names[start : start + size] for start in range(0, len(names), size)]


def _info(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    path = Path(args.path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json at {args.path}")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type != AttnResConfig.model_type:
        raise ValueError(f"{args.path} is not an AttnRes checkpoint (model_type {model_type!r}); "
                         "`attnres convert` retrofits Llama/Mistral/Qwen2/Qwen3 ones")
    config = AttnResConfig.from_pretrained(args.path)
    print(f"model_type          {config.model_type}")
    print(f"depth_mixing        {config.depth_mixing}")
    print(f"layers / sub-layers {config.num_hidden_layers} / {config.num_sublayers}")
    print(f"hidden_size         {config.hidden_size}")
    if config.depth_mixing == "attnres":
        kind = "Full AttnRes" if config.attnres_block_size == 1 else "Block AttnRes"
        size = config.attnres_block_size
        last = config.num_sublayers - size * (config.num_attnres_blocks - 1)
        layout = f"{config.num_attnres_blocks} blocks" + (f", the last of {last}" if last != size else "")
        print(f"block size          {size} sub-layer{'s' if size > 1 else ''} ({kind}, {layout})")
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

    return HfArgumentParser(
        (AttnResArguments, TrainingArguments),
        usage="attnres train MODEL --data FILE [FILE ...] [--method {routers,lora,full}] --output-dir DIR "
        "[--max-steps N] [--seq-len T] [--lr LR] [--resume] [any TrainingArguments flag; _ and - both work]",
    )


def _train(args: argparse.Namespace) -> int:
    from .training import DEFAULT_LEARNING_RATES, train

    parser = _train_parser()
    argv = ["--learning_rate" if arg == "--lr" else arg.replace("--lr=", "--learning_rate=", 1)
            if arg.startswith("--lr=") else arg for arg in args.rest]
    given = {arg.lstrip("-").split("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    for name, value in TRAIN_DEFAULTS.items():
        if name not in given:
            argv += [f"--{name}", value]
    ours, training_args = parser.parse_args_into_dataclasses(["--model", args.model, *argv])
    if "learning_rate" not in given:
        training_args.learning_rate = DEFAULT_LEARNING_RATES[ours.method]
    train(ours, training_args)
    return 0


def _routing_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres routing",
        description="Depth-routing maps of an AttnRes model. Also: `attnres routing compare MODEL --pairs FILE` and "
        "`attnres routing dynamics --data FILE`.",
    )
    parser.add_argument("model", help="AttnRes model folder")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the input text")
    text.add_argument("--data", help="a text file (its first --max-tokens tokens are used)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--token", type=int, default=None, help="token index for the per-token map (default: last)")
    parser.add_argument("--span", default=None, help="token span START:END for the per-token map (mean over it)")
    parser.add_argument("--output-dir", default="outputs/routing")
    return parser


def _load_model_and_tokenizer(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _routing(argv: list[str]) -> int:
    import json
    from pathlib import Path

    import numpy as np

    from .analysis import record_routing, summarize
    from .analysis.plots import plot_average_routing, plot_token_routing

    args = _routing_parser().parse_args(argv)
    model, tokenizer = _load_model_and_tokenizer(args.model)
    text = args.text if args.text is not None else Path(args.data).read_text(encoding="utf-8", errors="replace")
    input_ids = tokenizer(text, return_tensors="pt").input_ids[0, : args.max_tokens]
    record = record_routing(model, input_ids, tokenizer)
    if args.span:
        start, end = (int(x) for x in args.span.split(":"))
    else:
        start = len(record.tokens) - 1 if args.token is None else args.token
        end = start + 1
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    plot_average_routing(record, out / "routing_average.png", title=f"{name}: depth routing")
    plot_token_routing(record, out / "routing_tokens.png", start, end, title=f"{name}: depth routing, per token")
    np.savez_compressed(out / "routing.npz", weights=record.weights, value_norms=record.value_norms,
                        routers=np.array(record.routers), sources=np.array(record.sources),
                        tokens=np.array(record.tokens))
    summary = summarize(record)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'router':<20}{'sources':>8}{'entropy/max':>12}{'embedding':>11}{'recent':>8}{'long jumps':>11}  sinks")
    for row in summary["routers"]:
        ratio = "n/a" if row["entropy_ratio"] is None else f"{row['entropy_ratio']:.3f}"
        print(f"{row['router']:<20}{row['n_sources']:>8}{ratio:>12}{row['embedding_mass']:>11.3f}"
              f"{row['recent_mass']:>8.3f}{row['long_jump_mass']:>11.3f}  {', '.join(row['sinks'])}")
    print(f"wrote {out}/routing_average.png, routing_tokens.png, routing.npz, summary.json")
    return 0


def _routing_compare(argv: list[str]) -> int:
    import json
    from pathlib import Path

    import numpy as np

    from .analysis import compare_pairs, load_pairs
    from .analysis.plots import plot_shift

    parser = argparse.ArgumentParser(prog="attnres routing compare",
                                     description="Depth-weight shift after the difference in paired inputs.")
    parser.add_argument("model")
    parser.add_argument("--pairs", required=True,
                        help='.jsonl of {"a": text, "b": text}; "example" uses the shipped contradiction pairs')
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--output-dir", default="outputs/routing-compare")
    args = parser.parse_args(argv)
    from .analysis.compare import EXAMPLE_PAIRS

    pairs = load_pairs(EXAMPLE_PAIRS if args.pairs == "example" else args.pairs)
    model, tokenizer = _load_model_and_tokenizer(args.model)
    result = compare_pairs(model, tokenizer, pairs, bootstrap=args.bootstrap)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_shift(result["routers"], result["sources"], result["shift"], out / "shift.png",
               title=f"depth-weight shift (b - a) after the difference, {result['pairs_used']} pairs")
    width = max(len(source) for source in result["sources"])
    print(f"{result['pairs_used']} pairs; aligned tokens after the difference: {result['aligned_tokens']}")
    print(f"{'router':<20}{'largest shift':>14}  {'source':<{width}}  95% interval")
    rows = []
    for r, router in enumerate(result["routers"]):
        shift = result["shift"][r]
        c = int(np.nanargmax(np.abs(shift)))
        low, high = result["low"][r, c], result["high"][r, c]
        rows.append({"router": router, "source": result["sources"][c], "shift": float(shift[c]),
                     "low": float(low), "high": float(high)})
        print(f"{router:<20}{shift[c]:>+14.4f}  {result['sources'][c]:<{width}}  [{low:+.4f}, {high:+.4f}]")
    (out / "compare.json").write_text(json.dumps({"largest_shift_per_router": rows, "aligned_tokens":
                                                  result["aligned_tokens"], "max_abs_shift": result["max_abs_shift"]},
                                                 indent=2) + "\n")
    print(f"wrote {out}/shift.png and compare.json")
    return 0


def _routing_dynamics(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from .analysis import run_dynamics

    parser = argparse.ArgumentParser(
        prog="attnres routing dynamics",
        description="Train a baseline and a Block AttnRes model of the same small shape from scratch on the same "
        "text and plot output and gradient magnitude across depth (paper Figure 5 b/c).",
    )
    parser.add_argument("--data", nargs="+", required=True, help=".txt / .jsonl files or datasets folders")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the cached SmolLM2 one)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--output-dir", default="outputs/dynamics")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from .demo import smollm2_hf_folder

        args.tokenizer = smollm2_hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    histories = run_dynamics(args.data, tokenizer, args.output_dir, steps=args.steps, num_hidden_layers=args.layers,
                             hidden_size=args.hidden_size, seq_len=args.seq_len, every=args.every)
    for name, history in histories.items():
        loss = history["last_logged_train_loss"]
        print(f"{name}: last logged train loss {'n/a' if loss is None else format(loss, '.3f')}")
        for key in ("hidden_rms", "output_rms", "grad_norm"):
            print(f"  {key:<11}" + " ".join(f"{v:8.3g}" for v in history[key][-1]))
    print(f"wrote {args.output_dir}/dynamics.png and dynamics.json")
    return 0


ROUTING_COMMANDS = {"compare": _routing_compare, "dynamics": _routing_dynamics}


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
    convert.add_argument("--depth-mixing", default="attnres", choices=list(DEPTH_MIXING_METHODS),
                         help="the method; every one starts exactly as the source (default: attnres)")
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

    commands.add_parser("routing", add_help=False, help="depth-routing maps; also `routing compare`, `routing dynamics`")

    demo = commands.add_parser("demo", help="convert the real SmolLM2-135M-Instruct and check it (make demo)")
    demo.add_argument("--output-dir", default="outputs/demo", help="an earlier demo output there is replaced")
    demo.add_argument("--block-size", type=int, default=None)
    demo.add_argument("--ppl-tokens", type=int, default=4096)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["routing"]:  # `routing MODEL ...`, `routing compare ...`, `routing dynamics ...`
        command = ROUTING_COMMANDS.get(argv[1] if len(argv) > 1 else "", _routing)
        rest = argv[2:] if command is not _routing else argv[1:]
        try:
            return command(rest)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            print(f"attnres routing: error: {error}", file=sys.stderr)
            return 2
    if argv[:1] == ["train"] and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        _train_parser().print_help()  # the Trainer options live in TrainingArguments, not in this parser
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and the like
        return 0
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"attnres {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
