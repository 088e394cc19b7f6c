"""Checkpoints are published atomically: a save interrupted by a dead worker, or a half-written folder
left by a killed job, is never picked on resume (only folders marked committed are), and its slot is
cleared before it is written again. Re-running the same command resumes from the last
complete checkpoint, in the same MLflow run, and finishes."""

import json
import os
import signal
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

import support

from unirl_ray.runtime.worker import COMMIT_FILE
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = support.recipe_path("ar", "tiny", "char_grpo_direct.yaml")


def make(tmp_path, steps):
    return support.make(ARTrainer, RECIPE, tmp_path, "atomic", f"trainer.num_steps={steps}", "trainer.checkpoint_every=2",
                        "tracking.log_samples_every=0", "ray.scaling.num_workers=1",
                        "ray.scaling.resources_per_worker.CPU=2", experiment="faults")


def kill_when_folder_appears(folder, pid, done):
    """SIGKILL ``pid`` as soon as ``folder`` exists (the save is being persisted), or give up at ``done``."""
    while not done.is_set():
        if os.path.exists(folder):
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.005)


def test_interrupted_save_and_half_written_folder_are_never_picked(ray_local, tmp_path):
    run_dir = tmp_path / "atomic"
    first = make(tmp_path, 4)
    done = threading.Event()
    original = first.save_checkpoint

    def save_checkpoint(step):
        if step == 4:  # kill the worker while it writes / persists the step-4 checkpoint
            # (the step-4 save first waits for the step-2 commit: at most one asynchronous save in flight)
            pid = first.group.call("ping", {})[0]["pid"]
            threading.Thread(target=kill_when_folder_appears, args=(str(run_dir / "checkpoint_000004"), pid, done),
                             daemon=True).start()
        return original(step)

    first.save_checkpoint = save_checkpoint
    with pytest.raises(Exception):  # ray.max_failures=0: the dead worker fails the run
        first.fit()
    done.set()
    run_id = first.tracker.run_id

    # a killed job can also leave a folder behind that Ray Train never registered: junk in the next slot
    junk = run_dir / "checkpoint_000006"
    (junk / "shards").mkdir(parents=True)
    (junk / "controller_state.json").write_text('{"step": 6, "backend": {"trunc')
    (junk / "shards" / "__0_0.distcp").write_bytes(b"\0" * 10)

    second = make(tmp_path, 6)
    second.fit()
    assert second.tracker.run_id == run_id  # resumed the same MLflow run
    client = MlflowClient(second.tracker.tracking_uri)
    steps = sorted({m.step for m in client.get_metric_history(run_id, "reward/mean")})
    assert steps == [1, 2, 3, 4, 5, 6]
    assert client.get_run(run_id).info.status == "FINISHED"
    # it resumed from a complete checkpoint (2, or 4 if the kill came after the commit), never the junk 6
    state = json.loads((run_dir / "checkpoint_000006" / "controller_state.json").read_text())
    assert state["step"] == 6 and second.policy_version == 6
    # the slots of the interrupted 4 and the junk 6 were cleared and written again; each checkpoint is marked
    # committed, and only the newest ray.num_checkpoints_to_keep (2) are kept
    folders = sorted(p.name for p in run_dir.glob("checkpoint_*"))
    assert folders == ["checkpoint_000004", "checkpoint_000006"], folders
    assert all((run_dir / name / COMMIT_FILE).is_file() for name in folders)
    assert not (run_dir / "checkpoint_000006" / "shards" / "__0_0.distcp").read_bytes().startswith(b"\0" * 10)
