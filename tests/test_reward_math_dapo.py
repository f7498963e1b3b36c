"""The math_dapo scorer: extraction window, last-match rule and Minerva normalisation.

Every case states the normalised prediction and the score expected from the DAPO recipe's
rules, including its known quirks (exact match only, "1,2" -> "12").
"""

import pytest

from nemo_dapo.reward.math_dapo import (
    ANSWER_WINDOW_CHARS,
    compute_score,
    extract_answer,
    normalize_final_answer,
)

# (id, solution, ground truth, expected pred, expected score)
CASES = [
    # -- finding the answer line
    ("plain", "So the result follows.\nAnswer: 42", "42", "42", 1.0),
    ("lowercase", "answer: 42", "42", "42", 1.0),
    ("upper_space_before_colon", "ANSWER : 42", "42", "42", 1.0),
    ("newline_after_colon", "Final Answer:\n42", "42", "42", 1.0),
    ("blank_lines_after_colon", "Answer:\n\n   42", "42", "42", 1.0),
    ("tab_after_colon", "Answer:\t42", "42", "42", 1.0),
    ("crlf_line_end", "Answer: 42\r\nThanks", "42", "42", 1.0),
    ("final_answer_prefix", "Final answer: 5", "5", "5", 1.0),
    ("last_match_wins", "Answer: 3\nWait, I erred.\nAnswer: 5", "5", "5", 1.0),
    ("last_match_wins_wrong", "Answer: 3\nWait, I erred.\nAnswer: 5", "3", "5", -1.0),
    ("same_line_twice_kept_whole", "Answer: 3 Answer: 4", "4", "3Answer:4", -1.0),
    ("answer_is_colon_not_matched", "The answer is: 5", "5", "", -1.0),
    ("no_answer", "I think it is 42.", "42", "", -1.0),
    ("colon_then_nothing", "Answer:", "42", "", -1.0),
    # -- text after the last '='
    ("equation", "Answer: x = 3", "3", "3", 1.0),
    ("chained_equation", "Answer: a = b = 4", "4", "4", 1.0),
    ("expression_after_equals", "Answer: y = 2x + 1", "2x+1", "2x+1", 1.0),
    ("inline_math_equation", "Answer: $x = 3$", "3", "3", 1.0),
    ("period_after_inline_math", "Answer: The value is $x = 3$.", "3", "3.", -1.0),
    # -- LaTeX wrappers
    ("boxed", "Answer: \\boxed{7}", "7", "7", 1.0),
    ("boxed_nested_braces", "Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "\\frac{1}{2}", 1.0),
    ("fbox", "Answer: \\fbox{12}", "12", "12", 1.0),
    ("inline_math", "Answer: $\\frac{3}{4}$", "\\frac{3}{4}", "\\frac{3}{4}", 1.0),
    ("textbf_choice", "Answer: \\textbf{(C)}", "(C)", "(C)", 1.0),
    ("overline", "Answer: \\overline{AB}", "AB", "AB", 1.0),
    ("boxed_ground_truth_in_math", "Answer: 7", "$\\boxed{7}$", "7", 1.0),
    ("left_right_not_stripped", "Answer: \\left( 1, 2 \\right)", "(1,2)", "\\left(1,2\\right)", -1.0),
    # -- shorthand TeX
    ("frac_shorthand", "Answer: \\frac12", "\\frac{1}{2}", "\\frac{1}{2}", 1.0),
    ("dfrac_shorthand_is_not_frac", "Answer: \\dfrac12", "\\frac{1}{2}", "\\dfrac{1}{2}", -1.0),
    ("sqrt_shorthand", "Answer: \\sqrt2", "\\sqrt{2}", "\\sqrt{2}", 1.0),
    ("coefficient_sqrt_shorthand", "Answer: 2\\sqrt3", "2\\sqrt{3}", "2\\sqrt{3}", 1.0),
    ("sqrt_in_truth", "Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", 1.0),
    # -- units, words and spacing
    ("inches", "Answer: 5 inches", "5", "5", 1.0),
    ("text_cm", "Answer: 12\\text{ cm}", "12", "12", 1.0),
    ("text_units", "Answer: 4 \\text{ units}", "4", "4", 1.0),
    ("thin_space_meters", "Answer: 6\\;\\text{meters}", "6", "6", 1.0),
    ("escaped_space_cm", "Answer: 5\\ \\text{cm}", "5", "5", 1.0),
    ("dollar_sign", "Answer: \\$5", "5", "5", 1.0),
    ("dollars_word", "Answer: 5 dollars", "5", "5", 1.0),
    ("ways", "Answer: 7 ways", "7", "7", 1.0),
    ("degrees_circ", "Answer: 90^\\circ", "90", "90", 1.0),
    ("degrees_braced_circ", "Answer: 90^{\\circ}", "90", "90", 1.0),
    ("degrees_word", "Answer: 90 degrees", "90", "90", 1.0),
    ("units_in_ground_truth", "Answer: 5", "5 \\text{ inches}", "5", 1.0),
    ("percent_kept", "Answer: 10\\%", "10", "10\\%", -1.0),
    # -- numbers
    ("thousands", "Answer: 1,000", "1000", "1000", 1.0),
    ("millions", "Answer: 1,000,000", "1000000", "1000000", 1.0),
    ("latex_thousands", "Answer: 1{,}000", "1000", "1000", 1.0),
    ("tuple_keeps_commas", "Answer: (1,2)", "(1, 2)", "(1,2)", 1.0),
    ("digit_list_collapses", "Answer: 1,2", "12", "12", 1.0),
    ("negative", "Answer: -7", "-7", "-7", 1.0),
    ("sign_matters", "Answer: -7", "7", "-7", -1.0),
    ("decimal_vs_fraction", "Answer: 0.5", "\\frac{1}{2}", "0.5", -1.0),
    ("trailing_zero_decimal", "Answer: 2.50", "2.5", "2.50", -1.0),
    ("integer_as_decimal", "Answer: 3.0", "3", "3.0", -1.0),
    ("unevaluated_power", "Answer: \\boxed{2^{10}}", "1024", "2^{10}", -1.0),
    ("trailing_period", "Answer: \\frac{1}{2}.", "\\frac{1}{2}", "\\frac{1}{2}.", -1.0),
    ("period_inside_math", "Answer: $\\frac{1}{2}.$", "\\frac{1}{2}", "\\frac{1}{2}", 1.0),
]


@pytest.mark.parametrize(
    ("solution", "ground_truth", "pred", "score"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_compute_score(solution, ground_truth, pred, score):
    result = compute_score(solution, ground_truth)
    assert result == {"score": score, "acc": score > 0, "pred": pred}


def test_case_ids_are_unique():
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 40


def test_window_boundary():
    """An answer line fully inside the last 300 characters is read; one character less is not."""
    line = "Answer: 42\n"
    inside = "reasoning " * 50 + line + "y" * (ANSWER_WINDOW_CHARS - len(line))
    cut = "reasoning " * 50 + line + "y" * (ANSWER_WINDOW_CHARS - len(line) + 1)
    assert compute_score(inside, "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score(cut, "42") == {"score": -1.0, "acc": False, "pred": ""}


def test_answer_far_before_the_end_is_not_seen():
    solution = "Answer: 42\n" + "Let me double check. " * 40
    assert extract_answer(solution) is None
    assert compute_score(solution, "42")["pred"] == ""


def test_extract_answer_returns_raw_last_line():
    assert extract_answer("Answer: 1\nanswer:  \\boxed{7} \nbye") == "\\boxed{7} "
    assert extract_answer("nothing here") is None


def test_empty_prediction_never_matches():
    """An answer that normalises to "" must not match a ground truth that also does."""
    assert normalize_final_answer("cm") == ""
    assert compute_score("Answer: cm", "cm") == {"score": -1.0, "acc": False, "pred": ""}


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("\\text{m}", ""),
        ("\\mbox{ cm}", ""),
        ("x \\text{and} y", "x,y"),
        ("x, \\text{and} y", "x,y"),
        ("10\\ldots", "10"),
        ('"yes"', "yes"),
        ("  \\frac ab  ", "\\frac{a}{b}"),
    ],
)
def test_normalize_final_answer(raw, normalised):
    assert normalize_final_answer(raw) == normalised


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [
        (lambda: compute_score(None, "1"), TypeError, "solution_str"),
        (lambda: compute_score(b"Answer: 1", "1"), TypeError, "solution_str"),
        (lambda: compute_score("Answer: 1", 1), TypeError, "ground_truth"),
        (lambda: compute_score("Answer: 1", None), TypeError, "ground_truth"),
        (lambda: compute_score("Answer: 1", "  "), ValueError, "ground_truth"),
        (lambda: normalize_final_answer(3), TypeError, "final_answer"),
        (lambda: extract_answer(None), TypeError, "solution_str"),
    ],
)
def test_invalid_inputs_name_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()
