"""The operator calls AttnRes adds to Llama's, counted (`benchmarks/op_count.py`): a deterministic cost, so a bound a
regression breaks. The counts depend on the layer count, the block size and the code paths, not on the width
(the benchmark's `--smoke` shape, 30 layers at hidden 32, gives the SmolLM2-135M shape's counts)."""

import importlib.util
import sys
from pathlib import Path

import pytest

OP_COUNT = Path(__file__).parents[1] / "benchmarks" / "op_count.py"

TRAINING_MEMORY_CALLS = 348
"""Of Block's training-step bound, the calls of the reads rebuilt in backward (Kimi K3's recipe, `DepthRead.normed`;
tests/test_training_memory.py), at 30 layers in blocks of 8 sub-layers: 240 `detach` (4 per norm of the 60 reads:
the aliases autograd makes of the tensors a norm saves and unpacks while saved-tensor hooks are active; no kernel, no
data), 52 `lerp` (each merge's output, rebuilt) and, for the 8 first reads of a block, 8 `detach` of the phase-1
weights they keep and 48 calls rebuilding them from the buffer (one `(B T, 1, n) @ (B T, n, D)` product and 5
views each)."""


ADDED_AT_MOST = {  # (model, workload) -> the most aten calls it may add to Llama's (measured: docs/results/op_count.md)
    ("block", "decode"): 281, ("block", "prefill"): 281, ("block", "train"): 3055 + TRAINING_MEMORY_CALLS,
    ("full", "decode"): 385, ("full", "prefill"): 385, ("full", "train"): 3882,
}


@pytest.fixture(scope="module")
def op_count():
    sys.path.insert(0, str(OP_COUNT.parent))
    try:
        spec = importlib.util.spec_from_file_location("op_count_benchmark", OP_COUNT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(OP_COUNT.parent))
    return module


@pytest.fixture(scope="module")
def counts(op_count):
    return op_count.count_all(dict(op_count.SMOLLM2_135M, **op_count.SMOKE))


@pytest.mark.parametrize("model,workload", sorted(ADDED_AT_MOST))
def test_attnres_adds_no_more_operator_calls_than_measured(counts, model, workload):
    added = sum(counts[model][workload].values()) - sum(counts["llama"][workload].values())
    assert added <= ADDED_AT_MOST[model, workload], (
        f"{model} {workload} adds {added} aten calls to Llama's (at most {ADDED_AT_MOST[model, workload]}): a regression "
        f"(python benchmarks/op_count.py --ops shows which operators)")


def test_the_table_judges_each_target(op_count, counts):
    text = op_count.report(counts, dict(op_count.SMOLLM2_135M, **op_count.SMOKE))
    targets = sum(len(workloads) for workloads in op_count.TARGETS.values())
    assert text.count("PASS (") + text.count("FAIL (") == targets
    assert f"Targets met: {text.count('PASS (')} of {targets}." in text
