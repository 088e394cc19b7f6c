"""Bad input, all in one place: each case fails before any worker (or Ray) starts, or at the one
call that meets it, with a message naming what is wrong and how to fix it. In-process, no Ray."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch

from unirl_ray.config.recipe import RecipeError, instantiate, load_recipe
from unirl_ray.rewards.combine import RewardError, combine, reward_metrics, score_batch, score_one
from unirl_ray.rewards.image import brightness
from unirl_ray.runtime.worker import SHARDS_DIR, STATE_FILE, read_checkpoint_state
from unirl_ray.train.configs import TrainTopology
from unirl_ray.trainer.diffusion import DiffusionTrainer

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TINY = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")


def build(*overrides, path=TINY):
    return DiffusionTrainer(load_recipe(path, list(overrides)))


# ------------------------------------------------------------------ recipe: YAML, keys, types, model


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  run_name: x\n  num_steps: [1, 2\nray: {}\n")
    with pytest.raises(RecipeError, match=r"malformed YAML in .*bad\.yaml, line \d+"):
        load_recipe(bad)


@pytest.mark.parametrize(
    "override, message",
    [
        # unknown keys: the closest existing key is suggested
        ("trainer.num_step=3", r"no key 'trainer.num_step'.*trainer\.num_steps"),
        ("+algorithm.clip_rnge=0.1", r"takes no argument 'clip_rnge'.*clip_range"),
        # wrong types: the key, the expected type and the value
        ("trainer.num_steps=abc", r"`trainer.num_steps` must be an int .*got 'abc' \(str\)"),
        ("algorithm.group_size=1.5", r"`algorithm.group_size` must be an int .*got 1.5 \(float\)"),
        ("algorithm.clip_range=abc", r"`algorithm.clip_range` must be a number, got 'abc'"),
        ("data.shuffle=maybe", r"`data.shuffle` must be a boolean"),
        ("pipeline.height=abc", r"`pipeline.height` must be an int"),
        # missing model folder
        ("bundle.config.pretrained_model_ckpt_path=/nonexistent", r"'/nonexistent' does not exist"),
        # images of a size the model cannot make
        ("pipeline.height=30", r"pipeline.height=30 must be a positive multiple of 4"),
        # prompt file that is not there
        ("data.path=/nonexistent/prompts.txt", r"not found: /nonexistent/prompts.txt"),
        # a negative clipping norm made torch flip every gradient (ascent); 0 is not "no clipping" either
        ("stack.max_grad_norm=-1", r"`stack.max_grad_norm` must be > 0 \(null: no clipping.*got -1"),
        ("stack.max_grad_norm=0", r"`stack.max_grad_norm` must be > 0 .*got 0"),
        ("stack.micro_batch_size=0", r"`stack.micro_batch_size` must be >= 1, got 0"),
        ("stack.num_updates_per_batch=0", r"`stack.num_updates_per_batch` must be >= 1, got 0"),
        # values only the workers checked before: now on the driver, naming the recipe key
        ("pipeline.num_inference_steps=0", r"`pipeline.num_inference_steps` must be >= 1, got 0"),
        ("pipeline.guidance_scale=0.5", r"`pipeline.guidance_scale` must be >= 1 \(1 disables CFG\), got 0.5"),
        ("pipeline.noise_level=0", r"`pipeline.noise_level` must be > 0 \(SDE sampling needs noise\)"),
        ("rollout.micro_batch_size=0", r"`rollout.micro_batch_size` must be >= 1, got 0"),
        # run names are one folder name: ".." wrote checkpoints outside the storage path
        ("trainer.run_name=..", r"trainer.run_name must be one folder name.*got '\.\.'"),
        ("trainer.run_name=.", r"trainer.run_name must be one folder name.*got '\.'"),
        ("trainer.run_name=a/b", r"trainer.run_name must be one folder name"),
        # a constant reward trains nothing
        ("reward.rewards.brightness.weight=0", r"every reward source has weight 0 \(reward.rewards.brightness.weight\)"),
    ],
)
def test_bad_recipe_values_fail_on_the_driver(override, message):
    import ray

    with pytest.raises(RecipeError, match=message):
        build(override)
    assert not ray.is_initialized()


@pytest.mark.parametrize("override, message", [
    ("pipeline.temperature=0", r"`pipeline.temperature` must be > 0 \(log-probs are those of softmax"),
    ("+pipeline.top_p=1.5", r"`pipeline.top_p` must be > 0 and <= 1 \(1 disables nucleus sampling\), got 1.5"),
    ("pipeline.max_new_tokens=0", r"`pipeline.max_new_tokens` must be >= 1, got 0"),
])
def test_bad_text_sampling_values_fail_on_the_driver(override, message):
    from unirl_ray.trainer.ar import ARTrainer

    with pytest.raises(RecipeError, match=message):
        ARTrainer(load_recipe(os.path.join(ROOT, "recipes", "ar", "tiny", "char_grpo_direct.yaml"), [override]))


def test_a_pipeline_longer_than_the_models_context_fails_on_the_driver(tmp_path):
    """Before: the ranks and every engine replica refused it only once started (the engine app's deploy failed)."""
    import json

    from unirl_ray.trainer.agentic import AgenticTrainer
    from unirl_ray.trainer.ar import ARTrainer

    recipe = os.path.join(ROOT, "recipes", "ar", "tiny", "char_grpo_direct.yaml")
    with pytest.raises(RecipeError, match=r"pipeline.max_prompt_tokens \+ pipeline.max_new_tokens = 240 \+ 64 = 304 "
                                          r"exceeds the model's context of 256 tokens \(the demo model's "):
        ARTrainer(load_recipe(recipe, ["pipeline.max_prompt_tokens=240", "pipeline.max_new_tokens=64"]))
    ARTrainer(load_recipe(recipe, ["pipeline.max_prompt_tokens=192", "pipeline.max_new_tokens=64"]))  # 256 fits
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 2048}))
    real = os.path.join(ROOT, "recipes", "agentic", "qwen2_5", "gsm8k_python_vllm.yaml")  # 3072 + 1024
    with pytest.raises(RecipeError, match=r"= 4096 exceeds the model's context of 2048 tokens \("
                                          + re.escape(f"max_position_embeddings in {tmp_path}/config.json)")):
        AgenticTrainer(load_recipe(real, [f"bundle.config.pretrained_model_path={tmp_path}"]))
    vlm = {"model_type": "qwen2_5_vl", "text_config": {"max_position_embeddings": 4096}}
    (tmp_path / "config.json").write_text(json.dumps(vlm))
    AgenticTrainer(load_recipe(real, [f"bundle.config.pretrained_model_path={tmp_path}"]))  # a text_config's counts
    from unirl_ray.trainer.pe import PETrainer  # the prompt enhancer's rewriter side

    pe = os.path.join(ROOT, "recipes", "pe", "tiny", "pe_tiny.yaml")
    with pytest.raises(RecipeError, match=r"ar.pipeline.max_prompt_tokens \+ ar.pipeline.max_new_tokens = 250 \+ 16 = 266 "
                                          r"exceeds .* \(the demo model's ar.bundle.config.tiny.max_position_embeddings\)"):
        PETrainer(load_recipe(pe, ["ar.pipeline.max_prompt_tokens=250"]))


