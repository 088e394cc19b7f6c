"""Reward configuration, scoring of one batch, and weighting of several reward sources.

A reward source is a plain function with the TRL-style contract (see ``unirl_ray.rewards.image``)::

    fn(*, images: list[np.ndarray], prompts: list[str], **columns) -> list[float | None]

named in a recipe by import path (``"unirl_ray.rewards.image.brightness"`` or
``"pkg.module:fn"``) with a weight and optional keyword arguments. The total reward of a sample
is ``sum(weight * score)`` over the sources with a non-zero weight. Text samples give ``images``
as ``None`` entries and add a ``completions`` column (TRL's ``fn(*, prompts, completions, **columns)``).

A source may also name a class (e.g. ``"unirl_ray.rewards.model.SequenceClassifierReward"``): its
``kwargs`` then go to the constructor, called once per reward replica (load a model there), and the
instance is called with the contract's arguments.

Failure policy (applied by ``RewardClient``; ``score_batch`` and ``combine`` are its pure parts):

- **Invalid score.** A reward fn may return ``None`` (or NaN / inf, converted to ``None``) for a
  sample it cannot score. That sample's source score is ``None``; if that source has a non-zero
  weight the sample's total reward is ``None``: the sample is invalid, excluded from advantages,
  and counted in ``reward/invalid_frac``. Nothing is retried.
- **Exception or timeout.** A reward fn that raises, returns the wrong number of scores, or does
  not answer within ``timeout_s`` is retried ``max_retries`` times (only the failed sources are
  re-run). If it still fails: with ``on_error="fail"`` the step fails with ``RewardError`` naming
  the reward and the cause; with ``on_error="skip"`` every sample of that request gets ``None`` from
  that reward (so it is invalid if the reward is weighted) and a warning is logged.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from unirl_ray.config.checks import check_literal_fields

RewardFn = Callable[..., Sequence[Any]]

_RESERVED_COLUMNS = ("images", "prompts")


class RewardError(RuntimeError):
    """A reward source failed (raised, returned a bad result, or timed out) after its retries."""

    def __init__(self, reward: str, cause: str):
        super().__init__(f"reward {reward!r} failed: {cause}")
        self.reward = reward
        """Name of the failing reward source (the key in ``RewardConfig.rewards``)."""
        self.cause = cause
        """What went wrong, as text (exception type and message, or the timeout)."""

    def __reduce__(self):  # keep the attributes when the error crosses a process boundary
        return (RewardError, (self.reward, self.cause))


def _did_you_mean(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def import_callable(path: str) -> RewardFn:
    """Import ``"pkg.module.fn"`` or ``"pkg.module:fn"``; ValueError with a close match when it fails."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"a reward fn must be an import path like 'unirl_ray.rewards.image.brightness', got {path!r}")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward fn path {path!r} needs a module and a name, e.g. 'unirl_ray.rewards.image.brightness'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"cannot import module {module_name!r} of reward fn {path!r}: {exc}{_module_hint(module_name)}") from exc
    if not hasattr(module, attr):
        public = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, public, n=1)
        hint = f"; did you mean {module_name + sep + close[0]!r}?" if close else ""
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (reward fn {path!r}){hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"reward fn {path!r} is a {type(fn).__name__}, not a callable")
    return fn


def _module_hint(module_name: str) -> str:
    """A 'did you mean' for a missing module, looking among the siblings of its deepest importable parent."""
    parts = module_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            parent = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        siblings = [m.name for m in pkgutil.iter_modules(getattr(parent, "__path__", []))]
        close = difflib.get_close_matches(parts[i], siblings, n=1)
        return f"; did you mean {'.'.join(parts[:i] + close)!r}?" if close else ""
    return ""


