"""The ``math_dapo`` scorer: the rule-based reward DAPO was trained with (docs/algorithm.md §10).

The model is prompted to end with a line ``Answer: <answer>``. The scorer reads only the tail
of the response, takes the last such line, normalises it with the Minerva answer
normalisation (Lewkowycz et al., 2022) and compares it to the equally normalised ground truth
by exact string equality: +1 when equal, -1 otherwise (including "no answer").

Exact matching is deliberate: it is cheap, deterministic and matches the published recipe,
so rewards are comparable with the paper. Symbolic equivalence lives in
:mod:`nemo_dapo.reward.math_verify_scorer`.

One extension beyond the public recipe (docs/algorithm.md §10): ``\\fbox{...}`` is unwrapped
like ``\\boxed{...}``.
"""

from __future__ import annotations

import re

from nemo_dapo.reward.validation import require_ground_truth, require_str

# The public recipe looks at the last 300 characters only: the longest MATH-500 answer is
# 159 characters, and a short window keeps the regex cheap on 20k-token responses.
ANSWER_WINDOW_CHARS = 300

# ``.`` stops at a newline, so one answer line is captured; ``\s*`` after the colon may still
# cross a newline, so "Answer:\n42" is read as "42".
ANSWER_PATTERN = re.compile(r"Answer\s*:\s*(.+)", flags=re.IGNORECASE)

CORRECT_SCORE = 1.0
INCORRECT_SCORE = -1.0

# Minerva substitutions, applied in this order (order matters: articles go before spaces).
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Units, filler words and TeX spacing that carry no value. The DAPO recipe's list: the
# Minerva list without "ft". Removal is plain substring removal, in this order.
# fmt: off
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# fmt: on

# (pattern, replacement) pairs that keep the content of a LaTeX wrapper. ``\text`` and
# friends take the shortest brace group; ``\boxed``/``\fbox`` take everything up to the last
# brace so nested braces such as ``\boxed{\frac{1}{2}}`` survive.
_FIRST_INLINE_MATH = (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$")
_WRAPPERS = (
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"\\fbox\{(.*)\}"), r"\1"),
)
# Shorthand TeX: ``\frac12`` -> ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``.
_SHORTHAND_FRAC = (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}")
_SHORTHAND_SQRT = (re.compile(r"sqrt([^{])"), r"sqrt{\1}")


def extract_answer(solution_str: str) -> str | None:
    """Return the raw text of the last ``Answer:`` line in the response tail, or None.

    Only the last :data:`ANSWER_WINDOW_CHARS` characters are searched, as in the recipe, so
    an answer stated early and followed by a long ramble is not seen.
    """
    require_str(solution_str, "solution_str")
    matches = ANSWER_PATTERN.findall(solution_str[-ANSWER_WINDOW_CHARS:])
    return matches[-1] if matches else None


def _replace_all(text: str, pairs) -> str:
    """Apply plain-substring replacements in order."""
    for before, after in pairs:
        text = text.replace(before, after)
    return text


def _unwrap_latex(text: str) -> str:
    """Keep the math of the first ``$...$`` and the contents of text/box wrappers."""
    pattern, replacement = _FIRST_INLINE_MATH
    text = pattern.sub(replacement, text)
    for pattern, replacement in _WRAPPERS:
        text = pattern.sub(replacement, text)
    return text


def _expand_shorthand_tex(text: str) -> str:
    """Give ``\\frac`` and ``\\sqrt`` explicit braces so both spellings compare equal."""
    for pattern, replacement in (_SHORTHAND_FRAC, _SHORTHAND_SQRT):
        text = pattern.sub(replacement, text)
    return text


def _drop_thousands_separators(text: str) -> str:
    """``1,000`` -> ``1000``, only when the commas sit in a plain integer (not in a tuple)."""
    without_commas = text.replace(",", "")
    return without_commas if without_commas.isdigit() else text


def normalize_final_answer(final_answer: str) -> str:
    """Minerva normalisation of a final answer, so that formatting noise does not matter.

    Keeps the text after the last ``=`` (``x = 5`` -> ``5``), strips spaces, units and LaTeX
    wrappers, expands shorthand fractions/roots and drops thousands separators.
    """
    text = require_str(final_answer, "final_answer").split("=")[-1]
    text = _replace_all(text, SUBSTITUTIONS)
    text = _replace_all(text, ((expr, "") for expr in REMOVED_EXPRESSIONS))
    text = _unwrap_latex(text)
    text = _expand_shorthand_tex(text)
    text = text.replace("$", "")
    text = _drop_thousands_separators(text)
    return text.strip()


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """Score one response: ``{"score": +1.0 | -1.0, "acc": bool, "pred": str}``.

    ``pred`` is the normalised prediction ("" when the tail has no ``Answer:`` line). An empty
    prediction is never correct, so a ground truth that normalises to "" cannot reward an
    answerless response. Non-str inputs raise TypeError, an empty ground truth ValueError.
    """
    require_str(solution_str, "solution_str")
    require_ground_truth(ground_truth, "ground_truth")
    raw_answer = extract_answer(solution_str)
    pred = normalize_final_answer(raw_answer) if raw_answer is not None else ""
    correct = pred != "" and pred == normalize_final_answer(ground_truth)
    return {"score": CORRECT_SCORE if correct else INCORRECT_SCORE, "acc": correct, "pred": pred}