@pytest.mark.parametrize("override, message", [
    ("data.columns=[answer]", r"pipeline.image_column='image' is not among data.columns=\['answer'\]: add it"),
    ("rollout={_target_: unirl_ray.rollout.DedicatedRollout, engine: vllm}",
     r"rollout.engine=vllm does not take prompts with images yet .*use rollout.engine=hf"),
    ("+bundle.config.max_pixels=-1", r"max_pixels must be > 0 or null, got -1"),
])
def test_bad_vision_language_recipes_fail_on_the_driver(override, message):
    from unirl_ray.trainer.ar import ARTrainer

    if "vllm" in override:
        pytest.importorskip("vllm")  # without vLLM the rollout refuses the engine first (its own message)
    with pytest.raises(RecipeError, match=message):
        ARTrainer(load_recipe(os.path.join(ROOT, "recipes", "ar", "tiny", "vlm_colors_grpo.yaml"), [override]))


def test_an_override_without_equals_is_named_as_such(capsys):
    from unirl_ray.cli import run_trainer
    from unirl_ray.config.recipe import parse_cli

    assert run_trainer(DiffusionTrainer, ["trainer.num_steps"], default_recipe=TINY) == 2
    assert "bad override 'trainer.num_steps': overrides are key=value" in capsys.readouterr().err
    with pytest.raises(RecipeError, match=r"'trainer.num_steps' is neither a recipe file nor an override: overrides "
                                          r"look like key=value"):
        parse_cli(["trainer.num_steps"])
    with pytest.raises(RecipeError, match=r"recipe file 'nope.yaml' not found"):
        parse_cli(["nope.yaml"])


