"""The unified-model trainer's step without Ray: the driver (``UnifiedModelTrainer``) over one real train rank in
this process (commands pickled both ways as Ray carries them), and the recipe errors it raises before anything
starts."""

from __future__ import annotations

import pytest
import torch
from support import InProcessGroup, Prompts, load, recipe_path

from unirl_ray.config.recipe import RecipeError
from unirl_ray.core.sample import DiffusionPart, TextPart, routed_part
from unirl_ray.train.configs import TrainTopology
from unirl_ray.train.rank import StackWorker
from unirl_ray.trainer.unified import UnifiedModelTrainer

RECIPE = recipe_path("unified", "tiny", "unified_tiny.yaml")
SMALL = ("ray.scaling.num_workers=1", "trainer.prompts_per_step=1", "algorithm.text.group_size=2",
         "pipeline.num_inference_steps=2", "pipeline.max_new_tokens=4")


class LocalReward:
    """Scores like the reward app would: image brightness + the fraction of "a" in what the model wrote."""

    def score(self, samples):
        for s in samples:
            text = s.columns["completions"]
            s.rewards = {"bright": float(s.image.mean()) / 255.0, "a": text.count("a") / max(len(text), 1)}
            s.reward = s.rewards["bright"] + 0.5 * s.rewards["a"]
        return {"reward/mean": sum(s.reward for s in samples) / len(samples)}


def driver(tmp_path, *overrides):
    trainer = UnifiedModelTrainer(load(RECIPE, tmp_path, "unified-unit", *SMALL, *overrides))
    rank = StackWorker(trainer.rank_sections(), topology=TrainTopology(), device=torch.device("cpu"))
    trainer.group, trainer.reward, trainer.data = InProcessGroup(rank), LocalReward(), Prompts(["a red cat", "a dog"])
    trainer.policy_version, trainer.engine, trainer._stage_metrics = 0, None, {}
    return trainer, rank


def test_a_step_writes_then_draws_and_trains_both_stages_on_their_parts(tmp_path):
    trainer, rank = driver(tmp_path, "trainer.images_per_text=2", "trainer.image_group_scope=text")
    samples, metrics = trainer.collect(1)
    assert len(samples) == 1 * 2 * 2  # prompts x text segments x images
    for s in samples:
        text, image = routed_part(s, TextPart, "text"), routed_part(s, DiffusionPart, "image")
        assert s.prompt == "a red cat" and s.columns["completions"] == text.text and s.image is not None
    assert [routed_part(s, TextPart, "text").part_id for s in samples] == ["s1-p0-t0", "s1-p0-t0", "s1-p0-t1", "s1-p0-t1"]
    assert metrics["unified/text_segments"] == 2 and metrics["unified/images"] == 4
    credit = trainer.assign_credit(1, samples)
    assert credit["credit/text/rewrites"] == 2.0
    out = trainer.train(samples, seed=0)
    assert trainer.policy_version == 1 == rank.policy_version
    assert out["unified/advantages_checked"] == 2 + 4  # one per text segment, one per image
    assert out["text/train/parts"] == 2 and out["image/train/parts"] == 4
    assert out["text/rollout/logp_gap"] < 1e-4 and out["image/rollout/logp_gap"] < 1e-4  # ratio 1 at step start
    assert out["train/optimizer_steps"] == 1.0  # one optimizer step over both stages
    assert rank._cache == {}


def test_an_advantage_lost_on_the_rank_is_caught_by_the_driver(tmp_path, monkeypatch):
    import unirl_ray.train.rank as rank_module

    trainer, _ = driver(tmp_path)
    samples, _ = trainer.collect(1)
    trainer.assign_credit(1, samples)
    original = rank_module.complete_sample

    def drops_the_image_advantage(light, cached):
        full = original(light, cached)
        full.parts[1].advantage = None  # the image would fall back to the sample's (None): lost on the way
        full.advantage = 0.0
        return full

    monkeypatch.setattr(rank_module, "complete_sample", drops_the_image_advantage)
    with pytest.raises(RuntimeError, match="trained stage 'image' on other advantages"):
        trainer.train(samples, seed=0)


