"""MLflow tracking for the driver: params, metrics, the resolved recipe, sample images and tables.

Without a tracking URI (config or ``MLFLOW_TRACKING_URI``) the store is a local SQLite DB in the run
folder, with artifacts beside it, so ``mlflow ui`` shows it (``MLflowTracker.ui_command``).

Tracking must never stop training. A failure of the backend (server down, bad store, any
exception) logs one warning per outage; from then on params and metrics are appended as JSON lines
to ``<run_root>/<run_name>/mlflow_fallback.jsonl`` (and kept in memory, up to ``MAX_PENDING``
records), artifacts are written under ``<run_root>/<run_name>/fallback_artifacts/``. Every
``TrackingConfig.retry_interval_s`` the tracker tries MLflow again; when it answers, the buffered
params and metrics are sent to the run (artifacts written meanwhile stay local) and logging goes
to MLflow again. No ``log_*`` call raises. For an HTTP store, MLflow's own retries and timeouts are
made short (``HTTP_ENV_DEFAULTS``, only where the environment does not set them), so one call to a
dead server returns within seconds instead of MLflow's minutes of back-off.

All calls go through an ``MlflowClient`` with the explicit run id (no global active run), under a
lock, so the tracker can be used from several driver threads.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
import re
import shutil
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_MAX_KEY_CHARS = 250
_MAX_PARAM_VALUE_CHARS = 6000
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /:]")
FALLBACK_FILE = "mlflow_fallback.jsonl"
"""Name of the JSON-lines file (in ``<run_root>/<run_name>/``) params and metrics go to while MLflow is down."""
MAX_PENDING = 100_000
"""Params/metrics records kept in memory for MLflow while it is down (older ones stay in the file only)."""
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}
"""MLflow HTTP settings applied by ``start`` unless already set: a dead server costs seconds, not minutes."""


MAX_QUEUED_WRITES = 256
"""Metric writes the background writer may be behind by before ``log_metrics`` waits for room."""
FLUSH_TIMEOUT_S = 120.0
"""Longest ``flush()`` (and so ``end()``) waits for queued metric writes."""
MAX_BATCHED_STEPS = 100
"""Most steps' metrics the background writer sends together (``TrackingConfig.metrics_batch_s``), in calls of
at most MLflow's batch limit (1000 metrics)."""


_STOP = object()  # the writer's end (``None`` on the queue)


class _StepMetrics:
    """One step's metrics queued for the background writer, which sends consecutive ones together."""

    __slots__ = ("record",)

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record


@dataclass(kw_only=True)
class TrackingConfig:
    """Where and what to track in MLflow."""

    experiment_name: str = "unirl_ray"
    """MLflow experiment the run goes to (created when missing)."""
    tracking_uri: str | None = None
    """Tracking store; None: env MLFLOW_TRACKING_URI, else ``sqlite:///<run_root>/mlflow.db``."""
    artifact_location: str | None = None
    """Artifact root of a new experiment; None: ``<run_root>/mlartifacts`` for a SQLite store."""
    log_samples_every: int = 5
    """Log sample images/text tables every this many steps (0: never)."""
    enabled: bool = True
    """False turns every call into a no-op."""
    retry_interval_s: float = 60.0
    """While MLflow is unreachable, try it again at most this often (seconds) and send it the buffered params and metrics; 0: stay local for the rest of the run."""
    background_metrics: bool = True
    """Step metrics are written by one background thread of the driver, in order, so a step never waits for
    the store (a local SQLite write is ~15 ms per step). Ending the run, reading ``degraded`` / ``pending``
    and ``flush()`` wait for the queued ones. False: every ``log_metrics`` writes before it returns."""
    metrics_batch_s: float = 1.0
    """The background writer sends the steps' metrics logged within this many seconds together, in as few MLflow
    calls as its limit of 1000 metrics per call allows (one store transaction for several steps: about a third
    of the driver's CPU per step of a call per step); the charts lag by at most this much. 0: one call per step."""

    def __post_init__(self) -> None:
        if not self.retry_interval_s >= 0:
            raise ValueError(
                f"tracking.retry_interval_s must be >= 0 seconds (0: never retry), got {self.retry_interval_s}"
            )
        if self.log_samples_every < 0:
            raise ValueError(
                "tracking.log_samples_every must be >= 0 (0 disables samples),"
                f" got {self.log_samples_every}"
            )
        if not self.experiment_name:
            raise ValueError("tracking.experiment_name must not be empty")
        if not 0 <= self.metrics_batch_s <= 60:
            raise ValueError(f"tracking.metrics_batch_s must be between 0 and 60 seconds, got {self.metrics_batch_s}")


