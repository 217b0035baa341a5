"""Should the pseudo-queries adapt in post-training? Supervised fine-tuning of a model whose routing was trained from
scratch, with LoRA without the routers, LoRA with them (at the adapters' rate and at Delta AttnRes's higher rate), and
full fine-tuning.

The base model is a Block AttnRes decoder trained from scratch here (`trained_routing.train_arm`: `ablation`'s
backbone, batches and schedule on the books of `attnres_hf.assets`, its 4,096-id BPE tokenizer trained on the
training split) at a shape the run's budget allows, 8 decoder layers x 128 (16 sub-layers, blocks of 4: 4 blocks +
the embedding = 5 sources, 17 routers), or loaded with `--base PATH` (e.g. `outputs/trained_routing/model`, the
16-layer model of `benchmarks/trained_routing.py`, which is saved with its tokenizer).

The instruction set is built offline from the same books, because the offline task pack (MMLU, ARC, HellaSwag, ...:
`attnres_hf.eval`) is far beyond a model of a few million parameters trained on under a million tokens: it would score
chance before and after any fine-tuning, so no arm could move it. Each item is a prompt and an answer about one
sentence of a book (6-20 words), in five kinds of question, the kinds in turn: four word-level ones, which need the
passage (the options are all words of it), and who wrote it, for the four books with a held-out part (the options are
the four authors; style and names give it away, so this is the kind a small model can learn fastest):

    Passage: <a sentence>
    Question: What is the first word? | What is the last word? | Which word comes after "X"? | ... before "X"?
              | Who wrote this?
    Answer: <the word, or the author's surname>

Training items come from the books' training split (the text the base was trained on, now as instructions), test
items from the held-out split (sentences the base never saw). The SFT loss is on the answer tokens only. Measured per
arm and seed, on the test items:

- held-out loss: the mean NLL (nats per token) of the answer's tokens;
- task accuracy: multiple choice by summed log-likelihood, the answer against three other words of the same passage
  (or the other three authors), chance 25%, per item;
- forgetting: the language-modelling NLL on held-out windows of the books;
- routing drift on the first `routing_items` test items: per router the entropy of the depth weights over
  `log(n_sources)` (1.0 = uniform), and the change of the depth weights from the base's, token by token on the same
  inputs (total variation, half the L1 distance: 0 = unchanged, 1 = disjoint), and the relative change of the
  routers' parameters (0 where they were frozen: LoRA then still moves the depth weights, through the sources it
  changes).

Arms (`ARMS`), all from the same base, with the same items in the same order for a seed, the same steps, warm-up and
schedule (`AttnResTrainer`, AdamW without weight decay, linear warm-up then cosine to 0, clip 1.0, fp32); a seed
sets the batch order and the LoRA adapters' initial values (the same in every LoRA arm of that seed). Learning
rates: the library's defaults (`training.DEFAULT_LEARNING_RATES`, what `attnres train --method lora|full` uses: LoRA
2e-4, full fine-tuning 5e-5) times `--lr-scale`, default 10 (LoRA 2e-3, full 5e-4), chosen before the recorded run
on 100-step runs of one seed, where x5's answer loss fell less than x10's in every arm (this small base was trained
from scratch at 2e-3; x1 was not tried); the routers train at the LoRA rate (no `router_learning_rate`: what
`attnres train --method lora` does) or at Delta AttnRes's 5e-3 (arXiv:2605.18855's router rate, not scaled:
`--router-learning-rate`); full fine-tuning trains them at its own rate. No rate was searched per arm. Paired
statistics (`ablation.paired_difference`, 95% t-interval): each arm minus the reference arm (LoRA, routers frozen)
over test items, an item's value the mean over seeds; the per-seed means beside them show the seed spread.

    python benchmarks/post_training_routing.py --smoke       # seconds: a tiny base, a few steps
    python benchmarks/post_training_routing.py --out outputs/post_training_routing \\
        --results docs/results/post_training_routing.md      # about half an hour on two cores
    python benchmarks/post_training_routing.py --base outputs/trained_routing/model   # trained_routing's model

Writes `post_training_routing.json` (every number, per item and per seed) and the base model with its tokenizer
(`base/`, unless loaded with `--base`) to `--out`; `--results PATH` writes the printed report, with how it was
measured, as a fragment for the docs (`benchmarks/_results.py`).
"""

import argparse
import json
import math
import multiprocessing
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import ablation  # noqa: E402  (the from-scratch training pieces and the paired statistics, one home)
import trained_routing  # noqa: E402  (the from-scratch Block AttnRes base and its routing measurements)
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)
from retrofit_routing import window_nll  # noqa: E402  (held-out windows and their NLL)

from attnres_hf import assets  # noqa: E402
from attnres_hf.analysis import record_routing  # noqa: E402
from attnres_hf.training import DEFAULT_LEARNING_RATES  # noqa: E402

