"""Answer extraction and scoring of `attnres_hf.eval.scoring`: fractions (`1/2` is one number, a half, never its
numerator), option letters, numbers as each language writes them, and every numeric task's filters on numbers that
differ from the gold only in sign, decimal mark or grouping."""

from decimal import Decimal
from pathlib import Path

import pytest

from attnres_hf.eval import scoring


@pytest.mark.parametrize("text, value", [
    ("1/2", Decimal("0.5")), ("-1/2", Decimal("-0.5")), ("3 / 4", Decimal("0.75")), ("$1,000/4", Decimal(250)),
    ("1/0", None), ("1/2.5", Decimal("0.4")), ("3/0.75", Decimal(4)), ("1.5/0.5", Decimal(3)), ("2/0.0", None),
])
def test_fraction_is_parsed_as_its_value(text, value):
    assert scoring.parse_number(text) == value


@pytest.mark.parametrize("response, extracted", [
    ("The answer is 1/2", "0.5"),
    ("The answer is 1/2.", "0.5"),
    ("She ate 1/2 of the 8 slices, so the answer is 4.", "4"),
    ("On 12/25/2024 she bought 7 more. The answer is 7", "7"),
    ("The answer is 1/0.", scoring.INVALID),
    ("The answer is 1/2.5", "0.4"),
    ("The answer is 1/2.5.", "0.4"),
    ("Half of it, 9/4.5, so the answer is 2", "2"),
])
def test_fraction_answer_is_not_read_as_its_numerator(response, extracted):
    assert scoring.extract_number(response) == extracted


def _numeric_match(gold: str, response: str) -> float:
    """`numeric_match` of the numeric-extract filter's answer to an English response."""
    ((answer,),) = scoring.numeric_filter([[response]], [{}])
    return scoring.score_numeric(answer, gold, "en", {})["numeric_match"]


def test_fraction_answer_scores_by_value():
    assert _numeric_match("#### 1", "The answer is 1/2") == 0.0
    assert _numeric_match("1/2", "0.5") == 1.0
    assert _numeric_match("#### -3", "The answer is \u22123.") == 1.0


@pytest.mark.parametrize("response, letter", [
    ("The correct option is B.", "B"),
    ("After checking each, the best choice would be (c).", "C"),
    ("The answer is: $\\boxed{B}$", "B"),
    ("So we get \\boxed{\\text{C}}", "C"),
    ("A is a common trap; the correct option is D", "D"),
    ("ANSWER IS D. A is incorrect.", "D"),
    ("The correct option is a good one", scoring.INVALID),
])
def test_letter_answers_in_common_phrasings_are_extracted(response, letter):
    """MMLU-Pro/GPQA: "the correct option is X" and `\\boxed{X}` were `[invalid]`, scored wrong."""
    assert scoring.extract_letter(response) == letter


@pytest.mark.parametrize("text, language, values", [
    ("30 - 2 = 28", "en", [30, 2, 28]),  # a subtraction: no -2
    ("30-2", "en", [30, 2]),
    ("a loss of -$3 and $-4, then $ -5", "en", [-3, -4, -5]),
    ("$30 - $2 = $28", "en", [30, 2, 28]),  # a subtraction of amounts
    ("x2 plus H2O", "en", []),  # digits inside a word are not numbers
    ("共有18元，还剩3元", "zh", [18, 3]),  # Chinese writes numbers against its letters
    ("12,3456 and 1,234,56", "en", []),  # invalid groups: no number, nor the numbers either side of a comma
    ("1.234,5 und 2.5", "de", [Decimal("1234.5"), Decimal("2.5")]),
    ("1,234.5 and 2,5", "en", [Decimal("1234.5")]),  # English has no decimal comma: 2,5 is no number
    ("12,34,567", "bn", [1234567]),
    ("12,34,567", "en", []),  # lakh groups only where the language writes them
    ("1 234 et 5", "fr", [1234, 5]),
    ("1 234 and 5", "en", [1, 234, 5]),
    ("in 2 1/2 hours", "en", [Decimal("2.5")]),
])
def test_numbers_in_text_as_the_language_writes_them(text, language, values):
    assert scoring.numbers_in(text, language) == [Decimal(v) for v in values]


def test_an_unknown_language_is_refused():
    with pytest.raises(ValueError, match="known: en, de"):
        scoring.parse_number("1", "xx")


# --- numbers through every filter of each numeric task: sign, decimal mark and grouping ------------------------------

