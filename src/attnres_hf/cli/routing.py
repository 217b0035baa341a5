"""`attnres routing MODEL --text ...` (= `routing map`), `routing compare`, `routing dynamics`: read the depth routing."""

import argparse
import json
from pathlib import Path

from ._common import add_command, add_family, load_model_and_tokenizer


def register(commands: argparse._SubParsersAction) -> None:
    family = add_family(
        commands, "routing", default="map", help="depth-routing maps; also `routing compare`, `routing dynamics`",
        description="Read the depth routing of an AttnRes model. `attnres routing MODEL ...` is short for "
        "`attnres routing map MODEL ...`.",
    )
    parser = add_command(family, "map", run_map, help="depth-routing maps of one text (the default)",
                         description="Depth-routing maps of an AttnRes model.")
    parser.add_argument("model", help="AttnRes model folder")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the input text")
    text.add_argument("--data", help="a text file (its first --max-tokens tokens are used)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--token", type=int, default=None, help="token index for the per-token map (default: last)")
    parser.add_argument("--span", default=None, help="token span START:END for the per-token map (mean over it)")
    parser.add_argument("--output-dir", default="outputs/routing")

    parser = add_command(family, "compare", run_compare, help="depth-weight shift after the difference in paired "
                         "inputs", description="Depth-weight shift after the difference in paired inputs.")
    parser.add_argument("model")
    parser.add_argument("--pairs", required=True,
                        help='.jsonl of {"a": text, "b": text}; "example" uses the shipped contradiction pairs')
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--output-dir", default="outputs/routing-compare")

    parser = add_command(
        family, "dynamics", run_dynamics, help="train a baseline and Block AttnRes from scratch, plot depth dynamics",
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


def run_map(args: argparse.Namespace) -> int:
    import numpy as np

    from ..analysis import record_routing, summarize
    from ..analysis.plots import plot_average_routing, plot_token_routing

    model, tokenizer = load_model_and_tokenizer(args.model)
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


def run_compare(args: argparse.Namespace) -> int:
    import numpy as np

    from ..analysis import compare_pairs, load_pairs
    from ..analysis.compare import EXAMPLE_PAIRS
    from ..analysis.plots import plot_shift

    pairs = load_pairs(EXAMPLE_PAIRS if args.pairs == "example" else args.pairs)
    model, tokenizer = load_model_and_tokenizer(args.model)
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


def run_dynamics(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..analysis import run_dynamics

    if args.tokenizer is None:
        from ..demo import smollm2_hf_folder

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
