"""The ablation benchmark's own logic: paired variants start from one backbone, and its statistics."""

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import transformers

from attnres_hf.conversion.convert import STREAMED_NEW_TOKENS

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
ABLATION = BENCHMARKS / "ablation.py"


def assert_results_fragment(path: Path, script: str, argv: list[str], printed: str) -> str:
    """`--results` wrote a docs fragment: no heading, a provenance paragraph (the command as given, the UTC date and
    wall time, the machine, the versions, the commit, the load), then exactly the text the benchmark printed; no
    temporary file left beside it. Returns the provenance paragraph."""
    sys.path.insert(0, str(BENCHMARKS))
    import _results

    fragment = path.read_text()
    provenance, body = fragment.split("\n\n", 1)
    assert provenance.startswith(f"Measured by `python benchmarks/{script} {shlex.join(argv)}` on "), provenance
    assert re.search(r" on \d{4}-\d\d-\d\d \d\d:\d\d UTC \(wall time [\d.]+ (s|min), [^)]*\), on ", provenance)
    assert f", {os.cpu_count()} cores (torch threads: " in provenance
    assert f" on {_results.cpu_model() or 'unknown CPU'}, " in provenance
    assert f"torch {torch.__version__}, transformers {transformers.__version__}; " in provenance
    assert re.search(r"; (commit [0-9a-f]{4,}( \+ local changes)?|no git commit \(not a checkout\)); ", provenance)
    assert re.search(r"load average (\d+\.\d\d|n/a) at the start, (\d+\.\d\d|n/a) at the end", provenance)
    digest = _results.body_digest(body)
    assert provenance.endswith(f"Running the command again replaces this file. Body digest {digest}.")
    assert "\n" not in provenance
    assert body.strip() == printed.strip() and body.strip() in printed
    assert not [line for line in fragment.splitlines() if line.startswith("#") or set(line) in ({"="}, {"-"})]
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []
    return provenance


def test_a_results_path_is_checked_before_the_run_and_recorded_from_the_root(tmp_path, monkeypatch):
    """`--results` that cannot take the fragment (empty, a folder, under a file, unwritable) is a usage error when the
    arguments are parsed; the recorded command names the path from the checkout's root, so it reruns from there."""
    sys.path.insert(0, str(BENCHMARKS))
    import _results

    (tmp_path / "a-file").write_text("x")
    (tmp_path / "locked").mkdir(mode=0o500)
    bad = {"": "an empty path", str(tmp_path): "is a folder", str(tmp_path / "a-file" / "x.md"): "is a file",
           str(tmp_path / "locked" / "x.md"): "not writable"}
    for value, says in bad.items():
        if says == "not writable" and os.access(tmp_path / "locked", os.W_OK):
            continue  # root writes anywhere
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            _results.results_path(value)
    assert _results.results_path(str(tmp_path / "new" / "x.md")) == tmp_path / "new" / "x.md"

    monkeypatch.setattr(_results, "ROOT", tmp_path)
    (tmp_path / "new").mkdir()
    monkeypatch.chdir(tmp_path / "new")
    command = _results.command_line
    assert command("x.py", ["--results", "x.md", "--n", "1"]) == "python benchmarks/x.py --results new/x.md --n 1"
    assert command("x.py", ["--results=../y.md"]) == "python benchmarks/x.py --results=y.md"
    assert command("x.py", ["--results", "/elsewhere/z.md"]) == "python benchmarks/x.py --results /elsewhere/z.md"