DELTA_ROUTER_LR = 5e-3
"""Delta AttnRes's router learning rate (Luo, Cai, Hu, arXiv:2605.18855; `retrofit_recipes.BASE_LR["mixing"]`)."""


@dataclass(frozen=True)
class Arm:
    lora: bool  # LoRA adapters (`lora_config`) or every parameter
    routers: bool  # whether the depth routers train
    router_lr: float | None = None  # their own peak rate (`router_learning_rate`); None: the arm's rate


ARMS = {
    "LoRA, routers frozen": Arm(lora=True, routers=False),
    "LoRA + routers, base rate": Arm(lora=True, routers=True),
    "LoRA + routers, Delta rate": Arm(lora=True, routers=True, router_lr=DELTA_ROUTER_LR),
    "full fine-tuning": Arm(lora=False, routers=True),
}
REFERENCE = "LoRA, routers frozen"
BASE = "no fine-tuning (base)"
KINDS = ("first", "last", "after", "before", "book")
AUTHORS = {"austen-emma": "Austen", "carroll-alice": "Carroll", "chesterton-thursday": "Chesterton",
           "melville-moby_dick": "Melville"}
"""The books of the `book` question (`assets.HELD_OUT_BOOKS`, the books with a held-out part) and their authors, the
answers (surnames of a few tokens each: titles of one to five words would make summed log-likelihood favour the
shortest)."""
CHANCE = 0.25  # four options


@dataclass(frozen=True)
class Settings:
    base: trained_routing.Settings  # the base's pre-training (shape, batches, steps, tokenizer)
    steps: int  # SFT optimizer steps per run
    batch_size: int  # SFT items per step
    warmup: int  # SFT warm-up steps
    seeds: int
    train_items: int  # distinct training items (the runs draw `steps * batch_size` of them per seed)
    test_items: int
    routing_items: int  # test items whose routing is recorded
    book_tokens: int  # held-out book tokens of the forgetting check (windows of the base's seq_len)
    lora_r: int = 8
    lora_alpha: int = 16
    lr_scale: float = 10.0  # times the library's default rates (LoRA, full); not the Delta router rate
    router_lr: float = DELTA_ROUTER_LR
    jobs: int = 2  # SFT runs side by side (processes of one thread each); 1: in this process
    min_words: int = 6
    max_words: int = 20


REAL = Settings(trained_routing.Settings(
    ablation.Preset(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, seq_len=128, batch_size=16,
                    steps=400, seeds=1, learning_rate=2e-3, eval_batches=4, max_chars_per_book=None, jobs=1,
                    tokenizer="bpe", vocab_size=4096),
    block_size=4, eval_every=100, eval_tokens=4096, curve_sequences=4, bootstrap=0),
    steps=250, batch_size=16, warmup=15, seeds=3, train_items=4000, test_items=400, routing_items=48,
    book_tokens=8192)
SMOKE = Settings(trained_routing.Settings(
    ablation.Preset(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, seq_len=128, batch_size=4, steps=6,
                    seeds=1, learning_rate=3e-3, eval_batches=2, max_chars_per_book=20_000, jobs=1,
                    tokenizer="bpe", vocab_size=300),
    block_size=2, eval_every=3, eval_tokens=256, curve_sequences=2, bootstrap=0),
    steps=4, batch_size=4, warmup=1, seeds=2, train_items=32, test_items=24, routing_items=3, book_tokens=256,
    lora_r=2, lora_alpha=4, jobs=1)


# --- the instruction items -------------------------------------------------------------------------------------------

WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")  # letters and digits, inner apostrophes kept ("don't")


def sentences(text: str) -> list[str]:
    """The sentences of `text`: paragraphs (blank-line separated), whitespace collapsed, split after . ! or ?."""
    out = []
    for paragraph in text.split("\n\n"):
        paragraph = " ".join(paragraph.split())
        out += [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s]
    return out


def question(kind: str, words: list[str], rng: random.Random) -> tuple[str, str] | None:
    """`(question, answer)` of `kind` about `words`, or None when the passage has no unambiguous one."""
    if kind == "first":
        return "What is the first word?", words[0]
    if kind == "last":
        return "What is the last word?", words[-1]
    counts = {}
    for w in words:
        counts[w.lower()] = counts.get(w.lower(), 0) + 1
    step = 1 if kind == "after" else -1
    anchors = [i for i, w in enumerate(words) if counts[w.lower()] == 1 and 0 <= i + step < len(words)]
    if not anchors:
        return None
    i = rng.choice(anchors)
    return f'Which word comes {kind} "{words[i]}"?', words[i + step]


def book_part(book: str, split: str, max_chars: int | None) -> str:
    """`book`'s part of `split` as `assets.gutenberg_split` cuts it (its last 10% held out)."""
    text = (assets.gutenberg_dir() / f"{book}.txt").read_text(encoding="utf-8", errors="replace")
    cut = int(len(text) * 0.9)
    return (text[cut:] if split == "held_out" else text[:cut])[:max_chars]


