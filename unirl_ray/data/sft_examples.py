"""Supervised examples: one record -> one ``Part``, packing, and the bad-record reasons.

A record is one dict as Ray Data reads it (a JSON line, a parquet row). The formats
(``RecordSource.format``):

- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the tokenizer's
  chat template; only the assistant turns are trained (what the template emits for each assistant
  message after its generation prompt: the content and the end-of-turn token).
- ``prompt_completion``: ``{"prompt": str, "completion": str}``; the prompt is rendered exactly as
  ``CausalLMPipeline`` renders rollout prompts (chat template with its ``system_prompt`` when
  ``use_chat_template``, else plain text), then the completion and EOS, which alone are trained. So
  an SFT policy sees the same token layout in a later GRPO run.
- ``text``: ``{"text": str}``; every token is trained (continued pre-training).
- ``image_caption``: ``{"image": ..., "caption": str}``; the image is a path (relative paths are
  resolved against the record file's folder), a URI, raw bytes, or a ``{"bytes": ..., "path": ...}``
  struct (the Hugging Face datasets layout); it is resized to cover the pipeline's resolution and
  centre-cropped.

Text is truncated to ``max_length`` tokens (the start is kept). A builder raises ``BadRecord`` with
one of ``SKIP_REASONS`` when a record cannot be used; the feed counts it (``data/skipped_<reason>``)
and skips it, or fails, as ``RecordSource.on_bad_record`` says.

Packing (``pack_rows``) puts several examples into one row of at most ``max_length`` tokens; the row
keeps each example's length, so the collate restarts position ids per example and the model's
packed-sequence attention keeps examples from attending to each other.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from unirl_ray.config.checks import check_literal_args
from unirl_ray.core.sample import Part

SKIP_REASONS: tuple[str, ...] = (
    "bad_json",
    "missing_field",
    "empty_text",
    "bad_messages",
    "bad_template",
    "bad_image",
    "no_trainable_tokens",
)
"""Why a record is skipped; each is logged as ``data/skipped_<reason>``."""


class BadRecord(ValueError):
    """A record that cannot become a training example (``reason`` is one of ``SKIP_REASONS``)."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(kw_only=True)
class SFTTextPart(Part):
    """One row of token sequences for supervised training: one example, or several packed ones."""

    kind: str = "sft_text"
    """Family tag of supervised token rows."""
    input_ids: torch.Tensor
    """[L] token ids of the row (the examples one after another)."""
    target_mask: torch.Tensor
    """[L] float, 1 where the token is a trained target; 0 on the first token of every example."""
    segment_lengths: list[int]
    """Token count of each example in the row, in order (sums to L); one entry when not packed."""
    truncated: bool = False
    """The (single) record was cut to ``max_length``."""

    @property
    def num_targets(self) -> int:
        """Trained target tokens of the row."""
        return int(self.target_mask.sum().item())


@dataclass(kw_only=True)
class SFTImagePart(Part):
    """One image-caption example for flow-matching training."""

    kind: str = "sft_image"
    """Family tag of supervised image examples."""
    pixels: torch.Tensor
    """[3, H, W] float32 image in [-1, 1] at the pipeline's resolution."""
    caption: str
    """The text the image is conditioned on."""
    seed: int = 0
    """Seed of this example's noise, timestep and caption dropout (fixed by its place in the data)."""
    weight: float = 1.0
    """Loss weight: 1 for a record, 0 for a padding row (rank balance)."""


# ---------------------------------------------------------------------------------------------- records
def parse_record(row: dict[str, Any], *, json_line: bool) -> dict[str, Any]:
    """A record from a Ray Data row. ``json_line``: the row is one line of a .jsonl file read as text
    (``{"text": line, "path": file}``), parsed here so that one malformed line is one bad record."""
    if not json_line:
        return row
    try:
        record = json.loads(row["text"])
    except json.JSONDecodeError as exc:
        raise BadRecord("bad_json", f"not a JSON object ({exc.msg} at char {exc.pos})") from None
    if not isinstance(record, dict):
        raise BadRecord("bad_json", f"a JSON {type(record).__name__}, expected an object")
    if row.get("path") is not None:
        record.setdefault("path", row["path"])
    return record


def _field(record: dict[str, Any], name: str) -> Any:
    value = record.get(name)
    if value is None:
        present = sorted(k for k in record if k != "path")
        raise BadRecord("missing_field", f"no {name!r} field (fields: {present})")
    return value


