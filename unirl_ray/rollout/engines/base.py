"""What every rollout engine shares: the version it serves, catching up from the WeightStore, and
sleeping / waking for colocated layouts (train and engine take turns on the same devices)."""

from __future__ import annotations

import abc
from typing import Any

from unirl_ray.rollout.weight_sync import StaleWeightsError


def check_version(replica: int, version: int, expected: int, at_least: bool) -> None:
    """Refuse to generate with weights other than ``expected`` (``at_least``: older than ``expected``)."""
    if version == expected or (at_least and version > expected):
        return
    wanted = f"v{expected} or newer" if at_least else f"v{expected}"
    raise StaleWeightsError(f"replica {replica} serves weights v{version}, the controller expects {wanted}")


def token_ids_in(requests: list[dict[str, Any]]) -> bool:
    """Whether ``requests`` give their contexts as token ids (``prompt_ids``) rather than prompt text: all of
    them or none (``ValueError`` on a mix, which would sample half of a call from re-rendered text)."""
    given = ["prompt_ids" in r for r in requests]
    if any(given) and not all(given):
        raise ValueError("an engine call mixes requests with prompt_ids and requests without; send each kind "
                         "in its own call")
    return bool(given) and all(given)


class VersionedEngine(abc.ABC):
    """Mixin for engine deployments; subclasses set ``store``, ``version``, ``checksum``, ``replica``
    and implement ``load_weights(version, state, checksum)``, ``_release()`` (give the device memory
    back, return bytes freed) and ``_restore()`` (take it again, return bytes restored)."""

    store: tuple[str, str] | None = None
    sections: dict[str, Any] | None = None
    """What the replica built (bundle, pipeline, LoRA structure, trained attribute): ``describe`` returns it."""
    version: int = -1
    checksum: str | None = None
    replica: int = 0
    asleep: bool = False
    released_bytes: int = 0

    def describe(self) -> dict[str, Any]:
        """The model this engine serves (a trainer attaching to a running engine app checks it matches)."""
        return {"engine": type(self).__name__, "sections": self.sections}

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "checksum": self.checksum, "replica": self.replica,
                "asleep": self.asleep, "released_bytes": self.released_bytes}

    def sleep(self) -> dict[str, Any]:
        """Free the engine's device memory (weights, caches) until ``wake``; generation is refused meanwhile."""
        if not self.asleep:
            self.released_bytes = int(self._release())
            self.asleep = True
        return self.status()

    def wake(self, expected_version: int) -> dict[str, Any]:
        """Take the device memory back, then load the latest published weights if behind ``expected_version``."""
        if self.asleep:
            self._restore()
            self.asleep, self.released_bytes = False, 0
        self._catch_up(expected_version, exact=True)
        return self.status()

    @abc.abstractmethod
    def load_weights(self, version: int, state: dict[str, Any], checksum: str) -> dict[str, Any]:
        """Load a published version (verified by checksum); returns ``status()``."""

    @abc.abstractmethod
    def _release(self) -> int:
        """Give the engine's device memory back; returns the bytes freed."""

    @abc.abstractmethod
    def _restore(self) -> int:
        """Reallocate what ``_release`` freed, contents intact; returns the bytes restored."""

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(
                f"rollout replica {self.replica} is asleep (colocated layout: the train workers hold the device); "
                "the controller wakes it before rolling out"
            )

    def _catch_up(self, expected_version: int, *, exact: bool = False) -> None:
        """A replica behind the controller (started or restarted late) loads the latest published weights.
        ``exact`` (a colocated replica waking): it must serve ``expected_version`` itself, which is older than
        the one it holds after a worker-group restart rewound the run to a checkpoint."""
        fits = (lambda v: v == expected_version) if exact else (lambda v: v >= expected_version)
        if fits(self.version) or self.store is None:
            return
        import ray

        store = ray.get_actor(self.store[0], namespace=self.store[1])
        latest = ray.get(store.get_latest.remote(), timeout=60)
        if latest is not None and fits(latest["version"]):
            state = ray.get(latest["ref"][0], timeout=300)
            self.load_weights(latest["version"], state, latest["checksum"])
