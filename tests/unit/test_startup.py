"""The start-up clock: milestones since the process start (first run of a process) or since setup()."""

import time

import pytest

from unirl_ray.runtime import startup
from unirl_ray.runtime.startup import StartupClock, process_start_time


def test_process_start_time_is_this_process_start():
    import psutil

    # psutil counts from the boot time in whole seconds, this from /proc/uptime (hundredths)
    assert process_start_time() == pytest.approx(psutil.Process().create_time(), abs=1.0)
    assert process_start_time() <= time.time()


def test_first_run_counts_from_the_process_start_later_runs_from_their_setup(monkeypatch):
    monkeypatch.setattr(startup, "_started_one", False)
    first = StartupClock()
    assert first.since_process and first.origin == pytest.approx(process_start_time(), abs=0.01)
    first.mark("setup")
    assert first.marks["setup"] >= 0
    later = StartupClock()
    assert not later.since_process and time.time() - later.origin < 1.0


def test_a_milestone_keeps_its_first_time_and_the_summary_lists_them_in_order():
    clock = StartupClock(origin=time.time() - 10.0)
    assert not clock.since_process
    clock.marks.update(setup=0.5, workers=9.0, ray=3.0)
    assert clock.mark("ray") == 3.0  # a restart does not move a milestone
    clock.mark("first_step")
    assert clock.metrics() == {f"startup/{k}_s": v for k, v in clock.marks.items()}
    line = clock.summary()
    assert line.startswith(f"first step {clock.marks['first_step']:.1f}s after setup() began")
    assert line.index("setup 0.5") < line.index("ray 3.0") < line.index("workers 9.0") < line.index("first_step")
