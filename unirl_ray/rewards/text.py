"""Rule rewards on text completions.

Every function here follows TRL's reward contract::

    fn(*, completions: list[str], prompts: list[str], **columns) -> list[float | None]

``completions[i]`` is the decoded text of sample ``i`` (``samples_to_inputs`` fills the
``completions`` column from the samples' text parts); ``columns`` holds the dataset columns (e.g.
``answer``), one list per column aligned with ``completions``. ``images`` (``None`` entries for text
samples), ``prompts`` and unused columns are accepted and ignored. Extra keyword arguments from a
reward recipe (``kwargs: {target: 50}``) arrive as keywords.

This module imports only the standard library: it runs in reward replicas without torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "char_fraction",
    "extract_answer",
    "format_reward",
    "length_target",
    "math_exact_match",
    "normalize_answer",
    "tag_format",
    "tag_pattern",
]


# ---- answer extraction and normalisation ---------------------------------------------------------

_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?")
"""A number as written in text: optional minus, digits with thousands commas, optional decimals."""
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*\}")
_DROP = ("\\$", "$", "\\%", "%", "\\,", "\\!", "\\;", "\\ ", "\\left", "\\right")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed); None if there is none or it is unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _after_hashes(text: str) -> str | None:
    """First non-empty line after the last GSM8K ``####`` marker; None without a marker."""
    head, sep, tail = text.rpartition("####")
    if not sep:
        return None
    for line in tail.splitlines():
        if line.strip():
            return line.strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text``, unnormalised: after ``####``, else ``\\boxed{}``, else the last number.

    >>> extract_answer("2 + 2 = 4\\n#### 4")
    '4'
    >>> extract_answer("so the total is \\\\boxed{3.50}")
    '3.50'
    >>> extract_answer("she pays 12 dollars, then 15.")
    '15'
    """
    if not isinstance(text, str):
        return None
    for marked in (_after_hashes(text), _last_boxed(text)):
        if marked is not None and marked.strip():
            return marked.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _to_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_answer(answer: Any) -> Fraction | str | None:
    """A comparable form of an extracted answer: an exact number when it reads as one, else folded text.

    Drops ``$`` and ``%`` signs, thousands commas, surrounding whitespace, a trailing period,
    LaTeX ``\\text{...}`` units and spacing; ``\\frac{a}{b}`` becomes ``a/b``. Numbers compare exactly
    (``Fraction``), so ``"1,234"``, ``"1234.0"`` and ``"$1234"`` are equal, and ``"3.50"`` equals ``"3.5"``.
    If the answer is not a number as a whole (``"42 apples"``), its first number is used when it has
    exactly one; other answers (``"B"``) compare as case-folded text without spaces.
    """
    if answer is None:
        return None
    if isinstance(answer, bool):
        answer = str(answer)
    if isinstance(answer, (int, float)):
        return Fraction(answer).limit_denominator(10**9) if answer == answer and abs(answer) != float("inf") else None
    text = str(answer)
    text = _FRAC.sub(r"(\1)/(\2)", text)
    text = _TEXT.sub("", text)
    for token in _DROP:
        text = text.replace(token, "")
    text = text.strip().rstrip(".").strip()
    if not text:
        return None
    plain = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text).replace(" ", "")
    number = _to_number(plain.replace("(", "").replace(")", ""))
    if number is not None:
        return number
    numbers = _NUMBER.findall(text)
    if len(numbers) == 1:
        number = _to_number(numbers[0].replace(",", ""))
        if number is not None:
            return number
    return re.sub(r"\s+", "", text).casefold()


def _reference(answer: Any) -> Fraction | str | None:
    """Normalised reference answer; a full GSM8K solution gives the number after its ``####``."""
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        return None
    if isinstance(answer, str):
        marked = _after_hashes(answer) or _last_boxed(answer)
        if marked is not None:
            return normalize_answer(marked)
    return normalize_answer(answer)


# ---- rewards ---------------------------------------------------------------------------------------


def _texts(completions: Sequence[Any] | None) -> list[str]:
    if completions is None:
        raise ValueError(
            "this reward scores text and got no 'completions'; it needs samples with text parts "
            "(RewardClient fills 'completions' from them) or a completions=[...] argument"
        )
    if isinstance(completions, str):
        raise ValueError("completions must be a list of strings (one per sample), got one string")
    return ["" if c is None else str(c) for c in completions]


