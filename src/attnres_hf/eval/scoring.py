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

MATH-500 and CMath score with their own functions (`task_utils.process_math`, `process_cmath`), which use the number
parsing here.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

INVALID = "[invalid]"  # lm-eval's fallback for a response with no answer

_MINUS = "\u2212\u2012\u2013\uff0d"  # Unicode minus, figure dash, en dash, full-width hyphen-minus
_CURRENCY = "$€£¥₹₩元"
# a number: optional sign, optional currency (either side of the sign), digits with 3-digit thousands groups
# (comma, thin space or apostrophe) or plain digits, optional decimals, an optional denominator (`1/2` is one number,
# a half, never its numerator 1; `1/2.5` is 0.4), optional percent
_NUMBER = re.compile(
    rf"(?<![\w./])([-+]?)\s?[{_CURRENCY}]?\s?([-+]?)((?:\d{{1,3}}(?:[,\u2009\u202f']\d{{3}})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s?/\s?(\d+(?:\.\d+)?)(?!\d|\.\d))?(%?)"
)


def _clean(text: str) -> str:
    for dash in _MINUS:
        text = text.replace(dash, "-")
    return text.replace("**", "")


def parse_number(text: str) -> Decimal | None:
    """The value of one written number, or None: currency symbols, thousands separators, trailing zeros, a trailing
    period and a percent sign (kept as written: `50%` is 50) do not change it; a sign and a decimal point are kept.

    >>> parse_number("$29.00."), parse_number("-1,234.50"), parse_number("\u22123")
    (Decimal('29'), Decimal('-1234.5'), Decimal('-3'))
    """
    match = _NUMBER.fullmatch(_clean(text).strip().rstrip(".").strip())
    return _value(match) if match else None


def _value(match: re.Match) -> Decimal | None:
    sign = "-" if "-" in match.group(1) + match.group(2) else ""
    digits = re.sub(r"[,\u2009\u202f']", "", match.group(3))
    try:
        value = Decimal(sign + digits)
        if match.group(4) is not None:  # a fraction
            value = value / Decimal(match.group(4))
    except (InvalidOperation, ZeroDivisionError):
        return None
    return value.normalize() if value != 0 else Decimal(0)


def numbers_in(text: str) -> list[Decimal]:
    """Every number written in `text`, in order (see `parse_number`)."""
    return [value for match in _NUMBER.finditer(_clean(text)) if (value := _value(match)) is not None]


def canonical_number(value: Decimal) -> str:
    """`29`, `-1234.5`, `0.5`: no exponent, no trailing zeros."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


_ANSWER_MARKERS = re.compile(r"(?:####|answer is|answer:|答案是|答案：|答案:|答：|答:)", re.IGNORECASE)


def extract_number(response: str) -> str:
    """The final numeric answer of a solution, canonical (`canonical_number`), or `[invalid]`: the first number
    after the last answer marker (GSM8K's `####`, "the answer is", "Answer:", "答案"), else the last number."""
    response = _clean(response)
    markers = list(_ANSWER_MARKERS.finditer(response))
    found = numbers_in(response[markers[-1].end():])[:1] if markers else []
    found = found or numbers_in(response)[-1:]
    return canonical_number(found[0]) if found else INVALID


def gold_number(gold: str) -> Decimal | None:
    """The gold value of a GSM8K solution (the number after `####`) or of a plain answer (`answer_number`)."""
    text = str(gold)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return parse_number(text)


def numeric_filter(resps, docs):
    """lm-eval custom filter: each response replaced by `extract_number` of it."""
    return [[extract_number(r) for r in resp] for resp, _ in zip(resps, docs)]


def numeric_match(references, predictions, **kwargs) -> float:
    """1.0 if the prediction's number (after any filter) equals the gold number as a number, else 0.0."""
    predicted = parse_number(str(predictions[0]))
    gold = gold_number(references[0])
    return float(predicted is not None and gold is not None and predicted == gold)


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
