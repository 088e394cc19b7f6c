"""The data contract between rollout, reward, algorithm and train stack.

A ``Sample`` is one generated response to one prompt. It holds an ordered list of ``Part``s, one per
generated segment (a diffusion trajectory, a text completion, later tool calls), so that trainers
that produce several segments per sample (prompt enhancer, unified model, agentic loops) use the
same record. Every sample carries the policy version that produced it.

Tensors in parts are CPU tensors with the shapes given in each field's docstring. ``Sample.light()``
drops the heavy tensors so that the driver only moves what rewards and logging need; train workers
keep the full sample in their rollout cache and look it up by ``sample_id``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from unirl_ray.core.wire import pack_tree, unpack_tree


@dataclass(kw_only=True)
class Part:
    """One generated segment of a sample. Subclasses say which family produced it.

    Pickling carries CPU tensors as numpy arrays (``unirl_ray.core.wire``): samples cross several
    processes per step (engine -> rollout stream -> driver -> train ranks).
    """

    kind: str = "part"
    """Family tag: ``"diffusion"``, ``"text"``, ..."""
    stage: str | None = None
    """The side / stage that produced this Part and trains it (e.g. ``"ar"`` and ``"diffusion"`` in a
    prompt-enhancer Sample); ``None`` in a single-side recipe. Algorithms take the Parts of their stage
    (``routed_part``), never "the first Part of a kind"."""
    part_id: str | None = None
    """Identity of this Part where several samples share it (the M images of one rewrite each carry a
    copy of the rewrite Part with the same id); ``None`` when the Part is its sample's own."""
    reward: float | None = None
    """This Part's own reward, where credit assignment gives it one (a rewrite scored by its images);
    ``None`` means the sample's reward applies."""
    advantage: float | None = None
    """Per-part advantage; ``None`` means the sample's advantage applies."""
    policy_version: int | None = None
    """Version of the weights that generated this Part where it may differ from the sample's (the turns of an
    agent's trajectory are each tagged); ``None`` means ``Sample.policy_version``."""

    def light(self) -> "Part":
        """A copy without the heavy tensors (for the driver)."""
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {k: pack_tree(v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: unpack_tree(v) for k, v in state.items()})

    @property
    def is_light(self) -> bool:
        return False


@dataclass(kw_only=True)
class DiffusionPart(Part):
    """A recorded denoising trajectory of a flow / diffusion model.

    ``T`` is the number of sampling steps; ``latent_shape`` is ``[C, H, W]`` for images and
    ``[C, F, H, W]`` for videos (the time axis sits after the channels).
    """

    kind: str = "diffusion"
    latents: torch.Tensor | None = None
    """[T+1, *latent_shape] x_0 = initial noise ... x_T = final latent, in sampling order."""
    log_probs: torch.Tensor | None = None
    """[T] behaviour log-prob of each transition latents[t] -> latents[t+1] (mean over elements)."""
    sigmas: torch.Tensor | None = None
    """[T+1] noise levels of the schedule used, sigmas[0] = 1 (pure noise) ... sigmas[T] = 0."""
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    """Conditioning tensors without batch axis (e.g. ``prompt_embeds`` [L, D], ``pooled`` [P])."""

    def light(self) -> "DiffusionPart":
        return dataclasses.replace(self, latents=None, log_probs=None, sigmas=None, cond={})

    @property
    def is_light(self) -> bool:
        return self.latents is None

    @property
    def num_steps(self) -> int:
        assert self.log_probs is not None, "light part has no trajectory"
        return int(self.log_probs.shape[0])


