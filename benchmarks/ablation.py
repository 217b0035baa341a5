"""Small-scale ablation study of the depth-mixing family, after the AttnRes paper's Table 4.

The same small decoder is trained from scratch with each `depth_mixing` variant (the residual baseline, Full and
Block AttnRes, DenseFormer, MUDDFormer, DCA, mHC, and each AttnRes ablation knob on Full AttnRes) on the same real
text (the public-domain books of `attnres_hf.assets`, ../shared/DATA.md), byte-level tokens (vocab 256, so that no
tokenizer or hub is needed), with the same token budget and hyperparameters for every variant. The comparison is
paired: for a given seed every variant starts from the same backbone weights (copied from the seed's baseline
model) and sees the same batches in the same order, so the per-seed difference to the baseline cancels most of the
seed-to-seed noise. It prints the held-out validation loss (nats per byte), the mean paired difference to the
baseline with its 95% t-interval over seeds, and the paper's Table 4 value beside it.

The paper's Table 4 is a 16 attention + 16 MLP layer model trained at a scale far beyond these presets (its
losses are nats per token of its own tokenizer): compare orderings, not numbers. Where one of our variants uses
another setting than the paper's (block size, window, heads), the row says so.

    python benchmarks/ablation.py --preset smoke              # < 1 minute, checks the pipeline end to end
    python benchmarks/ablation.py --preset cpu                # about 35 minutes on 2 CPU cores (34 min measured)
    python benchmarks/ablation.py --preset gpu --device cuda  # larger model and budget
    python benchmarks/ablation.py --preset kimi-linear        # Kimi Linear backbone: baseline vs Block AttnRes S=6

Add `--output results.json` to keep the per-run numbers, `--variants baseline,dca` to run a subset.
"""

import argparse
import json
import math
import multiprocessing
import queue
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from attnres_hf import AttnResConfig, AttnResForCausalLM, assets


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    seq_len: int
    batch_size: int
    steps: int
    seeds: int
    learning_rate: float
    eval_batches: int
    max_chars_per_book: int | None  # None: the whole corpus
    jobs: int = 1  # runs in parallel, one single-threaded process each (CPU); 1: in this process
    threads: int | None = None  # torch threads of this process when jobs == 1 (None: torch's default)
    backbone: str = "llama"  # the backbone family (`"kimi_linear"`: `kimi_linear_backbone`)
    variants: tuple[str, ...] | None = None  # the variants run by default (None: every one of `VARIANTS` but S=6)


PRESETS = {
    "smoke": Preset(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, seq_len=32, batch_size=4, steps=30,
                    seeds=2, learning_rate=3e-3, eval_batches=2, max_chars_per_book=20_000, threads=1),
    "cpu": Preset(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, seq_len=128, batch_size=16, steps=360,
                  seeds=3, learning_rate=3e-3, eval_batches=16, max_chars_per_book=None, jobs=2),
    "gpu": Preset(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, seq_len=512, batch_size=32,
                  steps=5000, seeds=3, learning_rate=1e-3, eval_batches=64, max_chars_per_book=None),
}

# The paper's own backbone, Kimi Linear 48B A3B, shrunk: KDA linear attention and MLA layers 3:1, a dense first MLP
# then mixture-of-experts MLPs with a shared expert, Block AttnRes with 6 sub-layers per block (paper: 54 sub-layers,
# 9 blocks). On CPU transformers runs KDA with its pure-torch fallback (slow; flash-linear-attention is the kernel):
# `--steps 8 --seeds 2 --jobs 1` took 38 min on 2 shared, loaded CPU cores, so the full preset is for `--device cuda`.
PRESETS["kimi-linear"] = Preset(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, seq_len=64, batch_size=8,
                                steps=300, seeds=2, learning_rate=3e-3, eval_batches=8, max_chars_per_book=200_000,
                                jobs=2, backbone="kimi_linear", variants=("baseline", "Block AttnRes (S=6)"))


@dataclass(frozen=True)
class Variant:
    """One row of the study: the config overrides, and the paper's Table 4 row it stands for (if any)."""

    overrides: dict
    paper: float | None = None  # the paper's Table 4 validation loss for this variant; None: no row in Table 4
    paper_setting: str = ""  # how our setting differs from the paper's row ("" when it is the same)


