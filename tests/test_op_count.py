"""The operator calls AttnRes adds to Llama's, counted (`benchmarks/op_count.py`): a deterministic cost, so a bound a
regression breaks. The counts depend on the layer count, the block size and the code paths, not on the width
(the benchmark's `--smoke` shape, 30 layers at hidden 32, gives the SmolLM2-135M shape's counts)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (the launch counter's Triton test is skipped)
    triton = None

OP_COUNT = Path(__file__).parents[1] / "benchmarks" / "op_count.py"

TRAINING_MEMORY_CALLS = 348
"""Of Block's training-step bound, the calls of the reads rebuilt in backward (Kimi K3's recipe, `DepthRead.normed`;
tests/test_training_memory.py), at 30 layers in blocks of 8 sub-layers: 240 `detach` (4 per norm of the 60 reads:
the aliases autograd makes of the tensors a norm saves and unpacks while saved-tensor hooks are active; no kernel, no
data), 52 `lerp` (each merge's output, rebuilt) and, for the 8 first reads of a block, 8 `detach` of the phase-1
weights they keep and 48 calls rebuilding them from the buffer (one `(B T, 1, n) @ (B T, n, D)` product and 5
views each)."""


ADDED_AT_MOST = {  # (model, workload) -> the most aten calls it may add to Llama's (measured: docs/results/op_count.md)
    ("block", "decode"): 281, ("block", "prefill"): 281, ("block", "train"): 3028 + TRAINING_MEMORY_CALLS,
    ("full", "decode"): 385, ("full", "prefill"): 385, ("full", "train"): 2890,
}


TRAINING_LAUNCHES_ADDED_AT_MOST = {"block": 1882, "full": 1614}
"""The most kernel launches a training step may add to Llama's (`count_training_launches`, measured:
docs/results/op_count.md)."""

DECODE_LAUNCHES_ADDED_AT_MOST = {"block+triton": 63}
"""The most kernel launches a decoded token on the Triton kernels may add to Llama's (`count_launches`, measured:
docs/results/op_count.md)."""

DECODE_PYTHON_CALLS_ADDED_AT_MOST = {"block": 2119 + 40, "full": 2538 + 40}
"""The most Python function calls a decoded token may add to Llama's (`count_python_calls`, measured:
docs/results/op_count.md), with 40 to spare for calls the interpreter makes outside the model (a garbage collection's
weakref callbacks). A helper called once per read adds 61; Python 3.12 and later inline comprehensions (fewer)."""


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


def test_a_training_step_adds_no_more_kernel_launches_than_measured(op_count):
    launches = op_count.count_training_launches(dict(op_count.SMOLLM2_135M, **op_count.SMOKE))
    base = sum(launches["llama"].values())
    for model, most in TRAINING_LAUNCHES_ADDED_AT_MOST.items():
        added = sum(launches[model].values()) - base
        assert added <= most, f"{model}'s training step adds {added} kernel launches to Llama's (at most {most})"


def test_a_decoded_token_on_the_kernels_adds_no_more_launches_than_measured(op_count):
    """Block AttnRes's decode step on the Triton kernels (run by the interpreter, about 5 s): its launches over
    Llama's, which the merges' fused adds (`attnres_triton.add`) and phase 1 without the softmax keep down."""
    if triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton with its interpreter on (TRITON_INTERPRET=1 before Triton is imported)")
    shape = dict(op_count.SMOLLM2_135M, **op_count.SMOKE)
    launches = op_count.count_launches(shape, ("llama", *DECODE_LAUNCHES_ADDED_AT_MOST))
    base = sum(launches["llama"].values())
    for model, most in DECODE_LAUNCHES_ADDED_AT_MOST.items():
        added = sum(launches[model].values()) - base
        assert added <= most, f"{model}'s decoded token adds {added} kernel launches to Llama's (at most {most})"


def test_a_decoded_token_adds_no_more_python_calls_than_measured(op_count):
    calls = op_count.count_python_calls(dict(op_count.SMOLLM2_135M, **op_count.SMOKE))
    base = sum(calls["llama"].values())
    for model, most in DECODE_PYTHON_CALLS_ADDED_AT_MOST.items():
        added = sum(calls[model].values()) - base
        assert added <= most, (f"{model}'s decoded token adds {added} Python calls to Llama's (at most {most}): "
                               f"{calls[model].most_common(5)}")
    assert "| block |" in op_count.python_call_report(calls)


def test_the_python_call_counter_counts_frames_and_puts_back_the_profiler(op_count):
    def leaf():
        return len([1])  # (a builtin: not counted)

    def twice():
        return leaf() + leaf()

    outer = []
    sys.setprofile(lambda frame, event, arg: outer.append(event))
    try:
        counter = op_count.CountPythonCalls()
        with counter:
            twice()
        restored = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert counter.calls[__file__] == 3  # (and the counter's own `__exit__`)
    assert counter.total - 3 == sum(n for path, n in counter.calls.items() if path == op_count.__file__) == 1
    assert restored is not None and restored is not counter._profile


if triton is not None:
    @triton.jit
    def add_one(pointer, count, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < count
        tl.store(pointer + offsets, tl.load(pointer + offsets, mask=mask) + 1, mask=mask)


def test_kernel_launches_count_what_computes_and_each_triton_launch_once(op_count):
    """`CountLaunches`: a view and an allocation launch nothing, each other aten call one kernel, each Triton launch
    one (its own operations, torch calls under Triton's interpreter, not counted)."""
    if triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton with its interpreter on (TRITON_INTERPRET=1 before Triton is imported)")
    values = torch.zeros(2, 3)
    counter = op_count.CountLaunches()
    with counter:
        flat = values.view(-1)
        torch.empty(6)
        flat + 1
        for _ in range(2):
            add_one[(1,)](flat, 6, BLOCK=8)
    assert dict(counter.calls) == {"add": 1, "triton:add_one": 2}
    assert torch.equal(values, torch.full((2, 3), 2.0))