def test_a_results_fragment_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """`_results`: the command as given (quoted; torchrun's under torchrun), no commit outside a checkout, and an
    atomic write: a second run replaces the file, a failed write leaves the old one and no temporary file."""
    sys.path.insert(0, str(BENCHMARKS))
    import _results

    monkeypatch.setattr(_results, "ROOT", tmp_path)  # not a checkout
    run = _results.Run("benchmarks/x.py", ["--label", "two words"])
    assert run.command == "python benchmarks/x.py --label 'two words'" and run.commit is None
    path = tmp_path / "docs" / "results" / "x.md"
    run.write(path, "| a |\n|---|\n| 1 |\n")
    first = path.read_text()
    assert first.startswith("Measured by `python benchmarks/x.py --label 'two words'` on ") and "no git commit" in first
    assert first.endswith("\n\n| a |\n|---|\n| 1 |\n") and oct(path.stat().st_mode & 0o777) == "0o644"
    run.write(path, "| a |\n|---|\n| 2 |")
    assert path.read_text().endswith("| 2 |\n")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(_results.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        run.write(path, "| a |\n|---|\n| 3 |")
    assert path.read_text().endswith("| 2 |\n") and sorted(p.name for p in path.parent.iterdir()) == ["x.md"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _results.command_line("x.py", ["--layers", "8"]) == "torchrun --nproc-per-node 2 benchmarks/x.py --layers 8"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation_benchmark", ABLATION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["Full AttnRes", "mHC (n=4)", "MUDDFormer", "AttnRes input-dependent query"])
def test_every_variant_of_a_seed_starts_from_the_baselines_backbone(ablation, variant):
    preset = ablation.PRESETS["smoke"]
    baseline = ablation.build_model(preset, ablation.VARIANTS["baseline"].overrides, seed=3).state_dict()
    model = ablation.build_model(preset, ablation.VARIANTS[variant].overrides, seed=3).state_dict()
    other_seed = ablation.build_model(preset, ablation.VARIANTS["baseline"].overrides, seed=4).state_dict()
    assert set(baseline) <= set(model)
    for name, tensor in baseline.items():
        torch.testing.assert_close(model[name], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(other_seed["model.layers.0.self_attn.q_proj.weight"],
                           baseline["model.layers.0.self_attn.q_proj.weight"])


def test_paired_difference_and_its_interval(ablation):
    mean, low, high = ablation.paired_difference([1.0, 2.0, 3.5], [0.5, 1.5, 2.5])
    assert mean == pytest.approx(2 / 3)
    # differences 0.5, 0.5, 1.0: sd 0.288675, t(0.975, 2) = 4.302653
    half = 4.302653 * 0.288675 / math.sqrt(3)
    assert (low, high) == (pytest.approx(mean - half, abs=1e-5), pytest.approx(mean + half, abs=1e-5))
    assert ablation.paired_difference([1.0], [0.5]) == (0.5, None, None)  # one seed: no interval
    assert ablation.format_paired((mean, low, high)) == f"+0.6667 [{low:+.4f}, {high:+.4f}]"
    assert ablation.format_paired((0.5, None, None)) == "+0.5000 [n/a (1 seed)]"
    assert ablation.format_paired((-0.25, None, None), unit="window") == "-0.2500 [n/a (1 window)]"


def test_paper_column_is_table_4_and_its_ordering(ablation):
    assert ablation.VARIANTS["baseline"].paper == 1.766
    assert ablation.VARIANTS["AttnRes input-dependent query"].paper == 1.731
    assert ablation.VARIANTS["MUDDFormer"].paper is None
    assert ablation.paper_ordering(["baseline", "Full AttnRes", "MUDDFormer", "AttnRes input-dependent query"]) == (
        "AttnRes input-dependent query < Full AttnRes < baseline")


RETROFIT_ROUTING = Path(__file__).parents[1] / "benchmarks" / "retrofit_routing.py"


@pytest.fixture(scope="module")
def retrofit_routing():
    spec = importlib.util.spec_from_file_location("retrofit_routing_benchmark", RETROFIT_ROUTING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """One torch thread: on a loaded machine, two threads of a tiny model wait on each other (15x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_retrofit_routing_runs_every_arm_on_the_same_batches(retrofit_routing, tmp_path, one_thread, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils import TINY, counting_text, word_tokenizer

    torch.manual_seed(0)
    source = tmp_path / "source"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(source)
    tokenizer = word_tokenizer()
    pairs = [{"a": "w3 w4 w5 w6 w7 w8", "b": "w3 w9 w5 w6 w7 w8"}, {"a": "w10 w11 w12 w13", "b": "w10 w40 w12 w13"}]
    results = retrofit_routing.run(source, tokenizer, counting_text(60), counting_text(20, seed=1), tmp_path / "out",
                                   steps=4, batch_size=2, seq_len=16, learning_rate=1e-2, eval_every=2,
                                   eval_tokens=128, window=32, pairs=pairs, log=lambda line: None)
    ppl = results["perplexity"]
    assert list(ppl) == ["no training", "routers", "norms", "lora"] and ppl["no training"]["windows"] == 4
    arms = results["arms"]
    # every arm starts from the same function (the retrofit is exact; LoRA's B starts at zero)
    assert arms["routers"]["curve"]["held_out_loss"][0] == pytest.approx(arms["norms"]["curve"]["held_out_loss"][0])
    assert arms["lora"]["curve"]["held_out_loss"][0] == pytest.approx(arms["norms"]["curve"]["held_out_loss"][0])
    assert arms["routers"]["train_loss_per_step"][0] == pytest.approx(arms["lora"]["train_loss_per_step"][0])
    assert arms["routers"]["curve"]["step"] == [0, 2, 4]
    assert arms["routers"]["curve"]["depth_entropy_ratio"][0] == pytest.approx(1.0)
    assert arms["routers"]["curve"]["depth_entropy_ratio"][-1] < 1.0  # lr 1e-2 moves the routers
    assert arms["norms"]["curve"]["depth_entropy_ratio"] == [pytest.approx(1.0)] * 3  # routers stay uniform
    assert arms["routers"]["trainable_parameters"] == results["router_parameters"]
    assert arms["norms"]["trainable_parameters"] == 32 * (2 * TINY["num_hidden_layers"] + 1)
    assert arms["lora"]["trainable_parameters"] == results["lora"]["parameters"]
    assert 0.0 <= results["routing"]["static_share"] <= 1.0 and results["probe"]["pairs_used"] == 2
    assert (tmp_path / "out" / "routing_average.png").is_file()
    assert (tmp_path / "out" / "retrofit_routing.json").is_file()
    assert "| routers |" in retrofit_routing.report(results)
    # arms run side by side (separate processes and folders) merge into the same report
    for arm in ("routers", "norms"):
        retrofit_routing.run(source, tokenizer, counting_text(60), counting_text(20, seed=1), tmp_path / arm,
                             steps=4, batch_size=2, seq_len=16, learning_rate=1e-2, eval_every=2, eval_tokens=128,
                             window=32, arms=[arm], pairs=pairs, log=lambda line: None)
    merged = retrofit_routing.merge([tmp_path / "routers", tmp_path / "norms"])
    assert list(merged["perplexity"]) == ["no training", "routers", "norms"] and "probe" in merged
    for name in ("routers", "norms"):
        assert merged["perplexity"][name]["nll"] == pytest.approx(ppl[name]["nll"], rel=1e-5)
    assert merged["perplexity"]["norms"]["paired_delta_nll_vs_routers"] == pytest.approx(
        ppl["norms"]["paired_delta_nll_vs_routers"], rel=1e-4, abs=1e-6)
    # `--merge ... --results`: the merged report, printed and written as a docs fragment naming the merged runs
    capsys.readouterr()
    argv = ["--merge", str(tmp_path / "routers"), str(tmp_path / "norms"), "--out", str(tmp_path / "merged"),
            "--results", str(tmp_path / "docs" / "retrofit_routing.md")]
    retrofit_routing.main(argv)
    printed = capsys.readouterr().out
    assert printed.strip() == retrofit_routing.report(merged).strip()
    assert "| step | 0 | 2 | 4 |" in printed and "| depth entropy / uniform, routers |" in printed
    provenance = assert_results_fragment(tmp_path / "docs" / "retrofit_routing.md", "retrofit_routing.py", argv,
                                         printed)
    assert f"It merges the runs of separate arms: `{tmp_path / 'routers'}`; `{tmp_path / 'norms'}`;" in provenance


def test_matched_lora_picks_the_closest_parameter_count(retrofit_routing):
    from attnres_hf.conversion import retrofit
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils import TINY

    model = retrofit(LlamaForCausalLM(LlamaConfig(**TINY)))
    # TINY: q/o 32+32, k/v 32+16, gate/up 32+64, down 64+32 per layer, 3 layers
    rank, targets, count = retrofit_routing.matched_lora(model, target=3 * (64 + 48))
    assert count == 3 * (64 + 48) and rank == 1 and len(targets) == 2
    assert retrofit_routing.matched_lora(model, target=2 * 3 * 64)[2] == 2 * 3 * 64


def test_ablation_runs_with_a_bpe_tokenizer_from_a_data_dir(ablation, tmp_path, monkeypatch):
    """The long preset's code path (tokenizer.json and books from --data-dir, results under --out), tiny."""
    from attnres_hf import assets
    from utils import counting_text, word_tokenizer

    monkeypatch.setenv("ATTNRES_HF_CACHE", str(tmp_path / "elsewhere"))  # load_data points it at the data dir
    data = tmp_path / "data"
    (data / "gutenberg").mkdir(parents=True)
    word_tokenizer().backend_tokenizer.save(str(data / "tokenizer.json"))
    names = list(assets.HELD_OUT_BOOKS) + [f"book-{i}" for i in range(14)]
    for i, name in enumerate(names):
        (data / "gutenberg" / f"{name}.txt").write_text(counting_text(30, seed=i).replace("\n", "\n\n"))
    out = tmp_path / "out"
    ablation.main(["--preset", "smoke", "--tokenizer", "smollm2", "--data-dir", str(data), "--out", str(out),
                   "--variants", "baseline,Full AttnRes", "--steps", "3", "--seeds", "2"])
    results = json.loads((out / "results.json").read_text())
    assert results["preset"]["tokenizer"] == "smollm2" and results["preset"]["vocab_size"] == 99
    assert set(results["results"]) == {"baseline", "Full AttnRes"} and len(results["results"]["baseline"]) == 2
    report = (out / "results.md").read_text()
    assert "nats/SmolLM2 token" in report and "| Full AttnRes |" in report and "ordering, paper Table 4" in report
    preset = ablation.Preset(**{**ablation.asdict(ablation.PRESETS["smoke"]), "tokenizer": "smollm2"})
    train = ablation.load_data("train", preset, str(data))
    assert int(train.max()) < 99 and float((train >= 3).float().mean()) > 0.9  # word ids (and separators)
    with pytest.raises(SystemExit):
        ablation.main(["--preset", "smoke", "--data-dir", str(tmp_path / "missing")])


def test_ablation_trains_its_bpe_tokenizer_on_the_training_split(ablation, tmp_path, monkeypatch):
    """The long preset's tokenizer: a byte-level BPE trained on the training split only, saved under --out with
    each finished run (runs.jsonl); an --out that holds results is refused before anything trains."""
    from attnres_hf import assets
    from utils import counting_text

    data = tmp_path / "data"
    (data / "gutenberg").mkdir(parents=True)
    names = list(assets.HELD_OUT_BOOKS) + [f"book-{i}" for i in range(14)]
    for i, name in enumerate(names):
        (data / "gutenberg" / f"{name}.txt").write_text(counting_text(30, seed=i).replace("\n", "\n\n"))
    monkeypatch.setenv("ATTNRES_HF_CACHE", str(data))
    preset = ablation.Preset(**{**ablation.asdict(ablation.PRESETS["smoke"]), "tokenizer": "bpe", "vocab_size": 300})
    bpe = ablation.train_bpe(300, preset.max_chars_per_book)
    assert 257 < bpe.get_vocab_size() <= 300 and bpe.token_to_id("<|endoftext|>") == 0
    held_out = assets.text_split("held_out", max_chars_per_book=preset.max_chars_per_book)
    train_text = assets.text_split("train", max_chars_per_book=preset.max_chars_per_book)
    ids = ablation.load_data("held_out", preset)
    assert int(ids.max()) < bpe.get_vocab_size() and len(ids) < len(held_out.encode()) / 1.5  # merges apply
    assert bpe.decode(bpe.encode(held_out[:500]).ids) == held_out[:500]  # byte-level: lossless on any text
    assert ablation.train_bpe(300, preset.max_chars_per_book) is bpe and train_text != held_out

    out = tmp_path / "out"
    argv = ["--preset", "smoke", "--tokenizer", "bpe", "--out", str(out), "--variants", "baseline,Block AttnRes (S=2)",
            "--steps", "2", "--seeds", "2"]
    ablation.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["preset"]["tokenizer"] == "bpe" and 257 < results["preset"]["vocab_size"] <= 4096
    assert "nats/BPE token" in (out / "results.md").read_text() and (out / "tokenizer.json").is_file()
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted((r["variant"], r["seed"]) for r in runs) == sorted(
        (v, s) for v in ("baseline", "Block AttnRes (S=2)") for s in range(2))
    before = (out / "results.json").read_text()
    with pytest.raises(SystemExit):
        ablation.main(argv)
    assert (out / "results.json").read_text() == before


@pytest.mark.parametrize("df, expected", [(1, 12.706205), (2, 4.302653), (9, 2.262157), (30, 2.042272),
                                          (31, 2.039513), (60, 2.000298), (1000, 1.962339)])
def test_t_quantile_matches_students_t(ablation, df, expected):
    assert ablation.t_quantile_975(df) == pytest.approx(expected, abs=1e-4)


SYNTHETIC = Path(__file__).parents[1] / "benchmarks" / "structured_vs_memorisation.py"


@pytest.fixture(scope="module")
def synthetic():
    spec = importlib.util.spec_from_file_location("structured_vs_memorisation_benchmark", SYNTHETIC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recall_labels_are_the_values_of_keys_seen_before(synthetic, seed):
    input_ids, labels = synthetic.recall_batch(torch.Generator().manual_seed(seed), 8, pairs=12, keys=4)
    assert input_ids.shape == labels.shape == (8, 24) and int(input_ids.max()) < 256
    for row, label in zip(input_ids.tolist(), labels.tolist()):
        table = {}
        for i in range(0, 24, 2):
            key, value = row[i], row[i + 1]
            assert synthetic.KEY <= key < synthetic.VALUE <= value < synthetic.LABEL and label[i] == synthetic.IGNORE
            assert table.setdefault(key, value) == value  # one value per key within a sequence
            assert label[i + 1] == (value if key in row[:i:2] else synthetic.IGNORE)
        assert len(table) <= 4
    assert (labels != synthetic.IGNORE).any()


def test_memorisation_table_is_fixed_per_seed_and_its_labels_ignore_the_input(synthetic):
    inputs, labels = synthetic.memorisation_table(512, seed=3)
    again, _ = synthetic.memorisation_table(512, seed=3)
    other, _ = synthetic.memorisation_table(512, seed=4)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    assert len({tuple(r) for r in inputs[:, :2].tolist()}) == 512  # distinct inputs
    assert (labels[:, :2] == synthetic.IGNORE).all() and torch.equal(labels[:, 2], inputs[:, 2])
    assert len(set(inputs[:, 2].tolist())) > 48  # labels spread over the 64 classes
    with pytest.raises(ValueError, match="items"):
        synthetic.memorisation_table(5000, seed=0)


def test_structured_vs_memorisation_runs_and_pairs_its_variants(synthetic, tmp_path, capsys):
    argv = ["--seeds", "2", "--steps", "3", "--batch-size", "8", "--items", "64", "--output",
            str(tmp_path / "synthetic.json"), "--results", str(tmp_path / "docs" / "synthetic.md")]
    synthetic.main(argv)
    results = json.loads((tmp_path / "synthetic.json").read_text())["results"]
    assert list(results) == list(synthetic.TASKS)
    for task in synthetic.TASKS:
        assert list(results[task]) == list(synthetic.MODELS)
        for runs in results[task].values():
            assert len(runs) == 2 and all(math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in runs)
    text = synthetic.table(results)
    assert text.count("| recall |") == 3 and "verdict" in text
    printed = capsys.readouterr().out
    assert text in printed
    # --results: the model line and the table, as printed at the end, with how they were measured
    final = printed[printed.rindex("model: 4 layers x 64"):printed.rindex("\nwall time")]
    assert final.rstrip().endswith(text)
    assert_results_fragment(tmp_path / "docs" / "synthetic.md", "structured_vs_memorisation.py", argv, final)


def test_ordering_checks_judge_each_claim_by_its_paired_interval(ablation):
    def runs(*losses):
        return [{"val_loss": x} for x in losses]

    results = {"baseline": runs(2.0, 2.1, 2.2), "Full AttnRes": runs(1.9, 2.0, 2.1),  # -0.1 every seed
               "Block AttnRes (S=2)": runs(1.95, 2.15, 2.15),  # mean -0.0167, interval contains 0
               "DenseFormer": runs(2.0, 2.1, 2.2),  # on par
               "mHC (n=4)": runs(2.1, 2.2, 2.3)}  # +0.1 every seed: worse than the baseline
    lines = "\n".join(map(ablation.format_ordering_check, ablation.ordering_checks(results)))
    assert "Full AttnRes beats the baseline: Full AttnRes minus baseline -0.1000" in lines
    assert "beats the baseline: Full AttnRes minus baseline -0.1000 [-0.1000, -0.1000]: recovered" in lines
    assert "Block AttnRes beats the baseline: Block AttnRes (S=2) minus baseline -0.0167" in lines
    assert "same sign, not significant" in lines
    assert "DenseFormer is on par with the baseline: DenseFormer minus baseline +0.0000 [+0.0000, +0.0000]: " \
           "consistent" in lines
    assert "mHC beats the baseline: mHC (n=4) minus baseline +0.1000 [+0.1000, +0.1000]: NOT recovered " \
           "(opposite sign), significant" in lines
    assert "sigmoid" not in lines  # claims whose variants did not run are left out


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--steps", "-1"], "--steps must be at least 1, got -1"),
    (["--seeds", "0"], "--seeds must be at least 1, got 0"),
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--out", "KEPT"], "already holds runs.jsonl"),
])
def test_ablation_refuses_empty_budgets_and_a_folder_with_runs(ablation, argv, says, tmp_path, capsys):
    """Were a ZeroDivisionError (`--steps 0`), a StatisticsError (`--seeds 0`), a table for untrained models
    (`--steps -1`), or new runs appended to a killed run's `runs.jsonl`: now parser errors before anything trains."""
    (tmp_path / "runs.jsonl").write_text('{"variant": "baseline", "seed": 0, "val_loss": 1.0}\n')
    argv = [str(tmp_path) if a == "KEPT" else a for a in argv]
    with pytest.raises(SystemExit):
        ablation.main(["--preset", "smoke", *argv])
    assert says in capsys.readouterr().err
    assert (tmp_path / "runs.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("seeds", [1, 2])
def test_ordering_checks_draw_no_verdict_without_an_interval(ablation, seeds):
    """One seed gives a paired difference but no interval: no verdict, and None (JSON null) bounds, never NaN."""
    losses = {"baseline": [2.0, 2.1], "Full AttnRes": [1.9, 2.05], "DenseFormer": [2.3, 2.4], "mHC (n=4)": [2.0, 2.2]}
    results = {name: [{"val_loss": x, "parameters": 1, "seconds": 1.0} for x in values[:seeds]]
               for name, values in losses.items()}
    checks = ablation.ordering_checks(results)
    assert {c["claim"] for c in checks} == {"Full AttnRes beats the baseline", "mHC beats the baseline",
                                            "DenseFormer is on par with the baseline", "mHC is behind Full AttnRes"}
    for check in checks:
        line = ablation.format_ordering_check(check)
        if seeds == 1:
            assert check["low"] is check["high"] is check["verdict"] is None
            assert "[n/a (1 seed)]: no verdict (one seed gives no interval)" in line
            assert not any(word in line for word in ("recovered", "consistent", "nan"))
        else:
            assert check["verdict"] and math.isfinite(check["low"]) and math.isfinite(check["high"])
    json.loads(json.dumps(checks, allow_nan=False))
    assert ablation.format_paired(ablation.paired_difference([1.0], [0.5])) == "+0.5000 [n/a (1 seed)]"
    text = ablation.table(results)
    rows = [row for row in text.splitlines() if row.startswith("| Full AttnRes |")]
    assert ("-0.1000 [n/a (1 seed)]" in rows[0]) == (seeds == 1) and "nan" not in text
    assert (" ± " in rows[0]) == (seeds > 1)  # no spread from one seed


def test_ablation_with_one_seed_reports_no_interval_and_no_verdict(ablation, tmp_path, capsys):
    """`--seeds 1` end to end: the paired difference with `[n/a (1 seed)]` in the printed table and results.md,
    null bounds and verdicts in results.json (strict JSON), and no verdict on any ordering; `--results` writes the
    same report as a docs fragment."""
    out = tmp_path / "out"
    argv = ["--preset", "smoke", "--out", str(out), "--variants", "baseline,Full AttnRes,DenseFormer",
            "--steps", "1", "--seeds", "1", "--jobs", "1", "--results", str(tmp_path / "docs" / "ablation.md")]
    ablation.main(argv)
    printed = capsys.readouterr().out
    report = (out / "results.md").read_text()
    assert report.strip() in printed
    # --results: the same report, with how it was measured (a Markdown fragment for the docs)
    assert_results_fragment(tmp_path / "docs" / "ablation.md", "ablation.py", argv, report)
    for text in (printed, report):
        assert "nan" not in text.lower() and "recovered" not in text and "consistent" not in text
        assert text.count("[n/a (1 seed)]") == 2 + 2  # two table rows, two orderings
        assert "one seed gives no interval, so no verdicts" in text
    results = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert set(results["paired_vs_baseline"]) == {"Full AttnRes", "DenseFormer"}
    for entry in [*results["paired_vs_baseline"].values(), *results["orderings"]]:
        assert math.isfinite(entry["mean"]) and entry["low"] is None and entry["high"] is None
    assert [o["verdict"] for o in results["orderings"]] == [None, None]


def test_a_diverged_run_gives_no_interval_and_no_verdict(ablation, synthetic):
    """A non-finite loss (a diverged seed) makes no interval: was a [nan, nan] judged 'NOT recovered'."""
    results = {"baseline": [{"val_loss": 2.0}, {"val_loss": 2.1}],
               "Full AttnRes": [{"val_loss": math.nan}, {"val_loss": 2.05}],
               "DenseFormer": [{"val_loss": math.inf}, {"val_loss": 2.05}]}
    for name in ("Full AttnRes", "DenseFormer"):
        mean, low, high = ablation.paired_difference([r["val_loss"] for r in results[name]],
                                                     [r["val_loss"] for r in results["baseline"]])
        assert low is None and high is None and not math.isfinite(mean)
        assert ablation.format_paired((mean, low, high)) == "n/a (a loss is not finite)"
        assert synthetic.verdict(mean, low, high) == "no verdict (a loss is not finite)"
    checks = ablation.ordering_checks(results)
    assert [c["verdict"] for c in checks] == [None, None] and all(c["mean"] is None for c in checks)
    json.loads(json.dumps(checks, allow_nan=False))
    assert [ablation.format_ordering_check(c).split(": ", 1)[1] for c in checks] == [
        "Full AttnRes minus baseline n/a (a loss is not finite): no verdict (a loss is not finite)",
        "DenseFormer minus baseline n/a (a loss is not finite): no verdict (a loss is not finite)"]


@pytest.mark.parametrize("diverged", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_our_ordering_ranks_finite_losses_and_names_diverged_variants_apart(ablation, diverged):
    """A NaN mean compares false with everything: sorted among the others it scrambled the ranking of the rest."""
    losses = {"baseline": [2.0, 2.1], "Full AttnRes": [diverged, 1.8], "DenseFormer": [2.3, 2.3],
              "Block AttnRes (S=2)": [1.9, 1.9], "mHC (n=4)": [2.2, 2.2]}
    results = {name: [{"val_loss": x} for x in values] for name, values in losses.items()}
    assert ablation.our_ordering(results) == ("Block AttnRes (S=2) < baseline < mHC (n=4) < DenseFormer (not ranked, "
                                              "a loss is not finite: Full AttnRes)")
    results["Full AttnRes"] = [{"val_loss": 1.8}]
    assert ablation.our_ordering(results) == "Full AttnRes < Block AttnRes (S=2) < baseline < mHC (n=4) < DenseFormer"


@pytest.mark.slow  # about 7 s
def test_fla_interop_measures_a_case_and_its_round_trip(tmp_path):
    """benchmarks/fla_interop.py on one case (Full AttnRes): fp32 delta within the report's bound, the round trip bit
    for bit, and the table's verdict line."""
    pytest.importorskip("fla")
    sys.path.insert(0, str(BENCHMARKS))
    import fla_interop

    row = fla_interop.measure(*fla_interop.CASES[0], tmp_path, seed=0)
    assert row["exact"] and row["relative"] <= 1e-4 and row["round_trip"] is True
    assert row["ours_bf16"] > 0 and row["fla_bf16"] > 0
    text = fla_interop.table([row])
    assert "| Full | 3 | 1 |" in text and "bit for bit" in text and "Worst fp32 case" in text


@pytest.mark.slow  # about 3.5 s
def test_k3_interop_measures_a_case_and_its_round_trip(tmp_path):
    """benchmarks/k3_interop.py on one case (the default tiny K3, every piece on): fp32 delta from the independent
    reference within 1e-3 of the logits' scale (measured 4e-5; tests/test_k3.py says why 1e-3), the depth weights
    too, the round trip bit for bit, and the table's verdict line."""
    sys.path.insert(0, str(BENCHMARKS))
    import k3_interop

    row = k3_interop.measure(*k3_interop.CASES[0], tmp_path, seed=0)
    assert row["max"] / row["scale"] <= 1e-3 and row["weights"] <= 1e-3 and row["round_trip"] is True
    text = k3_interop.table([row])
    assert "| 5 layers, blocks of 2 (the last partial) | 5 | 2 |" in text and "bit for bit" in text
    assert "Worst fp32 case" in text


RETROFIT_RECIPES = Path(__file__).parents[1] / "benchmarks" / "retrofit_recipes.py"


@pytest.mark.slow
def test_retrofit_recipes_run_every_arm_on_the_same_batches_with_the_same_search(tmp_path, one_thread, monkeypatch):
    """Every arm from the same function (each retrofit is exact), the search over the same scales, two seeds, the
    paired differences to `full`, and lm-eval's three benchmarks on every seed's model, end to end on a tiny Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eval_fixtures import write_offline_fixture
    from utils import TINY, counting_text, word_tokenizer

    spec = importlib.util.spec_from_file_location("retrofit_recipes_benchmark", RETROFIT_RECIPES)
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    torch.manual_seed(0)
    source = tmp_path / "source"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(source)
    results = recipes.run(source, word_tokenizer(), counting_text(60), counting_text(40, seed=1), tmp_path / "out",
                          log=lambda line: None, steps=3, batch_size=2, seq_len=16, warmup=1, seeds=2,
                          eval_tokens=64, validation_tokens=64, window=32, eval_questions=0, lr_scales=(0.1, 1.0))
    arms = results["arms"]
    assert list(arms) == list(recipes.ARMS)
    first = {arm: row["search"]["0.1"]["final_train_loss"] for arm, row in arms.items()}
    assert all(math.isfinite(v) for v in first.values())
    for arm, row in arms.items():
        assert set(row["search"]) == {"0.1", "1.0"} and row["lr_scale"] in (0.1, 1.0)
        assert [r["seed"] for r in row["runs"]] == [0, 1] and len(row["runs"][0]["nll_per_window"]) == 2
        if arm != "full":
            mean, low, high = row["paired_delta_nll_vs_full"]
            assert low <= mean <= high
    total = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**TINY)).parameters())
    assert arms["full"]["runs"][0]["trainable_parameters"] == total
    d, sublayers = TINY["hidden_size"], 2 * TINY["num_hidden_layers"]
    assert arms["attnres+full"]["runs"][0]["trainable_parameters"] == total + (sublayers + 1) * 2 * d  # + routers
    assert arms["delta+full"]["runs"][0]["trainable_parameters"] == total + sublayers * (2 * d + 1)  # + gates, no final
    assert arms["norms"]["runs"][0]["trainable_parameters"] == 32 * (2 * TINY["num_hidden_layers"] + 1)
    text = recipes.report(results)
    assert "| delta+full |" in text and "| no training | 0 |" in text and "Learning-rate search" in text
    assert (tmp_path / "out" / "retrofit_recipes.json").is_file()
    # lm-eval's three benchmarks on every seed's model and the source: the run's calls (counted), then one real call
    real_accuracy, calls = recipes.benchmark_accuracy, []

    def accuracy(model, tokenizer, limit):  # lm-eval for the first model only; the same numbers' shape after it
        calls.append(limit)
        if len(calls) == 1:
            return real_accuracy(model, tokenizer, limit)
        return dict.fromkeys(recipes.BENCHMARK_NAMES, 0.5)

    monkeypatch.setattr(recipes, "benchmark_accuracy", accuracy)
    # the benchmarks' data: a few rows of each, made here (not what `attnres eval prepare-data` left in the cache)
    monkeypatch.setenv("ATTNRES_EVAL_DATA", str(write_offline_fixture(tmp_path / "eval-data", recipes.BENCHMARK_NAMES)))
    results = recipes.run(source, word_tokenizer(), counting_text(60), counting_text(40, seed=1), tmp_path / "eval",
                          arms=["delta+full"], log=lambda line: None, steps=2, batch_size=2, seq_len=16, warmup=1,
                          seeds=2, eval_tokens=64, validation_tokens=64, window=32, eval_questions=2)
    assert calls == [2, 2, 2]  # the source, then each seed's model; the first through lm-eval (its tasks take seconds)
    for row in (results["no_training"], *results["arms"]["delta+full"]["runs"]):
        assert set(row["accuracy"]) == set(recipes.BENCHMARK_NAMES)
        assert all(0.0 <= v <= 1.0 for v in row["accuracy"].values())
    assert "| mmlu | arc_challenge | hellaswag |" in recipes.report(results)


@pytest.mark.parametrize("value", ["x", "0.4,-1", "0.4,0.4", "nan", "0.4,"])
def test_retrofit_recipes_refuses_bad_lr_scales_before_loading(value, capsys):
    spec = importlib.util.spec_from_file_location("retrofit_recipes_benchmark", RETROFIT_RECIPES)
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    with pytest.raises(SystemExit):
        recipes.main(["--lr-scales", value])
    assert "--lr-scales must be" in capsys.readouterr().err


SLIDING_WINDOW = BENCHMARKS / "sliding_window.py"


@pytest.fixture(scope="module")
def sliding_window():
    spec = importlib.util.spec_from_file_location("sliding_window_benchmark", SLIDING_WINDOW)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sliding_window_alternative_lifts_the_final_routers_window_only(sliding_window, input_ids):
    preset = sliding_window.ablation.PRESETS["smoke"]
    overrides = sliding_window.arms()["W=2 + final router reads all"][0]
    windowed = sliding_window.build(preset, overrides, False, seed=0)
    lifted = sliding_window.build(preset, overrides, True, seed=0)
    assert [w.shape[-1] for w in windowed(input_ids, output_depth_weights=True).depth_weights] == [1, 2, 3, 3, 3]
    assert [w.shape[-1] for w in lifted(input_ids, output_depth_weights=True).depth_weights] == [1, 2, 3, 3, 5]


def test_sliding_window_runs_its_arms_on_paired_backbones(sliding_window, tmp_path, one_thread, capsys):
    arms = ["baseline", "Full AttnRes", "W=2", "W=2 + final router reads all"]
    argv = ["--preset", "smoke", "--seeds", "2", "--steps", "2", "--log-every", "1", "--jobs", "1", "--arms",
            ",".join(arms), "--output", str(tmp_path / "window.json"), "--results", str(tmp_path / "docs" / "w.md")]
    sliding_window.main(argv)
    results = json.loads((tmp_path / "window.json").read_text())["results"]
    assert list(results) == arms and all(len(runs) == 2 for runs in results.values())
    assert all(math.isfinite(r["val_loss"]) and [s for s, _ in r["curve"]] == [1, 2]
               for runs in results.values() for r in runs)
    final_sources = {name: len(runs[0]["routing"].get("final weights", ())) for name, runs in results.items()}
    assert final_sources == {"baseline": 0, "Full AttnRes": 5, "W=2": 3, "W=2 + final router reads all": 5}
    printed = capsys.readouterr().out
    final = printed[printed.rindex("preset smoke ("):]
    assert "| W=2 + final router reads all |" in final
    assert_results_fragment(tmp_path / "docs" / "w.md", "sliding_window.py", argv, final)


def tiny_books(tmp_path, monkeypatch, ablation, text) -> None:
    """The project cache at `tmp_path/cache` with tiny books (`text(i)` for the i-th; the held-out ones first) and
    `ablation`'s tokenizer cache emptied, so that a benchmark trains its tokenizer on these books."""
    from attnres_hf import assets

    cache = tmp_path / "cache"
    (cache / "gutenberg").mkdir(parents=True)
    for i, name in enumerate(list(assets.HELD_OUT_BOOKS) + [f"book-{i}" for i in range(14)]):
        (cache / "gutenberg" / f"{name}.txt").write_text(text(i))
    monkeypatch.setenv("ATTNRES_HF_CACHE", str(cache))
    monkeypatch.setattr(ablation, "_BPE", {})


@pytest.mark.slow  # about 7 s
def test_trained_routing_smoke_trains_both_arms_and_writes_its_fragment(tmp_path, monkeypatch, one_thread, capsys):
    """`benchmarks/trained_routing.py --smoke` end to end on tiny books: both arms on the same batches, the curve,
    per-router entropy intervals, sinks, the probe in alpha and alpha * ||v||, the fragment, and a saved model that
    `attnres routing` reads."""
    from attnres_hf.cli import main
    from utils import counting_text

    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("trained_routing_benchmark", BENCHMARKS / "trained_routing.py")
    trained_routing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trained_routing)
    tiny_books(tmp_path, monkeypatch, trained_routing.ablation, lambda i: counting_text(60, seed=i).replace("\n", "\n\n"))
    out, fragment = tmp_path / "out", tmp_path / "docs" / "trained_routing.md"
    argv = ["--smoke", "--out", str(out), "--results", str(fragment)]
    trained_routing.main(argv)
    printed = capsys.readouterr().out
    results = json.loads((out / "trained_routing.json").read_text())
    arms = results["arms"]
    assert list(arms) == ["baseline", "Block AttnRes"] and arms["baseline"]["curve"]["step"] == [0, 3, 6]
    # the same initial backbone and batches: the first losses agree to the routers' uniform start
    assert arms["baseline"]["train_loss_per_step"][0] == pytest.approx(arms["Block AttnRes"]["train_loss_per_step"][0],
                                                                       rel=1e-2)
    assert arms["Block AttnRes"]["curve"]["entropy_ratio"][0][1:] == [pytest.approx(1.0)] * 8  # uniform at step 0
    assert arms["baseline"]["curve"]["entropy_ratio"] == [None] * 3
    assert all(math.isfinite(results["held_out"][arm]["loss"]) for arm in arms)
    assert math.isfinite(results["paired_delta"]["mean"]) and results["paired_delta"]["low"] is not None
    routers = results["routers"]
    assert len(routers) == 9 and routers[0]["entropy_ratio"] is None  # the first router reads the embedding only
    assert all(0 < r["low"] <= r["entropy_ratio"] <= r["high"] <= 1 + 1e-9 for r in routers[1:])
    assert all(isinstance(r["non_uniform"], bool) and isinstance(r["sinks"], list) for r in routers[1:])
    for values in ("weights", "contributions"):
        probe = results["probe"][values]
        assert probe["pairs_used"] == 12 and len(probe["largest_shifts"]) == 9
        assert all(math.isfinite(row["shift"]) and row["low"] <= row["high"] for row in probe["largest_shifts"])
    final = printed[printed.index("Shape: 4 decoder layers"):printed.rindex("\nwall time")]
    assert final.rstrip() == trained_routing.report(results)
    for line in ("| step | 0 | 3 | 6 |", "| held-out loss, Block AttnRes |", "| entropy / uniform, mean |",
                 "| router | n | curve", "| final | 5 |", "- measurably non-uniform: ",
                 "- depth-wise attention sinks: ", "| router | α: source |", "- α·‖v‖: 12 pairs"):
        assert line in final, line
    assert_results_fragment(fragment, "trained_routing.py", argv, final)
    # the saved Block AttnRes model and its tokenizer are what `attnres routing` reads
    assert main(["routing", str(out / "model"), "--text", "w5 w6 w7 w8", "--output-dir", str(tmp_path / "map")]) == 0
    assert (tmp_path / "map" / "summary.json").is_file() and (out / "baseline" / "tokenizer.json").is_file()


@pytest.mark.slow  # about 35 s: a 0.3 GB checkpoint written, copied and converted in a child process
def test_convert_scale_small_streams_a_real_shaped_checkpoint_exactly(tmp_path):
    """benchmarks/convert_scale.py --small on its Llama-shaped case (0.16B parameters, 0.31 GB of bf16, sharded):
    `attnres convert --stream` in a child process under /usr/bin/time, the report's mode, the logits within 1e-5 of
    their scale, the greedy tokens, an output the source's size in bf16, the output loaded with
    `device_map="auto"` and a small CPU budget and generating, each phase's seconds (the report's: writing and check,
    within the child's wall time), and the table."""
    sys.path.insert(0, str(BENCHMARKS))
    import convert_scale

    row = convert_scale.measure("llama-small", tmp_path, "bfloat16", 64 * 2**20)
    assert row["mode"] == "streamed" and row["greedy_match"] and row["relative_delta"] <= 1e-5, row
    assert abs(row["output_bytes"] - row["source_bytes"]) <= 0.01 * row["source_bytes"]  # bf16 in, bf16 out
    assert row["peak_gb"] > 0 and row["cp_s"] > 0 and not list(tmp_path.iterdir())  # it cleaned up after itself
    assert 0 < row["write_s"] and 0 < row["verify_s"] and row["write_s"] + row["verify_s"] < row["convert_s"], row
    # the output loads with device_map="auto" under a 128 MiB CPU budget, the rest on disk, and generates
    assert row["load_new_tokens"] == 2 and 0 < row["offloaded_bytes"] < row["weight_bytes"], row
    assert row["load_peak_gb"] > 0
    text = convert_scale.format_table([row])
    assert "| llama-small | 0.16B | 0.31 GB (bfloat16) | 0.31 GB (bfloat16) |" in text, text
    assert f"{STREAMED_NEW_TOKENS} greedy tokens agree |" in text and "PASS" not in text  # verdicts are for the full cases


@pytest.mark.slow  # about 20 s
def test_post_training_routing_smoke_runs_every_arm_on_the_same_batches_and_writes_its_fragment(
        tmp_path, monkeypatch, one_thread, capsys):
    """`benchmarks/post_training_routing.py --smoke` end to end on tiny books: a base trained from scratch, the
    instruction items, every arm x seed from the same base on the same batches (the first step's loss is the base's
    in every arm of a seed), frozen routers unchanged, the Delta arm's router rate, paired intervals over items, the
    routing drift, the fragment; and `--base` reads the saved base."""
    from utils import counting_text

    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("post_training_routing_benchmark",
                                                  BENCHMARKS / "post_training_routing.py")
    post_training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(post_training)
    tiny_books(tmp_path, monkeypatch, post_training.ablation,
               lambda i: counting_text(60, seed=i, length=10).replace("\n", ".\n\n"))
    out, fragment = tmp_path / "out", tmp_path / "docs" / "post_training_routing.md"
    argv = ["--smoke", "--out", str(out), "--results", str(fragment)]
    post_training.main(argv)
    printed = capsys.readouterr().out
    results = json.loads((out / "post_training_routing.json").read_text())
    arms, runs = results["arms"], results["runs"]
    assert list(arms) == [post_training.BASE, *post_training.ARMS] and len(runs) == 2 * len(post_training.ARMS)
    for seed in (0, 1):  # one base, one batch order per seed: the first step's loss is the same in every arm
        first = [r["train_loss_log"][0] for r in runs if r["seed"] == seed]
        assert first == pytest.approx([first[0]] * len(first), rel=1e-4), first
    frozen, delta = arms["LoRA, routers frozen"], arms["LoRA + routers, Delta rate"]
    assert frozen["router_change"] == 0.0 and frozen["router_learning_rate"] is None
    assert delta["router_learning_rate"] == post_training.DELTA_ROUTER_LR and delta["router_change"] > 0
    assert arms["full fine-tuning"]["trainable_parameters"] == results["items"]["base_parameters"]
    assert frozen["trainable_parameters"] < arms["LoRA + routers, base rate"]["trainable_parameters"]
    n_test = results["items"]["test"]
    for name in post_training.ARMS:
        row = arms[name]
        assert len(row["correct_per_item"]) == n_test and 0 <= row["accuracy"] <= 1 and len(row["nll_per_seed"]) == 2
        assert all(math.isfinite(v) for v in row["nll_per_item"]) and row["paired_vs_base"]["nll"][1] is not None
        assert len(row["weight_change"]) == len(results["router_names"]) == 9
        assert all(0 <= v <= 1 for v in row["weight_change"]) and row["weight_change"][0] == 0  # embedding only
    assert set(results["comparisons"]["LoRA + routers: Delta rate minus base rate"]) == {"correct", "nll", "book_nll"}
    # every item is a question about its passage, with the answer among four distinct words of it
    items = results["items"]
    assert items["example"].startswith("Passage: w") and " / Question: " in items["example"]
    assert set(items["test_kinds"]) == set(post_training.KINDS) and min(items["test_kinds"].values()) >= 4
    final = printed[printed.index("Base: Block AttnRes trained from scratch"):printed.rindex("\nwall time")]
    assert final.rstrip() == post_training.report(results)
    for line in ("| no fine-tuning (base) | 0 | - |", "| LoRA + routers, Delta rate |",
                 "| arm | first | last | after | before | book |",
                 "- LoRA + routers: Delta rate minus base rate: accuracy", "| router | base | LoRA, routers frozen |",
                 "| final |"):
        assert line in final, line
    assert_results_fragment(fragment, "post_training_routing.py", argv, final)
    # the saved base (with its tokenizer) is what `--base` reads instead of training one
    again = post_training.main(["--smoke", "--seeds", "1", "--base", str(out / "base"), "--out", str(tmp_path / "b")])
    assert "base_training" not in again and "Base: loaded from `" in post_training.report(again)
    for key in ("accuracy", "nll", "book_nll"):
        assert again["arms"][post_training.BASE][key] == pytest.approx(arms[post_training.BASE][key])


def test_scale_use_judges_each_step_by_the_machines_memory(monkeypatch):
    """benchmarks/scale_use.py's table (its 8B run is a benchmark, not a test): a row whose steps all peak under the
    machine's memory passes, one that does not fails, and an eval that gave no score says so."""
    sys.path.insert(0, str(BENCHMARKS))
    import scale_use

    row = {"case": "llama-3-8b", "parameters": 8.03e9, "model_bytes": 16.06e9, "convert_s": 300.0,
           "convert_peak_gb": 1.3, "eval_task": "arc_easy", "eval_limit": 4, "eval_s": 200.0, "eval_peak_gb": 17.0,
           "eval_scored": True, "qlora_steps": 3, "qlora_seq_len": 128, "qlora_s": 900.0, "qlora_peak_gb": 9.0,
           "qlora_losses_logged": 3}
    monkeypatch.setattr(scale_use, "_machine_gib", lambda: 23.5)
    text = scale_use.format_table([row])
    assert "| llama-3-8b | 8.03B | 16.06 GB | 300 s | 1.30 GB | arc_easy, 4 questions: 200 s | 17.00 GB |" in text
    assert text.rstrip().endswith("every step within the machine's memory (23.5 GiB): PASS")
    text = scale_use.format_table([row | {"eval_peak_gb": 26.0, "eval_scored": False}])
    assert "(no score)" in text and text.rstrip().endswith("FAIL")
    assert scale_use._scored({"rows": [{"benchmark": "arc_easy", "model": 0.25}]}, "arc_easy")
    assert not scale_use._scored({"rows": [{"benchmark": "arc_easy", "model": None}]}, "arc_easy")
