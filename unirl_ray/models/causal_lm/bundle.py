"""``CausalLMBundle``: a causal LM and its tokenizer, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from unirl_ray.models.causal_lm.config import CausalLMConfig, TinyLMConfig
from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

logger = logging.getLogger(__name__)


def build_tiny_causal_lm(tiny: TinyLMConfig, tokenizer: Any) -> torch.nn.Module:
    """A randomly initialised tiny ``Qwen2ForCausalLM`` for ``tokenizer`` (weights depend only on ``tiny.seed``).

    The global RNG is left untouched (initialisation runs under ``torch.random.fork_rng``).
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_attention_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@dataclass(kw_only=True)
class CausalLMBundle:
    """A causal LM (trainable, in eval mode: no dropout, so recomputed log-probs match sampled ones) and its tokenizer."""

    model: torch.nn.Module
    """``*ForCausalLM`` (the train backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    tokenizer: Any
    """Hugging Face tokenizer with a pad and an EOS token."""
    config: CausalLMConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""

    @classmethod
    def from_config(cls, config: CausalLMConfig) -> "CausalLMBundle":
        """Load ``config.pretrained_model_path`` (local files only) or build the tiny demo model."""
        if config.is_demo:
            logger.warning(
                "CausalLM: no pretrained_model_path given; building a TINY RANDOMLY INITIALISED DEMO model with a "
                "char-level tokenizer (%s). Its text is gibberish: set pretrained_model_path for real training.",
                config.tiny,
            )
            tokenizer = build_char_tokenizer()
            model = build_tiny_causal_lm(config.tiny, tokenizer).to(config.dtype)
        else:
            path = config.pretrained_model_path
            logger.info("CausalLM: loading %s (%s)", path, config.torch_dtype)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=config.dtype, local_files_only=True)
            tokenizer = _load_tokenizer(path)
        model.eval()
        return cls(model=model, tokenizer=tokenizer, config=config, is_demo=config.is_demo)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype from the config."""
        return self.config.dtype

    def to(self, device: torch.device | str) -> "CausalLMBundle":
        """Move the model to ``device``; returns ``self``."""
        self.model.to(device)
        return self

    def save_pretrained(self, directory: str) -> str:
        """Write model (safetensors) and tokenizer to ``directory``; returns ``directory``.

        The model loads with ``AutoModelForCausalLM.from_pretrained(directory)``, a checkpoint's
        tokenizer with ``AutoTokenizer.from_pretrained(directory)``. The demo char tokenizer is saved
        complete (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) but must be
        loaded with ``PreTrainedTokenizerFast.from_pretrained(directory)``: next to a Qwen2
        ``config.json``, transformers 5.2x's ``AutoTokenizer`` builds a ``Qwen2Tokenizer`` (byte-level
        BPE), which drops the char vocabulary's whitespace (``CausalLMConfig(pretrained_model_path=...)``
        loads it right). This is the family's export hook:
        ``unirl_ray.train.export`` calls it on a copy holding the trained weights.
        """
        os.makedirs(directory, exist_ok=True)
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return directory


def tokenizer_from_config(config: CausalLMConfig) -> Any:
    """The tokenizer ``CausalLMBundle.from_config(config)`` would load, without the model (a driver that renders
    chat templates: the agentic trainer's transcripts)."""
    return build_char_tokenizer() if config.is_demo else _load_tokenizer(config.pretrained_model_path)


_GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(path: str) -> Any:
    try:
        tokenizer = _tokenizer_class(path).from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({err}); the model folder must also hold the tokenizer "
            "files (tokenizer.json / tokenizer_config.json): save both with CausalLMBundle.save_pretrained"
        ) from err
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {path!r} has no eos_token; set one in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        logger.warning("CausalLM: tokenizer in %s has no pad_token; using eos_token %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_class(path: str) -> Any:
    """``AutoTokenizer``, except for a folder saved from a generic ``tokenizer.json`` (e.g. the demo char
    tokenizer): next to a Qwen2 ``config.json`` transformers 5.2x's ``AutoTokenizer`` forces a byte-level
    ``Qwen2Tokenizer`` onto it, which silently drops spaces and newlines."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            if json.load(f).get("tokenizer_class") in _GENERIC_FAST_TOKENIZERS:
                return PreTrainedTokenizerFast
    return AutoTokenizer
