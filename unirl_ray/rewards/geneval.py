"""A GenEval-style compositional reward: does the image hold the objects the prompt's metadata asks for, in the
right number, colour and place? Scored with a ``transformers`` open-vocabulary detector (OWLv2).

Each sample carries GenEval's metadata for its prompt, as a ``metadata`` column (a dict, or its JSON string:
what a prompt file should hold, since GenEval's ``position`` lists mix strings and numbers, which a columnar
reader cannot store), or as ``include`` / ``exclude`` columns::

    {"tag": "position", "include": [{"class": "dog", "count": 1},
                                    {"class": "cat", "count": 1, "position": ["left of", 0]}],
     "exclude": [{"class": "dog", "count": 2}]}

The checks, each worth the same:

- every ``include`` entry: at least ``count`` detections of ``class``; with ``color``, at least ``count`` of
  them of that colour; with ``position: [relation, j]``, the best detection of ``class`` stands in
  ``relation`` (``left of``, ``right of``, ``above``, ``below``) to the best detection of include entry ``j``:
  their box centres (as fractions of the image's width / height) differ by more than ``position_margin`` in
  that direction;
- every ``exclude`` entry: fewer than ``count`` detections of ``class`` (``include n`` + ``exclude n + 1`` is
  "exactly n").

The score is the fraction of checks met (``strict=True``: 1 when all are met, else 0, GenEval's own
measure). Range [0, 1], higher follows the prompt better. A sample without metadata scores ``None`` (invalid
for its step, never 0 by accident).

Detection (``detect``): one forward pass per image with the queries ``"a photo of a <class>"`` for every class
its metadata names, plus ``"a photo of a <colour> <class>"`` for each of ``colors`` where a colour is asked.
Every predicted box goes to the class query with its highest logit; boxes whose sigmoid score is at least
``threshold`` are kept, the same class's overlapping boxes (IoU above ``nms_iou``) suppressed greedily by
score. A kept box's colour is the colour query of its class with the highest logit. Boxes are (cx, cy, w, h)
as fractions of the original image (OWLv2 sees the image padded to a square at the bottom / right).

The model and its ``Owlv2Processor`` come from a local folder saved with ``save_pretrained`` (e.g.
google/owlv2-base-patch16-ensemble), or ``tiny=True``: a small random OWLv2 with the tiny CLIP tokenizer
(tests, CPU demos; its detections are noise). torch and transformers are imported only when an instance is
built.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unirl_ray.rewards._models import check_arguments, device_and_dtype, frames_of

GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour names."""
RELATIONS = ("left of", "right of", "above", "below")


@dataclass
class Detection:
    """One kept box: its class, sigmoid score, colour (None where no colour was asked), (cx, cy, w, h) as
    fractions of the image, and which of the detector's predicted boxes it is."""

    cls: str
    """The metadata class it was assigned to (its best class query)."""
    score: float
    """Sigmoid of that query's logit."""
    box: tuple[float, float, float, float]
    """Centre x, centre y, width, height, as fractions of the image's width / height (y grows downward)."""
    color: str | None = None
    """Its best colour query, for classes a colour is asked of."""
    index: int = -1
    """Which of the detector's predicted boxes it is."""


def requirements(metadata: Any = None, include: Any = None, exclude: Any = None) -> tuple[list[dict], list[dict]] | None:
    """``(include, exclude)`` entries of a sample, from ``metadata`` (a dict or its JSON string) or the two
    columns; None when the sample has none (or both are empty). ``ValueError`` naming what is malformed."""
    if isinstance(metadata, str) and metadata.strip():
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise ValueError(f"GenEval metadata is not JSON ({exc}): {metadata[:80]!r}") from None
    if isinstance(metadata, Mapping):
        include, exclude = metadata.get("include"), metadata.get("exclude")
    if include is None and exclude is None:
        return None
    inc, exc_ = [_entry(e, "include") for e in include or []], [_entry(e, "exclude") for e in exclude or []]
    if not inc and not exc_:
        return None
    for e in inc:
        if e.get("position") is not None:
            relation, j = e["position"]
            if relation not in RELATIONS or not 0 <= j < len(inc):
                raise ValueError(f"GenEval position {e['position']!r}: the relation must be one of {RELATIONS} and "
                                 f"the index one of the {len(inc)} include entries")
    return inc, exc_


