"""Does a retrofit learn to route? Router-only training of the retrofitted SmolLM2-135M against controls.

A retrofit starts with every pseudo-query at zero (uniform depth weights, exactly the source model). Training the
routers alone lowers held-out perplexity, but so would training any few thousand parameters on the new text (domain
adaptation). This benchmark separates the two. From the same retrofitted model, with the same batches in the same
order, the same steps and the same learning rate, it trains:

- `routers`: the depth routers only (pseudo-queries and key-norm weights; 70,272 parameters in SmolLM2-135M);
- `norms`: the backbone's RMSNorm weights only (no routing: the routers stay at uniform, so the model stays a
  residual model; 35,136 parameters);
- `lora`: LoRA adapters whose parameter count is the closest to the routers' (rank and target modules chosen below;
  SmolLM2-135M: rank 1 on `q_proj` and `o_proj`, 69,120 parameters), routers frozen at uniform.

and reports, for the model without training and each arm: held-out perplexity (with the paired difference over
held-out windows and its 95% t-interval, from `ablation.paired_difference`), the training and held-out loss curves
(does it plateau?), and for the router arm the depth-entropy trajectory (fraction of uniform, the Trainer's
`depth_entropy`), the routing maps (`attnres_hf.analysis`), and whether the learned routing is input-dependent:

- the paired-input probe (`analysis.compare_pairs` on the shipped contradiction pairs): per router and source, the
  shift of the depth weights after a contradicting word, with its 95% bootstrap interval over pairs;
- the static share: of the routing's departure from uniform, `sum_r ||mean_t alpha_rt - u||^2 / sum_r mean_t
  ||alpha_rt - u||^2` on a held-out passage (1.0 = one fixed reweighting for every token, 0 = all per-token).

    python benchmarks/retrofit_routing.py --arms routers --out outputs/retrofit_routers &   # the recorded run
    python benchmarks/retrofit_routing.py --arms norms --out outputs/retrofit_norms         # (README, 'Does a
    python benchmarks/retrofit_routing.py --merge outputs/retrofit_routers outputs/retrofit_norms \\
        --results docs/results/retrofit_routing.md                                         # retrofit ...')

The defaults are the recorded run's: 100 steps of 4 x 32 tokens, lr 2e-4, held-out 2,048 tokens in windows of 256,
one torch thread per process (two threads of one process on a loaded machine wait on each other).

Writes `retrofit_routing.json`, `routing_average.png`, `routing_tokens.png` and `probe_shift.png` to `--out`;
`--results PATH` writes the printed report (Markdown), with how it was measured, as a fragment for the docs
(`benchmarks/_results.py`); with `--merge`, the merged report.
"""

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)
from ablation import format_paired, paired_difference  # noqa: E402  (one home for the paired statistics)

from attnres_hf import assets  # noqa: E402
from attnres_hf.analysis import compare_pairs, largest_shifts, load_pairs, record_routing, summarize  # noqa: E402
from attnres_hf.analysis.compare import EXAMPLE_PAIRS  # noqa: E402
from attnres_hf.demo import norm_parameter_names  # noqa: E402  (the demo's control: the same parameters)
from attnres_hf.training.recipes import is_router_parameter, prepare_model  # noqa: E402
from attnres_hf.training.trainer import depth_entropy  # noqa: E402

ARMS = ("routers", "norms", "lora")


def matched_lora(model: torch.nn.Module, target: int, max_rank: int = 8) -> tuple[int, list[str], int]:
    """`(rank, target module names, parameters)` of the LoRA whose parameter count is closest to `target`, over
    ranks 1..`max_rank` and every subset of the linear layers' names (the head excluded); ties: fewer modules."""
    from attnres_hf.training.recipes import default_lora_targets

    names = default_lora_targets(model)
    per_rank = {n: 0 for n in names}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in per_rank:
            per_rank[path.rsplit(".", 1)[-1]] += module.in_features + module.out_features
    best = None
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            for rank in range(1, max_rank + 1):
                count = rank * sum(per_rank[n] for n in subset)
                key = (abs(count - target), size, rank)
                if best is None or key < best[0]:
                    best = (key, rank, list(subset), count)
    return best[1], best[2], best[3]