@dataclass(kw_only=True)
class RewardFnSpec:
    """One reward source: what to call, how much it weighs, and extra keyword arguments."""

    name: str
    """Source name; metrics are ``reward/<name>/...`` and ``Sample.rewards[name]``."""
    fn: str | RewardFn | type
    """Import path (``"unirl_ray.rewards.image.brightness"``), the callable itself, or a class whose
    instances are reward fns (constructed once per replica with ``kwargs``)."""
    weight: float = 1.0
    """Weight in the total reward; 0 logs the source without using it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """For a function: extra keyword arguments passed to every call (they win over dataset columns
    of the same name). For a class: the constructor's keyword arguments."""

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be a finite number, got {self.weight!r}")
        self.weight = float(self.weight)
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"reward {self.name!r}: kwargs must be a mapping, got {type(self.kwargs).__name__}")
        self.kwargs = dict(self.kwargs)
        target = self.resolve()  # import now, so a bad path fails at construction on the driver
        if inspect.isclass(target):  # check the constructor's arguments without building the class
            try:
                inspect.signature(target).bind(**self.kwargs)
            except TypeError as exc:
                raise ValueError(f"reward {self.name!r}: kwargs {sorted(self.kwargs)} do not fit "
                                 f"{target.__name__}{inspect.signature(target)}: {exc}") from None
            except ValueError:  # no signature available (builtin): checked when constructed
                pass

    def resolve(self) -> RewardFn:
        """The callable, imported if given as a path."""
        if isinstance(self.fn, str):
            try:
                return import_callable(self.fn)
            except ValueError as exc:
                raise ValueError(f"reward {self.name!r}: {exc}") from None
        if not callable(self.fn):
            raise ValueError(f"reward {self.name!r}: fn must be an import path or a callable, got {self.fn!r}")
        return self.fn

    def bound(self) -> RewardFn:
        """The callable with ``kwargs`` applied, ready for ``score_batch``.

        For a class this constructs one instance (``cls(**kwargs)``, e.g. loading a reward model):
        call it once per process (the reward replica does, at start) and reuse the result.
        """
        fn, kwargs = self.resolve(), dict(self.kwargs)
        if inspect.isclass(fn):
            try:
                instance = fn(**kwargs)
            except Exception as exc:
                raise RewardError(self.name, f"constructing {fn.__name__} failed: {type(exc).__name__}: {exc}") from exc
            if not callable(instance):
                raise ValueError(f"reward {self.name!r}: {fn.__name__} instances are not callable; define __call__")
            return instance
        if not kwargs:
            return fn

        def call(**call_kwargs: Any) -> Sequence[Any]:
            return fn(**{**call_kwargs, **kwargs})

        return call


_SPEC_KEYS = ("fn", "weight", "kwargs", "app")
_APP_KEYS = ("num_replicas", "ray_actor_options", "max_ongoing_requests")


