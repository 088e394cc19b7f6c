"""Configuration of the causal-LM family (validated on the driver, no weights loaded).

Light on purpose: no transformers / tokenizers import, so drivers can validate configs cheaply.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from unirl_ray.models.causal_lm.tokenizer import CHAR_VOCAB, SPECIAL_TOKENS

from unirl_ray.core.dtypes import TORCH_DTYPES  # noqa: E402  (re-exported for callers)


@dataclass(kw_only=True)
class TinyLMConfig:
    """Knobs of the tiny randomly initialised demo LM (a Qwen2 architecture, ~0.1M params)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    hidden_size: int = 64
    """Model width (= num_attention_heads x head_dim)."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 2
    """Attention heads; head_dim = hidden_size / heads must be 32, 64, 80, 96, 112, 128... for vLLM's CPU attention."""
    intermediate_size: int = 128
    """Width of the MLP."""
    max_position_embeddings: int = 256
    """Longest prompt + completion the model supports (RoPE table size)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and output projection weights."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_attention_heads < 1 or self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )

    @property
    def vocab_size(self) -> int:
        """Special tokens + the printable-ASCII character set of the demo tokenizer."""
        return len(SPECIAL_TOKENS) + len(CHAR_VOCAB)


@dataclass(kw_only=True)
class CausalLMConfig:
    """Which causal LM to load and in which dtype."""

    pretrained_model_path: str | None = None
    """Local Hugging Face folder (with config.json and tokenizer files); ``None`` builds the tiny DEMO model."""
    torch_dtype: str = "float32"
    """Dtype of the weights: ``float32``, ``bfloat16`` or ``float16``."""
    seed: int = 0
    """Seed of the demo model's weights when ``tiny`` is not given (unused for a checkpoint)."""
    tiny: TinyLMConfig | None = None
    """Shape knobs of the demo model; defaults to ``TinyLMConfig(seed=seed)``."""

    def __post_init__(self) -> None:
        if self.torch_dtype not in TORCH_DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(TORCH_DTYPES)}, got {self.torch_dtype!r}")
        if self.tiny is None:
            self.tiny = TinyLMConfig(seed=self.seed)
        path = self.pretrained_model_path
        if path is None:
            return
        if not os.path.isdir(path):
            raise ValueError(
                f"pretrained_model_path {path!r} does not exist or is not a folder; expected a local Hugging Face "
                "causal-LM folder (config.json, weights, tokenizer files), or leave it unset (null) to use the "
                "tiny demo model"
            )
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"pretrained_model_path {path!r} has no config.json; expected a folder written by "
                "save_pretrained (model and tokenizer) or a downloaded Hugging Face model repository"
            )

    @property
    def is_demo(self) -> bool:
        """True when no checkpoint is given and the tiny random model is used."""
        return self.pretrained_model_path is None

    @property
    def dtype(self) -> torch.dtype:
        """``torch_dtype`` as a ``torch.dtype``."""
        return TORCH_DTYPES[self.torch_dtype]

    @property
    def context_length(self) -> int | None:
        """The model's longest sequence (``max_position_embeddings``): the demo model's, or the one the folder's
        config.json names (its ``text_config``'s for a vision-language model); None where it names none (or the
        file does not parse: loading the model says why)."""
        if self.is_demo:
            return int(self.tiny.max_position_embeddings)
        try:
            with open(os.path.join(self.pretrained_model_path, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        value = config.get("max_position_embeddings", text.get("max_position_embeddings"))
        return value if isinstance(value, int) and not isinstance(value, bool) else None
