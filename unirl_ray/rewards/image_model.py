"""Learned image rewards on CLIP: a text-image score (CLIPScore-style cosine similarity), a preference score
(PickScore-style: the cosine times the model's learned ``logit_scale``), a LAION-style aesthetic predictor
(an MLP head on the CLIP image embedding) and, for videos, a temporal-consistency term
(``TemporalConsistencyReward``: the cosine of consecutive frames' CLIP image embeddings).

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

``PickScoreReward``: the same model class with PickScore's score, ``exp(logit_scale) * cos`` (a preference
fine-tune of CLIP such as PickScore_v1, saved locally with its processor; ~18-23 on real images, higher is
preferred). ``AestheticReward``: the LAION "improved aesthetic predictor": the L2-normalised image embedding
of a CLIP vision tower with projection (``CLIPVisionModelWithProjection``, ViT-L/14 for the published head)
through a linear head of 5 layers without activations, ``d -> 1024 -> 128 -> 64 -> 16 -> 1`` (dropout only in
training); about 1-10 on real images (the AVA rating scale), higher is more aesthetic; it ignores the prompt.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from unirl_ray.rewards._models import check_arguments, device_and_dtype, image_frames, mean_per_sample

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
        check_arguments(type(self).__name__, path, tiny, "/local/clip/folder", batch_size=batch_size)
        self.device, torch_dtype = device_and_dtype(device, dtype)
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
            raise ValueError(f"{type(self).__name__} needs images=[one per sample] and prompts=[one per sample] (image samples)")
        frames, owner = image_frames(images)
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
        return [self.scale * m for m in mean_per_sample(cos, owner, len(images))]

    def save_pretrained(self, path: str) -> None:
        """Write model and processor to ``path`` (loadable with ``CLIPScoreReward(path)``)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


class PickScoreReward(CLIPScoreReward):
    """Reward fn: PickScore-style preference, ``exp(logit_scale) * cos(image, prompt)`` per sample (frames: mean).

    The scale is the model's own learned temperature (100 for PickScore_v1 and OpenAI's CLIP; the tiny model
    keeps ``CLIPConfig``'s initial ``exp(2.6592) = 14.28``) unless ``scale`` is given. Same arguments as ``CLIPScoreReward``.
    """

    def __init__(self, path: str | None = None, *, scale: float | None = None, **kwargs: Any):
        super().__init__(path, **kwargs)
        if scale is None:
            scale = float(self.model.logit_scale.detach().float().exp().item())
        self.scale = float(scale)


AESTHETIC_HEAD_DIMS = (1024, 128, 64, 16)
"""Hidden widths of the LAION aesthetic head (its input is the CLIP embedding, 768 for ViT-L/14; output 1)."""


def aesthetic_head(embed_dim: int, hidden: Sequence[int] = AESTHETIC_HEAD_DIMS) -> Any:
    """The LAION aesthetic predictor's head: ``nn.Sequential`` of Linear layers with the published dropouts and
    no activations; its state dict keys are ``layers.{0,2,4,6,7}.{weight,bias}`` inside the module ``layers``
    (those of the published ``.pth``)."""
    import torch

    dims = [embed_dim, *hidden, 1]
    dropouts = [0.2, 0.2, 0.1]  # after the first three layers, as published
    modules: list[Any] = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        modules.append(torch.nn.Linear(a, b))
        if i < len(dropouts):
            modules.append(torch.nn.Dropout(dropouts[i]))

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*modules)

        def forward(self, x: Any) -> Any:
            return self.layers(x)

    return Head()


