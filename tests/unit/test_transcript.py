"""Token in, token out: the transcript keeps the sampled ids as sampled and renders only new messages."""

import pytest

from unirl_ray.agentic.transcript import TokenTranscript, render_ids, truncate_text
from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

# a Qwen-like template: a newline after every turn's end token, roles as text, tool results as "tool"
NEWLINE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ 'user' if m['role'] == 'tool' else m['role'] }}|>"
    "{% if m['role'] == 'tool' %}tool: {% endif %}{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# the same, but assistant content is trimmed on render (as templates that strip reasoning or whitespace do):
# re-rendering a history whose sampled turns end in spaces gives other ids than were sampled
TRIM_TEMPLATE = NEWLINE_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim if m['role'] == 'assistant' "
                                                               "else m['content'] }}")


def tokenizer(template=None):
    tok = build_char_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


def sampled(tok, text, end=True):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids + ([tok.eos_token_id] if end else [])


@pytest.mark.parametrize("template", [None, NEWLINE_TEMPLATE])
def test_a_multi_turn_transcript_equals_the_full_render_and_masks_exactly_the_sampled_ids(template):
    tok = tokenizer(template)
    prompt = [{"role": "user", "content": "what is 3*4+1?"}]
    t = TokenTranscript(tok, prompt)
    assert t.ids == render_ids(tok, prompt, add_generation_prompt=True) and not any(t.loss_mask)
    turn1 = sampled(tok, '<tool_call>{"name": "calculator"}</tool_call>')
    assert t.add_assistant(turn1, [-0.5] * len(turn1)) == '<tool_call>{"name": "calculator"}</tool_call>'
    obs = t.add_observation([{"role": "tool", "content": "13"}])
    assert t.expecting_assistant and obs[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    turn2 = sampled(tok, "<answer>13</answer>")
    t.add_assistant(turn2)
    t.close()
    t.check()
    assert t.ids == t.rendered_ids() and not t.retokenize_mismatch()
    # the sampled ids sit verbatim at their spans, with their log-probs; nothing else carries loss
    assert [t.ids[s.start:s.end] for s in t.turns] == [turn1, turn2]
    assert t.logprobs[t.turns[0].start:t.turns[0].end] == [-0.5] * len(turn1)
    assert sum(t.loss_mask) == len(turn1) + len(turn2)
    assert t.after_turn_end == ([] if template is None else tok("\n", add_special_tokens=False)["input_ids"])


def test_sampled_ids_are_kept_where_a_re_render_would_change_them_and_strict_mode_sees_it():
    tok = tokenizer(TRIM_TEMPLATE)
    t = TokenTranscript(tok, [{"role": "user", "content": "hi"}])
    turn = sampled(tok, "  12  ")  # whitespace the template trims on re-render
    t.add_assistant(turn)
    t.add_observation([{"role": "user", "content": "sure?"}])
    assert t.ids[t.turns[0].start:t.turns[0].end] == turn  # trained on what was sampled
    assert t.retokenize_mismatch()  # a re-tokenised history would have trained on other ids
    assert len(t.rendered_ids()) == len(t.ids) - 4


def test_a_turn_cut_short_is_closed_with_the_end_token_without_loss():
    tok = tokenizer(NEWLINE_TEMPLATE)
    t = TokenTranscript(tok, [{"role": "user", "content": "count"}])
    turn = sampled(tok, "1 2 3 4", end=False)  # max_tokens hit: no end token sampled
    t.add_assistant(turn)
    new = t.add_observation([{"role": "user", "content": "go on"}])
    assert new[:2] == [tok.eos_token_id, *tok("\n", add_special_tokens=False)["input_ids"]]
    t.check()
    assert not t.retokenize_mismatch()


def test_tools_reach_the_template_and_wrong_orders_are_refused():
    tok = tokenizer(NEWLINE_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    t = TokenTranscript(tok, [{"role": "user", "content": "x"}], tools=tools)
    assert '"calculator"' in tok.decode(t.ids)
    with pytest.raises(RuntimeError, match="add the assistant turn first"):
        t.add_observation([{"role": "tool", "content": "1"}])
    t.add_assistant(sampled(tok, "a"))
    with pytest.raises(RuntimeError, match="two assistant turns"):
        t.add_assistant(sampled(tok, "b"))
    with pytest.raises(ValueError, match="log-probs for"):
        TokenTranscript(tok, [{"role": "user", "content": "x"}]).add_assistant([5, 6], [0.0])
    with pytest.raises(ValueError, match="pass turn_end_id"):
        TokenTranscript(tok, [{"role": "user", "content": "x"}], turn_end_id=tok.convert_tokens_to_ids("a"))


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # renders the last message differently from the others: the base is not a prefix of its continuation
    tok = tokenizer("{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|end|>{% endif %}{% endfor %}")
    t = TokenTranscript(tok, [{"role": "user", "content": "x"}])
    t.add_assistant(sampled(tok, "a"))
    with pytest.raises(ValueError, match="cannot be tokenised on their own"):
        t.add_observation([{"role": "user", "content": "y"}])


def test_tool_responses_are_truncated_on_the_side_asked():
    tok = tokenizer()
    assert truncate_text(tok, "abcdef", 3, "right") == ("abc", True)
    assert truncate_text(tok, "abcdef", 3, "left") == ("def", True)
    assert truncate_text(tok, "ab", 3) == ("ab", False)
    with pytest.raises(ValueError, match="'left' or 'right'"):
        truncate_text(tok, "ab", 1, "middle")