def prepare_arm(model, arm: str, lora: tuple[int, list[str]] | None = None):
    """Freeze everything but the arm's parameters; returns the model to train (a `PeftModel` for `lora`)."""
    if arm == "routers":
        return prepare_model(model, "routers")
    if arm == "norms":
        trainable = set(norm_parameter_names(model))
        for name, param in model.named_parameters():
            param.requires_grad_(name in trainable)
        return model
    if arm == "lora":
        from peft import LoraConfig, get_peft_model

        rank, targets = lora
        model.requires_grad_(False)  # the routers stay at uniform: no modules_to_save
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                target_modules=targets, task_type="CAUSAL_LM"))
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping `(n, seq_len)` blocks of a token sequence (the tail that does not fill one is dropped)."""
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, window: int) -> list[float]:
    """Mean NLL (nats per token) of each non-overlapping `window`-token window of `ids`: the paired unit."""
    model.eval()
    return [model(w[None], labels=w[None]).loss.item() for w in blocks(ids, window)]


def static_share(record) -> float | None:
    """Share of the routing's squared departure from uniform that one token-independent reweighting explains
    (1.0 = static; None at uniform routing)."""
    static = total = 0.0
    for r in range(len(record.routers)):
        w = record.weights[r]
        alpha = w[:, ~np.isnan(w[0])]
        if alpha.shape[1] < 2:
            continue
        uniform = 1.0 / alpha.shape[1]
        static += float(((alpha.mean(0) - uniform) ** 2).sum())
        total += float(((alpha - uniform) ** 2).sum(1).mean())
    return static / total if total > 1e-12 else None


def perplexity_rows(nll: dict[str, list[float]]) -> dict:
    """Held-out perplexity per arm from the per-window NLLs, with the paired differences (over windows) to the
    model without training and to the routers."""
    rows = {}
    for name, values in nll.items():
        row = {"perplexity": math.exp(float(np.mean(values))), "nll": float(np.mean(values)), "windows": len(values)}
        if name != "no training":
            row["paired_delta_nll_vs_no_training"] = paired_difference(values, nll["no training"])
            if name != "routers" and "routers" in nll:
                row["paired_delta_nll_vs_routers"] = paired_difference(values, nll["routers"])
        rows[name] = row
    return rows


def merge(folders: list[str | Path]) -> dict:
    """One result from runs of separate arms (`--arms routers` and `--arms norms` run side by side, each with its
    own `--out`): their settings and held-out windows must be the same (the model without training scores the same
    NLL on every window in each)."""
    parts = [json.loads((Path(f) / "retrofit_routing.json").read_text()) for f in folders]
    merged = parts[0]
    for part in parts[1:]:
        if part["settings"] != merged["settings"]:
            raise ValueError(f"different settings: {part['settings']} vs {merged['settings']}")
        if not np.allclose(part["held_out_nll_per_window"]["no training"],
                           merged["held_out_nll_per_window"]["no training"], rtol=0, atol=1e-5):
            raise ValueError("the runs scored different held-out windows (or another model)")
        merged["arms"] |= part["arms"]
        merged["held_out_nll_per_window"] |= {k: v for k, v in part["held_out_nll_per_window"].items()
                                              if k != "no training"}
        for key in ("routing", "probe"):
            if key in part:
                merged[key] = part[key]
    order = ["no training", *[a for a in ARMS if a in merged["held_out_nll_per_window"]]]
    nll = {k: merged["held_out_nll_per_window"][k] for k in order}
    merged["held_out_nll_per_window"] = nll
    merged["perplexity"] = perplexity_rows(nll)
    merged["arms"] = {a: merged["arms"][a] for a in order[1:]}
    merged["wall_seconds"] = max(p.get("wall_seconds", 0) for p in parts)
    merged["merged_from"] = [{"folder": str(f), "command": p.get("command"), "wall_seconds": p.get("wall_seconds")}
                             for f, p in zip(folders, parts)]
    merged.pop("command", None)  # the first part's
    return merged


def train_arm(model, arm, train_blocks, order, settings, probe, held_out_blocks, log) -> dict:
    """Train with AdamW (constant learning rate, no weight decay, clip 1.0) on `order`'s batches of
    `train_blocks`; every `eval_every` steps record the held-out loss and (routers) the depth entropy."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings["learning_rate"], weight_decay=0.0)
    curve = {"step": [], "train_loss": [], "held_out_loss": [], "depth_entropy_ratio": []}
    losses = []
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model

    def checkpoint(step):
        model.eval()
        with torch.no_grad():
            held = float(np.mean([model(b[None], labels=b[None]).loss.item() for b in held_out_blocks]))
        entropy = depth_entropy(inner, [{"input_ids": probe}]).get("depth_entropy_ratio")
        curve["step"].append(step)
        curve["train_loss"].append(float(np.mean(losses[-settings["eval_every"]:])) if losses else None)
        curve["held_out_loss"].append(held)
        curve["depth_entropy_ratio"].append(entropy)
        log(f"  {arm} step {step}: train {curve['train_loss'][-1] or float('nan'):.4f} held-out {held:.4f}"
            + (f" depth entropy/uniform {entropy:.4f}" if entropy is not None else ""))
        model.train()

    started = time.perf_counter()
    checkpoint(0)
    model.train()
    for step in range(1, settings["steps"] + 1):
        batch = train_blocks[order[(step - 1) * settings["batch_size"] : step * settings["batch_size"]]]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % settings["eval_every"] == 0 or step == settings["steps"]:
            checkpoint(step)
    model.eval()
    return {"trainable_parameters": sum(p.numel() for p in params), "curve": curve,
            "train_loss_per_step": losses, "seconds": round(time.perf_counter() - started, 1)}