def test_only_the_image_stage_trains_when_the_text_algorithm_is_left_out(tmp_path):
    trainer, rank = driver(tmp_path, "~algorithm.text", "stack.loss_weights={image: 1.0}", "+trainer.texts_per_image_only=2")
    assert set(rank.algorithm) == {"image"}
    samples, _ = trainer.collect(1)
    assert len(samples) == 2
    trainer.assign_credit(1, samples)
    out = trainer.train(samples, seed=0)
    assert "image/train/loss" in out and not any(k.startswith("text/") for k in out)


@pytest.mark.parametrize("overrides, message", [
    (("algorithm={_target_: unirl_ray.algorithms.GRPO, group_size: 2}",), "maps its stages to algorithms"),
    (("+algorithm.video={_target_: unirl_ray.algorithms.GRPO, group_size: 2}",), "maps its stages"),
    (("algorithm.image={_target_: unirl_ray.algorithms.GRPO, group_size: 2}",), "GRPO does not train DiffusionParts"),
    (("stack={_target_: unirl_ray.train.stack.TrainStack}",), "UnifiedModelTrainStack"),
    (("stack.loss_weights={text: 1.0, video: 2.0}",), "names stage"),
    (("rollout={_target_: unirl_ray.rollout.DedicatedRollout, engine: hf}",), "or on an engine pair, one app per stage"),
    (("rollout={text: {_target_: unirl_ray.rollout.DedicatedRollout}}",), "an engine pair names the stages text and image"),
    (("rollout={text: {_target_: unirl_ray.rollout.TrainsideRollout}, image: {_target_: unirl_ray.rollout.DedicatedRollout}}",),
     "rollout.text: each engine of the pair is"),
    (("ray.scaling.num_workers=3",), "must divide evenly over ray.scaling.num_workers=3"),
    (("trainer.image_group_scope=text",), "needs trainer.images_per_text >= 2"),
    (("~algorithm.text", "stack.loss_weights={image: 1.0}"), "would train on advantage 0"),
    (("+algorithm.text.normalize_std=false",), "set algorithm.text.normalize_std=True"),
    (("pipeline.height=30",), "pipeline.height=30 must be a positive multiple of 4"),
])
def test_bad_unified_recipes_are_refused_on_the_driver(tmp_path, overrides, message):
    with pytest.raises((RecipeError, ValueError), match=message):
        UnifiedModelTrainer(load(RECIPE, tmp_path, "bad", *SMALL, *overrides))


def test_a_janus_step_trains_text_and_image_tokens_and_its_real_recipe_validates(tmp_path, monkeypatch):
    import json

    janus = recipe_path("unified", "tiny", "janus_tiny.yaml")
    trainer = UnifiedModelTrainer(load(janus, tmp_path, "janus-unit", *SMALL[:-2], "pipeline.max_new_tokens=4"))
    rank = StackWorker(trainer.rank_sections(), topology=TrainTopology(), device=torch.device("cpu"))
    trainer.group, trainer.reward, trainer.data = InProcessGroup(rank), LocalReward(), Prompts(["a red cat"])
    trainer.policy_version, trainer.engine, trainer._stage_metrics = 0, None, {}
    samples, _ = trainer.collect(1)
    assert all([p.stage for p in s.parts] == ["text", "image"] and all(isinstance(p, TextPart) for p in s.parts)
               for s in samples)  # two TextParts, routed by their stage
    trainer.assign_credit(1, samples)
    out = trainer.train(samples, seed=0)
    assert out["unified/advantages_checked"] == 2 + 2 and out["image/train/parts"] == 2
    assert out["image/rollout/logp_gap"] < 1e-4 and "image/algo/clip_frac" in out

    (tmp_path / "janus").mkdir()
    (tmp_path / "janus" / "config.json").write_text(json.dumps({"model_type": "janus"}))
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path / "janus"))
    monkeypatch.setenv("CLIP_MODEL", str(tmp_path / "clip"))
    real = UnifiedModelTrainer(load(recipe_path("unified", "janus", "janus_pro_1b.yaml"), tmp_path, "janus-real"))
    assert not real.is_demo() and real.texts_per_prompt() == 4 and real.group_size == 8
    with pytest.raises(ValueError, match="has no config.json"):
        monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path / "missing"))
        UnifiedModelTrainer(load(recipe_path("unified", "janus", "janus_pro_1b.yaml"), tmp_path, "janus-real"))
