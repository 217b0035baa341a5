"""A small Block AttnRes model trained from scratch, and the routing it learns, beside a baseline of the same shape.

The paper's ablation setup (Kimi Team, arXiv:2603.15031, Table 4: 16 attention + 16 MLP layers, Block AttnRes with
blocks of 4 sub-layers) scaled down to 2 CPU cores: 16 decoder layers (32 sub-layers) at hidden size 128, Block
AttnRes with `attnres_block_size=4` (8 blocks + the embedding = 9 sources, 33 routers), and a residual baseline of
the same shape. Both start from the same backbone weights and see the same batches in the same order
(`ablation.build_model`, `ablation.batches`, `ablation.optimizer_and_schedule`: AdamW, warm-up then cosine). The
text is the books of `attnres_hf.assets` with the ablation's byte-level BPE tokenizer of 4,096 ids trained on the
training split only (`ablation.train_bpe`): real subword tokens, so the shipped contradiction pairs read as words
(bytes would spread a word over several positions), and an output layer small enough for a CPU (SmolLM2's 49,152
ids would cost about 3x the rest of this model). It is saved with the model as a transformers tokenizer.

Along the way (every `eval_every` steps): held-out loss of both models, and per router the entropy of the depth
weights over `log(n_sources)` (1.0 = uniform, where every router starts) on a few held-out sequences. After
training, on held-out windows of `seq_len` tokens:

- the held-out loss of both models, paired over windows (`ablation.paired_difference`: 95% t-interval);
- per router the entropy ratio with a 95% bootstrap interval over held-out windows (tokens of one window are not
  independent, so windows are resampled); a router is *measurably non-uniform* when the interval's upper end is
  below `NON_UNIFORM` (it has lost at least 5% of the uniform entropy, beyond resampling noise);
- depth-wise attention sinks: `analysis.summarize`'s criterion over every held-out token (mean weight at least twice
  uniform, coefficient of variation over tokens below 0.25), with each router's embedding, most recent and
  long-jump mass (the paper's Figure 8: mostly local, the embedding keeps weight, sinks);
- the contradiction probe (`analysis.compare_pairs` on the shipped pairs, or `--pairs`): per router the shift
  (b minus a) of the weights after the contradicting word, alpha and alpha * ||v||, 95% paired bootstrap over pairs.

    python benchmarks/trained_routing.py --smoke                      # seconds: a tiny shape, a few steps
    python benchmarks/trained_routing.py --out outputs/trained_routing --results docs/results/trained_routing.md

The models and the tokenizer are saved under `--out` (`model/`: Block AttnRes, `baseline/`), never committed;
`attnres routing OUT/model --text ...` reads the trained routing. Writes `trained_routing.json` there too.
"""

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import ablation  # noqa: E402  (the from-scratch training pieces, one home)
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)
from retrofit_routing import blocks, window_nll  # noqa: E402  (held-out windows and their NLL)

from attnres_hf import assets  # noqa: E402
from attnres_hf.analysis import RoutingRecord, compare_pairs, largest_shifts, load_pairs, record_routing  # noqa: E402
from attnres_hf.analysis import summarize  # noqa: E402
from attnres_hf.analysis.compare import EXAMPLE_PAIRS  # noqa: E402

NON_UNIFORM = 0.95
"""A router is measurably non-uniform when the upper end of its entropy ratio's 95% interval is below this."""


@dataclass(frozen=True)
class Settings:
    preset: ablation.Preset  # shape, batches, steps, learning rate, tokenizer (`ablation.Preset`)
    block_size: int  # sub-layers per block of Block AttnRes (`attnres_block_size`)
    eval_every: int  # steps between points of the training curve
    eval_tokens: int  # held-out tokens of the final evaluation (windows of `seq_len`)
    curve_sequences: int  # held-out windows the curve's entropies are read on
    bootstrap: int  # resamples of every bootstrap interval
    seed: int = 0


REAL = Settings(ablation.Preset(hidden_size=128, num_hidden_layers=16, num_attention_heads=4, seq_len=128,
                                batch_size=16, steps=1200, seeds=1, learning_rate=2e-3, eval_batches=4,
                                max_chars_per_book=None, jobs=2, tokenizer="bpe", vocab_size=4096),
                block_size=4, eval_every=150, eval_tokens=32768, curve_sequences=8, bootstrap=2000)