def test_every_shipped_recipe_takes_tracking_uri_without_a_plus():
    # the README says `tracking.tracking_uri=...`; recipes without the key needed `+tracking.tracking_uri`
    from pathlib import Path

    for recipe in sorted(Path(ROOT, "recipes").rglob("*.yaml")):
        assert "tracking_uri:" in recipe.read_text(), recipe


def test_rerunning_with_a_changed_recipe_is_refused_and_a_finished_run_does_nothing(tmp_path, capsys):
    # `python recipes/ar.py algorithm._target_=...DAPO` after a finished GRPO run printed "resuming" and
    # exited 0 having trained nothing, while MLflow still said GRPO
    import ray

    from unirl_ray.cli import run_trainer
    from unirl_ray.runtime.worker import COMMIT_FILE
    from unirl_ray.trainer.base import FINISHED_FILE, RECIPE_FILE
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    where = (f"trainer.storage_path={tmp_path}", "trainer.run_name=r")
    changed = (*where, "algorithm._target_=unirl_ray.algorithms.FlowGRPO", "algorithm.clip_range=0.3", "pipeline.height=64")
    build(*where)._record_recipe()  # the first start records the recipe in the run folder
    assert (tmp_path / "r" / RECIPE_FILE).is_file()
    build(*changed).check_resumed_recipe()  # no checkpoint yet (a start that failed early): it may start over changed
    (tmp_path / "r" / "checkpoint_000004").mkdir()  # a first save killed half written: still no checkpoint
    build(*changed).check_resumed_recipe()
    (tmp_path / "r" / "checkpoint_000004" / COMMIT_FILE).write_text("{}")  # the run has trained: its recipe is fixed now
    build(*changed)._record_recipe()  # and is not overwritten
    build(*where, "trainer.num_steps=50", "ray.scaling.num_workers=1", "tracking.log_samples_every=0",
          "stack.micro_batch_size=2").check_resumed_recipe()  # budget, resources, logging, memory knobs: fine
    with pytest.raises(RecipeError, match=r"run 'r' .* was written with another recipe.*algorithm.clip_range: .* -> 0.3"
                                          r".*pipeline.height: 32 -> 64.*trainer.run_name=<new name>"):
        build(*changed).check_resumed_recipe()
    assert run_trainer(DiffusionTrainer, list(changed), default_recipe=TINY) == 2  # one line, exit 2, nothing started
    assert "was written with another recipe" in capsys.readouterr().err and not ray.is_initialized()
    build(*changed, "+trainer.resume_changed_recipe=true").check_resumed_recipe()  # the explicit opt-in
    from unirl_ray.trainer.ar import ARTrainer  # another domain's recipe in this run folder: said so first
    ar = os.path.join(ROOT, "recipes", "ar", "tiny", "char_grpo_direct.yaml")
    with pytest.raises(RecipeError, match=r"this run was written by a diffusion recipe with the tiny demo model; "):
        ARTrainer(load_recipe(ar, list(where))).check_resumed_recipe()

    (tmp_path / "r" / FINISHED_FILE).write_text('{"num_steps": 24}')
    assert build(*where).fit() == {}  # already finished 24/24: nothing starts
    assert "already finished 24/24 steps" in capsys.readouterr().out and not ray.is_initialized()


def test_an_export_dir_that_would_fail_after_training_is_refused_before(tmp_path):
    import ray

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    where = (f"trainer.storage_path={tmp_path}", "trainer.run_name=r")
    with pytest.raises(RecipeError, match=r"trainer.export_dir: export directory .*taken' exists and is not empty.*"
                                          r"Set trainer.export_dir to an empty or new folder"):
        build(*where, f"+trainer.export_dir={taken}").setup()
    with pytest.raises(RecipeError, match=r"trainer.export_dir=.*/r/model is inside the run folder"):
        build(*where, f"+trainer.export_dir={tmp_path / 'r' / 'model'}").setup()
    assert not ray.is_initialized()  # refused before Ray, not after the training


def test_remote_storage_needs_a_tracking_store_and_creates_no_local_uri_folders(tmp_path, monkeypatch):
    # trainer.storage_path=s3://... put the default SQLite store in a local folder named "s3:"
    from unirl_ray.tracking import MLflowTracker, TrackingConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(RecipeError, match=r"storage_path=s3://bucket/runs is remote storage.*tracking.tracking_uri="):
        build("trainer.storage_path=s3://bucket/runs")
    trainer = build("trainer.storage_path=s3://bucket/runs", "tracking.tracking_uri=http://127.0.0.1:1")
    assert trainer.run_cfg.storage_path == "s3://bucket/runs"  # kept as a URI, not made a local path
    with pytest.raises(ValueError, match="remote storage"):
        MLflowTracker(TrackingConfig()).start("s3://bucket/runs", "r")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = MLflowTracker(TrackingConfig(tracking_uri="http://127.0.0.1:1"))
    tracker.start("s3://bucket/runs", "r")  # the server is down: the fallback log goes to the user's cache
    tracker.log_metrics({"x": 1.0}, step=1)
    assert tracker.flush()  # metrics are written by a background thread
    assert not list(tmp_path.glob("s3*")) and not list(tmp_path.rglob("s3:"))
    assert (tmp_path / "home" / ".cache" / "unirl_ray" / "tracking" / "s3" / "bucket" / "runs" / "r").is_dir()


