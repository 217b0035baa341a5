"""The overhead benchmark's statistics: the median's distribution-free interval, the PASS/FAIL/"not shown" verdict
on it, and the Markdown table that reports them (the timings themselves are the benchmark's, never a test's)."""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

OVERHEAD = Path(__file__).parents[1] / "benchmarks" / "overhead.py"


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("overhead_benchmark", OVERHEAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_median_interval_uses_binomial_order_statistics(overhead):
    # 5 values: only [min, max] is available, covering 1 - 2/32
    assert overhead.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, 1.0, 5.0, pytest.approx(1 - 2 / 32))
    # 12 values: k = 3 covers 1 - 2 (1 + 12 + 66) / 4096 = 96.1%; k = 4 would cover 85.4%
    median, low, high, coverage = overhead.median_interval([float(i) for i in range(12)])
    assert (median, low, high) == (5.5, 2.0, 9.0) and coverage == pytest.approx(1 - 2 * 79 / 4096)


@pytest.mark.parametrize("low, high, expected", [(0.98, 1.02, "PASS"), (1.031, 1.2, "FAIL"), (1.0, 1.05, "not shown")])
def test_a_target_is_judged_on_the_whole_interval(overhead, low, high, expected):
    assert overhead.verdict(low, high, 1.03).startswith(expected)
    assert overhead.verdict(low, high, None) == ""


def test_report_is_a_markdown_table_with_each_verdict_beside_its_ratio(overhead):
    """The printed tables are what `--results` writes to the docs: Markdown, Llama's times, each ratio with its
    interval (and its verdict where a target applies), the memory, then the verdicts with their targets."""
    llama = {"train": [1.0] * 6, "prefill": [0.5] * 6, "decode": [0.01] * 6}
    block = {"train": [1.01, 1.0, 1.02, 1.01, 1.0], "prefill": [0.6] * 5, "decode": [0.0101] * 5}
    result = {"times": {"llama": llama, "block": block, "block+sigmoid": block},
              "peaks": {"llama": 100 * 2**20, "block": 104 * 2**20, "block+sigmoid": 104 * 2**20}}
    lines = overhead.report("eager", result, argparse.Namespace(repeats=5)).splitlines()
    assert lines[2:5] == ["| model | train step | prefill | decode / token | train peak memory |",
                          "|---|---|---|---|---|", "| llama | 1 s | 0.5 s | 10 ms | 100 MiB |"]
    assert lines[5] == ("| block | 1.010 [1.000, 1.020] PASS | 1.200 [1.200, 1.200] FAIL | 1.010 [1.010, 1.010] PASS | "
                        "104 MiB (1.040) FAIL |")
    assert lines[6] == ("| block+sigmoid | 1.010 [1.000, 1.020] | 1.200 [1.200, 1.200] | 1.010 [1.010, 1.010] | "
                        "104 MiB (1.040) |")  # no targets for the knobs
    assert "Interval coverage with 5 repeats: 93.8%." in lines
    assert "- block, eager, prefill: 1.200 [1.200, 1.200] FAIL (> 1.02)" in lines
    assert "- block, eager, memory: 1.040 (one run) FAIL (> 1.01)" in lines


def test_fla_variants_are_the_fused_read_and_need_cuda(overhead, capsys):
    """`--fla` adds Block and Full with `attnres_implementation="fla"` (tiny shape here, built only) and is refused
    off CUDA before any model is built."""
    shape = dict(overhead.SMOLLM2_135M, num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=99,
                 num_attention_heads=4, num_key_value_heads=2)
    models = overhead.build_models(overhead.torch.device("cpu"), "sdpa", [], shape, fla=True)
    assert list(models) == ["llama", "block", "full", "block+fla", "full+fla"]
    assert models["full+fla"].config.attnres_implementation == "fla" and models["full+fla"].config.attnres_block_size == 1
    with pytest.raises(SystemExit):
        overhead.main(["--fla", "--device", "cpu"])
    assert "--fla needs --device cuda" in capsys.readouterr().err