SMOKE = Settings(ablation.Preset(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, seq_len=32, batch_size=4,
                                 steps=6, seeds=1, learning_rate=3e-3, eval_batches=2, max_chars_per_book=20_000,
                                 jobs=1, tokenizer="bpe", vocab_size=300),
                 block_size=2, eval_every=3, eval_tokens=256, curve_sequences=2, bootstrap=200)
ARMS = {"baseline": {"depth_mixing": "residual"}, "Block AttnRes": {"depth_mixing": "attnres"}}


def overrides(settings: Settings, arm: str) -> dict:
    extra = {"attnres_block_size": settings.block_size} if arm == "Block AttnRes" else {}
    return ARMS[arm] | extra


def hf_tokenizer(bpe):
    """The `tokenizers` BPE as a transformers tokenizer (what `analysis` reads and `save_pretrained` writes); no
    special tokens are added to a text (the training stream has none but the paragraph separator, id 0)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def entropy_ratios(records: list[RoutingRecord]) -> np.ndarray:
    """`(len(records), n_routers)`: per record (one sequence) the token-mean entropy of each router's depth weights
    over `log(n_sources)` (`summarize`; NaN for a router with a single source)."""
    return np.array([[np.nan if row["entropy_ratio"] is None else row["entropy_ratio"]
                      for row in summarize(record)["routers"]] for record in records], dtype=float)


def concatenated(records: list[RoutingRecord]) -> RoutingRecord:
    """One record of every token of `records` (sequences of the same model), for criteria over all inputs."""
    first = records[0]
    return replace(first, tokens=[t for r in records for t in r.tokens],
                   weights=np.concatenate([r.weights for r in records], axis=1),
                   value_norms=np.concatenate([r.value_norms for r in records], axis=1))


def bootstrap_mean(values: np.ndarray, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(mean, low, high)` over the first axis of `values` `(n, ...)`, with a 95% percentile bootstrap interval."""
    rng = np.random.default_rng(seed)
    boot = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    return values.mean(axis=0), np.percentile(boot, 2.5, axis=0), np.percentile(boot, 97.5, axis=0)


def train_arm(arm: str, settings: Settings, train: torch.Tensor, val: torch.Tensor, device: str = "cpu",
              log=print) -> dict:
    """Train one arm from scratch (`ablation`'s backbone, batches and schedule for `settings.seed`); every
    `eval_every` steps the held-out loss (`ablation.evaluate`: `eval_batches` batches) and, for Block AttnRes, the
    entropy ratio per router on the first `curve_sequences` held-out windows. Returns the curve, the per-step
    training losses, the seconds and the final state dict (CPU tensors)."""
    preset, device = settings.preset, torch.device(device)
    model = ablation.build_model(preset, overrides(settings, arm), settings.seed).to(device).train()
    optimizer, schedule = ablation.optimizer_and_schedule(model, preset)
    probe = blocks(val, preset.seq_len)[: settings.curve_sequences]
    curve = {"step": [], "held_out_loss": [], "train_loss": [], "entropy_ratio": []}
    losses, started = [], time.perf_counter()

    def checkpoint(step):
        curve["step"].append(step)
        curve["held_out_loss"].append(ablation.evaluate(model, val, preset, device))
        curve["train_loss"].append(float(np.mean(losses[-settings.eval_every:])) if losses else None)
        ratios = None
        if arm == "Block AttnRes":
            model.eval()
            per_window = entropy_ratios([record_routing(model, w) for w in probe])
            model.train()
            ratios = [None if np.isnan(column).all() else float(column.mean()) for column in per_window.T]
        curve["entropy_ratio"].append(ratios)
        mean = "" if ratios is None else f", entropy/uniform {np.mean([v for v in ratios if v is not None]):.4f}"
        log(f"  {arm} step {step}: held-out {curve['held_out_loss'][-1]:.4f}{mean} "
            f"({time.perf_counter() - started:.0f} s)")

    checkpoint(0)
    for step, batch in enumerate(ablation.batches(train, preset, preset.steps, seed=settings.seed), start=1):
        batch = batch.to(device)
        with ablation.autocast(device):
            loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % settings.eval_every == 0 or step == preset.steps:
            checkpoint(step)
    return {"curve": curve, "train_loss_per_step": losses, "seconds": time.perf_counter() - started,
            "parameters": sum(p.numel() for p in model.parameters()),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def _worker(arm, settings, train, val, device):
    torch.set_num_threads(1)  # one core per arm: two arms share two cores without oversubscription
    torch.set_flush_denormal(True)
    return train_arm(arm, settings, train, val, device, log=lambda line: print(line, flush=True))


def train_both(settings: Settings, train, val, device="cpu", log=print) -> dict:
    """Both arms: side by side in `preset.jobs` processes (one thread each), or one after the other here."""
    if settings.preset.jobs <= 1:
        return {arm: train_arm(arm, settings, train, val, device, log) for arm in ARMS}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(settings.preset.jobs, len(ARMS)), mp_context=context) as pool:
        futures = {arm: pool.submit(_worker, arm, settings, train, val, device) for arm in ARMS}
        return {arm: future.result() for arm, future in futures.items()}


