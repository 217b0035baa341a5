"""Small-scale ablation study of the depth-mixing family, after the AttnRes paper's Table 4.

The same small decoder is trained from scratch with each `depth_mixing` variant (the residual baseline, Full and
Block AttnRes, DenseFormer, MUDDFormer, DCA, mHC, and each AttnRes ablation knob on Full AttnRes) on the same real
text (the public-domain books of `attnres_hf.assets`, ../shared/DATA.md), byte-level tokens (vocab 256, so that no
tokenizer or hub is needed), with the same token budget and hyperparameters for every variant. The comparison is
paired: for a given seed every variant starts from the same backbone weights (copied from the seed's baseline
model) and sees the same batches in the same order, so the per-seed difference to the baseline cancels most of the
seed-to-seed noise. It prints the held-out validation loss (nats per byte), the mean paired difference to the
baseline with its 95% t-interval over seeds, and the paper's Table 4 value beside it. With `--seeds 1` there is no
interval: the paired difference is printed with `[n/a (1 seed)]` (null in results.json) and no ordering gets a verdict.

The paper's Table 4 is a 16 attention + 16 MLP layer model trained at a scale far beyond these presets (its
losses are nats per token of its own tokenizer): compare orderings, not numbers. Where one of our variants uses
another setting than the paper's (block size, window, heads), the row says so.

    python benchmarks/ablation.py --preset smoke              # < 1 minute, checks the pipeline end to end
    python benchmarks/ablation.py --preset cpu                # about 35 minutes on 2 CPU cores (34 min measured)
    python benchmarks/ablation.py --preset gpu --device cuda  # larger model and budget
    python benchmarks/ablation.py --preset kimi-linear        # Kimi Linear backbone: baseline vs Block AttnRes S=6
    python benchmarks/ablation.py --preset long --out results/  # 87 min on 2 shared CPU cores (README)
        # 8 layers x 128 (16 sub-layers), a byte-level BPE tokenizer of 4,096 ids trained (`tokenizers`) on the
        # training split, the 11 variants of the paper's Table 4 x 3 seeds x 307K tokens, two runs at a time.
    python benchmarks/ablation.py --prepare-data DATA         # copy SmolLM2's tokenizer.json and the books to DATA
    python benchmarks/ablation.py --preset long-gpu --device cuda --data-dir DATA --out results/
        # 12 layers x 256, SmolLM2's BPE tokenizer (49,152 ids), 13 variants x 3 seeds x 4.1M tokens, 8 runs at a
        # time; sized (not measured) for one GPU. CUDA runs use bf16 autocast (fp32 weights, optimizer state and
        # loss; TF32 for the fp32 matmuls); CPU runs are fp32. Needs torch, transformers, tokenizers, numpy and
        # tqdm only: no scipy, no network, no cache (DATA holds the text and tokenizer).

Add `--output results.json` to keep the per-run numbers, `--variants baseline,dca` to run a subset, `--results
docs/results/ablation_long.md` to write the report (results.md's text) with how it was measured, as a Markdown
fragment for the docs (`benchmarks/_results.py`).
"""

import argparse
import json
import math
import multiprocessing
import os
import queue
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnres_hf import AttnResConfig, AttnResForCausalLM, assets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)


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
    variants: tuple[str, ...] | None = None  # the variants run by default (None: every `VARIANTS` entry marked default)
    tokenizer: str = "bytes"  # one of `TOKENIZERS`
    vocab_size: int = 256  # set from the tokenizer by `main` ("bpe": the vocabulary size to train)


