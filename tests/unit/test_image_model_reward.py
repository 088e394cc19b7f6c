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


# ------------------------------------------------------------------ PickScore and the aesthetic predictor


def test_pickscore_is_the_cosine_times_the_learned_temperature(clip):
    from unirl_ray.rewards.image_model import PickScoreReward

    pick = PickScoreReward(tiny=True, batch_size=3, device="cpu")
    # the tiny CLIP keeps CLIPConfig's initial temperature, logit_scale = 2.6592 (~ log(1 / 0.07))
    assert pick.scale == pytest.approx(np.exp(2.6592), rel=1e-6)
    images, prompts = _images(4, seed=5), ["a red fox", "a cat", "", "snow"]
    cosines = clip(images=images, prompts=prompts)  # the same tiny model, scale 1
    assert pick(images=images, prompts=prompts) == pytest.approx([np.exp(2.6592) * s for s in cosines], rel=1e-4, abs=1e-5)
    assert PickScoreReward(tiny=True, device="cpu", scale=2.0).scale == 2.0  # an explicit scale wins


@pytest.fixture(scope="module")
def aesthetic():
    from unirl_ray.rewards.image_model import AestheticReward

    return AestheticReward(tiny=True, batch_size=2, device="cpu")


def _aesthetic_by_hand(reward, image, seed=0):
    """The published predictor, written out: the CLIP image feature of the SAME tiny CLIP (its full model,
    not the reward's vision-only copy), L2-normalised, through the head's Linear layers as one affine map
    (the head has no activations; dropout is off in eval)."""
    from unirl_ray.rewards.image_model import tiny_clip

    model, processor = tiny_clip(seed=seed)
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        feature = model.get_image_features(pixel_values=pixels)
    feature = getattr(feature, "pooler_output", feature)[0].double().numpy()
    feature = feature / np.linalg.norm(feature)
    linears = [m for m in reward.head.layers if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(16, 32), (8, 16), (8, 8), (4, 8), (1, 4)]
    value = feature
    for m in linears:
        value = m.weight.detach().double().numpy() @ value + m.bias.detach().double().numpy()
    return float(value[0])


def test_aesthetic_score_is_the_head_on_the_normalised_clip_embedding(aesthetic, tmp_path):
    from unirl_ray.rewards.image_model import AestheticReward

    images = _images(5, seed=6)
    scores = aesthetic(images=images, prompts=["ignored"] * 5)
    for image, score in zip(images, scores):
        assert score == pytest.approx(_aesthetic_by_hand(aesthetic, image), abs=1e-5)
    assert all(4.0 < s < 6.0 for s in scores) and len(set(np.round(scores, 6))) > 1  # around the scale's middle
    assert aesthetic(images=images) == scores  # the prompt plays no part
    frames = _images(3, seed=7)  # a video: the mean over its frames
    assert aesthetic(images=[frames]) == pytest.approx([float(np.mean(aesthetic(images=list(frames))))], abs=1e-6)

    # a local folder: the vision tower, its processor and the head as safetensors, or the head as a .pth
    # state dict (read with weights_only=True) with the published key names
    aesthetic.save_pretrained(str(tmp_path / "aesthetic"))
    loaded = AestheticReward(str(tmp_path / "aesthetic"), head=str(tmp_path / "aesthetic" / "aesthetic_head.safetensors"),
                             device="cpu")
    assert loaded(images=images) == pytest.approx(scores, abs=1e-6)
    torch.save(aesthetic.head.state_dict(), tmp_path / "head.pth")
    assert set(aesthetic.head.state_dict()) == {f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}
    from_pth = AestheticReward(str(tmp_path / "aesthetic"), head=str(tmp_path / "head.pth"), device="cpu")
    assert from_pth(images=images) == pytest.approx(scores, abs=1e-6)
    # the tower may also come from a whole CLIPModel folder (as openai/clip-vit-large-patch14 is published)
    from unirl_ray.rewards.image_model import tiny_clip

    model, processor = tiny_clip()
    model.save_pretrained(str(tmp_path / "clip_full"))
    processor.save_pretrained(str(tmp_path / "clip_full"))
    from_clip = AestheticReward(str(tmp_path / "clip_full"), head=str(tmp_path / "head.pth"), device="cpu")
    assert from_clip(images=images) == pytest.approx(scores, abs=1e-6)

    with pytest.raises(ValueError, match="exactly one of"):
        AestheticReward()
    with pytest.raises(ValueError, match="needs head="):
        AestheticReward(str(tmp_path / "aesthetic"))
    torch.save({"layers.0.weight": torch.zeros(4, 7), "layers.0.bias": torch.zeros(4)}, tmp_path / "wrong.pth")
    with pytest.raises(ValueError, match="not an aesthetic head for 32-dim"):
        AestheticReward(str(tmp_path / "aesthetic"), head=str(tmp_path / "wrong.pth"), device="cpu")
    with pytest.raises(ValueError, match="uint8"):
        aesthetic(images=[np.zeros((8, 8, 3), dtype=np.float32)])


def test_temporal_consistency_is_the_mean_cosine_of_consecutive_frames(tmp_path):
    """Pinned by hand: each frame's image feature from the tiny CLIP's full model (not the reward's vision-only
    copy), normalised, and the mean of the consecutive cosines; a still video scores exactly 1; batching and
    a local folder change nothing; an image or a one-frame video is refused."""
    from unirl_ray.rewards.image_model import TemporalConsistencyReward, tiny_clip

    reward = TemporalConsistencyReward(tiny=True, batch_size=3, device="cpu")
    model, processor = tiny_clip()

    def by_hand(frames):
        pixels = processor(images=list(frames), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            feats = model.get_image_features(pixel_values=pixels)
        feats = getattr(feats, "pooler_output", feats).double().numpy()
        feats = feats / np.linalg.norm(feats, axis=1, keepdims=True)
        return float(np.mean([feats[t] @ feats[t + 1] for t in range(len(feats) - 1)]))

    moving, other = _images(4, seed=8), _images(3, seed=9)
    still = np.repeat(_images(1, seed=10), 5, axis=0)
    scores = reward(images=[moving, still, other], prompts=["ignored"] * 3)
    assert scores[0] == pytest.approx(by_hand(moving), abs=1e-5) and scores[2] == pytest.approx(by_hand(other), abs=1e-5)
    assert scores[1] == pytest.approx(1.0, abs=1e-6) and scores[0] < 1.0 - 1e-4  # steady vs changing frames
    assert reward(images=[other]) == pytest.approx([scores[2]], abs=1e-6)  # batch-independent
    reward.save_pretrained(str(tmp_path / "clip_vision"))
    assert TemporalConsistencyReward(str(tmp_path / "clip_vision"), device="cpu")(images=[moving, other]) == pytest.approx(
        [scores[0], scores[2]], abs=1e-6)
    with pytest.raises(ValueError, match=r"videos of 2 frames or more; samples \[1\] have 1"):
        reward(images=[moving, _images(1)[0]])
    with pytest.raises(ValueError, match="exactly one of"):
        TemporalConsistencyReward()