def analyse(models: dict, tokenizer, settings: Settings, val: torch.Tensor, pairs: list[dict]) -> dict:
    """The trained models' final held-out loss, routing, sinks and probe (see the module docstring), on CPU."""
    held_out, seq_len = val[: settings.eval_tokens], settings.preset.seq_len
    windows = blocks(held_out, seq_len)
    nll = {arm: window_nll(model, held_out, seq_len) for arm, model in models.items()}
    mean, low, high = ablation.paired_difference(nll["Block AttnRes"], nll["baseline"])
    model = models["Block AttnRes"].eval()
    records = [record_routing(model, w) for w in windows]
    ratio, ratio_low, ratio_high = bootstrap_mean(entropy_ratios(records), settings.bootstrap, settings.seed)
    summary = summarize(concatenated(records))
    routers = []
    for r, row in enumerate(summary["routers"]):
        n = row["n_sources"]
        routers.append({**row, "entropy_ratio": None if n < 2 else float(ratio[r]),
                        "low": None if n < 2 else float(ratio_low[r]), "high": None if n < 2 else float(ratio_high[r]),
                        "non_uniform": None if n < 2 else bool(ratio_high[r] < NON_UNIFORM)})
    probe = {}
    for values in ("weights", "contributions"):
        result = compare_pairs(model, tokenizer, pairs, bootstrap=settings.bootstrap, seed=settings.seed,
                               values=values)
        valid = ~np.isnan(result["shift"])
        cells = valid & (np.nan_to_num(result["high"] - result["low"]) > 0)  # a single-source router never shifts
        excludes = valid & ((result["low"] > 0) | (result["high"] < 0))
        probe[values] = {"pairs_used": result["pairs_used"], "aligned_tokens": result["aligned_tokens"],
                         "max_abs_shift": result["max_abs_shift"], "cells": int(cells.sum()),
                         "cells_interval_excludes_zero": int(excludes.sum()), "largest_shifts": largest_shifts(result)}
    return {"held_out": {arm: {"loss": float(np.mean(v)), "windows": len(v)} for arm, v in nll.items()},
            "paired_delta": {"mean": mean, "low": low, "high": high}, "held_out_nll_per_window": nll,
            "sources": records[0].sources, "routers": routers, "held_out_tokens_routing": int(windows.numel()),
            "probe": probe}