def make_items(split: str, count: int, seed: int, settings: Settings) -> list[dict]:
    """Up to `count` items from the sentences of `split` (shuffled by `seed`), the kinds in turn: `prompt`,
    `answer`, `options`, `label` (the answer's index) and `kind`. A word question's options are the answer and three
    other distinct words of the passage; a `book` question's the four authors (`AUTHORS`), its passage a sentence of one
    of those books, the books in turn (without the books, on LAMBADA's passages, there is no `book` question)."""
    rng = random.Random(seed)
    max_chars = settings.base.preset.max_chars_per_book

    def usable(text):
        pool = [s for s in sentences(text) if settings.min_words <= len(WORD.findall(s)) <= settings.max_words]
        rng.shuffle(pool)
        return iter(pool)

    words_pool = usable(assets.text_split(split, max_chars_per_book=max_chars))
    books = {b: usable(book_part(b, split, max_chars)) for b in AUTHORS} if assets.books_available() else {}
    kinds = [k for k in KINDS if k != "book" or books]
    items = []
    while len(items) < count:
        kind = kinds[len(items) % len(kinds)]
        if kind == "book":
            book = list(books)[len(items) // len(kinds) % len(books)]
            sentence = next(books[book], None)
            if sentence is None:
                break
            options = list(AUTHORS.values())
            rng.shuffle(options)
            items.append({"prompt": f"Passage: {sentence}\nQuestion: Who wrote this?\nAnswer:",
                          "answer": AUTHORS[book], "options": options, "label": options.index(AUTHORS[book]),
                          "kind": kind})
            continue
        sentence = next(words_pool, None)
        if sentence is None:
            break
        words = WORD.findall(sentence)
        qa = question(kind, words, rng)
        if qa is None:
            continue
        ask, answer = qa
        others = list(dict.fromkeys(w for w in words if w.lower() != answer.lower()))
        if len(others) < 3:
            continue
        options = [answer, *rng.sample(others, 3)]
        rng.shuffle(options)
        items.append({"prompt": f"Passage: {sentence}\nQuestion: {ask}\nAnswer:", "answer": answer,
                      "options": options, "label": options.index(answer), "kind": kind})
    return items


def encode(tokenizer, item: dict, max_len: int) -> dict | None:
    """The item's token ids: the prompt's, and each option's (with its leading space); None when the longest option
    would not fit `max_len` positions."""
    prompt = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
    options = [tokenizer(" " + o, add_special_tokens=False)["input_ids"] for o in item["options"]]
    if len(prompt) + max(map(len, options)) > max_len:
        return None
    return {**item, "prompt_ids": prompt, "option_ids": options}


def book_ids(tokenizer, max_chars_per_book: int | None) -> torch.Tensor:
    """The held-out books as one token stream, paragraphs separated by the end-of-text id (as `ablation.load_data`)."""
    text = assets.text_split("held_out", max_chars_per_book=max_chars_per_book)
    separator = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    return torch.tensor([i for ids in tokenizer(paragraphs, add_special_tokens=False)["input_ids"]
                         for i in ids + separator])


def sft_example(item: dict) -> dict:
    """Prompt + answer, with the loss on the answer's tokens only."""
    answer = item["option_ids"][item["label"]]
    return {"input_ids": item["prompt_ids"] + answer, "labels": [-100] * len(item["prompt_ids"]) + answer}


def collate(examples: list[dict], pad_id: int = 0) -> dict:
    """Right-padded batch; padding is masked out of the attention and the loss."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(e["input_ids"]), torch.tensor(e["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


# --- measurements ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def score_items(model, items: list[dict], batch_size: int = 64) -> dict:
    """Per item: `correct` (the answer has the highest summed log-likelihood of the four options) and `nll` (the
    answer's mean NLL per token, the SFT loss on a held-out item)."""
    model.eval()
    rows = [(i, k, item["prompt_ids"] + option, len(item["prompt_ids"]))
            for i, item in enumerate(items) for k, option in enumerate(item["option_ids"])]
    logp = np.zeros((len(items), 4))
    tokens = np.zeros((len(items), 4))
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = collate([{"input_ids": ids, "labels": ids} for _, _, ids, _ in chunk])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        log_probs = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, vocab): position t predicts token t+1
        for row, (i, k, ids, n_prompt) in enumerate(chunk):
            target = torch.tensor(ids[n_prompt:])
            logp[i, k] = log_probs[row, n_prompt - 1:len(ids) - 1].gather(-1, target[:, None]).sum().item()
            tokens[i, k] = len(target)
    labels = np.array([item["label"] for item in items])
    picked = np.arange(len(items)), labels
    return {"correct": (logp.argmax(1) == labels).astype(float).tolist(),
            "nll": (-logp[picked] / tokens[picked]).tolist()}


def routing_weights(model, items: list[dict]) -> list[np.ndarray]:
    """Per item, the depth weights `(n_routers, seq_len, n_sources)` on prompt + answer (NaN where a router cannot
    read a source; `analysis.record_routing`)."""
    model.eval()
    return [record_routing(model, torch.tensor(it["prompt_ids"] + it["option_ids"][it["label"]])).weights
            for it in items]


def entropy_ratio_per_router(weights: list[np.ndarray]) -> list[float | None]:
    """Per router, the token-mean entropy of its depth weights over `log(n_sources)` over every recorded token."""
    alpha = np.concatenate(weights, axis=1)  # (n_routers, tokens, n_sources)
    out = []
    for w in alpha:
        w = w[:, ~np.isnan(w[0])]
        n = w.shape[1]
        out.append(None if n < 2 else float(-(w * np.log(np.clip(w, 1e-12, None))).sum(-1).mean() / math.log(n)))
    return out


def weight_change(after: list[np.ndarray], before: list[np.ndarray]) -> list[float]:
    """Per router, the token-mean total variation `0.5 * sum_c |alpha_after - alpha_before|` on the same tokens."""
    a, b = np.concatenate(after, axis=1), np.concatenate(before, axis=1)
    return (0.5 * np.nansum(np.abs(a - b), axis=-1)).mean(axis=1).tolist()


def router_parameter_change(model, base_state: dict) -> float:
    """`||theta - theta_base|| / ||theta_base||` over every depth-mixing parameter (pseudo-queries, key norms)."""
    from attnres_hf.training.recipes import is_router_parameter

    moved = total = 0.0
    for name, param in model.state_dict().items():
        if is_router_parameter(name):
            moved += float((param.float() - base_state[name].float()).pow(2).sum())
            total += float(base_state[name].float().pow(2).sum())
    return math.sqrt(moved / total) if total else 0.0


def measure(model, test: list[dict], book: torch.Tensor, window: int, settings: Settings) -> dict:
    """Everything measured on one model: the items' scores, the book windows' NLL, the routing weights."""
    return {**score_items(model, test), "book_nll": window_nll(model, book, window),
            "routing": routing_weights(model, test[:settings.routing_items])}


# --- the base and the fine-tuning runs -------------------------------------------------------------------------------

def pretrain_base(settings: Settings, out: Path, log=print) -> tuple[Path, dict]:
    """Train the Block AttnRes base from scratch (`trained_routing.train_arm`) and save it with its tokenizer to
    `out/base`. Returns the folder and the training record (curve, seconds, parameters)."""
    preset = settings.base.preset
    train, val = ablation.load_data("train", preset), ablation.load_data("held_out", preset)
    tokenizer = trained_routing.hf_tokenizer(ablation.train_bpe(preset.vocab_size, preset.max_chars_per_book))
    log(f"base: {len(train):,} training and {len(val):,} held-out {len(tokenizer):,}-id BPE tokens; {preset.steps} "
        f"steps x {preset.batch_size} x {preset.seq_len} tokens")
    record = trained_routing.train_arm("Block AttnRes", settings.base, train, val, log=log)
    model = ablation.build_model(preset, trained_routing.overrides(settings.base, "Block AttnRes"), settings.base.seed)
    model.load_state_dict(record.pop("state_dict"))
    folder = out / "base"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, record


def fine_tune(base_dir: str, arm: str, seed: int, train_items: list[dict], settings: Settings, work: str) -> tuple:
    """One SFT run of `arm` from the base at `base_dir` with `AttnResTrainer`: the seed's items in a fixed order
    (sequential sampling, so every arm of a seed sees the same batches). Returns the fine-tuned model (LoRA merged
    into it) and the run's record."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainingArguments, set_seed

    from attnres_hf.training import AttnResTrainer, lora_config

    spec = ARMS[arm]
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    set_seed(seed)  # the LoRA adapters' initial values: the same in every LoRA arm of a seed
    if spec.lora:
        model = get_peft_model(model, lora_config(model, settings.lora_r, settings.lora_alpha, routers=spec.routers))
    else:
        model.requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    needed = settings.steps * settings.batch_size
    order = torch.randperm(len(train_items), generator=torch.Generator().manual_seed(seed)).tolist()
    data = [sft_example(train_items[i]) for i in (order * (needed // len(order) + 1))[:needed]]
    rate = DEFAULT_LEARNING_RATES["lora" if spec.lora else "full"] * settings.lr_scale
    args = TrainingArguments(
        output_dir=work, per_device_train_batch_size=settings.batch_size, max_steps=settings.steps,
        learning_rate=rate, warmup_steps=settings.warmup, lr_scheduler_type="cosine", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, train_sampling_strategy="sequential", seed=seed,
        logging_steps=max(settings.steps // 10, 1), save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = AttnResTrainer(model=model, args=args, train_dataset=data, data_collator=collate, entropy_batches=0,
                             router_learning_rate=settings.router_lr if spec.router_lr else None)
    trainer.remove_callback(PrinterCallback)  # the losses are kept in the record, not printed per log step
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if spec.lora:
        model = model.merge_and_unload()
    return model.eval(), {"trainable_parameters": trainable, "learning_rate": rate,
                          "router_learning_rate": (settings.router_lr if spec.router_lr else rate) if spec.routers
                          else None, "train_loss_log": losses, "seconds": round(seconds, 1)}


def run_one(base_dir: str, arm: str, seed: int, train_items, test, book, window: int, settings: Settings) -> dict:
    """`fine_tune` then `measure`, and the routers' parameter change; what a worker returns."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as work:
        model, record = fine_tune(base_dir, arm, seed, train_items, settings, work)
    base_state = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    return {"arm": arm, "seed": seed, **record, "router_change": router_parameter_change(model, base_state),
            **measure(model, test, book, window, settings)}


def _worker(*args):
    from transformers.utils import logging

    logging.disable_progress_bar()  # one "Loading weights" bar per load otherwise
    torch.set_num_threads(1)  # one core per run: two runs share two cores without oversubscription
    torch.set_flush_denormal(True)
    return run_one(*args)


def run_all(base_dir: Path, train_items, test, book, window: int, settings: Settings, log=print) -> list[dict]:
    """Every (arm, seed) run, seed-major, in `settings.jobs` processes (or here)."""
    runs = [(arm, seed) for seed in range(settings.seeds) for arm in ARMS]
    args = [(str(base_dir), arm, seed, train_items, test, book, window, settings) for arm, seed in runs]
    if settings.jobs <= 1:
        results = []
        for a in args:
            results.append(run_one(*a))
            log(f"  {a[1]} seed {a[2]}: accuracy {np.mean(results[-1]['correct']):.3f} ({results[-1]['seconds']} s)")
        return results
    with ProcessPoolExecutor(settings.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_worker, *a) for a in args]
        results = []
        for future in futures:
            results.append(future.result())
            r = results[-1]
            log(f"  {r['arm']} seed {r['seed']}: accuracy {np.mean(r['correct']):.3f} ({r['seconds']} s)")
        return results


