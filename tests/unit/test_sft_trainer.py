"""The SFT controller without Ray: recipe checks on the driver before any worker starts, how steps are
cut into worker commands, and how per-rank results become metrics."""

import os

import pytest

from unirl_ray.config.recipe import RecipeError, load_recipe
from unirl_ray.trainer.sft import SFTTrainer

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "sft", "tiny")


def trainer(tmp_path, *overrides, recipe="char_chat_sft.yaml"):
    return SFTTrainer(load_recipe(os.path.join(RECIPES, recipe), [f"trainer.storage_path={tmp_path}", *overrides]))


@pytest.mark.parametrize("override, message", [
    ("data.path=/no/such/records.jsonl", "does not exist"),
    ("trainer.batch_size=15", "must divide evenly over ray.scaling.num_workers=2"),
    ("stack.mini_batch_size=8", "stack.mini_batch_size: null"),
    ("data.format=image_caption", "no 'image' field"),
    ("data.eval_fraction=0.0", "need held-out data"),
])
def test_bad_recipes_fail_on_the_driver(tmp_path, override, message):
    with pytest.raises(RecipeError, match=message):
        trainer(tmp_path, override)


def test_image_records_need_an_image_model_without_cfg(tmp_path):
    with pytest.raises(RecipeError, match="records need an image model"):
        trainer(tmp_path, "data.path=${unirl_asset:data/sft_captions/captions.jsonl}", "data.format=auto")
    with pytest.raises(RecipeError, match="guidance_scale=1.0"):
        trainer(tmp_path, "pipeline.guidance_scale=4.5", recipe="sd3_caption_sft.yaml")


def test_commands_end_at_every_eval_checkpoint_and_the_last_step(tmp_path):
    t = trainer(tmp_path, "trainer.num_steps=25", "trainer.steps_per_call=8", "trainer.eval_every=6",
                "trainer.checkpoint_every=10")
    starts, step = [], 0
    while step < 25:
        starts.append(step)
        step += t._steps_in_call(step)
    assert starts == [0, 6, 10, 12, 18, 20, 24]
    assert [s for s in range(1, 26) if t._eval_due(s)] == [6, 12, 18, 24, 25]


def test_step_metrics_add_the_ranks_and_keep_the_cursor(tmp_path):
    t = trainer(tmp_path)
    rank = {"metrics": {"train/loss": 2.0, "train/lr": 0.003}, "policy_version": 7, "cursor": {"epoch": 1, "offset": 4},
            "stats": {"records": 8, "skipped": {"bad_json": 1}, "truncated": 2}, "rows": 7, "pad_rows": 1,
            "tokens": 200, "targets": 60, "images": 0, "data_seconds": 0.01}
    metrics = t._step_metrics([rank, dict(rank, tokens=100, data_seconds=0.03)], seconds=0.5)
    assert metrics["train/loss"] == 2.0 and metrics["data/records"] == 16 and metrics["data/skipped_bad_json"] == 2
    assert metrics["data/tokens"] == 300 and metrics["perf/tokens_per_s"] == 600 and metrics["timing/data"] == 0.03
    assert metrics["data/skipped_total"] == 2 and t.controller_state()["data"]["offset"] == 4
    t._step_metrics([rank, rank], seconds=0.5)
    assert t.totals["data/skipped_bad_json"] == 4  # cumulative, saved with the checkpoint
    with pytest.raises(RuntimeError, match="disagree on the data cursor"):
        t._step_metrics([rank, dict(rank, cursor={"epoch": 1, "offset": 5})], seconds=0.5)


def test_resume_on_another_worker_count_keeps_the_epoch_fraction(tmp_path):
    t = trainer(tmp_path)
    assert t._resume_cursor({"epoch": 2, "offset": 6, "world_size": 2}) == {"epoch": 2, "offset": 6}
    assert t._resume_cursor({"epoch": 2, "offset": 6, "world_size": 1}) == {"epoch": 2, "offset": 3}
    assert t._resume_cursor(None) == {"epoch": 0, "offset": 0}


def test_the_data_cursor_says_who_split_the_records_and_a_resume_across_the_two_warns(tmp_path, caplog):
    t = trainer(tmp_path)
    t.cursor = {"epoch": 1, "offset": 2}
    assert t.worker_datasets() is None and t.controller_state()["data"]["split"] == "driver"  # the small tiny file
    saved = {"epoch": 1, "offset": 2, "world_size": 2}
    with caplog.at_level("WARNING", logger="unirl_ray.trainer.sft"):
        assert t._resume_cursor({**saved, "split": "driver"}) == {"epoch": 1, "offset": 2}
        assert not caplog.records
        assert t._resume_cursor(saved) == {"epoch": 1, "offset": 2}  # before the split was recorded: Ray Train's
    assert "split over the ranks by ray train, this run's by driver" in caplog.text


def test_real_model_recipe_validates_against_a_model_folder_and_data(monkeypatch, tmp_path):
    import ray

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # driver-side checks read no weights
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path / "model"))
    monkeypatch.setenv("SFT_DATA", os.path.join(RECIPES, "..", "..", "..", "unirl_ray", "assets", "data", "sft_chat.jsonl"))
    t = trainer(tmp_path, recipe=os.path.join("..", "qwen2_5", "chat_sft_0_5b.yaml"))
    assert t.records_per_rank == 16 and t.data.packing and t.data.format == "messages" and not t.is_demo()
    assert not ray.is_initialized()
    monkeypatch.setenv("SFT_DATA", str(tmp_path / "missing"))
    with pytest.raises(RecipeError, match="does not exist"):
        trainer(tmp_path, recipe=os.path.join("..", "qwen2_5", "chat_sft_0_5b.yaml"))


def test_a_rising_held_out_loss_is_called_overfitting_once(tmp_path, capsys):
    # the tiny chat demo's eval loss rose at every evaluation while its train loss fell to 0.08, unsaid
    sft = trainer(tmp_path)
    seen = [sft._watch_overfitting(loss) for loss in (2.0, 1.5, 1.52, 1.7, 1.8, 1.4)]
    assert [m["eval/rising_evals"] for m in seen] == [0, 0, 0, 1, 2, 0]  # within 2% of the best: not rising
    assert [m["eval/best_loss"] for m in seen] == [2.0, 1.5, 1.5, 1.5, 1.5, 1.4]
    out = capsys.readouterr().out
    assert out.count("overfitting the training records") == 1 and "above its best (1.5000) for 2 evaluations" in out
