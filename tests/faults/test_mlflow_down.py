"""MLflow unavailable: no tracker call raises or hangs; params and metrics go to
``<run_root>/<run_name>/mlflow_fallback.jsonl`` and reach MLflow once it answers again.

The unreachable case is real HTTP to a loopback port where nothing listens. The server that goes
away mid-run is simulated against a real local SQLite store by making the MLflow client's calls
raise ``ConnectionError`` for a while (starting ``mlflow server`` takes ~25 s on a 2-core machine,
too slow for this suite)."""

import json
import logging
import os
import socket
import time

import pytest
from mlflow import MlflowClient

from unirl_ray.tracking import MLflowTracker, TrackingConfig
from unirl_ray.tracking.mlflow_tracker import FALLBACK_FILE, HTTP_ENV_DEFAULTS

LOGGER = "unirl_ray.tracking.mlflow_tracker"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]


def _fallback_metrics(path):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r["metrics"]) for r in lines if "metrics" in r]


def test_unreachable_server_costs_seconds_and_logs_locally(tmp_path, monkeypatch, caplog):
    for key in HTTP_ENV_DEFAULTS:  # the tracker's own short defaults apply, as for a user who set none
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    uri = f"http://127.0.0.1:{_dead_port()}"
    tracker = MLflowTracker(TrackingConfig(tracking_uri=uri, retry_interval_s=0.5))
    durations = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t0 = time.monotonic()
        assert tracker.start(str(tmp_path), "dead") == ""
        durations.append(time.monotonic() - t0)
        tracker.log_params({"lr": 0.1})
        for step in range(3):
            t0 = time.monotonic()
            tracker.log_metrics({"reward/mean": 0.5 + step}, step=step)
            durations.append(time.monotonic() - t0)
            time.sleep(0.3 if step == 0 else 0)  # the next call retries the server (still dead)
        tracker.end()
    assert max(durations) < 8, durations  # MLflow's defaults (7 retries, 120 s timeout) would take minutes
    assert tracker.degraded and tracker.pending == 4  # 1 params + 3 metrics records kept for a retry
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and uri in warnings[0] and FALLBACK_FILE in warnings[0]
    assert _fallback_metrics(tmp_path / "dead" / FALLBACK_FILE) == [
        (0, {"reward/mean": 0.5}), (1, {"reward/mean": 1.5}), (2, {"reward/mean": 2.5})]
    assert all(os.environ[key] == value for key, value in HTTP_ENV_DEFAULTS.items())


@pytest.fixture(scope="module")
def sqlite_root(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path_factory.mktemp("runs")
    yield root
    mp.undo()


class _Outage:
    """Makes every MLflow client call fail like a dead server until ``end()``."""

    def __init__(self, monkeypatch):
        self.down = False
        for name in ("log_batch", "get_run", "set_terminated", "log_text"):
            original = getattr(MlflowClient, name)

            def failing(client, *args, _original=original, **kwargs):
                if self.down:
                    raise ConnectionError("Connection refused (simulated outage)")
                return _original(client, *args, **kwargs)

            monkeypatch.setattr(MlflowClient, name, failing)


def test_server_that_goes_away_and_comes_back_gets_the_buffered_metrics(sqlite_root, monkeypatch, caplog):
    outage = _Outage(monkeypatch)
    # the outage is switched on and off between calls: each write must happen at its call, not in the background
    tracker = MLflowTracker(TrackingConfig(experiment_name="outage", retry_interval_s=0.2, background_metrics=False))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run_id = tracker.start(str(sqlite_root), "flaky")
        tracker.log_params({"lr": 0.1})
        tracker.log_metrics({"reward/mean": 0.0}, step=0)
        outage.down = True
        tracker.log_metrics({"reward/mean": 1.0}, step=1)  # fails: degraded, buffered, written locally
        tracker.log_params({"seed": 3})
        time.sleep(0.25)
        tracker.log_metrics({"reward/mean": 2.0}, step=2)  # the retry fails too: still local
        assert tracker.degraded and tracker.pending == 3
        outage.down = False
        tracker.log_metrics({"reward/mean": 3.0}, step=3)  # within the retry interval: still local
        assert tracker.degraded
        time.sleep(0.25)
        tracker.log_metrics({"reward/mean": 4.0}, step=4)  # retry succeeds: buffer flushed, then this
        assert not tracker.degraded and tracker.pending == 0
        tracker.end()
    client = MlflowClient(tracker.tracking_uri)
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(5)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1", "seed": "3"}
    warnings = _warnings(caplog)
    assert len(warnings) == 2 and "training continues" in warnings[0]
    assert "is back: sent 4 buffered records" in warnings[1]
    local = _fallback_metrics(sqlite_root / "flaky" / FALLBACK_FILE)
    assert [step for step, _ in local] == [1, 2, 3]  # the local copy of what MLflow missed


def test_a_long_outage_is_sent_back_in_few_calls(sqlite_root, monkeypatch):
    """The records buffered while MLflow was down go back together, up to its limit of 1000 metrics a call (an
    hour's outage at 10 steps a second: ~1,300 calls, not ~36,000 with the writer held for them)."""
    outage = _Outage(monkeypatch)
    tracker = MLflowTracker(TrackingConfig(experiment_name="outage", retry_interval_s=0.2, background_metrics=False))
    run_id = tracker.start(str(sqlite_root), "long")
    outage.down = True
    for step in range(120):
        tracker.log_metrics({f"m{i}": float(step) for i in range(10)}, step=step)
    assert tracker.degraded and tracker.pending == 120
    outage.down = False
    calls, original = [], tracker._client.log_batch

    def counted(run, **kwargs):
        calls.append(len(kwargs.get("metrics", ())))
        return original(run, **kwargs)

    tracker._client.log_batch = counted
    time.sleep(0.25)
    tracker.log_metrics({"m0": 120.0}, step=120)  # the retry: the buffer first, then this step
    assert not tracker.degraded and tracker.pending == 0
    assert calls == [1000, 200, 1]
    tracker.end()
    history = MlflowClient(tracker.tracking_uri).get_metric_history(run_id, "m0")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(121)]


def test_end_makes_a_last_attempt_and_retry_zero_stays_local(sqlite_root, monkeypatch):
    outage = _Outage(monkeypatch)
    tracker = MLflowTracker(TrackingConfig(experiment_name="outage", retry_interval_s=3600, background_metrics=False))
    run_id = tracker.start(str(sqlite_root), "last")
    outage.down = True
    tracker.log_metrics({"x": 1.0}, step=1)
    outage.down = False
    tracker.end()  # the interval has not passed, but end() tries once more and flushes
    client = MlflowClient(tracker.tracking_uri)
    assert [m.step for m in client.get_metric_history(run_id, "x")] == [1]
    assert client.get_run(run_id).info.status == "FINISHED"

    never = MLflowTracker(TrackingConfig(experiment_name="outage", retry_interval_s=0, background_metrics=False))
    never.start(str(sqlite_root), "never")
    outage.down = True
    never.log_metrics({"x": 1.0}, step=1)
    outage.down = False
    never.log_metrics({"x": 2.0}, step=2)
    never.end()
    assert never.degraded
    assert [s for s, _ in _fallback_metrics(sqlite_root / "never" / FALLBACK_FILE)] == [1, 2]
    with pytest.raises(ValueError, match="retry_interval_s must be >= 0"):
        TrackingConfig(retry_interval_s=-1)
