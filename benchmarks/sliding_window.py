"""Why the sliding-window ablation trains behind the baseline in `ablation.py`'s long preset: a diagnosis.

The paper's Table 4 window ("the 8 most recent layers plus the embedding", 32 sub-layers) lands level with the
baseline; ours (W=2 and W=4 of the long preset's 16 sub-layers) trailed it by +0.32 and +0.50 nats. This trains the
`ablation.py` model (same preset, data, backbone and batches per seed, same optimiser and schedule) as the baseline,
Full AttnRes (a window as wide as the depth) and windows of several widths, each window also with its final router
reading every source (an alternative reading: the window applied to the sub-layers' routers only), and records the
training loss over the run and where the trained routers put their weight (the embedding's share; 1/n is uniform).

    python benchmarks/sliding_window.py --preset long --seeds 2 --results docs/results/sliding_window.md
    python benchmarks/sliding_window.py --preset smoke --arms baseline,W=2   # seconds: the pipeline end to end
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)

import ablation  # noqa: E402  (a module by name: its Preset is pickled to the worker processes)

BASELINE = ablation.VARIANTS["baseline"].overrides
FULL = ablation.VARIANTS["Full AttnRes"].overrides


def arms() -> dict:
    """name -> (config overrides, whether the final router reads every source, learning-rate multiplier)."""
    table = {"baseline": (BASELINE, False, 1.0), "Full AttnRes": (FULL, False, 1.0)}
    for window in (2, 4, 8):
        table[f"W={window}"] = (FULL | {"attnres_window": window}, False, 1.0)
        table[f"W={window} + final router reads all"] = (FULL | {"attnres_window": window}, True, 1.0)
    table["baseline at lr / 2"] = (BASELINE, False, 0.5)
    table["W=2 at lr / 2"] = (FULL | {"attnres_window": 2}, False, 0.5)
    return table


def build(preset, overrides, final_reads_all, seed):
    """`ablation.build_model`; `final_reads_all`: the final router's window lifted (its `window` attribute, which
    its forward reads: it then routes over the embedding and every sub-layer output, as Full AttnRes's does)."""
    model = ablation.build_model(preset, overrides, seed)
    if final_reads_all:
        model.model.final_res.window = None
    return model


@torch.no_grad()
def routing(model, batch) -> dict:
    """Where the routers put their weight on `batch` (token-averaged): the embedding's share in the final router and
    on average over the sub-layer routers, and the final router's weight on each source it reads."""
    if model.config.depth_mixing != "attnres":
        return {}
    model.eval()
    weights = [w.float().mean(dim=(0, 1)) for w in model(batch, output_depth_weights=True).depth_weights]
    model.train()
    return {"final embedding": float(weights[-1][0]), "final weights": [round(float(x), 3) for x in weights[-1]],
            "sublayer embedding": statistics.mean(float(w[0]) for w in weights[1:-1]),
            "sublayer uniform": statistics.mean(1 / len(w) for w in weights[1:-1])}


def train(preset, name, seed, train_data, val_data, log_every):
    """`ablation.train_one`'s loop (AdamW, warm-up + cosine, clipping at 1), with the training loss averaged over
    every `log_every` steps and the trained routing."""
    overrides, final_reads_all, lr_scale = arms()[name]
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    start = time.perf_counter()
    model = build(preset, overrides, final_reads_all, seed).train()
    scaled = ablation.Preset(**(ablation.asdict(preset) | {"learning_rate": preset.learning_rate * lr_scale}))
    optimizer, schedule = ablation.optimizer_and_schedule(model, scaled)
    curve, window = [], []
    for step, batch in enumerate(ablation.batches(train_data, preset, preset.steps, seed=seed), start=1):
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        window.append(loss.item())
        if step % log_every == 0 or step == preset.steps:
            curve.append((step, statistics.mean(window)))
            window = []
    val = ablation.evaluate(model, val_data, preset, torch.device("cpu"))
    probe = next(ablation.batches(val_data, preset, 1, seed=12345))
    return name, seed, {"val_loss": val, "curve": curve, "routing": routing(model, probe),
                        "seconds": time.perf_counter() - start}


