"""Helpers the offline task pack's YAML files call (`!function utils.NAME`; `tasks/utils.py` re-exports these).

Each helper reproduces the document processing or scoring of lm-eval's standard version of the task, named in the
pack's README, on the local data layout of `attnres_hf.eval.data`.
"""

from __future__ import annotations

import random
import re

from lm_eval.api.samplers import ContextSampler

from .code_execution import pass_at_1 as _pass_at_1
from .local import load_local as load  # noqa: F401  (custom_dataset of every task)
from .scoring import _clean as _clean_dashes
from .scoring import answer_value, document_language, parse_number, score_numeric
from .sources import LETTERS, last_boxed

# --- few-shot samplers ----------------------------------------------------------------------------------------------


class PoolSampler(ContextSampler):
    """The first `n` documents of the evaluated document's own `fewshot_pool` (its subject's dev rows, attached by
    `attnres_hf.eval.data.load_local`): lm-eval's `first_n` sampler per subject, as its per-subject MMLU, CMMLU,
    C-Eval and MMLU-Pro tasks draw few-shot examples. The task must set `fewshot_split` to its evaluated split, so
    that lm-eval passes the evaluated document to the sampler.

    Raises:
        ValueError: the subject has fewer than `n` few-shot rows.
    """

    def sample(self, n, eval_doc=None, df=None, **kwargs):
        if n == 0:
            return []
        if eval_doc is None or "fewshot_pool" not in eval_doc:
            raise RuntimeError("PoolSampler needs fewshot_split == test_split and documents with a fewshot_pool")
        pool = eval_doc["fewshot_pool"]
        if len(pool) < n:
            group = next((eval_doc[k] for k in ("subject", "category") if k in eval_doc), "?")
            raise ValueError(f"{n} few-shot examples asked for, but {group!r} has {len(pool)}")
        return pool[:n]


# --- document processing --------------------------------------------------------------------------------------------


def _clean(text: str | None) -> str:
    """Strip, turn WikiHow's " [title]" into ". ", drop other bracketed artefacts, collapse double spaces."""
    text = (text or "").strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def process_hellaswag(dataset):
    """HellaSwag as lm-eval's `hellaswag` v1: query `activity_label: ctx_a Ctx_b`, WikiHow bracket artefacts
    removed, gold = int(label)."""

    def one(doc):
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {"query": _clean(doc["activity_label"] + ": " + context),
                "choices": [_clean(ending) for ending in doc["endings"]], "gold": int(doc["label"])}

    return dataset.map(one)