def is_uri(path: str | Path) -> bool:
    """Whether a storage path is remote (``s3://``, ``gs://``, ``abfss://`` ...), not a local folder."""
    return "://" in str(path)


def check_tracking_store(config: TrackingConfig, run_root: str | Path) -> None:
    """ValueError when the default store cannot exist: a SQLite file cannot live in remote storage."""
    if config.enabled and is_uri(run_root) and not config.tracking_uri and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ValueError(
            f"trainer.storage_path={run_root} is remote storage, where MLflow's default SQLite store cannot live. "
            "Give the store: tracking.tracking_uri=http://<mlflow-server>:5000 (or sqlite:////<shared>/mlflow.db "
            "on a file system every node mounts), or set MLFLOW_TRACKING_URI; or tracking.enabled=false. "
            "The run's artifacts then go next to its checkpoints, under <storage_path>/mlartifacts"
        )


def resolve_tracking_uri(config: TrackingConfig, run_root: str | Path) -> str:
    """The config's URI, else env ``MLFLOW_TRACKING_URI``, else a SQLite DB in ``run_root`` (a local
    folder; remote storage needs one of the first two: ``check_tracking_store``)."""
    if config.tracking_uri:
        return config.tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    check_tracking_store(config, run_root)
    return f"sqlite:///{Path(run_root).resolve() / 'mlflow.db'}"


def mlflow_cli() -> str:
    """The ``mlflow`` command of this interpreter's environment (a bare ``mlflow`` may be another one, or none)."""
    exe = Path(sys.executable).parent / "mlflow"
    return str(exe) if exe.is_file() else "mlflow"


def _local_root(run_root: str | Path) -> Path:
    """Where the tracker keeps its local files (the fallback log when the server is down): the run root
    itself, or for remote storage a folder in the user's cache named after it (never a folder "s3:")."""
    if not is_uri(run_root):
        return Path(run_root).resolve()
    scheme, _, rest = str(run_root).partition("://")
    return cache_root() / "tracking" / scheme / rest.strip("/")


