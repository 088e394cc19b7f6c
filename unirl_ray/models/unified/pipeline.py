"""``UnifiedPipeline``: the think / recaption segment, then the image drawn from prompt + generated tokens.

Two stage views over one ``UnifiedBundle``, each what its stage algorithm expects:

- ``text`` (a ``CausalLMPipeline`` on the unified module's text forward): sampling with recorded
  log-probs of the temperature-scaled distribution, and ``collate`` / ``token_log_probs`` for GRPO;
- ``image`` (a ``FlowSDEPipeline``): the Flow-GRPO SDE sampler with per-step log-probs, conditioned on
  the token ids the text stage wrote (token in, never re-tokenised), and ``collate`` / ``step_log_prob``
  for Flow-GRPO. A DiffusionPart's ``cond`` holds ``cond_ids`` / ``cond_mask`` (right-padded to
  ``max_prompt_tokens + max_new_tokens``).

``sample_requests`` is what a trainside rollout calls: requests that share a ``text_id`` share one text
segment (written once, from ``text_seed``), and each request is one image (from its ``seed``). Every
output holds the Parts ``[TextPart (stage "text", part_id = text_id), DiffusionPart (stage "image")]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt
from unirl_ray.core.sample import DiffusionPart, Part, TextPart
from unirl_ray.models.causal_lm.pipeline import CausalLMPipeline, Temperature, TopP
from unirl_ray.models.flow_sde import FlowSDEPipeline, GuidanceScale, NoiseLevel, decode_image_latents

TEXT_STAGE, IMAGE_STAGE = "text", "image"
"""The stages of a unified sample (``Part.stage``) and the keys of ``UnifiedPipeline.stage_pipelines``."""


class TextView:
    """What ``CausalLMPipeline`` reads of a bundle: the module to call (the bundle's ``attr``) and the tokenizer."""

    def __init__(self, bundle: Any, attr: str) -> None:
        self._bundle, self._attr = bundle, attr

    @property
    def model(self) -> torch.nn.Module:
        return getattr(self._bundle, self._attr)

    @property
    def tokenizer(self) -> Any:
        return self._bundle.tokenizer


class UnifiedImagePipeline(FlowSDEPipeline):
    """Flow-GRPO sampling / recomputation of the unified model's image block (see the module docstring)."""

    def __init__(self, bundle: Any, *, text: CausalLMPipeline, num_inference_steps: int, height: int, width: int,
                 noise_level: float, guidance_scale: float, max_text_tokens: int, sde_window_size: int | None,
                 sde_window_range: list[int] | tuple[int, int] | None, share_initial_noise: bool) -> None:
        self.height, self.width, self.text = height, width, text
        super().__init__(bundle, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                         noise_level=noise_level, max_sequence_length=max_text_tokens, sde_window_size=sde_window_size,
                         sde_window_range=sde_window_range, share_initial_noise=share_initial_noise)

    def validate_shape(self) -> None:
        shape = self.bundle.transformer.image_config()
        factor = shape["vae_scale_factor"] * shape["patch_size"]
        for name in ("height", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % factor:
                raise ValueError(f"pipeline.{name}={value!r} must be a positive multiple of {factor} (VAE scale factor x "
                                 "patch size of this model)")
        if self.guidance_scale != 1.0:
            raise ValueError(f"pipeline.guidance_scale={self.guidance_scale}: the unified pipeline samples without "
                             "classifier-free guidance; set pipeline.guidance_scale: 1.0")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        shape = self.bundle.transformer.image_config()
        f = shape["vae_scale_factor"]
        return (shape["latent_channels"], self.height // f, self.width // f)

    def _compute_sigmas(self) -> torch.Tensor:
        scheduler = self._euler_scheduler()
        kwargs = {"mu": float(scheduler.config.get("base_shift", 0.5))} if scheduler.config.get("use_dynamic_shifting") else {}
        return self._schedule_sigmas(scheduler, **kwargs)

    def cond_from_ids(self, ids: list[list[int]]) -> dict[str, torch.Tensor]:
        """``cond_ids`` / ``cond_mask`` [B, max_sequence_length] (right-padded) of the given text token ids."""
        width = self.max_sequence_length
        too_long = [len(row) for row in ids if len(row) > width or not row]
        if too_long:
            raise ValueError(f"an image's text has {too_long[0]} tokens; it must have 1..{width} "
                             "(max_prompt_tokens + max_new_tokens)")
        cond_ids = torch.full((len(ids), width), int(self.text.pad_token_id), dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for b, row in enumerate(ids):
            cond_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, : len(row)] = 1
        return {"cond_ids": cond_ids, "cond_mask": mask}

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """An image straight from prompts (no think segment): the text stage's prompt encoding."""
        return self.cond_from_ids(self.text.encode_prompts(prompts))

    def _cond_keys(self) -> tuple[str, ...]:
        return ("cond_ids", "cond_mask")

    def _velocity(self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor,
                  cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return module(input_ids=cond["cond_ids"].long(), attention_mask=cond["cond_mask"].long(),
                      image_latents=x.to(self.bundle.dtype), sigma=sigma).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        return decode_image_latents(self.bundle.vae, latents, self.bundle.device)


def text_of(part: TextPart) -> list[int]:
    """The token ids an image is conditioned on: the prompt and the whole generated segment (stop token included)."""
    return [int(i) for i in part.prompt_ids.tolist()] + [int(i) for i in part.completion_ids.tolist()]


class UnifiedPipeline:
    """Text then image on one unified bundle (see the module docstring)."""

    stage_parts = {TEXT_STAGE: TextPart, IMAGE_STAGE: DiffusionPart}
    """The kind of Part each stage generates (what its algorithm must train; checked on the driver)."""

    def __init__(
        self,
        bundle: Any,
        *,
        max_prompt_tokens: PositiveInt = 48,
        max_new_tokens: PositiveInt = 16,
        temperature: Temperature = 1.0,
        top_p: TopP = 1.0,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        num_inference_steps: PositiveInt = 6,
        height: int = 32,
        width: int = 32,
        noise_level: NoiseLevel = 0.7,
        guidance_scale: GuidanceScale = 1.0,
        sde_window_size: int | None = None,
        sde_window_range: list[int] | tuple[int, int] | None = None,
        share_initial_noise: bool = False,
    ) -> None:
        """
        Args:
            max_prompt_tokens: Prompt tokens kept (the last ones) for the text segment.
            max_new_tokens: Tokens of the think / recaption segment (always this many forward calls).
            temperature: Sampling temperature of the text segment (its log-probs are of softmax(logits / T)).
            top_p: Nucleus of the text sampler (1 disables it).
            use_chat_template: Wrap the prompt in the tokenizer's chat template.
            system_prompt: System message of the chat template (e.g. an instruction to describe the image).
            num_inference_steps: Denoising steps of the image.
            height: Image height in pixels (a multiple of VAE scale x patch size).
            width: Image width in pixels.
            noise_level: Flow-GRPO SDE noise scale of the image steps.
            guidance_scale: 1 (the unified pipeline samples without classifier-free guidance).
            sde_window_size: SDE steps per image trajectory (``FlowSDEPipeline``); None: all.
            sde_window_range: Where the SDE window may lie.
            share_initial_noise: The images of a group start from the same noise (DanceGRPO).
        """
        self.bundle = bundle
        self.text = CausalLMPipeline(TextView(bundle, "transformer"), max_prompt_tokens=max_prompt_tokens,
                                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     use_chat_template=use_chat_template, system_prompt=system_prompt)
        self.image = UnifiedImagePipeline(bundle, text=self.text, num_inference_steps=num_inference_steps,
                                          height=height, width=width, noise_level=noise_level,
                                          guidance_scale=guidance_scale,
                                          max_text_tokens=max_prompt_tokens + max_new_tokens,
                                          sde_window_size=sde_window_size, sde_window_range=sde_window_range,
                                          share_initial_noise=share_initial_noise)
        self.stage_pipelines = {TEXT_STAGE: self.text, IMAGE_STAGE: self.image}
        self.needs_group_seeds = self.image.needs_group_seeds

    @torch.no_grad()
    def sample_requests(self, requests: list[dict[str, Any]], *, module: torch.nn.Module | None = None,
                        micro_batch_size: int = 8) -> list[tuple[list[Part], np.ndarray]]:
        """``([TextPart, DiffusionPart], image)`` per request, in order. A request holds ``prompt`` and ``seed`` (the
        image's), and optionally ``text_id`` / ``text_seed`` (requests with one text id share one text segment;
        default: its own, from ``seed``) and ``group_seed`` (shared initial noise)."""
        return compose(self, requests, module=module, micro_batch_size=micro_batch_size)

    @torch.no_grad()
    def sample_stage(self, stage: str, requests: list[dict[str, Any]], *, module: torch.nn.Module | None = None,
                     micro_batch_size: int = 8) -> list[tuple[list[Part], np.ndarray | None]]:
        """One stage alone (what an engine of the pair runs). ``text``: a request (``sample_id``, ``prompt``, ``seed``)
        is one segment, ``([TextPart], None)`` with ``part_id = sample_id``. ``image``: a request (``sample_id``,
        ``seed``, ``context_ids``: the prompt + segment token ids, optional ``group_seed``) is one image,
        ``([DiffusionPart], image)``."""
        module = self.bundle.transformer if module is None else module
        out: list[tuple[list[Part], np.ndarray | None]] = []
        for start in range(0, len(requests), micro_batch_size):
            chunk = requests[start : start + micro_batch_size]
            if stage == TEXT_STAGE:
                out += text_stage(self.text, chunk, module)
            elif stage == IMAGE_STAGE:
                cond = self.image.cond_from_ids([list(r["context_ids"]) for r in chunk])
                group_seeds = [int(r["group_seed"]) for r in chunk] if self.needs_group_seeds else None
                outs = self.image.sample_from_cond(cond, [int(r["seed"]) for r in chunk], module=module,
                                                   group_seeds=group_seeds)
                for part, media in outs:
                    part.stage = IMAGE_STAGE
                    out.append(([part], media))
            else:
                raise ValueError(f"unknown stage {stage!r}: this pipeline has stages {', '.join(self.stage_pipelines)}")
        return out


def text_stage(text: CausalLMPipeline, requests: list[dict[str, Any]], module: torch.nn.Module) -> list[tuple[list[Part], None]]:
    """The text stage of a unified pipeline: one segment per request (``prompt``, ``seed``), its Part named
    ``text`` with ``part_id = sample_id``."""
    outs = text.sample([r["prompt"] for r in requests], [int(r["seed"]) for r in requests], module=module)
    return [([dataclasses.replace(part, stage=TEXT_STAGE, part_id=str(r["sample_id"]))], None)
            for r, (part, _) in zip(requests, outs)]


def compose(pipeline: Any, requests: list[dict[str, Any]], *, module: torch.nn.Module | None,
            micro_batch_size: int) -> list[tuple[list[Part], np.ndarray]]:
    """Text then image for ``requests`` (``sample_requests``): one segment per distinct ``text_id`` (default: the
    request's own, from its ``seed``; ``text_seed`` otherwise), then each request's image conditioned on its
    segment; ``([text Part, image Part], image)`` per request. Shared by the unified families."""
    texts: dict[str, dict[str, Any]] = {}
    for r in requests:
        tid = str(r.get("text_id", r["sample_id"]))
        texts.setdefault(tid, {"sample_id": tid, "prompt": r["prompt"], "seed": int(r.get("text_seed", r["seed"]))})
    written = {parts[0].part_id: parts[0] for parts, _ in
               pipeline.sample_stage(TEXT_STAGE, list(texts.values()), module=module, micro_batch_size=micro_batch_size)}
    parents = [written[str(r.get("text_id", r["sample_id"]))] for r in requests]
    drawn = pipeline.sample_stage(IMAGE_STAGE, [dict(r, context_ids=text_of(p)) for r, p in zip(requests, parents)],
                                  module=module, micro_batch_size=micro_batch_size)
    return [([dataclasses.replace(parent), parts[0]], media) for parent, (parts, media) in zip(parents, drawn)]