# --- the analysis ----------------------------------------------------------------------------------------------------

def per_item_mean(runs: list[dict], key: str) -> list[float]:
    """An arm's per-item value averaged over its seeds (the paired unit is the item)."""
    return np.mean([r[key] for r in runs], axis=0).tolist()


def analyse(base: dict, runs: list[dict], test: list[dict]) -> dict:
    """Per arm: means, per-seed means, paired differences to `REFERENCE` and to the base over items (windows for the
    book NLL), accuracy by kind, and the routing drift per router (mean over seeds)."""
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    kinds = [item["kind"] for item in test]
    present = [k for k in KINDS if k in kinds]
    base_entropy = entropy_ratio_per_router(base["routing"])
    arms = {BASE: {"accuracy": float(np.mean(base["correct"])), "nll": float(np.mean(base["nll"])),
                   "book_nll": float(np.mean(base["book_nll"])), "entropy_ratio": base_entropy,
                   "accuracy_by_kind": {k: float(np.mean([c for c, kk in zip(base["correct"], kinds) if kk == k]))
                                        for k in present}}}
    for arm, rs in by_arm.items():
        row = {"trainable_parameters": rs[0]["trainable_parameters"], "learning_rate": rs[0]["learning_rate"],
               "router_learning_rate": rs[0]["router_learning_rate"], "seeds": len(rs),
               "seconds": float(np.mean([r["seconds"] for r in rs]))}
        for key in ("correct", "nll", "book_nll"):
            row[f"{key}_per_item"] = per_item_mean(rs, key)
            row[f"{key}_per_seed"] = [float(np.mean(r[key])) for r in rs]
        row["accuracy"], row["nll"] = float(np.mean(row["correct_per_item"])), float(np.mean(row["nll_per_item"]))
        row["book_nll"] = float(np.mean(row["book_nll_per_item"]))
        row["accuracy_by_kind"] = {k: float(np.mean([c for c, kk in zip(row["correct_per_item"], kinds) if kk == k]))
                                   for k in present}
        row["paired_vs_base"] = {
            "accuracy": ablation.paired_difference(row["correct_per_item"], base["correct"]),
            "nll": ablation.paired_difference(row["nll_per_item"], base["nll"]),
            "book_nll": ablation.paired_difference(row["book_nll_per_item"], base["book_nll"])}
        entropy = [entropy_ratio_per_router(r["routing"]) for r in rs]
        row["entropy_ratio"] = [None if v[0] is None else float(np.mean(v)) for v in zip(*entropy)]
        row["weight_change"] = np.mean([weight_change(r["routing"], base["routing"]) for r in rs], axis=0).tolist()
        row["router_change"] = float(np.mean([r["router_change"] for r in rs]))
        arms[arm] = row
    reference = arms[REFERENCE]
    for arm in ARMS:
        if arm != REFERENCE:
            arms[arm]["paired_vs_reference"] = {
                key: ablation.paired_difference(arms[arm][f"{key}_per_item"], reference[f"{key}_per_item"])
                for key in ("correct", "nll", "book_nll")}
    delta, plain = arms["LoRA + routers, Delta rate"], arms["LoRA + routers, base rate"]
    comparisons = {"LoRA + routers: Delta rate minus base rate": {
        key: ablation.paired_difference(delta[f"{key}_per_item"], plain[f"{key}_per_item"])
        for key in ("correct", "nll", "book_nll")}}
    return {"arms": arms, "comparisons": comparisons}


