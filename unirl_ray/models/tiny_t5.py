"""Tiny T5-style text encoders for the demo models, built offline (no hub download).

SD3's third encoder is a ``T5EncoderModel``, Wan's only encoder a ``UMT5EncoderModel``; both tiny
versions take the same shape (one layer, two heads, ``d_ff = 2 x d_model``) and read a
character-level T5 tokenizer. Their weights come from the global torch RNG: the family builders
seed it inside ``torch.random.fork_rng``.
"""

from __future__ import annotations

import string

from transformers import PreTrainedModel, T5Tokenizer

__all__ = ["build_t5_tokenizer", "build_tiny_t5_encoder"]


def build_t5_tokenizer() -> T5Tokenizer:
    """A character-level unigram T5 tokenizer (pad=0, eos=1, unk=2), no extra ids."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for c in string.ascii_letters + string.digits + string.punctuation:
        pieces += [(c, -3.0), ("\u2581" + c, -2.5)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def build_tiny_t5_encoder(encoder_cls: type[PreTrainedModel], tokenizer: T5Tokenizer, d_model: int) -> PreTrainedModel:
    """A one-layer ``encoder_cls`` (``T5EncoderModel`` or ``UMT5EncoderModel``) of width ``d_model``
    over ``tokenizer``'s vocabulary, randomly initialised from the global torch RNG."""
    config = encoder_cls.config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return encoder_cls(config)