def test_a_run_whose_rewards_are_all_invalid_stops_instead_of_training_on_nothing():
    from unirl_ray.core.sample import Sample

    trainer = build()
    bad = [Sample(sample_id=f"s{i}", group_id="g", prompt="p", reward=None) for i in range(4)]
    good = [Sample(sample_id="s0", group_id="g", prompt="p", reward=0.5), *bad[1:]]
    check = trainer.make_credit().check_usable  # the credit-assignment stage checks before it assigns
    check(1, bad)
    check(2, good)  # one usable reward resets the count
    check(3, bad)
    check(4, bad)
    with pytest.raises(RuntimeError, match=r"steps 3\.\.5: every sample's reward was invalid.*reward.timeout_s"):
        check(5, bad)
    with pytest.raises(RuntimeError, match=r"steps 1\.\.3: every sample's reward was invalid"):
        for step in (1, 2, 3):  # through the stage itself, as learn() calls it
            trainer.assign_credit(step, bad)


# ------------------------------------------------------------------ prompt files


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog"}\nnot json\n',
         r"bad\.jsonl, line 3 is not valid JSON.*fix or delete that line"),
        ("nokey.jsonl", '{"prompt": "a cat"}\n{"promt": "a dog"}\n',
         r"nokey\.jsonl, line 2 has no 'prompt' key.*did you mean 'promt'"),
        ("list.jsonl", '{"prompt": "a cat"}\n["a dog"]\n', r"list\.jsonl, line 2 is a JSON list"),
        ("empty.jsonl", "", r"empty\.jsonl is empty"),
        ("blank.jsonl", "\n  \n", r"blank\.jsonl is empty"),
        ("empty.txt", "", r"empty\.txt is empty"),
        ("blank.txt", "\n \n\t\n", r"blank\.txt is empty"),
        # the prompt column must hold text; .json arrays are checked like .jsonl lines
        ("num.jsonl", '{"prompt": "a cat"}\n{"prompt": 3}\n', r"num\.jsonl, line 2: 'prompt' is a int \('3'\), not a string"),
        ("arr.json", '[{"prompt": "a cat"}, {"promt": "a dog"}]', r"arr\.json, item 1 has no 'prompt' key.*did you mean 'promt'"),
        ("arrnum.json", '[{"prompt": ["a", "b"]}]', r"arrnum\.json, item 0: 'prompt' is a list"),
        ("badarr.json", '[{"prompt": "a cat"},\n oops]', r"badarr\.json, line 2 is not valid JSON"),
    ],
)
def test_bad_prompt_files_fail_on_the_driver(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(RecipeError, match=message):
        build(f"data.path={path}")


def test_undecodable_bytes_name_the_line_and_a_long_first_line_is_valid(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("a cat\n".encode() + "a café\n".encode("latin-1"))
    with pytest.raises(RecipeError, match=r"latin\.txt, line 2 is not UTF-8 text .*save the file as UTF-8"):
        build(f"data.path={latin}")
    long = tmp_path / "long.jsonl"  # a first line longer than any peek buffer is still one valid object
    long.write_text(json.dumps({"prompt": "a cat " * 20000}) + "\n" + json.dumps({"prompt": "a dog"}) + "\n")
    build(f"data.path={long}")
    array = tmp_path / "ok.json"
    array.write_text(json.dumps([{"prompt": "a cat", "seed": 1}, {"prompt": "a dog", "seed": 2}]))
    build(f"data.path={array}")


def test_bad_line_in_a_later_file_of_a_directory_is_found(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "a cat"}\n')
    (tmp_path / "b.jsonl").write_text('{"prompt": "a dog"}\n{"prompt": "a fox"\n')
    with pytest.raises(RecipeError, match=r"b\.jsonl, line 2 is not valid JSON"):
        build(f"data.path={tmp_path}")


# ------------------------------------------------------------------ checkpoint folder


def _checkpoint(tmp_path, state):
    folder = tmp_path / "run" / "checkpoint_000002"
    (folder / SHARDS_DIR).mkdir(parents=True)
    if state is not None:
        (folder / STATE_FILE).write_text(state)
    return folder


@pytest.mark.parametrize(
    "state, shards, message",
    [
        (None, True, f"{STATE_FILE} is missing"),
        ("{not json", True, f"{STATE_FILE} is unreadable: JSONDecodeError"),
        ("\xff\xfe garbage", True, f"{STATE_FILE} is unreadable"),
        ('["a list"]', True, "lacks a 'step' >= 0 and a 'backend' entry"),
        ('{"step": "2", "backend": {}}', True, "lacks a 'step'"),
        ('{"step": 2, "backend": {}, "controller": {}}', False, f"its {SHARDS_DIR}/ folder is missing"),
    ],
)
def test_corrupt_checkpoint_names_the_folder_and_what_to_do(tmp_path, state, shards, message):
    folder = _checkpoint(tmp_path, state)
    if not shards:
        (folder / SHARDS_DIR).rmdir()
    with pytest.raises(RuntimeError, match=message) as info:
        read_checkpoint_state(str(folder))
    assert "checkpoint_000002" in str(info.value) and "new trainer.run_name" in str(info.value)


def test_valid_checkpoint_state_is_returned(tmp_path):
    state = {"step": 2, "backend": {"policy_version": 2}, "controller": {"seed": 0}}
    folder = _checkpoint(tmp_path, json.dumps(state))
    assert read_checkpoint_state(str(folder), name="s3://bucket/run/checkpoint_000002") == state


# ------------------------------------------------------------------ rewards


PROMPTS = ["a", "b", "c", "d"]
IMAGES = [np.full((4, 4, 3), 200, dtype=np.uint8)] * 4


def test_reward_of_the_wrong_length_is_an_error_naming_it():
    with pytest.raises(RewardError, match=r"reward 'short' failed: returned 3 scores for 4 samples"):
        score_one("short", lambda **_: [1.0, 2.0, 3.0], IMAGES, PROMPTS)
    with pytest.raises(RewardError, match=r"reward 'scalar' failed: returned float; .*one score per sample"):
        score_one("scalar", lambda **_: 1.0, IMAGES, PROMPTS)
    with pytest.raises(RewardError, match=r"reward 'text' failed: returned a non-numeric score"):
        score_one("text", lambda **_: ["x"] * 4, IMAGES, PROMPTS)


def test_nan_and_none_rewards_are_invalid_samples_and_counted():
    scores = score_one("partial", lambda **_: [1.0, math.nan, None, math.inf], IMAGES, PROMPTS)
    assert scores == [1.0, None, None, None]
    per_source = {"partial": scores, "ok": [0.5] * 4}
    totals = combine(per_source, {"partial": 1.0, "ok": 2.0})
    assert totals == [2.0, None, None, None]
    metrics = reward_metrics(per_source, totals)
    assert metrics["reward/invalid_frac"] == 0.75 and metrics["reward/mean"] == 2.0
    # a source with weight 0 is logged but does not invalidate a sample
    assert combine(per_source, {"partial": 0.0, "ok": 1.0}) == [0.5] * 4


def test_images_not_matching_the_contract_fail_naming_the_reward():
    gray = [np.zeros((4, 4), dtype=np.uint8)] * 4
    with pytest.raises(RewardError, match=r"reward 'brightness' failed: .*expected an image \[H, W, 3\]"):
        score_batch({"brightness": brightness}, gray, PROMPTS)
    floats = [np.zeros((4, 4, 3), dtype=np.float32)] * 4
    with pytest.raises(RewardError, match=r"reward 'brightness' failed: .*expected uint8 pixels"):
        score_batch({"brightness": brightness}, floats, PROMPTS)
    with pytest.raises(ValueError, match="got 3 images for 4 prompts"):
        score_batch({"brightness": brightness}, IMAGES[:3], PROMPTS)


# ------------------------------------------------------------------ model: block class


def test_unknown_block_class_is_named_when_the_worker_sets_up():
    """What a train rank does (StackWorker builds bundle, then backend), in one process."""
    cfg = load_recipe(TINY, ["backend.block_class_names=[Nope]"])
    backend = instantiate(cfg.backend, bundle=instantiate(cfg.bundle))
    with pytest.raises(ValueError, match=r"block_class_names \['Nope'\] not found in SD3Transformer.*"
                                         r"Set backend.block_class_names"):
        backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
