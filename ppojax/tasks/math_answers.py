"""Numeric-answer checking for math tasks (GSM8K's ``#### <number>``, LaTeX ``\\boxed{...}``), as reward functions.

Extraction modes (what a completion's answer is):
    strict    the number after the LAST ``####`` marker (GSM8K's answer format; verl's strict GSM8K reward).
    flexible  the last number anywhere in the completion (lm-eval-harness's "flexible-extract").
    boxed     the content of the last ``\\boxed{...}``.

Numbers are compared as numbers: ``1,000`` = ``1000`` = ``1000.0``, ``$5`` = ``5``, a trailing full stop is
punctuation. The reference answer comes from the dataset's ``answer`` column (or ``solution``): either a bare
number or a GSM8K solution whose last line is ``#### <number>``.

The reward functions follow TRL's GRPOTrainer convention: ``f(completions, **columns) -> list[float | None]``,
one value per completion, None where the row has no reference answer (the reward does not apply there).
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional, Sequence

__all__ = ["extract_answer", "parse_number", "reference_answer", "answers_match", "gsm8k_strict",
           "gsm8k_flexible", "boxed_answer", "answer_format"]

# a minus sign only where it cannot be subtraction ("10-4" ends in 4, not -4)
_NUMBER = r"(?:(?<![\w)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_MARKED = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)
_BOXED = re.compile(r"\\boxed\s*\{")
MODES = ("strict", "flexible", "boxed")


def parse_number(text: str) -> Optional[Decimal]:
    """'1,234.50' / '$12' / '-3.' / ' 7 ' -> a Decimal; None if the text is no number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None  # unclosed


def extract_answer(completion: str, mode: str = "strict") -> Optional[str]:
    """The answer text a completion gives, by ``mode`` (see the module docstring); None when it gives none."""
    if mode == "strict":
        found = _MARKED.findall(completion)
        return found[-1] if found else None
    if mode == "flexible":
        found = _ANY_NUMBER.findall(completion)
        return found[-1] if found else None
    if mode == "boxed":
        return _last_boxed(completion)
    raise ValueError(f"mode={mode!r}: expected one of {MODES}")


def reference_answer(answer) -> Optional[Decimal]:
    """A dataset's answer cell -> the number: a bare number, or a GSM8K solution ending in ``#### n``."""
    if answer is None:
        return None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return parse_number(repr(answer))
    text = str(answer)
    marked = extract_answer(text, "strict")
    return parse_number(marked if marked is not None else text)


def answers_match(given: Optional[str], reference) -> bool:
    """Whether an extracted answer equals the reference (both read as numbers)."""
    if given is None:
        return False
    expected, value = reference_answer(reference), parse_number(given)
    return expected is not None and value is not None and value == expected


def _reference_column(columns: dict, n: int) -> Optional[Sequence]:
    for name in ("answer", "solution"):
        if columns.get(name) is not None:
            return columns[name]
    return None


def _accuracy(completions: Sequence[str], columns: dict, mode: str) -> list:
    references = _reference_column(columns, len(completions))
    if references is None:
        raise KeyError(f"the {mode} answer check needs the reference answer as a dataset column named 'answer' "
                       f"(or 'solution'); the columns given were {sorted(columns) or 'none'}")
    return [None if reference_answer(ref) is None else float(answers_match(extract_answer(c, mode), ref))
            for c, ref in zip(completions, references)]


def gsm8k_strict(completions: Sequence[str], **columns) -> list:
    """1.0 when the number after the completion's last ``####`` equals the reference answer, else 0.0."""
    return _accuracy(completions, columns, "strict")


def gsm8k_flexible(completions: Sequence[str], **columns) -> list:
    """1.0 when the completion's last number equals the reference answer, else 0.0 (no format needed)."""
    return _accuracy(completions, columns, "flexible")


def boxed_answer(completions: Sequence[str], **columns) -> list:
    """1.0 when the completion's last ``\\boxed{...}`` holds the reference answer, else 0.0."""
    return _accuracy(completions, columns, "boxed")


def answer_format(completions: Sequence[str], **columns) -> list:
    """1.0 when the completion states its answer as ``#### <number>``, else 0.0 (the format alone, right or not)."""
    return [float(extract_answer(c, "strict") is not None) for c in completions]
