"""Why the input-dependent query (the paper's best Table 4 ablation) trains worst in `ablation.py`: a diagnosis.

Trains the `ablation.py` model (same preset, data, backbone and batches per seed) with Full AttnRes and with the
input-dependent query (`attnres_query="input_dependent"`: `q_l = w_l + W_l RMSNorm(v_last) / d`, `W_l` a
zero-initialised `d x d` matrix per router), with and without the `1/d` and under several learning-rate settings, and records per parameter group the gradient norm
and the size of each AdamW update, and per router the mean max depth weight (1/n: uniform, 1: one source) and the
largest logit spread. The arithmetic it checks: Adam moves every entry by about `lr` per step whatever its gradient,
so one step changes a logit `q . k` (keys of unit RMS) by up to `lr * d` through the `d` entries of `w_l` but by up to
`lr * d^2` through the `d^2` entries of `W_l`: without the `1/d` the projection is `d` times "hotter" than the query.

    python benchmarks/input_dependent_query.py --preset cpu --seeds 2 --output idq.json
    python benchmarks/input_dependent_query.py --preset cpu --seeds 2 --results docs/results/input_dependent_query.md
"""

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)

_spec = importlib.util.spec_from_file_location("ablation", Path(__file__).with_name("ablation.py"))
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)

FULL = ablation.VARIANTS["Full AttnRes"].overrides
IDQ = ablation.VARIANTS["AttnRes input-dependent query"].overrides


def settings(hidden_size: int) -> dict:
    """name -> (config overrides, learning-rate multiplier of the projections `W_l`, global lr multiplier).

    The model computes `W_l RMSNorm(v_last) / d`. Under Adam (zero init, no weight decay) a forward multiplier `c` on
    a parameter is the same as multiplying its learning rate by `c`, so `W_l lr x d` reproduces the projection
    without the `1/d` (the parameterisation before the fix), and `x sqrt(d)` a `1/sqrt(d)` multiplier."""
    return {
        "Full AttnRes": (FULL, 1.0, 1.0),
        "input-dependent (W_l / d)": (IDQ, 1.0, 1.0),
        "input-dependent (W_l / sqrt(d))": (IDQ, math.sqrt(hidden_size), 1.0),
        "input-dependent (no 1/d, as before)": (IDQ, float(hidden_size), 1.0),
        "input-dependent (no 1/d, global lr / 3)": (IDQ, float(hidden_size), 1.0 / 3),
    }


def group_of(name: str) -> str:
    if name.endswith("query_proj"):
        return "W_l (query_proj)"
    if name.endswith(".query"):
        return "w_l (query)"
    if "_res." in name:
        return "key norms"
    return "backbone"


def train(preset, overrides, proj_scale, lr_scale, seed, train_data, val_data, log_every):
    model = ablation.build_model(preset, overrides, seed).train()
    groups = {}
    for name, param in model.named_parameters():
        groups.setdefault(group_of(name), []).append((name, param))
    lr = preset.learning_rate * lr_scale
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in members], "lr": lr * (proj_scale if g.startswith("W_l") else 1.0), "name": g}
         for g, members in groups.items()], betas=(0.9, 0.95), weight_decay=0.0)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    warmup = max(1, preset.steps // 20)
    trace = []
    for step, batch in enumerate(ablation.batches(train_data, preset, preset.steps, seed=seed)):
        factor = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / preset.steps))))
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base * factor
        out = model(batch, labels=batch, output_depth_weights=step % log_every == 0)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step % log_every == 0:
            before = {g: [p.detach().clone() for _, p in members] for g, members in groups.items()}
        optimizer.step()
        if step % log_every == 0:
            entry = {"step": step, "loss": out.loss.item()}
            for g, members in groups.items():
                entry[f"grad {g}"] = math.sqrt(sum(float(p.grad.pow(2).sum()) for _, p in members if p.grad is not None))
                entry[f"update {g}"] = math.sqrt(sum(float((p.detach() - b).pow(2).sum())
                                                     for (_, p), b in zip(members, before[g])))
            weights = [w.float() for w in out.depth_weights if w.shape[-1] > 1]
            entry["max depth weight"] = statistics.mean(float(w.detach().max(-1).values.mean()) for w in weights)
            entry["uniform weight"] = statistics.mean(1 / w.shape[-1] for w in weights)
            trace.append(entry)
    val = ablation.evaluate(model, val_data, preset, torch.device("cpu"))
    return {"val_loss": val, "trace": trace}