@dataclass(kw_only=True)
class RewardConfig:
    """Which reward sources to run, how to weight them, and how the reward Serve app is placed."""

    rewards: dict[str, dict[str, Any]]
    """Sources by name: ``{"brightness": {"fn": "unirl_ray.rewards.image.brightness", "weight": 1.0, "kwargs": {}}}``.
    A source with ``app: {num_replicas, ray_actor_options, max_ongoing_requests}`` runs as its own Serve
    app with those replicas and resources (e.g. a reward model on a GPU share); the others share one app."""
    timeout_s: float = 60.0
    """Deadline of each reward fn on one request, seconds (the driver waits this plus a small grace)."""
    max_retries: int = 1
    """Retries of a reward that raised or timed out, before ``on_error`` applies."""
    on_error: Literal["fail", "skip"] = "fail"
    """After retries: ``"fail"`` raises ``RewardError``; ``"skip"`` gives ``None`` scores and warns."""
    num_replicas: int = 1
    """Serve replicas of the reward deployment; a batch is split across them."""
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0.25})
    """Resources of each replica (fractional CPUs avoid deadlocks next to Train workers on small machines)."""
    max_ongoing_requests: int = 16
    """Concurrent requests one replica accepts."""
    placement: Literal["auto", "local", "serve"] = "auto"
    """Where the shared sources (those without their own ``app``) run. ``local``: in the process that holds
    the client (the trainer's driver; an async trainer's rollout stage), each source in worker threads
    under the same ``timeout_s``, retries and ``on_error`` as in a replica, with no replica to start or
    call. ``serve``: a Serve app of ``num_replicas`` replicas (``ray_actor_options``). ``auto`` (the
    default): ``local`` when every shared source is a function (rule rewards), ``serve`` when one is a
    class (it builds a model, once per replica). A source with ``app`` always runs as its own Serve app."""
    image_prompt: Literal["original", "rewrite"] = "original"
    """Prompt-enhancer runs: the prompt reward fns get as ``prompts``: the user's ``original`` prompt (so a
    rewriter cannot win by drifting from it) or the ``rewrite`` the image was drawn from. Both are also in
    the columns ``original_prompt`` and ``rewrite``. Other trainers have one prompt and keep the default."""

    def __post_init__(self) -> None:
        if not isinstance(self.rewards, Mapping) or not self.rewards:
            raise ValueError("RewardConfig.rewards needs at least one source, e.g. "
                             "{'brightness': {'fn': 'unirl_ray.rewards.image.brightness'}}")
        self.rewards = {str(k): dict(v) if isinstance(v, Mapping) else v for k, v in self.rewards.items()}
        self._specs = [self._make_spec(name, entry) for name, entry in self.rewards.items()]
        self._apps = {name: self._check_app(name, entry["app"]) for name, entry in self.rewards.items()
                      if isinstance(entry, Mapping) and entry.get("app") is not None}
        self._check_scalars()
        if self._apps:
            self.placements()  # validates each app's replicas and resources now, on the driver

    @staticmethod
    def _make_spec(name: str, entry: Any) -> RewardFnSpec:
        if isinstance(entry, str) or callable(entry):
            entry = {"fn": entry}
        if not isinstance(entry, Mapping) or "fn" not in entry:
            raise ValueError(f"reward {name!r}: expected a mapping with 'fn' (and optional 'weight', 'kwargs'), got {entry!r}")
        for key in entry:
            if key not in _SPEC_KEYS:
                raise ValueError(f"reward {name!r}: unknown key {key!r}{_did_you_mean(key, _SPEC_KEYS)}; allowed: {list(_SPEC_KEYS)}")
        return RewardFnSpec(name=name, fn=entry["fn"], weight=entry.get("weight", 1.0), kwargs=entry.get("kwargs") or {})

    def check_learnable(self) -> None:
        """ValueError when every source has weight 0: the total reward is the constant 0 and nothing
        is learned (a trainer calls this; one app's share of the sources may log only)."""
        if all(spec.weight == 0 for spec in self._specs):
            names = ", ".join(f"reward.rewards.{spec.name}.weight" for spec in self._specs)
            raise ValueError(f"every reward source has weight 0 ({names}): the total reward would be 0 for every "
                             "sample and nothing would be learned; give at least one source a non-zero weight")

    @staticmethod
    def _check_app(name: str, app: Any) -> dict[str, Any]:
        """The placement of a source that runs as its own Serve app; ValueError on unknown keys."""
        if not isinstance(app, Mapping):
            raise ValueError(f"reward {name!r}: app must be a mapping like {{num_replicas: 1, ray_actor_options: "
                             f"{{num_cpus: 1, num_gpus: 0.25}}}}, got {app!r}")
        for key in app:
            if key not in _APP_KEYS:
                raise ValueError(f"reward {name!r}: unknown app key {key!r}{_did_you_mean(str(key), _APP_KEYS)}; "
                                 f"allowed: {list(_APP_KEYS)}")
        return dict(app)

    def _check_scalars(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        check_literal_fields(self)
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {self.num_replicas!r}")
        if not isinstance(self.max_ongoing_requests, int) or self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be an int >= 1, got {self.max_ongoing_requests!r}")
        if not isinstance(self.ray_actor_options, Mapping):
            raise ValueError(f"ray_actor_options must be a mapping like {{'num_cpus': 0.25}}, got {self.ray_actor_options!r}")
        self.ray_actor_options = dict(self.ray_actor_options)

    def placements(self) -> list[tuple[str, "RewardConfig"]]:
        """One ``(suffix, config)`` per app: the shared app (suffix ``""``; in Serve or local, see
        ``placement``) with every source without ``app``, then one Serve app per source with ``app``
        (suffix ``"-<name>"``), each config holding only its sources and its own replicas / resources
        (timeouts and policy are shared)."""
        base = {k: v for k, v in self.to_dict().items() if k != "rewards"}
        shared = {n: e for n, e in self.rewards.items() if n not in self._apps}
        out: list[tuple[str, RewardConfig]] = []
        if shared:
            out.append(("", RewardConfig(rewards=shared, **base)))
        for name, app in self._apps.items():
            entry = {k: v for k, v in self.rewards[name].items() if k != "app"}
            out.append((f"-{name}", RewardConfig(rewards={name: entry}, **{**base, **app})))
        return out

    def shared_runs_locally(self) -> bool:
        """Whether the shared sources run in the client's process (``placement``; see there)."""
        if self.placement != "auto":
            return self.placement == "local"
        return not any(inspect.isclass(spec.resolve()) for spec in self._specs if spec.name not in self._apps)

    def uses_serve(self) -> bool:
        """Whether any source runs in a Serve app (its own ``app``, or shared sources not run locally)."""
        local = self.shared_runs_locally()
        return any(suffix or not local for suffix, _ in self.placements())

    def resources(self) -> dict[str, float]:
        """CPUs / GPUs all reward replicas reserve, summed over the Serve apps (for the cluster-fit check);
        shared sources that run locally reserve nothing."""
        need: dict[str, float] = {}
        local = self.shared_runs_locally()
        for suffix, cfg in self.placements():
            if local and not suffix:
                continue
            opts = cfg.ray_actor_options
            need["CPU"] = need.get("CPU", 0.0) + float(opts.get("num_cpus", 1)) * cfg.num_replicas
            if opts.get("num_gpus"):
                need["GPU"] = need.get("GPU", 0.0) + float(opts["num_gpus"]) * cfg.num_replicas
        return need

    @property
    def specs(self) -> list[RewardFnSpec]:
        """The validated sources, in recipe order."""
        return list(self._specs)

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self._specs}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict form (what the Serve deployment is constructed from)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "RewardConfig") -> "RewardConfig":
        """Build from a dict (e.g. a recipe section); unknown keys fail with a close match."""
        if isinstance(data, RewardConfig):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"a reward config must be a mapping, got {type(data).__name__}")
        data = _plain(data)
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise ValueError(f"unknown RewardConfig key {key!r}{_did_you_mean(str(key), names)}; allowed: {names}")
        return cls(**dict(data))