PRESETS = {
    "smoke": Preset(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, seq_len=32, batch_size=4, steps=30,
                    seeds=2, learning_rate=3e-3, eval_batches=2, max_chars_per_book=20_000, threads=1),
    "cpu": Preset(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, seq_len=128, batch_size=16, steps=360,
                  seeds=3, learning_rate=3e-3, eval_batches=16, max_chars_per_book=None, jobs=2),
    # 8 layers, a 4,096-id BPE trained on the training split, 307K tokens per run, the 11 variants of the paper's
    # Table 4: 87 min measured on 2 CPU cores shared with other work (a 49K-id output layer would cost 3x the rest
    # of the model)
    "long": Preset(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, seq_len=128, batch_size=16,
                   steps=150, seeds=3, learning_rate=2e-3, eval_batches=40, max_chars_per_book=None, jobs=2,
                   tokenizer="bpe", vocab_size=4096,
                   variants=("baseline", "Full AttnRes", "Block AttnRes (S=2)", "DenseFormer", "mHC (n=4)",
                             "AttnRes w/ sigmoid", "AttnRes w/o key RMSNorm", "AttnRes sliding window (W=2)",
                             "AttnRes input-dependent query", "AttnRes multi-head (H=4)",
                             "AttnRes input-independent scalars")),
    # 12 layers, SmolLM2's BPE tokenizer, 4.1M tokens per run; sized for one GPU (bf16 autocast, 8 runs at a time)
    "long-gpu": Preset(hidden_size=256, num_hidden_layers=12, num_attention_heads=4, seq_len=256, batch_size=32,
                   steps=500, seeds=3, learning_rate=2e-3, eval_batches=32, max_chars_per_book=None, jobs=8,
                   tokenizer="smollm2"),
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
    default: bool = True  # run when a preset names no variants (the others: `--variants` or a preset's own list)


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
                                         "the paper's Kimi Linear 48B setting (6 sub-layers per block)", default=False)
VARIANTS["AttnRes sliding window (W=4)"] = Variant(
    {"depth_mixing": "attnres", "attnres_block_size": 1, "attnres_window": 4}, 1.764,
    "paper: W=8 of 32 sub-layers, the same quarter of the depth as W=4 of the long preset's 16", default=False)


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
        vocab_size=preset.vocab_size, hidden_size=h, intermediate_size=8 * h // 3, moe_intermediate_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=h // 2, q_lora_rank=None,
        qk_nope_head_dim=h // heads, qk_rope_head_dim=h // (2 * heads), v_head_dim=h // heads,
        linear_num_heads=heads, linear_head_dim=h // heads, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, max_position_embeddings=preset.seq_len, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
    )


TOKENIZER_FILE = "tokenizer.json"
TOKENIZERS = {
    "bytes": "byte",  # UTF-8 bytes, vocab 256: no tokenizer at all
    "smollm2": "SmolLM2 token",  # SmolLM2's BPE tokenizer (its tokenizer.json, 49,152 ids)
    "bpe": "BPE token",  # a byte-level BPE of `Preset.vocab_size` ids trained on the training split (`train_bpe`)
}
"""The tokenizers a preset can use, with the unit its losses are in (nats per ...)."""
BPE_VOCAB_SIZE = 4096  # the "bpe" tokenizer's vocabulary when the preset does not set one (`--tokenizer bpe`)


def tokenizer_path(data_dir: str | None) -> Path:
    """SmolLM2's `tokenizer.json`: in `data_dir` when given (see `prepare_data`), else the demo's cached HF copy."""
    if data_dir is not None:
        return Path(data_dir) / TOKENIZER_FILE
    from attnres_hf.demo import smollm2_hf_folder

    return smollm2_hf_folder() / TOKENIZER_FILE


_BPE = {}


def train_bpe(vocab_size: int, max_chars_per_book: int | None):
    """A byte-level BPE tokenizer (GPT-2 style, as SmolLM2's) of `vocab_size` ids, `<|endoftext|>` id 0, trained
    with `tokenizers` on the paragraphs of the training split only (the held-out text never shapes the vocabulary);
    deterministic, a few seconds, kept per process."""
    key = (vocab_size, max_chars_per_book)
    if key not in _BPE:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        text = assets.text_split("train", max_chars_per_book=max_chars_per_book)
        tokenizer.train_from_iterator((p for p in text.split("\n\n") if p.strip()), trainer=trainer)
        _BPE[key] = tokenizer
    return _BPE[key]


