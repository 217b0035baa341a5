"""Answer extraction and comparison for the pack's generative tasks, where lm-eval's standard filters mark right
answers wrong.

lm-eval's GSM8K/MGSM filters compare number *strings*: `"...her order costs $29.00."` (gold 29) normalises to
`29.00` and fails, `#### $29` does not match the strict pattern at all, and MGSM's `ignore_punctuation` drops signs
and decimal points on both sides (`-3` equals `3`, `2.5` equals `25`). lm-eval's MMLU-Pro pattern
`answer is \\(?([A-J])\\)?` is case-sensitive and misses "The correct answer is: D" or "Answer: D". Each task keeps
lm-eval's metric under its own name, for comparability, and reports the corrected one beside it:

| task | lm-eval's (kept) | corrected (the paper-style table) |
|---|---|---|
| `offline_gsm8k` | `exact_match,strict-match`, `exact_match,flexible-extract` | `numeric_match,numeric-extract` |
| `offline_mgsm` | `exact_match,remove_whitespace`, `exact_match,flexible-extract` | `numeric_match,numeric-extract` |
| `offline_mmlu_pro` | `exact_match,custom-extract` | `exact_match,letter-extract` |
| `offline_bbh` | `exact_match,strict-match` | `exact_match,answer-extract` |

lm-eval scores every filter's output with every metric of a task, so the GSM8K and MGSM tasks score each filter
with its own metric through `score_numeric` (their `process_results`): the `numeric-extract` filter's answer is a
number (`NumericAnswer`), scored by `numeric_match` only (lm-eval's MGSM `exact_match` ignores punctuation and would
equate -3 with 3 and 2.5 with 25 on it too), and lm-eval's filters' strings by lm-eval's `exact_match` only, with
lm-eval's settings for the task (lm-eval's regex drops what it does not capture, such as the sign `\u2212` of
`\u22123`, which no later reading can restore).

MATH-500 and CMath score with their own functions (`task_utils.process_math`, `process_cmath`), which use the number
parsing here. Numbers are read as the response's language writes them (`NUMBER_FORMATS`: MGSM's document language,
Chinese for CMath, else English), the response's and the gold's alike: a sign is kept (`-`, `\u2212` and the other
minus signs of `_MINUS`; `30 - 2` is a subtraction, not -2), a decimal mark is told from a full stop, and a thousands
separator counts as one only where the language writes it and between valid groups, whose first digit is not zero
(German `1.234` is 1234 but `0.125` is 0.125; English `1,234` is 1234 and `1.234` is 1.234); digits joined by a
group mark in invalid groups are no number (English `0,125` is neither 0 nor 125). Numbers compare by value: `5.0`
is `5`, while `1.2` is never `12` nor `-5` ever `5`.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

INVALID = "[invalid]"  # lm-eval's fallback for a response with no answer

_MINUS = "\u2212\u2012\u2013\ufe63\uff0d"  # Unicode minus, figure dash, en dash, small and full-width hyphen-minus
_CURRENCY = "$€£¥₹₩元৳฿"


@dataclass(frozen=True)
class NumberFormat:
    """How a language writes numbers, after CLDR's decimal and group symbols for it.

    Attributes:
        decimal: the characters read as a decimal mark. A language that writes a decimal comma also reads a point
            as one where it cannot be a thousands separator (`2.5`, but `1.234` is 1234 in German), as its reader
            reads an English-style number.
        group: the thousands separators the language writes, read as such only between valid groups of three digits
            (also two-digit lakh groups where `indian`) after a first group that does not start with zero; digits
            joined by them in invalid groups are no number (`12,3456`, `0,500` and `1,5` in English).
        indian: lakh/crore grouping as well as groups of three (`12,34,567`), as Bengali and Telugu write it.
    """

    decimal: str
    group: str
    indian: bool = False


_SI_SPACES = "\u2009\u202f"  # thin and narrow no-break space: SI / ISO 80000 digit grouping, read in every language
_SPACES = " \u00a0" + _SI_SPACES
# The languages scored numerically: MGSM's (lm-eval's `mgsm` tasks; a test checks the two lists agree) and CMath's
# Chinese. A document without a language (GSM8K, MATH) is English.
NUMBER_FORMATS = {
    "en": NumberFormat(".", "," + _SI_SPACES),
    "de": NumberFormat(",.", "." + _SI_SPACES),
    "es": NumberFormat(",.", "." + _SI_SPACES),
    "fr": NumberFormat(",.", _SPACES),
    "ru": NumberFormat(",.", _SPACES),
    "sw": NumberFormat(".", "," + _SI_SPACES),
    "bn": NumberFormat(".", "," + _SI_SPACES, indian=True),
    "te": NumberFormat(".", "," + _SI_SPACES, indian=True),
    "th": NumberFormat(".", "," + _SI_SPACES),
    "ja": NumberFormat(".", "," + _SI_SPACES),
    "zh": NumberFormat(".", "," + _SI_SPACES),
}
# A number does not start inside a word of a script that spaces its words (x2, H2O, mp3), nor after a decimal point or
# a fraction bar; Chinese, Japanese and Thai write numbers against their letters (共有18元), so those do not block.
_NOT_AFTER = r"(?<![\d_./A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff])"


def number_format(language: str) -> NumberFormat:
    """The `NumberFormat` of a language code (`NUMBER_FORMATS`); `ValueError` naming the known codes otherwise."""
    if language not in NUMBER_FORMATS:
        raise ValueError(f"no number format for language {language!r}; known: {', '.join(NUMBER_FORMATS)}")
    return NUMBER_FORMATS[language]


@functools.cache
def _zero_digits() -> str:
    """The digit zero of every script (`0`, Bengali `০`, Telugu `౦`, Thai `๐`, full-width `０`, ...): `\\d` reads
    them all, and a thousands group never starts with one."""
    return "".join(c for c in map(chr, range(sys.maxunicode + 1)) if unicodedata.decimal(c, None) == 0)


@functools.cache
def _number_pattern(language: str) -> re.Pattern:
    """A number as `language` writes it: optional sign, optional currency (either side of the sign; no space after
    the sign, so `30 - 2` and `$30 - $2` are subtractions, not -2), the whole part of a mixed
    number (`1 2/3`), digits in valid thousands groups or plain digits, optional decimals, an optional denominator
    (`1/2` is one number, a half, never its numerator 1; `1/2.5` is 0.4), an optional percent sign."""
    fmt = number_format(language)
    group, decimal = re.escape(fmt.group), re.escape(fmt.decimal)
    # a grouped number starts with a non-zero digit: `0.125` is a decimal in German, `0,500` no grouping in English
    grouped = rf"(?![{_zero_digits()}])(?:\d{{1,3}}(?:[{group}]\d{{3}})+"
    grouped += rf"|\d{{1,2}}(?:[{group}]\d{{2}})+[{group}]\d{{3}})" if fmt.indian else ")"
    # digits joined by the language's group marks are one written number; where their groups are invalid
    # (`12,3456`, `1,234,56`, `0,125` in English, `12,34,567` outside lakh languages) they are no number, never the
    # numbers on either side of a mark (`0,125` is not 125): no number starts right after a digit and a group mark,
    # and none ends right before one (the atomic group keeps `1,5` from being read as 1)
    integer = rf"(?:{grouped}(?![{group}]?\d)|\d+)"
    return re.compile(
        rf"{_NOT_AFTER}(?<!\d[{group}])(?P<sign>[-+]?)(?:[{_CURRENCY}]\s?(?P<sign2>[-+]?))?"
        rf"(?:(?:(?P<whole>\d+)\s(?=\d+\s?/\s?\d))?"
        rf"(?>(?P<integer>{integer})(?P<decimals>[{decimal}]\d+)?)(?![{group}]\d)"
        rf"|(?P<point>\.\d+))"
        rf"(?:\s?/\s?(?P<denominator>\d+(?:[{decimal}]\d+)?)(?!\d|[{decimal}]\d))?(?P<percent>%?)"
    )


def _clean(text: str) -> str:
    for dash in _MINUS:
        text = text.replace(dash, "-")
    return text.replace("**", "")


def parse_number(text: str, language: str = "en") -> Decimal | None:
    """The value of one written number in `language`'s way of writing it (`NUMBER_FORMATS`), or None: currency
    symbols, valid thousands separators, trailing zeros, a final full stop (`.`, `。`, `।`) and a percent sign (kept
    as written: `50%` is 50) do not change it; a sign and a decimal mark are kept.

    >>> parse_number("$29.00."), parse_number("-1,234.50"), parse_number("\u22123"), parse_number("1.234,5", "de")
    (Decimal('29'), Decimal('-1234.5'), Decimal('-3'), Decimal('1234.5'))

    Raises:
        ValueError: an unknown language code.
    """
    match = _number_pattern(language).fullmatch(_clean(text).strip().rstrip(".。।").strip())
    return _value(match) if match else None


def _value(match: re.Match) -> Decimal | None:
    sign = "-" if "-" in match["sign"] + (match["sign2"] or "") else ""
    if match["point"] is not None:
        number = match["point"]
    else:
        number = re.sub(r"\D", "", match["integer"])  # drops the group separators; any script's digits are kept
        if match["decimals"]:
            number += "." + match["decimals"][1:]
    try:
        value = Decimal(number)
        if match["denominator"] is not None:  # a fraction
            value = value / Decimal(re.sub(r"\D", ".", match["denominator"]))
            if match["whole"] is not None:  # a mixed number
                value += Decimal(match["whole"])
        elif match["whole"] is not None:
            return None
    except (InvalidOperation, ZeroDivisionError):
        return None
    value = -value if sign else value
    return value.normalize() if value != 0 else Decimal(0)


def _numbers(text: str, language: str) -> list[tuple[Decimal, bool]]:
    """`(value, written as a percentage)` of every number in `text`, in order."""
    return [(value, bool(match["percent"])) for match in _number_pattern(language).finditer(_clean(text))
            if (value := _value(match)) is not None]


def numbers_in(text: str, language: str = "en") -> list[Decimal]:
    """Every number written in `text`, in order, read as `language` writes numbers (see `parse_number`)."""
    return [value for value, _ in _numbers(text, language)]


def canonical_number(value: Decimal) -> str:
    """`29`, `-1234.5`, `0.5`: no exponent, no trailing zeros."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


