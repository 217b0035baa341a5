"""The user's path after `attnres convert` at the sizes users bring: a retrofitted Llama-3-8B-shaped model evaluated
with `attnres eval --limit` and fine-tuned with QLoRA, each on this machine, with the time and memory it takes.

A random-weight bf16 checkpoint of `convert_scale.CASES[case]`'s shape is written tensor by tensor
(`convert_scale.write_checkpoint`), with SmolLM2-135M-Instruct's tokenizer saved beside it (the real offline one,
`attnres_hf.demo.smollm2_hf_folder`; its 49,152 ids are ids of the 8B shapes' vocabularies, and a smaller case's
vocabulary is widened to hold them) so that the commands that read
text run, and converted streamed (`attnres convert --stream --dtype bfloat16`). Then, each as a child process under
`/usr/bin/time -v` (its wall time and peak resident memory, the whole process):

- **eval**: `attnres eval OUT --tasks TASK --limit N --dtype bfloat16` (lm-eval-harness on the offline pack, the
  model resident in bf16; the pack's data built first with `attnres eval prepare-data --only TASK`);
- **QLoRA**: `attnres train OUT --method qlora --max-steps K` (the base loaded in 4 bits, NF4 with double
  quantization; LoRA on every projection and the routers trained in full; `--seq-len`, batch 1) on a small corpus of
  the offline books (`attnres_hf.assets.text_split`).

Random weights: the scores and losses mean nothing, and the table gives none; what is measured is that each step
runs within the machine's memory, and what it costs. Disk: the checkpoint and the output at once (2x its bf16 size),
then the output alone.

    python benchmarks/scale_use.py --results docs/results/scale_use.md     # Llama-3-8B shape: ~40 min on 2 cores
    python benchmarks/scale_use.py --case llama-small --limit 2 --steps 2   # ~250 MB, a few minutes
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Run, results_path  # noqa: E402
from convert_scale import CASES, folder_bytes, timed_child, write_checkpoint  # noqa: E402

CLI = [sys.executable, "-m", "attnres_hf.cli"]


def make_model(root: Path, case: str, shard_bytes: int) -> tuple[Path, dict]:
    """Write the case's checkpoint with SmolLM2's tokenizer, convert it streamed into bf16, delete the source;
    returns the output folder and the conversion's figures."""
    from transformers import AutoTokenizer

    from attnres_hf.demo import smollm2_hf_folder

    family, fields = CASES[case]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_folder())
    fields = dict(fields, vocab_size=max(fields["vocab_size"], len(tokenizer)))  # the small cases' 32,000: widened
    source, output = root / f"{case}-src", root / f"{case}-out"
    counts = write_checkpoint(source, family, fields, shard_bytes)
    tokenizer.save_pretrained(source)
    wall, peak, _ = timed_child([*CLI, "convert", str(source), str(output), "--dtype", "bfloat16", "--stream"])
    report = json.loads((output / "conversion_report.json").read_text())
    shutil.rmtree(source)
    return output, {"parameters": counts["parameters"], "model_bytes": folder_bytes(output), "convert_s": wall,
                    "convert_peak_gb": peak, "convert_mode": report["conversion"]["mode"]}


def run_eval(model: Path, root: Path, task: str, limit: int) -> dict:
    """`attnres eval` of `model` on `task` with `--limit` in bf16: wall time, peak memory, requests answered."""
    data = root / "eval-data"
    timed_child([*CLI, "eval", "prepare-data", "--data-dir", str(data), "--only", task])
    out = root / "eval-out"
    wall, peak, _ = timed_child([*CLI, "eval", str(model), "--tasks", task, "--limit", str(limit), "--dtype",
                                 "bfloat16", "--data-dir", str(data), "--output-dir", str(out), "--batch-size", "1"])
    results = json.loads((out / "results.json").read_text())
    shutil.rmtree(out)
    return {"eval_s": wall, "eval_peak_gb": peak, "eval_task": task, "eval_limit": limit,
            "eval_scored": _scored(results, task)}


def _scored(results: dict, task: str) -> bool:
    """Whether `results.json`'s row of benchmark `task` holds the model's score."""
    return any(row["benchmark"] == task and row["model"] is not None for row in results["rows"])


