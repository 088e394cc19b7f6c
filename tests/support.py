"""Helpers shared by the test modules that drive trainers: recipe builders, MLflow metric readers,
step loops and kill helpers (one copy here instead of one per module).

``tests/`` is on ``sys.path`` (pytest puts the directory of the top-level ``conftest.py`` there), so a
module imports these as ``from support import history, make``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


ONE_WORKER = ("ray.scaling.num_workers=1", "ray.scaling.resources_per_worker.CPU=2")
"""Overrides for one train worker with both CPUs (torch's threads follow the worker's CPUs): for runs that
check no rank logic; one worker starts faster, and a trainside rollout on one CPU leaves the other idle."""


def recipe_path(*parts: str) -> str:
    """A recipe file under ``recipes/``, e.g. ``recipe_path("ar", "tiny", "char_grpo_direct.yaml")``."""
    return str(RECIPES.joinpath(*parts))


def load(recipe: str, storage: Any, run_name: str, *overrides: str, experiment: str = "tests") -> Any:
    """The recipe with a run name, a storage path (also the MLflow store's folder) and an experiment."""
    from unirl_ray.config.recipe import load_recipe

    return load_recipe(recipe, [f"trainer.run_name={run_name}", f"trainer.storage_path={storage}",
                                f"tracking.experiment_name={experiment}", *overrides])


def make(cls: type, recipe: str, storage: Any, run_name: str, *overrides: str, experiment: str = "tests") -> Any:
    """A trainer of class ``cls`` over :func:`load`'s recipe."""
    return cls(load(recipe, storage, run_name, *overrides, experiment=experiment))


def fit(cls: type, recipe: str, storage: Any, run_name: str, *overrides: str, **kwargs: Any) -> Any:
    """:func:`make` then ``fit()``; returns the trainer (its tracker still names the MLflow run)."""
    trainer = make(cls, recipe, storage, run_name, *overrides, **kwargs)
    trainer.fit()
    return trainer


# ------------------------------------------------------------------ MLflow
def _metric_history(trainer: Any, key: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    return MlflowClient(trainer.tracker.tracking_uri).get_metric_history(trainer.tracker.run_id, key)


def history(trainer: Any, key: str) -> list[float]:
    """The values of a metric of the trainer's MLflow run, in step order."""
    return [m.value for m in sorted(_metric_history(trainer, key), key=lambda m: m.step)]


def logged(trainer: Any, key: str) -> dict[int, float]:
    """``{step: value}`` of a metric of the trainer's MLflow run (the last value where a step has two)."""
    return {m.step: m.value for m in sorted(_metric_history(trainer, key), key=lambda m: m.timestamp)}


def attempts(trainer: Any, key: str) -> dict[int, list[float]]:
    """``{step: [values in logging order]}``: a step replayed after a restart has two."""
    out: dict[int, list[float]] = {}
    for m in sorted(_metric_history(trainer, key), key=lambda m: m.timestamp):
        out.setdefault(m.step, []).append(m.value)
    return out


def artifacts(trainer: Any, folder: str | None = None) -> list[str]:
    """Artifact paths of the trainer's MLflow run (under ``folder``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(trainer.tracker.tracking_uri)
    return [a.path for a in client.list_artifacts(trainer.tracker.run_id, folder)]


# ------------------------------------------------------------------ driving a rank or a trainer by hand
def sample_table(trainer: Any, path: str) -> dict[str, Any]:
    """A JSON artifact (an MLflow table: ``columns`` and ``data``) of the trainer's MLflow run."""
    import json

    from mlflow.tracking import MlflowClient

    local = MlflowClient(trainer.tracker.tracking_uri).download_artifacts(trainer.tracker.run_id, path)
    with open(local) as f:
        return json.load(f)


def rollout_requests(prompt: str, n: int = 2, prefix: str = "s1") -> list[dict[str, Any]]:
    """``n`` rollout requests of one group for ``prompt``, as a trainer sends them to a rank's ``generate``
    (sample ids ``<prefix>-<i>``, seed ``i``, one group seed)."""
    return [{"sample_id": f"{prefix}-{i}", "group_id": "g0", "prompt": prompt, "columns": {}, "seed": i,
             "group_seed": 0} for i in range(n)]


def drive(trainer: Any, steps: int, check: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """setup, ``steps`` steps (metrics logged to MLflow; ``check(step, metrics)`` after setup with step 0
    and after each step), teardown with the run's status; returns every step's metrics."""
    status, out = "FAILED", []
    try:
        start = trainer.setup()
        assert start == 0, f"expected a fresh run, resumed at step {start}"
        if check is not None:
            check(0, {})
        for step in range(1, steps + 1):
            metrics = trainer.run_step(step)
            trainer.tracker.log_metrics(metrics, step=step)
            out.append(metrics)
            if check is not None:
                check(step, metrics)
        status = "FINISHED"
    finally:
        trainer.teardown(status)
    return out


def record_training(trainer: Any) -> list[tuple[int, int, list[tuple[str, int]]]]:
    """Wrap ``trainer.train``: (step, trainer weights version, [(sample_id, sample version)]) per call; a
    step replayed after a worker-group restart is recorded again."""
    seen, original = [], trainer.train

    def train(samples, *, seed):
        seen.append((trainer.prompt_log[-1][0], trainer.policy_version,
                     [(s.sample_id, s.policy_version) for s in samples]))
        return original(samples, seed=seed)

    trainer.train = train
    return seen


def copy_run(trainer: Any, dest: Path) -> Path:
    """The storage folder of a live run copied to ``dest`` as it stands between two checkpoints: the run
    folder (every checkpoint committed so far) and the MLflow store (a consistent SQLite backup, its artifact locations moved to
    ``dest``). A later fit of the same run name on ``dest`` resumes from the last of those checkpoints in a
    copy of the MLflow run: what a job stopped there and started again sees, without a run of its own.

    Call it while the run trains a step (no save in flight): it waits for the last checkpoint's commit and
    for the queued metric writes first."""
    import shutil
    import sqlite3
    from contextlib import closing

    trainer.group.wait_committed()
    trainer.tracker.flush()
    src = Path(trainer.run_cfg.storage_path).resolve()
    dest = Path(dest).resolve()
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("mlflow.db", "mlflow.db-*"))
    with closing(sqlite3.connect(src / "mlflow.db")) as db, closing(sqlite3.connect(dest / "mlflow.db")) as copy:
        db.backup(copy)
        with copy:
            for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
                copy.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?)", (str(src), str(dest)))
    return dest


# ------------------------------------------------------------------ faults
def kill_rank(trainer: Any, rank: int) -> int:
    """SIGKILL one train worker process (as a crash would); returns its pid.

    A checkpoint still uploading (asynchronous saves, the default) is committed first: the restart then
    loads the checkpoint the test expects, however fast the steps after the save were."""
    trainer.group.wait_committed()
    pid = trainer.group.call("ping", {})[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_engine_replica(engine: Any) -> int:
    """SIGKILL a dedicated engine's first replica process; returns its pid."""
    pid = engine.status()[0]["replica"]
    os.kill(pid, signal.SIGKILL)
    return pid


# ------------------------------------------------------------ without Ray
class InProcessGroup:
    """One rank, commands and results pickled as ``TrainGroup.call`` carries them."""

    world_size = 1

    def __init__(self, rank: Any) -> None:
        self.rank = rank

    def call(self, op: str, payloads: Any) -> list[Any]:
        import pickle

        from unirl_ray.runtime.operations import dispatch

        payloads = payloads if isinstance(payloads, list) else [payloads]
        return [pickle.loads(pickle.dumps(dispatch(self.rank, op, pickle.loads(pickle.dumps(p))))) for p in payloads]


class Prompts:
    """The prompt source's contract (``next_batch``) over a list, so that no Ray Data job starts here."""

    def __init__(self, prompts: list[str]) -> None:
        self.prompts, self.offset = prompts, 0

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        rows = [{"prompt": self.prompts[(self.offset + i) % len(self.prompts)], "row_index": self.offset + i}
                for i in range(n)]
        self.offset += n
        return rows


def free_port() -> int:
    """A TCP port that nothing listens on now, on any interface (``free_ports``)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports that nothing listens on, on any interface, from 20000-29999: above Ray's worker
    ports (10002-19999), below the kernel's ephemeral range (32768-60999), from which every process that binds
    port 0 (the other test lane's Ray daemons and workers) or connects gets one, so that none takes a port
    between this check and its user's bind (a rendezvous or server would fail with EADDRINUSE; a GCS sharing its
    port with another gRPC server through SO_REUSEPORT would answer only some of its clients)."""
    import random
    import socket

    ports: list[int] = []
    rng = random.Random()
    while len(ports) < count:
        port = rng.randrange(20000, 30000)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
    return ports


# ------------------------------------------------------------------ a real head node (`ray start --head`)
HEAD_START_TIMEOUT_S = 180


def venv_bin() -> Path:
    """The folder with the venv's ``python`` and ``ray`` CLI (the head and its jobs run from it)."""
    import sys

    import pytest

    for candidate in (ROOT / ".venv" / "bin", Path(sys.executable).parent):
        if (candidate / "ray").is_file() and (candidate / "python").exists():
            return candidate
    pytest.skip("no `ray` CLI next to the venv's python")


def stop_ray_in_this_process() -> None:
    """A Ray left initialised in the test process (another module's fixture) would only compete for CPUs."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        if "ray.serve" in sys.modules:
            try:
                sys.modules["ray.serve"].shutdown()
            except Exception:  # noqa: BLE001 - best effort; ray.shutdown() ends it anyway
                pass
        ray.shutdown()


class RayHead:
    """``ray start --head --block`` in a session of its own, with its own free ports and temp dir: ``url`` (the
    dashboard, for ``ray job submit``), ``address`` (the GCS, for ``ray.init`` / ``RAY_ADDRESS``), ``env`` (the
    environment it runs in and ray CLI calls use: the venv's ``bin`` first on PATH), ``temp_dir``.

    ``ray stop --force`` would kill every Ray instance on the machine (other test processes', other users'),
    so ``stop()`` ends this head through its process (SIGTERM: Ray tears down what it started) and then kills
    what is left of its session, nothing else."""

    def __init__(self, log_path: Path) -> None:
        import subprocess
        import tempfile
        import time

        stop_ray_in_this_process()
        bin_dir = venv_bin()
        gcs_port, dash_port, client_port, agent_port = free_ports(4)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
                   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # SIGTERM to the head: tear down at once
                   PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent))
        # a short private temp dir: Ray's unix socket paths must stay short, and the head's ray_current_cluster
        # file must not make other processes' ray.init() join this head
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rayjs_", dir="/tmp"))
        self.url, self.address, self.env, self.log_path = (f"http://127.0.0.1:{dash_port}", f"127.0.0.1:{gcs_port}",
                                                           env, log_path)
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [str(bin_dir / "ray"), "start", "--head", "--block", "--num-cpus", "8", "--port", str(gcs_port),
                 "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port), "--include-dashboard", "true",
                 "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port),
                 "--object-store-memory", str(512 * 1024**2), "--temp-dir", str(self.temp_dir),
                 "--disable-usage-stats"],
                env=env, cwd=log_path.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.perf_counter()
        try:
            self._wait_for_dashboard()
        except BaseException:
            self.stop()
            raise
        print(f"ray head (dashboard {self.url}) up in {time.perf_counter() - t0:.1f}s")

    def _wait_for_dashboard(self) -> None:
        import time
        import urllib.request

        import pytest

        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"`ray start --head` exited with {self.process.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/version", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"the head's dashboard {self.url} did not answer within {HEAD_START_TIMEOUT_S}s:\n{self.logs()}")
        from unirl_ray.runtime.cluster import wait_for_cluster

        try:  # the GCS at the address a driver dials (ray.init resolves 127.0.0.1 to this node's IP)
            wait_for_cluster(self.address, timeout_s=max(5.0, deadline - time.monotonic()))
        except ConnectionError as exc:
            pytest.fail(f"the head's GCS does not answer: {exc}\n{self.logs()}")

    def logs(self, chars: int = 3000) -> str:
        """The tails of ``ray start``'s output and of the head's GCS, raylet and dashboard logs."""
        parts = [("ray start", self.log_path)]
        session = self.temp_dir / "session_latest" / "logs"
        parts += [(name, session / name) for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err",
                                                      "dashboard.log", "dashboard.err")]
        out = []
        for name, path in parts:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                out.append(f"---- {name} (last {chars} characters) ----\n{text[-chars:]}")
        return "\n".join(out) or "(no logs of the head found)"

    def members(self) -> list[int]:
        """Pids in the head's session (the one ``start_new_session`` made)."""
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.process.pid and fields[0] != "Z":  # after "pid (comm)": state ppid pgrp session
                members.append(int(stat.parent.name))
        return members

    def stop(self) -> None:
        """End the head and everything it spawned; AssertionError if a process of its session survives."""
        import shutil
        import subprocess
        import time

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # ray start --block: tear down its processes
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        for pid in self.members():  # stragglers of this head's session only
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 30
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not self.members(), "processes of the test's Ray head survived its shutdown"
