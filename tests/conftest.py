"""Fixtures; the helpers they use live in `tests/utils.py`."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter runs `attnres_implementation="triton"`'s kernels on CPU tensors (test_triton_kernels.py).
    # Triton reads the variable when it is first imported (its own `tl.sum`, `tl.sigmoid` are kernels too), which
    # importing attnres_hf does: so here, before anything else. Where CUDA is, the kernels run compiled.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from utils import TINY, write_tiny_model_dir


def pytest_configure(config):
    """No test reads benchmark data that an earlier command prepared (`make demo`, `attnres eval prepare-data`): the
    run's default eval-data folder is a new empty one, so a test evaluating on a benchmark makes its rows (
    `tests/eval_fixtures.py`) or prepares them itself. Downloads stay in the project cache (`$ATTNRES_HF_CACHE`):
    each is fetched on demand and digest-checked, and `.ci/run` points that cache at an empty folder as well."""
    import tempfile

    config._attnres_eval_data = tempfile.TemporaryDirectory(prefix="attnres-test-eval-data-")
    os.environ["ATTNRES_EVAL_DATA"] = config._attnres_eval_data.name


def pytest_unconfigure(config):
    if hasattr(config, "_attnres_eval_data"):
        config._attnres_eval_data.cleanup()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Benchmarks' `main()` run in-process set one torch thread and flush denormals for their own runs; keep that
    from leaking into later tests (a test comparing against a subprocess runs with torch's default threads)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


@pytest.fixture
def input_ids():
    return torch.randint(3, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A saved tiny AttnRes model with its tokenizer, and a counting corpus beside it (`write_tiny_model_dir`)."""
    return write_tiny_model_dir(tmp_path)


# `ATTNRES_TEST_MEMORY=1 make test`: which tests raise the run's peak resident memory, of the pytest process and of
# the largest subprocess a test waited for (servers, accelerate and torchrun launches); the suite's peak is what a
# machine must hold.
_PEAK_RAISES: list[tuple[float, float, str, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import os
    import resource

    if not os.environ.get("ATTNRES_TEST_MEMORY"):
        yield
        return
    who = {"pytest": resource.RUSAGE_SELF, "subprocess": resource.RUSAGE_CHILDREN}
    before = {name: resource.getrusage(kind).ru_maxrss for name, kind in who.items()}
    yield
    for name, kind in who.items():
        after = resource.getrusage(kind).ru_maxrss  # KiB on Linux
        if after > before[name]:
            _PEAK_RAISES.append(((after - before[name]) / 2**20, after / 2**20, name, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _PEAK_RAISES:
        terminalreporter.section("tests that raised the peak resident memory (GiB raised, peak after, of which)")
        for raised, peak, name, nodeid in sorted(_PEAK_RAISES, reverse=True)[:15]:
            terminalreporter.write_line(f"{raised:6.2f} {peak:6.2f}  {name:10}  {nodeid}")
