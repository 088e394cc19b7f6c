"""The prompt-enhancer trainer's step without Ray: the driver (``PETrainer``) over one real train rank with
both sides (tiny LM + tiny SD3) in this process, the commands pickled both ways as Ray would carry them.

Checked here: the composed rollout (N rewrites per prompt, M images per rewrite, each Sample [rewrite,
image] with the original prompt for the rewards), the routing of each side's Parts to the rank, the
advantages the rank trained on against the driver's (and a dropped one caught), frozen sides, and the
recipe errors the driver raises before anything starts.
"""

from __future__ import annotations

import pytest
import torch
from support import InProcessGroup, Prompts, load, recipe_path

from unirl_ray.config.recipe import RecipeError
from unirl_ray.core.sample import DiffusionPart, TextPart
from unirl_ray.train.configs import TrainTopology
from unirl_ray.train.rank import StackWorker
from unirl_ray.trainer.pe import PETrainer

RECIPE = recipe_path("pe", "tiny", "pe_tiny.yaml")
SMALL = ("ray.scaling.num_workers=1", "trainer.prompts_per_step=1", "ar.algorithm.group_size=2",
         "diffusion.algorithm.group_size=2", "diffusion.pipeline.num_inference_steps=2",
         "ar.stack.mini_batch_size=2", "ar.stack.micro_batch_size=2", "diffusion.stack.mini_batch_size=4",
         "diffusion.stack.micro_batch_size=4", "ar.pipeline.max_new_tokens=6")


class LocalReward:
    """Scores like the reward app would: image brightness + a length term on what the rewriter wrote."""

    def __init__(self):
        self.seen = []

    def score(self, samples):
        self.seen.append([(s.prompt, dict(s.columns)) for s in samples])
        for s in samples:
            s.rewards = {"bright": float(s.image.mean()) / 255.0, "len": -abs(8 - len(s.columns["completions"])) / 8}
            s.reward = s.rewards["bright"] + 0.1 * s.rewards["len"]
        return {"reward/mean": sum(s.reward for s in samples) / len(samples)}


def driver(tmp_path, *overrides):
    trainer = PETrainer(load(RECIPE, tmp_path, "pe-unit", *SMALL, *overrides))
    torch.manual_seed(0)
    rank = StackWorker(trainer.rank_sections(), topology=TrainTopology(), device=torch.device("cpu"))
    trainer.group, trainer.reward, trainer.data = InProcessGroup(rank), LocalReward(), Prompts(["a red cat", "a dog"])
    trainer.policy_version = dict(rank.policy_version)
    return trainer, rank


def test_a_step_composes_rewrites_and_images_and_trains_each_side_on_its_parts(tmp_path):
    trainer, rank = driver(tmp_path)
    samples, metrics = trainer.collect(1)
    assert len(samples) == 1 * 2 * 2  # prompts x rewrites x images
    original = "a red cat"
    assert trainer.prompt_log == [(1, [original])]
    for s in samples:
        text, image = s.parts
        assert isinstance(text, TextPart) and isinstance(image, DiffusionPart)
        assert (text.stage, image.stage) == ("ar", "diffusion")
        assert s.prompt == s.columns["original_prompt"] == original  # image rewards see the user's prompt
        assert s.columns["completions"] == text.text and s.image is not None
    # the M images of a rewrite share its Part id; the rewrites of a prompt share the group
    assert [s.parts[0].part_id for s in samples] == ["s1-p0-r0", "s1-p0-r0", "s1-p0-r1", "s1-p0-r1"]
    assert len({s.group_id for s in samples}) == 1
    assert {"pe/fallback_frac", "pe/rewrite_chars_mean", "timing/rollout_rewrite", "timing/rollout_draw"} <= set(metrics)

    credit = trainer.assign_credit(1, samples)
    assert credit["credit/ar/rewrites"] == 2.0
    out = trainer.train(samples, seed=0)
    assert trainer.policy_version == {"ar": 1, "diffusion": 1} == rank.policy_version
    assert out["pe/advantages_checked"] == 2 + 4  # one per rewrite (ar) and one per image (diffusion)
    assert "ar/train/loss" in out and "diffusion/train/loss" in out
    assert out["ar/rollout/logp_gap"] < 1e-4 and out["diffusion/rollout/logp_gap"] < 1e-4  # ratio 1 at step start
    assert rank._cache == {}


def test_an_advantage_lost_on_the_rank_is_caught_by_the_driver(tmp_path, monkeypatch):
    import unirl_ray.train.rank as rank_module

    trainer, _ = driver(tmp_path, "trainer.freeze_diffusion=true")
    samples, _ = trainer.collect(1)
    trainer.assign_credit(1, samples)
    assert any(s.parts[0].advantage for s in samples)
    original = rank_module.complete_sample

    def drops_part_advantages(light, cached):  # what the trainside path did before Parts kept their scores
        full = original(light, cached)
        for part in full.parts:
            part.advantage = 0.0
        return full

    monkeypatch.setattr(rank_module, "complete_sample", drops_part_advantages)
    with pytest.raises(RuntimeError, match="other advantages than the driver assigned"):
        trainer.train(samples, seed=0)