def test_targets_are_per_device_kind_and_compile_times_are_judged(overhead):
    """The compile-time table: each model's seconds per workload and its ratio to Llama's, judged on the total."""
    llama = {"train": [1.0] * 3, "decode": [0.01] * 3}
    block = {"train": [1.01, 1.0], "decode": [0.0101] * 2}
    result = {"times": {"llama": llama, "block": block}, "peaks": {},
              "compile": {"llama": {"train": 10.0, "decode": 2.0}, "block": {"train": 14.0, "decode": 1.0}}}
    text = overhead.report("regional", result, argparse.Namespace(repeats=2), "cpu")
    assert "| block | 14.0 s (1.40) | 1.0 s (0.50) | 15.0 s (1.25) PASS |" in text
    assert "- block, regional, compile time: 1.25 (one run) PASS (<= 1.5)" in text
    assert "- block, regional, train: 1.005 [1.000, 1.010] PASS (<= 1.02)" in text
    gpu = overhead.report("regional", result, argparse.Namespace(repeats=2), "cuda")
    assert "- block, regional, train: 1.005 [1.000, 1.010] PASS (<= 1.05)" in gpu
    for (device, model, mode), targets in overhead.TARGETS.items():
        assert device in ("cpu", "cuda") and model in overhead.COMPILED and mode in overhead.MODES
        assert set(targets) <= {*overhead.WORKLOADS, "memory", "compile"}


@pytest.mark.slow
def test_a_tiny_run_of_every_mode_writes_its_fragment_and_the_readme_block(overhead, tmp_path, monkeypatch):
    """Two layers of the smoke shape (in the benchmark's own shape's place: `--readme` refuses `--smoke`), a few
    tokens, dynamo without inductor (`--backend eager`): every mode runs, the fragment has each table, and `--readme`
    rewrites only the README's block, with the verdicts and their count."""
    results = sys.modules["_results"]
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results:overhead-cpu -->\nold\n<!-- /results:overhead-cpu -->\nafter\n")
    monkeypatch.setattr(results, "README", readme)
    monkeypatch.setattr(overhead, "ROOT", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.setattr(overhead, "SMOLLM2_135M", {**overhead.SMOLLM2_135M, **overhead.SMOKE})
    fragment = tmp_path / "docs" / "overhead.md"
    overhead.main(["--layers", "2", "--repeats", "2", "--knobs", "none", "--backend", "eager", "--train-batch", "1",
                   "--train-len", "8", "--prefill-len", "8", "--decode-tokens", "2", "--no-memory",
                   "--compiled-workloads", "decode", "--results", str(fragment), "--readme"])
    text = fragment.read_text()
    assert all(f"**{mode}**" in text for mode in overhead.MODES)
    assert "Compile time, regional" in text and "Compile time, compiled" in text
    block = readme.read_text()
    assert block.startswith("# x\n\n<!-- results:overhead-cpu -->\nMeasured ") and block.endswith(
        "<!-- /results:overhead-cpu -->\nafter\n")
    verdicts = [line for line in block.splitlines() if line.startswith("- ")]
    assert verdicts and all(line in text.splitlines() for line in verdicts)
    counts = re.search(r"Of (\d+) targets, (\d+) pass, (\d+) fail and (\d+) are not shown", block)
    assert counts and int(counts[1]) == len(verdicts) == sum(int(counts[i]) for i in (2, 3, 4))
    assert "[docs/overhead.md](docs/overhead.md)" in block


def test_readme_needs_results_inside_the_checkout_and_a_real_shape(overhead, capsys, tmp_path):
    with pytest.raises(SystemExit):
        overhead.main(["--readme", "--results", str(tmp_path / "x.md")])
    assert "--readme needs --results inside the checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overhead.main(["--readme", "--smoke", "--results", str(overhead.ROOT / "docs" / "results" / "x.md")])
    assert "--readme with --smoke" in capsys.readouterr().err
