"""Helpers the offline task pack's YAML files call (`!function utils.NAME`; `tasks/utils.py` re-exports these).

Each helper reproduces the document processing or scoring of lm-eval's standard version of the task, named in the
pack's README, on the local data layout of `attnres_hf.eval.data`.
"""

from __future__ import annotations

import random
import re

from lm_eval.api.samplers import ContextSampler

from .code_execution import pass_at_1 as _pass_at_1
from .data import LETTERS, last_boxed
from .data import load_local as load  # noqa: F401  (custom_dataset of every task)

# --- few-shot samplers ----------------------------------------------------------------------------------------------


class _SameGroupSampler(ContextSampler):
    """The first `n` few-shot documents whose `KEY` equals the evaluated document's: lm-eval's `first_n` sampler
    applied per subject, as MMLU, CMMLU, C-Eval and MMLU-Pro draw their few-shot examples from their own subject's
    dev split."""

    KEY = "subject"

    def sample(self, n, eval_doc=None, df=None, **kwargs):
        if n == 0:
            return []
        pool = [doc for doc in (df or self.df) if eval_doc is None or doc[self.KEY] == eval_doc[self.KEY]]
        pool = [doc for doc in pool if doc != eval_doc]
        if len(pool) < n:
            raise ValueError(f"{n} few-shot examples asked for, but the few-shot split has {len(pool)} with "
                             f"{self.KEY} {eval_doc[self.KEY] if eval_doc else ''!r}")
        return pool[:n]


class SameSubjectSampler(_SameGroupSampler):
    KEY = "subject"


class SameCategorySampler(_SameGroupSampler):
    KEY = "category"


# --- document processing --------------------------------------------------------------------------------------------


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def process_hellaswag(dataset):
    """HellaSwag as lm-eval's `hellaswag` v1: query `activity_label: ctx_a Ctx_b`, WikiHow bracket artefacts
    removed, gold = int(label)."""

    def one(doc):
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {"query": _hellaswag_clean(doc["activity_label"] + ": " + context),
                "choices": [_hellaswag_clean(ending) for ending in doc["endings"]], "gold": int(doc["label"])}

    return dataset.map(one)


def process_gpqa(dataset):
    """GPQA as lm-eval's `gpqa_diamond_zeroshot`: the correct and three incorrect answers in a shuffled order. The
    shuffle is seeded by the question text, so the order does not depend on which documents run before it."""

    def one(doc):
        correct = doc["Correct Answer"].strip()
        choices = [doc[f"Incorrect Answer {i}"].strip() for i in (1, 2, 3)] + [correct]
        random.Random(doc["Question"]).shuffle(choices)
        return {"choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                "answer": f"({LETTERS[choices.index(correct)]})"}

    return dataset.map(one)


def mmlu_pro_doc_to_text(doc) -> str:
    """MMLU-Pro as lm-eval's `mmlu_pro` (5-shot chain of thought): question, lettered options, and
    "Answer: Let's think step by step." (the few-shot targets continue with the reference reasoning)."""
    options = "".join(f"{LETTERS[i]}. {option}\n" for i, option in enumerate(doc["options"]))
    return f"Question:\n{doc['question']}\nOptions:\n{options}Answer: Let's think step by step."


def mmlu_pro_fewshot_target(doc) -> str:
    return doc["cot_content"].removeprefix("A: Let's think step by step.").strip()


# --- scoring --------------------------------------------------------------------------------------------------------

_REMOVED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}", "\\displaystyle")
_UNITS = ("degrees", "degree", "cm", "centimeters", "meters", "meter", "inches", "inch", "feet", "foot", "units",
          "unit", "sq", "square", "dollars", "cents", "hours", "minutes", "seconds", "mph", "km")


def normalize_math_answer(answer: str) -> str:
    """Normalise a MATH final answer for string comparison, in the spirit of the Minerva normalisation lm-eval's
    `minerva_math` uses (Lewkowycz et al. 2022, App. D.1): drop `\\text{}` wrappers, units, dollar signs, `\\left`,
    `\\right`, spaces and a trailing period; `dfrac`/`tfrac` become `frac`; `\\frac12` becomes `\\frac{1}{2}`;
    `0.5` and `.5` agree; thousands separators go."""
    text = answer.strip()
    text = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", text)
    for token in _REMOVED:
        text = text.replace(token, "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    for unit in _UNITS:
        text = re.sub(rf"(?<=[\d}}\s]){unit}(\^\d)?\b", "", text)
    text = text.replace(" ", "").rstrip(".")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", text)
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", text):
        text = text.replace(",", "")
    if text.startswith("."):
        text = "0" + text
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]
    if re.fullmatch(r"[a-zA-Z]=.+", text):  # `x=5` -> `5`
        text = text.split("=", 1)[1]
    return text


def extract_math_answer(generation: str) -> str | None:
    """The final answer of a MATH solution: "Final Answer: The final answer is X." (Minerva style), else the last
    `\\boxed{}`, else None."""
    match = re.search(r"[Ff]inal [Aa]nswer: The final answer is (.*?)(?:\. I hope it is correct|$)", generation)
    if match:
        return match.group(1).strip()
    return last_boxed(generation)


def process_math(doc, results) -> dict:
    answer = extract_math_answer(results[0])
    return {"exact_match": int(answer is not None and normalize_math_answer(answer) == normalize_math_answer(doc["answer"]))}


def _numbers(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?", text)


def _as_float(text: str) -> float | None:
    text = text.replace(",", "")
    try:
        if "/" in text:
            numerator, denominator = text.split("/")
            return float(numerator) / float(denominator)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def process_cmath(doc, results) -> dict:
    """CMath (Wei et al. 2023): the last number in the answer equals the gold answer `golden` within 1e-4 relative
    tolerance (fractions allowed), as the CMath paper's automatic checker compares numbers, not strings."""
    found = _numbers(results[0])
    predicted = _as_float(found[-1]) if found else None
    gold = _as_float(str(doc["golden"]).strip().rstrip("%"))
    correct = predicted is not None and gold is not None and abs(predicted - gold) <= 1e-4 * max(1.0, abs(gold))
    return {"accuracy": int(correct)}


def build_humaneval_program(resps, docs):
    """HumanEval filter: each completion is appended to its prompt (the function signature and docstring)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]


def build_mbpp_program(resps, docs):
    """MBPP filter: the completion is the program; the test setup code runs before the tests (see doc_to_target)."""
    return [[r.split("[DONE]")[0] for r in resp] for resp in resps]


def pass_at_1(references, predictions, **kwargs) -> float:
    return _pass_at_1(references, predictions)