def math_exact_match(
    *, completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference ``answer`` column, else 0.0.

    The completion's answer is the text after its last ``####`` (GSM8K), else its last ``\\boxed{}``,
    else its last number; the reference is taken the same way when it is a full solution (GSM8K's
    ``answer`` column ends in ``#### N``) or used as is (``"1234"``, ``1234``). Both are normalised
    by ``normalize_answer``. ``None`` (invalid, not scored) where the reference is missing or empty.
    """
    texts = _texts(completions)
    refs = [None] * len(texts) if answer is None else list(answer)
    if len(refs) != len(texts):
        raise ValueError(f"got {len(refs)} answers for {len(texts)} completions; pass one answer per sample")
    scores: list[float | None] = []
    for text, ref in zip(texts, refs):
        want = _reference(ref)
        if want is None:
            scores.append(None)
            continue
        got = normalize_answer(extract_answer(text))
        scores.append(1.0 if got is not None and type(got) is type(want) and got == want else 0.0)
    return scores


def tag_pattern(tags: Sequence[str] = ("think", "answer")) -> str:
    """Regex for ``<t1>...</t1><t2>...</t2>...``: every tag once, in order, whitespace between, nothing around.

    Tag contents may span lines but may not contain any of the tags themselves.
    """
    if isinstance(tags, str) or not tags or not all(isinstance(t, str) and re.fullmatch(r"[\w.-]+", t) for t in tags):
        raise ValueError(f"tags must be a non-empty list of tag names like ['think', 'answer'], got {tags!r}")
    any_tag = "|".join(re.escape(t) for t in tags)
    inner = rf"(?:(?!</?(?:{any_tag})>).)*"
    blocks = r"\s*".join(rf"<{re.escape(t)}>{inner}</{re.escape(t)}>" for t in tags)
    return rf"\s*{blocks}\s*"


DEFAULT_FORMAT_PATTERN = tag_pattern(("think", "answer"))
"""``<think>...</think><answer>...</answer>`` with optional whitespace around and between the blocks."""


def format_reward(*, completions: Sequence[str], pattern: str = DEFAULT_FORMAT_PATTERN, **_: Any) -> list[float]:
    """1.0 when the whole completion matches ``pattern`` (``re.fullmatch``, ``.`` matches newlines), else 0.0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"format_reward: invalid regex pattern {pattern!r}: {exc}") from None
    return [1.0 if regex.fullmatch(text) else 0.0 for text in _texts(completions)]


def tag_format(*, completions: Sequence[str], tags: Sequence[str] = ("think", "answer"), **_: Any) -> list[float]:
    """1.0 when the completion is exactly the ``tags`` blocks in order (see ``tag_pattern``), else 0.0."""
    return format_reward(completions=completions, pattern=tag_pattern(tags))


def length_target(*, completions: Sequence[str], target: int = 20, **_: Any) -> list[float]:
    """``-|target - len(completion)| / target``, lengths in characters: 0 at the target, -1 when empty.

    A fast CPU learning signal for tiny models (reward reaches ~-0.1 within ~40 GRPO steps).
    """
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0:
        raise ValueError(f"length_target: target must be a positive number of characters, got {target!r}")
    return [-abs(target - len(text)) / target for text in _texts(completions)]


def answer_char_fraction(*, completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
    """Fraction of the completion's characters equal to the row's ``answer`` column, a single character (0.0 for an
    empty completion; ``None``, not scored, where the answer is missing or longer). In [0, 1], higher is better.

    The tiny vision-language demo task: answer with the first letter of the image's colour, as often as it fits.
    """
    texts = _texts(completions)
    refs = [None] * len(texts) if answer is None else list(answer)
    if len(refs) != len(texts):
        raise ValueError(f"got {len(refs)} answers for {len(texts)} completions; pass one answer per sample")
    return [None if not isinstance(ref, str) or len(ref) != 1 else (text.count(ref) / len(text) if text else 0.0)
            for text, ref in zip(texts, refs)]


def char_fraction(*, completions: Sequence[str], char: str = "a", **_: Any) -> list[float]:
    """Fraction of the completion's characters equal to ``char`` (0.0 for an empty completion).

    The demo task for a tiny random LM: it learns to emit ``char`` within minutes on CPU.
    """
    if not isinstance(char, str) or len(char) != 1:
        raise ValueError(f"char_fraction: char must be a single character, got {char!r}")
    return [text.count(char) / len(text) if text else 0.0 for text in _texts(completions)]
