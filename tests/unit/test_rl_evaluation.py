"""When the RL trainers evaluate (``trainer.eval_every``, ``trainer.eval_on_start``), without Ray: the steps that end
with an evaluation, and the baseline evaluation before the first step of a new run (not of a resumed one)."""

from types import SimpleNamespace

from unirl_ray.trainer import base
from unirl_ray.trainer.ar import ARTrainer
from unirl_ray.trainer.rl import RLRunConfig


def trainer(num_steps, eval_every, eval_on_start, source=True):
    t = object.__new__(ARTrainer)
    t.run_cfg = RLRunConfig(run_name="r", num_steps=num_steps, eval_every=eval_every, eval_on_start=eval_on_start,
                            checkpoint_every=100)
    t.eval_source = object() if source else None
    logged = []
    t.tracker = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, dict(metrics))))
    t.evaluate = lambda step: {"eval/reward_mean": float(step)}
    return t, logged


def test_eval_steps_are_every_n_and_the_last():
    t, _ = trainer(10, 4, False)
    assert [s for s in range(1, 11) if t.eval_due(s)] == [4, 8, 10]
    t, _ = trainer(10, 0, True)  # the baseline only (before the first step), as SFT's eval_on_start
    assert not any(t.eval_due(s) for s in range(1, 11))
    t, _ = trainer(10, 0, False, source=False)  # evaluation off: no eval source is built
    assert not any(t.eval_due(s) for s in range(1, 11))


def test_eval_on_start_logs_a_baseline_at_step_0_of_a_new_run_only(monkeypatch):
    ran = []
    monkeypatch.setattr(base.BaseTrainer, "run_steps", lambda self, start: ran.append(start) or {})
    t, logged = trainer(10, 5, True)
    t.run_steps(0)
    assert logged == [(0, {"eval/reward_mean": 0.0})] and ran == [0]
    logged.clear()
    t.run_steps(4)  # a resumed run: its baseline was logged when it started
    assert logged == [] and ran == [0, 4]
    t.run_steps(0)  # the last commit's recovery runs the steps again from 0: the baseline is not logged twice
    assert logged == [] and ran == [0, 4, 0]
    t, logged = trainer(10, 5, False)
    t.run_steps(0)
    assert logged == []


def test_a_worker_group_restart_during_the_baseline_is_recovered_and_the_baseline_run_again(monkeypatch):
    from unirl_ray.runtime.train_group import WorkerGroupRestarted

    monkeypatch.setattr(base.BaseTrainer, "run_steps", lambda self, start: {})
    t, logged = trainer(10, 5, True)
    calls, recovered = [], []

    def evaluate(step):
        calls.append(step)
        if len(calls) == 1:
            raise WorkerGroupRestarted("a rank died")
        return {"eval/reward_mean": 0.5}

    t.evaluate = evaluate
    t.recover = lambda step, exc: recovered.append((step, str(exc))) or 0
    t.run_steps(0)
    assert calls == [0, 0] and recovered == [(0, "a rank died")] and logged == [(0, {"eval/reward_mean": 0.5})]


def test_a_trainer_whose_config_has_no_evaluation_never_evaluates(monkeypatch):
    """The prompt enhancer's ``PERunConfig`` has no ``eval_*`` fields; its eval source is None."""
    monkeypatch.setattr(base.BaseTrainer, "run_steps", lambda self, start: {})
    t, logged = trainer(10, 5, True, source=False)
    t.run_cfg = SimpleNamespace(num_steps=10)
    assert not any(t.eval_due(s) for s in range(1, 11))
    t.run_steps(0)
    assert logged == []