def load_data(split: str, preset: Preset, data_dir: str | None = None) -> torch.Tensor:
    """The split as one int64 token stream: bytes, or SmolLM2 BPE ids (`tokenizers`, no transformers needed).
    `data_dir` (a folder written by `prepare_data`) holds the books and the tokenizer, for a machine without
    the cache or a network; it is read as the `attnres_hf.assets` cache (`ATTNRES_HF_CACHE`)."""
    if data_dir is not None:
        if not (Path(data_dir) / "gutenberg").is_dir():
            raise FileNotFoundError(f"{data_dir}/gutenberg/ not found: write the folder with --prepare-data")
        os.environ["ATTNRES_HF_CACHE"] = str(data_dir)
    if preset.tokenizer == "bytes":
        return load_bytes(split, preset.max_chars_per_book)
    if preset.tokenizer == "bpe":
        tokenizer = train_bpe(preset.vocab_size, preset.max_chars_per_book)
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_path(data_dir)))
    text = assets.text_split(split, max_chars_per_book=preset.max_chars_per_book)
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    separator = [tokenizer.token_to_id("<|endoftext|>") or 0]
    ids = [i for encoding in tokenizer.encode_batch(paragraphs) for i in encoding.ids + separator]
    return torch.tensor(ids, dtype=torch.long)


def prepare_data(data_dir: str | Path) -> Path:
    """Copy SmolLM2's tokenizer and the books into `data_dir` (`tokenizer.json`, `gutenberg/*.txt`): everything
    `--data-dir` needs on a machine without the cache or a network."""
    data_dir = Path(data_dir)
    (data_dir / "gutenberg").mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_path(None), data_dir / TOKENIZER_FILE)
    for book in sorted(assets.gutenberg_dir().glob("*.txt")):
        shutil.copy(book, data_dir / "gutenberg" / book.name)
    return data_dir


def _config(preset: Preset, overrides: dict) -> AttnResConfig:
    if preset.backbone == "kimi_linear":
        return AttnResConfig(backbone=kimi_linear_backbone(preset), attn_implementation="sdpa", **overrides)
    return AttnResConfig(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size, intermediate_size=8 * preset.hidden_size // 3,
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


def autocast(device):
    """bf16 autocast on CUDA (weights, optimizer state and the loss reduction stay fp32); nothing on CPU."""
    device = torch.device(device)
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, preset: Preset, device) -> float:
    model.eval()
    with autocast(device):
        losses = [model(batch.to(device), labels=batch.to(device)).loss.item()
                  for batch in batches(data, preset, preset.eval_batches, seed=12345)]
    model.train()
    return sum(losses) / len(losses)


