"""What every rollout engine shares: the version it serves and catching up from the WeightStore."""

from __future__ import annotations

from typing import Any


class VersionedEngine:
    """Mixin for engine deployments; subclasses set ``store``, ``version``, ``checksum``, ``replica``
    and implement ``load_weights(version, state, checksum)``."""

    store: tuple[str, str] | None = None
    version: int = -1
    checksum: str | None = None
    replica: int = 0

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "checksum": self.checksum, "replica": self.replica}

    def _catch_up(self, expected_version: int) -> None:
        """A replica behind the controller (started or restarted late) loads the latest published weights."""
        if self.version >= expected_version or self.store is None:
            return
        import ray

        store = ray.get_actor(self.store[0], namespace=self.store[1])
        latest = ray.get(store.get_latest.remote(), timeout=60)
        if latest is not None and latest["version"] >= expected_version:
            state = ray.get(latest["ref"][0], timeout=300)
            self.load_weights(latest["version"], state, latest["checksum"])
