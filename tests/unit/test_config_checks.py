"""``Literal`` choices are checked from the annotation itself (``unirl_ray.config.checks``): on
construction in Python, and in recipes by ``validate_targets``; no component keeps its own list."""

from __future__ import annotations

import ast
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pytest
import torch

from unirl_ray.algorithms.grpo import DAPO, GRPO, kl_penalty
from unirl_ray.algorithms.off_policy import OffPolicyCorrection
from unirl_ray.algorithms.sft import SFT
from unirl_ray.config import RecipeError, validate_targets
from unirl_ray.config.checks import check_choice, check_literal_args, check_literal_fields, describe_choices
from unirl_ray.data.records import RecordSource
from unirl_ray.data.sft_examples import TextExampleBuilder
from unirl_ray.rewards.combine import RewardConfig
from unirl_ray.rollout.dedicated import DedicatedRollout
from unirl_ray.rollout.trainside import TrainsideRollout
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig, EmaTiming, FSDPConfig, LrSchedulerConfig
from unirl_ray.trainer.async_rl import AsyncConfig

if TYPE_CHECKING:
    from collections import OrderedDict  # only for type checking: unresolvable at run time

PACKAGE = Path(__file__).resolve().parents[2] / "unirl_ray"
HERE = __name__


BRIGHTNESS = {"b": {"fn": "unirl_ray.rewards.image.brightness"}}
CASES = [  # (build, field as named in the message, bad value, allowed values as shown)
    (lambda: FSDPConfig(fsdp_mode="zero3"), "FSDPConfig.fsdp_mode", "'zero3'", "'full', 'hybrid' or 'no_shard'"),
    (lambda: EmaLoraConfig(timing="epoch"), "EmaLoraConfig.timing", "'epoch'", "'rollout_end' or 'optimizer_step'"),
    (lambda: EmaLoraConfig(ema_decay_type="cosine"), "EmaLoraConfig.ema_decay_type", "'cosine'", "'constant' or 'ramp'"),
    (lambda: EmaFullConfig(timing="epoch"), "EmaFullConfig.timing", "'epoch'", "'rollout_end' or 'optimizer_step'"),
    (lambda: LrSchedulerConfig(kind="step"), "LrSchedulerConfig.kind", "'step'", "'constant', 'linear' or 'cosine'"),
    (lambda: RewardConfig(rewards=BRIGHTNESS, on_error="ignore"), "RewardConfig.on_error", "'ignore'", "'fail' or 'skip'"),
    (lambda: AsyncConfig(partial_rollout="abort"), "async_rollout.partial_rollout", "'abort'", "'finish' or 'resample'"),
    (lambda: DedicatedRollout(placement="remote"), "rollout.placement", "'remote'", "'separate' or 'colocated'"),
    (lambda: OffPolicyCorrection(mode="vtrace"), "off_policy.mode", "'vtrace'", "'none' or 'decoupled'"),
    (lambda: OffPolicyCorrection(cap_policy="drop"), "off_policy.cap_policy", "'drop'", "'truncate' or 'mask'"),
    (lambda: RecordSource(path="unused.jsonl", format="csv"), "data.format", "'csv'", "'auto', 'messages'"),
    (lambda: RecordSource(path="unused.jsonl", on_bad_record="warn"), "data.on_bad_record", "'warn'", "'skip' or 'fail'"),
    (lambda: GRPO(group_size=2, advantage_estimator="ppo"), "GRPO.advantage_estimator", "'ppo'", "'grpo' or 'rloo'"),
    (lambda: DAPO(group_size=2, loss_aggregation="sum"), "DAPO.loss_aggregation", "'sum'", "'seq_mean_token_sum_norm'"),
    (lambda: GRPO(group_size=2, kl_estimator="k4"), "GRPO.kl_estimator", "'k4'", "'k1', 'k2' or 'k3'"),
    (lambda: kl_penalty(torch.zeros(1), torch.zeros(1), "k4"), "kl_estimator", "'k4'", "'k1', 'k2' or 'k3'"),
    (lambda: SFT(timestep_sampling="beta"), "SFT.timestep_sampling", "'beta'", "'logit_normal' or 'uniform'"),
    (lambda: TrainsideRollout(sampling_policy="ema"), "rollout.sampling_policy", "'ema'", "'trainable' or 'shadow'"),
    (lambda: TextExampleBuilder(None, format="chat", max_length=8, fields={}), "TextExampleBuilder.format", "'chat'",
     "'prompt_completion' or 'text'"),
]


@pytest.mark.parametrize("build, name, value, allowed", CASES, ids=[c[1] for c in CASES])
def test_components_refuse_values_outside_their_literal(build, name, value, allowed):
    """Built directly in Python (no recipe): a ValueError naming the field, the value and the choices."""
    with pytest.raises(ValueError) as err:
        build()
    message = str(err.value)
    assert message.startswith(f"{name} must be one of ")
    assert allowed in message and message.endswith(f"got {value}")