def optimizer_and_schedule(model, preset: Preset):
    """AdamW (betas 0.9/0.95, no weight decay) at `preset.learning_rate`: linear warm-up over 5% of the steps,
    then cosine to 10%; the same for every variant (step the schedule once per optimizer step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, preset.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / preset.steps)))))
    return optimizer, schedule


def train_one(preset, overrides, seed, train_data, val_data, device, progress) -> dict:
    """Train one variant from scratch; `progress(loss)` is called after every step."""
    model = build_model(preset, overrides, seed).to(device).train()
    optimizer, schedule = optimizer_and_schedule(model, preset)
    start, last_loss = time.perf_counter(), float("nan")
    for batch in batches(train_data, preset, preset.steps, seed=seed):
        batch = batch.to(device)
        with autocast(device):
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


def _worker_init(preset, device, updates, train, val, parent):
    torch.set_num_threads(1)  # one core per run: no thread oversubscription when runs share the cores
    torch.set_flush_denormal(True)
    torch.backends.cuda.matmul.allow_tf32 = True  # what autocast leaves in fp32
    _WORKER.update(preset=preset, device=torch.device(device), updates=updates, train=train, val=val)

    def exit_with_the_parent():  # the benchmark was stopped (killed): do not train on, or wait, as an orphan
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_the_parent, daemon=True).start()


def _worker_run(name, seed):
    w = _WORKER

    def progress(loss):
        w["updates"].put((name, seed, loss))

    result = train_one(w["preset"], VARIANTS[name].overrides, seed, w["train"], w["val"], w["device"], progress)
    return name, seed, result


def run_all(names, preset, device, train_data, val_data, on_result=None) -> dict:
    """Every (variant, seed) run, in this process or in `preset.jobs` worker processes, with one progress bar;
    `on_result(name, seed, result)` is called as each run finishes."""
    runs = [(name, seed) for name in names for seed in range(preset.seeds)]
    results = {name: [None] * preset.seeds for name in names}
    with tqdm(total=len(runs) * preset.steps, unit="step", desc="ablation") as bar:
        if preset.jobs <= 1:
            for name, seed in runs:
                bar.set_description(f"{name} seed {seed}")
                results[name][seed] = train_one(
                    preset, VARIANTS[name].overrides, seed, train_data, val_data, device,
                    lambda loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}")))
                if on_result is not None:
                    on_result(name, seed, results[name][seed])
            return results
        context = multiprocessing.get_context("spawn")
        updates = context.Queue()  # handed to the workers as they start (no manager process to orphan)
        with ProcessPoolExecutor(preset.jobs, mp_context=context, initializer=_worker_init,
                                 initargs=(preset, str(device), updates, train_data, val_data, os.getpid())) as pool:
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
                    if on_result is not None:
                        on_result(name, seed, result)
    return results


_T_975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
          2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
          2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (6 decimals; a table up to 30, then the
    Cornish-Fisher expansion, within 1e-4): no scipy needed on the machine that runs the benchmark."""
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = 1.959963985
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_difference(losses: list[float], baseline: list[float]) -> tuple[float, float | None, float | None]:
    """Mean of the per-seed differences `losses[s] - baseline[s]` and its 95% t-interval `(mean, low, high)`.
    With one seed, or a non-finite loss (a diverged run), there is no interval: `(mean, None, None)`
    (`format_paired` prints it as such, JSON as null, and no verdict is drawn from it)."""
    diffs = [a - b for a, b in zip(losses, baseline, strict=True)]
    mean = statistics.mean(diffs)
    if len(diffs) < 2 or not all(math.isfinite(d) for d in diffs):
        return mean, None, None
    half = t_quantile_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def format_paired(difference: tuple[float, float | None, float | None], unit: str = "seed") -> str:
    """`paired_difference`'s result as `+0.0123 [-0.0040, +0.0286]`, or `+0.0123 [n/a (1 seed)]` without an
    interval (`unit` names the paired unit), or `n/a (a loss is not finite)`."""
    mean, low, high = difference
    if mean is None or not math.isfinite(mean):
        return "n/a (a loss is not finite)"
    if low is None:
        return f"{mean:+.4f} [n/a (1 {unit})]"
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"


def no_verdict(mean: float | None, unit: str = "seed") -> str:
    """Why a paired difference without an interval gets no verdict."""
    finite = mean is not None and math.isfinite(mean)
    return f"no verdict ({f'one {unit} gives no interval' if finite else 'a loss is not finite'})"


def paired_summary(difference: tuple[float, float | None, float | None]) -> dict:
    """`paired_difference`'s result for JSON: `{"mean", "low", "high"}`, null where there is no number (the bounds
    without an interval, the mean of a non-finite loss)."""
    mean, low, high = difference
    return {"mean": mean if math.isfinite(mean) else None, "low": low, "high": high}


def table(results: dict, baseline: str = "baseline", unit: str = "nats/byte") -> str:
    rows = [f"| variant | val loss ({unit}), mean ± std | paired Δ vs baseline [95% CI] | paper Table 4 (Δ) "
            "| params | s / run |", "|---|---|---|---|---|---|"]
    base = [r["val_loss"] for r in results[baseline]] if baseline in results else None
    paper_base = VARIANTS[baseline].paper if baseline in VARIANTS else None
    for name, runs in results.items():
        losses = [r["val_loss"] for r in runs]
        spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""  # no spread from one seed
        delta = "-"
        if base is not None and name != baseline:
            delta = format_paired(paired_difference(losses, base))
        variant = VARIANTS[name]
        paper = "not in Table 4"
        if variant.paper is not None:
            paper = f"{variant.paper:.3f}" + (f" ({variant.paper - paper_base:+.3f})" if paper_base is not None
                                               and name != baseline else "")
        if variant.paper_setting:
            paper += f"; {variant.paper_setting}"
        rows.append(f"| {name} | {statistics.mean(losses):.4f}{spread} (n={len(losses)}) | {delta} | {paper} | "
                    f"{runs[0]['parameters']:,} | {statistics.mean(r['seconds'] for r in runs):.0f} |")
    return "\n".join(rows)


