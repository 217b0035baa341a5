"""`attnres convert` at the sizes users bring: random-weight checkpoints at real shapes, converted streamed
(`attnres_hf.conversion.streaming`), with the memory, time and exactness each takes.

Each case writes a bf16 checkpoint tensor by tensor (the family's own state-dict names and shapes, from the model
built on the meta device; sharded safetensors as the Hub's are, `--shard-size`; no tokenizer, so the probe is 64 fixed
random token ids), then records: the checkpoint's size; the time `cp -r` takes to copy it (the floor for reading and
writing the same bytes); `attnres convert` run as a child process under `/usr/bin/time -v` (its wall time and peak
resident memory, the whole process: Python, torch, transformers and the verification included); the verification's
max |delta logits| (fp32, both models offloaded to disk) over the source's max |logit|, and whether the greedy tokens
agree; the output's size; then the user's next step, `AutoModelForCausalLM.from_pretrained(device_map="auto")` of the
output with a CPU budget well under the machine's memory (`LOAD_BUDGET`; the rest offloaded to disk) and 2 greedy
tokens, its wall time and peak resident memory (`LOAD_SCRIPT`). Targets (issue: streamed conversion at 7-8B): peak
memory <= 3 GB, wall <= 3x `cp`, |delta| <= 1e-3 of the logits' scale.

    python benchmarks/convert_scale.py --results docs/results/convert_scale.md   # Llama-3-8B shape: ~15 min on 2 cores
    python benchmarks/convert_scale.py --small                                  # ~250 MB cases, about a minute

Random weights (normal, std 0.02; norms ones) make small logits; the relative delta is what compares across shapes.
Disk: the checkpoint, its copy (deleted after timing) and the output, at once: about 3.5x the checkpoint in bf16.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Run, results_path  # noqa: E402

CASES = {
    # Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B)
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                 tie_word_embeddings=False)),
    # Qwen2.5-7B's (Qwen/Qwen2.5-7B): q/k/v biases
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # --small: the same families at a few hundred MB, the streamed path on every machine
    "llama-small": ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                                  num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)),
    "qwen2-small-tied": ("qwen2", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                                       num_attention_heads=12, num_key_value_heads=2, vocab_size=32000,
                                       tie_word_embeddings=True)),
}
FULL = ["llama-3-8b"]
SMALL = ["llama-small", "qwen2-small-tied"]
TARGETS = {"peak_gb": 3.0, "wall_over_cp": 3.0, "relative_delta": 1e-3}


def write_checkpoint(folder: Path, family: str, fields: dict, shard_bytes: int, seed: int = 0) -> dict:
    """A bf16 checkpoint of `family` with `fields`, written tensor by tensor into shards of about `shard_bytes`
    (at most one shard's tensors in memory); returns the config's parameter and tensor counts."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **fields)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {name: tensor for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(seed)
    plan, current, size = [], [], 0
    for name, tensor in names.items():
        nbytes = tensor.numel() * 2
        if current and size + nbytes > shard_bytes:
            plan.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    plan.append(current)
    folder.mkdir(parents=True)
    weight_map = {}
    for index, shard in enumerate(plan, start=1):
        file_name = f"model-{index:05d}-of-{len(plan):05d}.safetensors"
        state = {}
        for name in shard:
            shape = names[name].shape
            if name.endswith("norm.weight"):
                state[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                state[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = file_name
        save_file(state, folder / file_name, metadata={"format": "pt"})
        del state
    total = sum(names[name].numel() * 2 for name in weight_map)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(folder)
    return {"parameters": sum(t.numel() for t in names.values()), "tensors": len(names)}


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def timed_child(argv: list[str]) -> tuple[float, float, str]:
    """Run `argv` under `/usr/bin/time -v`: (wall seconds, peak resident GB, its output)."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return wall, peak_kb * 1024 / 1e9, done.stdout + done.stderr


LOAD_SCRIPT = r"""
import json, sys, tempfile, time
import torch
from transformers import AutoModelForCausalLM

folder, budget = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory(prefix="offload-") as offload:
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="auto", device_map="auto",
                                                 max_memory={"cpu": budget}, offload_folder=offload)
    loaded = time.perf_counter() - start
    ids = torch.randint(model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    tokens = model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)[0, 8:]
    sizes = [(param.numel() * param.element_size(), param.device.type) for param in model.parameters()]
    print(json.dumps({"load_only_s": loaded, "new_tokens": len(tokens), "total_bytes": sum(n for n, _ in sizes),
                      "offloaded_bytes": sum(n for n, device in sizes if device == "meta")}))  # hooks hold them
"""
"""The user's next step, in a child process: the converted folder loaded with `AutoModelForCausalLM.from_pretrained(
trust_remote_code=True, device_map="auto", max_memory={"cpu": budget}, offload_folder=...)` (accelerate puts what
does not fit on disk) and 2 greedy tokens generated from 8 random ids."""

LOAD_BUDGET = {"full": "4GiB", "small": "128MiB"}
"""`max_memory["cpu"]` of the load step: well under the machine's memory, so most of the model is offloaded."""


def measure(name: str, root: Path, dtype: str, shard_bytes: int) -> dict:
    family, fields = CASES[name]
    source, copy, output = root / f"{name}-src", root / f"{name}-copy", root / f"{name}-out"
    for path in (source, copy, output):
        shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    counts = write_checkpoint(source, family, fields, shard_bytes)
    made = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(copy)], check=True)
    subprocess.run(["sync"], check=True)
    cp_seconds = time.perf_counter() - start
    shutil.rmtree(copy)
    cli = [sys.executable, "-m", "attnres_hf.cli", "convert", str(source), str(output), "--dtype", dtype, "--stream"]
    wall, peak, _ = timed_child(cli)
    report = json.loads((output / "conversion_report.json").read_text())
    check = report["verification"]
    row = {"case": name, "parameters": counts["parameters"], "source_bytes": folder_bytes(source), "made_s": made,
           "cp_s": cp_seconds, "convert_s": wall, "peak_gb": peak, "dtype": dtype,
           "mode": report["conversion"]["mode"], "output_bytes": folder_bytes(output),
           "max_abs_logit_delta": check["max_abs_logit_delta"], "source_max_abs_logit": check["source_max_abs_logit"],
           "greedy_match": check["greedy_match"], "greedy_new_tokens": check["greedy_new_tokens"],
           "largest_tensor_bytes": max_tensor_bytes(source)}
    row["relative_delta"] = row["max_abs_logit_delta"] / row["source_max_abs_logit"]
    row["load_budget"] = LOAD_BUDGET["full" if name in FULL else "small"]
    wall, peak, text = timed_child([sys.executable, "-c", LOAD_SCRIPT, str(output), row["load_budget"]])
    loaded = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    row |= {"load_generate_s": wall, "load_peak_gb": peak, "offloaded_bytes": loaded["offloaded_bytes"],
            "weight_bytes": loaded["total_bytes"], "load_new_tokens": loaded["new_tokens"]}
    shutil.rmtree(output)
    shutil.rmtree(source)
    return row


def max_tensor_bytes(folder: Path) -> int:
    """The largest tensor of the checkpoint in fp32 bytes (what the offloaded verification holds at once)."""
    from safetensors import safe_open

    largest = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= size
                largest = max(largest, count * 4)
    return largest


def format_table(rows: list[dict]) -> str:
    lines = ["| case | parameters | checkpoint (bf16) | output | `cp` | convert | convert / `cp` | peak memory | "
             "peak / largest tensor (fp32) | max abs delta logits / max abs logit | greedy tokens agree | "
             "load + 2 tokens (`device_map=\"auto\"`) | its peak memory |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['parameters'] / 1e9:.2f}B | {row['source_bytes'] / 1e9:.2f} GB | "
            f"{row['output_bytes'] / 1e9:.2f} GB ({row['dtype']}) | {row['cp_s']:.0f} s | {row['convert_s']:.0f} s | "
            f"{row['convert_s'] / row['cp_s']:.2f}x | {row['peak_gb']:.2f} GB | "
            f"{row['peak_gb'] * 1e9 / row['largest_tensor_bytes']:.2f}x | {row['relative_delta']:.2g} | "
            f"{row['greedy_match']} ({row['greedy_new_tokens']}) | {row['load_generate_s']:.0f} s (cpu "
            f"{row['load_budget']}; {row['offloaded_bytes'] / 1e9:.2f} of {row['weight_bytes'] / 1e9:.2f} GB on "
            "disk) | "
            f"{row['load_peak_gb']:.2f} GB |")
    verdicts = []
    for row in rows:
        if row["case"] not in FULL:
            continue
        checks = [("peak memory <= 3 GB", row["peak_gb"] <= TARGETS["peak_gb"]),
                  ("wall <= 3x cp", row["convert_s"] / row["cp_s"] <= TARGETS["wall_over_cp"]),
                  ("|delta logits| <= 1e-3 of the scale", row["relative_delta"] <= TARGETS["relative_delta"])]
        verdicts.append(f"{row['case']} ({row['dtype']} output): " + "; ".join(
            f"{label}: {'PASS' if ok else 'FAIL'}" for label, ok in checks))
    return "\n".join(lines) + ("\n\n" + "\n\n".join(verdicts) if verdicts else "") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help=f"the small cases ({', '.join(SMALL)}) only")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), help="cases to run (default: the full ones)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32", "auto"],
                        help="output dtype(s) of the conversion (default bfloat16)")
    parser.add_argument("--shard-size", type=float, default=5.0, help="source shard size in GB (default 5, as the Hub)")
    parser.add_argument("--workdir", type=Path, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--results", type=results_path, help="write the table as a results fragment")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    measured = Run(__file__, argv)
    cases = args.cases or (SMALL if args.small else FULL)
    shard_bytes = int(args.shard_size * 1e9) if not args.small else 64 * 2**20
    rows = []
    with tempfile.TemporaryDirectory(prefix="convert-scale-", dir=args.workdir) as root:
        for name in cases:
            for dtype in args.dtype:
                rows.append(measure(name, Path(root), dtype, shard_bytes))
                print(json.dumps(rows[-1]), flush=True)
    text = format_table(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.results:
        measured.write(args.results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