def report(results: dict) -> str:
    """The printed table (Markdown; also what `--results` writes): per setting the validation loss (mean, and per
    seed), the paired difference to Full AttnRes, and the routing's mean max depth weight at the last logged step."""
    base = [r["val_loss"] for r in results.get("Full AttnRes", [])]
    rows = ["| setting | val loss (nats/byte), mean | per seed | paired Δ vs Full AttnRes [95% CI] | mean max depth "
            "weight at the last logged step, per seed |", "|---|---|---|---|---|"]
    for name, runs in results.items():
        losses = [r["val_loss"] for r in runs]
        delta = "-"
        if base and name != "Full AttnRes" and len(base) == len(losses):
            delta = ablation.format_paired(ablation.paired_difference(losses, base))
        last = [r["trace"][-1] for r in runs]
        weights = ", ".join(f"{t['max depth weight']:.2f}" for t in last)
        rows.append(f"| {name} | {statistics.mean(losses):.4f} (n={len(losses)}) | "
                    f"{', '.join(f'{x:.4f}' for x in losses)} | {delta} | {weights} (step {last[0]['step']}, "
                    f"uniform {last[0]['uniform weight']:.2f}) |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=ablation.PRESETS, default="smoke")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--settings", help="comma-separated subset")
    parser.add_argument("--log-every", type=int, default=40)
    parser.add_argument("--output")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the table, with how it was measured, to PATH "
                        "(a Markdown fragment, e.g. docs/results/input_dependent_query.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    preset = ablation.PRESETS[args.preset]
    if args.steps:
        preset = ablation.Preset(**(ablation.asdict(preset) | {"steps": args.steps}))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    table = settings(preset.hidden_size)
    names = list(table) if not args.settings else [s.strip() for s in args.settings.split(",")]
    train_data = ablation.load_bytes("train", preset.max_chars_per_book)
    val_data = ablation.load_bytes("held_out", preset.max_chars_per_book)
    results = {}
    for name in names:
        overrides, proj_scale, lr_scale = table[name]
        runs = []
        for seed in range(args.seeds):
            start = time.perf_counter()
            runs.append(train(preset, overrides, proj_scale, lr_scale, seed, train_data, val_data, args.log_every))
            last = runs[-1]["trace"][-1]
            print(f"{name} seed {seed}: val {runs[-1]['val_loss']:.4f} ({time.perf_counter() - start:.0f} s); "
                  f"step {last['step']}: max depth weight {last['max depth weight']:.3f} "
                  f"(uniform {last['uniform weight']:.3f}); "
                  + ", ".join(f"{k} {v:.3g}" for k, v in last.items() if k.startswith(("grad", "update"))),
                  flush=True)
        results[name] = runs
    text = (f"preset {args.preset} ({preset.num_hidden_layers} layers x {preset.hidden_size}, {preset.steps} steps of "
            f"{preset.batch_size} x {preset.seq_len} bytes, lr {preset.learning_rate}), {args.seeds} seed"
            f"{'s' if args.seeds > 1 else ''}; for a seed every setting starts from the same backbone and sees the "
            f"same batches; routing logged every {args.log_every} steps (1/n: uniform, 1: one source)\n\n"
            f"{report(results)}")
    print(f"\n{text}")
    if args.results:
        measured.write(args.results, text)
    if args.output:
        Path(args.output).write_text(json.dumps({"preset": ablation.asdict(preset), "results": results}, indent=1))


if __name__ == "__main__":
    main()
