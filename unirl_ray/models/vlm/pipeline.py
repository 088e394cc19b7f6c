"""``VLMPipeline``: ``CausalLMPipeline``'s sampling and log-prob recomputation for prompts with images.

A request's images come from its dataset columns (``image_column``: one image or a list per row; a file path,
``bytes`` or a ``data:image/...;base64,`` URL). The prompt is the chat template over ``[image, ..., text]``, with
each image's ``<|image_pad|>`` expanded to its number of image tokens (``image_grid_thw``' patches / merge²),
so the prompt's token ids are exactly what the model reads; the image processor's ``pixel_values`` and
``image_grid_thw`` travel with the trajectory (``TextPart.vision``) and go into the recomputation again.
Positions are Qwen2.5-VL's 3D rotary ones (``get_rope_index``: text tokens count on, an image's tokens take
their grid's row / column), computed for the sampling loop and again in ``collate`` for training, and after
the prompt every new token's three positions are the next text position. The vision markers (image / video
placeholders and their brackets) are never sampled: their probability is 0 in the sampled distribution, when
sampling and when recomputing alike, so a completion cannot open an image slot. Everything else (the
fixed-length KV-cache loop, per-sample generators, temperature / top-p, stop tokens) is ``CausalLMPipeline``'s.

Shapes: ``B`` batch, ``L`` longest prompt + completion, ``N_p`` patches of all images of the batch.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch

from unirl_ray.config.checks import PositiveInt
from unirl_ray.core.sample import TextPart
from unirl_ray.models.causal_lm.pipeline import CausalLMPipeline, Temperature, TopP
from unirl_ray.models.vlm.bundle import VLMBundle


def load_image(value: Any) -> Any:
    """A PIL RGB image from a path, ``bytes`` (an encoded file), a ``data:image/...;base64,`` URL or a PIL image."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and "bytes" in value:  # a parquet / HF datasets image struct
        value = value["bytes"]
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value)).convert("RGB")
    if isinstance(value, str) and value.startswith("data:image"):
        return Image.open(io.BytesIO(base64.b64decode(value.split(",", 1)[1]))).convert("RGB")
    if isinstance(value, str):
        return Image.open(value).convert("RGB")
    raise ValueError(f"an image must be a path, bytes or a data:image URL, got {type(value).__name__}")


def _rope_model(module: torch.nn.Module) -> Any:
    """The object holding ``get_rope_index`` (``Qwen2_5_VLModel``) inside a (wrapped) conditional-generation model."""
    inner = getattr(module, "model", module)
    if not hasattr(inner, "get_rope_index"):
        raise ValueError(f"{type(module).__name__} has no Qwen2.5-VL get_rope_index; VLMPipeline needs a Qwen2.5-VL model")
    return inner