def report(results: dict, seeds: int) -> str:
    """The printed table (Markdown; what `--results` writes)."""
    base = [r["val_loss"] for r in results.get("baseline", [])]
    full = [r["val_loss"] for r in results.get("Full AttnRes", [])]
    first = next(iter(results.values()))[0]["curve"]
    steps = [s for s, _ in first]
    picks = sorted({steps[0], steps[len(steps) // 2], steps[-1]})
    rows = ["| arm | val loss, mean | per seed | paired Δ vs baseline | paired Δ vs Full AttnRes | training loss at "
            f"step {', '.join(map(str, picks))} (mean of the logged interval, seed mean) | embedding's weight: final "
            "router; sub-layer routers (uniform) |", "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        losses = [r["val_loss"] for r in runs]
        vs_base, vs_full = (ablation.format_paired(ablation.paired_difference(losses, ref))
                            if ref and name != ref_name else "-" for ref, ref_name in ((base, "baseline"),
                                                                                      (full, "Full AttnRes")))
        by_step = [statistics.mean(dict(r["curve"])[s] for r in runs) for s in picks]
        route = [r["routing"] for r in runs]
        if route[0]:
            mixing = (f"{statistics.mean(x['final embedding'] for x in route):.3f} of "
                      f"{len(route[0]['final weights'])}; {statistics.mean(x['sublayer embedding'] for x in route):.3f}"
                      f" ({route[0]['sublayer uniform']:.3f})")
        else:
            mixing = "- (no routers)"
        rows.append(f"| {name} | {statistics.mean(losses):.4f} (n={len(losses)}) | "
                    f"{', '.join(f'{x:.4f}' for x in losses)} | {vs_base} | {vs_full} | "
                    f"{', '.join(f'{x:.3f}' for x in by_step)} | {mixing} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=ablation.PRESETS, default="smoke")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, help="override the preset's number of training steps")
    parser.add_argument("--arms", help=f"comma-separated subset of: {', '.join(arms())}")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one single-threaded process each")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--output", help="write every run's numbers (curves, routing) as JSON here")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the table, with how it was "
                        "measured, to PATH (a Markdown fragment, e.g. docs/results/sliding_window.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    names = list(arms()) if not args.arms else [a.strip() for a in args.arms.split(",")]
    unknown = sorted(set(names) - set(arms()))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {list(arms())}")
    for flag in ("seeds", "jobs", "log_every", "steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    preset = ablation.PRESETS[args.preset]
    if args.steps:
        preset = ablation.Preset(**(ablation.asdict(preset) | {"steps": args.steps}))
    train_data = ablation.load_data("train", preset)
    val_data = ablation.load_data("held_out", preset)
    if preset.tokenizer == "bpe":
        preset = ablation.Preset(**(ablation.asdict(preset) | {"vocab_size": ablation.train_bpe(
            preset.vocab_size, preset.max_chars_per_book).get_vocab_size()}))
    runs = [(name, seed) for name in names for seed in range(args.seeds)]
    results = {name: [None] * args.seeds for name in names}
    with ExitStack() as stack:
        if args.jobs > 1:  # one single-threaded process per run; 1: every run in this process
            pool = stack.enter_context(ProcessPoolExecutor(min(args.jobs, len(runs)),
                                                           mp_context=multiprocessing.get_context("spawn")))
            done = (f.result() for f in [pool.submit(train, preset, name, seed, train_data, val_data,
                                                     args.log_every) for name, seed in runs])
        else:
            done = (train(preset, name, seed, train_data, val_data, args.log_every) for name, seed in runs)
        for name, seed, result in done:
            results[name][seed] = result
            print(f"{name} seed {seed}: val {result['val_loss']:.4f}, training loss "
                  f"{' '.join(f'{s}:{x:.3f}' for s, x in result['curve'])}, routing {result['routing']} "
                  f"({result['seconds']:.0f} s)", flush=True)
    unit = ablation.TOKENIZERS[preset.tokenizer]
    text = (f"preset {args.preset} ({preset.num_hidden_layers} layers x {preset.hidden_size} = "
            f"{2 * preset.num_hidden_layers} sub-layers, {preset.steps} steps of {preset.batch_size} x "
            f"{preset.seq_len} tokens, lr {preset.learning_rate}, loss in nats/{unit}), {args.seeds} seed"
            f"{'s' if args.seeds > 1 else ''}; for a seed every arm starts from the same backbone and sees the same "
            f"batches; W=w: the embedding and the w most recent sub-layer outputs (Full AttnRes: w = "
            f"{2 * preset.num_hidden_layers}); routing token-averaged on one held-out batch after training\n\n"
            f"{report(results, args.seeds)}")
    print(f"\n{text}")
    if args.results:
        measured.write(args.results, text)
    if args.output:
        Path(args.output).write_text(json.dumps({"preset": ablation.asdict(preset), "results": results}, indent=1))


if __name__ == "__main__":
    main()
