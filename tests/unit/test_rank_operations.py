"""The runtime dispatches commands to what the rank object registers (``@operation``), without knowing
any domain: a new trainer adds methods to its rank class and never edits ``runtime/``."""

from __future__ import annotations

import inspect

import pytest

from unirl_ray.runtime import worker as runtime_worker
from unirl_ray.runtime.operations import dispatch, operation, operations
from unirl_ray.train.rank import StackWorker


class Rank:
    policy_version = 3

    @operation
    def draw(self, prompts: list[str], scale: float = 1.0) -> list[str]:
        return [f"{p}x{scale:g}" for p in prompts]

    def helper(self) -> None:  # not a command
        raise AssertionError("never dispatched")


def test_commands_are_the_marked_methods_called_with_the_payload_as_keywords():
    rank = Rank()
    assert sorted(operations(rank)) == ["draw"]
    assert dispatch(rank, "draw", {"prompts": ["a"], "scale": 2.0}) == ["ax2"]
    assert runtime_worker._dispatch(rank, "draw", {"prompts": ["b"]}, 0, 1.0) == ["bx1"]
    pong = runtime_worker._dispatch(rank, "ping", {}, 0, 1.0)  # the runtime's own
    assert pong["policy_version"] == 3 and pong["node_id"] is None  # without Ray: no node (and no Ray started)
    with pytest.raises(ValueError, match="unknown worker command 'helper'; Rank serves draw"):
        dispatch(rank, "helper", {})
    with pytest.raises(TypeError, match="payload of command 'draw' must be a dict"):
        dispatch(rank, "draw", ["a"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'prompt'"):
        dispatch(rank, "draw", {"prompt": ["a"]})


def test_the_train_rank_serves_what_the_trainers_send():
    served = {name for name, fn in inspect.getmembers(StackWorker) if getattr(fn, "__unirl_operation__", False)}
    assert served == {"generate", "eval_generate", "train", "export_weights", "export", "offload", "onload",
                      "sft_start", "sft_train", "sft_eval"}
    assert runtime_worker.rank_class(runtime_worker.DEFAULT_RANK_CLASS) is StackWorker
    source = inspect.getsource(runtime_worker)
    for name in served:  # the runtime names no domain command
        assert f'"{name}"' not in source, name