def our_ordering(results: dict) -> str:
    """The variants with a paper value ranked by mean validation loss, best first; a variant whose loss is not finite
    (a diverged seed) has no rank: listed after the ranking (a NaN compares false with everything, so sorting it
    would scramble the rest)."""
    means = {name: statistics.mean(r["val_loss"] for r in runs) for name, runs in results.items()
             if VARIANTS[name].paper is not None}
    ranked = " < ".join(name for _, name in sorted((m, n) for n, m in means.items() if math.isfinite(m)))
    unranked = [name for name, mean in means.items() if not math.isfinite(mean)]
    return ranked + (f" (not ranked, a loss is not finite: {', '.join(unranked)})" if unranked else "")


PAPER_ORDERINGS = (
    # (claim, variant, reference, the paper's sign of variant minus reference: -1 better, +1 worse, 0 on par)
    ("Full AttnRes beats the baseline", "Full AttnRes", "baseline", -1),
    ("Block AttnRes beats the baseline", "Block AttnRes (S=2)", "baseline", -1),
    ("Full AttnRes beats Block AttnRes", "Full AttnRes", "Block AttnRes (S=2)", -1),
    ("softmax beats sigmoid scoring", "AttnRes w/ sigmoid", "Full AttnRes", +1),
    ("the key RMSNorm helps", "AttnRes w/o key RMSNorm", "Full AttnRes", +1),
    ("the sliding window is behind Full AttnRes", "AttnRes sliding window (W=2)", "Full AttnRes", +1),
    ("the sliding window is on par with the baseline", "AttnRes sliding window (W=2)", "baseline", 0),
    ("the sliding window (W=4) is behind Full AttnRes", "AttnRes sliding window (W=4)", "Full AttnRes", +1),
    ("the sliding window (W=4) is on par with the baseline", "AttnRes sliding window (W=4)", "baseline", 0),
    ("DenseFormer is on par with the baseline", "DenseFormer", "baseline", 0),
    ("mHC beats the baseline", "mHC (n=4)", "baseline", -1),
    ("mHC is behind Full AttnRes", "mHC (n=4)", "Full AttnRes", +1),
    ("the input-dependent query beats Full AttnRes", "AttnRes input-dependent query", "Full AttnRes", -1),
)
"""The paper's Table 4 orderings that the README checks (Kimi Team, arXiv:2603.15031: baseline 1.766, Full 1.737,
Block 1.746, sigmoid 1.741, w/o key norm 1.743, window 1.764, DenseFormer 1.767, mHC 1.747, input-dependent 1.731)."""


def ordering_checks(results: dict) -> list[dict]:
    """One entry per `PAPER_ORDERINGS` claim whose variants ran: `claim`, `variant`, `reference`, the paired
    difference (variant minus reference) `mean` with its 95% interval `low`, `high`, and `verdict`, whether this run
    recovers it. A strict ordering is recovered when the interval excludes 0 on the paper's side, "same sign, not
    significant" when only the mean is; "on par" claims are consistent when the interval contains 0 (a weak check: a
    short run has wide intervals). With one seed (or a non-finite loss) there is no interval: `low`, `high` and
    `verdict` are None.
    `format_ordering_check` prints an entry."""
    checks = []
    for claim, variant, reference, sign in PAPER_ORDERINGS:
        if variant not in results or reference not in results:
            continue
        mean, low, high = paired_difference([r["val_loss"] for r in results[variant]],
                                            [r["val_loss"] for r in results[reference]])
        if low is None:
            verdict = None
        elif sign == 0:
            verdict = "consistent (interval contains 0)" if low <= 0 <= high else "NOT recovered (interval excludes 0)"
        elif (high < 0) if sign < 0 else (low > 0):
            verdict = "recovered"
        elif mean * sign > 0:
            verdict = "same sign, not significant"
        else:
            verdict = "NOT recovered (opposite sign)" + (", significant" if (low > 0 or high < 0) else "")
        checks.append({"claim": claim, "variant": variant, "reference": reference,
                       **paired_summary((mean, low, high)), "verdict": verdict})
    return checks