def run(settings: Settings, out: Path | None = None, device: str = "cpu", pairs: list[dict] | None = None,
        log=print) -> dict:
    """The experiment: data, both arms, the analysis; saves the models and `trained_routing.json` under `out`."""
    preset = settings.preset
    train, val = ablation.load_data("train", preset), ablation.load_data("held_out", preset)
    bpe = ablation.train_bpe(preset.vocab_size, preset.max_chars_per_book)
    tokenizer = hf_tokenizer(bpe)
    needed = settings.eval_tokens
    if len(val) < needed or len(val) < preset.seq_len * max(settings.curve_sequences, 1):
        raise ValueError(f"{len(val)} held-out tokens, {needed} asked for (--eval-tokens)")
    log(f"{len(train):,} training and {len(val):,} held-out {len(tokenizer):,}-id BPE tokens ({assets.text_source()}); "
        f"{preset.steps} steps x {preset.batch_size} x {preset.seq_len} tokens per model")
    trained = train_both(settings, train, val, device, log)
    log("trained both; the analysis: held-out windows, routing, sinks, the probe")
    models = {}
    for arm, result in trained.items():
        models[arm] = ablation.build_model(preset, overrides(settings, arm), settings.seed)
        models[arm].load_state_dict(result.pop("state_dict"))
        models[arm].eval()
    results = {"settings": asdict(settings), "train_tokens": len(train), "held_out_tokens": len(val),
               "text": assets.text_source(), "arms": trained}
    results |= analyse(models, tokenizer, settings, val, load_pairs(EXAMPLE_PAIRS) if pairs is None else pairs)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for arm, folder in (("Block AttnRes", "model"), ("baseline", "baseline")):
            models[arm].save_pretrained(out / folder)
            tokenizer.save_pretrained(out / folder)
        (out / "trained_routing.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def _cell(value, digits=4):
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: dict) -> str:
    """The printed report (Markdown; what `--results` writes)."""
    s, p = results["settings"], results["settings"]["preset"]
    n_blocks = -(-2 * p["num_hidden_layers"] // s["block_size"])
    tokens = p["steps"] * p["batch_size"] * p["seq_len"]
    held, delta = results["held_out"], results["paired_delta"]
    base, attn = results["arms"]["baseline"], results["arms"]["Block AttnRes"]
    routers = results["routers"]
    multi = [r for r in routers if r["n_sources"] > 1]
    lines = [
        f"Shape: {p['num_hidden_layers']} decoder layers ({2 * p['num_hidden_layers']} sub-layers) x hidden "
        f"{p['hidden_size']}, {p['num_attention_heads']} heads, tied embeddings, {p['vocab_size']:,}-id BPE "
        f"(trained on the training split); Block AttnRes with blocks of {s['block_size']} sub-layers ({n_blocks} "
        f"blocks + the embedding = {n_blocks + 1} sources, {len(routers)} routers) and a residual baseline of the same "
        f"shape ({base['parameters']:,} and {attn['parameters']:,} parameters), the same initial backbone and the same "
        f"{p['steps']} batches of {p['batch_size']} x {p['seq_len']} tokens ({tokens:,} training tokens per model) of "
        f"{results['text']}; AdamW (0.9/0.95, no weight decay) lr {p['learning_rate']}, 5% warm-up then cosine to "
        f"10%, clip 1.0, fp32; seed {s['seed']}. Training time {base['seconds'] / 60:.1f} min (baseline) and "
        f"{attn['seconds'] / 60:.1f} min (Block AttnRes).", "",
        f"Final held-out loss (nats per BPE token, {held['baseline']['windows']} windows of {p['seq_len']} tokens): "
        f"baseline {held['baseline']['loss']:.4f}, Block AttnRes {held['Block AttnRes']['loss']:.4f}; paired "
        f"difference (Block AttnRes minus baseline, 95% t-interval over windows) "
        f"{ablation.format_paired((delta['mean'], delta['low'], delta['high']), unit='window')}.", "",
        f"Training curve: held-out loss on {p['eval_batches']} batches of {p['batch_size']} x {p['seq_len']} tokens; "
        f"depth entropy / uniform (1.0 = uniform) per router on {s['curve_sequences']} held-out windows, over the "
        f"{len(multi)} routers with more than one source:", "",
        "| step | " + " | ".join(map(str, base["curve"]["step"])) + " |",
        "|---" * (len(base["curve"]["step"]) + 1) + "|"]
    for arm, result in results["arms"].items():
        lines.append(f"| held-out loss, {arm} | " + " | ".join(f"{v:.4f}" for v in result["curve"]["held_out_loss"])
                     + " |")
    curves = [[v for v in point if v is not None] for point in attn["curve"]["entropy_ratio"]]
    for label, fn in (("mean", np.mean), ("lowest", np.min), ("highest", np.max)):
        lines.append(f"| entropy / uniform, {label} | " + " | ".join(f"{fn(c):.4f}" for c in curves) + " |")
    verdict = sum(bool(r["non_uniform"]) for r in multi)
    lines += ["", f"Routing after training, per router (entropy / uniform over {results['held_out_tokens_routing']:,} "
              f"held-out tokens, 95% bootstrap interval over windows; non-uniform: the interval's upper end below "
              f"{NON_UNIFORM}; masses are mean weights, uniform = 1/n; sinks: mean weight at least twice uniform and "
              "coefficient of variation over tokens below 0.25):", "",
              "| router | n | curve (entropy / uniform at the steps above) | entropy / uniform [95% CI] | non-uniform "
              "| embedding | most recent | long jumps | sinks |", "|---|---|---|---|---|---|---|---|---|"]
    for index, r in enumerate(routers):
        trend = " → ".join(_cell(point[index], 3) for point in attn["curve"]["entropy_ratio"])
        ratio = "- (one source)" if r["entropy_ratio"] is None else \
            f"{r['entropy_ratio']:.4f} [{r['low']:.4f}, {r['high']:.4f}]"
        flag = "-" if r["non_uniform"] is None else ("yes" if r["non_uniform"] else "no")
        trend = trend if r["n_sources"] > 1 else "-"
        lines.append(f"| {r['router']} | {r['n_sources']} | {trend} | {ratio} | {flag} | {r['embedding_mass']:.3f} | "
                     f"{r['recent_mass']:.3f} | {r['long_jump_mass']:.3f} | {', '.join(r['sinks']) or '-'} |")
    sinks = {}
    for r in routers:
        for source in r["sinks"]:
            sinks.setdefault(source, []).append(r["router"])
    lines += ["", f"- measurably non-uniform: {verdict} of {len(multi)} routers with more than one source "
              f"(mean entropy / uniform {np.mean([r['entropy_ratio'] for r in multi]):.4f})",
              "- depth-wise attention sinks: " + ("; ".join(f"{source} in {len(names)} routers ({', '.join(names)})"
                                                  for source, names in sinks.items()) or "none by this criterion"),
              "- the paper's Figure 8 (token-averaged routing of its models): mostly local, the embedding keeps weight "
              "all the way up, occasional long jumps, depth-wise attention sinks"]
    lines += ["", "Contradiction probe (shift b minus a after the contradicting word, mean over the aligned tokens, "
              "95% paired bootstrap interval over pairs), per router the source that shifted most, in weight α and in "
              "contribution α·‖v‖ (‖v‖: the source's L2 norm per token):", "",
              "| router | α: source | α shift [95% CI] | α·‖v‖: source | α·‖v‖ shift [95% CI] |",
              "|---|---|---|---|---|"]
    weights, contributions = results["probe"]["weights"], results["probe"]["contributions"]
    for a, c in zip(weights["largest_shifts"], contributions["largest_shifts"]):
        lines.append(f"| {a['router']} | {a['source']} | {a['shift']:+.4f} [{a['low']:+.4f}, {a['high']:+.4f}] | "
                     f"{c['source']} | {c['shift']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] |")
    lines.append("")
    for name, probe in (("α", weights), ("α·‖v‖", contributions)):
        lines.append(f"- {name}: {probe['pairs_used']} pairs ({sum(probe['aligned_tokens'])} aligned tokens), max "
                     f"|shift| {probe['max_abs_shift']:.4f}; {probe['cells_interval_excludes_zero']} of "
                     f"{probe['cells']} router-source cells with an interval excluding 0 (about "
                     f"{0.05 * probe['cells']:.1f} by chance at 95%)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape and a few steps (seconds)")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument("--jobs", type=int, help="arms trained side by side (processes of one thread); 1: in turn")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process (the analysis, and "
                        "the training with --jobs 1); on a loaded machine two threads of one small model wait on each "
                        "other (15x slower measured)")
    parser.add_argument("--pairs", help="probe pairs, .jsonl of {\"a\": ..., \"b\": ...} (default: the shipped ones)")
    parser.add_argument("--out", default="outputs/trained_routing", help="folder for the models and the JSON")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the report, with how it "
                        "was measured, to PATH (a Markdown fragment, e.g. docs/results/trained_routing.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    settings = SMOKE if args.smoke else REAL
    changes = {k: v for k, v in (("steps", args.steps), ("jobs", args.jobs)) if v is not None}
    if any(v < 1 for v in [*changes.values(), args.threads]):
        parser.error("--steps, --jobs and --threads must be at least 1")
    settings = replace(settings, preset=replace(settings.preset, **changes))
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    pairs = load_pairs(args.pairs) if args.pairs else None
    started = time.perf_counter()
    results = run(settings, Path(args.out), args.device, pairs, log=lambda line: print(line, flush=True))
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    results["command"] = measured.command
    (Path(args.out) / "trained_routing.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    print()
    print(text)
    print(f"\nwall time {results['wall_seconds'] / 60:.1f} min; wrote {args.out}/ (model/, baseline/, JSON)")
    if args.results:
        measured.write(args.results, text, device=args.device, notes=(
            "The two models trained side by side, one process of one thread each, on cores shared with other work "
            "(the load average says how much), so the times are not benchmarks." if settings.preset.jobs > 1 else ""))


if __name__ == "__main__":
    main()