def _text_field(record: dict[str, Any], name: str) -> str:
    value = _field(record, name)
    if not isinstance(value, str):
        raise BadRecord("missing_field", f"{name!r} is a {type(value).__name__}, expected a string")
    if not value.strip():
        raise BadRecord("empty_text", f"{name!r} is empty")
    return value


def preview(record: Any, limit: int = 160) -> str:
    """A short, single-line view of a record for logs and errors (binary fields summarised)."""
    def short(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray)):
            return f"<{len(value)} bytes>"
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        return value

    text = json.dumps(short(record), default=str, ensure_ascii=False) if isinstance(record, dict) else repr(record)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------- text
class TextExampleBuilder:
    """Records of a text format -> ``SFTTextPart`` (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        format: Literal["messages", "prompt_completion", "text"],
        max_length: int,
        fields: dict[str, str],
        use_chat_template: bool = True,
        system_prompt: str | None = None,
    ) -> None:
        check_literal_args(TextExampleBuilder.__init__, "TextExampleBuilder", locals())
        if format == "messages" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages records need a tokenizer with a chat_template; use prompt_completion or text records")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; SFT appends it to completions")
        self.tokenizer = tokenizer
        self.format = format
        self.max_length = int(max_length)
        self.fields = fields
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.eos = int(tokenizer.eos_token_id)

    def build(self, record: dict[str, Any]) -> SFTTextPart:
        """The record's tokens and trained-target mask, cut to ``max_length``; ``BadRecord`` if unusable."""
        if self.format == "messages":
            ids, trained = self._messages(record)
        elif self.format == "prompt_completion":
            ids, trained = self._prompt_completion(record)
        else:
            ids = self._encode(_text_field(record, self.fields["text"]), special=True) + [self.eos]
            trained = [1] * len(ids)
        truncated = len(ids) > self.max_length
        ids, trained = ids[: self.max_length], trained[: self.max_length]
        if trained:
            trained[0] = 0  # the first token has no context to be predicted from
        if sum(trained) == 0:
            why = f"after truncation to max_length={self.max_length}" if truncated else "in the record"
            raise BadRecord("no_trainable_tokens", f"no trained token {why} ({len(ids)} tokens)")
        return SFTTextPart(
            input_ids=torch.tensor(ids, dtype=torch.long),
            target_mask=torch.tensor(trained, dtype=torch.float32),
            segment_lengths=[len(ids)],
            truncated=truncated,
        )

    def _encode(self, text: str, *, special: bool) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=special)["input_ids"]]

    def _prompt_completion(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        prompt = _text_field(record, self.fields["prompt"])
        completion = _text_field(record, self.fields["completion"])
        if self.use_chat_template:
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids = self._encode(text, special=False)
        else:
            prompt_ids = self._encode(prompt, special=True)
        completion_ids = self._encode(completion, special=False)
        if not completion_ids or completion_ids[-1] != self.eos:
            completion_ids.append(self.eos)
        return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)

    def _messages(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        messages = _field(record, self.fields["messages"])
        if not isinstance(messages, list) or not messages:
            raise BadRecord("bad_messages", "'messages' must be a non-empty list of {role, content} objects")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRecord("bad_messages", f"every message needs a string role and content, got {preview(m, 80)}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not any(messages[i]["content"].strip() for i in turns):
            raise BadRecord("empty_text", "no assistant message with content to train on")
        full = self._render(messages, generation_prompt=False)
        spans = []
        for i in turns:
            start = self._render(messages[:i], generation_prompt=True)
            upto = self._render(messages[: i + 1], generation_prompt=False)
            if not (full.startswith(upto) and upto.startswith(start)):
                raise BadRecord(
                    "bad_template",
                    "the chat template does not render conversations as prefixes of each other (it rewrites earlier "
                    "turns), so assistant tokens cannot be located; use prompt_completion records",
                )
            spans.append((len(start), len(upto)))
        return self._mark_spans(full, spans)

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as exc:  # jinja errors of a template that refuses this conversation
            raise BadRecord("bad_template", f"the chat template failed on this conversation: {exc}") from None

    def _mark_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Tokens of ``text`` and 1 for those starting inside a character span (an assistant turn)."""
        if getattr(self.tokenizer, "is_fast", False):
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = [int(i) for i in enc["input_ids"]]
            trained = [int(any(a <= s < b for a, b in spans) and e > s) for s, e in enc["offset_mapping"]]
            return ids, trained
        ids = self._encode(text, special=False)  # slow tokenizers: token counts of string prefixes
        trained = [0] * len(ids)
        for a, b in spans:
            first, end = len(self._encode(text[:a], special=False)), len(self._encode(text[:b], special=False))
            for t in range(first, min(end, len(ids))):
                trained[t] = 1
        return ids, trained


# ------------------------------------------------------------------------------------------------ image
class ImageExampleBuilder:
    """Image-caption records -> ``SFTImagePart`` at ``height`` x ``width`` (see the module docstring)."""

    def __init__(self, *, height: int, width: int, fields: dict[str, str]) -> None:
        self.height, self.width = int(height), int(width)
        self.fields = fields

    def build(self, record: dict[str, Any], *, seed: int = 0) -> SFTImagePart:
        caption = _text_field(record, self.fields["caption"])
        image = self._decode(_field(record, self.fields["image"]), record.get("path"))
        return SFTImagePart(pixels=self._to_tensor(image), caption=caption, seed=seed)

    def _decode(self, value: Any, record_file: str | None) -> Any:
        from PIL import Image, UnidentifiedImageError

        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
            if value is None:
                raise BadRecord("missing_field", "the image struct has neither 'bytes' nor 'path'")
        try:
            data = value if isinstance(value, (bytes, bytearray)) else _read_bytes(str(value), record_file)
            with Image.open(io.BytesIO(data)) as img:
                return img.convert("RGB")
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise BadRecord("bad_image", f"the image does not decode ({type(exc).__name__}: {exc})") from None

    def _to_tensor(self, image: Any) -> torch.Tensor:
        """Resize to cover height x width (aspect kept), centre-crop, scale to [-1, 1]: [3, H, W]."""
        import numpy as np
        from PIL import Image

        scale = max(self.width / image.width, self.height / image.height)
        size = (max(self.width, round(image.width * scale)), max(self.height, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        left, top = (size[0] - self.width) // 2, (size[1] - self.height) // 2
        image = image.crop((left, top, left + self.width, top + self.height))
        array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _read_bytes(location: str, record_file: str | None) -> bytes:
    """Bytes of an image path: a URI, an absolute path, or a path relative to the record's file."""
    if "://" in location:
        import pyarrow.fs

        fs, inner = pyarrow.fs.FileSystem.from_uri(location)
        with fs.open_input_stream(inner) as f:
            return f.read()
    if not os.path.isabs(location) and record_file:
        location = os.path.join(os.path.dirname(record_file), location)
    with open(location, "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------- packing
def pack_rows(parts: list[SFTTextPart], max_length: int) -> list[SFTTextPart]:
    """First-fit-decreasing packing of single examples into rows of at most ``max_length`` tokens.

    Deterministic (ties keep input order); every example stays whole (they are already cut to
    ``max_length``). Rows keep the examples' lengths in ``segment_lengths``.
    """
    order = sorted(range(len(parts)), key=lambda i: (-len(parts[i].input_ids), i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(parts[i].input_ids)
        if n > max_length:
            raise ValueError(f"example of {n} tokens is longer than max_length={max_length}; truncate before packing")
        slot = next((r for r, free in enumerate(room) if free >= n), None)
        if slot is None:
            rows.append([i])
            room.append(max_length - n)
        else:
            rows[slot].append(i)
            room[slot] -= n
    return [
        SFTTextPart(
            input_ids=torch.cat([parts[i].input_ids for i in members]),
            target_mask=torch.cat([parts[i].target_mask for i in members]),
            segment_lengths=[len(parts[i].input_ids) for i in members],
            truncated=any(parts[i].truncated for i in members),
        )
        for members in rows
    ]


def padding_row(like: str, *, pad_token_id: int = 0, height: int = 0, width: int = 0) -> Part:
    """A row with nothing to learn (zero loss weight) that keeps ranks' forward counts equal."""
    if like == "sft_text":
        return SFTTextPart(
            input_ids=torch.full((2,), pad_token_id, dtype=torch.long),
            target_mask=torch.zeros(2),
            segment_lengths=[2],
        )
    return SFTImagePart(pixels=torch.zeros(3, height, width), caption="", weight=0.0)


@dataclass(kw_only=True)
class BuildStats:
    """What building one batch of records found (summed over ranks by the controller)."""

    records: int = 0
    """Records read."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Records skipped, by reason."""
    truncated: int = 0
    """Records cut to ``max_length``."""

    def as_metrics(self) -> dict[str, float]:
        """``data/records``, ``data/truncated`` and one ``data/skipped_<reason>`` per reason (0 included)."""
        out = {"data/records": float(self.records), "data/truncated": float(self.truncated)}
        out |= {f"data/skipped_{r}": float(self.skipped.get(r, 0)) for r in SKIP_REASONS}
        return out
