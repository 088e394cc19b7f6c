"""Shared fixtures for tests that need a local Ray cluster.

``ray_local`` (module-scoped): one local Ray per test module, 8 logical CPUs on however many cores
the machine has (so fractional Serve / Data / Train requests schedule on 2-core machines), no
dashboard, usage stats off, Hugging Face offline. Serve apps left running are shut down with it.
"""

from __future__ import annotations

import os
import sys

import pytest

for _key, _value in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}.items():
    os.environ.setdefault(_key, _value)


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
