"""End to end on CPU: the prompt enhancer (a tiny LM rewrites, a tiny SD3 draws) on 2 Ray Train workers that
hold both sides, a Serve reward app, Ray Data prompts, MLflow.

One straight run with both sides trained serves most assertions: 14 steps, a checkpoint every 7, rank 1
SIGKILLed while step 9 trains (Ray Train restarts the worker group, the workers load the step-7
checkpoint of both sides, steps 8 and 9 run again: step 8 with the same numbers). Its storage folder is
copied while step 8 first trains (``support.copy_run``: the step-7 checkpoint committed, nothing newer);
a fit of the copy resumes to step 9, as a job stopped after step 7 would, and its steps 8 and 9 equal the
straight run's. Then each frozen mode learns on its own, the trained side on a dedicated engine app (the
other layouts): ``freeze_llm`` (only the image model, on a separate engine; image reward only,
advantages over all images of a prompt) and ``freeze_diffusion`` (only the rewriter, on a colocated
engine; a rewrite scored by its best image).

On every step the driver checks that the ranks trained each Part on the advantage it assigned
(``pe/advantages_checked`` counts them); the ratio is 1 at the start of each side's step (``logp_gap``).
"""

import os

import numpy as np
import pytest
from support import (ONE_WORKER, artifacts, attempts, copy_run, drive, fit, kill_rank, logged, make, recipe_path,
                     sample_table)

from unirl_ray.trainer.pe import PETrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.second_lane]  # .ci/test: beside the shared-Ray lane

RECIPE = recipe_path("pe", "tiny", "pe_tiny.yaml")
STEPS, CHECKPOINT, KILL_AT = 14, 7, 9
COMMON = (f"trainer.checkpoint_every={CHECKPOINT}", "ray.scaling.num_workers=2")
PER_STEP = 2 * 8 + 2 * 8 * 2  # prompts x rewrites (ar Parts) + prompts x rewrites x images (diffusion Parts)


def assert_rises(trainer, spreads=3.0):
    """The reward of the last 3 steps is several within-step spreads above that of the first 3."""
    rewards, stds = logged(trainer, "reward/mean"), logged(trainer, "reward/std")
    steps = sorted(rewards)
    first, last = np.mean([rewards[s] for s in steps[:3]]), np.mean([rewards[s] for s in steps[-3:]])
    spread = np.mean([stds[s] for s in steps[:3]])
    assert last - first > spreads * spread, (first, last, spread, [rewards[s] for s in steps])


def checkpoint_sides(storage, name, step):
    return sorted(os.listdir(os.path.join(storage, name, f"checkpoint_{step:06d}", "shards")))


@pytest.fixture(scope="module")
def straight(ray_local, tmp_path_factory):
    storage = tmp_path_factory.mktemp("pe")
    trainer = make(PETrainer, RECIPE, storage, "pe-straight", f"trainer.num_steps={STEPS}", *COMMON,
                   "tracking.log_samples_every=7", "++ray.max_failures=1", f"+trainer.export_dir={storage / 'export'}",
                   experiment="e2e-pe")
    pids, original = [], trainer.train
    copy = tmp_path_factory.mktemp("pe-copy") / "after_step_7"

    def train(samples, *, seed):
        step = trainer.prompt_log[-1][0]
        if step == CHECKPOINT + 1 and not copy.exists():  # the step-7 checkpoint, before the kill
            copy_run(trainer, copy)
        if step == KILL_AT and not pids:  # step 9's samples are out, its training starts
            pids.append(kill_rank(trainer, 1))
        return original(samples, seed=seed)

    trainer.train = train
    trainer.fit()
    return trainer, storage, pids, copy


