"""Number extraction of `attnres_hf.eval.scoring` on fractions: `1/2` is one number, a half, never its numerator."""

from decimal import Decimal

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


def test_fraction_answer_scores_by_value():
    assert scoring.numeric_match(["#### 1"], [scoring.extract_number("The answer is 1/2")]) == 0.0
    assert scoring.numeric_match(["1/2"], ["0.5"]) == 1.0
    assert scoring.numeric_match(["#### -3"], [scoring.extract_number("The answer is \u22123.")]) == 1.0


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
    ("12,3456 and 1,234,56", "en", [12, 3456, 1, 234, 56]),  # invalid groups: the comma separates numbers
    ("1.234,5 und 2.5", "de", [Decimal("1234.5"), Decimal("2.5")]),
    ("1,234.5 and 2,5", "en", [Decimal("1234.5"), 2, 5]),  # English has no decimal comma
    ("12,34,567", "bn", [1234567]),
    ("12,34,567", "en", [12, 34, 567]),  # lakh groups only where the language writes them
    ("1 234 et 5", "fr", [1234, 5]),
    ("1 234 and 5", "en", [1, 234, 5]),
    ("in 2 1/2 hours", "en", [Decimal("2.5")]),
])
def test_numbers_in_text_as_the_language_writes_them(text, language, values):
    assert scoring.numbers_in(text, language) == [Decimal(v) for v in values]


def test_an_unknown_language_is_refused():
    with pytest.raises(ValueError, match="known: en, de"):
        scoring.parse_number("1", "xx")
