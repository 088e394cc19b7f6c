"""Write the bytecode of what unirl_ray's processes import, by importing it once with bytecode writing on.

Run by ``.ci/setup`` after an install: ``python .ci/compile_imports.py`` for the package and what it imports,
``python .ci/compile_imports.py --vllm`` for vLLM's engine (which must import: this also checks the install).
Where ``PYTHONDONTWRITEBYTECODE`` is set (as on the project's machines) Python never caches bytecode, so every
Ray worker and replica would compile again what it imports (seconds per process). Compiling every installed
module at install time (``--compile-bytecode``) costs ~60 s on 2 cores for ~34,000 files of which a run
imports ~6,000; importing the package's modules (and through them torch, Ray Train / Serve / Data,
transformers, diffusers, peft, mlflow) writes exactly those in ~20 s. A module only some runs import is
compiled by the first process that imports it where bytecode writing is on (the test suite turns it on:
``tests/conftest.py``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

# what the package imports only inside functions (Ray libraries on first use, engines, tools)
EXTRA = ("ray.train.torch", "ray.serve", "ray.data", "mlflow", "mlflow.tracking", "pytest", "nbclient",
         # what Ray's own processes import: the Train controller and worker actors (ray.tune and ray.air with them),
         # Serve's controller and replicas, Ray Data's executor, the autoscaler monitor, dashboard, agents and
         # log monitor of every `ray.init` (~140 modules compiled again by every such process otherwise)
         "ray.train.v2._internal.execution.controller.controller", "ray.train.v2._internal.execution.worker_group.worker",
         "ray.serve._private.controller", "ray.serve._private.replica",
         "ray.data._internal.issue_detection.issue_detector_manager", "ray.autoscaler._private.monitor",
         "ray.autoscaler.v2.monitor", "ray.dashboard.dashboard", "ray.dashboard.agent", "ray._private.log_monitor",
         "ray._private.runtime_env.agent.main", "torch.distributed.checkpoint.state_dict", "fsspec.implementations.http")
VLLM = ("vllm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core")


def main(argv: list[str]) -> int:
    sys.dont_write_bytecode = False
    if "--vllm" in argv:
        for name in VLLM:
            importlib.import_module(name)
        import transformers
        import vllm

        print("vLLM", vllm.__version__, "/ transformers", transformers.__version__)
        return 0
    import serve_apps
    import unirl_ray

    names = [m.name for pkg in (unirl_ray, serve_apps) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    names += EXTRA
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optional dependency missing here only costs its compile later
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    if failed:
        print(f"compile_imports: not imported (compiled on first use instead): {'; '.join(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
