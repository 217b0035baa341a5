"""Evaluation: lm-eval-harness on the offline task pack (`evaluate_pair`, `task_dir`), the local benchmark data
(`prepare_offline`, `import_benchmark`), and sliding-window perplexity."""

from .data import import_benchmark, prepare_offline
from .harness import BENCHMARKS, PAPER_TABLE, evaluate_pair, run_lm_eval, task_dir, task_manager
from .perplexity import perplexity

__all__ = ["BENCHMARKS", "PAPER_TABLE", "evaluate_pair", "import_benchmark", "perplexity", "prepare_offline",
           "run_lm_eval", "task_dir", "task_manager"]
