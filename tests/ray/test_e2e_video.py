"""End to end on CPU for video: the tiny Wan recipe (time-axis latents) trained with Flow-GRPO on a Ray
Train worker, the brightness reward (a rule, scored in the driver), Ray Data prompts, MLflow with GIF
artifacts. One worker with both CPUs: nothing here depends on the rank count (two FSDP2 ranks train, are
killed and resume in the image modules), and a worker fewer starts faster."""


import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image
from support import ONE_WORKER, fit, history, recipe_path

from unirl_ray.trainer.diffusion import DiffusionTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = recipe_path("diffusion", "wan", "wan_tiny_flowgrpo.yaml")
STEPS = 4


def test_tiny_wan_trains_and_logs_gifs(ray_local, tmp_path):
    trainer = fit(DiffusionTrainer, RECIPE, tmp_path, "video", f"trainer.num_steps={STEPS}",
                  f"trainer.checkpoint_every={STEPS}", "tracking.log_samples_every=2",
                  "trainer.prompts_per_step=2", "stack.mini_batch_size=8",  # half the recipe's batch: a shorter test
                  *ONE_WORKER, experiment="e2e-video")
    client = MlflowClient(trainer.tracker.tracking_uri)
    run_id = trainer.tracker.run_id
    rewards = history(trainer, "reward/mean")
    assert len(rewards) == STEPS and all(0 < r < 1 for r in rewards)
    print("video reward/mean per step:", [round(r, 5) for r in rewards])
    # seeded run: the tiny model gets brighter from the first step (0.5375 -> 0.5403 measured; std ~0.002)
    assert rewards[-1] > rewards[0], rewards
    metrics = client.get_run(run_id).data.metrics
    for key in ("train/loss", "algo/clip_frac", "rollout/logp_gap", "timing/rollout", "reward/brightness/mean"):
        assert key in metrics, key
    # on-policy trainside rollout over a time axis: recomputed log-probs equal the recorded ones
    assert max(history(trainer, "rollout/logp_gap")) < 1e-4

    files = [a.path for a in client.list_artifacts(run_id, "samples/step_000002")]
    gifs = [f for f in files if f.endswith(".gif")]
    assert gifs and any(f.endswith("_strip.png") for f in files), files
    local = client.download_artifacts(run_id, gifs[0], str(tmp_path / "dl"))
    with Image.open(local) as gif:
        assert gif.is_animated and gif.n_frames == 5 and gif.size == (16, 16)
    assert "samples/step_000002.json" in [a.path for a in client.list_artifacts(run_id, "samples")]
    assert (tmp_path / "video" / f"checkpoint_{STEPS:06d}" / "controller_state.json").exists()
    assert np.isfinite(history(trainer, "train/loss")).all()
