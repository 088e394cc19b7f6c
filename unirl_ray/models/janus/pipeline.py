"""``JanusPipeline``: the think segment (LM head), then the image as VQ tokens (generation head), both with log-probs.

``sample_requests`` writes one text segment per ``text_id`` (``CausalLMPipeline``'s sampler on the text
forward), then per request the image tokens conditioned on prompt + generated tokens + the
begin-of-image token (never re-tokenised), sampled from ``softmax(generation_head / image_temperature)``
with one CPU generator per image (inverse CDF, as the text sampler: an image depends only on its
context, its seed and the weights), and decodes them with the VQ decoder. Each output holds the Parts
``[TextPart (stage "text"), TextPart (stage "image": prompt_ids = the context, completion_ids = the image tokens)]``.

``JanusImageTokens`` is the image stage's view for the GRPO family: ``collate`` lays out context + image
tokens right-padded (positions 0.. as in sampling), ``token_log_probs`` scores every image token under the
generation head. Without classifier-free guidance (the recorded log-probs are those of the distribution
sampled from, which training recomputes exactly).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt, check_choice
from unirl_ray.core.sample import Part, TextPart
from unirl_ray.models.causal_lm.pipeline import (
    CausalLMPipeline,
    Temperature,
    TopP,
    draw_tokens,
    next_token_log_probs,
    nucleus_filter,
)
from unirl_ray.models.flow_sde import module_device, to_uint8
from unirl_ray.models.unified.pipeline import TextView, compose, text_stage

TEXT_STAGE, IMAGE_STAGE = "text", "image"


class JanusImageTokens:
    """Sampling and log-prob recomputation of Janus image tokens (see the module docstring)."""

    def __init__(self, bundle: Any, *, temperature: float, top_p: float, pad_token_id: int) -> None:
        self.bundle, self.temperature, self.top_p, self.pad_token_id = bundle, temperature, top_p, pad_token_id
        self.max_new_tokens = self.num_image_tokens  # what seq_mean_token_sum_norm normalises by

    @property
    def num_image_tokens(self) -> int:
        return self.bundle.model.num_image_tokens

    @torch.no_grad()
    def sample(self, module: torch.nn.Module, contexts: list[list[int]], seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Image tokens [B, N] and their log-probs [B, N] (float32, CPU) after each context (left-padded, KV cache)."""
        device = module_device(module)
        b, n = len(contexts), self.num_image_tokens
        width = max(len(c) for c in contexts)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((b, width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            attention[i, width - len(c):] = 1
        ids, attention = ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        next_position = attention.sum(-1)
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        tokens = torch.zeros((b, n), dtype=torch.long, device=device)
        log_probs = torch.zeros((b, n), dtype=torch.float32, device=device)
        cache, step_ids, step_images, step_pos = None, ids, torch.zeros((b, 0), dtype=torch.long, device=device), positions
        for t in range(n):
            out = module(input_ids=step_ids, image_ids=step_images, attention_mask=attention, position_ids=step_pos,
                         past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logp_all = torch.log_softmax(out.logits[:, -1].float() / self.temperature, dim=-1)
            uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
            token = draw_tokens(nucleus_filter(logp_all.exp(), self.top_p), uniforms)
            tokens[:, t], log_probs[:, t] = token, logp_all.gather(-1, token[:, None]).squeeze(-1)
            attention = torch.cat([attention, torch.ones((b, 1), dtype=torch.long, device=device)], dim=1)
            step_ids, step_images, step_pos = None, token[:, None], next_position[:, None]
            next_position = next_position + 1
        return tokens.cpu(), log_probs.cpu()

    def collate(self, parts: list[TextPart]) -> dict[str, torch.Tensor]:
        """``CausalLMPipeline.collate``'s layout over context + image tokens, plus ``image_ids`` / ``image_positions``."""
        if not parts or any(p.is_light for p in parts):
            raise ValueError("collate needs full image-token TextParts (with prompt_ids / completion_ids)")
        lens = [len(p.prompt_ids) + len(p.completion_ids) for p in parts]
        b, length = len(parts), max(lens)
        input_ids = torch.full((b, length), self.pad_token_id, dtype=torch.long)
        image_ids = torch.zeros((b, length), dtype=torch.long)
        image_positions = torch.zeros((b, length), dtype=torch.bool)
        attention = torch.zeros((b, length), dtype=torch.long)
        completion_mask = torch.zeros((b, length - 1), dtype=torch.float32)
        old = torch.zeros((b, length - 1), dtype=torch.float32)
        for i, (p, n) in enumerate(zip(parts, lens)):
            c, k = len(p.prompt_ids), len(p.completion_ids)
            input_ids[i, :c] = p.prompt_ids.long()
            image_ids[i, c:n] = p.completion_ids.long()
            image_positions[i, c:n] = True
            attention[i, :n] = 1
            targets = slice(c - 1, c - 1 + k)
            completion_mask[i, targets] = (p.loss_mask if p.loss_mask is not None else torch.ones(k)).float()
            if p.log_probs is not None:
                old[i, targets] = p.log_probs.float()
        return {"input_ids": input_ids, "image_ids": image_ids, "image_positions": image_positions,
                "attention_mask": attention, "position_ids": torch.arange(length).expand(b, length).clone(),
                "completion_mask": completion_mask, "old_log_probs": old}

    def token_log_probs(self, module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L-1] log-prob of each next image token under ``softmax(generation_head / temperature)`` and its
        entropy (float32, with grad); only positions under ``completion_mask`` mean anything."""
        device = module_device(module)
        out = module(input_ids=batch["input_ids"].to(device), image_ids=batch["image_ids"].to(device),
                     image_positions=batch["image_positions"].to(device), attention_mask=batch["attention_mask"].to(device),
                     position_ids=batch["position_ids"].to(device), use_cache=False)
        return next_token_log_probs(out.logits[:, :-1], batch["image_ids"][:, 1:].to(device), self.temperature)


class JanusPipeline:
    """Text then image tokens on one Janus bundle (see the module docstring)."""

    stage_parts = {TEXT_STAGE: TextPart, IMAGE_STAGE: TextPart}
    """The kind of Part each stage generates (both token sequences; checked on the driver)."""

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
        image_temperature: Temperature = 1.0,
        image_top_p: TopP = 1.0,
    ) -> None:
        """
        Args:
            max_prompt_tokens: Prompt tokens kept (the last ones) for the text segment.
            max_new_tokens: Tokens of the think / recaption segment.
            temperature: Sampling temperature of the text segment.
            top_p: Nucleus of the text sampler (1 disables it).
            use_chat_template: Wrap the prompt in the tokenizer's chat template.
            system_prompt: System message of the chat template.
            image_temperature: Sampling temperature of the image tokens (log-probs are of softmax(logits / T)).
            image_top_p: Nucleus of the image-token sampler (1 disables it).
        """
        for name, value, annotation in (("image_temperature", image_temperature, Temperature),
                                        ("image_top_p", image_top_p, TopP)):
            check_choice(f"pipeline.{name}", value, annotation)
        self.bundle = bundle
        self.text = CausalLMPipeline(TextView(bundle, "model"), max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                                     temperature=temperature, top_p=top_p, use_chat_template=use_chat_template,
                                     system_prompt=system_prompt)
        self.image = JanusImageTokens(bundle, temperature=image_temperature, top_p=image_top_p,
                                      pad_token_id=self.text.pad_token_id)
        self.stage_pipelines = {TEXT_STAGE: self.text, IMAGE_STAGE: self.image}

    @torch.no_grad()
    def sample_requests(self, requests: list[dict[str, Any]], *, module: torch.nn.Module | None = None,
                        micro_batch_size: int = 8) -> list[tuple[list[Part], np.ndarray]]:
        """``([text Part, image Part], image)`` per request, in order (requests as ``UnifiedPipeline.sample_requests``)."""
        return compose(self, requests, module=module, micro_batch_size=micro_batch_size)

    @torch.no_grad()
    def sample_stage(self, stage: str, requests: list[dict[str, Any]], *, module: torch.nn.Module | None = None,
                     micro_batch_size: int = 8) -> list[tuple[list[Part], np.ndarray | None]]:
        """One stage alone (``UnifiedPipeline.sample_stage``); an image's context gets ``<begin_of_image>`` appended."""
        module = self.bundle.model if module is None else module
        out: list[tuple[list[Part], np.ndarray | None]] = []
        for start in range(0, len(requests), micro_batch_size):
            chunk = requests[start : start + micro_batch_size]
            if stage == TEXT_STAGE:
                out += text_stage(self.text, chunk, module)
            elif stage == IMAGE_STAGE:
                contexts = [[int(i) for i in r["context_ids"]] + [self.bundle.boi_token_id] for r in chunk]
                tokens, log_probs = self.image.sample(module, contexts, [int(r["seed"]) for r in chunk])
                media = to_uint8(module(decode_tokens=tokens.to(module_device(module)))).cpu().numpy()
                n = tokens.shape[1]
                for i, context in enumerate(contexts):
                    part = TextPart(stage=IMAGE_STAGE, prompt_ids=torch.tensor(context, dtype=torch.long),
                                    completion_ids=tokens[i].clone(), log_probs=log_probs[i].clone(),
                                    loss_mask=torch.ones(n), text="", num_tokens=n)
                    out.append(([part], media[i]))
            else:
                raise ValueError(f"unknown stage {stage!r}: this pipeline has stages {', '.join(self.stage_pipelines)}")
        return out
