"""An OCR reward for text rendering: does the image show the text the prompt quotes?

``OCRReward`` reads each image with a ``transformers`` OCR model (a ``VisionEncoderDecoderModel`` with its
``TrOCRProcessor``, e.g. microsoft/trocr-base-printed saved locally with ``save_pretrained``), and scores it by
``edit_similarity(recognised, target)``, where the target is the first double-quoted span of the prompt
(``'a sign that says "OPEN 24 HOURS"'``: ``OPEN 24 HOURS``; straight or curly quotes). Both strings are
lowercased and stripped of whitespace, and the score is ``max(0, 1 - levenshtein / len(target))``: 1 for the
exact text, 0 when nothing of it is there (the reward of Flow-GRPO's text-rendering task). A prompt without a
quoted span, or with an empty one, has no target: its score is ``None`` (the sample is invalid for the step,
never scored 0 by accident). A video ``[F, H, W, 3]`` scores the mean over its frames. Range [0, 1], higher
renders the text better.

``tiny=True`` builds a small random model from config (a 2-layer ViT encoder, a 2-layer TrOCR decoder and
the char-level tokenizer of the tiny LM) for tests and CPU demos: it reads gibberish. torch and transformers
are imported only when an instance is built.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from unirl_ray.rewards._models import check_arguments, device_and_dtype, image_frames

_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')


def quoted_text(prompt: str | None) -> str | None:
    """The first double-quoted span of ``prompt`` (straight ``"..."`` or curly quotes), or None."""
    found = _QUOTED.search(prompt or "")
    if found is None:
        return None
    return found.group(1) if found.group(1) is not None else found.group(2)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each 1) between ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _normalise(text: str) -> str:
    return "".join(text.lower().split())


def edit_similarity(recognised: str, target: str) -> float | None:
    """``max(0, 1 - levenshtein / len(target))`` on lowercased, whitespace-free strings; None for an empty target."""
    got, want = _normalise(recognised), _normalise(target)
    if not want:
        return None
    return max(0.0, 1.0 - levenshtein(got, want) / len(want))


def tiny_trocr(*, seed: int = 0, hidden_size: int = 32, image_size: int = 32) -> tuple[Any, Any]:
    """``(VisionEncoderDecoderModel, TrOCRProcessor)``: a random OCR model built from config; same seed, same weights."""
    import torch
    from transformers import (TrOCRConfig, TrOCRProcessor, ViTConfig, ViTImageProcessor, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)

    from unirl_ray.models.causal_lm import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    encoder = ViTConfig(hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=2 * hidden_size, image_size=image_size, patch_size=8)
    decoder = TrOCRConfig(vocab_size=len(tokenizer), d_model=hidden_size, decoder_layers=2, decoder_attention_heads=4,
                          decoder_ffn_dim=2 * hidden_size, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=tokenizer.bos_token_id)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = tokenizer.bos_token_id
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = VisionEncoderDecoderModel(config)
    images = ViTImageProcessor(size={"height": image_size, "width": image_size})
    return model, TrOCRProcessor(image_processor=images, tokenizer=tokenizer)


class OCRReward:
    """Reward fn ``(*, images, prompts, **columns) -> list[float | None]``: how well each image renders the text
    its prompt quotes (module docstring). Calls are serialised by a lock (one forward at a time per replica)."""

    def __init__(
        self,
        path: str | None = None,
        *,
        tiny: bool = False,
        seed: int = 0,
        batch_size: int = 16,
        max_new_tokens: int = 32,
        device: str = "auto",
        dtype: str | None = None,
    ):
        """
        Args:
            path: Local folder holding a ``VisionEncoderDecoderModel`` and its ``TrOCRProcessor`` (``save_pretrained``).
            tiny: Build a small random OCR model instead (tests, CPU demos).
            seed: Weight seed of the tiny model.
            batch_size: Images per generate call.
            max_new_tokens: Longest text read from an image (greedy decoding).
            device: ``"auto"`` (cuda when visible), ``"cpu"``, ``"cuda:0"``...
            dtype: Weight dtype name (``"bfloat16"``); None keeps float32.
        """
        check_arguments("OCRReward", path, tiny, "/local/trocr/folder", batch_size=batch_size, max_new_tokens=max_new_tokens)
        self.device, torch_dtype = device_and_dtype(device, dtype)
        """Where the model runs."""
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        if tiny:
            self.model, self.processor = tiny_trocr(seed=seed)
        else:
            from transformers import TrOCRProcessor, VisionEncoderDecoderModel

            path = os.path.abspath(os.path.expanduser(str(path)))
            if not os.path.isdir(path):
                raise ValueError(f"OCR model folder not found: {path}; pass a local folder saved with save_pretrained")
            self.model, self.processor = VisionEncoderDecoderModel.from_pretrained(path), TrOCRProcessor.from_pretrained(path)
        self.model.to(self.device, torch_dtype).eval()
        self._lock = threading.Lock()

    def read(self, frames: Sequence[np.ndarray]) -> list[str]:
        """The text the model reads in each uint8 ``[H, W, 3]`` frame (greedy decoding)."""
        import torch

        texts: list[str] = []
        with self._lock, torch.inference_mode():
            for lo in range(0, len(frames), self.batch_size):
                pixels = self.processor(images=list(frames[lo:lo + self.batch_size]), return_tensors="pt")["pixel_values"]
                ids = self.model.generate(pixels.to(self.device, self.model.dtype), max_new_tokens=self.max_new_tokens,
                                          do_sample=False, num_beams=1)
                texts.extend(self.processor.batch_decode(ids, skip_special_tokens=True))
        return texts

    def __call__(self, *, images: Sequence[Any], prompts: Sequence[str], **_: Any) -> list[float | None]:
        """One score per sample: the mean over its frames of ``edit_similarity(read text, quoted text)``."""
        if images is None or prompts is None or len(images) != len(prompts):
            raise ValueError("OCRReward needs images=[one per sample] and prompts=[one per sample] (image samples)")
        targets = [quoted_text(p) for p in prompts]
        has_target = [bool(t and _normalise(t)) for t in targets]
        frames, owner = image_frames(images, keep=has_target)  # no target, nothing to read
        per_sample: dict[int, list[float]] = {}
        for i, text in zip(owner, self.read(frames) if frames else []):
            per_sample.setdefault(i, []).append(edit_similarity(text, targets[i]))  # a float: the target is not empty
        return [float(np.mean(per_sample[i])) if ok else None for i, ok in enumerate(has_target)]

    def save_pretrained(self, path: str) -> None:
        """Write model and processor to ``path`` (loadable with ``OCRReward(path)``)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)
