"""The cleaning between a prompt enhancer's text and the image model (``rollout.prompt_rewrite``)."""

import pytest

from unirl_ray.rollout.prompt_rewrite import RewriteFormat

ORIGINAL = "a cat"


@pytest.mark.parametrize("text, want, fell_back", [
    ("<think>the user wants a cat\nadd light</think>\nRevised Prompt: A fluffy cat in soft light", "A fluffy cat in soft light", False),
    ("<think>a</think> draft <think>b</think> revised prompt: \u201cA tabby cat\u201d", "A tabby cat", False),  # last block, any case
    ("Sure! Revised Prompt: one. Revised Prompt: 'two'", "two", False),  # after the last marker, quotes off
    ("A cat on a sofa,\n  golden hour", "A cat on a sofa, golden hour", False),  # no marker: the whole text, one line
    ("<think>still thinking about the sca", ORIGINAL, True),  # unfinished reasoning: no rewrite
    ("Revised Prompt:   \"\"  ", ORIGINAL, True),  # empty after cleaning
    ("", ORIGINAL, True),
])
def test_the_rewrite_is_cut_out_of_the_rewriters_text(text, want, fell_back):
    assert RewriteFormat().clean(text, ORIGINAL) == (want, fell_back)


def test_required_marker_length_cut_and_no_marker():
    assert RewriteFormat(require_marker=True).clean("A cat.", ORIGINAL) == (ORIGINAL, True)
    assert RewriteFormat(max_chars=12).clean("Revised Prompt: a very fluffy cat", ORIGINAL) == ("a very", False)
    assert RewriteFormat(max_chars=5).clean("abcdefghij", ORIGINAL) == ("abcde", False)  # no word boundary
    assert RewriteFormat(marker=None).clean("Revised Prompt: x", ORIGINAL) == ("Revised Prompt: x", False)
