"""`attnres routing MODEL --text ...` (= `routing map`), `routing compare`, `routing dynamics`: depth routing;
`--html` on `map` and `compare` also writes the routing explorer page (`analysis.explorer`)."""

import argparse
import json
from pathlib import Path

from ._common import (add_command, add_family, add_trust_remote_code, check_model_folder, check_tokenizer_folder,
                      load_model_and_tokenizer, positive_int)


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
    parser.add_argument("--chat", action="store_true",
                        help="read the text as a user turn of the model's chat template (one BOS), as in chat use")
    parser.add_argument("--max-tokens", type=positive_int, default=512)
    parser.add_argument("--token", type=int, default=None, help="token index for the per-token map (default: last)")
    parser.add_argument("--span", default=None, help="token span START:END for the per-token map (mean over it)")
    parser.add_argument("--output-dir", default="outputs/routing")
    parser.add_argument("--html", metavar="PATH", default=None,
                        help="also write the routing explorer, one self-contained page: the text as tokens, each "
                        "token's map, alpha or alpha*||v||, the mean over tokens (refused if PATH exists, unless "
                        "--force)")
    parser.add_argument("--force", action="store_true", help="replace an existing --html file")
    add_trust_remote_code(parser)

    parser = add_command(family, "compare", run_compare, help="depth-weight shift after the difference in paired "
                         "inputs", description="Depth-weight shift after the difference in paired inputs.")
    parser.add_argument("model")
    parser.add_argument("--pairs", required=True,
                        help='.jsonl of {"a": text, "b": text}; "example" uses the shipped contradiction pairs')
    parser.add_argument("--chat", action="store_true", help="read each text as a user turn of the chat template")
    parser.add_argument("--bootstrap", type=positive_int, default=2000)
    parser.add_argument("--output-dir", default="outputs/routing-compare")
    parser.add_argument("--html", metavar="PATH", default=None,
                        help="also write the routing explorer of one pair (--html-pair): both texts token by token "
                        "and the difference b - a of their maps (refused if PATH exists, unless --force)")
    parser.add_argument("--html-pair", type=int, default=None, metavar="N",
                        help="the pair the --html page shows: its index in --pairs (0-based; default 0, the first)")
    parser.add_argument("--force", action="store_true", help="replace an existing --html file")
    add_trust_remote_code(parser)

    parser = add_command(
        family, "dynamics", run_dynamics, help="train a baseline and Block AttnRes from scratch, plot depth dynamics",
        description="Train a baseline and a Block AttnRes model of the same small shape from scratch on the same "
        "text and plot output and gradient magnitude across depth (paper Figure 5 b/c).",
    )
    parser.add_argument("--data", nargs="+", required=True, help=".txt / .jsonl files or datasets folders")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the cached SmolLM2 one)")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--every", type=positive_int, default=25)
    parser.add_argument("--output-dir", default="outputs/dynamics")


def run_map(args: argparse.Namespace) -> int:
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..analysis import encode_text, record_routing, summarize, write_routing_explorer
    from ..analysis.explorer import check_explorer_path
    from ..analysis.plots import plot_average_routing, plot_token_routing

    check_model_folder(args.model, attnres=True)
    if args.html is not None:
        check_explorer_path(args.html, args.force)
    check_tokenizer_folder(args.model, args.trust_remote_code)
    text = args.text if args.text is not None else read_text_file(args.data)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    input_ids = encode_text(tokenizer, text, chat=args.chat, max_tokens=args.max_tokens)
    start, end = token_range(args.span, args.token, len(input_ids))
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    record = record_routing(model, input_ids, tokenizer)
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
    if args.html is not None:
        write_routing_explorer(record, args.html, title=f"{name}: depth routing", force=args.force)
    print(f"{'router':<20}{'sources':>8}{'entropy/max':>12}{'embedding':>11}{'recent':>8}{'long jumps':>11}  sinks")
    for row in summary["routers"]:
        ratio = "n/a" if row["entropy_ratio"] is None else f"{row['entropy_ratio']:.3f}"
        print(f"{row['router']:<20}{row['n_sources']:>8}{ratio:>12}{row['embedding_mass']:>11.3f}"
              f"{row['recent_mass']:>8.3f}{row['long_jump_mass']:>11.3f}  {', '.join(row['sinks'])}")
    print(f"wrote {out}/routing_average.png, routing_tokens.png, routing.npz, summary.json"
          + ("" if args.html is None else f" and {args.html}"))
    return 0


