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
    stuck.set()


def test_only_marked_checkpoint_folders_count_and_deleting_one_drops_its_marker_first(tmp_path):
    import pyarrow.fs

    from unirl_ray.runtime.worker import COMMIT_FILE, _delete_checkpoint, committed_checkpoints

    fs = pyarrow.fs.LocalFileSystem()
    for step, marked in ((2, True), (4, False), (10, True), (6, True)):  # 4: a save a killed job left half written
        folder = tmp_path / f"checkpoint_{step:06d}"
        (folder / "shards").mkdir(parents=True)
        if marked:
            (folder / COMMIT_FILE).write_text("{}")
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "checkpoint_000008").write_text("a file, not a folder")
    (tmp_path / "mlflow.db").write_text("")
    found = committed_checkpoints(fs, str(tmp_path))
    assert [step for step, _ in found] == [2, 6, 10]  # numeric order, the unmarked 4 and the rest ignored
    assert found[-1][1] == str(tmp_path / "checkpoint_000010")
    assert committed_checkpoints(fs, str(tmp_path / "no_such_run")) == []
    _delete_checkpoint(fs, found[0][1])
    _delete_checkpoint(fs, str(tmp_path / "checkpoint_000004"))
    _delete_checkpoint(fs, str(tmp_path / "checkpoint_000012"))  # absent: nothing to do
    assert not (tmp_path / "checkpoint_000002").exists() and not (tmp_path / "checkpoint_000004").exists()
    assert [step for step, _ in committed_checkpoints(fs, str(tmp_path))] == [6, 10]