VARIANTS = {
    "baseline": Variant({"depth_mixing": "residual"}, 1.766),
    "Full AttnRes": Variant({"depth_mixing": "attnres", "attnres_block_size": 1}, 1.737),
    "Block AttnRes (S=2)": Variant({"depth_mixing": "attnres", "attnres_block_size": 2}, 1.746,
                                   "paper: block size 4 (8 blocks of 32 sub-layers)"),
    "DenseFormer": Variant({"depth_mixing": "denseformer"}, 1.767),
    "MUDDFormer": Variant({"depth_mixing": "muddformer"}),
    "DCA": Variant({"depth_mixing": "dca"}),
    "mHC (n=4)": Variant({"depth_mixing": "mhc", "mhc_num_streams": 4}, 1.747),
    "AttnRes w/ sigmoid": Variant({"depth_mixing": "attnres", "attnres_block_size": 1, "attnres_score_fn": "sigmoid"},
                                  1.741),
    "AttnRes w/o key RMSNorm": Variant({"depth_mixing": "attnres", "attnres_block_size": 1, "attnres_key_norm": False},
                                       1.743, "paper: Full 1.743, Block 1.750"),
    "AttnRes sliding window (W=2)": Variant({"depth_mixing": "attnres", "attnres_block_size": 1, "attnres_window": 2},
                                            1.764, "paper: W=8 of 32 sub-layers"),
    "AttnRes input-dependent query": Variant({"depth_mixing": "attnres", "attnres_block_size": 1,
                                              "attnres_query": "input_dependent"}, 1.731),
    "AttnRes multi-head (H=4)": Variant({"depth_mixing": "attnres", "attnres_block_size": 1, "attnres_num_heads": 4},
                                        1.752, "paper: H=16"),
    "AttnRes input-independent scalars": Variant({"depth_mixing": "attnres", "attnres_block_size": 1,
                                                  "attnres_scalar_weights": True}, 1.749),
}
"""The variants, with the paper's Table 4 validation losses (Kimi Team, arXiv:2603.15031, Table 4: 16 + 16 layers,
everything else fixed). MUDDFormer and DCA are not in the paper's table."""
VARIANTS["Block AttnRes (S=6)"] = Variant({"depth_mixing": "attnres", "attnres_block_size": 6}, None,
                                         "the paper's Kimi Linear 48B setting (6 sub-layers per block)")


def paper_ordering(names) -> str:
    """The paper's Table 4 ordering of `names` (best first; variants without a paper value are left out)."""
    ranked = sorted((VARIANTS[n].paper, n) for n in names if VARIANTS[n].paper is not None)
    return " < ".join(name for _, name in ranked)


def load_bytes(split: str, max_chars_per_book: int | None) -> torch.Tensor:
    text = assets.text_split(split, max_chars_per_book=max_chars_per_book)  # the books, or LAMBADA without npm
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def kimi_linear_backbone(preset: Preset):
    """A Kimi-Linear-shaped `KimiLinearConfig` (transformers' own family): every 4th layer MLA (`full_attention`, no
    rope), the others KDA (`linear_attention`); a dense first MLP (`first_k_dense_replace=1`), then MoE layers with 8
    routed experts (top 2) and one shared expert. Equal key/value and attention heads (transformers' MLA needs it)."""
    from transformers import KimiLinearConfig

    h, n, heads = preset.hidden_size, preset.num_hidden_layers, preset.num_attention_heads
    return KimiLinearConfig(
        vocab_size=256, hidden_size=h, intermediate_size=8 * h // 3, moe_intermediate_size=h, num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=h // 2, q_lora_rank=None,
        qk_nope_head_dim=h // heads, qk_rope_head_dim=h // (2 * heads), v_head_dim=h // heads,
        linear_num_heads=heads, linear_head_dim=h // heads, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, max_position_embeddings=preset.seq_len, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
    )


def _config(preset: Preset, overrides: dict) -> AttnResConfig:
    if preset.backbone == "kimi_linear":
        return AttnResConfig(backbone=kimi_linear_backbone(preset), attn_implementation="sdpa", **overrides)
    return AttnResConfig(
        vocab_size=256, hidden_size=preset.hidden_size, intermediate_size=8 * preset.hidden_size // 3,
        num_hidden_layers=preset.num_hidden_layers, num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_attention_heads, max_position_embeddings=preset.seq_len,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        attn_implementation="sdpa", **overrides,
    )


