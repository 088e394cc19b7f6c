"""What a prompt-enhancer rewrite means as a prompt: the cleaning between the LLM's text and the image model.

A rewriter writes free text: a reasoning block (``<think> ... </think>``), a preamble, the rewrite after a
marker such as ``Revised Prompt:``, quotes around it. ``RewriteFormat.clean`` keeps the rewrite only; a
rewrite that is empty or off-format (an unfinished reasoning block, a missing marker where one is
required) falls back to the user's original prompt, so the image model never draws the rewriter's
noise, and the fallback is counted (the trainer logs the fraction as ``pe/fallback_frac``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unirl_ray.config.checks import PositiveInt, check_literal_fields

_QUOTES = {'"': '"', "'": "'", "`": "`", "\u201c": "\u201d", "\u2018": "\u2019", "\u00ab": "\u00bb"}


@dataclass(kw_only=True)
class RewriteFormat:
    """How a rewrite is cut out of the rewriter's text."""

    marker: str | None = "Revised Prompt:"
    """The rewrite is the text after the last occurrence of this marker (case-insensitive); None: all of it."""
    require_marker: bool = False
    """A text without the marker is off-format (falls back to the original prompt) instead of used whole."""
    max_chars: PositiveInt = 512
    """Longest rewrite kept (cut at the last word boundary before it)."""

    def clean(self, text: str, original: str) -> tuple[str, bool]:
        """``(prompt to draw, fell_back)``: the cleaned rewrite, or ``original`` if there is none."""
        body = str(text)
        if "</think>" in body:
            body = body.rsplit("</think>", 1)[1]
        elif "<think>" in body:  # the reasoning never ended (token budget): no rewrite was written
            return original, True
        if self.marker:
            found = [m.end() for m in re.finditer(re.escape(self.marker), body, flags=re.IGNORECASE)]
            if found:
                body = body[found[-1]:]
            elif self.require_marker:
                return original, True
        body = " ".join(body.split())  # one line, single spaces
        while len(body) >= 2 and _QUOTES.get(body[0]) == body[-1]:
            body = body[1:-1].strip()
        if len(body) > self.max_chars:
            cut = body[: self.max_chars + 1]
            body = cut[: cut.rfind(" ")] if " " in cut else body[: self.max_chars]
            body = body.rstrip(" ,;:")
        if not body:
            return original, True
        return body, False


DEFAULT_INSTRUCTION = (
    "Rewrite the image prompt below into a detailed prompt for a text-to-image model: keep its subject and "
    "intent, add visual detail (composition, lighting, style). Answer with the rewrite only, after "
    "'Revised Prompt:'.\n\nPrompt: {prompt}"
)


@dataclass(kw_only=True)
class RewriteRollout(RewriteFormat):
    """The prompt enhancer's composed rollout (the ``rollout:`` block of a PE recipe): how the rewriter is
    asked (``instruction``) and how its answer is cut into the prompt the image model draws (the
    ``RewriteFormat`` fields). How many rewrites per prompt and images per rewrite: the ``group_size`` of
    the ``ar`` and ``diffusion`` sides' algorithms."""

    instruction: str = DEFAULT_INSTRUCTION
    """What the rewriter is given (through its chat template when the pipeline uses one); ``{prompt}``
    stands for the user's prompt."""

    def __post_init__(self) -> None:
        if not isinstance(self.instruction, str) or "{prompt}" not in self.instruction:
            raise ValueError("rollout.instruction must contain '{prompt}' (where the user's prompt goes), got "
                             f"{self.instruction!r}")
        try:
            self.instruction.format(prompt="")
        except (IndexError, KeyError, ValueError) as exc:
            raise ValueError(f"rollout.instruction is not a format string with only {{prompt}} in it ({exc}); "
                             "write literal braces as {{ and }}") from None
        check_literal_fields(self, "rollout")

    def ask(self, prompt: str) -> str:
        """The rewriter's input for the user's ``prompt``."""
        return self.instruction.format(prompt=prompt)
