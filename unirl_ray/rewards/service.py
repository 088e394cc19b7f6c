"""The reward service: reward sources as one Ray Serve app, and the driver-side client.

``RewardService`` runs every configured reward fn on a batch, as the body of a Serve deployment
(``build_reward_app``) or in the driver. Each fn runs in a worker thread of its own under its own deadline
(``timeout_s``), so a slow or failing source is named and the other sources' scores still come back; the
driver waits ``timeout_s`` plus a transport grace (``CLIENT_GRACE_S``) before it gives up on the whole request.
``RewardClient`` is what the trainer holds: it deploys the app (HTTP off unless asked; rule rewards run in the
client's own process instead, ``RewardConfig.placement``), splits a batch across replicas, applies the retry
and ``on_error`` policy documented in ``unirl_ray.rewards.combine``, writes ``Sample.rewards`` /
``Sample.reward`` in place and returns the step's reward metrics.

Usage on the driver::

    client = RewardClient.deploy(RewardConfig.from_dict(cfg), app_name="reward")
    metrics = client.score(samples)   # fills sample.rewards / sample.reward
    client.shutdown()
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from unirl_ray.rewards.combine import RewardConfig, RewardError, combine, reward_metrics, score_one
from unirl_ray.runtime.serve import SHUTDOWN_POLL_S, delete_apps, run_app, start_serve

if TYPE_CHECKING:  # replicas never import torch through the Sample module
    from unirl_ray.core.sample import Sample
    from ray import serve

logger = logging.getLogger(__name__)

CLIENT_GRACE_S = 2.0
"""Extra seconds the driver waits beyond ``timeout_s`` (transport, queueing) so the replica names a slow source."""
RETRY_BACKOFF_S = 1.0
"""Pause before the first retry of a failed reward request; doubled on each further retry."""
RETRY_BACKOFF_MAX_S = 10.0
"""Longest pause between two retries."""


DEPLOYMENT_OPTIONS = {"graceful_shutdown_timeout_s": 5, "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
                      "logging_config": {"enable_access_log": False}}  # no "CALL score_detailed OK" line per call
"""Serve options of every reward deployment (``build_reward_app``; replicas and resources come from the config)."""


class RewardService:
    """Runs the configured reward sources on batches: a Serve replica's body (``build_reward_app``), or the
    driver's own (``LocalRewardHandle``). Plain Python: a driver whose rewards run in it never imports Serve
    (~0.7 s of its start-up before the workers are launched)."""

    def __init__(self, config: Mapping[str, Any]):
        self._config = RewardConfig.from_dict(config)
        self._fns = {spec.name: spec.bound() for spec in self._config.specs}
        # one pool per source: calls that time out keep running (a thread cannot be killed) but only
        # ever hold their own source's threads, so a hung source never starves the healthy ones
        self._limit = max(1, min(16, self._config.max_ongoing_requests))
        self._pools = {name: ThreadPoolExecutor(max_workers=self._limit, thread_name_prefix=f"reward-{name}")
                       for name in self._fns}
        self._running = dict.fromkeys(self._fns, 0)  # calls in a thread, including abandoned ones

    def get_config(self) -> dict[str, Any]:
        """The config this replica was built from (used by ``RewardClient.connect``)."""
        return self._config.to_dict()

    def close(self) -> None:
        """Stop the sources' threads (calls running past their deadline finish in the background)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def score(
        self, images: Any, prompts: Sequence[str], columns: Mapping[str, Sequence[Any]] | None = None
    ) -> dict[str, list[float | None]]:
        """Per-source scores ``{name: [score or None]}``; raises ``RewardError`` naming a failed source."""
        out = await self.score_detailed(images, prompts, columns)
        if out["errors"]:
            name, cause = next(iter(out["errors"].items()))
            raise RewardError(name, cause)
        return out["scores"]

    async def score_detailed(
        self,
        images: Any,
        prompts: Sequence[str],
        columns: Mapping[str, Sequence[Any]] | None = None,
        names: Sequence[str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Run the sources ``names`` (default: all) concurrently; never raises for a source's failure.

        Each source gets ``timeout_s`` seconds (default: the config's) in a worker thread; a source
        that is still running then is reported as an error (its thread finishes in the background).

        Returns ``{"scores": {name: list}, "errors": {name: cause}, "timing": {name: seconds}}``.
        ``images`` is one uint8 array ``[B, ...]`` or a list of arrays (``None`` entries for text).
        """
        images = list(images) if isinstance(images, np.ndarray) else list(images)
        prompts = list(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"got {len(images)} images for {len(prompts)} prompts")
        unknown = [n for n in (names or []) if n not in self._fns]
        if unknown:
            raise ValueError(f"unknown reward source(s) {unknown}; this service has {list(self._fns)}")
        selected = list(names) if names is not None else list(self._fns)
        deadline = float(timeout_s) if timeout_s is not None else self._config.timeout_s
        results = await asyncio.gather(*(self._run_one(n, images, prompts, columns, deadline) for n in selected))
        out: dict[str, Any] = {"scores": {}, "errors": {}, "timing": {}}
        for name, (scores, error, seconds) in zip(selected, results):
            out["timing"][name] = seconds
            if error is None:
                out["scores"][name] = scores
            else:
                out["errors"][name] = error
        return out

    async def _run_one(
        self, name: str, images: list, prompts: list, columns: Any, timeout_s: float
    ) -> tuple[Any, str | None, float]:
        start = time.perf_counter()
        if self._running[name] >= self._limit:  # every thread of this source still runs a call past its deadline
            return None, (f"not started: {self._running[name]} earlier calls of this reward are still running past "
                          f"timeout_s={timeout_s:g} s (it hangs)"), 0.0
        loop = asyncio.get_running_loop()
        self._running[name] += 1
        call = self._pools[name].submit(score_one, name, self._fns[name], images, prompts, columns)
        call.add_done_callback(lambda _: self._release_from_thread(loop, name))  # when the thread is done
        future = asyncio.wrap_future(call, loop=loop)
        try:
            scores = await asyncio.wait_for(future, timeout=timeout_s)
            return scores, None, time.perf_counter() - start
        except asyncio.TimeoutError:
            cause = f"did not finish within timeout_s={timeout_s:g} s"
        except RewardError as exc:
            cause = exc.cause
        except Exception as exc:  # noqa: BLE001 - reported per source, the client applies the policy
            cause = f"{type(exc).__name__}: {exc}"
        return None, cause, time.perf_counter() - start

    def _release(self, name: str) -> None:
        self._running[name] -= 1

    def _release_from_thread(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        try:
            loop.call_soon_threadsafe(self._release, name)
        except RuntimeError:  # the replica's event loop is closed: it is shutting down, nothing left to count
            pass

    async def __call__(self, request: Any) -> dict[str, Any]:
        """HTTP: POST JSON ``{"prompts": [...], "images": [base64 PNG/JPEG, ...], "columns": {...}}``.

        Text requests leave out ``images`` and send ``columns: {"completions": [...], ...}``. An image
        may also be a ``data:image/...;base64,`` URL. A malformed request is answered with status 400
        and ``{"error": reason}`` (what is wrong and what a request looks like), never a bare 500.
        """
        try:
            images, prompts, columns = _parse_request(await _json_body(request))
        except BadRequest as exc:
            from starlette.responses import JSONResponse

            return JSONResponse({"error": str(exc)}, status_code=400)
        out = await self.score_detailed(images, prompts, columns)
        if not out["errors"]:
            out["reward"] = combine(out["scores"], self._config.weights)
        return out


class BadRequest(ValueError):
    """An HTTP request the reward app cannot score; the message says why (sent back with status 400)."""


_REQUEST_SHAPE = ('a request is a JSON object {"prompts": [str, ...], "images": [base64 PNG/JPEG or data URL, '
                  '...] (one per prompt; left out for text), "columns": {name: [value per prompt]}}')


async def _json_body(request: Any) -> Any:
    try:
        return await request.json()
    except Exception as exc:  # noqa: BLE001 - starlette raises JSONDecodeError or UnicodeDecodeError
        raise BadRequest(f"the body is not JSON ({type(exc).__name__}: {exc}); {_REQUEST_SHAPE}") from None


def _parse_request(body: Any) -> tuple[list[Any], list[str], dict[str, list[Any]] | None]:
    """``(images, prompts, columns)`` of an HTTP request body; ``BadRequest`` naming what is wrong."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"the body is a JSON {type(body).__name__}, not an object; {_REQUEST_SHAPE}")
    unknown = sorted(set(body) - {"prompts", "images", "columns"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; {_REQUEST_SHAPE}")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(f"'prompts' must be a non-empty list of strings, got {_short(prompts)}; {_REQUEST_SHAPE}")
    raw = body.get("images")
    if raw is None:
        images: list[Any] = [None] * len(prompts)
    elif not isinstance(raw, list) or len(raw) != len(prompts):
        count = f"{len(raw)} images" if isinstance(raw, list) else f"'images' of type {type(raw).__name__}"
        raise BadRequest(f"got {count} for {len(prompts)} prompts: send one image per prompt, or none for text")
    else:
        images = [_decode_image(data, i) for i, data in enumerate(raw)]
    columns = body.get("columns")
    if columns is not None:
        if not isinstance(columns, Mapping):
            raise BadRequest(f"'columns' must be an object of lists, got {_short(columns)}")
        for name, values in columns.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise BadRequest(f"column {name!r} must be a list with one value per prompt ({len(prompts)}), "
                                 f"got {_short(values)}")
    return images, prompts, columns


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _decode_image(data: Any, index: int = 0) -> np.ndarray:
    """An RGB uint8 array from base64 PNG/JPEG bytes or a ``data:image/...;base64,`` URL."""
    import binascii

    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str):
        raise BadRequest(f"image {index} is a {type(data).__name__}, not a base64 string")
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise BadRequest(f"image {index} is a data URL without ';base64,' ({_short(header)})")
    try:
        raw = base64.b64decode(data, validate=True)
        return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"image {index} is not valid base64 ({exc})") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise BadRequest(f"image {index} is not a PNG/JPEG image PIL can read ({exc})") from None


def build_reward_app(config: RewardConfig | Mapping[str, Any]) -> serve.Application:
    """The bound ``RewardService`` deployment with replicas, resources and concurrency from the config."""
    from ray import serve

    from unirl_ray.runtime.serve import serve_build

    cfg = RewardConfig.from_dict(config)
    with serve_build("the reward app"):
        return serve.deployment(**DEPLOYMENT_OPTIONS)(RewardService).options(
            num_replicas=cfg.num_replicas,
            ray_actor_options=dict(cfg.ray_actor_options),
            max_ongoing_requests=cfg.max_ongoing_requests,
        ).bind(cfg.to_dict())


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into up to ``parts`` contiguous, near-equal, non-empty slices."""
    parts = max(1, min(parts, n))
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def samples_to_inputs(samples: Sequence[Sample]) -> tuple[Any, list[str], dict[str, list[Any]]]:
    """``(images, prompts, columns)`` for the reward contract.

    Images of one shape are stacked into one uint8 array ``[B, ...]`` (one transfer); mixed shapes
    stay a list; samples without images (text) give ``None`` entries. ``columns`` are the samples'
    dataset columns, one list per key (``None`` where a sample lacks it), plus ``completions`` (the
    generated text) when the samples have text parts.
    """
    prompts = [s.prompt for s in samples]
    raw = [s.image for s in samples]
    has_image = [img is not None for img in raw]
    if any(has_image) and not all(has_image):
        missing = [s.sample_id for s, ok in zip(samples, has_image) if not ok][:5]
        raise ValueError(f"samples {missing} have no image while others do; the rollout must decode every image")
    if all(has_image) and raw:
        arrays = [np.asarray(img) for img in raw]
        same = all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays)
        images: Any = np.stack(arrays) if same else arrays
    else:
        images = [None] * len(samples)
    keys = sorted({k for s in samples for k in s.columns})
    columns = {k: [s.columns.get(k) for s in samples] for k in keys}
    if "completions" not in columns and any(p.kind == "text" for s in samples for p in s.parts):
        columns["completions"] = ["".join(getattr(p, "text", "") for p in s.parts if p.kind == "text") for s in samples]
    return images, prompts, columns


@dataclass(frozen=True)
class RewardApp:
    """One reward app: its handle, the sources it runs (its config) and its name."""

    handle: Any
    """Serve ``DeploymentHandle`` of the app's ``RewardService``, or a ``LocalRewardHandle``."""
    config: RewardConfig
    """The app's sources, replicas and resources."""
    name: str
    """Serve application name (of a local app: the name it would have in Serve)."""
    local: bool = False
    """Whether the sources run in this process (``LocalRewardHandle``) rather than in Serve replicas."""


class LocalRewardHandle:
    """A ``RewardService`` in this process, called like its Serve handle (``handle.score_detailed.remote(...)
    .result(timeout_s=...)``): the same per-source threads and deadlines as a replica, on an event loop
    thread of its own, without a replica to start or a request to send.

    Pickled (e.g. into an async trainer's rollout stage), it carries its config and builds its sources
    again in the process that unpickles it."""

    def __init__(self, config: RewardConfig | Mapping[str, Any]):
        self.config = RewardConfig.from_dict(config)
        self._service = RewardService(self.config.to_dict())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-local", daemon=True)
        self._thread.start()
        self.score_detailed = _LocalMethod(self, self._service.score_detailed)
        self.get_config = _LocalMethod(self, self._service.get_config)

    def __reduce__(self):
        return (LocalRewardHandle, (self.config.to_dict(),))

    def submit(self, method: Any, args: tuple, kwargs: dict) -> _LocalResponse:
        if self._loop.is_closed():
            raise RuntimeError("this local reward app was shut down")
        if asyncio.iscoroutinefunction(method):
            return _LocalResponse(asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self._loop))
        future: Future = Future()
        future.set_result(method(*args, **kwargs))
        return _LocalResponse(future)

    def close(self) -> None:
        """Stop the event loop and the sources' threads (``RewardService.close``)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._service.close()


class _LocalMethod:
    def __init__(self, owner: LocalRewardHandle, method: Any) -> None:
        self._owner, self._method = owner, method

    def remote(self, *args: Any, **kwargs: Any) -> _LocalResponse:
        return self._owner.submit(self._method, args, kwargs)


class _LocalResponse:
    """What ``LocalRewardHandle`` calls return: ``result(timeout_s=)`` and ``cancel()``, as a Serve response."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self, timeout_s: float | None = None) -> Any:
        return self._future.result(timeout=timeout_s)  # TimeoutError when it is not done by then

    def cancel(self) -> None:
        self._future.cancel()


@dataclass
class _Unit:
    """One request slot of a scoring call: a slice of the batch for one app, and its unfinished sources."""

    app: RewardApp
    lo: int
    hi: int
    payload: tuple
    pending: list[str]


class RewardClient:
    """Driver-side handle to the deployed reward app(s), applying the failure policy.

    Sources without ``app`` share one app: in this process for rule rewards (``RewardConfig.placement``),
    else a Serve app; each source with ``app`` (e.g. a reward model that needs a GPU share) has a Serve
    app of its own. A batch is split across the replicas of every Serve app, all requests go out at
    once, and the per-source scores are combined on the driver.
    """

    def __init__(self, apps: Sequence[RewardApp], config: RewardConfig):
        if not apps:
            raise ValueError("RewardClient needs at least one reward app")
        self.apps = list(apps)
        """The deployed apps (the shared one first)."""
        self.config = config
        """The whole reward config (weights, timeout, retry policy)."""
        self.app_name = self.apps[0].name
        """Name of the first (shared) Serve application; the others are ``<app_name>-<source>``."""
        self.last_timing: dict[str, float] = {}
        """Seconds each source took in its replica during the last call (max over replicas)."""

    @classmethod
    def deploy(
        cls,
        config: RewardConfig | Mapping[str, Any],
        app_name: str = "reward",
        *,
        http_port: int | None = None,
        ready_timeout_s: float = 120.0,
    ) -> "RewardClient":
        """Run the reward app(s) and wait until ready; Serve is started (HTTP off unless ``http_port``)
        where one of them is a Serve app.

        One app ``app_name`` for the shared sources (in this process where ``config.placement`` says so,
        rule rewards by default, unless ``http_port`` asks for a route), plus the Serve app ``<app_name>-<source>`` for every source with its own
        ``app`` placement. Raises TimeoutError when the replicas do not start within
        ``ready_timeout_s`` (usually: not enough free CPUs / GPUs for ``num_replicas`` x
        ``ray_actor_options``); apps already deployed by this call are deleted again.
        """
        cfg = RewardConfig.from_dict(config)
        local = cfg.shared_runs_locally() and http_port is None  # an HTTP route is asked of a Serve app
        placements = [(suffix, sub, local and not suffix) for suffix, sub in cfg.placements()]  # (.., here)
        if not all(here for _, _, here in placements):
            start_serve(http_port)
        apps: list[RewardApp] = []
        try:
            for suffix, sub, here in placements:
                if here:
                    apps.append(RewardApp(LocalRewardHandle(sub), sub, app_name + suffix, local=True))
                else:
                    apps.append(_deploy_one(sub, app_name + suffix, http_port, ready_timeout_s))
        except BaseException:
            for app in apps:
                _close(app)
            raise
        return cls(apps, cfg)

    @classmethod
    def connect(cls, app_name: str = "reward", *, timeout_s: float = 30.0) -> "RewardClient":
        """Attach to a reward app deployed elsewhere (e.g. ``serve deploy serve_apps/reward_config.yaml``)."""
        from ray import serve

        handle = serve.get_app_handle(app_name)
        cfg = RewardConfig.from_dict(handle.get_config.remote().result(timeout_s=timeout_s))
        return cls([RewardApp(handle, cfg, app_name)], cfg)

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Score samples in place (``sample.rewards``, ``sample.reward``); return this batch's metrics.

        Metrics: ``reward/<name>/mean|std``, ``reward/mean|std``, ``reward/invalid_frac``,
        ``reward/retries``, ``reward/skipped`` (sources given up under on_error="skip"), ``timing/reward``
        (wall time on the driver) and ``timing/reward/<name>`` (time of each source in its replica).
        Blocking: call it from plain (non-async) driver code.
        """
        start = time.perf_counter()
        if not samples:
            raise ValueError("RewardClient.score got no samples")
        images, prompts, columns = samples_to_inputs(samples)
        per_source, retries, skipped = self.score_inputs(images, prompts, columns)
        totals = combine(per_source, self.config.weights)
        for i, sample in enumerate(samples):
            sample.rewards = {name: values[i] for name, values in per_source.items()}
            sample.reward = totals[i]
        metrics = reward_metrics(per_source, totals)
        metrics.update({"reward/retries": float(retries), "reward/skipped": float(skipped)})
        metrics.update({f"timing/reward/{name}": sec for name, sec in self.last_timing.items()})
        metrics["timing/reward"] = time.perf_counter() - start
        return metrics

    def score_inputs(
        self, images: Any, prompts: Sequence[str], columns: Mapping[str, Sequence[Any]] | None = None
    ) -> tuple[dict[str, list[float | None]], int, int]:
        """Per-source scores for raw inputs with retries and ``on_error``; also (retries, skipped) counts."""
        n = len(prompts)
        scores: dict[str, list[float | None]] = {spec.name: [None] * n for spec in self.config.specs}
        units = [
            _Unit(app, lo, hi, self._payload(app, images, prompts, columns, lo, hi), [s.name for s in app.config.specs])
            for app in self.apps
            for lo, hi in _split(n, 1 if app.local else app.config.num_replicas)
        ]
        causes: dict[tuple[int, str], str] = {}
        retries = 0
        self.last_timing = {}
        for attempt in range(self.config.max_retries + 1):
            if not any(u.pending for u in units):
                break
            if attempt:
                retries += sum(len(u.pending) for u in units)
                pause = min(RETRY_BACKOFF_S * 2 ** (attempt - 1), RETRY_BACKOFF_MAX_S)
                logger.warning("retrying reward source(s) %s in %.1fs (attempt %d)", _failed_names(units), pause, attempt + 1)
                time.sleep(pause)  # a dead replica: give Serve the time to route around it and replace it
            self._attempt(units, scores, causes)
        skipped = self._apply_on_error(units, causes)
        return scores, retries, skipped

    def _payload(self, app: RewardApp, images: Any, prompts: Sequence[str], columns: Any, lo: int, hi: int) -> tuple:
        part = images[lo:hi]
        # to a replica: put once, reused by retries; a local app reads the array where it is
        ref = ray.put(part) if isinstance(part, np.ndarray) and not app.local else part
        cols = {k: list(v[lo:hi]) for k, v in (columns or {}).items()}
        return ref, list(prompts[lo:hi]), cols

    def _attempt(self, units: list[_Unit], scores: dict, causes: dict) -> None:
        """One round: send every unit's pending sources, collect within one shared deadline."""
        responses = {
            ui: u.app.handle.score_detailed.remote(*u.payload, names=list(u.pending), timeout_s=self.config.timeout_s)
            for ui, u in enumerate(units) if u.pending
        }
        wait_s = self.config.timeout_s + CLIENT_GRACE_S
        deadline = time.monotonic() + wait_s
        for ui, response in responses.items():
            unit = units[ui]
            try:
                out = response.result(timeout_s=max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                response.cancel()
                for name in unit.pending:
                    causes[(ui, name)] = f"request for {unit.pending} got no answer within {wait_s:g} s (timeout_s + grace)"
                continue
            except Exception as exc:  # noqa: BLE001 - replica died, bad payload...: retried per policy
                for name in unit.pending:
                    causes[(ui, name)] = f"request to {unit.app.name!r} failed: {type(exc).__name__}: {exc}"
                continue
            for name, values in out["scores"].items():
                scores[name][unit.lo : unit.hi] = values
                unit.pending.remove(name)
            for name, seconds in out["timing"].items():
                self.last_timing[name] = max(self.last_timing.get(name, 0.0), float(seconds))
            for name, cause in out["errors"].items():
                causes[(ui, name)] = cause

    def _apply_on_error(self, units: list[_Unit], causes: dict) -> int:
        failed = [(ui, name) for ui, u in enumerate(units) for name in u.pending]
        if not failed:
            return 0
        attempts = self.config.max_retries + 1
        if self.config.on_error == "fail":
            ui, name = failed[0]
            raise RewardError(name, f"{causes.get((ui, name), 'unknown error')} (after {attempts} attempt(s))")
        for ui, name in failed:
            unit = units[ui]
            logger.warning(
                "reward %r skipped for %d sample(s) after %d attempt(s) (on_error='skip'): %s",
                name, unit.hi - unit.lo, attempts, causes.get((ui, name), "unknown error"),
            )
        return len({name for _, name in failed})

    def app_names(self) -> list[str]:
        """The Serve apps of this client (one per reward app that runs in Serve)."""
        return [app.name for app in self.apps if not app.local]

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Delete the reward app(s) (Serve itself keeps running for other apps); stop a local one."""
        for app in self.apps:
            if app.local:
                app.handle.close()
        delete_apps(self.app_names(), timeout_s=timeout_s)


def _deploy_one(cfg: RewardConfig, app_name: str, http_port: int | None, ready_timeout_s: float) -> RewardApp:
    """Run one ``RewardService`` app and wait until it answers; TimeoutError naming the resources."""
    app = build_reward_app(cfg)
    route = f"/{app_name}" if http_port is not None else None
    try:
        handle = run_app(app, app_name, route_prefix=route, timeout_s=ready_timeout_s)
    except TimeoutError:
        _delete_quietly(app_name)
        raise TimeoutError(
            f"reward app {app_name!r} was not ready within {ready_timeout_s} s: it needs {cfg.num_replicas} "
            f"replica(s) x {cfg.ray_actor_options}; check free resources with `ray status` (lower "
            "ray_actor_options.num_cpus or the Train workers' CPUs) or raise ready_timeout_s"
        ) from None
    except Exception as exc:
        raise RuntimeError(f"deploying reward app {app_name!r} failed: {exc}") from exc
    handle.get_config.remote().result(timeout_s=ready_timeout_s)  # warm the handle's routing
    return RewardApp(handle, cfg, app_name)


def _failed_names(units: Sequence[_Unit]) -> list[str]:
    return sorted({name for u in units for name in u.pending})


def _close(app: RewardApp) -> None:
    """Stop a local app or delete a Serve one, best effort (after a failed deploy)."""
    if app.local:
        app.handle.close()
    else:
        _delete_quietly(app.name)


def _delete_quietly(app_name: str) -> None:
    from ray import serve

    try:
        serve.delete(app_name, _blocking=False)
    except Exception as exc:  # noqa: BLE001 - best effort cleanup after a failed deploy
        logger.warning("could not delete reward app %r: %s", app_name, exc)
