"""End to end on CPU: the unified model (one tiny Qwen2 backbone writes a think segment and draws the image)
on 2 Ray Train workers (FSDP2 over gloo), a Serve reward app, Ray Data prompts, MLflow.

One run serves every assertion: 8 steps, a checkpoint every 4, rank 1 SIGKILLed while step 6 trains (Ray
Train restarts the worker group, the workers load the step-4 checkpoint, step 5 runs again with the same
numbers: checkpoint + resume exact). Both stages train in one optimizer step on every step; the driver
checks that each rank trained each Part on the advantage it assigned; the ratio is 1 at the start of each
stage's step (``logp_gap``). Right after the last step the live ranks sample fixed requests; the model the
run exports reloads from its folder and gives the same text and image. The Janus-Pro family (discrete image
tokens, both stages GRPO) runs 8 steps on one worker with both CPUs (it checks nothing about ranks, and a
worker fewer starts faster) with the engine pair (a text app writes, an image app draws, one weight export
per step feeds both): it learns, both stages train every step with engine == trainer log-probs, its export
reloads and gives the live outputs.
"""

import numpy as np
import pytest
from support import artifacts, attempts, kill_rank, logged, make, recipe_path, sample_table

from unirl_ray.trainer.unified import UnifiedModelTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = recipe_path("unified", "tiny", "unified_tiny.yaml")
STEPS, CHECKPOINT, KILL_AT = 8, 4, 6
PER_STEP = 2 * 4 + 2 * 4 * 1  # prompts x text segments (text Parts) + prompts x segments x images (image Parts)
LIVE = [{"sample_id": f"live-{i}", "group_id": "live", "prompt": prompt, "columns": {}, "seed": 7 + i,
         "text_id": f"live-{i}", "text_seed": 70 + i} for i, prompt in enumerate(["a red fox", "an owl"])]


@pytest.fixture(scope="module")
def run(ray_local, tmp_path_factory):
    storage = tmp_path_factory.mktemp("unified")
    trainer = make(UnifiedModelTrainer, RECIPE, storage, "unified", f"trainer.num_steps={STEPS}",
                   f"trainer.checkpoint_every={CHECKPOINT}", "tracking.log_samples_every=4", "++ray.max_failures=1",
                   f"+trainer.export_dir={storage / 'export'}", experiment="e2e-unified")
    pids, live, original = [], [], trainer.train

    def train(samples, *, seed):
        step = trainer.prompt_log[-1][0]
        if step == KILL_AT and not pids:  # step 6's samples are out, its training starts
            pids.append(kill_rank(trainer, 1))
        out = original(samples, seed=seed)
        if step == STEPS:  # the final weights, live on the ranks: what the export must reproduce
            shards = trainer.group.call("eval_generate", [{"requests": [r]} for r in LIVE])
            live.extend(s for shard in shards for s in shard)
        return out

    trainer.train = train
    trainer.fit()
    return trainer, storage, pids, live


def test_both_stages_learn_in_one_step_and_a_killed_worker_is_replayed_exactly(run):
    trainer, _, pids, _ = run
    assert pids and trainer.restarts == 1 and trainer.policy_version == STEPS
    rewards, stds = logged(trainer, "reward/mean"), logged(trainer, "reward/std")
    first, last = np.mean([rewards[s] for s in (1, 2, 3)]), np.mean([rewards[s] for s in (6, 7, 8)])
    spread = np.mean([stds[s] for s in (1, 2, 3)])
    print(f"unified reward {first:.4f} -> {last:.4f} (within-step spread {spread:.4f})")
    assert last - first > 3 * spread, (first, last, spread, rewards)
    for key in ("reward/mean", "text/train/loss", "image/train/loss", "train/grad_norm"):
        values = attempts(trainer, key)
        assert sorted(values) == list(range(1, STEPS + 1)), key
        # step 5 ran again from the step-4 checkpoint with the same numbers; step 6 (killed before its
        # metrics were logged) and every other step were logged once
        assert len(values[5]) == 2 and values[5][0] == pytest.approx(values[5][1], rel=1e-6, abs=1e-9), key
        assert all(len(v) == 1 for step, v in values.items() if step != 5), key
    assert attempts(trainer, "fault/worker_group_restarts") == {CHECKPOINT: [1.0]}
    checked = logged(trainer, "unified/advantages_checked")
    assert sorted(checked) == list(range(1, STEPS + 1)) and set(checked.values()) == {float(PER_STEP)}
    for stage, parts in (("text", 8.0), ("image", 8.0)):  # one optimizer step trained both stages, every step
        assert max(logged(trainer, f"{stage}/rollout/logp_gap").values()) < 1e-4, stage  # ratio 1 at step start
        assert set(logged(trainer, f"{stage}/train/parts").values()) == {parts}, stage
        assert all(abs(v - 1) < 1e-2 for v in logged(trainer, f"{stage}/algo/ratio").values()), stage
    assert set(logged(trainer, "train/optimizer_steps").values()) == {1.0}
    table = sample_table(trainer, "samples/step_000004.json")  # every log_samples_every steps: a table ...
    assert len(table["data"]) == PER_STEP // 2  # the step's images
    for column in ("prompt", "generated_text", "reward", "text_reward", "text_advantage", "image_advantage"):
        assert column in table["columns"], column
    grid = artifacts(trainer, "images")  # ... and an image grid captioned with the generated text
    assert any(a.endswith(".png") for a in grid) and any(a.endswith("step_000004.json") for a in grid), grid
    captions = sample_table(trainer, "images/step_000004.json")
    text, caption = table["columns"].index("generated_text"), captions["columns"].index("caption")
    assert f"| {table['data'][0][text]} | r=" in captions["data"][0][caption]