def _plain(value: Any) -> Any:
    """Nested mappings / sequences (e.g. OmegaConf containers) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _to_score(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)):  # float("0.75") would pass a parsing bug off as a score
        raise TypeError(f"got the string {value!r}")
    score = float(value)  # raises TypeError/ValueError for non-numbers
    return score if math.isfinite(score) else None


def score_one(
    name: str,
    fn: RewardFn,
    images: Sequence[Any],
    prompts: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> list[float | None]:
    """Run one reward source on a batch; RewardError naming it on any failure. NaN/inf become None."""
    columns = dict(columns or {})
    for key in _RESERVED_COLUMNS:
        if key in columns:
            raise ValueError(f"dataset column {key!r} collides with a reward fn argument; rename the column")
    try:
        out = fn(images=images, prompts=prompts, **columns)
    except Exception as exc:  # noqa: BLE001 - the error is re-raised with the reward's name
        raise RewardError(name, f"{type(exc).__name__}: {exc}") from exc
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
        raise RewardError(name, f"returned {type(out).__name__}; a reward fn must return a list with one score per sample")
    if len(out) != len(prompts):
        raise RewardError(name, f"returned {len(out)} scores for {len(prompts)} samples")
    try:
        return [_to_score(v) for v in out]
    except (TypeError, ValueError) as exc:
        raise RewardError(name, f"returned a non-numeric score ({exc}); return floats or None") from None


def score_batch(
    fns: Mapping[str, RewardFn],
    images: Sequence[Any],
    prompts: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, list[float | None]]:
    """Score one batch with every source: ``{name: [score or None per sample]}``.

    ``images`` is a list of uint8 arrays or one stacked array ``[B, ...]``. The first failing source
    raises ``RewardError``; use ``score_one`` per source to handle failures separately.
    """
    images = list(images) if isinstance(images, np.ndarray) else images
    if len(images) != len(prompts):
        raise ValueError(f"got {len(images)} images for {len(prompts)} prompts; pass one image per prompt")
    return {name: score_one(name, fn, images, prompts, columns) for name, fn in fns.items()}


def combine(per_source: Mapping[str, Sequence[float | None]], weights: Mapping[str, float]) -> list[float | None]:
    """Weighted sum per sample; ``None`` where any source with a non-zero weight is ``None``."""
    used = {name: w for name, w in weights.items() if w != 0.0}
    missing = [name for name in used if name not in per_source]
    if missing:
        raise ValueError(f"no scores for weighted reward(s) {missing}; scored sources: {sorted(per_source)}")
    lengths = {name: len(per_source[name]) for name in per_source}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"reward sources scored different numbers of samples: {lengths}")
    n = next(iter(lengths.values()), 0)
    totals: list[float | None] = []
    for i in range(n):
        values = [(w, per_source[name][i]) for name, w in used.items()]
        bad = any(v is None or not math.isfinite(v) for _, v in values)
        totals.append(None if bad else float(sum(w * v for w, v in values)))
    return totals


def reward_metrics(
    per_source: Mapping[str, Sequence[float | None]], totals: Sequence[float | None]
) -> dict[str, float]:
    """``reward/<name>/mean|std`` over valid scores, ``reward/mean|std``, ``reward/invalid_frac``.

    Means and stds are NaN when no sample is valid (MLflow stores NaN).
    """

    def stats(values: Sequence[float | None]) -> tuple[float, float]:
        valid = np.array([v for v in values if v is not None], dtype=np.float64)
        if valid.size == 0:
            return math.nan, math.nan
        return float(valid.mean()), float(valid.std())

    metrics: dict[str, float] = {}
    for name, values in per_source.items():
        metrics[f"reward/{name}/mean"], metrics[f"reward/{name}/std"] = stats(values)
    metrics["reward/mean"], metrics["reward/std"] = stats(totals)
    metrics["reward/invalid_frac"] = (sum(t is None for t in totals) / len(totals)) if totals else 0.0
    return metrics
