"""A rank's asynchronous checkpoint (``runtime.worker._Writing``): the next save or ``wait_checkpoint`` waits
for it and raises what it raised, naming the checkpoint; a write that outlives its timeout is named too."""

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
