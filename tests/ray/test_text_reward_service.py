"""Text samples through the real reward Serve app: rule rewards + a tiny reward model, GSM8K prompts."""

from __future__ import annotations

import pytest

from unirl_ray.assets import asset_path
from unirl_ray.core.sample import Sample, TextPart
from unirl_ray.data import PromptSource
from unirl_ray.rewards import RewardClient, RewardConfig
from unirl_ray.rewards.service import samples_to_inputs

RM_KWARGS = {"tiny": True, "seed": 3, "batch_size": 4, "device": "cpu"}
REWARDS = {
    "math": {"fn": "unirl_ray.rewards.text.math_exact_match", "weight": 1.0},
    # The reward model runs as its own Serve app (its own replicas and resources).
    "rm": {"fn": "unirl_ray.rewards.model.SequenceClassifierReward", "weight": 0.5, "kwargs": RM_KWARGS,
           "app": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}},
    "chars": {"fn": "unirl_ray.rewards.text.char_fraction", "weight": 0.0, "kwargs": {"char": "4"}},
}


@pytest.fixture(scope="module")
def gsm8k_rows(ray_local):
    src = PromptSource(path=asset_path("data/gsm8k_sample.jsonl"), prompt_column="question", columns=["answer"],
                       shuffle=False)
    return src.next_batch(len(src))


@pytest.fixture(scope="module")
def text_reward_app(ray_local):
    cfg = RewardConfig.from_dict({"rewards": REWARDS, "ray_actor_options": {"num_cpus": 0.25}, "timeout_s": 60.0})
    client = RewardClient.deploy(cfg, app_name="text-reward-test", ready_timeout_s=180)
    yield client
    client.shutdown()


def test_prompt_source_maps_gsm8k_columns(gsm8k_rows):
    assert len(gsm8k_rows) >= 30
    first = gsm8k_rows[0]
    assert set(first) == {"prompt", "answer", "row_index"} and first["row_index"] == 0
    assert first["prompt"].startswith("Mia has 12 stickers") and first["answer"].endswith("#### 16")
    chars = PromptSource(path=asset_path("data/char_task.jsonl"), shuffle=False)
    assert len(chars) >= 40 and chars.next_batch(1)[0] == {"prompt": "write a word", "row_index": 0}


def _text_samples(rows: list[dict]) -> list[Sample]:
    """Per row: a correct GSM8K-style completion, a wrong boxed one; plus one row without an answer."""
    samples = []
    for i, row in enumerate(rows):
        final = row["answer"].rsplit("#### ", 1)[1]
        for j, text in enumerate([f"Let me add it up.\n#### {final}", f"I think it is \\boxed{{{final}1}}"]):
            samples.append(Sample(sample_id=f"s0-{2 * i + j}", group_id=f"g{i}", prompt=row["prompt"],
                                  columns={"answer": row["answer"]}, parts=[TextPart(text=text)]))
    samples.append(Sample(sample_id="s0-x", group_id="gx", prompt="no reference", columns={},
                          parts=[TextPart(text="#### 4")]))
    return samples


def test_text_samples_scored_by_rules_and_reward_model(text_reward_app, gsm8k_rows):
    from unirl_ray.rewards.model import SequenceClassifierReward

    samples = _text_samples(gsm8k_rows[:3])
    images, prompts, columns = samples_to_inputs(samples)
    assert images == [None] * 7 and columns["completions"][0].endswith("#### 16")
    assert columns["answer"][-1] is None  # the sample without the column gets None

    metrics = text_reward_app.score(samples)

    local_rm = SequenceClassifierReward(**RM_KWARGS)  # same seed: the replica's weights
    want_rm = local_rm(prompts=prompts, completions=columns["completions"])
    want_math = [1.0, 0.0] * 3 + [None]
    for i, s in enumerate(samples):
        assert s.rewards["math"] == want_math[i]
        assert s.rewards["rm"] == pytest.approx(want_rm[i], abs=1e-4)
        text = columns["completions"][i]
        assert s.rewards["chars"] == pytest.approx(text.count("4") / len(text))
        if want_math[i] is None:
            assert s.reward is None  # a weighted source is invalid
        else:
            assert s.reward == pytest.approx(want_math[i] + 0.5 * want_rm[i], abs=1e-4)
    assert metrics["reward/math/mean"] == pytest.approx(0.5)
    assert metrics["reward/rm/mean"] == pytest.approx(sum(want_rm) / 7, abs=1e-4)
    assert metrics["reward/invalid_frac"] == pytest.approx(1 / 7)
    assert metrics["reward/mean"] == pytest.approx(sum(s.reward for s in samples[:6]) / 6)
    for key in ("reward/chars/mean", "reward/rm/std", "timing/reward", "timing/reward/rm", "timing/reward/math"):
        assert key in metrics


def test_reward_model_runs_in_its_own_app_and_the_rules_in_this_process(text_reward_app):
    """``placement: auto``: the rule sources (functions) run in the client's process, the reward model (a
    class, with its own ``app``) in its Serve app; the client only ever deletes Serve apps."""
    from ray import serve

    from unirl_ray.rewards.service import LocalRewardHandle

    assert [a.name for a in text_reward_app.apps] == ["text-reward-test", "text-reward-test-rm"]
    assert [a.local for a in text_reward_app.apps] == [True, False]
    assert isinstance(text_reward_app.apps[0].handle, LocalRewardHandle)
    assert text_reward_app.app_names() == ["text-reward-test-rm"]
    assert [s.name for s in text_reward_app.apps[0].config.specs] == ["math", "chars"]
    assert [s.name for s in text_reward_app.apps[1].config.specs] == ["rm"]
    running = serve.status().applications
    assert running["text-reward-test-rm"].status == "RUNNING" and "text-reward-test" not in running
    for app in text_reward_app.apps:
        # each was built from its app's config only: the rules never load the model
        assert sorted(app.handle.get_config.remote().result(timeout_s=30)["rewards"]) == sorted(
            s.name for s in app.config.specs)
    assert RewardConfig.from_dict({"rewards": REWARDS}).resources() == {"CPU": 0.25}  # the rm app's replica only


def test_http_body_without_images_scores_text():
    """The HTTP entry point accepts text requests (no ``images``); run on the replica class in-process."""
    import asyncio

    from unirl_ray.rewards.service import RewardService

    class Request:
        async def json(self):
            return {"prompts": ["p1", "p2"], "columns": {"completions": ["#### 1,234", "aaaa"], "answer": ["1234", "5"]}}

    service = RewardService({"rewards": {"math": REWARDS["math"], "chars": REWARDS["chars"]}})
    out = asyncio.run(service(Request()))
    assert out["errors"] == {}
    assert out["scores"] == {"math": [1.0, 0.0], "chars": [0.1, 0.0]}  # one "4" in 10 characters
    assert out["reward"] == [1.0, 0.0]