def run_qlora(model: Path, root: Path, steps: int, seq_len: int) -> dict:
    """`attnres train --method qlora` for `steps` steps of one `seq_len`-token sequence: wall time, peak memory,
    the steps logged and their mean seconds."""
    from attnres_hf.assets import text_split

    corpus = root / "corpus.jsonl"
    text = text_split("train", max_chars_per_book=4000)
    pieces = [text[i:i + 2000] for i in range(0, min(len(text), 2000 * 64), 2000)]
    corpus.write_text("".join(json.dumps({"text": piece}) + "\n" for piece in pieces))
    out = root / "qlora-out"
    wall, peak, log = timed_child([*CLI, "train", str(model), "--data", str(corpus), "--method", "qlora",
                                   "--max-steps", str(steps), "--seq-len", str(seq_len), "--output-dir", str(out),
                                   "--per-device-train-batch-size", "1", "--logging-steps", "1",
                                   "--save-strategy", "no", "--report-to", "none"])
    losses = re.findall(r"'loss': '?([0-9.]+)", log)  # the Trainer's log line of each step (`--logging-steps 1`)
    shutil.rmtree(out, ignore_errors=True)
    return {"qlora_s": wall, "qlora_peak_gb": peak, "qlora_steps": steps, "qlora_seq_len": seq_len,
            "qlora_losses_logged": len(losses)}


def format_table(rows: list[dict]) -> str:
    lines = ["| case | parameters | converted folder (bf16) | convert (streamed) | its peak | `attnres eval --limit` "
             "(bf16, resident) | its peak | QLoRA steps (4-bit base) | its peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['parameters'] / 1e9:.2f}B | {row['model_bytes'] / 1e9:.2f} GB | "
            f"{row['convert_s']:.0f} s | {row['convert_peak_gb']:.2f} GB | {row['eval_task']}, {row['eval_limit']} "
            f"questions: {row['eval_s']:.0f} s{'' if row['eval_scored'] else ' (no score)'} | "
            f"{row['eval_peak_gb']:.2f} GB | {row['qlora_steps']} x {row['qlora_seq_len']} tokens: "
            f"{row['qlora_s']:.0f} s ({row['qlora_losses_logged']} losses logged) | {row['qlora_peak_gb']:.2f} GB |")
    memory = _machine_gib()
    verdicts = [f"{row['case']}: every step within the machine's memory ({memory:.1f} GiB): "
                f"{'PASS' if max(row['convert_peak_gb'], row['eval_peak_gb'], row['qlora_peak_gb']) < memory * 2**30 / 1e9 else 'FAIL'}"
                for row in rows] if memory else []
    return "\n".join(lines) + ("\n\n" + "\n\n".join(verdicts) if verdicts else "") + "\n"


def _machine_gib() -> float | None:
    from _results import memory_gib

    return memory_gib()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="llama-3-8b", choices=list(CASES), help="the shape (default llama-3-8b)")
    parser.add_argument("--task", default="arc_easy", help="the pack's benchmark to evaluate (default arc_easy)")
    parser.add_argument("--limit", type=int, default=4, help="questions evaluated (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="QLoRA steps (default 3)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per QLoRA step (default 128)")
    parser.add_argument("--shard-size", type=float, default=5.0, help="source shard size in GB (default 5)")
    parser.add_argument("--workdir", type=Path, help="where the folders are written (default: a temporary folder)")
    parser.add_argument("--results", type=results_path, help="write the table as a results fragment")
    args = parser.parse_args(argv)
    measured = Run(__file__, argv)
    with tempfile.TemporaryDirectory(prefix="scale-use-", dir=args.workdir) as root:
        root = Path(root)
        start = time.perf_counter()
        model, row = make_model(root, args.case, int(args.shard_size * 1e9))
        row = {"case": args.case, **row, **run_eval(model, root, args.task, args.limit),
               **run_qlora(model, root, args.steps, args.seq_len), "total_s": time.perf_counter() - start}
        print(json.dumps(row), flush=True)
    text = format_table([row])
    print(text)
    if args.results:
        measured.write(args.results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