def build_model(preset: Preset, overrides: dict, seed: int) -> AttnResForCausalLM:
    """The variant's model, with the backbone weights of the seed's baseline model: the mixing modules are built
    between the decoder layers and draw from the same random stream, so seeding alone would give each variant
    other attention/MLP weights. Mixing modules keep their residual-exact initialisation."""
    torch.manual_seed(seed)
    backbone = AttnResForCausalLM(_config(preset, {"depth_mixing": "residual"})).state_dict()
    torch.manual_seed(seed)
    model = AttnResForCausalLM(_config(preset, overrides))
    own = model.state_dict()
    shared = {k: v for k, v in backbone.items() if k in own and own[k].shape == v.shape}
    missing, _ = model.load_state_dict(shared, strict=False)
    if overrides.get("depth_mixing", "residual") == "residual" and missing:
        raise RuntimeError(f"baseline parameters without a backbone value: {missing}")
    return model


def batches(data: torch.Tensor, preset: Preset, count: int, seed: int):
    """`count` random windows of `seq_len` tokens, `batch_size` at a time; the same for every variant of a seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        starts = torch.randint(0, len(data) - preset.seq_len, (preset.batch_size,), generator=generator)
        yield torch.stack([data[s : s + preset.seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, preset: Preset, device) -> float:
    model.eval()
    losses = [model(batch.to(device), labels=batch.to(device)).loss.item()
              for batch in batches(data, preset, preset.eval_batches, seed=12345)]
    model.train()
    return sum(losses) / len(losses)


def train_one(preset, overrides, seed, train_data, val_data, device, progress) -> dict:
    """Train one variant from scratch; `progress(loss)` is called after every step."""
    model = build_model(preset, overrides, seed).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, preset.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to 10%
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / preset.steps)))))
    start, last_loss = time.perf_counter(), float("nan")
    for batch in batches(train_data, preset, preset.steps, seed=seed):
        batch = batch.to(device)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        last_loss = loss.item()
        progress(last_loss)
    return {"val_loss": evaluate(model, val_data, preset, device), "train_loss": last_loss,
            "seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters())}


_WORKER = {}


def _worker_init(preset, device, updates):
    torch.set_num_threads(1)  # one core per run: no thread oversubscription when runs share the cores
    torch.set_flush_denormal(True)
    _WORKER.update(preset=preset, device=torch.device(device), updates=updates,
                   train=load_bytes("train", preset.max_chars_per_book),
                   val=load_bytes("held_out", preset.max_chars_per_book))


def _worker_run(name, seed):
    w = _WORKER
    result = train_one(w["preset"], VARIANTS[name].overrides, seed, w["train"], w["val"], w["device"],
                       lambda loss: w["updates"].put((name, seed, loss)))
    return name, seed, result


def run_all(names, preset, device, train_data, val_data) -> dict:
    """Every (variant, seed) run, in this process or in `preset.jobs` worker processes, with one progress bar."""
    runs = [(name, seed) for name in names for seed in range(preset.seeds)]
    results = {name: [None] * preset.seeds for name in names}
    with tqdm(total=len(runs) * preset.steps, unit="step", desc="ablation") as bar:
        if preset.jobs <= 1:
            for name, seed in runs:
                bar.set_description(f"{name} seed {seed}")
                results[name][seed] = train_one(
                    preset, VARIANTS[name].overrides, seed, train_data, val_data, device,
                    lambda loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}")))
            return results
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager:
            updates = manager.Queue()
            with ProcessPoolExecutor(preset.jobs, mp_context=context, initializer=_worker_init,
                                     initargs=(preset, str(device), updates)) as pool:
                pending = {pool.submit(_worker_run, name, seed) for name, seed in runs}
                while pending:
                    try:
                        name, seed, loss = updates.get(timeout=0.5)
                        bar.update(1)
                        bar.set_postfix_str(f"{name} seed {seed} loss {loss:.3f}")
                    except queue.Empty:
                        pass
                    for future in [f for f in pending if f.done()]:
                        pending.remove(future)
                        name, seed, result = future.result()
                        results[name][seed] = result
    return results


def paired_difference(losses: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """Mean of the per-seed differences `losses[s] - baseline[s]` and its 95% t-interval `(mean, low, high)`
    (the interval is `(nan, nan)` with one seed)."""
    from scipy import stats

    diffs = [a - b for a, b in zip(losses, baseline, strict=True)]
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def table(results: dict, baseline: str = "baseline") -> str:
    rows = ["| variant | val loss (nats/byte), mean ± std | paired Δ vs baseline [95% CI] | paper Table 4 (Δ) "
            "| params | s / run |", "|---|---|---|---|---|---|"]
    base = [r["val_loss"] for r in results[baseline]] if baseline in results else None
    paper_base = VARIANTS[baseline].paper if baseline in VARIANTS else None
    for name, runs in results.items():
        losses = [r["val_loss"] for r in runs]
        std = statistics.stdev(losses) if len(losses) > 1 else 0.0
        delta = "-"
        if base is not None and name != baseline:
            mean, low, high = paired_difference(losses, base)
            delta = f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"
        variant = VARIANTS[name]
        paper = "not in Table 4"
        if variant.paper is not None:
            paper = f"{variant.paper:.3f}" + (f" ({variant.paper - paper_base:+.3f})" if paper_base is not None
                                               and name != baseline else "")
        if variant.paper_setting:
            paper += f"; {variant.paper_setting}"
        rows.append(f"| {name} | {statistics.mean(losses):.4f} ± {std:.4f} (n={len(losses)}) | {delta} | {paper} | "
                    f"{runs[0]['parameters']:,} | {statistics.mean(r['seconds'] for r in runs):.0f} |")
    return "\n".join(rows)


def our_ordering(results: dict) -> str:
    ranked = sorted((statistics.mean(r["val_loss"] for r in runs), name) for name, runs in results.items()
                    if VARIANTS[name].paper is not None)
    return " < ".join(name for _, name in ranked)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="smoke")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", type=int, help="override the preset's number of seeds")
    parser.add_argument("--steps", type=int, help="override the preset's number of training steps")
    parser.add_argument("--jobs", type=int, help="override the preset's number of parallel runs (CPU processes)")
    parser.add_argument("--output", help="write the per-run results as JSON here")
    args = parser.parse_args(argv)

    preset = PRESETS[args.preset]
    overrides = {k: v for k, v in (("seeds", args.seeds), ("steps", args.steps), ("jobs", args.jobs)) if v is not None}
    preset = Preset(**(asdict(preset) | overrides))
    if preset.threads:
        torch.set_num_threads(preset.threads)
    torch.set_flush_denormal(True)  # denormal floats (e.g. exp of very negative logits) slow CPUs many times over
    default = preset.variants or [name for name in VARIANTS if name != "Block AttnRes (S=6)"]
    names = list(default) if not args.variants else [n.strip() for n in args.variants.split(",")]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    device = torch.device(args.device)
    train_data = load_bytes("train", preset.max_chars_per_book)
    val_data = load_bytes("held_out", preset.max_chars_per_book)
    tokens = preset.steps * preset.batch_size * preset.seq_len
    print(f"preset {args.preset}: {preset}")
    print(f"corpus: {len(train_data):,} training bytes, {len(val_data):,} held-out bytes ({assets.text_source()}); "
          f"{tokens:,} training tokens per run; {len(names)} variants x {preset.seeds} seeds on {device}"
          f"{f', {preset.jobs} runs at a time' if preset.jobs > 1 else ''}")

    start = time.perf_counter()
    results = run_all(names, preset, device, train_data, val_data)
    wall = time.perf_counter() - start
    print()
    print(table(results, baseline="baseline" if "baseline" in results else names[0]))
    print(f"\nordering, ours (mean val loss, best first): {our_ordering(results)}")
    print(f"ordering, paper Table 4 (same variants):     {paper_ordering(results)}")
    print(f"\nwall time {wall / 60:.1f} min; same initial backbone, data order, token budget and hyperparameters for "
          f"every variant of a seed; the paper's Table 4 is a 16 + 16-layer model trained far longer (nats per token "
          f"of its tokenizer, ours are nats per byte), so only orderings and signs can be compared.")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"preset": asdict(preset), "results": results, "wall_seconds": wall}, handle, indent=1)


if __name__ == "__main__":
    main()
