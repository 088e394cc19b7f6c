"""A learned image reward: a CLIP text-image score (CLIPScore-style cosine similarity).

``CLIPScoreReward`` is a reward fn class: name it in a reward recipe and every reward replica builds
it once (its ``kwargs`` go to the constructor) and then calls it per batch::

    reward:
      rewards:
        brightness: {fn: unirl_ray.rewards.image.brightness, weight: 1.0}
        clip:
          fn: unirl_ray.rewards.image_model.CLIPScoreReward
          weight: 0.5
          kwargs: {path: /models/clip-vit-base-patch32, batch_size: 32, device: auto}
          app: {num_replicas: 1, ray_actor_options: {num_cpus: 1, num_gpus: 0.25}}

Placement: ``app:`` gives the model its own Serve app (``<run>-reward-clip``) with its own replicas
and resources, started before the train workers; the rule rewards keep sharing the main reward app (in the driver by default).
The driver sends every batch to both apps and combines the weighted scores.

The score of an image is ``scale * cos(image_embed, text_embed)`` of a ``transformers`` ``CLIPModel``
(the prompt is the text), as in CLIPScore (Hessel et al., 2021, which uses ``scale=2.5`` and clips at
0; here the raw cosine is kept so a policy also gets signal below 0). Video frames ``[F, H, W, 3]``
score the mean over frames. The model and its ``CLIPProcessor`` come from a local folder saved with
``save_pretrained`` (no hub access at run time), or ``tiny=True``: a small random CLIP with the
byte-level CLIP tokenizer of the tiny SD3 demo, for tests and CPU demos. torch and transformers are
imported only when an instance is built.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

TINY_IMAGE_SIZE = 32
"""Input resolution of the tiny CLIP's vision tower (images are resized to it)."""


def tiny_clip(*, seed: int = 0, hidden_size: int = 32, image_size: int = TINY_IMAGE_SIZE) -> tuple[Any, Any]:
    """``(CLIPModel, CLIPProcessor)``: a random 2-layer CLIP built from config; same seed, same weights."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from unirl_ray.models.sd3.tiny import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    common = {"hidden_size": hidden_size, "intermediate_size": 2 * hidden_size, "num_hidden_layers": 2,
              "num_attention_heads": 4, "projection_dim": hidden_size}
    text = {**common, "vocab_size": len(tokenizer), "max_position_embeddings": tokenizer.model_max_length,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {**common, "image_size": image_size, "patch_size": 8}
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=hidden_size)
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = CLIPModel(config)
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    return model, CLIPProcessor(image_processor=images, tokenizer=tokenizer)


class CLIPScoreReward:
    """Reward fn ``(*, images, prompts, **columns) -> list[float]``: ``scale * cos(image, prompt)`` per sample.

    ``images[i]`` is a uint8 ``[H, W, 3]`` image or ``[F, H, W, 3]`` frames (mean over frames).
    Calls are serialised by a lock (one forward at a time per replica).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        tiny: bool = False,
        seed: int = 0,
        scale: float = 1.0,
        batch_size: int = 32,
        device: str = "auto",
        dtype: str | None = None,
    ):
        """
        Args:
            path: Local folder holding a ``CLIPModel`` and its ``CLIPProcessor`` (``save_pretrained`` output).
            tiny: Build a small random CLIP instead (tests, CPU demos).
            seed: Weight seed of the tiny model.
            scale: Factor on the cosine similarity (CLIPScore uses 2.5).
            batch_size: Images per forward pass.
            device: ``"auto"`` (cuda when visible, e.g. with ``ray_actor_options.num_gpus``), ``"cpu"``, ``"cuda:0"``...
            dtype: Weight dtype name (``"bfloat16"``); None keeps float32.
        """
        if (path is None) == (not tiny):
            raise ValueError("CLIPScoreReward needs exactly one of path='/local/clip/folder' or tiny=True")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        import torch

        torch_dtype = getattr(torch, dtype) if dtype else torch.float32
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype like 'bfloat16', got {dtype!r}")
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        """Where the model runs."""
        self.scale = float(scale)
        """Factor on the cosine similarity."""
        self.batch_size = batch_size
        """Images per forward pass."""
        self.model, self.processor = self._load(path, tiny=tiny, seed=seed)
        self.model.to(self.device, torch_dtype).eval()
        self._lock = threading.Lock()

    @staticmethod
    def _load(path: str | None, *, tiny: bool, seed: int) -> tuple[Any, Any]:
        from transformers import CLIPModel, CLIPProcessor

        if tiny:
            return tiny_clip(seed=seed)
        path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.isdir(path):
            raise ValueError(f"CLIP folder not found: {path}; pass a local folder saved with save_pretrained")
        return CLIPModel.from_pretrained(path), CLIPProcessor.from_pretrained(path)

    def __call__(self, *, images: Sequence[Any], prompts: Sequence[str], **_: Any) -> list[float]:
        """One score per sample: the mean over its frames of ``scale * cos(image embed, prompt embed)``."""
        import torch

        if images is None or prompts is None or len(images) != len(prompts):
            raise ValueError("CLIPScoreReward needs images=[one per sample] and prompts=[one per sample] (image samples)")
        frames, owner = [], []
        for i, image in enumerate(images):
            arr = np.asarray(image)
            stack = arr[None] if arr.ndim == 3 else arr
            if stack.ndim != 4 or stack.shape[-1] != 3 or stack.dtype != np.uint8:
                raise ValueError(f"image {i}: expected uint8 [H, W, 3] or [F, H, W, 3], got {arr.dtype} {tuple(arr.shape)}")
            frames.extend(stack)
            owner.extend([i] * len(stack))
        texts = ["" if p is None else str(p) for p in prompts]
        cos = np.empty(len(frames), dtype=np.float64)
        with self._lock, torch.inference_mode():
            for lo in range(0, len(frames), self.batch_size):
                hi = min(lo + self.batch_size, len(frames))
                enc = self.processor(text=[texts[owner[j]] for j in range(lo, hi)], images=list(frames[lo:hi]),
                                     return_tensors="pt", padding=True, truncation=True).to(self.device)
                enc["pixel_values"] = enc["pixel_values"].to(self.model.dtype)
                out = self.model(**enc)
                image_emb = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)
                text_emb = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
                cos[lo:hi] = (image_emb * text_emb).sum(-1).cpu().numpy()
        sums = np.bincount(owner, weights=cos, minlength=len(images))
        counts = np.bincount(owner, minlength=len(images))
        return [float(self.scale * s / c) for s, c in zip(sums, counts)]

    def save_pretrained(self, path: str) -> None:
        """Write model and processor to ``path`` (loadable with ``CLIPScoreReward(path)``)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)
