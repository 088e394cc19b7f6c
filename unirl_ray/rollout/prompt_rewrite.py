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

from unirl_ray.config.checks import PositiveInt

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
