"""Which retrofit helps? Five fine-tuning recipes of the real SmolLM2-135M, on the same batches and budget.

From the same source checkpoint, each arm trains with the same batches in the same order, the same steps, warm-up and
optimizer, and the same learning-rate search (`LR_SCALES`, or `--lr-scales`, times the arm's base rates, chosen on a
validation split):

- `full`: full fine-tuning of the source model (the residual model, `depth_mixing="residual"`: the source exactly);
- `attnres+full`: the Block AttnRes retrofit, every parameter trained, the routers at their own learning rate
  (Delta AttnRes's recipe: routers 5e-3, the rest 5e-5, arXiv:2605.18855);
- `delta+full`: the Delta AttnRes retrofit (`depth_mixing="delta_attnres"`, same blocks), the same;
- `routers`: the Block AttnRes retrofit, its routers alone (as `benchmarks/retrofit_routing.py`);
- `norms`: the Block AttnRes retrofit, the backbone's RMSNorm weights alone (the routers stay uniform: a residual
  model; the control of `retrofit_routing.py`).

Every retrofit starts as the source model exactly, so the arms differ only in what trains and how. Reported per arm:
held-out NLL and perplexity (windows of held-out text never trained on nor used for the search), the paired difference
to `full` over (seed, window) pairs with its 95% t-interval, the per-seed means, and MMLU / ARC-Challenge / HellaSwag
accuracy through lm-eval on the offline subsets (the first `--eval-questions` of each, every seed's model).

    python benchmarks/retrofit_recipes.py --out outputs/retrofit_recipes --results docs/results/retrofit_recipes.md

The defaults are the recorded run's budget (`DEFAULTS`); tests/test_benchmarks.py runs it end to end on a tiny Llama.
Writes `retrofit_recipes.json` to `--out` after each arm (a long run keeps what it measured); `--results PATH` the
report with how it was measured (`benchmarks/_results.py`).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import Run, results_path  # noqa: E402
from ablation import format_paired, paired_difference  # noqa: E402  (one home for the paired statistics)
from retrofit_routing import blocks, prepare_arm, window_nll  # noqa: E402  (the routers / norms arms, NLL windows)

from attnres_hf.modeling.depth_mixing import is_depth_mixing_parameter  # noqa: E402

ARMS = {  # arm -> (retrofit overrides, what trains)
    "full": ({"depth_mixing": "residual"}, "all"),
    "attnres+full": ({}, "all"),
    "delta+full": ({"depth_mixing": "delta_attnres"}, "all"),
    "routers": ({}, "routers"),
    "norms": ({}, "norms"),
}
BASE_LR = {"backbone": 5e-5, "mixing": 5e-3}
"""Base peak learning rates (Delta AttnRes's fine-tuning recipe): the backbone's, and the depth-mixing parameters' and
the single-group arms' (`routers`, `norms`: few parameters, as the routers)."""
LR_SCALES = (0.4, 1.0)
"""The learning-rate search: each arm runs its base rates times each scale on seed 0; the lowest validation NLL wins."""
DEFAULTS = dict(steps=60, batch_size=4, seq_len=128, warmup=6, seeds=2, eval_tokens=4096, validation_tokens=2048,
                window=256, eval_questions=40)
BENCHMARK_NAMES = ("mmlu", "arc_challenge", "hellaswag")


def param_groups(model, trains: str, scale: float) -> list[dict]:
    """AdamW groups: the arm's trainable parameters at `scale` times their base rate (`BASE_LR`)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if trains != "all":
        return [{"params": [p for _, p in trainable], "lr": BASE_LR["mixing"] * scale}]
    groups = [{"params": [p for n, p in trainable if not is_depth_mixing_parameter(n)],
               "lr": BASE_LR["backbone"] * scale},
              {"params": [p for n, p in trainable if is_depth_mixing_parameter(n)], "lr": BASE_LR["mixing"] * scale}]
    return [g for g in groups if g["params"]]


def build(source, arm: str):
    """The arm's model, retrofitted from `source`, with only its parameters trainable."""
    from attnres_hf.conversion import retrofit

    overrides, trains = ARMS[arm]
    model = retrofit(source, **overrides)
    if trains == "all":
        model.requires_grad_(True)
        return model
    return prepare_arm(model, trains)


def train(model, groups, train_blocks, order, settings, log, label) -> dict:
    """AdamW (betas 0.9/0.999, no weight decay), linear warm-up over `warmup` steps then constant, clip 1.0, fp32."""
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    peaks = [g["lr"] for g in optimizer.param_groups]
    params = [p for g in groups for p in g["params"]]
    losses, started = [], time.perf_counter()
    model.train()
    for step in range(1, settings["steps"] + 1):
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * min(1.0, step / max(settings["warmup"], 1))
        batch = train_blocks[order[(step - 1) * settings["batch_size"]: step * settings["batch_size"]]]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % max(settings["steps"] // 4, 1) == 0:
            log(f"  {label} step {step}: train loss {np.mean(losses[-5:]):.4f}")
    model.eval()
    return {"train_loss_per_step": losses, "seconds": round(time.perf_counter() - started, 1)}


def benchmark_accuracy(model, tokenizer, limit: int) -> dict:
    """lm-eval accuracy (each benchmark's metric, `BENCHMARKS[name].metric`) on the first `limit` questions."""
    from attnres_hf.eval.benchmarks import BENCHMARKS
    from attnres_hf.eval.harness import metric_value, run_lm_eval

    chosen = [BENCHMARKS[name] for name in BENCHMARK_NAMES]
    results = run_lm_eval(model, chosen, tokenizer=tokenizer, limit=limit, batch_size=4)
    return {b.name: metric_value(results, b) for b in chosen}


def run(source, tokenizer, train_text: str, held_out_text: str, out: Path, arms=tuple(ARMS), log=print,
        lr_scales=LR_SCALES, **overrides) -> dict:
    """The experiment (module docstring); `overrides`: `DEFAULTS` fields; `lr_scales`: the search's scales of
    `BASE_LR`. `source`: an HF folder (or a model)."""
    settings = DEFAULTS | overrides
    settings |= {"lr_scales": list(lr_scales), "base_lr": BASE_LR,
                 "optimizer": "AdamW(0.9/0.999, weight decay 0), linear warm-up then constant, clip 1.0, fp32"}
    out.mkdir(parents=True, exist_ok=True)
    train_ids = torch.tensor(tokenizer(train_text)["input_ids"])
    held = torch.tensor(tokenizer(held_out_text)["input_ids"])
    validation = held[: settings["validation_tokens"]]  # the search's; the test windows come after it
    test = held[settings["validation_tokens"]: settings["validation_tokens"] + settings["eval_tokens"]]
    train_blocks = blocks(train_ids, settings["seq_len"])
    needed = settings["steps"] * settings["batch_size"]
    if len(train_blocks) < needed or len(test) < settings["window"] or len(validation) < settings["window"]:
        raise ValueError(f"not enough text: {len(train_blocks)} training blocks ({needed} needed), "
                         f"{len(validation)} validation and {len(test)} test tokens ({settings['window']} each)")
    orders = [torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(seed))[:needed]
              for seed in range(settings["seeds"])]
    results = {"settings": settings, "train_tokens": len(train_ids), "test_tokens": len(test), "arms": {}}
    source_model = build(source, "full")
    results["no_training"] = {"nll_per_window": window_nll(source_model, test, settings["window"])}
    if settings["eval_questions"]:
        results["no_training"]["accuracy"] = benchmark_accuracy(source_model, tokenizer, settings["eval_questions"])
    del source_model
    for arm in arms:
        trains = ARMS[arm][1]
        search, models = {}, {}
        for scale in settings["lr_scales"]:  # seed 0, every scale
            torch.manual_seed(0)
            model = build(source, arm)
            report = train(model, param_groups(model, trains, scale), train_blocks, orders[0], settings, log,
                           f"{arm} lr x{scale} seed 0")
            search[scale] = {"validation_nll": float(np.mean(window_nll(model, validation, settings["window"]))),
                             **report}
            models[scale] = model
            best = min(search, key=lambda s: search[s]["validation_nll"])
            models = {best: models[best]}  # keep the best so far only
        seed_runs = [{"seed": 0, "nll_per_window": window_nll(models[best], test, settings["window"]),
                      "seconds": search[best]["seconds"], "model": models.pop(best)}]
        for seed in range(1, settings["seeds"]):
            torch.manual_seed(seed)
            model = build(source, arm)
            report = train(model, param_groups(model, trains, best), train_blocks, orders[seed], settings, log,
                           f"{arm} lr x{best} seed {seed}")
            seed_runs.append({"seed": seed, "nll_per_window": window_nll(model, test, settings["window"]),
                              "seconds": report["seconds"], "model": model})
        for run_ in seed_runs:
            model = run_.pop("model")
            if settings["eval_questions"]:
                run_["accuracy"] = benchmark_accuracy(model, tokenizer, settings["eval_questions"])
            run_["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            del model
        results["arms"][arm] = {"lr_scale": best, "search": {str(s): {k: v for k, v in r.items()
                                                                     if k != "train_loss_per_step"} | {
            "final_train_loss": float(np.mean(r["train_loss_per_step"][-5:]))} for s, r in search.items()},
            "runs": seed_runs}
        log(f"[{arm}] lr x{best}: test NLL {np.mean([np.mean(r['nll_per_window']) for r in seed_runs]):.4f}")
        (out / "retrofit_recipes.json").write_text(json.dumps(summarise(results), indent=1) + "\n")
    return summarise(results)


def summarise(results: dict) -> dict:
    """Add each arm's mean NLL, perplexity, per-seed means and paired difference to `full` (over (seed, window)
    pairs, from `ablation.paired_difference`), and the mean accuracy over seeds."""
    base = results["arms"].get("full")
    for arm, row in results["arms"].items():
        nll = [v for r in row["runs"] for v in r["nll_per_window"]]
        row["nll"] = float(np.mean(nll))
        row["perplexity"] = math.exp(row["nll"])
        row["nll_per_seed"] = [float(np.mean(r["nll_per_window"])) for r in row["runs"]]
        if base is not None and arm != "full":
            reference = [v for r in base["runs"] for v in r["nll_per_window"]]
            row["paired_delta_nll_vs_full"] = paired_difference(nll, reference)
        if all("accuracy" in r for r in row["runs"]):
            row["accuracy"] = {name: float(np.mean([r["accuracy"][name] for r in row["runs"]]))
                               for name in row["runs"][0]["accuracy"]}
    return results


def report(results: dict) -> str:
    """The printed report (Markdown; also what `--results` writes)."""
    s = results["settings"]
    tokens = s["steps"] * s["batch_size"] * s["seq_len"]
    lines = [f"{s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens ({tokens:,} training tokens per run; "
             f"warm-up {s['warmup']} steps), {s['seeds']} seeds with their own batch orders, the same for every arm; "
             f"learning-rate search x{' / x'.join(map(str, s['lr_scales']))} of the base rates (backbone "
             f"{s['base_lr']['backbone']:g}, depth mixing and single-group arms {s['base_lr']['mixing']:g}) on "
             f"seed 0, chosen on {s['validation_tokens']:,} validation tokens; test: {results['test_tokens']:,} "
             f"held-out tokens in windows of {s['window']}; lm-eval on the first {s['eval_questions']} questions of "
             "each benchmark (accuracy, mean over seeds)", ""]
    names = list(BENCHMARK_NAMES) if s["eval_questions"] else []
    lines += ["| arm | trainable params | lr scale | test ppl | NLL per seed | paired Δ NLL vs full [95% CI] | "
              + " | ".join(names) + (" |" if names else ""),
              "|---|---|---|---|---|---|" + "---|" * len(names)]
    untrained = results["no_training"]
    accuracy = untrained.get("accuracy", {})
    lines.append(f"| no training | 0 | - | {math.exp(np.mean(untrained['nll_per_window'])):.3f} | - | - | "
                 + " | ".join(f"{100 * accuracy[n]:.1f}" for n in names) + (" |" if names else ""))
    for arm, row in results["arms"].items():
        delta = row.get("paired_delta_nll_vs_full")
        acc = row.get("accuracy", {})
        lines.append(f"| {arm} | {row['runs'][0]['trainable_parameters']:,} | x{row['lr_scale']} | "
                     f"{row['perplexity']:.3f} | {' / '.join(f'{v:.4f}' for v in row['nll_per_seed'])} | "
                     f"{'-' if delta is None else format_paired(delta, unit='window')} | "
                     + " | ".join(f"{100 * acc[n]:.1f}" if n in acc else "-" for n in names) + (" |" if names else ""))
    lines += ["", "Learning-rate search (seed 0, validation NLL):", ""]
    for arm, row in results["arms"].items():
        lines.append(f"- {arm}: " + ", ".join(f"x{scale} {r['validation_nll']:.4f}" for scale, r in row["search"].items()))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder of the source model (default: the demo's SmolLM2-135M copy)")
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {tuple(ARMS)}")
    parser.add_argument("--lr-scales", default=",".join(map(str, LR_SCALES)),
                        help="comma-separated scales of the base rates the search tries on seed 0 (default: "
                             f"{','.join(map(str, LR_SCALES))})")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="outputs/retrofit_recipes")
    parser.add_argument("--results", metavar="PATH", type=results_path,
                        help="also write the report, with how it was measured, to PATH (a Markdown fragment)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    arms = [a.strip() for a in args.arms.split(",")]
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"unknown arms {unknown}; choose from {tuple(ARMS)}")
    try:
        lr_scales = [float(v) for v in args.lr_scales.split(",")]
    except ValueError:
        parser.error(f"--lr-scales must be comma-separated numbers, got {args.lr_scales!r}")
    if not all(math.isfinite(v) and v > 0 for v in lr_scales) or len(set(lr_scales)) != len(lr_scales):
        parser.error(f"--lr-scales must be distinct positive numbers, got {args.lr_scales!r}")
    for name in (*DEFAULTS, "threads"):
        if getattr(args, name) < (0 if name == "eval_questions" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'eval_questions' else 1}")
    torch.set_num_threads(args.threads)
    settings = {name: getattr(args, name) for name in DEFAULTS}
    started = time.perf_counter()
    from transformers import AutoTokenizer

    from attnres_hf import assets
    from attnres_hf.demo import smollm2_hf_folder

    source = Path(args.model) if args.model else smollm2_hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(source)
    if settings["eval_questions"]:  # the benchmarks' local data (kept where prepared), before an hour of training
        from attnres_hf.eval.data import prepare_offline

        prepare_offline(benchmarks=BENCHMARK_NAMES)
    train_text = assets.text_split("train", max_chars_per_book=40_000)
    held_out_text, described = assets.text_split("held_out"), assets.text_source()
    results = run(source, tokenizer, train_text, held_out_text, Path(args.out), arms=arms, lr_scales=lr_scales,
                  log=lambda line: print(line, flush=True), **settings)
    results["text"] = described
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    results["command"] = measured.command
    (Path(args.out) / "retrofit_recipes.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    print(text)
    if args.results:
        measured.write(args.results, text, notes=f"Text: {described}. Wall time {results['wall_seconds'] / 60:.1f} min.")
    return results


if __name__ == "__main__":
    main()