@dataclass(kw_only=True)
class TextPart(Part):
    """A generated token segment (used by the AR trainers)."""

    kind: str = "text"
    prompt_ids: torch.Tensor | None = None
    """[P] token ids of the context this segment was generated from."""
    completion_ids: torch.Tensor | None = None
    """[C] generated token ids."""
    log_probs: torch.Tensor | None = None
    """[C] behaviour log-probs of the generated tokens."""
    loss_mask: torch.Tensor | None = None
    """[C] 1 for tokens that are trained on, 0 for tokens that are not (e.g. tool output)."""
    text: str = ""
    """Decoded completion."""
    num_tokens: int = 0
    """Generated tokens (kept when the part is made light, for length metrics)."""
    segments: torch.Tensor | None = None
    """[C] long: the turn each completion token belongs to (0, 1, ...), -1 on tokens that were not sampled
    (observations, template tokens between turns); ``None``: the completion is one turn. Set on the
    concatenation of a multi-turn trajectory (``chain_turns``), where each turn counts as a sequence."""
    vision: dict[str, torch.Tensor] | None = None
    """The prompt's images as the model reads them (a vision-language model's ``pixel_values`` [patches, D] and
    ``image_grid_thw`` [images, 3]); ``None`` for a text-only prompt."""

    def light(self) -> "TextPart":
        n = int(self.completion_ids.numel()) if self.completion_ids is not None else self.num_tokens
        return dataclasses.replace(
            self, prompt_ids=None, completion_ids=None, log_probs=None, loss_mask=None, num_tokens=n, segments=None,
            vision=None,
        )

    @property
    def is_light(self) -> bool:
        return self.completion_ids is None


@dataclass(kw_only=True)
class Sample:
    """One generated response to one prompt, with everything that later stages attach to it."""

    sample_id: str
    """Unique within a run: ``"s{step}-{index}"``."""
    group_id: str
    """Samples drawn for the same prompt share a group id (group-relative advantages)."""
    prompt: str
    columns: dict[str, Any] = field(default_factory=dict)
    """Other dataset columns of the prompt row (answers, metadata), passed to reward functions."""
    parts: list[Part] = field(default_factory=list)
    image: np.ndarray | None = None
    """[H, W, 3] uint8 decoded image (or [F, H, W, 3] frames) for rewards and logging."""
    policy_version: int = 0
    """Version of the weights that generated this sample."""
    rewards: dict[str, float | None] = field(default_factory=dict)
    """Per-source rewards before weighting; ``None`` marks an invalid score."""
    reward: float | None = None
    """Weighted total reward; ``None`` when any weighted source was invalid."""
    advantage: float | None = None
    """Advantage from the algorithm; ``None`` until computed, 0 for excluded samples."""

    def light(self) -> "Sample":
        return dataclasses.replace(self, parts=[p.light() for p in self.parts])

    @property
    def is_light(self) -> bool:
        return any(p.is_light for p in self.parts)


def routed_part(sample: Sample, part_type: type[Part], stage: str | None = None) -> Part:
    """The one Part of ``part_type`` that ``stage`` trains in ``sample``; ``ValueError`` if there is none
    or the choice is ambiguous.

    With a stage: the Parts of that stage, else the unnamed ones (a single-side recipe's Parts belong to
    its one side). Without one: every Part of the type, which must then be exactly one.
    """
    typed = [p for p in sample.parts if isinstance(p, part_type)]
    where = "" if stage is None else f" of stage {stage!r}"
    chosen = typed
    if stage is not None:
        chosen = [p for p in typed if p.stage == stage] or [p for p in typed if p.stage is None]
    if len(chosen) == 1:
        return chosen[0]
    name = part_type.__name__
    if not chosen:
        stages = sorted({str(p.stage) for p in typed})
        raise ValueError(f"sample {sample.sample_id!r} has no {name}{where}"
                         + (f" (its {name}s are of stage {', '.join(stages)})" if typed else ""))
    raise ValueError(f"{len(chosen)} {name}s{where} in sample {sample.sample_id!r} and no stage to choose by: "
                     "route each Part to the stage that trains it (Part.stage) and give the algorithm its stage")


def routed_parts(sample: Sample, part_type: type[Part], stage: str | None = None) -> list[Part]:
    """Every Part of ``part_type`` that ``stage`` trains in ``sample``, in order (``routed_part``'s choice
    without its one-Part rule: the turns of a multi-turn trajectory)."""
    typed = [p for p in sample.parts if isinstance(p, part_type)]
    if stage is None:
        return typed
    return [p for p in typed if p.stage == stage] or [p for p in typed if p.stage is None]


