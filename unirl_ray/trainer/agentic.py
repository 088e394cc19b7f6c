"""``AgenticTrainer``: multi-turn tool use, the final answer scored by the reward service, one group advantage
training every assistant turn.

The step is ``RLTrainer``'s, with the rollout done by a ``RolloutManager`` (``rollout.manager``) over the
dedicated engine (``rollout: DedicatedRollout``; ``placement: colocated`` as in the seed, ``separate`` too):

    prompts  -> each prompt group_size times
    rollout  -> every trajectory run to its end: engine turn (token in, token out) -> environment step
                (tools, concurrently) -> ... -> answer; barrier: only complete groups come back
    reward   -> the answer (the ``completions`` column) scored by the reward app(s); per-turn rewards
                of the environment, if any, are added; a failed trajectory's reward is None
    credit   -> group-relative advantages (``trainer.credit: trajectory``: every turn the trajectory's;
                ``turn``: each turn its return-to-go against the group's baseline)
    train    -> each trajectory one row: its turns chained, observation tokens masked, each turn a
                sequence in the aggregation (``algorithms.grpo``); a failed trajectory trains no token
    sync     -> the manager quiesces (no engine call in flight), then the verified weight push
    log      -> ``agent/*`` metrics; every ``tracking.log_samples_every`` steps a table of whole transcripts

The recipe adds two sections to an AR engine recipe: ``environment`` (built once per trajectory, with the
policy's tokenizer as ``tokenizer=`` where it takes one: ``agentic.ToolEnvironment`` or your own
``agentic.Environment``) and ``agent`` (``rollout.manager.AgentRolloutConfig``, optional). The engine's
``pipeline.max_prompt_tokens`` is the longest context a turn may see; ``pipeline.max_new_tokens`` the
longest turn.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Literal

from unirl_ray.algorithms.advantages import group_advantages
from unirl_ray.algorithms.credit import CreditAssignment
from unirl_ray.config.checks import check_literal_fields
from unirl_ray.config.recipe import RecipeError, instantiate, locate
from unirl_ray.core.sample import Sample, TextPart, routed_parts
from unirl_ray.trainer.ar import ARRunConfig, ARTrainer, pipeline_setting
from unirl_ray.trainer.base import derive_seed
from unirl_ray.trainer.rl import RLTrainer


@dataclass(kw_only=True)
class AgenticRunConfig(ARRunConfig):
    """The ``trainer:`` block of an agentic recipe."""

    credit: Literal["trajectory", "turn"] = "trajectory"
    """``trajectory``: every assistant turn trains on its trajectory's group-relative advantage. ``turn``: each
    turn on its own return-to-go (the environment's rewards from that turn on plus the answer's reward) minus
    the group's mean return, over the group's standard deviation (needs an environment with per-turn rewards
    to differ from ``trajectory``)."""
    transcripts_logged: int = 8
    """Whole transcripts per table (every ``tracking.log_samples_every`` steps)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_literal_fields(self, "trainer")
        if self.transcripts_logged < 1:
            raise ValueError(f"trainer.transcripts_logged must be >= 1, got {self.transcripts_logged}")


class TurnCredit(CreditAssignment):
    """``trainer.credit: turn``: turn ``k`` of a trajectory trains on ``(G_k - mean_g) / (std_g + eps)``, where
    ``G_k`` is the reward of the answer plus the environment's rewards of turns ``k, k+1, ...`` and
    ``mean_g`` / ``std_g`` are over the returns ``G_0`` of the trajectory's group (its valid members). A
    trajectory with an invalid reward, or in a group whose valid returns are all equal (no signal), gets 0 on
    every turn."""

    def assign(self, samples: list[Sample]) -> dict[str, float]:
        baseline, metrics = group_advantages([s.reward for s in samples], [s.group_id for s in samples],
                                             normalize_std=getattr(self.algorithm, "normalize_std", True))
        stats: dict[str, list[float]] = {}
        for s in samples:
            if s.reward is not None and math.isfinite(s.reward):
                stats.setdefault(s.group_id, []).append(float(s.reward))
        for s, adv in zip(samples, baseline):
            turns = routed_parts(s, TextPart, getattr(self.algorithm, "stage", None))
            values = stats.get(s.group_id, [])
            if s.reward is None or not math.isfinite(s.reward) or len(values) < 2 or max(values) == min(values):
                for part in turns:
                    part.advantage = 0.0
                s.advantage = 0.0
                continue
            mean = math.fsum(values) / len(values)
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            scale = (std + 1e-4) if getattr(self.algorithm, "normalize_std", True) else 1.0
            later = [p.reward or 0.0 for p in turns]  # the environment's own reward of each turn
            answer_reward = float(s.reward) - math.fsum(later)
            for k, part in enumerate(turns):
                part.advantage = (answer_reward + math.fsum(later[k:]) - mean) / scale
            s.advantage = adv
        return metrics


