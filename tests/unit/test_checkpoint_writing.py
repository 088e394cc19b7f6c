"""Checkpoint bookkeeping of a train rank (``runtime.worker``): the next save or ``wait_checkpoint`` waits for
the rank's asynchronous checkpoint (``_Writing``) and raises what it raised, naming it; a write that outlives
its timeout is named too; only folders with the commit marker count as committed, and deleting one removes
its marker first."""

import threading

import pytest

from unirl_ray.runtime.worker import _Writing


def test_a_failed_background_write_is_raised_once_by_the_next_command_with_its_name():
    def fail():
        raise OSError(28, "No space left on device")

    _Writing.current = _Writing("checkpoint_000007", fail)
    with pytest.raises(RuntimeError, match=r"writing checkpoint checkpoint_000007 failed: OSError: .*No space left") as info:
        _Writing.join(10)
    assert isinstance(info.value.__cause__, OSError)
    _Writing.join(10)  # taken: the next command does not raise it again


def test_the_next_command_waits_for_the_write_and_a_hung_one_times_out():
    release, order = threading.Event(), []
    _Writing.current = _Writing("checkpoint_000001", lambda: (release.wait(10), order.append("written")))
    threading.Timer(0.2, release.set).start()
    _Writing.join(10)
    assert order == ["written"] and _Writing.current is None
    stuck = threading.Event()
    _Writing.current = _Writing("checkpoint_000002", lambda: stuck.wait(30))
    with pytest.raises(TimeoutError, match="checkpoint_000002 was not written within 0s"):
        _Writing.join(0.2)
    assert _Writing.current is not None  # still this rank's: the next command waits for it again
    stuck.set()
    _Writing.join(10)
    assert _Writing.current is None


def test_only_marked_checkpoint_folders_count_and_deleting_one_drops_its_marker_first(tmp_path):
    import pyarrow.fs

    from unirl_ray.runtime.worker import COMMIT_FILE, STATE_FILE, _delete_checkpoint, checkpoint_folders, committed_checkpoints
    from unirl_ray.trainer.base import BaseTrainer

    fs = pyarrow.fs.LocalFileSystem()
    assert not BaseTrainer._has_checkpoint(str(tmp_path))
    (tmp_path / "checkpoint_000001" / "shards").mkdir(parents=True)  # a first save killed half written
    assert not BaseTrainer._has_checkpoint(str(tmp_path))  # the run starts over: no checkpoint to resume
    (tmp_path / "checkpoint_000001" / STATE_FILE).write_text("{}")
    assert BaseTrainer._has_checkpoint(str(tmp_path))  # a state file (a run from before the marker) counts
    _delete_checkpoint(fs, str(tmp_path / "checkpoint_000001"))
    for step, marked in ((2, True), (4, False), (10, True), (6, True)):  # 4: a save a killed job left half written
        folder = tmp_path / f"checkpoint_{step:06d}"
        (folder / "shards").mkdir(parents=True)
        if marked:
            (folder / COMMIT_FILE).write_text("{}")
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "checkpoint_000008").write_text("a file, not a folder")
    (tmp_path / "mlflow.db").write_text("")
    (tmp_path / "checkpoint_000006" / STATE_FILE).write_text("{}")
    assert [(f.step, f.committed, f.has_state) for f in checkpoint_folders(fs, str(tmp_path))] == [
        (2, True, True), (4, False, False), (6, True, True), (10, True, True)]  # (committed: stated)
    assert BaseTrainer._has_checkpoint(str(tmp_path))
    found = committed_checkpoints(fs, str(tmp_path))
    assert [step for step, _ in found] == [2, 6, 10]  # numeric order, the unmarked 4 and the rest ignored
    assert found[-1][1] == str(tmp_path / "checkpoint_000010")
    assert committed_checkpoints(fs, str(tmp_path / "no_such_run")) == []
    _delete_checkpoint(fs, found[0][1])
    _delete_checkpoint(fs, str(tmp_path / "checkpoint_000004"))
    _delete_checkpoint(fs, str(tmp_path / "checkpoint_000012"))  # absent: nothing to do
    assert not (tmp_path / "checkpoint_000002").exists() and not (tmp_path / "checkpoint_000004").exists()
    assert [step for step, _ in committed_checkpoints(fs, str(tmp_path))] == [6, 10]


class _Rank:
    """A rank object whose whole state is one number, written to ``<shards>/value``."""

    policy_version = 0

    def __init__(self, value=0, file="value"):
        self.value, self.file = value, file

    def save(self, directory):
        meta, write = self.save_async(directory)
        write()
        return meta

    def save_async(self, directory):
        import os

        os.makedirs(directory, exist_ok=True)
        staged = self.value

        def write():
            with open(os.path.join(directory, self.file), "w") as f:
                f.write(str(staged))

        return {"value": staged}, write

    def load(self, directory, meta):
        import os

        with open(os.path.join(directory, self.file)) as f:
            self.value = int(f.read())
        assert self.file != "value" or meta == {"value": self.value}  # (the state is rank 0's)