@functools.cache
def _answer_markers() -> re.Pattern:
    """GSM8K's `####`, "the answer is", "Answer:", CMath's "答案" / "答：", and each MGSM language's answer phrase
    and direct-answer prompt as lm-eval's `mgsm` tasks write them ("Die Antwort lautet", "Ответ —", "答えは", ...)."""
    from lm_eval.tasks.mgsm.utils import LANGUAGES

    phrases = {"####", "answer is", "answer:", "答案", "答：", "答:"}
    for language in LANGUAGES.values():
        phrases |= {language["REGEX"].split("(")[0].strip(), language["DIRECT"].strip()}
    alternatives = sorted(phrases, key=len, reverse=True)  # the longest phrase where two start alike
    return re.compile("|".join(re.escape(p).replace(r"\ ", r"\s*") for p in alternatives), re.IGNORECASE)


def answer_value(response: str, language: str = "en") -> tuple[Decimal, bool] | None:
    """The final numeric answer of a solution and whether it was written as a percentage, or None: the first number
    after the last answer marker (`_answer_markers`), else the last number; numbers read as `language` writes them.

    Raises:
        ValueError: an unknown language code.
    """
    response = _clean(response)
    markers = list(_answer_markers().finditer(response))
    found = _numbers(response[markers[-1].end():], language)[:1] if markers else []
    found = found or _numbers(response, language)[-1:]
    return found[0] if found else None