def clip_vision_tower(path: str | None, *, tiny: bool = False, seed: int = 0) -> tuple[Any, Any]:
    """``(CLIPVisionModelWithProjection, CLIPImageProcessor)`` from a local folder (a vision tower with projection,
    or a whole ``CLIPModel``, saved with ``save_pretrained``), or the tiny CLIP's vision half (``tiny=True``)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    if tiny:
        clip, processor = tiny_clip(seed=seed)
        vision_cfg = CLIPVisionConfig(**clip.config.vision_config.to_dict())
        vision_cfg.projection_dim = clip.config.projection_dim
        vision = CLIPVisionModelWithProjection(vision_cfg)
        vision.vision_model.load_state_dict(clip.vision_model.state_dict())
        vision.visual_projection.load_state_dict(clip.visual_projection.state_dict())
        return vision, processor.image_processor
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise ValueError(f"CLIP folder not found: {path}; pass a local folder saved with save_pretrained")
    return CLIPVisionModelWithProjection.from_pretrained(path), CLIPImageProcessor.from_pretrained(path)


def image_embeds(vision: Any, processor: Any, frames: Sequence[np.ndarray], device: Any) -> Any:
    """L2-normalised CLIP image embeddings (float32 ``[N, d]``) of uint8 ``[H, W, 3]`` frames."""
    import torch

    pixels = processor(images=list(frames), return_tensors="pt")["pixel_values"]
    out = vision(pixel_values=pixels.to(device, vision.dtype))
    return torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)


class AestheticReward:
    """Reward fn ``(*, images, prompts, **columns) -> list[float]``: a LAION-style aesthetic score per image
    (frames: the mean), from a CLIP vision tower's normalised image embedding and a linear head.

    Calls are serialised by a lock (one forward at a time per replica).
    """

    def __init__(
        self,
        path: str | None = None,
        head: str | None = None,
        *,
        tiny: bool = False,
        seed: int = 0,
        batch_size: int = 32,
        device: str = "auto",
        dtype: str | None = None,
    ):
        """
        Args:
            path: Local folder holding a ``CLIPVisionModelWithProjection`` (or a whole ``CLIPModel``) and its
                ``CLIPImageProcessor`` (``save_pretrained`` output), e.g. openai/clip-vit-large-patch14.
            head: The head's weights: a ``.safetensors`` file or a ``.pth`` state dict (read with
                ``torch.load(weights_only=True)``: tensors only), keys ``layers.N.weight`` / ``layers.N.bias``
                (or the same without ``layers.``). Required with ``path``.
            tiny: Build a small random CLIP vision tower and head instead (tests, CPU demos).
            seed: Weight seed of the tiny model and head.
            batch_size: Images per forward pass.
            device: ``"auto"`` (cuda when visible), ``"cpu"``, ``"cuda:0"``...
            dtype: Weight dtype name of the vision tower (``"bfloat16"``); the head runs in float32.
        """
        check_arguments("AestheticReward", path, tiny, "/local/clip/folder", batch_size=batch_size)
        if path is not None and head is None:
            raise ValueError("AestheticReward(path=...) needs head='/path/to/aesthetic_head.safetensors' (or a .pth state dict)")
        import torch

        self.device, torch_dtype = device_and_dtype(device, dtype)
        """Where the model runs."""
        self.batch_size = batch_size
        """Images per forward pass."""
        if tiny:
            self.vision, self.processor, self.head = self._tiny(seed)
        else:
            self.vision, self.processor = self._load_vision(str(path))
            self.head = self._load_head(str(head), self.vision.config.projection_dim)
        self.vision.to(self.device, torch_dtype).eval()
        self.head.to(self.device, torch.float32).eval()
        self._lock = threading.Lock()

    @staticmethod
    def _tiny(seed: int) -> tuple[Any, Any, Any]:
        import torch

        vision, processor = clip_vision_tower(None, tiny=True, seed=seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            head = aesthetic_head(vision.config.projection_dim, hidden=(16, 8, 8, 4))
            with torch.no_grad():  # a head whose scores sit around the published scale's middle
                head.layers[-1].bias.fill_(5.0)
        return vision, processor, head

    @staticmethod
    def _load_vision(path: str) -> tuple[Any, Any]:
        return clip_vision_tower(path)

    @staticmethod
    def _load_head(head: str, embed_dim: int) -> Any:
        import torch

        head = os.path.abspath(os.path.expanduser(head))
        if not os.path.isfile(head):
            raise ValueError(f"aesthetic head weights not found: {head}")
        if head.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(head)
        else:  # a published .pth: tensors only, never arbitrary pickled objects
            state = torch.load(head, map_location="cpu", weights_only=True)
        state = {k if k.startswith("layers.") else f"layers.{k}": v for k, v in state.items()}
        widths = [state[f"layers.{i}.weight"].shape[0] for i in (0, 2, 4, 6)] if "layers.6.weight" in state else None
        if widths is None or state["layers.0.weight"].shape[1] != embed_dim:
            found = {k: tuple(v.shape) for k, v in state.items()}
            raise ValueError(f"{head}: not an aesthetic head for {embed_dim}-dim CLIP embeddings (layers.0 .. layers.7 "
                             f"Linear weights expected); found {found}")
        module = aesthetic_head(embed_dim, hidden=widths)
        module.load_state_dict(state)
        return module

    def embed(self, frames: Sequence[np.ndarray]) -> Any:
        """L2-normalised image embeddings (float32 ``[N, d]``) of uint8 ``[H, W, 3]`` frames."""
        return image_embeds(self.vision, self.processor, frames, self.device)

    def __call__(self, *, images: Sequence[Any], prompts: Sequence[str] | None = None, **_: Any) -> list[float]:
        """One score per sample: the head's output on its normalised image embedding (mean over frames)."""
        import torch

        if images is None:
            raise ValueError("AestheticReward needs images=[one per sample] (image or video samples)")
        frames, owner = image_frames(images)
        scores = np.empty(len(frames), dtype=np.float64)
        with self._lock, torch.inference_mode():
            for lo in range(0, len(frames), self.batch_size):
                hi = min(lo + self.batch_size, len(frames))
                scores[lo:hi] = self.head(self.embed(frames[lo:hi])).squeeze(-1).cpu().numpy()
        return mean_per_sample(scores, owner, len(images))

    def save_pretrained(self, path: str) -> None:
        """Write the vision tower and its image processor to ``path`` and the head to
        ``path/aesthetic_head.safetensors`` (loadable with ``AestheticReward(path, head=...)``)."""
        from safetensors.torch import save_file

        self.vision.save_pretrained(path)
        self.processor.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()},
                  os.path.join(path, "aesthetic_head.safetensors"))