def _entry(entry: Any, where: str) -> dict:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("class"), str) or not entry["class"].strip():
        raise ValueError(f"GenEval {where} entry {entry!r}: needs a 'class' name")
    out = {"class": entry["class"].strip(), "count": int(entry.get("count") or 1)}
    if entry.get("color"):
        out["color"] = str(entry["color"]).strip()
    position = entry.get("position")
    if position is not None:
        if isinstance(position, Mapping):  # {"relation": ..., "of": j}
            position = [position.get("relation"), position.get("of")]
        if not isinstance(position, Sequence) or len(position) != 2:
            raise ValueError(f"GenEval {where} entry {entry!r}: position must be [relation, include index]")
        out["position"] = (str(position[0]), int(position[1]))
    return out


def check(include: list[dict], exclude: list[dict], detections: list[Detection], *,
          position_margin: float = 0.1) -> list[bool]:
    """Whether each check of the module docstring holds for ``detections`` (in order: per include entry its
    count, then its colour, then its position where given; then each exclude entry)."""
    by_class: dict[str, list[Detection]] = {}
    for d in sorted(detections, key=lambda d: -d.score):
        by_class.setdefault(d.cls, []).append(d)
    results = []
    for e in include:
        found = by_class.get(e["class"], [])
        results.append(len(found) >= e["count"])
        if "color" in e:
            results.append(sum(d.color == e["color"] for d in found) >= e["count"])
        if "position" in e:
            relation, j = e["position"]
            other = by_class.get(include[j]["class"], [])
            results.append(bool(found and other) and _stands(found[0].box, relation, other[0].box, position_margin))
    for e in exclude:
        results.append(len(by_class.get(e["class"], [])) < e["count"])
    return results


def _stands(a: tuple[float, ...], relation: str, b: tuple[float, ...], margin: float) -> bool:
    """Whether box ``a`` is ``relation`` box ``b`` (centres apart by more than ``margin`` that way; y grows down)."""
    dx, dy = a[0] - b[0], a[1] - b[1]
    return {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation] > margin


def nms(boxes: Any, scores: Any, iou: float) -> list[int]:
    """Indices kept by greedy non-maximum suppression of (cx, cy, w, h) ``boxes``, best score first."""
    import torch

    x0, y0 = boxes[:, 0] - boxes[:, 2] / 2, boxes[:, 1] - boxes[:, 3] / 2
    x1, y1 = boxes[:, 0] + boxes[:, 2] / 2, boxes[:, 1] + boxes[:, 3] / 2
    area = (x1 - x0).clamp(min=0) * (y1 - y0).clamp(min=0)
    keep: list[int] = []
    for i in torch.argsort(scores, descending=True).tolist():
        if keep:
            k = torch.tensor(keep)
            w = (torch.minimum(x1[i], x1[k]) - torch.maximum(x0[i], x0[k])).clamp(min=0)
            h = (torch.minimum(y1[i], y1[k]) - torch.maximum(y0[i], y0[k])).clamp(min=0)
            inter = w * h
            overlap = inter / (area[i] + area[k] - inter).clamp(min=1e-12)
            if bool((overlap > iou).any()):
                continue
        keep.append(i)
    return keep