def chain_turns(sample: Sample, turns: list[TextPart]) -> TextPart:
    """The turns of a multi-turn trajectory as one sequence: ``prompt_ids`` of the first turn, then every turn's
    sampled ids (loss mask 1, its recorded log-probs, segment = its index) with the observation tokens between
    turns (mask 0, log-prob 0, segment -1).

    Each turn's context must be exactly everything before it: the previous turn's context, its sampled ids and
    then the observation. A turn whose context differs in one token (a re-tokenised history) is a
    ``ValueError``: the ids trained are the ids the engine sampled, token for token.
    """
    if len(turns) == 1:
        return turns[0]
    for t in turns:
        if t.is_light:
            raise ValueError(f"sample {sample.sample_id!r} has a light TextPart; chain_turns needs the full turns")
    pieces, masks, logps, segs = [], [], [], []
    prefix = turns[0].prompt_ids.long()
    n_prompt = len(prefix)
    for k, turn in enumerate(turns):
        context = turn.prompt_ids.long()
        if len(context) < len(prefix) or not torch.equal(context[: len(prefix)], prefix):
            where = next((i for i in range(min(len(context), len(prefix))) if context[i] != prefix[i]),
                         min(len(context), len(prefix)))
            raise ValueError(f"turn {k} of sample {sample.sample_id!r} does not continue the ids before it (first "
                             f"difference at token {where} of {len(prefix)}): its context was re-tokenised or edited")
        observation = context[len(prefix):]
        n_new, n_obs = len(turn.completion_ids), len(observation)
        mask = turn.loss_mask.float() if turn.loss_mask is not None else torch.ones(n_new)
        pieces += [observation, turn.completion_ids.long()]
        masks += [torch.zeros(n_obs), mask]
        logps += [torch.zeros(n_obs), turn.log_probs.float()]
        segs += [torch.full((n_obs,), -1, dtype=torch.long), torch.full((n_new,), k, dtype=torch.long)]
        prefix = torch.cat([context, turn.completion_ids.long()])
    completion = torch.cat(pieces)
    return TextPart(stage=turns[0].stage, prompt_ids=turns[0].prompt_ids.long(), completion_ids=completion,
                    log_probs=torch.cat(logps), loss_mask=torch.cat(masks), segments=torch.cat(segs),
                    text="".join(t.text for t in turns), num_tokens=len(prefix) - n_prompt,
                    vision=turns[0].vision)  # the images are those of the first context, which every turn continues


def part_advantage(sample: Sample, part: Part) -> float:
    """The advantage ``part`` trains on: its own where credit assignment set one, else the sample's."""
    value = part.advantage if part.advantage is not None else sample.advantage
    if value is None:
        raise ValueError(f"sample {sample.sample_id!r} has no advantage; call compute_advantages first")
    return float(value)


def complete_sample(light: Sample, cached: Sample) -> Sample:
    """``cached`` (the full sample a trainside rank kept) with every score the driver set on ``light``:
    the sample's rewards, reward and advantage and each Part's reward and advantage. The Parts must be the
    cached ones, in order (same type and stage); a mismatch is a ``ValueError``, never a silent mix-up."""
    if light.sample_id != cached.sample_id:
        raise ValueError(f"sample {light.sample_id!r} from the driver is not the same sample as {cached.sample_id!r}")
    if len(light.parts) != len(cached.parts):
        raise ValueError(f"sample {cached.sample_id!r} has {len(cached.parts)} Parts in the rank's cache but "
                         f"{len(light.parts)} from the driver")
    for i, (got, kept) in enumerate(zip(light.parts, cached.parts)):
        if type(got) is not type(kept) or got.stage != kept.stage:
            raise ValueError(f"Part {i} of sample {cached.sample_id!r} is a {type(got).__name__} of stage "
                             f"{got.stage!r} from the driver but a {type(kept).__name__} of stage {kept.stage!r} "
                             "in the rank's cache")
    cached.rewards, cached.reward, cached.advantage = light.rewards, light.reward, light.advantage
    for got, kept in zip(light.parts, cached.parts):
        kept.reward, kept.advantage = got.reward, got.advantage
    return cached


@dataclass(kw_only=True)
class TrainStepResult:
    """What one ``TrainStack.train`` call reports (already reduced over ranks)."""

    metrics: dict[str, float]
    """Namespaced scalars: ``train/loss``, ``algo/clip_frac``, ``timing/...``."""
    policy_version: int
    """Version of the weights after this step's optimizer updates."""
    num_samples: int
    """Samples trained on, over all ranks."""
    num_optimizer_steps: int