class TemporalConsistencyReward:
    """Reward fn ``(*, images, prompts, **columns) -> list[float]``: how steady a video is, the mean cosine
    similarity of the CLIP image embeddings of its consecutive frames, ``mean_t cos(e_t, e_{t+1})``.

    Range [-1, 1] (about 0.7-1 on real videos); 1 when every frame looks the same to CLIP, lower for flicker,
    jumps and identity changes; it ignores the prompt. A video reward is this term plus a per-frame image
    reward (every image reward scores a video as the mean over its frames), weighted in the recipe's
    ``reward.rewards``. Scores videos ``[F, H, W, 3]`` with ``F >= 2``; an image is refused (a recipe error,
    not a low score). Calls are serialised by a lock (one forward at a time per replica).
    """

    def __init__(self, path: str | None = None, *, tiny: bool = False, seed: int = 0, batch_size: int = 32,
                 device: str = "auto", dtype: str | None = None):
        """
        Args:
            path: Local folder holding a ``CLIPVisionModelWithProjection`` (or a whole ``CLIPModel``) and its
                ``CLIPImageProcessor`` (``save_pretrained`` output), e.g. openai/clip-vit-large-patch14.
            tiny: Build the tiny random CLIP vision tower instead (tests, CPU demos).
            seed: Weight seed of the tiny model.
            batch_size: Frames per forward pass.
            device: ``"auto"`` (cuda when visible), ``"cpu"``, ``"cuda:0"``...
            dtype: Weight dtype name (``"bfloat16"``); None keeps float32.
        """
        check_arguments("TemporalConsistencyReward", path, tiny, "/local/clip/folder", batch_size=batch_size)
        self.device, torch_dtype = device_and_dtype(device, dtype)
        """Where the model runs."""
        self.batch_size = batch_size
        """Frames per forward pass."""
        self.vision, self.processor = clip_vision_tower(path, tiny=tiny, seed=seed)
        self.vision.to(self.device, torch_dtype).eval()
        self._lock = threading.Lock()

    def __call__(self, *, images: Sequence[Any], prompts: Sequence[str] | None = None, **_: Any) -> list[float]:
        """One score per video: the mean cosine of its consecutive frames' embeddings."""
        import torch

        if images is None:
            raise ValueError("TemporalConsistencyReward needs images=[one video [F, H, W, 3] per sample]")
        frames, owner = image_frames(images)
        counts = np.bincount(owner, minlength=len(images))
        short = [i for i, c in enumerate(counts) if c < 2]
        if short:
            raise ValueError(f"TemporalConsistencyReward scores videos of 2 frames or more; samples {short[:5]} have "
                             f"{int(counts[short[0]])} (an image reward scores single images)")
        embeds = []
        with self._lock, torch.inference_mode():
            for lo in range(0, len(frames), self.batch_size):
                embeds.append(image_embeds(self.vision, self.processor, frames[lo:lo + self.batch_size], self.device).cpu())
        e = torch.cat(embeds).double()
        scores, start = [], 0
        for count in counts:
            clip = e[start:start + count]
            scores.append(float((clip[:-1] * clip[1:]).sum(-1).mean()))
            start += count
        return scores

    def save_pretrained(self, path: str) -> None:
        """Write the vision tower and its image processor to ``path`` (loadable with ``TemporalConsistencyReward(path)``)."""
        self.vision.save_pretrained(path)
        self.processor.save_pretrained(path)