def test_both_sides_learn_and_a_killed_worker_is_replayed_exactly(straight):
    trainer, storage, pids, _ = straight
    assert pids and trainer.restarts == 1 and trainer.policy_version == {"ar": STEPS, "diffusion": STEPS}
    assert_rises(trainer)
    for key in ("reward/brightness/mean", "reward/length/mean"):  # each side moved its own reward
        values = logged(trainer, key)
        assert np.mean([values[s] for s in (12, 13, 14)]) > np.mean([values[s] for s in (1, 2, 3)]), key
    for key in ("reward/mean", "ar/train/loss", "diffusion/train/loss", "ar/train/grad_norm", "diffusion/train/grad_norm"):
        values = attempts(trainer, key)
        assert sorted(values) == list(range(1, STEPS + 1)), key
        # step 8 ran again from the step-7 checkpoint of both sides with the same numbers; step 9 (killed
        # before its metrics were logged) and every other step were logged once
        assert len(values[8]) == 2 and values[8][0] == pytest.approx(values[8][1], rel=1e-6, abs=1e-9), key
        assert all(len(v) == 1 for step, v in values.items() if step != 8), key
    assert attempts(trainer, "fault/worker_group_restarts") == {CHECKPOINT: [1.0]}  # rewound to the step-7 checkpoint
    checked = logged(trainer, "pe/advantages_checked")
    assert sorted(checked) == list(range(1, STEPS + 1)) and set(checked.values()) == {float(PER_STEP)}
    for side in ("ar", "diffusion"):  # on-policy trainside rollout: the ratio is 1 at the start of each step
        assert max(logged(trainer, f"{side}/rollout/logp_gap").values()) < 1e-4, side
        assert logged(trainer, f"{side}/train/policy_version")[STEPS] == STEPS
    assert 0.0 <= min(logged(trainer, "pe/fallback_frac").values()) <= max(logged(trainer, "pe/fallback_frac").values()) < 0.5
    assert checkpoint_sides(storage, "pe-straight", STEPS) == ["ar", "diffusion"]
    table = sample_table(trainer, "samples/step_000007.json")  # every log_samples_every steps: a table ...
    assert len(table["data"]) == 32  # the step's images (at most 32 shown)
    for column in ("prompt", "rewrite", "rewriter_text", "reward", "rewrite_reward", "ar_advantage", "diffusion_advantage"):
        assert column in table["columns"], column
    grid = artifacts(trainer, "images")  # ... and an image grid with the rewrites as captions
    assert any(a.endswith(".png") for a in grid) and any(a.endswith("step_000007.json") for a in grid), grid
    captions = sample_table(trainer, "images/step_000007.json")
    rewrite, caption = table["columns"].index("rewrite"), captions["columns"].index("caption")
    assert captions["data"][0][caption].startswith(f"{table['data'][0][rewrite]} | r=")
    for side, marker in (("ar", "config.json"), ("diffusion", "model_index.json")):  # one model folder per side
        assert marker in os.listdir(storage / "export" / side), side


def test_resume_continues_both_sides_exactly(straight):
    trainer, _, _, copy = straight
    resumed = fit(PETrainer, RECIPE, copy, "pe-straight", f"trainer.num_steps={KILL_AT}", *COMMON,
                  "tracking.log_samples_every=0", experiment="e2e-pe-resume")
    assert [s for s, _ in resumed.prompt_log] == [CHECKPOINT + 1, KILL_AT]
    assert resumed.prompt_log == trainer.prompt_log[CHECKPOINT:KILL_AT]  # the data cursor continued
    for key in ("reward/mean", "ar/train/loss", "diffusion/train/loss", "ar/train/grad_norm", "diffusion/train/grad_norm"):
        got, first = logged(resumed, key), {s: v[0] for s, v in attempts(trainer, key).items()}
        assert sorted(got) == list(range(1, KILL_AT + 1)), key  # one MLflow run, continued
        for step in (CHECKPOINT + 1, KILL_AT):  # step 8 as first trained; step 9 as trained after the restart
            assert got[step] == pytest.approx(first[step], rel=1e-6, abs=1e-9), (key, step)