def cache_root() -> Path:
    """This project's folder in the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unirl_ray"


def seed_sqlite_store(tracking_uri: str) -> bool:
    """Start a new local SQLite store as a copy of an empty, migrated one; True if it did.

    MLflow builds a new SQLite store by running its whole schema history (dozens of migrations: seconds
    of CPU on a small machine, before the first step of every new run folder). The empty store is built
    that way once per MLflow version, in the user's cache, and copied; the copy is the same schema and
    the same alembic revision, so MLflow opens it as its own. Only a ``sqlite:///`` file that does not
    exist yet is touched; the copy appears atomically (a concurrent opener sees no file or a whole one).
    Any failure leaves the job to MLflow as before.
    """
    if not str(tracking_uri).startswith("sqlite:///"):
        return False
    target = Path(str(tracking_uri)[len("sqlite:///"):])
    if target.exists() or not target.parent.is_dir():
        return False
    try:
        import sqlite3

        import mlflow

        template = cache_root() / "mlflow" / f"empty-{mlflow.__version__}.db"
        if not template.exists():
            template.parent.mkdir(parents=True, exist_ok=True)
            building = template.with_name(f"{template.name}.{os.getpid()}.{threading.get_ident()}")
            from mlflow import MlflowClient

            MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments(max_results=1)  # migrates
            os.replace(building, template)
        partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
        shutil.copyfile(template, partial)
        with closing(sqlite3.connect(partial)) as db, db:  # the default experiment as MLflow makes it: here, now
            now = int(time.time() * 1000)
            db.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                       "WHERE experiment_id = 0", (str(Path.cwd() / "mlruns" / "0"), now, now))
        try:
            os.link(partial, target)  # fails if another process made the store meanwhile: keep theirs
        except FileExistsError:
            return False
        finally:
            partial.unlink(missing_ok=True)
        return True
    except Exception as exc:  # noqa: BLE001 - MLflow builds the store itself then
        logger.debug("seeding the new MLflow store %s failed (MLflow builds it): %s", target, exc)
        return False


def _set_env_defaults() -> None:
    """No telemetry, and short HTTP timeouts / retries unless the user set their own."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for key, value in HTTP_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def sanitize_key(key: str) -> str:
    """Make ``key`` a valid MLflow metric/param name: bad characters -> ``_``, no empty segments."""
    text = _BAD_KEY_CHARS.sub("_", str(key))
    parts = [p for p in text.split("/") if p not in ("", ".", "..")]
    return "/".join(parts)[:_MAX_KEY_CHARS] or "_"


def image_grid(images: Sequence[np.ndarray]) -> Any:
    """Tile HxWx3 images (uint8, or float in [0, 1]) into one PIL image, row-major, 2 px apart."""
    from PIL import Image

    arrays = [_to_uint8_rgb(img) for img in images]
    cols = math.ceil(math.sqrt(len(arrays)))
    rows = math.ceil(len(arrays) / cols)
    cell_h = max(a.shape[0] for a in arrays)
    cell_w = max(a.shape[1] for a in arrays)
    pad = 2
    grid = Image.new("RGB", (cols * (cell_w + pad) - pad, rows * (cell_h + pad) - pad), "white")
    for index, array in enumerate(arrays):
        row, col = divmod(index, cols)
        grid.paste(Image.fromarray(array), (col * (cell_w + pad), row * (cell_h + pad)))
    return grid


def _to_uint8_rgb(image: np.ndarray) -> np.ndarray:
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise ValueError(f"expected an HxWx3 image, got shape {array.shape}")
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    array = array[:, :, :3]
    if array.dtype != np.uint8:
        array = np.clip(np.nan_to_num(array.astype(np.float32)) * 255.0, 0, 255).round()
        array = array.astype(np.uint8)
    return np.ascontiguousarray(array)


def _dump_dict(dictionary: Mapping[str, Any], artifact_file: str) -> str:
    if artifact_file.endswith(".json"):
        return json.dumps(dictionary, indent=2, default=str)
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(dictionary, default=str)), sort_keys=False)


