"""Test-wide environment (offline hubs, quiet Ray, no telemetry) and the ``ray_local`` fixture.

``ray_local`` (module-scoped): one local Ray per test module, 8 logical CPUs on however many cores
the machine has (so fractional Serve / Data / Train requests schedule on 2-core machines), no
dashboard, usage stats off, Hugging Face offline. Serve apps left running are shut down with it.
"""

import os
import sys

import pytest

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}.items():
    os.environ.setdefault(key, value)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray (num_cpus=8) for the whole test module; yields the ``ray`` module."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    try:
        yield ray
    finally:
        if "ray.serve" in sys.modules:
            from ray import serve

            try:
                serve.shutdown()
            except Exception:  # noqa: BLE001 - best effort; ray.shutdown() below ends everything
                pass
        ray.shutdown()