# How each language of the pack writes numbers (CLDR's group and decimal symbols, written out here rather than read
# from scoring.NUMBER_FORMATS): (group mark, decimal mark, its digits, its answer phrase, its full stop, 1234567
# grouped as it groups it). Thai ends a sentence with no mark.
LANGUAGES = {
    "en": (",", ".", "0123456789", "The answer is", ".", "1,234,567"),
    "de": (".", ",", "0123456789", "Die Antwort lautet", ".", "1.234.567"),
    "es": (".", ",", "0123456789", "La respuesta es", ".", "1.234.567"),
    "fr": ("\u202f", ",", "0123456789", "La réponse est", ".", "1\u202f234\u202f567"),
    "ru": ("\u00a0", ",", "0123456789", "Ответ —", ".", "1\u00a0234\u00a0567"),
    "sw": (",", ".", "0123456789", "Jibu ni", ".", "1,234,567"),
    "bn": (",", ".", "০১২৩৪৫৬৭৮৯", "উত্তর হল", "।", "১২,৩৪,৫৬৭"),  # lakh groups, Bengali digits
    "te": (",", ".", "0123456789", "సమాధానం", ".", "12,34,567"),
    "th": (",", ".", "0123456789", "คำตอบคือ", "", "1,234,567"),
    "ja": (",", ".", "0123456789", "答えは", "。", "1,234,567"),
    "zh": (",", ".", "0123456789", "答案是", "。", "1,234,567"),
}


def written(number: str, language: str) -> str:
    """`number`, written in English style (`,` groups, `.` decimal mark), as `language` writes it."""
    group, decimal, digits, *_ = LANGUAGES[language]
    table = {",": group, ".": decimal} | {str(i): d for i, d in enumerate(digits)}
    return "".join(table.get(c, c) for c in number)


# (response's number, gold, scores): English style, as `written` turns them into each language's. Each pair
# differs only in its sign, only in its decimal mark, or only in its grouping marks; `1.234` is the number the
# language writes so (one and a fraction), and the gold is read as its language writes numbers, as the response is.
PAIRS = [
    ("-5", "5", 0), ("5", "-5", 0), ("\u22125", "5", 0), ("\u22125", "-5", 1), ("-5", "-5", 1), ("-2.5", "2.5", 0),
    ("2.5", "25", 0), ("25", "2.5", 0), ("1.2", "12", 0), ("12", "1.2", 0), ("2.5", "2.5", 1), ("2.50", "2.5", 1),
    ("5.0", "5", 1),
    ("GROUPED", "1234567", 1), ("1234567", "1234567", 1), ("1.234", "1234", 0), ("1.234", "1.234", 1),
    ("1,234", "1.234", 0), ("0,125", "125", 0), ("0.125", "125", 0),
]
# Each numeric task: (language(s), response around a number, its table metric, how the gold is written in the doc).
NUMERIC_TASKS = {
    "gsm8k": (["en"], "She sells them all.\n#### {}", "numeric_match,numeric-extract",
              lambda g: {"answer": f"#### {g}"}),
    "mgsm": (list(LANGUAGES), "{phrase} {}{stop}", "numeric_match,numeric-extract", lambda g: {"answer_number": g}),
    "math500": (["en"], "Final Answer: The final answer is ${}$. I hope it is correct.", "exact_match,none",
                lambda g: {"answer": g}),
    "cmath": (["zh"], "答案：{}", "accuracy,none", lambda g: {"golden": g}),
    "bbh": (["en"], "Step by step, the answer is {}.", "exact_match,answer-extract", lambda g: {"target": g}),
}
CASES = [(name, language, *pair) for name, (languages, *_) in NUMERIC_TASKS.items() for language in languages
         for pair in PAIRS]


@pytest.fixture(scope="module")
def numeric_tasks(tmp_path_factory):
    """The pack's numeric tasks, on a data folder of one row each (GSM8K, MATH-500) or the imported fixtures."""
    from attnres_hf.eval import data, harness

    folder = tmp_path_factory.mktemp("numeric-data")
    data.write_benchmark(folder, "gsm8k", {"test": [{"question": "q", "answer": "#### 1"}]}, force=False)
    data.write_benchmark(folder, "math500", {"test": [{"problem": "q", "solution": "$\\boxed{1}$", "answer": "1",
                                                      "level": 1, "unique_id": "t/0"}]}, force=False)
    fixtures = Path(__file__).parent / "fixtures" / "eval"
    for name in ("mgsm", "cmath", "bbh"):
        data.import_benchmark(name, fixtures / name, folder)
    loaded = harness.task_manager(folder).load([data.BENCHMARKS[name].task for name in NUMERIC_TASKS])["tasks"]
    return {name: loaded[data.BENCHMARKS[name].task] for name in NUMERIC_TASKS}


def _filtered_scores(task, doc: dict, response: str) -> tuple[dict, dict]:
    """`({filter: filtered response}, {metric,filter: score})` of one response through the task's own filters and
    its own scoring."""
    from lm_eval.api.instance import Instance

    instance = Instance(request_type="generate_until", doc=doc, arguments=("", {}), idx=0)
    instance.resps = [response]
    for ensemble in task._filters:
        ensemble.apply([instance])
    scores = {f"{metric},{key}": value for key, filtered in instance.filtered_resps.items()
              for metric, value in task.process_results(doc, [filtered]).items()}
    return instance.filtered_resps, scores


