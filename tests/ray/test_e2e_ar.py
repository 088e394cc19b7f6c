"""End to end on CPU for the AR trainer: FSDP2 Ray Train workers (gloo), Serve reward, Ray Data prompts,
MLflow; direct rollout, and a dedicated HF engine on Ray Serve with versioned weight sync,
separate and colocated.

The colocated engine takes turns with the train workers on the same devices (offload -> engine wakes,
loads the latest version, generates, sleeps -> onload). On a CPU machine host and device are the same
memory, so "freed" means what the mechanism does on a GPU: every device storage of the train state
(parameters, gradients, AdamW moments) and of the engine's weights is released (resized to 0) while
the other side runs; the bytes are checked. Its run must match the separate layout's numbers exactly
(same seeds, same weights, same samples): the separate run is the one the replica-kill test drives. The
async trainer at ``max_staleness=0`` on the same recipe must match that run too (``tests/ray/test_async.py``
has the async runs that overlap).
"""

import os

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from support import ONE_WORKER, artifacts, drive, history, kill_engine_replica, logged, make, recipe_path, sample_table

from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

DIRECT = recipe_path("ar", "tiny", "char_grpo_direct.yaml")
ENGINE = recipe_path("ar", "tiny", "char_grpo_engine.yaml")
TIED = "+bundle.config.tiny={_target_: unirl_ray.models.causal_lm.TinyLMConfig, tie_word_embeddings: true}"
ENGINE_STEPS, KILL_AT, COLOCATED_STEPS = 14, 8, 4
# Every run here has one train worker with both CPUs: what they check does not depend on the rank count
# (two FSDP2 ranks are trained, killed and resumed in test_resume_exact.py, and export their weights to
# a dedicated engine in test_vllm_engine.py), and a worker fewer starts faster.


def engine_trainer(tmp_path, name, steps, *overrides):
    # tied input/output embeddings: the engine must see the updated output layer too
    return make(ARTrainer, ENGINE, tmp_path, name, f"trainer.num_steps={steps}", "trainer.checkpoint_every=100", TIED,
                *ONE_WORKER, *overrides, experiment="e2e-ar")


def assert_learned(trainer, steps):
    rewards = history(trainer, "reward/mean")
    assert len(rewards) == steps
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.05, (first, last, rewards)


def assert_workers_at_driver_priority(trainer):
    # train workers and their command broker run at the driver's priority (ray.worker_niceness=0; raising it needs root)
    import ray

    expected = 0 if os.geteuid() == 0 else 15
    assert all(r["niceness"] == expected for r in trainer.group.call("ping", {}))
    assert ray.get(trainer.group.broker.niceness.remote(), timeout=30) == expected


def test_direct_rollout_learns_and_logs_text(ray_local, tmp_path):
    trainer = make(
        # 14 steps: the last three average ~0.18 against ~0.014 for the first three (0.41 vs 0.014 at 20 steps)
        ARTrainer, DIRECT, tmp_path, "direct", "trainer.num_steps=14", "tracking.log_samples_every=10",
        f"+trainer.export_dir={tmp_path / 'export'}", "+trainer.export_register_as=char-lm", *ONE_WORKER,
        experiment="e2e-ar",
    )
    trainer.fit()
    assert_learned(trainer, 14)
    assert max(history(trainer, "rollout/logp_gap")) < 1e-4  # on-policy: trainer == rollout log-probs
    for key in ("rollout/response_len_mean", "perf/rollout_tokens_per_s", "algo/clip_frac", "train/loss"):
        assert history(trainer, key), key
    assert any(a.endswith("step_000010.json") for a in artifacts(trainer, "samples"))
    # where the start-up went, logged once with step 1, each milestone after the one before it
    startup = {m: logged(trainer, f"startup/{m}_s") for m in ("setup", "ray", "workers", "services", "tracking", "first_step")}
    assert all(list(v) == [1] for v in startup.values()), startup
    offsets = [v[1] for v in startup.values()]
    assert offsets == sorted(offsets) and offsets[0] >= 0, offsets
    assert 0 <= logged(trainer, "startup/reward_app_s")[1] <= startup["services"][1]
    assert_exported(trainer, str(tmp_path / "export"), str(tmp_path / "after_fit"))