def format_ordering_check(check: dict) -> str:
    """One line of the report for an `ordering_checks` entry."""
    verdict = check["verdict"] or no_verdict(check["mean"])
    return (f"- {check['claim']}: {check['variant']} minus {check['reference']} "
            f"{format_paired((check['mean'], check['low'], check['high']))}: {verdict}")


def report_text(results: dict, preset_name: str, preset: Preset, device, wall: float) -> str:
    """The report (Markdown): the table, both orderings, the paper's orderings checked, and what was run. Printed,
    written to `--out`'s results.md and (with how it was measured) to `--results`."""
    base_name = "baseline" if "baseline" in results else next(iter(results))
    tokens = preset.steps * preset.batch_size * preset.seq_len
    unit = TOKENIZERS[preset.tokenizer]
    device = torch.device(device)
    return "\n".join([
        table(results, baseline=base_name, unit=f"nats/{unit}"), "",
        f"- ordering, ours (mean val loss, best first): {our_ordering(results)}",
        f"- ordering, paper Table 4 (same variants):     {paper_ordering(results)}", "",
        "the paper's orderings, paired over seeds (variant minus reference, 95% t-interval):"
        + (" one seed gives no interval, so no verdicts (run --seeds 2 or more)" if preset.seeds < 2 else ""), "",
        *map(format_ordering_check, ordering_checks(results)), "",
        f"preset {preset_name} on {device}{' (bf16 autocast)' if device.type == 'cuda' else ' (fp32)'}: "
        f"{preset.num_hidden_layers} layers x {preset.hidden_size}, {tokens:,} training tokens per run, "
        f"{preset.seeds} seed{'s' if preset.seeds > 1 else ''}; wall time {wall / 60:.1f} min; same initial "
        "backbone, data order, token budget and "
        f"hyperparameters for every variant of a seed; the paper's Table 4 is a 16 + 16-layer model trained far "
        f"longer (nats per token of its tokenizer; ours: nats per {unit}), "
        f"so only orderings and signs can be "
        f"compared."])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="smoke")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", type=int, help="override the preset's number of seeds")
    parser.add_argument("--steps", type=int, help="override the preset's number of training steps")
    parser.add_argument("--jobs", type=int, help="override the preset's number of parallel runs (processes)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, help="override the preset's tokenizer")
    parser.add_argument("--output", help="write the per-run results as JSON here")
    parser.add_argument("--out", help="folder for results.json and results.md (the table and orderings)")
    parser.add_argument("--data-dir", help="folder written by --prepare-data (books and tokenizer), for a machine "
                                           "without the attnres-hf cache or a network")
    parser.add_argument("--prepare-data", metavar="DIR", help="copy the books and SmolLM2's tokenizer into DIR, exit")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the report (results.md's text), with how it was "
                        "measured, to PATH (a Markdown fragment, e.g. docs/results/ablation_long.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    if args.prepare_data:
        print(f"wrote {prepare_data(args.prepare_data)}: {TOKENIZER_FILE}, gutenberg/*.txt")
        return
    preset = PRESETS[args.preset]
    overrides = {k: v for k, v in (("seeds", args.seeds), ("steps", args.steps), ("jobs", args.jobs),
                                   ("tokenizer", args.tokenizer)) if v is not None}
    preset = Preset(**(asdict(preset) | overrides))
    if preset.tokenizer == "bpe" and preset.vocab_size <= 256 + 1:  # `--tokenizer bpe` on a byte-level preset
        preset = Preset(**(asdict(preset) | {"vocab_size": BPE_VOCAB_SIZE}))
    if args.data_dir is not None and not Path(args.data_dir, "gutenberg").is_dir():
        parser.error(f"--data-dir {args.data_dir} has no gutenberg/ folder: write it with --prepare-data")
    if (preset.tokenizer == "smollm2" and args.data_dir is not None
            and not Path(args.data_dir, TOKENIZER_FILE).is_file()):
        parser.error(f"--data-dir {args.data_dir} has no {TOKENIZER_FILE}: write it with --prepare-data")
    for name in ("seeds", "steps", "jobs"):
        if getattr(preset, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(preset, name)}")
    kept = [name for name in ("results.json", "runs.jsonl") if args.out and Path(args.out, name).exists()]
    if kept:
        parser.error(f"{args.out} already holds {', '.join(kept)}: choose another --out (results are not overwritten "
                     "or mixed with another run's)")
    if preset.tokenizer == "smollm2":
        from tokenizers import Tokenizer

        vocab_size = Tokenizer.from_file(str(tokenizer_path(args.data_dir))).get_vocab_size()
        preset = Preset(**(asdict(preset) | {"vocab_size": vocab_size}))
    if preset.threads:
        torch.set_num_threads(preset.threads)
    torch.set_flush_denormal(True)  # denormal floats (e.g. exp of very negative logits) slow CPUs many times over
    default = preset.variants or [name for name, variant in VARIANTS.items() if variant.default]
    names = list(default) if not args.variants else [n.strip() for n in args.variants.split(",")]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # CUDA: matmuls autocast leaves in fp32 use TF32
    train_data = load_data("train", preset, args.data_dir)
    val_data = load_data("held_out", preset, args.data_dir)
    tokens = preset.steps * preset.batch_size * preset.seq_len
    unit = TOKENIZERS[preset.tokenizer]
    bpe = train_bpe(preset.vocab_size, preset.max_chars_per_book) if preset.tokenizer == "bpe" else None
    if bpe is not None:
        preset = Preset(**(asdict(preset) | {"vocab_size": bpe.get_vocab_size()}))
    print(f"preset {args.preset}: {preset}")
    print(f"corpus: {len(train_data):,} training {unit}s, {len(val_data):,} held-out {unit}s ({assets.text_source()}"
          f"{'' if unit == 'byte' else f', {preset.vocab_size:,}-id {preset.tokenizer} tokenizer'}); "
          f"{tokens:,} training tokens per run; {len(names)} variants x {preset.seeds} seeds on {device}"
          f"{f', {preset.jobs} runs at a time' if preset.jobs > 1 else ''}")

    on_result = None
    if args.out:  # the tokenizer, and each run as it finishes (a stopped run keeps what it finished)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        if bpe is not None:
            bpe.save(str(Path(args.out, TOKENIZER_FILE)))

        def on_result(name, seed, result):
            with open(Path(args.out, "runs.jsonl"), "a") as handle:
                handle.write(json.dumps({"variant": name, "seed": seed, **result}) + "\n")

    start = time.perf_counter()
    results = run_all(names, preset, device, train_data, val_data, on_result)
    wall = time.perf_counter() - start
    base_name = "baseline" if "baseline" in results else names[0]
    checks = ordering_checks(results)
    paired = {name: paired_summary(paired_difference([r["val_loss"] for r in runs],
                                                     [r["val_loss"] for r in results[base_name]]))
              for name, runs in results.items() if name != base_name}
    report = report_text(results, args.preset, preset, device, wall)
    print()
    print(report)
    if args.results:
        measured.write(args.results, report, device=str(device))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.md").write_text(report + "\n")
        Path(args.out, "results.json").write_text(json.dumps(
            {"preset": asdict(preset), "device": str(device), "results": results, "wall_seconds": wall,
             "baseline": base_name, "paired_vs_baseline": paired, "orderings": checks}, indent=1))
        print(f"wrote {args.out}/results.md, results.json")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"preset": asdict(preset), "results": results, "wall_seconds": wall, "baseline": base_name,
                       "paired_vs_baseline": paired, "orderings": checks}, handle, indent=1)


if __name__ == "__main__":
    main()