class VLMPipeline(CausalLMPipeline):
    """Sampling / log-prob recomputation around a ``VLMBundle`` (see the module docstring)."""

    samples_from_columns = True
    """Rollouts pass whole requests (``sample_requests``): the images are in their columns."""

    def __init__(
        self,
        bundle: VLMBundle,
        *,
        max_prompt_tokens: PositiveInt = 256,
        max_new_tokens: PositiveInt = 64,
        temperature: Temperature = 1.0,
        top_p: TopP = 1.0,
        system_prompt: str | None = None,
        image_column: str = "image",
    ) -> None:
        """
        Args:
            max_prompt_tokens: Longest prompt, image tokens included (a longer one is an error: its images cannot
                be cut).
            max_new_tokens: Tokens generated per completion (the sampling loop always runs this many steps).
            temperature: Sampling temperature; log-probs are those of ``softmax(logits / temperature)``.
            top_p: Nucleus sampling (1 disables it).
            system_prompt: A system turn before every prompt.
            image_column: The dataset column with each prompt's image (or list of images); a row without it is a
                text-only prompt.
        """
        self.image_column = image_column
        self.image_processor = bundle.image_processor
        super().__init__(bundle, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, use_chat_template=True, system_prompt=system_prompt)
        config = bundle.model.config
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        markers = (config.image_token_id, config.video_token_id, config.vision_start_token_id,
                   getattr(config, "vision_end_token_id", None))
        self.vision_marker_ids = torch.tensor(sorted({int(t) for t in markers if t is not None}), dtype=torch.long)
        """Tokens that only the processor places (image / video placeholders and their brackets): never sampled,
        so that a completion can never be read as an image slot."""

    # ------------------------------------------------------------------ prompts
    def encode_request(self, prompt: str, images: list[Any]) -> tuple[list[int], dict[str, torch.Tensor] | None]:
        """Token ids of one prompt with its images (each ``<|image_pad|>`` expanded) and the images' processor
        outputs (``pixel_values`` [patches, D], ``image_grid_thw`` [images, 3]; None without images)."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        messages = [{"role": "user", "content": content}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        vision = None
        if images:
            out = self.image_processor(images=[load_image(v) for v in images], return_tensors="pt")
            vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}
            pad = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            pieces = text.split(pad)
            if len(pieces) != len(images) + 1:
                raise ValueError(f"the chat template rendered {len(pieces) - 1} image placeholders for {len(images)} "
                                 "images; its image item must render one <|image_pad|>")
            counts = (vision["image_grid_thw"].prod(-1) // self.merge**2).tolist()
            text = pieces[0] + "".join(pad * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"a prompt with its images is {len(ids)} tokens > pipeline.max_prompt_tokens="
                             f"{self.max_prompt_tokens}; raise it or shrink the images (bundle.config.max_pixels)")
        return ids, vision

    def _images(self, request: dict[str, Any]) -> list[Any]:
        value = (request.get("columns") or {}).get(self.image_column)
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample_requests(self, requests: list[dict[str, Any]], *, module: torch.nn.Module | None = None,
                        micro_batch_size: int = 8) -> list[tuple[TextPart, str]]:
        """``(TextPart, text)`` per request (``prompt``, ``seed`` and the image column of ``columns``), in order,
        ``micro_batch_size`` at a time."""
        outputs: list[tuple[TextPart, str]] = []
        for start in range(0, len(requests), micro_batch_size):
            chunk = requests[start : start + micro_batch_size]
            encoded = [self.encode_request(r["prompt"], self._images(r)) for r in chunk]
            outputs.extend(self._sample_encoded([ids for ids, _ in encoded], [v for _, v in encoded],
                                                [int(r["seed"]) for r in chunk], module))
        return outputs

    @torch.no_grad()
    def sample(self, prompts: list[str], seeds: list[int], *, module: torch.nn.Module | None = None,
               images: list[list[Any]] | None = None) -> list[tuple[TextPart, str]]:
        """One completion per (prompt, seed), with ``images[i]`` (a list, possibly empty) in prompt ``i``."""
        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        images = images if images is not None else [[] for _ in prompts]
        encoded = [self.encode_request(p, list(imgs)) for p, imgs in zip(prompts, images)]
        return self._sample_encoded([ids for ids, _ in encoded], [v for _, v in encoded], seeds, module)

    def _sample_encoded(self, prompt_ids: list[list[int]], visions: list[dict[str, torch.Tensor] | None],
                        seeds: list[int], module: torch.nn.Module | None) -> list[tuple[TextPart, str]]:
        outputs = self.sample_ids(prompt_ids, seeds, module=module, prefill_context=visions)
        for (part, _), vision in zip(outputs, visions):
            part.vision = vision
        return outputs

    def _prefill(self, module: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, context: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """3D positions [3, B, W] of the left-padded prompts, each row's next text position [B], and the prefill's
        vision inputs (``context``: every row's images or None, in row order)."""
        visions = context or [None] * input_ids.shape[0]
        extra = _vision_inputs(visions, input_ids.device)
        positions, deltas = self._rope_index(module, input_ids, attention, extra.get("image_grid_thw"))
        return positions, attention.sum(-1) + deltas.view(-1).to(attention.device), extra

    def _mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The vision markers' logits at -1e9 (probability 0 after the softmax; finite, so the entropy stays a
        number), sampling and recomputation alike."""
        return logits.index_fill(-1, self.vision_marker_ids.to(logits.device), -1e9)

    def _step_positions(self, next_position: torch.Tensor) -> torch.Tensor:
        return next_position.view(1, -1, 1).expand(3, -1, 1)

    def _rope_index(self, module: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor,
                    grid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if grid is None:  # text only: the three axes are the 1D positions
            positions = (attention.cumsum(-1) - 1).clamp_min(0)
            return positions.unsqueeze(0).expand(3, -1, -1), torch.zeros(input_ids.shape[0], dtype=torch.long)
        types = (input_ids == self.image_token_id).int()
        return _rope_model(module).get_rope_index(input_ids, types, image_grid_thw=grid, attention_mask=attention)

    # ------------------------------------------------------------------ training
    def collate(self, parts: list[TextPart]) -> dict[str, torch.Tensor]:
        """``CausalLMPipeline.collate`` plus the parts' images (``pixel_values`` [N_p, D] and ``image_grid_thw``, in
        row order, when any part has some) and 3D ``position_ids`` [3, B, L]."""
        batch = super().collate(parts)
        extra = _vision_inputs([p.vision for p in parts], torch.device("cpu"))
        batch.update(extra)
        positions, _ = self._rope_index(self.bundle.model, batch["input_ids"], batch["attention_mask"],
                                        extra.get("image_grid_thw"))
        batch["position_ids"] = positions.contiguous()
        return batch

    def _extra_inputs(self, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """The images of ``collate`` (the 3D positions are its ``position_ids``)."""
        return {k: batch[k].to(device) for k in ("pixel_values", "image_grid_thw") if k in batch}


def _vision_inputs(visions: list[dict[str, torch.Tensor] | None], device: torch.device) -> dict[str, torch.Tensor]:
    """The rows' images as one model input: ``pixel_values`` and ``image_grid_thw`` concatenated in row order."""
    present = [v for v in visions if v is not None]
    if not present:
        return {}
    return {"pixel_values": torch.cat([v["pixel_values"] for v in present]).to(device),
            "image_grid_thw": torch.cat([v["image_grid_thw"] for v in present]).to(device)}
