"""Evaluation: lm-eval-harness on the offline task pack (`evaluate_pair`, `run_lm_eval`, `task_dir`), one record per
benchmark (`BENCHMARKS`), the local benchmark data (`prepare_offline`, `import_benchmark`), answer scoring
(`scoring`), and sliding-window perplexity."""

from .benchmarks import BENCHMARKS, IMPORTED, OFFLINE, PAPER_TABLE, Benchmark, resolve_benchmarks
from .harness import evaluate_pair, run_lm_eval, task_dir, task_manager
from .imports import import_benchmark
from .offline import prepare_offline
from .perplexity import perplexity

__all__ = ["BENCHMARKS", "IMPORTED", "OFFLINE", "PAPER_TABLE", "Benchmark", "evaluate_pair", "import_benchmark",
           "perplexity", "prepare_offline", "resolve_benchmarks", "run_lm_eval", "task_dir", "task_manager"]