def read_text_file(path: str) -> str:
    """The text of `path` (undecodable bytes replaced)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--data: no file {path}")
    return Path(path).read_text(encoding="utf-8", errors="replace")


def token_range(span: str | None, token: int | None, length: int) -> tuple[int, int]:
    """`[start, end)` of the per-token map from `--span START:END` or `--token I` (negative: from the end; default
    the last token), checked against the `length` tokens of the input."""
    if span is not None:
        start, sep, end = span.partition(":")
        try:
            start, end = int(start), int(end)
        except ValueError:
            raise ValueError(f"--span takes START:END token indices, e.g. 10:14; got {span!r}") from None
        if not sep or not 0 <= start < end <= length:
            raise ValueError(f"--span {span}: need 0 <= START < END <= {length} (the input has {length} tokens)")
        return start, end
    index = length - 1 if token is None else token
    if not -length <= index < length:
        raise ValueError(f"--token {token}: the input has {length} tokens (indices 0 to {length - 1}, or negative)")
    index %= length
    return index, index + 1


def run_compare(args: argparse.Namespace) -> int:
    from ..analysis import compare_pairs, largest_shifts, load_pairs
    from ..analysis.compare import EXAMPLE_PAIRS
    from ..analysis.plots import plot_shift

    check_model_folder(args.model, attnres=True)
    pairs = load_pairs(EXAMPLE_PAIRS if args.pairs == "example" else args.pairs)
    html_pair = check_html_pair(args, len(pairs))
    model, tokenizer = load_model_and_tokenizer(args.model, args.trust_remote_code)
    result = compare_pairs(model, tokenizer, pairs, bootstrap=args.bootstrap, chat=args.chat)
    if args.html is not None:
        write_pair_explorer(model, tokenizer, pairs[html_pair], html_pair, args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_shift(result["routers"], result["sources"], result["shift"], out / "shift.png",
               title=f"depth-weight shift (b - a) after the difference, {result['pairs_used']} pairs")
    width = max(len(source) for source in result["sources"])
    print(f"{result['pairs_used']} pairs; aligned tokens after the difference: {result['aligned_tokens']}")
    print(f"{'router':<20}{'largest shift':>14}  {'source':<{width}}  95% interval")
    rows = largest_shifts(result)
    for row in rows:
        interval = f"[{row['low']:+.4f}, {row['high']:+.4f}]"
        print(f"{row['router']:<20}{row['shift']:>+14.4f}  {row['source']:<{width}}  {interval}")
    (out / "compare.json").write_text(json.dumps({"largest_shift_per_router": rows, "aligned_tokens":
                                                  result["aligned_tokens"], "max_abs_shift": result["max_abs_shift"]},
                                                 indent=2) + "\n")
    print(f"wrote {out}/shift.png and compare.json"
          + ("" if args.html is None else f"; the explorer of pair {html_pair} to {args.html}"))
    return 0


def check_html_pair(args: argparse.Namespace, n_pairs: int) -> int:
    """The index of the pair `routing compare --html` shows, checked (with the --html path) before any model loads."""
    from ..analysis.explorer import check_explorer_path

    if args.html is None:
        if args.html_pair is not None:
            raise ValueError("--html-pair chooses the pair of the --html page; give --html PATH too")
        return 0
    check_explorer_path(args.html, args.force)
    index = 0 if args.html_pair is None else args.html_pair
    if not 0 <= index < n_pairs:
        raise ValueError(f"--html-pair {index}: --pairs has {n_pairs} pairs (indices 0 to {n_pairs - 1})")
    return index


def write_pair_explorer(model, tokenizer, pair: dict, index: int, args: argparse.Namespace) -> None:
    """The routing explorer of one pair: texts `a` and `b`, each read as `routing compare` reads it."""
    from ..analysis import encode_text, record_routing, write_routing_explorer

    records = [record_routing(model, encode_text(tokenizer, pair[key], chat=args.chat), tokenizer) for key in "ab"]
    name = f" ({pair['name']})" if "name" in pair else ""
    write_routing_explorer(records, args.html, labels=["a", "b"], force=args.force,
                           title=f"{Path(args.model).name}: depth routing, pair {index}{name}, b against a")


def run_dynamics(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..analysis import run_dynamics

    for file in args.data:
        if not Path(file).exists():
            raise FileNotFoundError(f"--data: no file or folder {file}")
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
