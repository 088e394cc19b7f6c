"""Ray Train's controller and worker group for a Ray whose every process inherited the run's variables.

Ray Train gives its controller actor a runtime env of the variables it propagates that are set in the driver
(``ray.train.v2._internal.constants.ENV_VARS_TO_PROPAGATE``: its ``RAY_TRAIN_*`` settings and a few others; and
``RAY_WARN_BLOCKING_GET_INSIDE_ASYNC=0``), and the controller gives each train worker the same variables as a
runtime env of its own. A process with a runtime env is started through Ray's setup process (a second
interpreter that then starts the worker) and cannot take one of the idle workers Ray starts ahead: ~0.5 CPU-s
and a process start more per actor. In the embedded local Ray (``cluster.start_local_ray``) every process
already inherits those variables with the same values from the daemons (one node: a node joined to it by
hand with ``ray start --address`` would not have them), so the controller and the workers need no runtime env:
``runtime.train_group``'s trainer starts ``InheritedEnvController`` without one when that holds, and its worker
groups pass on only the run's own ``worker_runtime_env``.

Imported by the controller's process (the class travels by reference), so it imports only Ray Train.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2._internal.execution.controller.controller import TrainController
from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup


class InheritedEnvWorkerGroup(WorkerGroup):
    """A worker group whose workers get only the run's ``worker_runtime_env``: Ray Train's variables are
    inherited by every process of this one-node Ray (the controller's own environment is the daemons')."""

    @staticmethod
    def _get_worker_runtime_env(custom_runtime_env: Any) -> Any:
        return dict(custom_runtime_env or {})


class InheritedEnvController(TrainController):
    """``TrainController`` that starts ``InheritedEnvWorkerGroup``s."""

    worker_group_cls = InheritedEnvWorkerGroup