def extract_number(response: str, language: str = "en") -> str:
    """The final numeric answer of a solution (`answer_value`), canonical (`canonical_number`), or `[invalid]`."""
    found = answer_value(response, language)
    return canonical_number(found[0]) if found else INVALID


def gold_number(gold: str, language: str = "en") -> Decimal | None:
    """The gold value of a GSM8K solution (the number after `####`) or of a plain answer (MGSM's `answer_number`),
    read as `language` writes numbers, as the response is (`parse_number`); None when it is no number.

    Raises:
        ValueError: an unknown language code.
    """
    text = str(gold)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return parse_number(text, language)


@dataclass(frozen=True)
class NumericAnswer:
    """The `numeric-extract` filter's answer to one response: the value of its final number (`answer_value`), or
    None when it has none. A number, not a string, so that `score_numeric` tells it from lm-eval's filters' strings
    and no string metric compares it; `str()` of it (lm-eval's logged `filtered_resps`) is `canonical_number` of the
    value or `[invalid]`."""

    value: Decimal | None

    def __str__(self) -> str:
        return INVALID if self.value is None else canonical_number(self.value)


def document_language(doc: dict) -> str:
    """The language a document's numbers are read in: its `language` (MGSM's), English when it has none (GSM8K)."""
    return doc.get("language") or "en"


def numeric_filter(resps, docs):
    """lm-eval custom filter: each response replaced by the `NumericAnswer` of it, its numbers read as
    `document_language` writes them.

    Raises:
        ValueError: a document's language has no `NUMBER_FORMATS` entry.
    """
    return [[NumericAnswer(found[0] if (found := answer_value(r, document_language(doc))) else None) for r in resp]
            for resp, doc in zip(resps, docs)]


def numeric_match(gold: Decimal | None, predicted: Decimal | None) -> float:
    """1.0 if both are numbers of the same value (`5.0` and `5` are one number), else 0.0."""
    return float(gold is not None and predicted is not None and gold == predicted)