def test_the_export_reloads_from_its_folder_and_gives_the_live_outputs(run):
    import torch

    from unirl_ray.core.sample import TextPart, routed_part
    from unirl_ray.models.unified import UnifiedBundle, UnifiedConfig, UnifiedPipeline
    from unirl_ray.train.export import ExportInfo

    trainer, storage, _, live = run
    info = ExportInfo.read(str(storage / "export"))
    assert info.policy_version == STEPS and info.model_path.endswith("transformer")
    bundle = UnifiedBundle.from_config(UnifiedConfig(pretrained_model_path=str(storage / "export")))
    pipeline_cfg = {k: v for k, v in dict(trainer.recipe.pipeline).items() if k != "_target_"}
    out = UnifiedPipeline(bundle, **pipeline_cfg).sample_requests(LIVE)
    assert len(live) == len(LIVE) == len(out)
    for sample, (parts, image) in zip(live, out):
        assert parts[0].text == routed_part(sample, TextPart, "text").text  # the same think segment ...
        assert np.abs(image.astype(int) - sample.image.astype(int)).max() <= 1  # ... and the same image
    fresh = UnifiedBundle.from_config(UnifiedConfig())
    assert not torch.equal(fresh.transformer.velocity_head.weight, bundle.transformer.velocity_head.weight)  # trained


JANUS = recipe_path("unified", "tiny", "janus_tiny_engines.yaml")
JANUS_STEPS = 8


@pytest.fixture(scope="module")
def janus_run(ray_local, tmp_path_factory):
    """The Janus-Pro family (discrete image tokens, both stages GRPO) on one worker, rolled out by the engine pair
    (a text app and an image app, one export feeds both); the live rank samples LIVE right after the last step."""
    storage = tmp_path_factory.mktemp("janus")
    trainer = make(UnifiedModelTrainer, JANUS, storage, "janus", f"trainer.num_steps={JANUS_STEPS}",
                   "trainer.checkpoint_every=100", "tracking.log_samples_every=0", "ray.scaling.num_workers=1",
                   "ray.scaling.resources_per_worker.CPU=2", f"+trainer.export_dir={storage / 'export'}",
                   experiment="e2e-unified")
    live, original = [], trainer.train

    def train(samples, *, seed):
        step = trainer.prompt_log[-1][0]
        reports = {stage: engine.status() for stage, engine in trainer.engine_set.engines.items()}
        assert all(r["version"] == step - 1 for rs in reports.values() for r in rs), reports  # both fed before the step
        out = original(samples, seed=seed)
        if step == JANUS_STEPS:
            live.extend(trainer.group.call("eval_generate", {"requests": LIVE})[0])
        return out

    trainer.train = train
    trainer.fit()
    return trainer, storage, live


def test_janus_on_the_engine_pair_learns_both_token_stages_and_its_export_gives_the_live_outputs(janus_run):
    from unirl_ray.core.sample import TextPart, routed_part
    from unirl_ray.models.janus import JanusBundle, JanusModelConfig, JanusPipeline

    trainer, storage, live = janus_run
    rewards, stds = logged(trainer, "reward/mean"), logged(trainer, "reward/std")
    steps = sorted(rewards)
    first, last = np.mean([rewards[s] for s in steps[:3]]), np.mean([rewards[s] for s in steps[-3:]])
    spread = np.mean([stds[s] for s in steps[:3]])
    print(f"janus reward {first:.4f} -> {last:.4f} (within-step spread {spread:.4f}): {[round(rewards[s], 3) for s in steps]}")
    assert last - first > 3 * spread, (first, last, spread, rewards)
    assert set(logged(trainer, "unified/advantages_checked").values()) == {float(PER_STEP)}
    for stage in ("text", "image"):  # both token stages trained on every step; engine == trainer log-probs
        assert max(logged(trainer, f"{stage}/rollout/logp_gap").values()) < 1e-4, stage
        assert set(logged(trainer, f"{stage}/train/parts").values()) == {8.0}, stage
    # one export per step reached both engines, each verified on its replica
    assert logged(trainer, "weight_sync/engines") == {s: 2.0 for s in range(1, JANUS_STEPS + 1)}
    assert logged(trainer, "weight_sync/version") == {s: float(s) for s in range(1, JANUS_STEPS + 1)}
    assert set(logged(trainer, "rollout/version_lag_max").values()) == {0.0}
    bundle = JanusBundle.from_config(JanusModelConfig(pretrained_model_path=str(storage / "export")))
    pipeline_cfg = {k: v for k, v in dict(trainer.recipe.pipeline).items() if k != "_target_"}
    out = JanusPipeline(bundle, **pipeline_cfg).sample_requests(LIVE)
    for sample, (parts, image) in zip(live, out):
        assert parts[0].text == routed_part(sample, TextPart, "text").text
        assert np.abs(image.astype(int) - sample.image.astype(int)).max() <= 1
