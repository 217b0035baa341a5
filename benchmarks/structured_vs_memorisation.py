"""Structured task vs pure memorisation: where does AttnRes help, where does the plain residual win?

Liu's analysis (outside the AttnRes paper, ../shared/PAPER.md) finds AttnRes ahead on structured tasks and the
standard residual ahead on pure memorisation (random labels), where uniform depth weighting regularises. This
benchmark trains the residual baseline, Block AttnRes and Full AttnRes (`ablation.VARIANTS`, built by
`ablation.build_model`: for a seed, every variant starts from the same backbone weights) on two synthetic tasks with
the same model size, token budget, optimiser and schedule (`ablation.optimizer_and_schedule`) and the same batches:

- `recall` (structured: a rule that generalises): in-context associative recall. Every sequence draws its own
  table of `keys` keys -> values and lists `pairs` (key, value) pairs with keys drawn from it; the loss is on each
  value whose key appeared earlier in the sequence (copy the value that followed it). A fresh table per sequence
  leaves nothing to memorise; scored on fresh held-out sequences.
- `memorisation` (random labels): a fixed table of `items` random inputs (two tokens) -> a random label (one of
  64); the loss is on the label. Nothing generalises; scored on the training table itself (how much was
  memorised within the budget).

It reports, per task and variant, the loss (nats per scored token) and accuracy, the paired difference to the
baseline over seeds with its 95% t-interval (`ablation.paired_difference`), and which wins.

    python benchmarks/structured_vs_memorisation.py            # the recorded run (README), a few minutes
    python benchmarks/structured_vs_memorisation.py --seeds 2 --steps 50   # quick look
    python benchmarks/structured_vs_memorisation.py --results docs/results/structured_vs_memorisation.md
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ablation import (  # noqa: E402
    VARIANTS,
    Preset,
    autocast,
    build_model,
    format_paired,
    no_verdict,
    optimizer_and_schedule,
    paired_difference,
)
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)

TASKS = ("recall", "memorisation")
MODELS = ("baseline", "Block AttnRes (S=2)", "Full AttnRes")
KEY, VALUE, LABEL = 16, 96, 160  # token offsets of keys (64), values (64) and labels (64); vocabulary 256
IGNORE = -100


def recall_batch(generator: torch.Generator, batch_size: int, pairs: int = 16, keys: int = 6):
    """`(input_ids, labels)`, both `(batch_size, 2 * pairs)` int64: `pairs` (key, value) tokens per sequence from a
    per-sequence random table of `keys` distinct keys (of 64) to values (of 64). `labels` holds the value at each
    value position whose key occurred earlier in the sequence, `IGNORE` elsewhere (the model's own shift aligns
    labels[t] with the prediction made at t - 1, i.e. after reading the key)."""
    table_keys = torch.rand(batch_size, 64, generator=generator).argsort(dim=1)[:, :keys]  # distinct keys
    table_values = torch.randint(0, 64, (batch_size, keys), generator=generator)
    which = torch.randint(0, keys, (batch_size, pairs), generator=generator)
    k, v = table_keys.gather(1, which), table_values.gather(1, which)
    input_ids = torch.stack([KEY + k, VALUE + v], dim=2).reshape(batch_size, 2 * pairs)
    seen = torch.zeros(batch_size, pairs, dtype=torch.bool)
    for i in range(1, pairs):
        seen[:, i] = (which[:, :i] == which[:, i : i + 1]).any(dim=1)
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, 1::2] = torch.where(seen, VALUE + v, IGNORE)
    return input_ids, labels


def memorisation_table(items: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, labels)`, `(items, 3)` int64: distinct inputs `(key, value-range token)` followed by a random
    label token (uniform over 64, independent of the input); `labels` is `IGNORE` but at the label."""
    if not 1 <= items <= 64 * 64:
        raise ValueError(f"items must be in [1, 4096] (distinct two-token inputs), got {items}")
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randperm(64 * 64, generator=generator)[:items]
    label = torch.randint(0, 64, (items,), generator=generator)
    input_ids = torch.stack([KEY + codes // 64, VALUE + codes % 64, LABEL + label], dim=1)
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, 2] = input_ids[:, 2]
    return input_ids, labels


def training_batches(task: str, settings: dict, seed: int):
    """The task's training batches, the same for every variant of a seed."""
    generator = torch.Generator().manual_seed(seed)
    if task == "recall":
        for _ in range(settings["steps"]):
            yield recall_batch(generator, settings["batch_size"], settings["pairs"], settings["keys"])
    else:
        inputs, labels = memorisation_table(settings["items"], seed)
        for _ in range(settings["steps"]):
            rows = torch.randint(0, len(inputs), (settings["batch_size"],), generator=generator)
            yield inputs[rows], labels[rows]


def evaluation_batches(task: str, settings: dict, seed: int):
    if task == "recall":  # fresh sequences, one fixed stream for every variant and seed
        generator = torch.Generator().manual_seed(10_000)
        return [recall_batch(generator, 256, settings["pairs"], settings["keys"]) for _ in range(4)]
    inputs, labels = memorisation_table(settings["items"], seed)  # the training table itself
    return list(zip(inputs.split(512), labels.split(512)))


@torch.no_grad()
def score(model, batches, device="cpu") -> tuple[float, float]:
    """`(mean NLL per scored token, accuracy of the argmax)` over `batches`."""
    model.eval()
    nll = correct = count = 0.0
    for input_ids, labels in batches:
        with autocast(device):
            logits = model(input_ids.to(device)).logits[:, :-1].float()
        target = labels[:, 1:].to(device)
        mask = target != IGNORE
        nll += torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum").item()
        correct += (logits[mask].argmax(-1) == target[mask]).sum().item()
        count += mask.sum().item()
    model.train()
    return nll / count, correct / count


def run_one(task: str, name: str, seed: int, preset: Preset, settings: dict, device="cpu") -> dict:
    model = build_model(preset, VARIANTS[name].overrides, seed).to(device).train()
    optimizer, schedule = optimizer_and_schedule(model, preset)
    started = time.perf_counter()
    for input_ids, labels in training_batches(task, settings, seed):
        with autocast(device):
            loss = model(input_ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    nll, accuracy = score(model, evaluation_batches(task, settings, seed), device)
    return {"loss": nll, "accuracy": accuracy, "seconds": time.perf_counter() - started}


def verdict(mean: float, low: float | None, high: float | None) -> str:
    if low is None:  # one seed, or a non-finite loss: no interval to judge by
        return no_verdict(mean)
    if high < 0:
        return "beats the baseline"
    if low > 0:
        return "loses to the baseline"
    return "no clear difference"


def table(results: dict) -> str:
    rows = ["| task | model | loss, mean ± std | accuracy | paired Δ loss vs baseline [95% CI] | verdict |",
            "|---|---|---|---|---|---|"]
    for task, by_model in results.items():
        base = [r["loss"] for r in by_model["baseline"]]
        for name, runs in by_model.items():
            losses = [r["loss"] for r in runs]
            delta, judged = "-", "-"
            if name != "baseline":
                mean, low, high = paired_difference(losses, base)
                delta, judged = format_paired((mean, low, high)), verdict(mean, low, high)
            spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
            rows.append(f"| {task} | {name} | {statistics.mean(losses):.4f}{spread} | "
                        f"{statistics.mean(r['accuracy'] for r in runs):.3f} | {delta} | {judged} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--items", type=int, default=1024, help="memorisation: inputs with a random label")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast)")
    parser.add_argument("--output", help="write the per-run results as JSON here")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the table, with how it was measured, to PATH "
                        "(a Markdown fragment, e.g. docs/results/structured_vs_memorisation.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    tasks = [t.strip() for t in args.tasks.split(",")]
    if unknown := sorted(set(tasks) - set(TASKS)):
        parser.error(f"unknown tasks {unknown}; choose from {TASKS}")
    if args.seeds < 2 or args.steps < 1 or args.batch_size < 1:
        parser.error("--seeds must be at least 2 (for an interval), --steps and --batch-size at least 1")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    settings = {"steps": args.steps, "batch_size": args.batch_size, "pairs": 12, "keys": 6, "items": args.items}
    preset = Preset(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, seq_len=2 * settings["pairs"],
                    batch_size=settings["batch_size"], steps=args.steps, seeds=args.seeds, learning_rate=3e-3,
                    eval_batches=0, max_chars_per_book=None)
    header = (f"model: {preset.num_hidden_layers} layers x {preset.hidden_size}, {preset.num_attention_heads} heads; "
              f"{args.steps} steps x {settings['batch_size']} sequences, lr {preset.learning_rate} (warm-up + "
              f"cosine); {args.seeds} seeds; task settings {settings}; loss in nats per scored token, paired Δ over "
              "seeds with its 95% t-interval")
    print(header)
    started = time.perf_counter()
    results = {task: {name: [] for name in MODELS} for task in tasks}
    for task in tasks:
        for seed in range(args.seeds):
            for name in MODELS:
                result = run_one(task, name, seed, preset, settings, torch.device(args.device))
                results[task][name].append(result)
                print(f"  {task} seed {seed} {name}: loss {result['loss']:.4f} accuracy {result['accuracy']:.3f} "
                      f"({result['seconds']:.0f} s)", flush=True)
    text = f"{header}\n\n{table(results)}"
    print()
    print(text)
    print(f"\nwall time {(time.perf_counter() - started) / 60:.1f} min")
    if args.results:
        measured.write(args.results, text, device=args.device)
    if args.output:
        Path(args.output).write_text(json.dumps({"settings": settings, "preset": preset.__dict__,
                                                 "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
