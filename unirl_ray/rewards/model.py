"""A learned reward: a sequence-classification model scoring (prompt, completion) pairs.

``SequenceClassifierReward`` is a reward fn class: name it in a reward recipe and every reward
replica builds it once (its ``kwargs`` go to the constructor) and then calls it per batch::

    reward:
      rewards:
        rm:
          fn: unirl_ray.rewards.model.SequenceClassifierReward
          weight: 1.0
          kwargs: {path: /models/my-rm, batch_size: 16, device: auto}
          app: {num_replicas: 2, ray_actor_options: {num_cpus: 1, num_gpus: 0.25}}
        math:
          fn: unirl_ray.rewards.text.math_exact_match
      ray_actor_options: {num_cpus: 0.25}

Placement: ``app:`` gives the model its own Serve app with its own replicas and resources, while
the rule rewards keep sharing the main reward app (in the driver by default). With ``num_gpus: 0.25`` four replicas share one
GPU (``device: auto`` then picks ``cuda``); ``memory`` reserves host RAM; each replica loads its own
copy. Without ``app`` the model runs inside the shared reward app, whose ``ray_actor_options`` must
then cover it.

The model is a Hugging Face ``AutoModelForSequenceClassification`` with ``num_labels=1`` (the usual
reward-model head: the score is the logit at the last non-padding token for decoder models) and its
tokenizer, from a local folder (no hub access at run time), or ``tiny=True``: a small random Llama
with the demo LM's character tokenizer (``unirl_ray.models.causal_lm.tokenizer``, whose chat template
then formats the pair), for tests and CPU demos. torch and transformers are imported only when an
instance is built, so naming the class in a config costs nothing on the driver.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from unirl_ray.rewards._models import check_arguments

logger = logging.getLogger(__name__)

TINY_MAX_LENGTH = 512
"""Positions of the tiny model (longer inputs are truncated from the left)."""


def tiny_reward_model(tokenizer: Any, *, seed: int = 0, hidden_size: int = 32, num_layers: int = 2) -> Any:
    """A random ``LlamaForSequenceClassification`` (num_labels=1) sized for ``tokenizer``; same seed, same weights."""
    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=TINY_MAX_LENGTH,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
        # The default head init (std 0.02) gives nearly equal scores: widen it so the tiny
        # reward visibly depends on the text.
        torch.nn.init.normal_(model.score.weight, std=1.0 / hidden_size**0.5)
    return model


class SequenceClassifierReward:
    """Reward fn ``(*, prompts, completions, **columns) -> list[float]``: the model's scalar score per sample.

    Inputs are ``template.format(prompt=..., completion=...)``; without a template the tokenizer's
    chat template (user = prompt, assistant = completion) when it has one, else ``prompt + completion``.
    Inputs longer than ``max_length`` tokens lose their beginning (the completion is kept). Calls are
    serialised by a lock (one forward at a time per replica; the tokenizer is not thread-safe).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        tiny: bool = False,
        seed: int = 0,
        batch_size: int = 16,
        device: str = "auto",
        dtype: str | None = None,
        max_length: int = 1024,
        template: str | None = None,
    ):
        """
        Args:
            path: Local folder holding an ``AutoModelForSequenceClassification`` (num_labels=1) and its tokenizer.
            tiny: Build a small random model with a character tokenizer instead (tests, CPU demos).
            seed: Weight seed of the tiny model.
            batch_size: Samples per forward pass.
            device: ``"auto"`` (cuda when visible, e.g. with ``ray_actor_options.num_gpus``), ``"cpu"``, ``"cuda:0"``...
            dtype: Weight dtype name (``"bfloat16"``); None keeps float32.
            max_length: Token limit per input (capped by the model's positions).
            template: Python format string with ``{prompt}`` and ``{completion}``.
        """
        check_arguments("SequenceClassifierReward", path, tiny, "/local/model/folder", batch_size=batch_size,
                        max_length=max_length)
        if template is not None and ("{prompt}" not in template or "{completion}" not in template):
            raise ValueError(f"template must contain '{{prompt}}' and '{{completion}}', got {template!r}")
        import torch

        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        """Where the model runs."""
        self.batch_size = batch_size
        """Samples per forward pass."""
        self.template = template
        """Input format, or None for the chat template / plain concatenation."""
        self.tokenizer, self.model = self._load(path, tiny=tiny, seed=seed, dtype=dtype)
        self.model.to(self.device).eval()
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(max_length, positions) if positions else max_length
        """Token limit per input."""
        self.tokenizer.truncation_side = "left"
        self._pad_batches = self._check_padding()
        self._lock = threading.Lock()

    @staticmethod
    def _load(path: str | None, *, tiny: bool, seed: int, dtype: str | None) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch_dtype = getattr(torch, dtype) if dtype else torch.float32
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype like 'bfloat16', got {dtype!r}")
        if tiny:
            from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

            tokenizer = build_char_tokenizer()
            return tokenizer, tiny_reward_model(tokenizer, seed=seed).to(torch_dtype)
        path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.isdir(path):
            raise ValueError(f"reward model folder not found: {path}; pass a local folder saved with save_pretrained")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch_dtype)
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path} has num_labels={model.config.num_labels}; a reward model needs one output (num_labels=1)"
            )
        return tokenizer, model

    def _check_padding(self) -> bool:
        """Align the model's pad id with the tokenizer's; False when batches cannot be padded (no pad token)."""
        tok, cfg = self.tokenizer, self.model.config
        if tok.pad_token_id is None and tok.eos_token_id is not None:
            tok.pad_token = tok.eos_token  # common for decoder reward models; the last real token is still found
        if tok.pad_token_id is None:
            logger.warning("reward model tokenizer has no pad or eos token: scoring one sample per forward pass")
            return False
        if cfg.pad_token_id is None:
            cfg.pad_token_id = tok.pad_token_id
        return True

    def _texts(self, prompts: Sequence[str], completions: Sequence[str]) -> list[str]:
        if self.template is not None:
            return [self.template.format(prompt=p, completion=c) for p, c in zip(prompts, completions)]
        if getattr(self.tokenizer, "chat_template", None):
            return [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
                )
                for p, c in zip(prompts, completions)
            ]
        return [p + c for p, c in zip(prompts, completions)]

    def __call__(
        self, *, completions: Sequence[str], prompts: Sequence[str] | None = None, **_: Any
    ) -> list[float]:
        """One score per sample: the model's single logit for ``prompt`` followed by ``completion``."""
        import torch

        if completions is None or isinstance(completions, str):
            raise ValueError("SequenceClassifierReward needs completions=[text per sample] (text samples)")
        completions = ["" if c is None else str(c) for c in completions]
        prompts = [""] * len(completions) if prompts is None else ["" if p is None else str(p) for p in prompts]
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts for {len(completions)} completions")
        texts = self._texts(prompts, completions)
        step = self.batch_size if self._pad_batches else 1
        scores: list[float] = []
        with self._lock, torch.inference_mode():
            for lo in range(0, len(texts), step):
                enc = self.tokenizer(
                    texts[lo : lo + step],
                    padding=self._pad_batches,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(**enc).logits  # [b, 1]
                scores += logits[:, 0].float().cpu().tolist()
        return scores

    def save_pretrained(self, path: str) -> None:
        """Write model and tokenizer to ``path`` (loadable with ``SequenceClassifierReward(path)``)."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

