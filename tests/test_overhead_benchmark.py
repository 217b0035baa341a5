"""The overhead benchmark's statistics: the median's distribution-free interval and the PASS/FAIL/"not shown"
verdict on it (the timings themselves are the benchmark's, never a test's)."""

import importlib.util
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