@pytest.mark.parametrize("uri", [False, True], ids=["folder", "uri"])
def test_save_commits_prunes_clears_a_left_slot_and_restore_loads_the_newest(tmp_path, monkeypatch, uri):
    """``_save`` / ``_restore`` of one rank against a real Ray Train storage context: a local folder (written in
    place) and a filesystem that is not the local one (the URI branch: a local folder first, then copied)."""
    import json
    import os
    import tempfile
    import types

    import fsspec
    import pyarrow.fs
    import ray.train
    from ray.train.v2._internal.execution.storage import StorageContext

    from unirl_ray.runtime import worker as w

    fs = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fsspec.filesystem("file"))) if uri else None
    storage = StorageContext(str(tmp_path), "run", storage_filesystem=fs)
    monkeypatch.setattr(ray.train, "get_context", lambda: types.SimpleNamespace(get_storage=lambda: storage))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    run = tmp_path / "run"
    leftovers = lambda: {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("unirl_ckpt_")}  # noqa: E731
    before = leftovers()

    rank = _Rank(1)
    out = w._save(rank, {"step": 1, "controller": {"cursor": 1}, "asynchronous": True, "keep": 2}, 0, 60)
    assert out["path"] is None and out["name"] == "checkpoint_000001"
    rank.value = 99  # training goes on: the copy taken at the save is what is written
    w._Writing.join(60)
    first = run / "checkpoint_000001"
    assert (first / w.COMMIT_FILE).is_file() and (first / "shards" / "value").read_text() == "1"
    assert json.loads((first / w.STATE_FILE).read_text()) == {"step": 1, "backend": {"value": 1}, "controller": {"cursor": 1}}

    for step in (2, 3):
        rank.value = step
        out = w._save(rank, {"step": step, "controller": {"cursor": step}, "asynchronous": False, "keep": 2}, 0, 60)
        assert out["path"] == str(run / f"checkpoint_{step:06d}")  # committed when a synchronous save returns
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_000002", "checkpoint_000003"]  # kept 2

    junk = run / "checkpoint_000004"  # a killed job's half-written save in the next slot
    (junk / "shards").mkdir(parents=True)
    (junk / "shards" / "stale").write_text("x")
    orphan = run / "checkpoint_000000"  # ... and one of an earlier step (no state file: never a checkpoint)
    (orphan / "shards").mkdir(parents=True)
    legacy = run / "checkpoint_000001"  # a state file without the marker (a run from before the marker)
    legacy.mkdir()
    (legacy / w.STATE_FILE).write_text("{}")
    assert w._restore(_Rank()) == (3, json.loads((run / "checkpoint_000003" / w.STATE_FILE).read_text()))
    rank.value = 4
    monkeypatch.setattr(w, "_SWEPT", False)  # as in a new job (a process sweeps at its first commit only)
    w._save(rank, {"step": 4, "controller": {}, "asynchronous": True, "keep": None}, 0, 60)
    w._Writing.join(60)
    assert not (junk / "shards" / "stale").exists() and (junk / w.COMMIT_FILE).is_file()
    assert not orphan.exists() and legacy.is_dir()  # the half-written earlier slot is cleared once 4 commits
    resumed = _Rank()
    step, state = w._restore(resumed)
    assert (step, resumed.value, state["step"]) == (4, 4, 4)
    assert leftovers() == before  # the local folders of the URI branch are gone


class _FailingRank(_Rank):
    def save(self, directory):
        raise OSError(28, "No space left on device")

    def save_async(self, directory):
        raise MemoryError("cannot copy the shards")


def _two_ranks_save(root):
    import types

    import ray.train
    import torch.distributed as dist
    from ray.train.v2._internal.execution.storage import StorageContext

    from unirl_ray.runtime import worker as w

    rank = dist.get_rank()
    storage = StorageContext(root, "run")
    ray.train.get_context = lambda: types.SimpleNamespace(get_storage=lambda: storage)
    ray.train.get_checkpoint = lambda: None
    out = {}
    payload = {"step": 1, "controller": {}, "asynchronous": False, "keep": None}
    try:  # rank 1 cannot write its shards: both ranks raise at once, nothing is committed
        w._save(_FailingRank(1, f"value{rank}") if rank == 1 else _Rank(1, f"value{rank}"), payload, rank, 60)
    except Exception as exc:  # noqa: BLE001
        out["failed"] = f"{type(exc).__name__}: {exc}"
    payload = {"step": 2, "controller": {}, "asynchronous": True, "keep": None}
    try:  # rank 1 cannot copy its shards: no rank's thread starts writing (their collectives would not match)
        w._save(_FailingRank(1, f"value{rank}") if rank == 1 else _Rank(1, f"value{rank}"), payload, rank, 60)
    except Exception as exc:  # noqa: BLE001
        out["failed_async"] = f"{type(exc).__name__}: {exc}"
    out["writing_after_failure"] = w._Writing.current is not None
    w._save(_Rank(10 + rank, f"value{rank}"), payload, rank, 60)
    w._Writing.join(60)
    resumed = _Rank(0, f"value{rank}")
    out["restored"] = w._restore(resumed)[0], resumed.value
    return out


def test_a_rank_that_fails_its_write_fails_the_save_on_every_rank_and_commits_nothing(tmp_path):
    from _dist import run_ranks

    from unirl_ray.runtime.worker import COMMIT_FILE

    ranks = run_ranks(_two_ranks_save, str(tmp_path))
    assert "OSError" in ranks[1]["failed"] and "No space left" in ranks[1]["failed"]
    assert "another rank failed to write its shards" in ranks[0]["failed"]
    assert not (tmp_path / "run" / "checkpoint_000001").exists()  # rank 0 cleared the failed save's slot
    assert "MemoryError" in ranks[1]["failed_async"] and "another rank failed to copy" in ranks[0]["failed_async"]
    assert not ranks[0]["writing_after_failure"] and not ranks[1]["writing_after_failure"]
    assert not (tmp_path / "run" / "checkpoint_000001" / COMMIT_FILE).exists()
    assert (tmp_path / "run" / "checkpoint_000002" / COMMIT_FILE).is_file()
    assert [r["restored"] for r in ranks] == [(2, 10), (2, 11)]  # the checkpoint rank 0 chose, each its shard
