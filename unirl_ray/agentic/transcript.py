"""Token in, token out: a multi-turn trajectory kept as the exact ids the engine saw and sampled.

``TokenTranscript`` starts from the chat template's rendering of the first messages (with the generation
prompt), appends every assistant turn as the ids the engine sampled (loss mask 1, their log-probs kept), and
every observation as the template's rendering of the new messages only (loss mask 0). The history is never
re-tokenised, so what is trained is token for token what was sampled (re-rendering a conversation can differ
from it: templates trim or rewrite assistant content, and text does not always tokenise back to the ids that
produced it).

Observations are rendered by diffing against a fixed base conversation: ``render(base + new, generation
prompt) - render(base)``. The base ends with an assistant message, so the ids the template writes after an
assistant turn's end token (e.g. the ``"\\n"`` after ``<|im_end|>``) are known: they are appended, with mask 0,
after each sampled turn that ended with its end token, and a turn cut short (no end token) is closed with the
end token and those ids. A template for which the base is not a prefix of the longer rendering cannot be
diffed; that is refused with the template named.

Strict check mode: ``retokenize_mismatch()`` renders the whole conversation again (the assistant turns as
decoded text) and says whether it differs from the ids kept; the trainer reports the fraction of trajectories
that differ as ``agent/retokenize_mismatch_frac`` (a measurement of what re-tokenising would have broken, not
an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from unirl_ray.config.checks import check_choice

_BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


def render_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool) -> list[int]:
    """The chat template's token ids for ``messages`` (``tools`` passed to the template as ``tools=``)."""
    out = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=True,
                                        add_generation_prompt=add_generation_prompt, return_dict=False)
    if isinstance(out, dict) or hasattr(out, "keys"):  # some tokenizers return a BatchEncoding regardless
        out = out["input_ids"]
    return [int(i) for i in out]


TruncateSide = Literal["left", "right"]
"""Which end of a long text is cut: ``right`` keeps the head, ``left`` the tail."""


def truncate_text(tokenizer: Any, text: str, max_tokens: int | None, side: TruncateSide = "right") -> tuple[str, bool]:
    """``text`` cut to ``max_tokens`` tokens (``side="right"`` keeps the head, ``"left"`` the tail); returns
    the text and whether it was cut."""
    check_choice("truncation side", side, TruncateSide)
    if max_tokens is None:
        return text, False
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    kept = ids[:max_tokens] if side == "right" else ids[len(ids) - max_tokens:]
    return tokenizer.decode(kept, skip_special_tokens=False), True


@dataclass(frozen=True)
class TurnSpan:
    """Where one sampled assistant turn lies in the transcript's ids (``ids[start:end]``)."""

    start: int
    """Index of the turn's first sampled id."""
    end: int
    """One past its last sampled id."""


class TokenTranscript:
    """One trajectory's ids, loss mask and sampling log-probs, grown turn by turn (see the module docstring)."""

    def __init__(self, tokenizer: Any, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict] | None = None,
                 turn_end_id: int | None = None) -> None:
        if not messages:
            raise ValueError("a transcript starts from at least one message (the prompt)")
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        self.turn_end_id = int(tokenizer.eos_token_id if turn_end_id is None else turn_end_id)
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.ids: list[int] = render_ids(tokenizer, self.messages, tools=self.tools, add_generation_prompt=True)
        self.loss_mask: list[int] = [0] * len(self.ids)
        self.logprobs: list[float] = [0.0] * len(self.ids)
        self.turns: list[TurnSpan] = []
        self.prompt_length = len(self.ids)
        self._base = render_ids(tokenizer, _BASE, tools=self.tools, add_generation_prompt=False)
        if self.turn_end_id not in self._base:
            raise ValueError(f"the chat template does not end an assistant turn with token id {self.turn_end_id} "
                             f"({tokenizer.convert_ids_to_tokens(self.turn_end_id)!r}); pass turn_end_id=")
        last = len(self._base) - 1 - self._base[::-1].index(self.turn_end_id)
        self.after_turn_end: list[int] = self._base[last + 1:]
        """The ids the template writes after an assistant turn's end token (e.g. a newline)."""
        self._open = False  # an assistant turn was appended and not yet closed

    @property
    def expecting_assistant(self) -> bool:
        """Whether the ids end with a generation prompt (the next thing is an assistant turn)."""
        return not self._open

    def add_assistant(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> str:
        """Append one sampled assistant turn as sampled (mask 1); returns its text (end token not included)."""
        if self._open:
            raise RuntimeError("two assistant turns in a row: add the observation in between")
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("an assistant turn of no tokens: the engine sampled nothing")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} log-probs for {len(ids)} sampled ids")
        start = len(self.ids)
        self.ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)
        self.turns.append(TurnSpan(start, len(self.ids)))
        content_ids = ids[:-1] if ids[-1] == self.turn_end_id else ids
        text = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": text})
        self._open = True
        return text

    def _closing_ids(self) -> list[int]:
        """What ends the open assistant turn the way the template does (mask 0)."""
        last = self.ids[self.turns[-1].start:self.turns[-1].end]
        return ([] if last[-1] == self.turn_end_id else [self.turn_end_id]) + self.after_turn_end

    def add_observation(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Append the template's rendering of ``messages`` (tool results, a user turn) and the generation
        prompt, mask 0; returns the ids appended."""
        if not self._open:
            raise RuntimeError("an observation answers an assistant turn: add the assistant turn first")
        messages = [dict(m) for m in messages]
        if not messages:
            raise ValueError("an observation of no messages")
        full = render_ids(self.tokenizer, [*_BASE, *messages], tools=self.tools, add_generation_prompt=True)
        if full[:len(self._base)] != self._base:
            raise ValueError("the chat template renders a conversation differently once messages follow it, so "
                             "new messages cannot be tokenised on their own; use a template whose rendering of a "
                             "conversation is a prefix of the rendering of its continuations")
        new = self._closing_ids() + full[len(self._base):]
        self.ids += new
        self.loss_mask += [0] * len(new)
        self.logprobs += [0.0] * len(new)
        self.messages += messages
        self._open = False
        return new

    def close(self) -> None:
        """End the trajectory after its last assistant turn (appends what the template writes after it)."""
        if self._open:
            new = self._closing_ids()
            self.ids += new
            self.loss_mask += [0] * len(new)
            self.logprobs += [0.0] * len(new)
            self._open = False

    def rendered_ids(self) -> list[int]:
        """The ids a full re-render of ``messages`` gives (what re-tokenising the history would train on)."""
        generation_prompt = self.messages[-1]["role"] != "assistant"
        return render_ids(self.tokenizer, self.messages, tools=self.tools, add_generation_prompt=generation_prompt)

    def retokenize_mismatch(self) -> bool:
        """Whether a full re-render differs from the ids kept (strict check mode)."""
        ids = self.ids + (self._closing_ids() if self._open else [])
        return self.rendered_ids() != ids

    def check(self) -> None:
        """The invariants the trainer asserts on every trajectory: one mask and log-prob per id, mask 1 exactly
        on the sampled turns, the prompt untouched."""
        n = len(self.ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise AssertionError(f"{n} ids, {len(self.loss_mask)} mask entries, {len(self.logprobs)} log-probs")
        sampled = [0] * n
        for span in self.turns:
            sampled[span.start:span.end] = [1] * (span.end - span.start)
        if sampled != self.loss_mask:
            raise AssertionError("the loss mask is not 1 exactly on the sampled assistant tokens")
        if any(self.loss_mask[:self.prompt_length]):
            raise AssertionError("the prompt carries loss")
