"""End to end on CPU for the AR trainer: 2 FSDP2 Ray Train workers (gloo), Serve reward, Ray Data
prompts, MLflow; direct rollout and a dedicated HF engine on Ray Serve with versioned weight sync."""

import os

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from unirl_ray.config.recipe import load_recipe
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "ar", "tiny")


def make(tmp_path, recipe, run_name, *overrides):
    cfg = load_recipe(
        os.path.join(RECIPES, recipe),
        [f"trainer.run_name={run_name}", f"trainer.storage_path={tmp_path}", "tracking.experiment_name=e2e-ar", *overrides],
    )
    return ARTrainer(cfg)


def history(trainer, key):
    client = MlflowClient(trainer.tracker.tracking_uri)
    return [m.value for m in sorted(client.get_metric_history(trainer.tracker.run_id, key), key=lambda m: m.step)]


def assert_learned(trainer, steps):
    rewards = history(trainer, "reward/mean")
    assert len(rewards) == steps
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.05, (first, last, rewards)


def test_direct_rollout_learns_and_logs_text(ray_local, tmp_path):
    trainer = make(
        tmp_path, "char_grpo_direct.yaml", "direct", "trainer.num_steps=20", "tracking.log_samples_every=10",
        f"+trainer.export_dir={tmp_path / 'export'}", "+trainer.export_register_as=char-lm",
    )
    trainer.fit()
    assert_learned(trainer, 20)
    assert max(history(trainer, "rollout/logp_gap")) < 1e-4  # on-policy: trainer == rollout log-probs
    for key in ("rollout/response_len_mean", "perf/rollout_tokens_per_s", "algo/clip_frac", "train/loss"):
        assert history(trainer, key), key
    artifacts = [a.path for a in MlflowClient(trainer.tracker.tracking_uri).list_artifacts(trainer.tracker.run_id, "samples")]
    assert any(a.endswith("step_000010.json") for a in artifacts), artifacts
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


def test_dedicated_engine_syncs_versions_and_survives_a_replica_kill(ray_local, tmp_path):
    # tied input/output embeddings: the engine must see the updated output layer too
    trainer = make(
        tmp_path, "char_grpo_engine.yaml", "engine", "trainer.num_steps=14",
        "+bundle.config.tiny={_target_: unirl_ray.models.causal_lm.TinyLMConfig, tie_word_embeddings: true}",
    )
    status = "FAILED"
    try:
        start = trainer.setup()
        assert start == 0 and trainer.engine.version == 0
        for step in range(1, 15):
            if step == 8:  # kill the engine replica: Serve replaces it, the new one pulls the latest weights
                kill_engine_replica(trainer.engine)
            metrics = trainer.run_step(step)
            trainer.tracker.log_metrics(metrics, step=step)
            assert metrics["weight_sync/version"] == step  # a new version after every train step
            assert metrics["rollout/version_lag_max"] == 0
            assert metrics["rollout/response_len_mean"] > 0
            assert metrics["rollout/logp_gap"] < 1e-4, metrics["rollout/logp_gap"]  # engine == trainer log-probs
            assert all(r["version"] == step for r in trainer.engine.status())
        status = "FINISHED"
    finally:
        trainer.teardown(status)
    assert_learned(trainer, 14)


def kill_engine_replica(engine):
    """SIGKILL the replica's process, as a crash would."""
    import signal

    os.kill(engine.status()[0]["replica"], signal.SIGKILL)


def test_a_failed_worker_start_leaves_no_serve_app(ray_local, tmp_path):
    """The separate engine deploys while the workers start; when the start fails, teardown waits for
    that deploy and removes the engine and reward apps."""
    from ray import serve

    trainer = make(tmp_path, "char_grpo_engine.yaml", "failed-start", "trainer.num_steps=2", "+ray.start_timeout_s=0.5")
    with pytest.raises(TimeoutError, match="train workers started within"):
        trainer.fit()
    apps = serve.status().applications
    assert not [name for name in apps if name.startswith("failed-start-")], sorted(apps)