def run(settings: Settings, out: Path, base_dir: Path | None = None, log=print) -> dict:
    """The experiment: the base (trained, or loaded from `base_dir`), the items, every run, the analysis."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    results = {"settings": asdict(settings), "text": assets.text_source()}
    if base_dir is None:
        base_dir, results["base_training"] = pretrain_base(settings, out, log)
    results["base"] = str(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if getattr(model.config, "depth_mixing", None) != "attnres":
        raise ValueError(f"{base_dir} is not an AttnRes model (depth_mixing {model.config.depth_mixing!r})")
    max_len = model.config.max_position_embeddings
    window = min(max_len, 256)
    encoded = {}
    for split, count, seed in (("train", settings.train_items, 1), ("held_out", settings.test_items, 2)):
        items = [e for e in (encode(tokenizer, it, max_len) for it in make_items(split, count, seed, settings)) if e]
        if len(items) < min(count, 8):
            raise ValueError(f"only {len(items)} {split} items of {count} (the text has too few usable sentences)")
        encoded[split] = items
    train_items, test = encoded["train"], encoded["held_out"]
    book = book_ids(tokenizer, settings.base.preset.max_chars_per_book)[:settings.book_tokens]
    record = record_routing(model, torch.tensor(test[0]["prompt_ids"]))
    results["router_names"] = record.routers
    results["items"] = {"train": len(train_items), "test": len(test),
                        "example": (test[0]["prompt"] + " " + test[0]["answer"]).replace("\n", " / "),
                        "test_kinds": {k: sum(it["kind"] == k for it in test) for k in KINDS},
                        "base_parameters": sum(p.numel() for p in model.parameters()), "routers": len(record.routers),
                        "window": window, "shape": {k: getattr(model.config, k) for k in (
                            "num_hidden_layers", "hidden_size", "attnres_block_size", "vocab_size")}}
    log(f"{len(train_items)} training and {len(test)} test items; {len(ARMS)} arms x {settings.seeds} seeds of "
        f"{settings.steps} steps x {settings.batch_size} items")
    base = measure(model, test, book, window, settings)
    del model
    runs = run_all(base_dir, train_items, test, book, window, settings, log)
    results["runs"] = [{k: v for k, v in r.items() if k != "routing"} for r in runs]
    results["base_scores"] = {k: v for k, v in base.items() if k != "routing"}
    results |= analyse(base, runs, test)
    return results


# --- the report ------------------------------------------------------------------------------------------------------

def _paired(difference, scale: float = 1.0, digits: int = 4) -> str:
    mean, low, high = difference
    if low is None:
        return ablation.format_paired(difference, unit="item")
    return f"{scale * mean:+.{digits}f} [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"


def _verdict(difference) -> str:
    mean, low, high = difference
    if low is None:
        return "no interval"
    return "interval excludes 0" if low > 0 or high < 0 else "interval contains 0"


def report(results: dict) -> str:
    """The printed report (Markdown; what `--results` writes)."""
    s, arms, items = results["settings"], results["arms"], results["items"]
    p = s["base"]["preset"]
    shape = items["shape"]
    if "base_training" in results:
        curve = results["base_training"]["curve"]
        base_line = (f"Base: Block AttnRes trained from scratch here, {shape['num_hidden_layers']} decoder layers x "
                     f"hidden {shape['hidden_size']}, blocks of {shape['attnres_block_size']} sub-layers "
                     f"({items['routers']} routers), {shape['vocab_size']:,}-id BPE, {items['base_parameters']:,} "
                     f"parameters; {p['steps']} steps of {p['batch_size']} x {p['seq_len']} tokens of "
                     f"{results['text']} "
                     f"(AdamW lr {p['learning_rate']}, warm-up then cosine; `trained_routing.train_arm`), "
                     f"{results['base_training']['seconds'] / 60:.1f} min; held-out LM loss "
                     f"{curve['held_out_loss'][0]:.3f} → {curve['held_out_loss'][-1]:.3f} nats/token over training.")
    else:
        base_line = (f"Base: loaded from `{results['base']}` ({shape['num_hidden_layers']} decoder layers x hidden "
                     f"{shape['hidden_size']}, blocks of {shape['attnres_block_size']} sub-layers, {items['routers']} "
                     f"routers, {items['base_parameters']:,} parameters).")
    kinds = ", ".join(f"{n} {k}" for k, n in items["test_kinds"].items())
    ref = arms[REFERENCE]
    lines = [
        base_line, "",
        f"Task: questions about one sentence of the books, word-level (its first word, its last word, the word after / "
        f"before a quoted word) and who wrote it (four books: {', '.join(AUTHORS.values())}), e.g. "
        f"`{items['example']}`; {items['train']:,} training items from the training split, "
        f"{items['test']} test items from the held-out split ({kinds}); accuracy: four options by summed "
        f"log-likelihood, the answer against three other words of the passage or the other three authors (chance "
        f"{100 * CHANCE:.0f}%). SFT: "
        f"{s['steps']} steps of {s['batch_size']} items (loss on the answer only), {s['seeds']} "
        f"seed{'s' if s['seeds'] > 1 else ''} (batch order and LoRA initialisation; the same for every arm of a "
        f"seed), `AttnResTrainer` with AdamW (0.9/0.999, no weight decay), {s['warmup']} warm-up steps then cosine, "
        f"clip 1.0, fp32; learning rates: the library's "
        f"defaults x{s['lr_scale']:g} (LoRA {ref['learning_rate']:g}, full fine-tuning "
        f"{arms['full fine-tuning']['learning_rate']:g}), routers at the arm's rate or at Delta AttnRes's "
        f"{s['router_lr']:g}; LoRA rank {s['lora_r']}, alpha {s['lora_alpha']}, on every linear layer but the head.",
        "",
        f"Held-out: accuracy and answer NLL (nats per answer token) over the {items['test']} test items, LM NLL over "
        f"{s['book_tokens']:,} held-out book tokens in windows of {items['window']}; Δ: paired difference over items "
        f"(book: windows), an item's value the mean over seeds, 95% t-interval; accuracy in percentage points.", "",
        f"| arm | trainable params | router lr | accuracy % (per seed) | Δ accuracy vs {REFERENCE} | answer NLL "
        f"(per seed) | Δ answer NLL vs {REFERENCE} | book NLL, Δ vs base |",
        "|---|---|---|---|---|---|---|---|"]
    base = arms[BASE]
    lines.append(f"| {BASE} | 0 | - | {100 * base['accuracy']:.1f} | - | {base['nll']:.4f} | - | "
                 f"{base['book_nll']:.4f} |")
    for arm in ARMS:
        row = arms[arm]
        vs = row.get("paired_vs_reference")
        router_lr = "frozen" if row["router_learning_rate"] is None else f"{row['router_learning_rate']:g}"
        lines.append(
            f"| {arm} | {row['trainable_parameters']:,} | {router_lr} | {100 * row['accuracy']:.1f} "
            f"({' / '.join(f'{100 * v:.1f}' for v in row['correct_per_seed'])}) | "
            f"{'-' if vs is None else _paired(vs['correct'], 100, 1)} | {row['nll']:.4f} "
            f"({' / '.join(f'{v:.4f}' for v in row['nll_per_seed'])}) | {'-' if vs is None else _paired(vs['nll'])} | "
            f"{row['book_nll']:.4f}, {_paired(row['paired_vs_base']['book_nll'])} |")
    lines += ["", "Accuracy % by kind of question (mean over seeds):", "",
              "| arm | " + " | ".join(arms[BASE]["accuracy_by_kind"]) + " |",
              "|---" * (len(arms[BASE]["accuracy_by_kind"]) + 1) + "|"]
    for arm in (BASE, *ARMS):
        lines.append(f"| {arm} | " + " | ".join(f"{100 * v:.1f}" for v in arms[arm]["accuracy_by_kind"].values())
                     + " |")
    lines += ["", "Paired comparisons over items (95% t-interval):", ""]
    for arm in ARMS:
        if arm == REFERENCE:
            continue
        vs = arms[arm]["paired_vs_reference"]
        lines.append(f"- {arm} minus {REFERENCE}: accuracy {_paired(vs['correct'], 100, 1)} points "
                     f"({_verdict(vs['correct'])}), answer NLL {_paired(vs['nll'])} ({_verdict(vs['nll'])}), book "
                     f"NLL {_paired(vs['book_nll'])} ({_verdict(vs['book_nll'])})")
    for name, vs in results["comparisons"].items():
        lines.append(f"- {name}: accuracy {_paired(vs['correct'], 100, 1)} points ({_verdict(vs['correct'])}), "
                     f"answer NLL {_paired(vs['nll'])} ({_verdict(vs['nll'])}), book NLL {_paired(vs['book_nll'])} "
                     f"({_verdict(vs['book_nll'])})")
    for arm in ARMS:
        vs = arms[arm]["paired_vs_base"]
        lines.append(f"- {arm} minus {BASE}: accuracy {_paired(vs['accuracy'], 100, 1)} points "
                     f"({_verdict(vs['accuracy'])}), answer NLL {_paired(vs['nll'])} ({_verdict(vs['nll'])})")
    names = results["router_names"]
    multi = [i for i, v in enumerate(base["entropy_ratio"]) if v is not None]
    lines += ["", f"Routing drift on {s['routing_items']} test items (prompt + answer, every token; mean over seeds): "
              "router parameter change `‖θ − θ_base‖ / ‖θ_base‖` over the pseudo-queries and key norms; entropy / "
              "uniform (1.0 = uniform), mean over the routers with more than one source; depth-weight change: "
              "per router the token-mean total variation from the base's weights on the same tokens (0 = unchanged, "
              "1 = disjoint), mean and largest over routers:", "",
              "| arm | router parameter change | entropy / uniform | depth-weight change, mean | largest (router) |",
              "|---|---|---|---|---|",
              f"| {BASE} | - | {np.mean([base['entropy_ratio'][i] for i in multi]):.4f} | - | - |"]
    for arm in ARMS:
        row = arms[arm]
        change = row["weight_change"]
        top = int(np.argmax(change))
        lines.append(f"| {arm} | {row['router_change']:.4f} | "
                     f"{np.mean([row['entropy_ratio'][i] for i in multi]):.4f} | {np.mean(change):.4f} | "
                     f"{change[top]:.4f} ({names[top]}) |")
    lines += ["", "Per router: entropy / uniform of the base, then per arm entropy / uniform after and the "
              "depth-weight change (mean over seeds):", "",
              "| router | base | " + " | ".join(ARMS) + " |", "|---" * (len(ARMS) + 2) + "|"]
    for r, name in enumerate(names):
        cells = [f"{'-' if arms[a]['entropy_ratio'][r] is None else format(arms[a]['entropy_ratio'][r], '.3f')}, "
                 f"{arms[a]['weight_change'][r]:.4f}" for a in ARMS]
        entropy = "-" if base["entropy_ratio"][r] is None else f"{base['entropy_ratio'][r]:.3f}"
        lines.append(f"| {name} | {entropy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _json(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(type(value).__name__)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny base and a few steps (seconds)")
    parser.add_argument("--base", help="an AttnRes model folder with its tokenizer (e.g. outputs/trained_routing/"
                        "model) instead of training the base here")
    parser.add_argument("--base-steps", type=int, help="override the base's pre-training steps")
    parser.add_argument("--steps", type=int, help="override the SFT steps")
    parser.add_argument("--seeds", type=int, help="override the number of SFT seeds")
    parser.add_argument("--jobs", type=int, help="SFT runs side by side (processes of one thread); 1: in turn")
    parser.add_argument("--lr-scale", type=float, help="override the scale of the library's default rates")
    parser.add_argument("--router-learning-rate", type=float, help=f"override the Delta arm's router rate "
                        f"(default {DELTA_ROUTER_LR:g})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process (the base's training, "
                        "and the runs with --jobs 1)")
    parser.add_argument("--out", default="outputs/post_training_routing", help="folder for the base and the JSON")
    parser.add_argument("--results", metavar="PATH", type=results_path, help="also write the report, with how it "
                        "was measured, to PATH (a Markdown fragment, e.g. docs/results/post_training_routing.md)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    settings = SMOKE if args.smoke else REAL
    changes = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds), ("jobs", args.jobs),
                                 ("lr_scale", args.lr_scale), ("router_lr", args.router_learning_rate))
               if v is not None}
    if any(v <= 0 for v in [*changes.values(), args.threads]) or (args.base_steps is not None and args.base_steps < 1):
        parser.error("--steps, --seeds, --jobs, --threads, --base-steps and the rates must be positive")
    settings = replace(settings, **changes)
    if args.base_steps is not None:
        settings = replace(settings, base=replace(settings.base, preset=replace(settings.base.preset,
                                                                                steps=args.base_steps)))
    if args.base is not None and not Path(args.base, "config.json").is_file():
        parser.error(f"--base {args.base} is not a model folder (no config.json)")
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # one "Loading weights" bar per load otherwise
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        results = run(settings, Path(args.out), Path(args.base) if args.base else None,
                      log=lambda line: print(line, flush=True))
    finally:
        if bars:
            logging.enable_progress_bar()
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    results["command"] = measured.command
    (Path(args.out) / "post_training_routing.json").write_text(json.dumps(results, indent=1, default=_json) + "\n")
    text = report(results)
    print()
    print(text)
    print(f"\nwall time {results['wall_seconds'] / 60:.1f} min; wrote {args.out}/post_training_routing.json")
    if args.results:
        measured.write(args.results, text, notes=(
            f"The SFT runs ran {settings.jobs} at a time, one process of one thread each, on cores shared with other "
            "work (the load average says how much), so the times are not benchmarks." if settings.jobs > 1 else ""))
    return results


if __name__ == "__main__":
    main()