def _lm_eval_exact_match_settings(name: str) -> dict:
    """lm-eval's own `exact_match` settings of its GSM8K / MGSM task, read from its YAML files."""
    import lm_eval.tasks
    import yaml

    path = {"gsm8k": "gsm8k/gsm8k.yaml", "mgsm": "mgsm/direct/direct_yaml"}[name]
    config = yaml.safe_load((Path(lm_eval.tasks.__file__).parent / path).read_text())
    (metric,) = config["metric_list"]
    return {k: v for k, v in metric.items() if k not in ("metric", "aggregation", "higher_is_better")}


@pytest.mark.parametrize(("name", "language", "number", "gold", "correct"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{i % len(PAIRS)}" for i, c in enumerate(CASES)])
def test_a_number_that_differs_in_sign_decimal_mark_or_grouping_never_scores(name, language, number, gold, correct,
                                                                             numeric_tasks):
    """Every filter of every numeric task, in every language of the pack: the pack's metric scores a response whose
    number differs from the gold only in sign, decimal mark or grouping as wrong, and the same number as right;
    lm-eval's filters keep lm-eval's own exact_match (and its faults), and no other metric scores them."""
    from lm_eval.api.registry import get_metric

    _, template, metric, gold_doc = NUMERIC_TASKS[name]
    _, _, _, phrase, stop, grouped = LANGUAGES[language]
    number = grouped if number == "GROUPED" else written(number, language)
    gold = gold if gold.lstrip("-").isdigit() else written(gold, language)  # integers as the dataset writes them
    response = template.format(number, phrase=phrase, stop=stop)
    doc = {"question": "q", "input": "q", "problem": "q", **gold_doc(gold)}
    if name == "mgsm":
        doc["language"] = language
    filtered, scores = _filtered_scores(numeric_tasks[name], doc, response)
    assert scores[metric] == correct, (response, gold, scores)
    if name in ("gsm8k", "mgsm"):
        lm_eval_filters = set(filtered) - {"numeric-extract"}
        assert set(scores) == {metric} | {f"exact_match,{f}" for f in lm_eval_filters}, scores
        settings = _lm_eval_exact_match_settings(name)
        target = numeric_tasks[name].doc_to_target(doc)
        for key in lm_eval_filters:
            lm_eval_score = get_metric("exact_match")(references=[target], predictions=[filtered[key]], **settings)
            assert scores[f"exact_match,{key}"] == lm_eval_score["exact_match"], key


def test_the_number_pairs_cover_every_language_of_the_pack():
    from lm_eval.tasks.mgsm.utils import LANGUAGES as MGSM_LANGUAGES

    assert set(LANGUAGES) == set(scoring.NUMBER_FORMATS) == set(MGSM_LANGUAGES) | {"zh"}


@pytest.mark.parametrize("name", ["gsm8k", "mgsm"])
def test_the_kept_lm_eval_metric_has_lm_eval_settings_and_filters(name):
    """GSM8K's and MGSM's `process_results` score lm-eval's filters with lm-eval's exact_match settings of the task,
    and those filters are lm-eval's own."""
    import lm_eval.tasks
    import yaml

    from attnres_hf.eval import harness, task_utils

    assert task_utils.LM_EVAL_EXACT_MATCH[name] == _lm_eval_exact_match_settings(name)
    path = {"gsm8k": "gsm8k/gsm8k.yaml", "mgsm": "mgsm/direct/direct_yaml"}[name]
    theirs = yaml.safe_load((Path(lm_eval.tasks.__file__).parent / path).read_text())["filter_list"]

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    ours = yaml.load((harness.task_dir() / f"offline_{name}.yaml").read_text(), Loader)["filter_list"]
    assert [f for f in ours if f["name"] != "numeric-extract"] == theirs


@pytest.mark.parametrize("text, language, values", [
    ("0.125", "de", [Decimal("0.125")]),  # a first group never starts with zero: a decimal point, not 125
    ("0,125", "en", []),  # no grouping: no number, never 125
    ("0\u202f125", "fr", []),
    ("০,১২৫", "bn", []),
    ("1,5", "en", []),  # never 1 nor 5
    ("10.125", "de", [10125]),
    ("\ufe635", "en", [-5]),  # small hyphen-minus
])
def test_a_thousands_group_follows_a_first_digit_that_is_not_zero(text, language, values):
    assert scoring.numbers_in(text, language) == [Decimal(v) for v in values]


def test_the_numeric_filter_answers_a_number():
    answers = scoring.numeric_filter([["Die Antwort lautet 1.234,50.", "nichts"]], [{"language": "de"}])[0]
    assert [a.value for a in answers] == [Decimal("1234.5"), None]
    assert [str(a) for a in answers] == ["1234.5", scoring.INVALID]  # as lm-eval logs it