def process_gpqa(dataset):
    """GPQA as lm-eval's `gpqa_diamond_zeroshot` (v2.2): the correct and three incorrect answers, cleaned as lm-eval
    does, in a shuffled order. The shuffle is seeded by the question text, so the order does not depend on which
    documents run before it (lm-eval's follows its global seed and the document order)."""

    def one(doc):
        correct = _clean(doc["Correct Answer"])
        choices = [_clean(doc[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [correct]
        random.Random(doc["Question"]).shuffle(choices)
        return {"choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                "answer": f"({LETTERS[choices.index(correct)]})"}

    return dataset.map(one)


def mmlu_pro_doc_to_text(doc) -> str:
    """MMLU-Pro as lm-eval's `mmlu_pro` (v3.1, 5-shot chain of thought): question, lettered options (stripped), and
    "Answer: Let's think step by step."."""
    options = "".join(f"{LETTERS[i]}. {option.strip()}\n" for i, option in enumerate(doc["options"][:len(LETTERS)]))
    return f"Question:\n{doc['question']}\nOptions:\n{options}Answer: Let's think step by step."


def mmlu_pro_fewshot_text(doc) -> str:
    """A few-shot example: the question as above followed by its reference reasoning (`cot_content`)."""
    reasoning = doc["cot_content"].replace("A: Let's think step by step.", "Answer: Let's think step by step.")
    return mmlu_pro_doc_to_text(doc).removesuffix("Answer: Let's think step by step.") + reasoning


def mmlu_pro_fewshot_target(doc) -> str:
    """Nothing: a few-shot example's answer is already in its reasoning (`mmlu_pro_fewshot_text`)."""
    return ""


# --- scoring --------------------------------------------------------------------------------------------------------

_REMOVED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}",
            "\\displaystyle", "{,}")
_UNITS = ("degrees", "degree", "centimeters", "centimeter", "cm", "meters", "meter", "kilometers", "km", "inches",
          "inch", "feet", "foot", "ft", "yards", "yard", "miles", "mile", "units", "unit", "sq", "square", "dollars",
          "dollar", "cents", "cent", "hours", "hour", "minutes", "minute", "seconds", "second", "mph", "pounds",
          "pound", "grams", "gram", "kg", "liters", "liter")
_WRAPPERS = ("boxed", "fbox", "text", "textbf", "mathrm", "mathbf", "mbox")


def _unwrap(text: str, command: str) -> str:
    """Replace every `\\command{...}` by its content (braces balanced)."""
    marker = "\\" + command + "{"
    while (start := text.find(marker)) >= 0:
        depth, index = 0, start + len(marker) - 1
        for index in range(start + len(marker) - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                break
        else:
            return text  # unbalanced: leave as is
        text = text[:start] + text[start + len(marker) : index] + text[index + 1 :]
    return text


def normalize_math_answer(answer: str) -> str:
    """Normalise a MATH final answer for string comparison, in the spirit of the Minerva normalisation that
    lm-eval's `minerva_math` uses (Lewkowycz et al. 2022, App. D.1): unwrap `\\boxed{}`, `\\text{}` and similar,
    drop units, dollar and percent signs, `\\left`/`\\right`, spaces and a trailing period; `dfrac`/`tfrac` become
    `frac` and `\\frac12` becomes `\\frac{1}{2}`; a lone `x = ...` keeps its right side; an option letter loses its
    parentheses; a plain number is written canonically (`0.50` -> `0.5`, `1,000` -> `1000`, `2.0` -> `2`); a Unicode
    minus is a minus."""
    text = _clean_dashes(answer).strip()
    for command in _WRAPPERS:
        text = _unwrap(text, command)
    for token in _REMOVED:
        text = text.replace(token, "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    for unit in _UNITS:
        text = re.sub(rf"(?<=[\d}}\s]){unit}(\^\d)?\b", "", text)
    text = text.replace(" ", "").rstrip(".")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", text)
    if re.fullmatch(r"[a-zA-Z]=[^=,]+", text):  # `x=5` -> `5`
        text = text.split("=", 1)[1]
    if re.fullmatch(r"\(([A-Ea-e])\)", text):  # `(C)` -> `C`
        text = text[1]
    # thousands groups after a first digit that is not zero, as `scoring.parse_number` reads them (`0,125` is none)
    if re.fullmatch(r"-?([1-9]\d{0,2}(,\d{3})+|\d+)?(\.\d+)?", text) and any(c.isdigit() for c in text):
        number = text.replace(",", "")
        if "." in number:
            number = number.rstrip("0").rstrip(".")
        if number.startswith(("-.", ".")):
            number = number.replace(".", "0.", 1)
        text = number or "0"
    return text


def extract_math_answer(generation: str) -> str | None:
    """The final answer of a MATH solution: "Final Answer: The final answer is X." (Minerva style, on its own
    line), else the last `\\boxed{}`, else None."""
    match = re.search(r"final answer: the final answer is (.*?)(?:\. I hope it is correct|\.?\s*$)",
                      generation, flags=re.MULTILINE | re.IGNORECASE)
    if match:
        return match.group(1).strip()
    return last_boxed(generation)


def process_math(doc, results) -> dict:
    """exact_match: the extracted answer equals the gold one after `normalize_math_answer`, or both are numbers of
    equal value (`29.00` is `29`)."""
    answer = extract_math_answer(results[0])
    if answer is None:
        return {"exact_match": 0}
    predicted, gold = normalize_math_answer(answer), normalize_math_answer(doc["answer"])
    same_number = parse_number(predicted) is not None and parse_number(predicted) == parse_number(gold)
    return {"exact_match": int(predicted == gold or same_number)}


# lm-eval's `exact_match` settings of its `gsm8k` (v3) and `mgsm_direct` (v4) tasks, whose metric the GSM8K and MGSM
# tasks keep on lm-eval's filters: their `process_results` (below) scores instead of lm-eval's metric_list, whose
# settings it therefore carries (a test checks them against lm-eval's YAML files).
LM_EVAL_EXACT_MATCH = {
    "gsm8k": {"ignore_case": True, "ignore_punctuation": False,
              "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]},
    "mgsm": {"ignore_case": True, "ignore_punctuation": True},
}


def process_gsm8k(doc, results) -> dict:
    """GSM8K's score of one filter's answer (`scoring.score_numeric`): `numeric_match` of numeric-extract's number
    (read as English writes numbers, as the gold is), lm-eval's `exact_match` of its strict-match and flexible-extract
    strings."""
    return score_numeric(results[0], doc["answer"], "en", LM_EVAL_EXACT_MATCH["gsm8k"])


def process_mgsm(doc, results) -> dict:
    """MGSM's score of one filter's answer (`scoring.score_numeric`): `numeric_match` of numeric-extract's number
    (the response's and the gold's read as the document's `language` writes numbers), lm-eval's `exact_match` of its
    remove_whitespace and flexible-extract strings. The gold is `answer_number` as the YAML's `doc_to_target` writes
    it."""
    return score_numeric(results[0], str(doc["answer_number"]), document_language(doc), LM_EVAL_EXACT_MATCH["mgsm"])


def process_cmath(doc, results) -> dict:
    """CMath (Wei et al. 2023): the answer equals the gold answer `golden` within 1e-4 relative tolerance, as the
    CMath paper's checker compares numbers, not strings. The answer is `scoring.answer_value` of the response
    (the first number after an answer marker such as "答案" or "答：", else the last number), read as Chinese
    writes numbers: fractions, mixed numbers and signs kept, thousands separators only in valid groups. A
    percentage on either side also matches its value over 100 (`75%` and `0.75`)."""
    found = answer_value(results[0], "zh")
    gold_text = str(doc["golden"]).strip()
    gold = parse_number(gold_text, "zh")  # the gold read as the response is
    if found is None or gold is None:
        return {"accuracy": 0}
    predicted, percent = found
    candidates = {float(gold)} | ({float(gold) / 100} if gold_text.endswith("%") else set())
    answers = {float(predicted)} | ({float(predicted) / 100} if percent else set())
    correct = any(abs(a - value) <= 1e-4 * max(1.0, abs(value)) for a in answers for value in candidates)
    return {"accuracy": int(correct)}


def build_humaneval_program(resps, docs):
    """HumanEval filter: each completion is appended to its prompt (the function signature and docstring)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]


def pass_at_1(references, predictions, **kwargs) -> float:
    """pass@1 of one document; `predictions[0]` is the program, or a list holding it (after a filter)."""
    program = predictions[0] if isinstance(predictions[0], str) else predictions[0][0]
    return _pass_at_1(references, [[program]])