class MLflowTracker:
    """Logs one training run to MLflow, degrading to local files if the backend fails."""

    def __init__(self, config: TrackingConfig | None = None) -> None:
        self.config = config or TrackingConfig()
        self._client: Any = None
        self._run_id: str | None = None
        self._tracking_uri: str | None = None
        self._local_dir: Path | None = None
        self._artifact_root: str | None = None  # remote storage: the default artifact location goes there
        self._degraded = False
        self._ended = False
        self._logged_params: dict[str, str] = {}
        self._warned_non_finite: set[str] = set()
        self._lock = threading.RLock()
        self._open_args: tuple[Path, str, str | None, dict[str, Any]] | None = None
        self._pending: deque[dict[str, Any]] = deque(maxlen=MAX_PENDING)
        self._dropped = 0
        self._next_retry = 0.0
        self._fallback_warned = False
        self._opened = False
        self._writes: queue.Queue | None = None  # background metric writes (config.background_metrics)
        self._writer: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def prepare(self, run_root: str) -> None:
        """Open the store and its experiment ahead of ``start`` (a new SQLite store runs its schema
        migrations here, seconds on a small machine), e.g. while the train workers start. Never raises:
        a store that fails here is retried, and degraded if need be, by ``start``."""
        if not self.config.enabled:
            return
        _set_env_defaults()
        try:
            from mlflow import MlflowClient

            root = _local_root(run_root)
            root.mkdir(parents=True, exist_ok=True)
            self._artifact_root = str(run_root) if is_uri(run_root) else None
            uri = resolve_tracking_uri(self.config, run_root)
            seed_sqlite_store(uri)
            self._experiment_id(root, MlflowClient(tracking_uri=uri))
        except Exception as exc:  # noqa: BLE001 - start() reports what is still wrong
            logger.debug("preparing the MLflow store failed (start() retries): %s", exc)

    def start(
        self,
        run_root: str,
        run_name: str,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Open (or, with ``run_id``, resume) the run; return its id ("" if off or failed)."""
        if not self.config.enabled:
            return ""
        _set_env_defaults()
        self._tracking_uri = resolve_tracking_uri(self.config, run_root)  # ValueError: no store for remote storage
        root = _local_root(run_root)
        root.mkdir(parents=True, exist_ok=True)
        seed_sqlite_store(self._tracking_uri)
        self._artifact_root = str(run_root) if is_uri(run_root) else None
        self._local_dir = root / run_name
        self._degraded = self._ended = False
        self._open_args = (root, run_name, run_id, dict(tags or {}))
        self._pending.clear()
        with self._lock:
            self._opened = False
            try:
                self._run_id = self._open_run(root, run_name, run_id, tags or {})
                self._opened = True
            except Exception as exc:  # noqa: BLE001 - tracking must not stop training
                self._run_id = run_id
                self._degrade("start", exc)
        return self._run_id or ""

    def _open_run(
        self, root: Path, run_name: str, run_id: str | None, tags: Mapping[str, Any]
    ) -> str:
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self._tracking_uri)
        experiment_id = self._experiment_id(root)
        str_tags = {str(k): str(v) for k, v in tags.items()}
        if run_id and self._resume(run_id, str_tags):
            return run_id
        run = self._client.create_run(experiment_id, run_name=run_name, tags=str_tags)
        self._logged_params = {}
        logger.info(
            "MLflow run %s at %s; view with: %s",
            run.info.run_id,
            self._tracking_uri,
            self.ui_command,
        )
        return run.info.run_id

    def _experiment_id(self, root: Path, client: Any = None) -> str:
        client = client or self._client
        name = self.config.experiment_name
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment.experiment_id)
            return experiment.experiment_id
        location = self.config.artifact_location
        if location is None and str(client.tracking_uri).startswith("sqlite:"):
            location = f"{self._artifact_root.rstrip('/')}/mlartifacts" if self._artifact_root else (root / "mlartifacts").as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
        except Exception:  # another process (or prepare() in a thread) may have created it meanwhile
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _resume(self, run_id: str, tags: Mapping[str, str]) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(run_id)
        except MlflowException as exc:
            logger.warning(
                "MLflow run %s not found in %s (%s); starting a new run",
                run_id,
                self._tracking_uri,
                exc,
            )
            return False
        self._client.update_run(run_id, status="RUNNING")
        for key, value in tags.items():
            self._client.set_tag(run_id, key, value)
        self._logged_params = dict(run.data.params)
        logger.info("resumed MLflow run %s at %s", run_id, self._tracking_uri)
        return True

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run ended (``FINISHED``, ``FAILED`` or ``KILLED``); later logs are dropped."""

        def call() -> None:
            self._client.set_terminated(self._run_id, status=status)

        self.flush()
        self._stop_writer()
        with self._lock:
            if self._degraded and self.config.retry_interval_s > 0:
                self._next_retry = 0.0  # one last try to deliver the buffered records
            self._guarded("end", call, lambda: self._append_jsonl({"end": status, "time": time.time()}))
            self._ended = True

    # ------------------------------------------------------------------ properties

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (None before ``start`` or when disabled)."""
        return self._run_id

    @property
    def tracking_uri(self) -> str | None:
        """The tracking store in use (None before ``start``)."""
        return self._tracking_uri

    @property
    def ui_command(self) -> str:
        """How to look at this run: an ``mlflow ui`` command for a local store, else the URL."""
        uri = self._tracking_uri or ""
        if uri.startswith(("http://", "https://", "databricks")):
            return f"open {uri} in a browser"
        return f"{mlflow_cli()} ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"

    @property
    def degraded(self) -> bool:
        """True once the backend failed and logging goes to the local fallback files (after the queued writes)."""
        self.flush()
        return self._degraded

    @property
    def fallback_metrics_path(self) -> Path | None:
        """``<run_root>/<run_name>/mlflow_fallback.jsonl`` (None before ``start``)."""
        return self._local_dir / FALLBACK_FILE if self._local_dir else None

    @property
    def pending(self) -> int:
        """Params/metrics records waiting for MLflow to come back (after the queued writes)."""
        self.flush()
        return len(self._pending)

    def should_log_samples(self, step: int) -> bool:
        """Whether ``step`` is a sample-logging step (every ``log_samples_every`` steps)."""
        every = self.config.log_samples_every
        return self.config.enabled and every > 0 and step % every == 0

    # ------------------------------------------------------------------ logging

    def log_params(self, flat: Mapping[str, Any]) -> None:
        """Log flat params in batches of 100; ones already on a resumed run are skipped."""
        params = {sanitize_key(k): str(v)[:_MAX_PARAM_VALUE_CHARS] for k, v in flat.items()}
        changed = sorted(
            k for k, v in params.items() if k in self._logged_params and self._logged_params[k] != v
        )
        if changed:
            logger.warning(
                "MLflow params cannot change within a run; keeping old values of %s", changed
            )
        fresh = {k: v for k, v in params.items() if k not in self._logged_params}

        def call() -> None:
            from mlflow.entities import Param

            items = list(fresh.items())
            for start in range(0, len(items), _PARAMS_PER_BATCH):
                batch = [Param(k, v) for k, v in items[start : start + _PARAMS_PER_BATCH]]
                self._client.log_batch(self._run_id, params=batch)
                self._logged_params.update((p.key, p.value) for p in batch)

        if fresh:
            record = {"params": fresh}
            self._guarded("log_params", call, lambda: self._append_jsonl(record), pending=record)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log scalar metrics at ``step`` (non-numeric ones are skipped). Non-finite values are logged as
        they are (MLflow keeps NaN; it stores +-inf as the largest float), counted in
        ``health/non_finite_metrics`` and warned about once per key: a chart never goes silently empty."""
        clean: dict[str, float] = {}
        non_finite = 0
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                logger.debug("metric %s=%r is not a number; skipped", key, value)
                continue
            if not math.isfinite(number):
                non_finite += 1
                if key not in self._warned_non_finite:
                    self._warned_non_finite.add(key)
                    logger.warning("metric %s is %r at step %d (logged as such; later ones are only counted in "
                                   "health/non_finite_metrics)", key, number, step)
            clean[sanitize_key(key)] = number
        if non_finite:
            clean["health/non_finite_metrics"] = float(non_finite)
        if not clean:
            return
        record = {"step": int(step), "time": time.time(), "metrics": clean}
        if self.config.background_metrics and self.config.enabled and not self._ended:
            self._in_background(record)
        else:
            self._write_metrics([record])

    def _write_metrics(self, records: list[dict[str, Any]]) -> None:
        """Send ``log_metrics`` records (in order) to MLflow in as few calls as its batch limit allows (whole
        records per call; a record wider than the limit in pieces of its own); while it is down, the records
        not sent yet go to the local fallback file (and the buffer that is sent when it answers again)."""
        unsent = list(records)  # the calls drop what MLflow took: only the rest is buffered and written locally

        def call() -> None:
            while unsent:
                del unsent[: self._send_metric_records(unsent)]

        def fallback() -> None:
            for record in unsent:
                self._append_jsonl(record)

        self._guarded("log_metrics", call, fallback, pending=unsent)

    # ------------------------------------------------------------------ background writes
    def _in_background(self, record: dict[str, Any]) -> None:
        """Queue a step's metrics for the writer thread (started on first use). A full queue (the store is far
        behind) makes the caller wait for room, at most ``FLUSH_TIMEOUT_S``: memory stays bounded, and a
        writer stuck in a write costs this record its MLflow copy, not the run: it goes to the local
        fallback file (without the lock, which the stuck write holds)."""
        if self._writer is None or not self._writer.is_alive():
            self._writes = queue.Queue(maxsize=MAX_QUEUED_WRITES)
            self._writer = threading.Thread(target=self._write_loop, args=(self._writes, self.config.metrics_batch_s),
                                            name="unirl-mlflow-writer", daemon=True)
            self._writer.start()
        try:
            self._writes.put(_StepMetrics(record), timeout=FLUSH_TIMEOUT_S)
        except queue.Full:
            logger.warning("MLflow metric writes are %d behind for %.0fs; step %s goes to %s", MAX_QUEUED_WRITES,
                           FLUSH_TIMEOUT_S, record.get("step"), self.fallback_metrics_path)
            try:
                self._append_jsonl(record)
            except OSError as exc:
                logger.warning("cannot write the local tracking fallback: %s", exc)

    def _write_loop(self, writes: queue.Queue, batch_s: float) -> None:
        """Write the queued step metrics in order: held for up to ``batch_s`` after the first of them (at most
        ``MAX_BATCHED_STEPS`` steps) and sent together; a flush marker (a ``threading.Event``, set once what
        came before it is written) or the end (``None``) sends them at once."""
        batch: list[dict[str, Any]] = []
        due = 0.0
        while True:
            try:
                item = writes.get(timeout=max(0.0, due - time.monotonic())) if batch else writes.get()
            except queue.Empty:  # the batch is due
                item = None
            else:
                if isinstance(item, _StepMetrics):
                    if not batch:
                        due = time.monotonic() + batch_s
                    batch.append(item.record)
                    if len(batch) < MAX_BATCHED_STEPS and time.monotonic() < due:
                        continue
                    item = None
                elif item is None:
                    item = _STOP
            if batch:
                try:
                    self._write_metrics(batch)
                except Exception:  # noqa: BLE001 - _guarded already degrades; never lose the writer thread
                    logger.exception("a background MLflow write failed")
                batch = []
            if item is None:
                continue
            if item is _STOP:
                return
            item.set()  # a flush marker: everything before it is written

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued metric write is done (at most ``timeout_s``); False if it timed out."""
        writer, writes = self._writer, self._writes
        if writer is None or writes is None or not writer.is_alive() or threading.current_thread() is writer:
            return True
        marker = threading.Event()
        started = time.monotonic()
        try:
            writes.put(marker, timeout=timeout_s)
        except queue.Full:
            pass
        else:
            if marker.wait(max(0.0, timeout_s - (time.monotonic() - started))):
                return True
        logger.warning("MLflow metric writes queued in this process did not finish within %.0fs", timeout_s)
        return False

    def _stop_writer(self) -> None:
        writer, writes = self._writer, self._writes
        if writer is not None and writes is not None and writer.is_alive():
            try:
                writes.put(None, timeout=FLUSH_TIMEOUT_S)
                writer.join(timeout=FLUSH_TIMEOUT_S)
            except queue.Full:  # a writer stuck in a write: it is a daemon thread, and the run ends without it
                logger.warning("the MLflow metric writer is stuck; ending the run without waiting for it")
        self._writer = self._writes = None

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file`` (e.g. ``recipe.yaml``)."""
        self._guarded(
            "log_text",
            lambda: self._client.log_text(self._run_id, text, artifact_file),
            lambda: self._write_local(artifact_file, text),
        )

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """Store a dict as a JSON (``.json``) or YAML (other suffixes) artifact."""
        self._guarded(
            "log_dict",
            lambda: self._client.log_dict(self._run_id, dict(dictionary), artifact_file),
            lambda: self._write_local(artifact_file, _dump_dict(dictionary, artifact_file)),
        )

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        """Store columns of equal length as an MLflow table artifact (``.json``)."""
        self._guarded(
            "log_table",
            lambda: self._client.log_table(
                self._run_id, data=dict(data), artifact_file=artifact_file
            ),
            lambda: self._write_local(artifact_file, json.dumps(dict(data), default=str)),
        )

    def log_images(
        self, step: int, images: Sequence[np.ndarray], captions: Sequence[str], key: str = "samples"
    ) -> None:
        """Log one grid image of ``images`` at ``step`` (``key``) and their captions as a table
        ``<key>/step_{step:06d}.json``."""
        if not images:
            return
        captions = [str(c) for c in captions][: len(images)]
        if len(captions) < len(images):
            logger.warning("log_images got %d captions for %d images", len(captions), len(images))
            captions += [""] * (len(images) - len(captions))
        try:
            grid = image_grid(images)
        except Exception as exc:  # noqa: BLE001 - bad images must not stop training
            logger.warning("cannot make an image grid at step %d: %s", step, exc)
            return
        table = {
            "step": [int(step)] * len(images),
            "index": list(range(len(images))),
            "caption": captions,
        }
        table_file = f"{key}/step_{step:06d}.json"

        def call() -> None:
            self._client.log_image(self._run_id, grid, key=sanitize_key(key), step=int(step))
            self._client.log_table(self._run_id, data=table, artifact_file=table_file)

        def fallback() -> None:
            self._write_local(table_file, json.dumps(table))
            path = self._fallback_path(f"{key}/step_{step:06d}.png")
            grid.save(path)

        self._guarded("log_images", call, fallback)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        """Log every file under ``local_dir`` to ``artifact_path`` of the run (or copy it into the
        local fallback folder when MLflow is unavailable)."""

        def call() -> None:
            self._client.log_artifacts(self._run_id, str(local_dir), artifact_path=artifact_path)

        def fallback() -> None:
            shutil.copytree(local_dir, self._fallback_path(artifact_path), dirs_exist_ok=True)

        self._guarded("log_artifacts", call, fallback)

    # ------------------------------------------------------------------ resilience

    def _guarded(
        self,
        what: str,
        call: Callable[[], None],
        fallback: Callable[[], None],
        pending: dict[str, Any] | list[dict[str, Any]] | None = None,
    ) -> None:
        """Run ``call`` against MLflow; on any failure degrade and use ``fallback`` (and buffer
        ``pending``, a params/metrics record or a list of them, for when MLflow comes back)."""
        if not self.config.enabled or self._ended:
            return
        if self._local_dir is None:
            logger.warning("MLflowTracker.%s called before start(); ignored", what)
            return
        with self._lock:
            if self._degraded:
                self._maybe_reconnect()
            if not self._degraded and self._run_id is not None:
                try:
                    call()
                    return
                except Exception as exc:  # noqa: BLE001 - tracking must not stop training
                    self._degrade(what, exc)
            for record in [pending] if isinstance(pending, dict) else pending or []:
                self._dropped += len(self._pending) == self._pending.maxlen
                self._pending.append(record)
            try:
                fallback()
            except Exception as exc:  # noqa: BLE001
                if not self._fallback_warned:
                    logger.warning("cannot write the local tracking fallback (%s): %s", what, exc)
                self._fallback_warned = True

    def _degrade(self, what: str, exc: BaseException) -> None:
        if not self._degraded:
            retry = self.config.retry_interval_s
            logger.warning(
                "MLflow tracking at %s failed in %s (%s: %s); training continues, params and metrics"
                " go to %s%s",
                self._tracking_uri,
                what,
                type(exc).__name__,
                str(exc)[:300],
                self.fallback_metrics_path,
                f" and are sent to MLflow when it answers again (retried every {retry:g}s)" if retry else "",
            )
            self._next_retry = time.monotonic() + retry
        self._degraded = True

    def _maybe_reconnect(self) -> None:
        """Every ``retry_interval_s``: reopen the run if needed, flush the buffer, leave degraded mode."""
        interval = self.config.retry_interval_s
        if interval <= 0 or self._open_args is None or time.monotonic() < self._next_retry:
            return
        self._next_retry = time.monotonic() + interval
        try:
            if not self._opened:
                self._run_id = self._open_run(*self._open_args)
                self._opened = True
            else:
                self._client.get_run(self._run_id)  # a cheap probe
            sent = self._flush_pending()
        except Exception as exc:  # noqa: BLE001 - still down: stay local until the next retry
            logger.debug("MLflow at %s still unavailable: %s", self._tracking_uri, exc)
            return
        self._degraded = False
        lost = f"; {self._dropped} older records are only in {self.fallback_metrics_path}" if self._dropped else ""
        logger.warning(
            "MLflow tracking at %s is back: sent %d buffered records to run %s (artifacts logged meanwhile"
            " stay in %s)%s",
            self._tracking_uri,
            sent,
            self._run_id,
            self._local_dir / "fallback_artifacts" if self._local_dir else None,
            lost,
        )
        self._dropped = 0

    def _send_metric_records(self, records: Sequence[dict[str, Any]]) -> int:
        """Send the leading metrics records of ``records`` that fit one MLflow call (at least the first, a record
        wider than the limit in pieces of its own); how many were sent."""
        from mlflow.entities import Metric

        count, width = 0, 0
        while count < len(records) and "metrics" in records[count] and (
                count == 0 or width + len(records[count]["metrics"]) <= _METRICS_PER_BATCH):
            width += len(records[count]["metrics"])
            count += 1
        items = [Metric(k, v, int(r["time"] * 1000), int(r["step"])) for r in records[:count] for k, v in r["metrics"].items()]
        for start in range(0, len(items), _METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=items[start : start + _METRICS_PER_BATCH])
        return count

    def _flush_pending(self) -> int:
        """Send the buffered params/metrics records in order, consecutive metrics records together (an outage of
        an hour at 10 steps a second is ~36,000 records: ~1,300 calls, not one per record); each is removed once
        MLflow took it."""
        from mlflow.entities import Param

        sent = 0
        while self._pending:
            record = self._pending[0]
            if "params" in record:
                fresh = [(k, v) for k, v in record["params"].items() if k not in self._logged_params]
                for start in range(0, len(fresh), _PARAMS_PER_BATCH):
                    batch = [Param(k, v) for k, v in fresh[start : start + _PARAMS_PER_BATCH]]
                    self._client.log_batch(self._run_id, params=batch)
                    self._logged_params.update((p.key, p.value) for p in batch)
                taken = 1
            else:
                head = list(itertools.islice(self._pending, 0, _METRICS_PER_BATCH))  # (at most that many fit a call)
                taken = self._send_metric_records(head)
            for _ in range(taken):
                self._pending.popleft()
            sent += taken
        return sent

    def _append_jsonl(self, record: Mapping[str, Any]) -> None:
        path = self.fallback_metrics_path
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=str) + "\n")

    def _fallback_path(self, artifact_file: str) -> Path:
        assert self._local_dir is not None
        path = self._local_dir / "fallback_artifacts" / artifact_file
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _write_local(self, artifact_file: str, text: str) -> None:
        self._fallback_path(artifact_file).write_text(text, encoding="utf-8")