def assert_exported(trainer, at_end, after_fit):
    """trainer.export_dir wrote the trained model at the end of fit() and registered it; export() after
    fit() restarts the workers from the last checkpoint and writes the same weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig
    from unirl_ray.models.causal_lm.tokenizer import CHAR_VOCAB, SPECIAL_TOKENS
    from unirl_ray.train.export import ExportInfo

    info = ExportInfo.read(at_end)
    assert info.policy_version == history(trainer, "train/policy_version")[-1] > 0
    trained = AutoModelForCausalLM.from_pretrained(info.model_path)
    initial = CausalLMBundle.from_config(CausalLMConfig()).model
    ids = torch.tensor([chat_prompt_ids("write a word")])
    a_id = len(SPECIAL_TOKENS) + CHAR_VOCAB.index("a")
    with torch.no_grad():
        p_trained, p_initial = (m(input_ids=ids).logits[0, -1].softmax(-1)[a_id] for m in (trained, initial))
    assert p_trained > p_initial + 0.05, (p_trained, p_initial)  # the reward (fraction of "a") was learned

    client = MlflowClient(trainer.tracker.tracking_uri)
    version = client.get_model_version("char-lm", "1")
    assert version.run_id == trainer.tracker.run_id
    assert client.get_logged_model(version.tags["unirl.logged_model_id"]).artifact_location == version.source

    assert trainer.export(after_fit) == after_fit
    again = load_file(f"{after_fit}/model.safetensors")
    for key, value in load_file(f"{at_end}/model.safetensors").items():
        assert torch.equal(again[key], value), key


def chat_prompt_ids(prompt):
    """Token ids of a chat prompt of the char task, as the pipeline renders it."""
    from unirl_ray.models.causal_lm import build_char_tokenizer

    tok = build_char_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def separate_engine_run(ray_local, tmp_path_factory):
    """The separate layout, ENGINE_STEPS steps, its replica SIGKILLed before step KILL_AT (Serve replaces
    it; the new one pulls the latest weights). Checked after every step; yields (trainer, metrics per step)."""
    trainer = engine_trainer(tmp_path_factory.mktemp("engine"), "engine", ENGINE_STEPS)

    def check(step, metrics):
        if step == 0:
            assert trainer.engine.version == 0 and not trainer.engine.colocated
            assert_workers_at_driver_priority(trainer)
            return
        assert metrics["weight_sync/version"] == step  # a new version after every train step
        # rank 0 put the weights in the object store itself (the driver only passed the reference on)
        assert metrics["weight_sync/put_s"] > 0 and metrics["weight_sync/checksum_s"] > 0
        assert metrics["weight_sync/replica_load_s"] > 0 and metrics["weight_sync/bytes"] > 0
        assert metrics["rollout/version_lag_max"] == 0
        assert metrics["rollout/response_len_mean"] > 0
        assert metrics["rollout/logp_gap"] < 1e-4, metrics["rollout/logp_gap"]  # engine == trainer log-probs
        assert all(r["version"] == step for r in trainer.engine.status())
        if step == KILL_AT - 1:
            kill_engine_replica(trainer.engine)

    yield trainer, drive(trainer, ENGINE_STEPS, check)


def test_dedicated_engine_syncs_versions_and_survives_a_replica_kill(separate_engine_run):
    trainer, metrics = separate_engine_run
    assert len(metrics) == ENGINE_STEPS
    assert_learned(trainer, ENGINE_STEPS)


def test_colocated_engine_takes_turns_and_matches_the_separate_layout(separate_engine_run, tmp_path):
    trainer = engine_trainer(tmp_path, "colocated", COLOCATED_STEPS, "rollout.placement=colocated")

    def check(step, metrics):
        reports = trainer.engine.status()
        if step == 0:
            assert_workers_at_driver_priority(trainer)
            assert all(r["asleep"] for r in reports)  # asleep while the workers start
            return
        assert all(r["asleep"] and r["version"] == step - 1 for r in reports), reports  # asleep during training
        assert metrics["colocate/train_bytes_offloaded"] > 0
        assert metrics["colocate/train_bytes_resident"] == 0  # nothing of the train state stays on the device
        assert metrics["colocate/engine_bytes_freed"] > 0
        assert metrics["rollout/logp_gap"] < 1e-4  # the woken engine serves exactly the trainer's weights
        assert metrics["rollout/version_lag_max"] == 0

    colocated = drive(trainer, COLOCATED_STEPS, check)
    assert_same_steps(colocated, separate_engine_run[1][:COLOCATED_STEPS])


def assert_same_steps(got, want):
    """Two runs' per-step metrics: the same samples and rewards, the same updates."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for key in ("reward/mean", "rollout/response_len_mean"):  # the same samples, the same rewards
            assert a[key] == b[key], (key, a[key], b[key])
        # the same update, up to the last bits of a float sum: on a step whose advantages sum to zero the
        # loss came out -7.45e-09 in one layout and 0.0 in the other on one run (two processes, two threads)
        for key in ("train/loss", "train/grad_norm", "rollout/logp_gap"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])


