"""Text rule rewards (hand-computed cases), class reward sources, the tiny reward model, packaged data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from unirl_ray.assets import asset_path
from unirl_ray.rewards import RewardConfig, RewardError, RewardFnSpec, score_batch
from unirl_ray.rewards.text import (
    char_fraction,
    extract_answer,
    format_reward,
    length_target,
    math_exact_match,
    normalize_answer,
    tag_format,
    tag_pattern,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- math_exact_match --------------------------------------------------------------------------


def test_math_exact_match_by_hand():
    completions = [
        "4 boxes of 300 and 34 more\n#### 1,234",  # GSM8K marker, thousands comma
        "so it costs \\boxed{3.50} dollars",  # LaTeX box, trailing zero
        "She had 3 apples, bought 4 more, so 7 apples.",  # last-number fallback
        "#### 12",  # wrong number
        "I am not sure",  # no number at all
        "#### $42.",  # dollar sign and sentence period
        "first 10, then \\boxed{\\frac{3}{4}}",  # fraction in a box
    ]
    answers = ["1234", "3.5", "Tom adds 3+4=<<3+4=7>>7.\n#### 7", "13", "5", "42.0", "0.75"]
    assert math_exact_match(completions=completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_math_exact_match_missing_reference_is_none():
    completions = ["#### 5", "#### 5", "#### 5", "#### 5"]
    assert math_exact_match(completions=completions, answer=[None, "", "   ", 5]) == [None, None, None, 1.0]
    # no answer column at all: nothing can be scored
    assert math_exact_match(completions=["#### 5", "6"], prompts=["a", "b"]) == [None, None]


def test_math_exact_match_takes_images_none_and_extra_columns():
    scores = math_exact_match(
        completions=["the answer is 8", "#### 8"], answer=[8, 8.0], images=[None, None], prompts=["p", "q"], meta=["x", "y"]
    )
    assert scores == [1.0, 1.0]


def test_math_exact_match_markers_win_over_later_numbers():
    # the #### answer counts even when numbers follow on later lines; the last marker wins
    assert math_exact_match(completions=["#### 3\n#### 9\nchecked with 2 methods"], answer=["9"]) == [1.0]
    assert math_exact_match(completions=["\\boxed{2} and \\boxed{5}, about 7 in total"], answer=["5"]) == [1.0]


def test_math_exact_match_text_answers_and_bad_lengths():
    assert math_exact_match(completions=["#### B", "#### c"], answer=["b", "B"]) == [1.0, 0.0]
    assert math_exact_match(completions=["#### 5"], answer=["five"]) == [0.0]  # number vs word: no match
    with pytest.raises(ValueError, match="1 answers for 2 completions"):
        math_exact_match(completions=["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="completions"):
        math_exact_match(completions=None, answer=["1"])


def test_extract_and_normalize():
    assert extract_answer("a 1 b 2\n#### 17\n") == "17"
    assert extract_answer("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_answer("1,234 then -5 dollars.") == "-5"
    assert extract_answer("none here") is None
    assert normalize_answer(" $1,234.00 ") == normalize_answer("1234") == 1234
    assert normalize_answer("\\frac{1}{2}") == normalize_answer("0.5")
    assert normalize_answer("50\\%") == 50
    assert normalize_answer("(2,3)") != normalize_answer("23")  # a pair, not a thousands comma


# ---- format, length, char fraction -----------------------------------------------------------------


def test_tag_format_by_hand():
    completions = [
        "<think>2 + 2\nis 4</think><answer>4</answer>",  # multi-line think
        "  <think>x</think>\n<answer>y</answer>\n",  # whitespace around and between blocks
        "<answer>y</answer><think>x</think>",  # wrong order
        "<think>x</think>",  # missing answer
        "so <think>x</think><answer>y</answer>",  # text outside the tags
        "<think>x</think><answer>y</answer><answer>z</answer>",  # a second answer
        "<think>a<think>b</think><answer>y</answer>",  # nested tag
    ]
    want = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert tag_format(completions=completions) == want
    assert format_reward(completions=completions, images=None) == want  # default pattern is the same format
    assert tag_format(completions=["<reasoning>r</reasoning><final>1</final>", completions[0]],
                      tags=("reasoning", "final")) == [1.0, 0.0]


def test_format_reward_custom_pattern_and_errors():
    assert format_reward(completions=["Answer: 12", "answer 12"], pattern=r"Answer: \d+") == [1.0, 0.0]
    with pytest.raises(ValueError, match="invalid regex"):
        format_reward(completions=["x"], pattern="(")
    with pytest.raises(ValueError, match="tag names"):
        tag_pattern("think")


def test_length_target_by_hand():
    completions = ["a" * 20, "a" * 10, "a" * 30, ""]
    assert length_target(completions=completions) == [0.0, -0.5, -0.5, -1.0]
    assert length_target(completions=["abcd"], target=8, images=None, prompts=["p"]) == [-0.5]
    with pytest.raises(ValueError, match="positive"):
        length_target(completions=["a"], target=0)


def test_char_fraction_by_hand():
    assert char_fraction(completions=["aaaa", "abab", "bcd", "", "AaAa"], images=None) == [1.0, 0.5, 0.0, 0.0, 0.5]
    assert char_fraction(completions=["xx y"], char="x", prompts=["p"], answer=[1]) == [0.5]
    with pytest.raises(ValueError, match="single character"):
        char_fraction(completions=["a"], char="ab")


def test_text_rewards_through_score_batch_with_none_images():
    cfg = RewardConfig.from_dict({"rewards": {
        "math": {"fn": "unirl_ray.rewards.text.math_exact_match"},
        "len": {"fn": "unirl_ray.rewards.text.length_target", "kwargs": {"target": 4}, "weight": 0.5},
    }})
    fns = {s.name: s.bound() for s in cfg.specs}
    out = score_batch(fns, [None, None], ["q1", "q2"], {"completions": ["#### 12", "1"], "answer": ["12", "#### 2"]})
    assert out == {"math": [1.0, 0.0], "len": [-0.75, -0.75]}


def test_text_module_imports_no_torch_or_ray():
    code = (
        "import sys, unirl_ray.rewards.text, unirl_ray.rewards.model; "
        "bad = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---- class reward sources -------------------------------------------------------------------------


class CountingReward:
    """A reward class: counts constructions, scores ``scale * len(completion)``."""

    built = 0

    def __init__(self, scale: float = 1.0):
        type(self).built += 1
        self.scale = scale

    def __call__(self, *, completions, **_):
        return [self.scale * len(c) for c in completions]


class Exploding:
    def __init__(self):
        raise OSError("weights missing")


def test_class_reward_is_built_once_with_kwargs():
    CountingReward.built = 0
    spec = RewardFnSpec(name="count", fn=CountingReward, kwargs={"scale": 2.0})
    assert CountingReward.built == 0  # validating the spec builds nothing (the driver loads no model)
    fn = spec.bound()
    assert CountingReward.built == 1
    out = score_batch({"count": fn}, [None] * 2, ["p", "q"], {"completions": ["ab", "abcd"]})
    assert out == {"count": [4.0, 8.0]} and CountingReward.built == 1


def test_class_reward_bad_kwargs_and_failing_constructor():
    with pytest.raises(ValueError, match=r"reward 'count': kwargs \['scal'\] do not fit CountingReward"):
        RewardFnSpec(name="count", fn=CountingReward, kwargs={"scal": 2.0})
    with pytest.raises(ValueError, match="do not fit SequenceClassifierReward"):
        RewardFnSpec(name="rm", fn="unirl_ray.rewards.model.SequenceClassifierReward", kwargs={"batchsize": 2})
    with pytest.raises(RewardError, match=r"'boom'.*constructing Exploding failed: OSError: weights missing"):
        RewardFnSpec(name="boom", fn=Exploding).bound()


# ---- the tiny sequence-classification reward model --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rm():
    from unirl_ray.rewards.model import SequenceClassifierReward

    return SequenceClassifierReward(tiny=True, batch_size=2, device="cpu")


PROMPTS = ["write a word", "add 2 and 3", "x"]
COMPLETIONS = ["aaaa", "the sum is 5\n#### 5", ""]


def test_tiny_reward_model_scores_and_batching(tiny_rm):
    from unirl_ray.rewards.model import SequenceClassifierReward

    scores = tiny_rm(prompts=PROMPTS, completions=COMPLETIONS, images=[None] * 3, answer=["1", "5", None])
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) == 3  # a random model still tells different texts apart
    one_by_one = SequenceClassifierReward(tiny=True, batch_size=1, device="cpu")
    assert one_by_one(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(scores, abs=1e-5)  # padding-free
    other_seed = SequenceClassifierReward(tiny=True, seed=1, device="cpu")
    assert other_seed(prompts=PROMPTS, completions=COMPLETIONS) != pytest.approx(scores, abs=1e-3)
    templated = SequenceClassifierReward(tiny=True, template="Q: {prompt}\nA: {completion}", device="cpu")
    assert templated(prompts=PROMPTS, completions=COMPLETIONS) != pytest.approx(scores, abs=1e-3)


def test_reward_model_round_trips_through_a_folder(tiny_rm, tmp_path):
    from unirl_ray.rewards.model import SequenceClassifierReward

    tiny_rm.save_pretrained(str(tmp_path / "rm"))
    loaded = SequenceClassifierReward(str(tmp_path / "rm"), batch_size=3, device="cpu")
    want = tiny_rm(prompts=PROMPTS, completions=COMPLETIONS)
    assert loaded(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(want, abs=1e-5)


def test_reward_model_argument_errors(tmp_path):
    from unirl_ray.rewards.model import SequenceClassifierReward

    with pytest.raises(ValueError, match="exactly one of path"):
        SequenceClassifierReward()
    with pytest.raises(ValueError, match="exactly one of path"):
        SequenceClassifierReward(str(tmp_path), tiny=True)
    with pytest.raises(ValueError, match="not found"):
        SequenceClassifierReward(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="template must contain"):
        SequenceClassifierReward(tiny=True, template="{prompt}")


# ---- packaged data -------------------------------------------------------------------------------


def _jsonl(rel: str) -> list[dict]:
    with open(asset_path(rel), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_gsm8k_sample_is_in_gsm8k_format():
    rows = _jsonl("data/gsm8k_sample.jsonl")
    assert len(rows) >= 30
    for row in rows:
        assert set(row) == {"question", "answer"} and row["question"].endswith("?")
        reasoning, final = row["answer"].rsplit("\n#### ", 1)
        assert reasoning and normalize_answer(final) is not None
    # every reference solution is its own correct completion (extraction works on the whole file)
    solutions = [r["answer"] for r in rows]
    assert math_exact_match(completions=solutions, answer=solutions) == [1.0] * len(rows)


def test_char_task_prompts():
    rows = _jsonl("data/char_task.jsonl")
    assert len(rows) >= 40 and all(set(r) == {"prompt"} and r["prompt"].strip() for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows)
