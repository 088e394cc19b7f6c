"""Test-wide environment (offline hubs, quiet Ray, no telemetry), the markers, and the ``ray_local`` fixture.

Markers (declared in pyproject.toml): ``e2e`` is set by the modules that run whole jobs (trainers on Ray
Train + Serve + Data + MLflow, ``ray job submit``, the notebooks); ``ray`` is added here to every test that
starts Ray (it uses ``ray_local``, or lives in an ``e2e`` module), and ``own_ray`` to those of them that
start a Ray of their own instead of using ``ray_local`` (so they can run beside the tests on the shared
one: ``.ci/test``); ``gpu`` by the tests that need CUDA. The fast lane is ``pytest -m "not e2e"``.

``ray_local`` (module-scoped): a local Ray for the test module, 8 logical CPUs on however many cores
the machine has (so fractional Serve / Data / Train requests schedule on 2-core machines), no
dashboard, usage stats off, Hugging Face offline. Serve apps left running are deleted with the
module. Consecutive modules that all use ``ray_local`` share one Ray (starting and stopping Ray
costs seconds per module); it is shut down after the last module of such a run, so a module that
starts its own Ray (a head via the CLI, a notebook kernel) or none never finds one left behind, and
a module in which a test failed hands the next one a fresh Ray.

``ray_head`` (session-scoped): a real head node started with ``ray start --head`` (``support.RayHead``), shared by
``ray job submit``'s test and the notebooks, which run last.
"""

import os
import sys

import pytest

from unirl_ray.runtime.cluster import EMBEDDED_RAY_ENV

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60",
    # one intra-op thread in every process of the suite (Ray workers and replicas inherit it): the models are
    # tiny, the machine has 2 cores and several processes compute at once, so a second OpenMP thread per
    # process only spins and competes (the PE module took 241 CPU-s instead of 259, as fast in wall time)
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # ray_local's Ray runs as the embedded one of `ensure_ray` does (imported without importing Ray)
    **EMBEDDED_RAY_ENV,
}.items():
    os.environ.setdefault(key, value)

# Bytecode is cached, as Python does by default: where PYTHONDONTWRITEBYTECODE is set (as on the project's
# machines), every process of the suite (Ray workers and replicas, vLLM engines, notebook kernels, inherit
# this environment) would otherwise compile again each module that .ci/setup did not compile.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(config, items):
    """Mark the Ray tests, and order the modules: those without Ray first (quick failures come early),
    then every module on ``ray_local`` in a row (they share one Ray), then those that start their own, the
    tests on the shared ``ray_head`` last."""
    uses_ray_local = {item.module for item in items if "ray_local" in item.fixturenames}
    for item in items:
        if item.module in uses_ray_local or item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.ray)
            if item.module not in uses_ray_local:
                item.add_marker(pytest.mark.own_ray)

    def group(item) -> int:
        if item.module in uses_ray_local:
            return 1
        if "ray_head" in item.fixturenames:
            return 3  # last: the head they share stays up until the session ends
        return 2 if item.get_closest_marker("ray") is not None else 0

    items.sort(key=group)  # stable: the order within a group (and within a module) is kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on ``ray_head`` reports the head's logs (its GCS, raylet and dashboard), which its temp dir
    loses when the head stops at the end of the session."""
    report = yield
    head = item.funcargs.get("ray_head") if hasattr(item, "funcargs") else None
    if head is not None and report.failed:
        report.sections.append(("the ray_head's logs", head.logs()))
    return report


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

    # a Ray of this process even while another module's head (`ray start`, a simulated cluster) runs beside it,
    # started as an embedded one is: its processes inherit the variables the train workers need (no runtime env)
    if not ray.is_initialized():
        from unirl_ray.runtime.cluster import runtime_env_vars, start_local_ray

        start_local_ray(8, runtime_env_vars())
    failed_before = request.session.testsfailed
    try:
        yield ray
    finally:
        # a failed test may have left work behind (a Ray Train run, actors): the next module starts clean
        keep = request.session.testsfailed == failed_before and _next_module_uses_ray_local(request)
        if "ray.serve" in sys.modules:
            from ray import serve

            try:  # no Serve app of this module reaches the next one; a kept Ray keeps its Serve controller
                if keep:
                    from unirl_ray.runtime.serve import delete_apps

                    delete_apps(list(serve.status().applications))
                else:
                    serve.shutdown()
            except Exception:  # noqa: BLE001 - best effort; ray.shutdown() ends everything
                keep = False
        if not keep:
            ray.shutdown()



@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A real head node (``ray start --head``, dashboard on; ``support.RayHead``) for the tests that use a cluster
    as users do: ``ray job submit`` and the notebooks (their kernels join it through ``RAY_ADDRESS``). One head
    for the session: these tests run last (``pytest_collection_modifyitems``), then it stops."""
    from support import RayHead

    head = RayHead(tmp_path_factory.mktemp("ray-head") / "ray_head.log")
    try:
        yield head
    finally:
        head.stop()
