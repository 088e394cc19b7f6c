"""MLflow tracking against a local SQLite store, and the fallback when the backend is down."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from unirl_ray.tracking import MLflowTracker, TrackingConfig, image_grid, sanitize_key


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """One run root (and SQLite DB, ~6 s of migrations) shared by the tests of this module."""
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path_factory.mktemp("runs")
    from mlflow import MlflowClient

    tracker = MLflowTracker(TrackingConfig(experiment_name="warmup"))
    tracker.start(str(root), "warmup")
    tracker.end()
    assert not tracker.degraded
    yield root, MlflowClient(tracking_uri=tracker.tracking_uri)
    mp.undo()


def images(n: int, value: int = 0) -> list[np.ndarray]:
    return [np.full((8, 8, 3), value + i, dtype=np.uint8) for i in range(n)]


def test_run_logs_params_metrics_images_and_artifacts(store) -> None:
    root, client = store
    tracker = MLflowTracker(TrackingConfig(experiment_name="logs"))
    run_id = tracker.start(str(root), "run_a", tags={"domain": "diffusion"})
    assert tracker.tracking_uri == f"sqlite:///{root.resolve() / 'mlflow.db'}"
    # the environment's own mlflow (a bare `mlflow` may be another install, or none)
    assert tracker.ui_command.startswith(f"{Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {tracker.tracking_uri}")
    params = {f"p.{i:03d}": i for i in range(150)} | {"reward.weight": 0.5}
    tracker.log_params(params)  # more than one batch of 100
    tracker.log_metrics({"reward/mean": 0.25, "algo/kl": math.nan, "bad key!": 1.0}, step=0)
    tracker.log_metrics({"reward/mean": 0.75}, step=1)
    tracker.log_images(step=0, images=images(3), captions=["a cat", "a dog", "a fox"])
    tracker.log_text("trainer:\n  num_steps: 2\n", "recipe.yaml")
    tracker.log_dict({"step": 1}, "state.json")
    tracker.log_table({"prompt": ["p0", "p1"], "reward": [0.1, 0.2]}, "text/step_000001.json")
    tracker.end()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["domain"] == "diffusion"
    assert len(run.data.params) == 151 and run.data.params["reward.weight"] == "0.5"
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.75)]
    # NaN logged as such and counted (a chart never goes silently empty), the key sanitised
    assert set(run.data.metrics) == {"reward/mean", "bad key_", "algo/kl", "health/non_finite_metrics"}
    assert math.isnan(run.data.metrics["algo/kl"]) and run.data.metrics["health/non_finite_metrics"] == 1.0
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == (root.resolve() / "mlartifacts").as_uri()
    files = {a.path for a in client.list_artifacts(run_id)}
    assert {"recipe.yaml", "state.json", "samples", "text"} <= files
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == [
        "samples/step_000000.json"
    ]
    table = json.loads(
        Path(client.download_artifacts(run_id, "samples/step_000000.json")).read_text()
    )
    assert "a dog" in json.dumps(table)
    assert client.list_artifacts(run_id, "images")  # the grid logged by log_image(key=, step=)


def test_resume_continues_the_same_run(store) -> None:
    root, client = store
    first = MLflowTracker(TrackingConfig(experiment_name="resume"))
    run_id = first.start(str(root), "run_b")
    first.log_params({"lr": 0.001})
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.end(status="KILLED")

    second = MLflowTracker(TrackingConfig(experiment_name="resume"))
    assert second.start(str(root), "run_b", run_id=run_id) == run_id
    second.log_params({"lr": 0.001, "seed": 3})  # identical lr is skipped, not an error
    second.log_metrics({"train/loss": 0.5}, step=1)
    second.end()
    assert not second.degraded

    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].info.status == "FINISHED" and runs[0].data.params == {"lr": "0.001", "seed": "3"}
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0, 1]


def test_dead_server_falls_back_to_jsonl_with_one_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    tracker = MLflowTracker(TrackingConfig(tracking_uri="http://127.0.0.1:1"))
    with caplog.at_level(logging.WARNING, logger="unirl_ray.tracking.mlflow_tracker"):
        assert tracker.start(str(tmp_path), "dead") == ""
        tracker.log_params({"lr": 0.1})
        tracker.log_metrics({"reward/mean": 0.5}, step=0)
        tracker.log_metrics({"reward/mean": 0.6, "x": math.inf}, step=1)
        tracker.log_images(step=0, images=images(2), captions=["a", "b"])
        tracker.log_text("hello", "notes.txt")
        tracker.end()
    assert tracker.degraded
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "127.0.0.1:1" in warnings[0]  # the server once, the infinite metric once
    assert warnings[1].startswith("metric x is inf at step 1")
    lines = (tmp_path / "dead" / "mlflow_fallback.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if '"metrics"' in line]
    assert [(m["step"], m["metrics"]) for m in metrics] == [
        (0, {"reward/mean": 0.5}),
        (1, {"reward/mean": 0.6, "x": math.inf, "health/non_finite_metrics": 1.0}),
    ]
    artifacts = tmp_path / "dead" / "fallback_artifacts"
    assert (artifacts / "notes.txt").read_text() == "hello"
    assert (artifacts / "samples" / "step_000000.png").is_file()


def test_disabled_tracker_is_a_no_op(tmp_path) -> None:
    tracker = MLflowTracker(TrackingConfig(enabled=False))
    assert tracker.start(str(tmp_path), "off") == ""
    tracker.log_metrics({"a": 1.0}, step=0)
    tracker.end()
    assert tracker.run_id is None and not (tmp_path / "off").exists()
    assert not tracker.should_log_samples(0)


def test_helpers() -> None:
    grid = image_grid(images(3) + [np.ones((4, 6, 3), dtype=np.float32)])
    assert grid.size == (2 * 8 + 2, 2 * 8 + 2)  # 2x2 cells of the largest image, 2 px apart
    assert grid.getpixel((0, 0)) == (0, 0, 0) and grid.getpixel((10, 10)) == (255, 255, 255)
    assert sanitize_key("/reward//mean@x/") == "reward/mean_x"
    assert sanitize_key("../a") == "a"
    tracker = MLflowTracker(TrackingConfig(log_samples_every=5))
    assert [s for s in range(12) if tracker.should_log_samples(s)] == [0, 5, 10]
    with pytest.raises(ValueError, match="log_samples_every"):
        TrackingConfig(log_samples_every=-1)


def test_prepare_opens_the_store_ahead_of_start_and_never_raises(tmp_path, monkeypatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MLflowTracker(TrackingConfig(experiment_name="prepared"))
    tracker.prepare(str(tmp_path))  # what BaseTrainer.setup runs in a thread while the workers start
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("prepared")
    assert experiment is not None and experiment.artifact_location == (tmp_path / "mlartifacts").as_uri()
    run_id = tracker.start(str(tmp_path), "run")  # the prepared experiment, not a second one
    assert client.get_run(run_id).info.experiment_id == experiment.experiment_id
    tracker.end()

    broken = MLflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}"))
    (tmp_path / "missing").write_text("a file where the store's folder should be")
    broken.prepare(str(tmp_path / "other"))  # logged at debug level; start() degrades with a warning


def test_a_new_sqlite_store_is_a_copy_of_the_migrated_empty_one(tmp_path, monkeypatch) -> None:
    """The first new store builds the empty one in the cache (MLflow's migrations, once per version); the
    next ones are copies that MLflow opens as its own: same schema revision, default experiment as
    MLflow makes it, runs and metrics work; an existing file or a non-SQLite URI is never touched."""
    import sqlite3

    import mlflow
    from mlflow import MlflowClient

    from unirl_ray.tracking.mlflow_tracker import seed_sqlite_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "cache" / "unirl_ray" / "mlflow" / f"empty-{mlflow.__version__}.db"
    plain = tmp_path / "plain.db"
    MlflowClient(f"sqlite:///{plain}").search_experiments()  # built by MLflow itself
    assert seed_sqlite_store(f"sqlite:///{tmp_path / 'a.db'}") and template.is_file()
    assert seed_sqlite_store(f"sqlite:///{tmp_path / 'b.db'}")  # from the cached template

    def schema(path):  # each table's columns and constraints (MLflow's own stores list them in varying order)
        with sqlite3.connect(path) as db:
            tables = db.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
            revision = db.execute("SELECT version_num FROM alembic_version").fetchall()
        return [(name, sorted(line.strip(" ,") for line in (sql or "").splitlines())) for name, sql in tables], revision

    assert schema(tmp_path / "b.db") == schema(plain)
    client = MlflowClient(f"sqlite:///{tmp_path / 'b.db'}")
    default = client.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    run = client.create_run(client.create_experiment("seeded"))
    client.log_metric(run.info.run_id, "x", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "x")] == [(3, 1.5)]

    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'b.db'}")  # exists: left alone
    assert client.get_run(run.info.run_id).info.run_id == run.info.run_id
    assert not seed_sqlite_store("http://127.0.0.1:5000") and not seed_sqlite_store("postgresql://h/db")
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'no' / 'folder.db'}")  # MLflow reports that one
    assert not list(tmp_path.glob(".*.db.*"))  # no partial copies left behind


def test_metrics_are_written_in_the_background_in_order_and_flushed_by_end(store) -> None:
    """A step does not wait for the store: ``log_metrics`` returns while the write is held up, the writes
    land in order, ``flush`` and ``end`` wait for them; ``background_metrics=False`` writes at once."""
    import threading

    root, client = store
    tracker = MLflowTracker(TrackingConfig(experiment_name="background"))
    run_id = tracker.start(str(root), "bg")
    gate, original = threading.Event(), tracker._client.log_batch

    def held(*args, **kwargs):
        assert gate.wait(30)
        return original(*args, **kwargs)

    tracker._client.log_batch = held
    for step in range(5):
        tracker.log_metrics({"reward/mean": float(step)}, step=step)  # returns with the store held up
    assert client.get_metric_history(run_id, "reward/mean") == []
    assert not tracker.flush(timeout_s=0.2)  # still held: a bounded wait, and it says so
    gate.set()
    assert tracker.flush()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(s, float(s)) for s in range(5)]
    tracker.log_metrics({"reward/mean": 5.0}, step=5)
    tracker.end()  # waits for the queued write, then ends the run; its writer thread is gone
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == list(range(6))
    assert client.get_run(run_id).info.status == "FINISHED" and tracker._writer is None

    direct = MLflowTracker(TrackingConfig(experiment_name="background", background_metrics=False))
    direct_id = direct.start(str(root), "direct")
    direct.log_metrics({"reward/mean": 1.0}, step=1)
    assert [m.value for m in client.get_metric_history(direct_id, "reward/mean")] == [1.0] and direct._writer is None
    direct.end()


def test_the_writer_sends_the_steps_of_a_batch_window_in_one_call(store) -> None:
    """``metrics_batch_s``: the steps logged within the window go to MLflow in one call, in order, once the
    window ends (nobody has to flush) or at a flush; records bigger than MLflow's batch limit are split."""
    import time

    import unirl_ray.tracking.mlflow_tracker as mt

    root, client = store
    tracker = MLflowTracker(TrackingConfig(experiment_name="batched", metrics_batch_s=0.5))
    run_id = tracker.start(str(root), "batched")
    calls, original = [], tracker._client.log_batch

    def counted(run, metrics=(), **kwargs):
        calls.append(sorted({m.step for m in metrics}))
        return original(run, metrics=metrics, **kwargs)

    tracker._client.log_batch = counted
    for step in range(4):
        tracker.log_metrics({"reward/mean": float(step), "loss": -float(step)}, step=step)
    time.sleep(0.2)
    assert calls == []  # inside the window: held
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:  # the window ends: written without a flush
        time.sleep(0.05)
    assert calls == [[0, 1, 2, 3]]
    for step in range(4, 7):
        tracker.log_metrics({"reward/mean": float(step)}, step=step)
    assert tracker.flush() and calls == [[0, 1, 2, 3], [4, 5, 6]]  # a flush sends the open batch at once
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(s, float(s)) for s in range(7)]
    wide = {f"m{i}": float(i) for i in range(mt._METRICS_PER_BATCH // 2 + 1)}
    for step in (7, 8):
        tracker.log_metrics(wide, step=step)
    tracker._stop_writer()  # the end sends the open batch (end() flushes first; this is the writer's own stop)
    assert calls[2:] == [[7], [8]]  # 2 x 501 metrics: a call each (whole records, at most 1000 metrics a call)
    assert len(client.get_metric_history(run_id, "m500")) == 2
    tracker.end()


def test_a_batch_that_fails_part_way_buffers_only_the_steps_mlflow_did_not_take(store) -> None:
    import unirl_ray.tracking.mlflow_tracker as mt

    root, client = store
    tracker = MLflowTracker(TrackingConfig(experiment_name="partial", metrics_batch_s=30, retry_interval_s=3600))
    run_id = tracker.start(str(root), "partial")
    original, calls = tracker._client.log_batch, []

    def second_fails(run, metrics=(), **kwargs):
        calls.append(metrics[0].step)
        if len(calls) == 2:
            raise ConnectionError("MLflow went away")
        return original(run, metrics=metrics, **kwargs)

    tracker._client.log_batch = second_fails
    wide = {f"m{i}": float(i) for i in range(mt._METRICS_PER_BATCH - 100)}  # one step per call
    for step in range(3):
        tracker.log_metrics(wide, step=step)
    assert tracker.degraded and calls == [0, 1]  # (reading `degraded` flushes)
    assert [m.step for m in client.get_metric_history(run_id, "m0")] == [0]
    fallback = [json.loads(line)["step"] for line in tracker.fallback_metrics_path.read_text().splitlines()]
    assert fallback == [1, 2] and tracker.pending == 2  # not step 0 again: MLflow has it
    tracker.end()


def test_a_writer_that_never_frees_room_costs_records_their_mlflow_copy_not_the_run(store, monkeypatch) -> None:
    """With the queue full for longer than the bound (a write hangs), ``log_metrics`` returns after the bound and
    the record goes to the local fallback file; ``flush`` says it timed out instead of hanging."""
    import time

    import threading

    import unirl_ray.tracking.mlflow_tracker as mt

    root, _ = store
    monkeypatch.setattr(mt, "MAX_QUEUED_WRITES", 1)
    monkeypatch.setattr(mt, "FLUSH_TIMEOUT_S", 0.3)
    tracker = MLflowTracker(TrackingConfig(experiment_name="background", metrics_batch_s=0))  # each step a write
    tracker.start(str(root), "stuck")
    gate = threading.Event()
    tracker._client.log_batch = lambda *a, **k: gate.wait(30)
    started = time.monotonic()
    for step in range(3):  # one in the writer, one queued, the third finds no room
        tracker.log_metrics({"reward/mean": float(step)}, step=step)
    assert time.monotonic() - started < 10  # the bound, not the hung write (30 s)
    assert not tracker.flush(timeout_s=0.3)
    assert [json.loads(line)["step"] for line in tracker.fallback_metrics_path.read_text().splitlines()] == [2]
    gate.set()
    tracker.end()