def score_numeric(result, target: str, language: str, exact_match: dict) -> dict[str, float]:
    """The score of one filtered response of GSM8K or MGSM against the gold `target`, by its filter's own metric.

    Args:
        result: a `NumericAnswer` (the `numeric-extract` filter's) or a string (an lm-eval filter's output).
        target: the gold answer as the task's `doc_to_target` writes it (GSM8K's solution, MGSM's `answer_number`).
        language: a `NUMBER_FORMATS` code in which the gold is read, as the `NumericAnswer`'s response was.
        exact_match: the keyword arguments of lm-eval's `exact_match` for the task (its YAML's metric settings).

    Returns:
        `{"numeric_match": 0.0 or 1.0}` for a `NumericAnswer`; `{"exact_match": ...}` for a string, as lm-eval
        scores it (its faults kept, for comparability with lm-eval's published numbers).

    Raises:
        ValueError: an unknown language code.
    """
    if isinstance(result, NumericAnswer):
        return {"numeric_match": numeric_match(gold_number(target, language), result.value)}
    from lm_eval.api.registry import get_metric

    return {"exact_match": float(get_metric("exact_match")(references=[target], predictions=[result],
                                                           **exact_match)["exact_match"])}


# an option letter: upper case on its own, either case in brackets ("(d)"); a lone lower-case "a" is English
_LETTER = r"(?:[\(\[]\s*([A-Ja-j])\s*[\)\]]|(?-i:\b([A-J])\b)(?![\w'’]))"
_LETTER_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    # "the answer is (D)", "The correct answer is: D", "answer is option D", "ANSWER IS D.", "answer would be D"
    rf"answer\s*(?:is|would be|should be|will be)\s*[:：]?\s*(?:option\s*|choice\s*)?{_LETTER}",
    # "Answer: D", "**Answer:** (D)", "Final answer: option D"
    rf"answer\s*[:：]\s*(?:option\s*|choice\s*)?{_LETTER}",
    # "(D) is correct", "option D is the correct one"
    rf"(?:option\s*|choice\s*)?{_LETTER}\s+is\s+(?:the\s+)?correct",
    # "The correct option is B.", "the best choice would be (C)"
    rf"(?:correct|right|best)\s+(?:option|choice)\s*(?:is|would be|should be|will be)\s*[:：]?\s*{_LETTER}",
    # "$\boxed{B}$", "\boxed{\text{C}}"
    rf"\\boxed\{{\s*(?:\\text(?:bf)?\{{\s*)?{_LETTER}",
)]


def extract_letter(response: str, letters: str = "ABCDEFGHIJ") -> str:
    """The option letter a chain-of-thought answer ends on, upper case, or `[invalid]`: the last match of the first
    phrasing that matches ("the answer is (X)", "answer: X", "X is correct"), case-insensitive. A statement about
    another letter after the answer ("ANSWER IS D. A is incorrect.") does not change it."""
    response = _clean(response)
    for pattern in _LETTER_PATTERNS:
        found = [(m.group(1) or m.group(2)).upper() for m in pattern.finditer(response)]
        found = [letter for letter in found if letter in letters]
        if found:
            return found[-1]
    return INVALID


def letter_filter(resps, docs):
    """lm-eval custom filter: each response replaced by `extract_letter` of it."""
    return [[extract_letter(r) for r in resp] for resp, _ in zip(resps, docs)]


_WORD_ANSWERS = ("true", "false", "yes", "no", "valid", "invalid")


def extract_bbh_answer(response: str, target: str) -> str:
    """The answer of a BIG-Bench Hard response in the form of its target: an option `(X)`, a word
    (True/False, Yes/No, valid/invalid, case as the target's), a number, or else the text after the last
    "the answer is" (the whole response when there is none), first line."""
    text = _clean(response)
    marker = list(re.finditer(r"answer is\s*:?", text, re.IGNORECASE))
    tail = text[marker[-1].end():] if marker else text
    option = re.fullmatch(r"\(([A-R])\)", target.strip())
    if option:
        found = re.findall(r"\(([A-Ra-r])\)", tail) or re.findall(r"(?<![\w'])([A-R])(?![\w'])", tail)
        return f"({found[0].upper()})" if found else INVALID
    if target.strip().lower() in _WORD_ANSWERS:
        found = re.findall(rf"\b({'|'.join(_WORD_ANSWERS)})\b", tail, re.IGNORECASE)
        return found[0].lower() if found else INVALID  # exact_match ignores case
    if parse_number(target) is not None:
        values = numbers_in(tail)
        return canonical_number(values[0]) if values else INVALID
    first = tail.strip().splitlines()[0] if tail.strip() else ""
    return first.strip()


def bbh_filter(resps, docs):
    """lm-eval custom filter: each response replaced by `extract_bbh_answer` of it, in its target's form."""
    return [[extract_bbh_answer(r, doc["target"]) for r in resp] for resp, doc in zip(resps, docs)]
