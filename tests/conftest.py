"""Test-wide environment (offline hubs, quiet Ray, no telemetry) and the ``ray_local`` fixture.

``ray_local`` (module-scoped): a local Ray for the test module, 8 logical CPUs on however many cores
the machine has (so fractional Serve / Data / Train requests schedule on 2-core machines), no
dashboard, usage stats off, Hugging Face offline. Serve apps left running are shut down with the
module. Consecutive modules that all use ``ray_local`` share one Ray (starting and stopping Ray
costs seconds per module); it is shut down after the last module of such a run, so a module that
starts its own Ray (a head via the CLI, a notebook kernel) or none never finds one left behind, and
a module in which a test failed hands the next one a fresh Ray.
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
    # one local node that is never drained or scraped: no preemption-watcher actor per Ray Train run,
    # no Prometheus metrics of the Train controller and workers
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
}.items():
    os.environ.setdefault(key, value)


def _next_module_uses_ray_local(request) -> bool:
    """Whether the test after this module's last one (in run order) belongs to a module using ``ray_local``."""
    items = request.session.items
    module = request.node
    last = max((i for i, item in enumerate(items) if item.module is module.obj), default=None)
    if last is None or last + 1 >= len(items):
        return False
    return "ray_local" in items[last + 1].fixturenames


@pytest.fixture(scope="module")
def ray_local(request):
    """A local Ray (num_cpus=8) for the whole test module; yields the ``ray`` module."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    failed_before = request.session.testsfailed
    try:
        yield ray
    finally:
        if "ray.serve" in sys.modules:
            from ray import serve

            try:
                serve.shutdown()  # no Serve app (or controller) of this module reaches the next one
            except Exception:  # noqa: BLE001 - best effort; ray.shutdown() ends everything
                pass
        # a failed test may have left work behind (a Ray Train run, actors): the next module starts clean
        if request.session.testsfailed != failed_before or not _next_module_uses_ray_local(request):
            ray.shutdown()