def test_async_trainer_at_max_staleness_zero_on_an_attached_engine_app_reproduces_the_synchronous_run(
        separate_engine_run, tmp_path):
    """The async trainer (rollout stream, cache and version gate) with ``max_staleness=0`` on the separate
    run's recipe and seed, rolling out on an engine app started on its own from ``serve_apps/engine.yaml``'s
    builder (``rollout.attach``): every sample is of the trained version, and the steps are the synchronous
    ones. A recipe whose model the app does not serve is refused before any worker starts; at the end the
    app is still running and serves the last version."""
    from ray import serve

    from serve_apps.engine_app import app_builder
    from unirl_ray.runtime.serve import delete_apps
    from unirl_ray.trainer.async_rl import AsyncARTrainer

    serve.run(app_builder({"recipe": ENGINE, "overrides": [TIED], "name": "engine-app"}), name="engine-app",
              route_prefix=None)
    try:
        other = make(ARTrainer, ENGINE, tmp_path, "other-model", "trainer.num_steps=1", TIED, *ONE_WORKER,
                     "rollout.attach=engine-app", "pipeline.max_new_tokens=7")
        with pytest.raises(ValueError, match=r"serves another model than this recipe's: pipeline.max_new_tokens: "
                                             r"served \d+, recipe 7"):
            other.start_services()  # the first thing it does: nothing of the run starts (no reward app, no workers)
        assert other.group is None and not [a for a in serve.status().applications if a.startswith("other-model")]

        steps = 3
        zero = make(AsyncARTrainer, ENGINE, tmp_path, "async-zero", f"trainer.num_steps={steps}",
                    "trainer.checkpoint_every=100", TIED, *ONE_WORKER, "tracking.log_samples_every=0",
                    "rollout.attach=engine-app",
                    "+async_rollout={_target_: unirl_ray.trainer.async_rl.AsyncConfig, max_staleness: 0}",
                    experiment="e2e-ar")
        zero.fit()
        assert history(zero, "async/staleness_max") == [0.0] * steps
        keys = ("reward/mean", "rollout/response_len_mean", "train/loss", "train/grad_norm", "rollout/logp_gap")
        logged_steps = [dict(zip(keys, values)) for values in zip(*(history(zero, k) for k in keys), strict=True)]
        assert_same_steps(logged_steps, separate_engine_run[1][:steps])
        assert "engine-app" in serve.status().applications  # left running, with the last version
        assert serve.get_app_handle("engine-app").status.remote().result(timeout_s=30)["version"] == steps
    finally:
        delete_apps(["engine-app"])


def test_prompts_with_images_train_on_policy_on_a_dedicated_engine(ray_local, tmp_path):
    """The tiny vision-language recipe (Qwen2.5-VL-shaped; its images are data URLs in the prompt file, read by Ray
    Data with the prompts) on a dedicated HF engine app: the engine samples with the images and the rank recomputes
    the log-probs with them (on-policy at every step), every version reaches the engine, and the frozen vision
    tower is exported unchanged while the language model moved."""
    from unirl_ray.models.vlm import VLMBundle, VLMConfig
    from unirl_ray.train.export import ExportInfo

    steps = 3
    trainer = make(ARTrainer, recipe_path("ar", "tiny", "vlm_colors_grpo.yaml"), tmp_path, "vlm", f"trainer.num_steps={steps}",
                   "trainer.checkpoint_every=100", "tracking.log_samples_every=3", *ONE_WORKER,
                   "rollout={_target_: unirl_ray.rollout.DedicatedRollout, engine: hf, num_replicas: 1, "
                   "ray_actor_options: {num_cpus: 0.5}, requests_per_call: 16}", f"+trainer.export_dir={tmp_path / 'export'}",
                   experiment="e2e-ar")

    trainer.fit()
    assert history(trainer, "weight_sync/version") == [1, 2, 3] and history(trainer, "rollout/version_lag_max") == [0] * 3
    gap = history(trainer, "rollout/logp_gap")
    assert len(gap) == steps and max(gap) < 1e-4, gap  # the engine's log-probs == the rank's, images included
    assert all(0 <= r <= 1 for r in history(trainer, "reward/colour_letter/mean"))
    table = sample_table(trainer, "samples/step_000003.json")
    assert set(table["columns"]) >= {"prompt", "completion", "reward"} and len(table["data"]) == 32
    trained = VLMBundle.from_config(VLMConfig(pretrained_model_path=ExportInfo.read(str(tmp_path / "export")).model_path))
    initial = VLMBundle.from_config(VLMConfig()).model.state_dict()
    after = trained.model.state_dict()
    vision = [k for k in initial if ".visual." in f".{k}"]
    assert vision and all(torch.equal(after[k], initial[k]) for k in vision)  # freeze_vision: the tower never trained
    assert any(not torch.equal(after[k], initial[k]) for k in initial if k not in vision)


def test_a_failed_worker_start_leaves_no_serve_app(ray_local, tmp_path):
    """The engine and reward apps deploy while the workers start; when the start fails, teardown waits
    for those deploys and removes the apps, and the workers that were still starting stop at once."""
    from ray import serve

    trainer = make(ARTrainer, ENGINE, tmp_path, "failed-start", "trainer.num_steps=2", "+ray.start_timeout_s=0.5", *ONE_WORKER)
    with pytest.raises(TimeoutError, match="train workers started within"):
        trainer.fit()
    apps = serve.status().applications
    assert not [name for name in apps if name.startswith("failed-start-")], sorted(apps)
    assert not trainer.group._thread.is_alive()  # the Ray Train run ended: nothing left starting
