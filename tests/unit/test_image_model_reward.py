"""The CLIP image reward: scores computed by hand from the model, batching, frames, save/load, errors,
and combination with a rule reward through a reward config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl_ray.rewards import RewardConfig, combine, score_batch
from unirl_ray.rewards.image_model import CLIPScoreReward


@pytest.fixture(scope="module")
def clip():
    return CLIPScoreReward(tiny=True, batch_size=2, device="cpu")


def _images(n, size=24, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _by_hand(reward, image, prompt):
    """cos(image embed, text embed) from the model's own towers, one sample at a time."""
    enc = reward.processor(text=[prompt], images=[image], return_tensors="pt", padding=True)
    with torch.no_grad():
        img = reward.model.get_image_features(pixel_values=enc["pixel_values"])
        txt = reward.model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    img, txt = (getattr(t, "pooler_output", t) for t in (img, txt))
    return float(torch.nn.functional.cosine_similarity(img, txt).item())


def test_scores_are_the_clip_cosine_and_batch_independent(clip):
    images, prompts = _images(5), ["a red fox", "a cat", "x", "an elephant in the snow", "a cat"]
    scores = clip(images=images, prompts=prompts)
    assert len(scores) == 5 and all(-1.0 <= s <= 1.0 for s in scores)
    for image, prompt, score in zip(images, prompts, scores):
        assert score == pytest.approx(_by_hand(clip, image, prompt), abs=1e-5)
    one_by_one = CLIPScoreReward(tiny=True, batch_size=1, device="cpu", scale=2.5)
    assert one_by_one(images=images, prompts=prompts) == pytest.approx([2.5 * s for s in scores], abs=1e-5)
    assert len(set(np.round(scores, 6))) > 1  # the score depends on the input
    other = CLIPScoreReward(tiny=True, seed=1, device="cpu")
    assert other(images=images, prompts=prompts) != pytest.approx(scores, abs=1e-4)


def test_video_frames_score_their_mean(clip):
    frames = _images(3, seed=2)
    prompt = "a dog"
    per_frame = clip(images=list(frames), prompts=[prompt] * 3)
    assert clip(images=[frames], prompts=[prompt]) == pytest.approx([float(np.mean(per_frame))], abs=1e-6)


def test_save_and_load_from_a_local_folder(clip, tmp_path):
    clip.save_pretrained(str(tmp_path / "clip"))
    loaded = CLIPScoreReward(str(tmp_path / "clip"), device="cpu")
    images, prompts = _images(3, seed=3), ["a", "b c", "d e f"]
    assert loaded(images=images, prompts=prompts) == pytest.approx(clip(images=images, prompts=prompts), abs=1e-6)


def test_bad_arguments_raise(clip, tmp_path):
    with pytest.raises(ValueError, match="exactly one of"):
        CLIPScoreReward()
    with pytest.raises(ValueError, match="not found"):
        CLIPScoreReward(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="uint8"):
        clip(images=[np.zeros((8, 8, 3), dtype=np.float32)], prompts=["a"])
    with pytest.raises(ValueError, match="one per sample"):
        clip(images=_images(2), prompts=["a"])


def test_combines_with_a_rule_reward_by_weight():
    cfg = RewardConfig(rewards={
        "brightness": {"fn": "unirl_ray.rewards.image.brightness", "weight": 1.0},
        "clip": {"fn": "unirl_ray.rewards.image_model.CLIPScoreReward", "weight": 0.5,
                 "kwargs": {"tiny": True, "device": "cpu"}, "app": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}},
    })
    assert [suffix for suffix, _ in cfg.placements()] == ["", "-clip"]  # the model gets its own app
    fns = {spec.name: spec.bound() for spec in cfg.specs}
    images, prompts = _images(4, seed=4), ["a", "b", "c", "d"]
    per_source = score_batch(fns, images=images, prompts=prompts)
    totals = combine(per_source, cfg.weights)
    for i, total in enumerate(totals):
        assert total == pytest.approx(images[i].mean() / 255.0 + 0.5 * per_source["clip"][i], abs=1e-6)