ENGINE = "{_target_: unirl_ray.rollout.DedicatedRollout, engine: hf, placement: %s, ray_actor_options: {num_cpus: 0.5}}"
# The frozen-mode runs check the engines and what each side learns, not ranks (the straight run has two):
# they run on ONE_WORKER.


def engine_checks(trainer, side, per_step, colocated, last):
    """A ``drive`` check: the side's engine serves every version right after its step (v0: the initial
    push), verified, and samples what the trainer would (log-probs equal at the start of each step); the
    last step is checkpointed (as ``fit`` would)."""
    def check(step, metrics):
        if step == last:
            trainer.save_checkpoint(step)
        engine = trainer.engines[side]
        assert engine.version == step and engine.colocated == colocated
        if step:
            assert metrics[f"{side}/weight_sync/version"] == step
            assert metrics[f"{side}/rollout/logp_gap"] < 1e-4
            assert metrics["rollout/version_lag_max"] == 0 and metrics["pe/advantages_checked"] == per_step
            if colocated:  # the workers handed their memory to the engine for its turn
                assert metrics[f"{side}/colocate/train_bytes_offloaded"] > 0
                assert metrics[f"{side}/colocate/train_bytes_resident"] == 0
    return check


def test_freeze_llm_trains_only_the_image_model_on_its_engine(ray_local, tmp_path):
    """The image model alone learns, rolling out on a separate HF engine app synced every step; the
    frozen rewriter writes on the train ranks (image reward only, advantages over all images of a prompt)."""
    trainer = make(PETrainer, RECIPE, tmp_path, "pe-freeze-llm", "trainer.num_steps=8", *COMMON,
                   "trainer.freeze_llm=true", "reward.rewards.length.weight=0", "trainer.diffusion_group_scope=prompt",
                   "tracking.log_samples_every=0", f"diffusion.rollout={ENGINE % 'separate'}", *ONE_WORKER,
                   experiment="e2e-pe")
    sides = trainer.rank_sections()["sides"]
    assert "rollout" not in sides["diffusion"] and "backend" not in sides["ar"] and "rollout" in sides["ar"]
    drive(trainer, 8, engine_checks(trainer, "diffusion", 2 * 8 * 2, colocated=False, last=8))
    assert_rises(trainer)
    assert trainer.policy_version == {"ar": 0, "diffusion": 8}
    assert not logged(trainer, "ar/train/loss") and logged(trainer, "diffusion/train/loss")
    assert checkpoint_sides(tmp_path, "pe-freeze-llm", 8) == ["diffusion"]  # a rollout-only side saves nothing


def test_freeze_diffusion_trains_only_the_rewriter_on_a_colocated_engine(ray_local, tmp_path):
    """The rewriter alone learns (a rewrite scored by its best image), writing on a colocated HF engine that
    takes turns with the train workers; the frozen image model draws on the train ranks."""
    # the image reward reaches the rewriter only through the images of its rewrites: a weak signal, so the
    # rewriter's learning rate is doubled; 2 within-step spreads over 3 steps of 32 images are still ~20
    # standard errors of the mean
    steps = 8
    trainer = make(PETrainer, RECIPE, tmp_path, "pe-freeze-diffusion", f"trainer.num_steps={steps}", *COMMON,
                   "trainer.freeze_diffusion=true", "trainer.rewrite_reward=max", "tracking.log_samples_every=0",
                   "ar.backend.optimizer_cfg.learning_rate=4e-2", f"ar.rollout={ENGINE % 'colocated'}",
                   *ONE_WORKER, experiment="e2e-pe")
    drive(trainer, steps, engine_checks(trainer, "ar", 2 * 8, colocated=True, last=steps))
    assert_rises(trainer, spreads=2.0)
    assert trainer.policy_version == {"ar": steps, "diffusion": 0}
    assert not logged(trainer, "diffusion/train/loss") and logged(trainer, "ar/train/loss")
    assert checkpoint_sides(tmp_path, "pe-freeze-diffusion", steps) == ["ar"]