def tiny_owlv2(*, seed: int = 0, hidden_size: int = 32, image_size: int = 32) -> tuple[Any, Any]:
    """``(Owlv2ForObjectDetection, Owlv2Processor)``: a random 2-layer OWLv2 built from config with the tiny CLIP
    tokenizer; same seed, same weights."""
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2Processor

    try:
        from transformers import Owlv2ImageProcessorPil as ImageProcessor  # no torchvision needed
    except ImportError:  # older transformers
        from transformers import Owlv2ImageProcessor as ImageProcessor

    from unirl_ray.models.sd3.tiny import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    common = {"hidden_size": hidden_size, "intermediate_size": 2 * hidden_size, "num_hidden_layers": 2,
              "num_attention_heads": 2}
    text = {**common, "vocab_size": len(tokenizer), "max_position_embeddings": tokenizer.model_max_length,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    config = Owlv2Config(text_config=text, vision_config={**common, "image_size": image_size, "patch_size": 8},
                         projection_dim=hidden_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Owlv2ForObjectDetection(config)
    images = ImageProcessor(size={"height": image_size, "width": image_size})
    return model, Owlv2Processor(image_processor=images, tokenizer=tokenizer)


class GenEvalReward:
    """Reward fn ``(*, images, prompts, metadata | include / exclude, **columns) -> list[float | None]``: the
    fraction of the prompt's GenEval checks an image meets (module docstring). Calls are serialised by a lock
    (one forward at a time per replica)."""

    def __init__(
        self,
        path: str | None = None,
        *,
        tiny: bool = False,
        seed: int = 0,
        threshold: float = 0.2,
        nms_iou: float = 0.5,
        position_margin: float = 0.1,
        colors: Sequence[str] = GENEVAL_COLORS,
        strict: bool = False,
        device: str = "auto",
        dtype: str | None = None,
    ):
        """
        Args:
            path: Local folder holding an ``Owlv2ForObjectDetection`` and its ``Owlv2Processor`` (``save_pretrained``).
            tiny: Build a small random OWLv2 instead (tests, CPU demos).
            seed: Weight seed of the tiny model.
            threshold: Least sigmoid score of a kept detection.
            nms_iou: Overlap above which the weaker of two boxes of one class is dropped.
            position_margin: Least distance between two box centres, as a fraction of the image, for a relation.
            colors: The colour names a colour check chooses among.
            strict: Score 1 only when every check is met, else 0 (GenEval's measure); default the fraction met.
            device: ``"auto"`` (cuda when visible), ``"cpu"``, ``"cuda:0"``...
            dtype: Weight dtype name (``"bfloat16"``); None keeps float32.
        """
        check_arguments("GenEvalReward", path, tiny, "/local/owlv2/folder")
        for name, value in (("threshold", threshold), ("nms_iou", nms_iou), ("position_margin", position_margin)):
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"GenEvalReward {name} must be in [0, 1], got {value!r}")
        if not colors or not all(isinstance(c, str) and c.strip() for c in colors):
            raise ValueError(f"GenEvalReward colors must be a non-empty list of colour names, got {colors!r}")
        self.threshold, self.nms_iou, self.position_margin = float(threshold), float(nms_iou), float(position_margin)
        self.colors, self.strict = [c.strip() for c in colors], bool(strict)
        self.device, torch_dtype = device_and_dtype(device, dtype)
        """Where the model runs."""
        if tiny:
            self.model, self.processor = tiny_owlv2(seed=seed)
        else:
            from transformers import Owlv2ForObjectDetection, Owlv2Processor

            path = os.path.abspath(os.path.expanduser(str(path)))
            if not os.path.isdir(path):
                raise ValueError(f"OWLv2 folder not found: {path}; pass a local folder saved with save_pretrained")
            self.model, self.processor = Owlv2ForObjectDetection.from_pretrained(path), Owlv2Processor.from_pretrained(path)
        self.model.to(self.device, torch_dtype).eval()
        self._lock = threading.Lock()

    def queries(self, classes: Sequence[str], colored: Sequence[str]) -> list[tuple[str, str | None, str]]:
        """``(class, colour or None, text)`` of every query for an image whose metadata names ``classes`` and asks
        colours of ``colored``: the class queries first, then each colour of each coloured class."""
        out = [(c, None, f"a photo of a {c}") for c in classes]
        return out + [(c, color, f"a photo of a {color} {c}") for c in colored for color in self.colors]

    def detect(self, image: np.ndarray, classes: Sequence[str], colored: Sequence[str] = ()) -> list[Detection]:
        """Kept detections of ``classes`` in one uint8 ``[H, W, 3]`` image (colours for ``colored``)."""
        import torch

        queries = self.queries(classes, colored)
        enc = self.processor(text=[[q for _, _, q in queries]], images=[image], return_tensors="pt", padding=True)
        enc = {k: (v.to(self.device, self.model.dtype) if v.is_floating_point() else v.to(self.device)) for k, v in enc.items()}
        with torch.inference_mode():
            out = self.model(**enc)
        logits, boxes = out.logits[0].float().cpu(), out.pred_boxes[0].float().cpu()  # [boxes, queries], [boxes, 4]
        side = max(image.shape[0], image.shape[1])  # the padded square, in original pixels
        boxes = boxes * torch.tensor([side / image.shape[1], side / image.shape[0]] * 2)
        n = len(classes)
        best = logits[:, :n].argmax(-1)
        scores = torch.sigmoid(logits[:, :n].gather(1, best[:, None])[:, 0])
        found: list[Detection] = []
        for k, cls in enumerate(classes):
            idx = torch.nonzero((best == k) & (scores >= self.threshold))[:, 0]
            if not len(idx):
                continue
            color_cols = [i for i, (c, color, _) in enumerate(queries) if c == cls and color is not None]
            for j in nms(boxes[idx], scores[idx], self.nms_iou):
                box = int(idx[j])
                color = queries[color_cols[int(logits[box, color_cols].argmax())]][1] if color_cols else None
                found.append(Detection(cls, float(scores[box]), tuple(float(v) for v in boxes[box]), color, box))
        return found

    def __call__(self, *, images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Any] | None = None,
                 include: Sequence[Any] | None = None, exclude: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
        """One score per sample (a video: the mean over its frames); None for a sample without metadata."""
        import torch

        if images is None or prompts is None or len(images) != len(prompts):
            raise ValueError("GenEvalReward needs images=[one per sample] and prompts=[one per sample] (image samples)")
        n = len(images)
        per_sample = [requirements(metadata[i] if metadata is not None else None,
                                   include[i] if include is not None else None,
                                   exclude[i] if exclude is not None else None) for i in range(n)]
        stacks = [frames_of(image, i) for i, image in enumerate(images)]  # bad input: before any forward
        scores: list[float | None] = []
        with self._lock, torch.inference_mode():
            for stack, req in zip(stacks, per_sample):
                if req is None:
                    scores.append(None)
                    continue
                inc, exc_ = req
                classes = list(dict.fromkeys(e["class"] for e in [*inc, *exc_]))
                colored = list(dict.fromkeys(e["class"] for e in inc if "color" in e))
                values = []
                for frame in stack:
                    met = check(inc, exc_, self.detect(frame, classes, colored), position_margin=self.position_margin)
                    values.append(float(all(met)) if self.strict else sum(met) / len(met) if met else 1.0)
                scores.append(float(np.mean(values)))
        return scores

    def save_pretrained(self, path: str) -> None:
        """Write the detector and its processor to ``path`` (loadable with ``GenEvalReward(path)``)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


def convert(source: str, target: str) -> int:
    """Write GenEval's ``evaluation_metadata.jsonl`` (one object per line: ``prompt``, ``tag``, ``include``,
    ``exclude``) as a prompt file this reward reads: ``{"prompt": ..., "metadata": "<the line's JSON>"}`` per
    line (each checked with ``requirements``); returns the number of prompts."""
    count = 0
    with open(source) as src, open(target, "w") as out:
        for number, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requirements(row)
                prompt = row["prompt"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{source}:{number}: not a GenEval metadata line ({exc})") from None
            out.write(json.dumps({"prompt": prompt, "metadata": json.dumps(row)}) + "\n")
            count += 1
    return count


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m unirl_ray.rewards.geneval evaluation_metadata.jsonl prompts.jsonl")
    print(f"wrote {convert(sys.argv[1], sys.argv[2])} prompts to {sys.argv[2]}")