def test_frozen_sides_roll_out_only_and_image_rewards_can_see_the_rewrite(tmp_path):
    trainer, rank = driver(tmp_path, "trainer.freeze_llm=true", "reward.image_prompt=rewrite")
    assert not rank.side("ar").trainable and rank.side("ar").backend is None
    samples, _ = trainer.collect(1)
    assert all(s.prompt == s.columns["rewrite"] for s in samples)
    trainer.assign_credit(1, samples)
    out = trainer.train(samples, seed=0)
    assert trainer.policy_version == {"ar": 0, "diffusion": 1}
    assert not any(k.startswith("ar/") for k in out) and out["pe/advantages_checked"] == 4


@pytest.mark.parametrize("overrides, message", [
    (("trainer.freeze_llm=true", "trainer.freeze_diffusion=true"), "nothing would train"),
    (("trainer.prompts_per_step=3",), "must divide evenly over ray.scaling.num_workers=2"),
    (("ar.rollout={_target_: unirl_ray.rollout.TensorWeightSync}",), "must be unirl_ray.rollout.TrainsideRollout"),
    (("trainer.freeze_llm=true", "ar.rollout={_target_: unirl_ray.rollout.DedicatedRollout}"),
     "a frozen side has no new weights to send an engine"),
    (("diffusion.algorithm={_target_: unirl_ray.algorithms.GRPO, group_size: 2}",), "does not train DiffusionParts"),
    (("rollout.instruction=Rewrite this",), "must contain '{prompt}'"),
    (("ar.stack=null",), "ar.stack is missing"),
    (("+trainer.eval_every=2",), "PERunConfig takes no argument 'eval_every'"),
    (("trainer.diffusion_group_scope=image",), "diffusion_group_scope` must be one of 'rewrite' or 'prompt'"),
    (("ar.stack.mini_batch_size=5",), "ar.stack"),
    (("diffusion.algorithm.normalize_std=false",), "diffusion.algorithm.normalize_std=False: the prompt enhancer's credit"),
    (("+ar.algorithm.advantage_estimator=rloo",), "set ar.algorithm.advantage_estimator='grpo'"),
])
def test_bad_prompt_enhancer_recipes_fail_on_the_driver(tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace("{", r"\{").replace("}", r"\}")):
        PETrainer(load(RECIPE, tmp_path, "pe-bad", *overrides))


def test_image_prompt_is_refused_outside_the_prompt_enhancer(tmp_path):
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    recipe = load(recipe_path("diffusion", "sd3", "sd3_tiny_flowgrpo.yaml"), tmp_path, "x", "+reward.image_prompt=rewrite")
    with pytest.raises(RecipeError, match="reward.image_prompt='rewrite' is for prompt-enhancer recipes"):
        DiffusionTrainer(recipe)


def test_an_earlier_per_side_export_is_replaced_and_anything_else_refused(tmp_path):
    from unirl_ray.train.export import INFO_FILE

    export = tmp_path / "export"
    for side in ("ar", "diffusion"):  # what a finished PE run left: one export per side
        (export / side).mkdir(parents=True)
        (export / side / INFO_FILE).write_text("{}")
    trainer = PETrainer(load(RECIPE, tmp_path / "runs", "pe-export", f"+trainer.export_dir={export}"))
    assert trainer.run_cfg.export_dir == str(export)
    (export / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="exists and is not empty"):
        PETrainer(load(RECIPE, tmp_path / "runs", "pe-export", f"+trainer.export_dir={export}"))


def test_exports_name_a_trained_side_and_resumes_may_change_per_side_resources(tmp_path):
    trainer = PETrainer(load(RECIPE, tmp_path, "pe-misc", "trainer.freeze_llm=true"))
    with pytest.raises(ValueError, match="name the side to export: side='diffusion'"):
        trainer.export(str(tmp_path / "out"))
    with pytest.raises(ValueError, match="a frozen side has nothing trained to export"):
        trainer.export(str(tmp_path / "out"), side="ar")
    safe = trainer.resume_safe_prefixes()
    assert {"stack.micro_batch_size", "ar.stack.micro_batch_size", "diffusion.rollout.num_replicas"} <= set(safe)


def test_single_side_ranks_leave_the_rollout_to_a_dedicated_engine(tmp_path):
    from unirl_ray.trainer.ar import ARTrainer

    engine = ARTrainer(load(recipe_path("ar", "tiny", "char_grpo_engine.yaml"), tmp_path, "engine"))
    direct = ARTrainer(load(recipe_path("ar", "tiny", "char_grpo_direct.yaml"), tmp_path, "direct"))
    assert "rollout" not in engine.rank_sections() and "rollout" in direct.rank_sections()
    assert "rollout" not in direct.rank_sections(rollout=False)  # an export generates nothing
