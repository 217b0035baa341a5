"""Local benchmark data: where it lives, how it is written and checked, and how the pack's tasks read it.

Layout: `<data_dir>/<benchmark>/<split>.jsonl`, one JSON object per line in the columns of the benchmark's usual
Hugging Face dataset (plus a `subject` column for multi-subject benchmarks), so the pack's YAML files read the same
fields as lm-eval's own versions of each task, and `SOURCE.json` with the row counts written.

`data_dir` is, in order: the `data_dir` task metadata (`lm_eval --metadata '{"data_dir": ...}'`), the
`ATTNRES_EVAL_DATA` environment variable, or `<cache>/eval-data` (`$ATTNRES_HF_CACHE`, default `~/.cache/attnres-hf`).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from .._io import staged_folder
from .._downloads import cache_dir
from .benchmarks import BENCHMARKS, Benchmark


def default_data_dir() -> Path:
    """`$ATTNRES_EVAL_DATA`, else `<cache>/eval-data`."""
    return Path(os.environ.get("ATTNRES_EVAL_DATA") or cache_dir() / "eval-data")


class MissingBenchmarkData(FileNotFoundError):
    """Local data for a benchmark is not there; the message names the command that prepares it."""


def prepare_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """The command that prepares `name` (into `data_dir` when that is not the default)."""
    spec = BENCHMARKS[name]
    folder = f" --data-dir {data_dir}" if data_dir and Path(data_dir) != default_data_dir() else ""
    if spec.source == "offline":
        return f"attnres eval prepare-data{folder} --only {name}"
    return f"attnres eval prepare-data{folder} --import {name}=PATH  (PATH: {spec.expected_input})"


def check_prepared(name: str, data_dir: str | os.PathLike | None = None, validate: bool = False) -> Path:
    """Folder of `name`'s local data.

    With `validate`, every line of every split is parsed and checked for the required columns, and the row counts
    are compared with those recorded when the data was written (`SOURCE.json`), so a corrupt or truncated file is
    found before a model is loaded.

    Raises:
        KeyError: unknown benchmark.
        MissingBenchmarkData: a split file is missing (the message names the command that prepares it).
        ValueError: (with `validate`) a malformed line, a missing column, or a row count that does not match.
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    folder = Path(data_dir) if data_dir else default_data_dir()
    spec = BENCHMARKS[name]
    missing = [f"{folder / name / split}.jsonl" for split in spec.splits
               if not (folder / name / f"{split}.jsonl").is_file()]
    if missing:
        raise MissingBenchmarkData(
            f"no local data for {name!r} (missing {', '.join(missing)}); nothing is downloaded at evaluation time. "
            f"Prepare it with: {prepare_command(name, data_dir)}"
        )
    if validate:
        recorded = {}
        if (folder / name / "SOURCE.json").is_file():
            recorded = json.loads((folder / name / "SOURCE.json").read_text()).get("rows", {})
        for split in spec.splits:
            path = folder / name / f"{split}.jsonl"
            rows = read_jsonl(path)
            for number, row in enumerate(rows, 1):
                absent = [column for column in spec.columns if column not in row]
                if absent:
                    raise ValueError(f"{path}: row {number} lacks {absent}; re-run {prepare_command(name, data_dir)}")
            if split in recorded and recorded[split] != len(rows):
                raise ValueError(f"{path} has {len(rows)} rows but {recorded[split]} were written (truncated?); "
                                 f"re-run {prepare_command(name, data_dir)} with --force")
    return folder / name


def fewshot_capacity(name: str, data_dir: str | os.PathLike | None = None) -> int | None:
    """The most few-shot examples every evaluated question of `name` can get (None: the task is 0-shot only)."""
    spec = BENCHMARKS[name]
    if spec.fewshot_split is None:
        return None
    folder = check_prepared(name, data_dir)
    pool = read_jsonl(folder / f"{spec.fewshot_split}.jsonl")
    if spec.pooled:
        evaluated = {row[spec.group] for row in read_jsonl(folder / f"{spec.splits[0]}.jsonl")}
        sizes = defaultdict(int)
        for row in pool:
            sizes[row[spec.group]] += 1
        return min(sizes.get(group, 0) for group in evaluated)
    return len(pool) - (1 if spec.fewshot_split == spec.splits[0] else 0)


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number} is not valid JSON ({error.msg}); re-run prepare-data") from None
    return rows


def load_local(benchmark: str, data_dir: str | None = None, **_ignored):
    """`datasets.DatasetDict` of one prepared benchmark, for a task's `custom_dataset` (lm-eval calls it with the
    task metadata and `dataset_kwargs`; other keys are ignored). Rows of a `pooled` benchmark's evaluated split
    carry `fewshot_pool` (see `Benchmark`).

    Raises:
        MissingBenchmarkData: the benchmark was not prepared (the message says how to prepare it).
    """
    import datasets

    folder = check_prepared(benchmark, data_dir)
    spec = BENCHMARKS[benchmark]
    splits = {split: read_jsonl(folder / f"{split}.jsonl") for split in spec.splits + spec.optional_splits
              if (folder / f"{split}.jsonl").is_file()}
    if spec.pooled:
        pools: dict[str, list[dict]] = defaultdict(list)
        for row in splits[spec.fewshot_split]:
            pools[row[spec.group]].append(row)
        splits[spec.splits[0]] = [{**row, "fewshot_pool": pools.get(row[spec.group], [])}
                                  for row in splits[spec.splits[0]]]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in splits.items()})


def write_split(folder: Path, split: str, rows: list[dict], spec: Benchmark) -> None:
    if not rows:
        raise ValueError(f"{spec.name}: the {split} split is empty")
    expected = spec.expected_input or "the standard columns"
    for number, row in enumerate(rows, 1):
        missing = [column for column in spec.columns if column not in row]
        if missing:
            raise ValueError(f"{spec.name}: {split} row {number} lacks column(s) {missing}; expected {expected}")
        if spec.choices and spec.choices[0] in row and row[spec.choices[0]] not in spec.choices[1]:
            column, allowed = spec.choices
            raise ValueError(f"{spec.name}: {split} row {number} has {column} = {row[column]!r}; expected one of "
                             f"{', '.join(map(str, allowed))}")
    with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_benchmark(data_dir: Path, name: str, splits: dict[str, list[dict]], force: bool) -> Path:
    spec = BENCHMARKS[name]
    for split in spec.splits:
        if split not in splits:
            raise ValueError(f"{name}: no {split!r} split found; expected {spec.expected_input or spec.splits}")
    if spec.group:
        splits = {**splits, spec.splits[0]: round_robin(splits[spec.splits[0]], spec.group)}
    with staged_folder(data_dir / name, replace=force) as staging:
        for split, rows in splits.items():
            write_split(staging, split, rows, spec)
        rows = {split: len(r) for split, r in splits.items()}
        (staging / "SOURCE.json").write_text(json.dumps({"benchmark": name, "rows": rows}, indent=2) + "\n")
    return data_dir / name


def round_robin(rows: list[dict], key: str) -> list[dict]:
    """Interleave rows by `key` (first of each group, then second, ...), keeping the order within a group, so that
    the first N rows (lm-eval's `--limit N`) cover every subject."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row[key]].append(row)
    ordered, depth = [], 0
    while len(ordered) < len(rows):
        for name in sorted(groups):
            if depth < len(groups[name]):
                ordered.append(groups[name][depth])
        depth += 1
    return ordered
