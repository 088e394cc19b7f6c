"""The end of a run (``BaseTrainer.commit_last``), without Ray: the run counts as finished only once its last
checkpoint is committed, and a worker-group restart during that wait (a worker, or its node, died after the
last step) is recovered like one during a step: the steps after the checkpoint the restarted workers loaded
run again, and the wait starts over. (Seen on a simulated multi-node cluster: a node killed as the last step
started took its worker down only after the step's save, and the run failed at its last commit.)"""

import pytest
from support import load, recipe_path

from unirl_ray.runtime.train_group import WorkerGroupRestarted
from unirl_ray.trainer.ar import ARTrainer


class Group:
    """The controller's view of a worker group whose first commit wait sees a restart."""

    def __init__(self, restored_step: int) -> None:
        self.restored_step = restored_step
        self.commit_waits = 0

    def wait_committed(self) -> None:
        self.commit_waits += 1
        if self.commit_waits == 1:
            raise WorkerGroupRestarted("the worker group restarted during 'wait_checkpoint'")

    def wait_announced(self, timeout_s: float) -> dict:
        return {"restored_step": self.restored_step, "policy_version": self.restored_step, "controller": {}}


class Tracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))


@pytest.mark.parametrize("restored", [4, 6])
def test_a_restart_during_the_last_commit_runs_the_steps_after_the_restored_checkpoint_again(tmp_path, restored):
    trainer = ARTrainer(load(recipe_path("ar", "tiny", "char_grpo_direct.yaml"), tmp_path, "last-commit",
                             "trainer.num_steps=6", "trainer.checkpoint_every=2"))
    ran, saved = [], []
    trainer.group, trainer.tracker = Group(restored), Tracker()
    trainer.run_step = lambda step: ran.append(step) or {"train/loss": float(step)}
    trainer.save_checkpoint = saved.append
    trainer.restore = lambda state: None
    trainer.prompt_log = [(s, ["a prompt"]) for s in range(1, 7)]
    trainer._start_state, trainer.engine = {}, None  # setup() sets both; the direct recipe has no engine

    last = trainer.commit_last({"train/loss": 6.0})
    assert trainer.group.commit_waits == 2 and trainer.restarts == 1
    assert trainer.policy_version == restored and [s for s, _ in trainer.prompt_log] == list(range(1, restored + 1))
    assert ("fault/worker_group_restarts" in dict(trainer.tracker.logged)[restored])
    if restored == 4:  # the step-6 checkpoint was not committed: steps 5 and 6 again, the last one saved
        assert ran == [5, 6] and saved == [6] and last == {"train/loss": 6.0}
    else:  # it was: nothing runs again
        assert ran == [] and saved == [] and last == {"train/loss": 6.0}