class AgenticTrainer(ARTrainer):
    """Agentic RL over a dedicated engine with a RolloutManager (see the module docstring)."""

    domain = "agentic"
    driver_sections = (*RLTrainer.driver_sections, "environment", "agent")

    def optional_sections(self) -> set[str]:
        return super().optional_sections() | {"agent"}

    # ------------------------------------------------------------ validation
    def validate_domain(self) -> None:
        super().validate_domain()
        from unirl_ray.models.causal_lm.bundle import tokenizer_from_config
        from unirl_ray.rollout.manager import AgentRolloutConfig

        if self.dedicated is None:
            raise RecipeError("an agentic recipe rolls out through a dedicated engine (the RolloutManager drives "
                              "it turn by turn): set rollout._target_: unirl_ray.rollout.DedicatedRollout")
        if self.bundle_cfg is None or not hasattr(self.bundle_cfg, "pretrained_model_path"):
            raise RecipeError("an agentic recipe trains a causal LM: bundle.config must be a CausalLMConfig")
        self.agent_cfg = self._build("agent") if self.recipe.get("agent") is not None else AgentRolloutConfig()
        try:
            self.tokenizer = tokenizer_from_config(self.bundle_cfg)
        except ValueError as exc:
            raise RecipeError(f"bundle.config: {exc}") from None
        pipeline = self.recipe.pipeline
        longest = pipeline_setting(pipeline, "max_prompt_tokens")
        if not isinstance(longest, int) or isinstance(longest, bool):
            raise RecipeError(f"pipeline.max_prompt_tokens must be set (the longest context a turn may see), "
                              f"got {longest!r}")
        self.max_context_tokens = longest
        self._env_takes_tokenizer = _accepts(locate(self.recipe.environment.get("_target_"), "environment"), "tokenizer")
        env = self.make_environment()  # built once here: a bad environment section fails before workers start
        for method in ("reset", "step", "answer"):
            if not callable(getattr(env, method, None)):
                raise RecipeError(f"environment {type(env).__name__} has no {method}(); an environment implements "
                                  "reset(row) -> messages, step(message) -> (observation, reward, done), answer()")
        if callable(getattr(env, "close", None)):
            env.close()

    def make_environment(self) -> Any:
        """One trajectory's environment (the ``environment`` section, with the policy's tokenizer if it takes one)."""
        extra = {"tokenizer": self.tokenizer} if self._env_takes_tokenizer else {}
        return instantiate(self.recipe.environment, **extra)

    def make_credit(self) -> CreditAssignment:
        return TurnCredit(self.algorithm) if self.run_cfg.credit == "turn" else super().make_credit()

    # -------------------------------------------------------------- services
    def make_manager(self, engine: Any) -> Any:
        """The engine's RolloutManager runs whole trajectories (RLTrainer quiesces it before every sync)."""
        from unirl_ray.rollout.manager import RolloutManager

        return RolloutManager(engine, make_env=self.make_environment, tokenizer=self.tokenizer,
                              max_context_tokens=self.max_context_tokens, cfg=self.agent_cfg,
                              turn_seed=lambda seed, turn: derive_seed(seed, "turn", turn))

    # ------------------------------------------------------------- one step
    def rollout(self, requests: list[dict[str, Any]]) -> list[Sample]:
        trajectories = self.on_engine(self.engine, requests, trajectories=True)
        self.trajectories = trajectories
        filler = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id)
        return [t.to_sample(filler) for t in trajectories]

    def collect(self, step: int) -> tuple[list[Sample], dict[str, Any]]:
        from unirl_ray.rollout.manager import agent_metrics

        samples, metrics = super().collect(step)
        metrics |= self.settle(samples, self.trajectories)
        metrics |= agent_metrics(self.trajectories)
        return samples, metrics

    @staticmethod
    def settle(samples: list[Sample], trajectories: list[Any]) -> dict[str, float]:
        """After the reward service: a failed trajectory's reward is None (it never trains as if it had one); an
        environment's per-turn rewards go to their turns (``Part.reward``) and are added to the sample's."""
        with_turn_rewards = 0
        for s, t in zip(samples, trajectories):
            if t.failure is not None:
                s.rewards = {k: None for k in s.rewards} | {"trajectory": None}
                s.reward = None
                continue
            given = [r for r in t.turn_rewards if r is not None]
            if not given:
                continue
            with_turn_rewards += 1
            for part, r in zip(s.parts, t.turn_rewards):
                part.reward = r
            s.rewards["environment"] = math.fsum(given)
            s.reward = None if s.reward is None else float(s.reward) + math.fsum(given)
        return {"agent/turn_rewarded_frac": with_turn_rewards / max(len(samples), 1)}

    def check_trained_rows(self, samples: list[Sample]) -> None:
        """Every trajectory's turns chain into one row that is, token for token, what the engine sampled, with
        loss mask 1 exactly on the sampled turns of a valid trajectory (asserted on every trajectory of a step)."""
        from unirl_ray.core.sample import chain_turns

        for s, t in zip(samples, self.trajectories):
            if not t.turns:
                continue
            row = chain_turns(s, routed_parts(s, TextPart))  # type: ignore[arg-type]
            ids = row.prompt_ids.tolist() + row.completion_ids.tolist()
            if ids != t.transcript.ids[: len(ids)]:
                raise AssertionError(f"trajectory {s.sample_id}: the row trained is not the ids the engine sampled")
            want = [float(m) if t.failure is None else 0.0 for m in t.transcript.loss_mask[len(row.prompt_ids):len(ids)]]
            if row.loss_mask.tolist() != want:
                raise AssertionError(f"trajectory {s.sample_id}: the loss mask is not 1 exactly on its sampled turns")

    def learn(self, step: int, samples: list[Sample], metrics: dict[str, Any], t_step: float) -> dict[str, Any]:
        self.check_trained_rows(samples)
        return super().learn(step, samples, metrics, t_step)

    # ------------------------------------------------------------- logging
    def log_samples(self, step: int, samples: list[Sample]) -> None:
        shown = list(zip(samples, self.trajectories))[: self.run_cfg.transcripts_logged]
        self.tracker.log_table(transcript_table(step, shown, self.tokenizer), f"transcripts/step_{step:06d}.json")

    # ------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts run as whole trajectories on the engine (the weights last published), one each with
        seeds fixed across evaluations, scored by the reward app; metrics under ``eval/``."""
        import time

        from unirl_ray.rollout.manager import agent_metrics

        t0 = time.perf_counter()
        samples = self.rollout(self.eval_requests())
        scored = self.reward.score(samples)
        self.settle(samples, self.trajectories)
        valid = [s.reward for s in samples if s.reward is not None]
        metrics = {"eval/reward_mean": math.fsum(valid) / len(valid) if valid else float("nan"),
                   "eval/reward_std": scored.get("reward/std", float("nan"))}
        metrics |= {f"eval/{k}": v for k, v in agent_metrics(self.trajectories).items()}
        self.tracker.log_table(transcript_table(step, list(zip(samples, self.trajectories)), self.tokenizer),
                               f"eval/transcripts_step_{step:06d}.json")
        metrics["timing/eval"] = time.perf_counter() - t0
        return metrics


def transcript_table(step: int, rows: list[tuple[Sample, Any]], tokenizer: Any) -> dict[str, list[Any]]:
    """Columns of a transcripts table: the whole conversation as the model saw it, its turns, tool calls,
    observations, answer, reward and how it ended."""
    table: dict[str, list[Any]] = {k: [] for k in ("step", "prompt", "transcript", "turns", "tool_calls",
                                                    "tool_errors", "observations", "answer", "reward", "advantage",
                                                    "finish", "failure", "policy_versions")}
    for s, t in rows:
        stats = t.env.stats()
        observations = [m.get("content", "") for m in t.transcript.messages if m.get("role") not in ("assistant", "user", "system")]
        for key, value in (("step", step), ("prompt", s.prompt), ("transcript", tokenizer.decode(t.transcript.ids)),
                           ("turns", t.turns), ("tool_calls", stats.get("tool_calls", 0.0)),
                           ("tool_errors", stats.get("tool_errors", 0.0)), ("observations", observations),
                           ("answer", t.answer), ("reward", s.reward), ("advantage", s.advantage),
                           ("finish", t.finish), ("failure", t.failure), ("policy_versions", list(t.versions))):
            table[key].append(value)
    return table


def _accepts(target: Any, name: str) -> bool:
    """Whether calling ``target`` accepts the keyword ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
