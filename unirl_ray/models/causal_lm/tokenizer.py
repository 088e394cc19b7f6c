"""A character-level tokenizer built in code (no files to download) for the tiny demo LM.

Every printable ASCII character (``" "`` ... ``"~"``) and ``"\\n"`` is one token; anything else maps to
``<|unk|>``. Special tokens come first (``<|pad|>`` = 0). The chat template renders

    <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>

so the assistant's turn ends with ``<|end|>``, which is also the EOS token. The result is a regular
``PreTrainedTokenizerFast``: ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it,
and engines that load a model folder (vLLM) read it like any other tokenizer.

The constants are importable without transformers / tokenizers (the config uses them).
"""

from __future__ import annotations

from typing import Any

PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
"""Special tokens, in id order (pad = 0, unk = 1, bos = 2, eos = 3, then the role markers)."""
CHAR_VOCAB: tuple[str, ...] = tuple(chr(i) for i in range(32, 127)) + ("\n",)
"""The characters that are tokens, in id order after the special tokens."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Jinja chat template (roles: system, user, assistant)."""


def build_char_tokenizer(extra_special_tokens: tuple[str, ...] = ()) -> Any:
    """The demo char-level ``PreTrainedTokenizerFast`` (pad, unk, bos, eos and a chat template).

    ``extra_special_tokens`` (e.g. another family's chat markers, ``"<|im_start|>"``) become single tokens with
    ids after the characters, so every other id stays as above."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHAR_VOCAB + tuple(extra_special_tokens))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # one piece per character, whitespace included; Fuse joins pieces back without separators
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS) + list(extra_special_tokens))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS) + list(extra_special_tokens),
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