def run(source, tokenizer, train_text: str, held_out_text: str, out: Path, steps: int = 100, batch_size: int = 4,
        seq_len: int = 32, learning_rate: float = 2e-4, eval_every: int = 25, eval_tokens: int = 2048,
        window: int = 256, arms=ARMS, pairs=None, seed: int = 0, log=print) -> dict:
    """The experiment (see the module docstring). `source`: an HF folder of a Llama-family model (or a model);
    `pairs`: the probe's `{"a", "b"}` texts (default: the shipped contradiction pairs)."""
    from attnres_hf.conversion import retrofit

    settings = {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "learning_rate": learning_rate,
                "eval_every": eval_every, "eval_tokens": eval_tokens, "window": window, "seed": seed,
                "optimizer": "AdamW(betas 0.9/0.999, weight decay 0), constant lr, grad clip 1.0, fp32"}
    out.mkdir(parents=True, exist_ok=True)
    train_ids = torch.tensor(tokenizer(train_text)["input_ids"])
    held_ids = torch.tensor(tokenizer(held_out_text)["input_ids"])[:eval_tokens]
    train_blocks = blocks(train_ids, seq_len)
    needed = steps * batch_size
    if len(train_blocks) < needed:
        raise ValueError(f"{len(train_blocks)} training blocks of {seq_len} tokens, {needed} needed "
                         f"({steps} steps x {batch_size}): give more text or fewer steps")
    order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(seed))[:needed]
    held_blocks = blocks(held_ids, seq_len)[:16]  # the curve's held-out batch
    probe = held_blocks[:4]
    pairs = load_pairs(EXAMPLE_PAIRS) if pairs is None else pairs
    results = {"settings": settings, "train_tokens": len(train_ids), "held_out_tokens": len(held_ids), "arms": {}}

    def fresh():
        return retrofit(source)  # exact: computes the source's logits; routers at uniform

    base = fresh()
    results["router_parameters"] = sum(p.numel() for n, p in base.named_parameters() if is_router_parameter(n))
    rank, targets, lora_count = matched_lora(base, results["router_parameters"])
    results["lora"] = {"rank": rank, "target_modules": targets, "parameters": lora_count}
    nll = {"no training": window_nll(base, held_ids, window)}
    del base
    trained_router_model = None
    for arm in arms:
        torch.manual_seed(seed)
        model = prepare_arm(fresh(), arm, (rank, targets))
        log(f"[{arm}] training {sum(p.numel() for p in model.parameters() if p.requires_grad):,} parameters")
        results["arms"][arm] = train_arm(model, arm, train_blocks, order, settings, probe, held_blocks, log)
        nll[arm] = window_nll(model, held_ids, window)
        results["held_out_nll_per_window"] = nll  # kept after each arm: a long run leaves what it measured
        (out / "retrofit_routing.json").write_text(json.dumps(results, indent=1) + "\n")
        if arm == "routers":
            trained_router_model = model
        else:
            del model
    results["perplexity"] = perplexity_rows(nll)

    if trained_router_model is not None:
        from attnres_hf.analysis.plots import plot_average_routing, plot_shift, plot_token_routing

        model = trained_router_model
        record = record_routing(model, held_ids[:256], tokenizer)
        summary = summarize(record)
        plot_average_routing(record, out / "routing_average.png", title=f"router-trained retrofit, {steps} steps")
        plot_token_routing(record, out / "routing_tokens.png", len(record.tokens) - 8, len(record.tokens),
                           title="router-trained retrofit, last 8 tokens")
        probe_result = compare_pairs(model, tokenizer, pairs, bootstrap=2000, seed=seed)
        plot_shift(probe_result["routers"], probe_result["sources"], probe_result["shift"], out / "probe_shift.png",
                   title="depth-weight shift after the contradicting word (b - a)")
        shift, low, high = probe_result["shift"], probe_result["low"], probe_result["high"]
        valid = ~np.isnan(shift)
        excludes_zero = valid & ((low > 0) | (high < 0))
        departure = []
        for weights in record.weights:
            alpha = weights[:, ~np.isnan(weights[0])]
            departure.append(float(np.abs(alpha.mean(0) - 1.0 / alpha.shape[1]).max()))
        results["routing"] = {
            "mean_entropy_ratio": summary["mean_entropy_ratio"],
            "static_share": static_share(record),
            "max_mean_departure_from_uniform": max(departure),
            "routers": summary["routers"],
        }
        results["probe"] = {
            "pairs_used": probe_result["pairs_used"],
            "max_abs_shift": probe_result["max_abs_shift"],
            "cells": int(valid.sum()),
            "cells_interval_excludes_zero": int(excludes_zero.sum()),
            "largest_shifts": largest_shifts(probe_result),
        }
    (out / "retrofit_routing.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def report(results: dict) -> str:
    """The printed report (Markdown; also what `--results` writes): settings, the perplexity table, the curves, and
    the router arm's routing and probe."""
    s = results["settings"]
    lines = [f"{s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens, lr {s['learning_rate']} (constant), "
             f"same batches in the same order for every arm; held-out: {results['held_out_tokens']} tokens in "
             f"windows of {s['window']}", "",
             "| arm | trainable params | held-out ppl | paired Δ NLL vs no training [95% CI] | "
             "paired Δ NLL vs routers [95% CI] |", "|---|---|---|---|---|"]
    for name, row in results["perplexity"].items():
        params = "0" if name == "no training" else f"{results['arms'][name]['trainable_parameters']:,}"
        cells = []
        for key in ("paired_delta_nll_vs_no_training", "paired_delta_nll_vs_routers"):
            value = row.get(key)
            cells.append("-" if value is None else format_paired(value, unit="window"))
        lines.append(f"| {name} | {params} | {row['perplexity']:.3f} | {cells[0]} | {cells[1]} |")
    curves = {name: arm["curve"] for name, arm in results["arms"].items()}
    if curves:
        steps = next(iter(curves.values()))["step"]
        held = min(16, results["held_out_tokens"] // s["seq_len"])
        lines += ["", "| step | " + " | ".join(map(str, steps)) + " |", "|---" * (len(steps) + 1) + "|"]
        for i, (name, c) in enumerate(curves.items()):
            label = f"held-out loss ({held} x {s['seq_len']} tokens), {name}" if i == 0 else f"held-out loss, {name}"
            lines.append(f"| {label} | " + " | ".join(f"{v:.4f}" for v in c["held_out_loss"]) + " |")
        for name, c in curves.items():
            if c["depth_entropy_ratio"][0] is not None:
                lines.append(f"| depth entropy / uniform, {name} | "
                             + " | ".join(f"{v:.4f}" for v in c["depth_entropy_ratio"]) + " |")
    if "routing" in results:
        r, p = results["routing"], results["probe"]
        lines += ["", "Routing of the router-trained model:", "",
                  f"- after training: mean entropy/uniform {r['mean_entropy_ratio']:.4f}, static share "
                  f"{'n/a (uniform routing)' if r['static_share'] is None else format(r['static_share'], '.3f')}, "
                  "largest departure of a mean weight from uniform "
                  f"{r['max_mean_departure_from_uniform']:.4f}",
                  f"- contradiction probe ({p['pairs_used']} pairs): max |shift| {p['max_abs_shift']:.4f}; "
                  f"{p['cells_interval_excludes_zero']}/{p['cells']} router-source cells with a 95% bootstrap "
                  "interval excluding 0; the largest shifts:"]
        top = sorted(p["largest_shifts"], key=lambda row: -abs(row["shift"]))[:3]
        lines += [f"    - {row['router']} <- {row['source']}: {row['shift']:+.4f} [{row['low']:+.4f}, "
                  f"{row['high']:+.4f}]" for row in top]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder of the source model (default: the demo's SmolLM2-135M copy)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens for the perplexity")
    parser.add_argument("--window", type=int, default=256, help="tokens per held-out perplexity window")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="outputs/retrofit_routing")
    parser.add_argument("--merge", nargs="+", metavar="OUT", help="print one report from runs of separate arms")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the report, with how it was measured, to PATH "
                        "(a Markdown fragment, e.g. docs/results/retrofit_routing.md; with --merge, of the merged "
                        "arms)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    if args.merge:
        results = merge(args.merge)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "retrofit_routing.json").write_text(json.dumps(results, indent=1) + "\n")
        text = report(results)
        print(text)
        if args.results:
            parts = "; ".join(f"`{part['command'] or part['folder']}`"
                              + (f" ({part['wall_seconds'] / 60:.1f} min)" if part["wall_seconds"] else "")
                              for part in results["merged_from"])
            measured.write(args.results, text, notes=f"It merges the runs of separate arms: {parts}; the machine, "
                      "versions and commit above are the merge's.")
        return
    arms = [a.strip() for a in args.arms.split(",")]
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"unknown arms {unknown}; choose from {ARMS}")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_tokens", "window", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.learning_rate > 0:
        parser.error("--learning-rate must be positive")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    from transformers import AutoTokenizer

    from attnres_hf.demo import smollm2_hf_folder

    source = Path(args.model) if args.model else smollm2_hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(source)
    started = time.perf_counter()
    results = run(source, tokenizer, assets.text_split("train", max_chars_per_book=40_000),
                  assets.text_split("held_out"), Path(args.out), steps=args.steps, batch_size=args.batch_size,
                  seq_len=args.seq_len, learning_rate=args.learning_rate, eval_every=args.eval_every,
                  eval_tokens=args.eval_tokens, window=args.window, arms=arms,
                  log=lambda line: print(line, flush=True))
    results["text"] = assets.text_source()
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    results["command"] = measured.command
    (Path(args.out) / "retrofit_routing.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    print()
    print(text)
    print(f"\nwall time {results['wall_seconds'] / 60:.1f} min; wrote {args.out}/")
    if args.results:
        measured.write(args.results, text)


if __name__ == "__main__":
    main()