def test_literal_values_and_none_where_allowed_pass():
    assert DedicatedRollout(placement="colocated").placement == "colocated"
    assert AsyncConfig(partial_rollout="resample").partial_rollout == "resample"
    check_choice("x", None, Literal["a"] | None)
    check_choice("x", 3, Literal["auto"] | int)
    with pytest.raises(ValueError, match=r"^x must be an int \(a whole number\) or 'auto', got 'a'$"):
        check_choice("x", "a", Literal["auto"] | int)
    with pytest.raises(ValueError, match=r"^x must be 'a', got None$"):
        check_choice("x", None, Literal["a"])
    with pytest.raises(ValueError, match="got True"):  # True == 1, but it is not the choice 1
        check_choice("x", True, Literal[1, 2])
    assert describe_choices(["a", "b", "c"]) == "one of 'a', 'b' or 'c'"


@dataclass(kw_only=True)
class Unresolvable:
    """A field whose annotation cannot be resolved at run time must not hide the others."""

    mode: Literal["a", "b"] = "a"
    """Checked."""
    table: OrderedDict | None = None
    """Unresolvable (imported only for type checking)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)


def test_one_unresolvable_annotation_leaves_the_literal_fields_checked():
    with pytest.raises(ValueError, match="Unresolvable.mode must be one of 'a' or 'b', got 'c'"):
        Unresolvable(mode="c")
    assert Unresolvable(mode="b").mode == "b"


def component(*, kind: Literal["x", "y"] = "x", size: int = 1) -> dict:
    check_literal_args(component, "component", locals())
    return {"kind": kind, "size": size}


def test_function_arguments_and_the_recipe_checker_use_the_same_annotation():
    with pytest.raises(ValueError, match="^component.kind must be one of 'x' or 'y', got 'z'$"):
        component(kind="z")
    node = {"part": {"_target_": f"{HERE}.component", "kind": "z"}}
    with pytest.raises(RecipeError, match=r"`part.kind` must be one of 'x' or 'y', got 'z' \(str\)"):
        validate_targets(node)
    validate_targets({"part": {"_target_": f"{HERE}.component", "kind": "y"}})


def _literal_value_sets(tree: ast.Module) -> list[set]:
    sets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if all(isinstance(i, ast.Constant) for i in items):
                sets.append({i.value for i in items})
    return sets


def test_no_module_repeats_a_literal_in_a_hand_written_membership_check():
    """``x not in ("a", "b")`` (or a tuple constant) matching some ``Literal["a", "b"]`` of the package is the
    duplicate this mechanism replaced."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(PACKAGE.rglob("*.py"))}
    literals = [values for tree in trees.values() for values in _literal_value_sets(tree)]
    offenders = []
    for path, tree in trees.items():
        constants = {}
        for node in ast.walk(tree):  # NAME = ("a", "b") tuples / sets
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.Set)):
                if all(isinstance(e, ast.Constant) for e in node.value.elts):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            constants[target.id] = {e.value for e in node.value.elts}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                continue
            right = node.comparators[-1]
            if isinstance(right, (ast.Tuple, ast.Set)) and all(isinstance(e, ast.Constant) for e in right.elts):
                values = {e.value for e in right.elts}
            elif isinstance(right, ast.Name) and right.id in constants:
                values = constants[right.id]
            else:
                continue
            if len(values) > 1 and any(values == lit or values == lit - {"auto"} for lit in literals):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == [], f"check these with unirl_ray.config.checks instead of a hand-kept list: {offenders}"


def test_a_shared_alias_gives_its_plain_values():
    assert typing.get_args(EmaTiming) == ("rollout_end", "optimizer_step")


def test_bounds_in_annotations_are_checked_in_python_and_in_recipes():
    from typing import Annotated

    from unirl_ray.config.checks import Bound, check_choice
    from unirl_ray.train.stack import TrainStack

    norm = Annotated[float, Bound(gt=0, why="null: no clipping")] | None
    check_choice("x", None, norm)
    check_choice("x", 0.5, norm)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^x must be > 0 \(null: no clipping\), got "):
            check_choice("x", bad, norm)
    assert Bound(ge=1, lt=8).describe() == ">= 1 and < 8"
    with pytest.raises(ValueError, match=r"^stack.max_grad_norm must be > 0 .*got -1$"):
        TrainStack(max_grad_norm=-1)
    with pytest.raises(RecipeError, match=r"^`stack.num_updates_per_batch` must be >= 1, got 0"):
        validate_targets({"stack": {"_target_": "unirl_ray.train.stack.TrainStack", "num_updates_per_batch": 0}})
