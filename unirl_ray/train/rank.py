"""What a train rank holds: one or more named sides, and the commands the controller sends it.

A **side** is bundle + pipeline and, when it trains, backend + algorithm + stack; optionally a trainside
rollout. Each side is built once per worker from its recipe sections, in the seed's order::

    bundle    = build(bundle_cfg)
    pipeline  = build(pipeline_cfg, bundle=bundle)
    backend   = build(backend_cfg, bundle=bundle)            # FSDPBackend
    algorithm = build(algorithm_cfg, pipeline=pipeline)      # StageAlgorithm, or {stage: StageAlgorithm}
    stack     = build(stack_cfg, fsdp_backend=backend, algorithm=algorithm)
    rollout   = build(rollout_cfg, pipeline=pipeline, backend=backend)   # trainside rollout

A side's ``algorithm:`` may map stage names to algorithms (``{text: GRPO, image: FlowGRPO}``): several
stages over one backend, trained by a ``UnifiedModelTrainStack`` in one optimizer step (the unified
model); each stage's algorithm gets the pipeline's view of its stage (``pipeline.stage_pipelines``) and
the Parts the pipeline names with its stage.

A flat recipe (``bundle``, ``pipeline``, ... at the top) is one implicit side; its checkpoints, policy
version and exports are what they always were. A recipe with ``sides: {ar: {...}, diffusion: {...}}``
(the prompt enhancer's rewriter and image model) gets one side per entry, in that order on every rank,
so the sides' collectives (FSDP, checkpoints) line up. A side without ``backend`` is rollout-only: no
optimizer memory, nothing checkpointed, policy version 0. Every Part a named side generates carries
the side's name (``Part.stage``) and its algorithm trains the Parts of that name only.

Plain Python (no Ray): the worker loop in ``runtime.worker`` drives it, and tests and benchmarks
can drive it directly in one process. Its commands are the methods marked ``@operation``
(``runtime.operations``): the runtime dispatches ``TrainGroup.call(name, payload)`` to them by name;
commands that concern one side take ``side=`` (optional where the rank has one side).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.config.recipe import instantiate
from unirl_ray.core.sample import Sample, complete_sample, part_advantage
from unirl_ray.runtime.operations import operation
from unirl_ray.train.configs import TrainTopology

if TYPE_CHECKING:
    from unirl_ray.train.export import ExportInfo

log = logging.getLogger(__name__)

IMPLICIT_SIDE = "policy"
"""The name of a flat recipe's one side."""
SIDE_SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")
"""The sections a side is built from (``bundle`` and ``pipeline`` required)."""


def is_stage_mapping(cfg: Any) -> bool:
    """Whether an ``algorithm:`` section maps stage names to algorithm configs (no ``_target_`` of its own)."""
    return isinstance(cfg, dict) and "_target_" not in cfg and bool(cfg) and all(isinstance(v, dict) for v in cfg.values())


class Side:
    """One named side of a train rank (see the module docstring)."""

    def __init__(self, name: str, sections: dict[str, Any], *, topology: TrainTopology, device: torch.device,
                 stage: str | None) -> None:
        self.check_sections(name, sections)
        self.name, self.stage = name, stage
        self.bundle = instantiate(sections["bundle"])
        if hasattr(self.bundle, "to"):
            self.bundle.to(device)
        self.pipeline = instantiate(sections["pipeline"], bundle=self.bundle)
        self.backend = self.algorithm = self.stack = None
        if sections.get("backend") is not None:
            self.backend = instantiate(sections["backend"], bundle=self.bundle)
            self.algorithm = self._algorithms(sections["algorithm"])
            self.stack = instantiate(sections["stack"], fsdp_backend=self.backend, algorithm=self.algorithm)
            needs_reference = any(a.needs_reference for a in self.stage_algorithms().values())
            self.backend.setup(topology=topology, device=device, needs_reference=needs_reference)
        self.rollout = None
        if sections.get("rollout") is not None:
            self.rollout = instantiate(sections["rollout"], pipeline=self.pipeline, backend=self.backend)

    def _algorithms(self, cfg: Any) -> Any:
        """The side's ``StageAlgorithm``, or ``{stage: StageAlgorithm}`` when ``algorithm:`` maps stages to algorithms
        (several stages over one backend: ``UnifiedModelTrainStack``); each stage's algorithm gets its view of
        the pipeline (``pipeline.stage_pipelines[stage]``) and trains the Parts of its stage."""
        if not is_stage_mapping(cfg):
            algorithm = instantiate(cfg, pipeline=self.pipeline)
            algorithm.stage = self.stage
            return algorithm
        views = getattr(self.pipeline, "stage_pipelines", None)
        if not isinstance(views, dict):
            raise ValueError(f"side {self.name!r}: algorithm maps stages ({', '.join(cfg)}) to algorithms, but "
                             f"{type(self.pipeline).__name__} has no stages (stage_pipelines); give one algorithm")
        unknown = sorted(set(cfg) - set(views))
        if unknown:
            raise ValueError(f"side {self.name!r}: algorithm names stage(s) {', '.join(unknown)}, but "
                             f"{type(self.pipeline).__name__} has stages {', '.join(views)}")
        kinds = getattr(self.pipeline, "stage_parts", {})
        algorithms = {}
        for stage_name, stage_cfg in cfg.items():
            algorithm = instantiate(stage_cfg, pipeline=views[stage_name])
            if stage_name in kinds and algorithm.part_type is not kinds[stage_name]:
                raise ValueError(f"side {self.name!r}: the algorithm of stage {stage_name!r} ({type(algorithm).__name__}) "
                                 f"does not train {kinds[stage_name].__name__}s, which that stage generates")
            algorithm.stage = stage_name
            algorithms[stage_name] = algorithm
        return algorithms

    def stage_algorithms(self) -> dict[str | None, Any]:
        """``{stage: algorithm}`` of a multi-stage side, ``{side stage: algorithm}`` otherwise (empty: rollout-only)."""
        if self.algorithm is None:
            return {}
        return dict(self.algorithm) if isinstance(self.algorithm, dict) else {self.stage: self.algorithm}

    @staticmethod
    def check_sections(name: str, sections: dict[str, Any]) -> None:
        """``ValueError`` naming the side when its sections cannot make a side."""
        unknown = sorted(set(sections) - set(SIDE_SECTIONS))
        if unknown:
            raise ValueError(f"side {name!r}: unknown section(s) {', '.join(unknown)}; a side has {', '.join(SIDE_SECTIONS)}")
        missing = [k for k in ("bundle", "pipeline") if sections.get(k) is None]
        if missing:
            raise ValueError(f"side {name!r} needs {' and '.join(missing)}")
        trains = sections.get("backend") is not None
        if not trains and any(sections.get(k) is not None for k in ("algorithm", "stack")):
            raise ValueError(f"side {name!r} has an algorithm / stack but no backend: give it a backend to train it, "
                             "or drop them to make it rollout-only")
        if trains and any(sections.get(k) is None for k in ("algorithm", "stack")):
            raise ValueError(f"side {name!r} has a backend: it needs an algorithm and a stack too")

    @property
    def trainable(self) -> bool:
        return self.backend is not None

    @property
    def policy_version(self) -> int:
        return self.stack.policy_version if self.stack is not None else 0

    def require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise ValueError(f"side {self.name!r} is rollout-only (no backend): it cannot {what}")


class StackWorker:
    """One train rank: its sides and the operations the controller asks of them."""

    def __init__(self, sections: dict[str, Any], *, topology: TrainTopology, device: torch.device,
                 open_shard: Callable[[str], Callable[[], Any] | None] | None = None) -> None:
        """``sections``: a flat recipe's side sections, or ``{"sides": {name: side sections}}``.
        ``open_shard(name)``: a function that starts a new epoch over this rank's shard of Ray Data
        dataset ``name`` (None when the run has no such dataset); given by the worker program."""
        self.topology = topology
        self.device = device
        self.open_shard = open_shard or (lambda name: None)
        named = sections.get("sides")
        self.implicit = named is None
        if self.implicit:
            specs = {IMPLICIT_SIDE: {k: v for k, v in sections.items() if k in SIDE_SECTIONS}}
        else:
            if not isinstance(named, dict) or not named:
                raise ValueError("sides must map side names to their sections, e.g. sides: {ar: {...}, diffusion: {...}}")
            extra = sorted(k for k in sections if k in SIDE_SECTIONS and sections[k] is not None)
            if extra:
                raise ValueError(f"a recipe with sides has no top-level {', '.join(extra)}: move them into a side")
            specs = dict(named)
        for name, spec in specs.items():  # every layout error before any model is built
            Side.check_sections(name, spec)
        if not any(spec.get("backend") is not None for spec in specs.values()):
            raise ValueError(f"no side of this rank trains (sides {', '.join(specs)} have no backend): "
                             "give at least one side a backend, algorithm and stack")
        self.sides = {name: Side(name, spec, topology=topology, device=device, stage=None if self.implicit else name)
                      for name, spec in specs.items()}
        self._cache: dict[str, Sample] = {}

    def side(self, name: str | None = None) -> Side:
        """Side ``name``; without a name the rank's only side."""
        if name is None:
            if len(self.sides) == 1:
                return next(iter(self.sides.values()))
            raise ValueError(f"this rank holds sides {', '.join(self.sides)}: name one (side=...)")
        if name not in self.sides:
            raise ValueError(f"this rank has no side {name!r}; it holds {', '.join(self.sides)}")
        return self.sides[name]

    # the only side's objects (a flat recipe's), as the single-side trainers and tools use them
    bundle = property(lambda self: self.side().bundle)
    pipeline = property(lambda self: self.side().pipeline)
    backend = property(lambda self: self.side().backend)
    algorithm = property(lambda self: self.side().algorithm)
    stack = property(lambda self: self.side().stack)
    rollout = property(lambda self: self.side().rollout)

    @property
    def policy_version(self) -> int | dict[str, int]:
        """The weights' version: an int for a flat recipe's side, else ``{side: version}``."""
        if self.implicit:
            return self.side().policy_version
        return {name: side.policy_version for name, side in self.sides.items()}

    def _trained_sides(self, name: str | None) -> list[Side]:
        """Side ``name`` (which must train), or every side that trains, in the recipe's order."""
        if name is not None:
            side = self.side(name)
            side.require_trainable("train, offload or save")
            return [side]
        return [side for side in self.sides.values() if side.trainable]

    # ------------------------------------------------------------------ ops
    @operation
    def generate(self, requests: list[dict[str, Any]], side: str | None = None) -> list[Sample]:
        """Trainside rollout of this rank's requests on ``side``; keeps full samples (until ``train``),
        returns light ones. A named side's Parts carry its name (``Part.stage``)."""
        chosen = self.side(side)
        if chosen.rollout is None:
            where = "" if self.implicit else f" of side {chosen.name!r}"
            raise ValueError(f"this recipe has no trainside rollout section{where} (rollout: _target_: ...)")
        samples = chosen.rollout.generate(requests, policy_version=chosen.policy_version)
        for sample in samples:
            for part in sample.parts:
                if part.stage is None:  # a multi-stage pipeline names its Parts' stages itself
                    part.stage = chosen.stage
        self._cache.update((s.sample_id, s) for s in samples)
        return [s.light() for s in samples]

    @operation
    def eval_generate(self, requests: list[dict[str, Any]], use_ema: bool = False, side: str | None = None) -> list[Sample]:
        """Collective: sample ``requests`` with the trained module of ``side``, with its EMA weights when
        ``use_ema`` (``backend.ema_weights()`` swaps them back bit for bit); returns light samples (images kept)."""
        import contextlib

        from unirl_ray.rollout.trainside import TrainsideRollout

        chosen = self.side(side)
        rollout = TrainsideRollout(micro_batch_size=getattr(chosen.rollout, "micro_batch_size", 8),
                                   sampling_policy="trainable", pipeline=chosen.pipeline, backend=chosen.backend)
        ema = use_ema and chosen.backend is not None
        with chosen.backend.ema_weights() if ema else contextlib.nullcontext():
            samples = rollout.generate(requests, policy_version=chosen.policy_version)
        return [s.light() for s in samples]

    @operation
    def train(self, samples: list[Sample] | dict[str, list[Sample]], *, seed: int,
              side: str | None = None) -> dict[str, Any]:
        """Train on this rank's shard (light samples are completed from the rollout cache): side ``side``,
        or every side that trains, one after the other in the recipe's order (on every rank alike), each
        on the Parts routed to it. ``samples`` is one shard for every side, or (named sides) ``{side: shard}``
        when the driver routes each side its own samples (the prompt enhancer: one Sample per rewrite for
        the rewriter, one per image for the image model). A flat recipe's results are as they always were;
        with named sides the metrics are ``<side>/...``, versions and sample counts are ``{side: value}``
        and ``advantages`` is ``{side: [the advantage each trained Part got, in shard order]}`` (the driver
        checks them against the ones it assigned)."""
        sides = self._trained_sides(side)
        if isinstance(samples, dict):
            if self.implicit:
                raise ValueError("samples routed per side ({side: shard}) need a recipe with named sides")
            trained = [chosen.name for chosen in sides]
            if sorted(samples) != sorted(trained):
                raise ValueError(f"samples are routed to sides {', '.join(sorted(samples)) or '(none)'}, but this "
                                 f"step trains sides {', '.join(trained)}: route one shard to each")
            shards = {name: [self._complete(s) for s in shard] for name, shard in samples.items()}
        else:
            shard = [self._complete(s) for s in samples]
            shards = {chosen.name: shard for chosen in sides}
        results, advantages = {}, {}
        try:
            for chosen in sides:
                side_seed = seed if self.implicit else zlib.crc32(f"{seed}:{chosen.name}".encode())
                mine = shards[chosen.name]
                if isinstance(chosen.algorithm, dict):  # per stage, each distinct Part once (the stack's view)
                    advantages[chosen.name] = {stage: [part_advantage(s, a.part_of(s)) for s in chosen.stack.stage_samples(stage, mine)]
                                               for stage, a in chosen.algorithm.items()}
                elif not self.implicit:
                    advantages[chosen.name] = [part_advantage(s, chosen.algorithm.part_of(s)) for s in mine]
                results[chosen.name] = chosen.stack.train(mine, seed=side_seed)
        finally:
            self._cache.clear()
        if self.implicit:
            result = results[IMPLICIT_SIDE]
            out = {"metrics": result.metrics, "policy_version": result.policy_version, "num_samples": result.num_samples}
            if IMPLICIT_SIDE in advantages:  # a multi-stage side: {stage: [advantage of each trained Part]}
                out["advantages"] = advantages[IMPLICIT_SIDE]
            return out
        return {
            "metrics": {f"{name}/{key}": value for name, r in results.items() for key, value in r.metrics.items()},
            "policy_version": {name: r.policy_version for name, r in results.items()},
            "num_samples": {name: r.num_samples for name, r in results.items()},
            "advantages": advantages,
        }

    def _complete(self, sample: Sample) -> Sample:
        if not sample.is_light:
            return sample
        cached = self._cache.get(sample.sample_id)
        if cached is None:
            raise KeyError(
                f"sample {sample.sample_id} carries no trajectory and is not in this rank's rollout cache; "
                "samples of a trainside rollout must be trained on the rank that generated them"
            )
        return complete_sample(sample, cached)  # every score the driver set, the sample's and each Part's

    @operation
    def export_weights(self, side: str | None = None, stage_in: list[str] | None = None) -> dict[str, Any]:
        """Collective: the full trainable weights of ``side`` (LoRA adapters only with LoRA) on rank 0.

        ``stage_in`` (``[name, namespace]`` of the engine's ``WeightStore``): rank 0 puts them in the object
        store itself and stages them there, returning only their checksum and size; else it returns them."""
        from unirl_ray.rollout.weight_sync import stage_weights, state_bytes, state_checksum

        chosen = self.side(side)
        chosen.require_trainable("export weights")
        t0 = time.perf_counter()
        # staged: put in the object store before this command returns, so it need not be a snapshot
        state = chosen.backend.full_trainable_state_dict(snapshot=stage_in is None)
        if self.topology.rank != 0:
            return {}
        t1 = time.perf_counter()
        version = chosen.policy_version
        if stage_in is None:
            checksum = state_checksum(state)
            timings = {"gather_s": t1 - t0, "checksum_s": time.perf_counter() - t1}
            return {"state": state, "checksum": checksum, "policy_version": version, "timings": timings}
        staged = stage_weights(state, version, (stage_in[0], stage_in[1]))  # the checksum while the put copies
        timings = {"gather_s": t1 - t0, "checksum_s": staged["checksum_s"], "put_s": staged["put_s"]}
        return {"checksum": staged["checksum"], "policy_version": version, "bytes": state_bytes(state),
                "timings": timings}

    @operation
    def export(self, directory: str, merge_lora: bool = True, overwrite: bool = False,
               side: str | None = None) -> ExportInfo | None:
        """Collective: write the trained model of ``side`` as a ``from_pretrained`` folder on rank 0
        (``train.export``). Returns the ``ExportInfo`` on rank 0, ``None`` on the other ranks.
        """
        from unirl_ray.train.export import export_model

        chosen = self.side(side)
        chosen.require_trainable("export a trained model")
        return export_model(
            chosen.bundle,
            chosen.backend,
            directory,
            merge_lora=merge_lora,
            overwrite=overwrite,
            policy_version=chosen.policy_version,
        )

    # ---------------------------------------------------- colocated turns
    @operation
    def offload(self, side: str | None = None) -> dict[str, int]:
        """Hand the device memory of ``side`` (default: every side that trains) to a colocated engine:
        ``bytes`` freed and ``resident_bytes`` (device bytes the train state still holds: 0 when all moved)."""
        sides = self._trained_sides(side)
        freed = sum(chosen.backend.offload() for chosen in sides)
        return {"bytes": freed, "resident_bytes": sum(chosen.backend.device_bytes() for chosen in sides)}

    @operation
    def onload(self, side: str | None = None) -> dict[str, int]:
        """Take the device memory back (bit for bit) before training."""
        sides = self._trained_sides(side)
        moved = sum(chosen.backend.onload() for chosen in sides)
        return {"bytes": moved, "resident_bytes": sum(chosen.backend.device_bytes() for chosen in sides)}

    # ------------------------------------------------------------------ SFT
    @operation
    def sft_start(self, source: Any, records_per_rank: int, cursor: dict[str, int],
                  rows: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build this rank's SFT feed (``data.sft_feed``) over its shards of datasets ``train`` and
        ``eval`` and move it to ``cursor``; ``source`` is the driver's ``RecordSource``. ``rows``: this rank's
        records where the driver split them (``RecordSource.driver_shards``: its training rows, every held-out
        row); None: Ray Train's shards (``open_shard``)."""
        from unirl_ray.data.sft_feed import SFTFeed

        if rows is not None:
            train, held_out = rows["train"], rows.get("eval")
            open_train = lambda: iter(train)  # noqa: E731 - a new epoch: the same rows, in the same order
            open_eval = None if held_out is None else (lambda: iter(held_out))
        else:
            open_train, open_eval = self.open_shard("train"), self.open_shard("eval")
        self.sft_feed = SFTFeed(
            source, records_per_rank=int(records_per_rank), bundle=self.bundle,
            pipeline=self.pipeline, algorithm=self.algorithm, stack=self.stack, rank=self.topology.rank,
            world_size=self.topology.world_size, open_train=open_train, open_eval=open_eval,
        )
        self.sft_feed.seek(cursor)
        return {"cursor": self.sft_feed.cursor()}

    @operation
    def sft_train(self, seeds: list[int]) -> list[dict[str, Any]]:
        """Collective: one SFT optimizer step per seed on records this rank pulls from its shard."""
        if getattr(self, "sft_feed", None) is None:
            raise RuntimeError("this rank has no SFT feed: sft_start must come first (did the worker group restart?)")
        return self.sft_feed.train(seeds)

    @operation
    def sft_eval(self) -> dict[str, Any]:
        """Collective: this rank's summed held-out loss (one pass over the held-out records)."""
        if getattr(self, "sft_feed", None) is None:
            raise RuntimeError("this rank has no SFT feed: sft_start must come first (did the worker group restart?)")
        return self.sft_feed.evaluate()

    # ----------------------------------------------------------- checkpoint
    def save(self, directory: str) -> dict[str, Any]:
        """Collective: this rank's shards of every side that trains; returns the JSON-able state.

        A flat recipe's side writes into ``directory`` itself (as always); named sides write into
        ``directory/<side>/`` and the state is ``{"sides": {side: state}}``. Rollout-only sides write nothing.
        """
        t0 = time.perf_counter()
        metas = {}
        for chosen in self._trained_sides(None):
            meta = chosen.backend.save(directory if self.implicit else os.path.join(directory, chosen.name))
            meta["policy_version"] = chosen.policy_version
            metas[chosen.name] = meta
        log.debug("rank %d saved shards in %.2fs", self.topology.rank, time.perf_counter() - t0)
        return metas[IMPLICIT_SIDE] if self.implicit else {"sides": metas}

    def save_async(self, directory: str) -> tuple[dict[str, Any], Callable[[], None]]:
        """``save`` in two parts (``FSDPBackend.save_async``): every trained side's shards are copied before
        this returns; returns the state and a function that writes the copies, one side after another
        (collective: a background thread of every rank calls it)."""
        metas, writes = {}, []
        for chosen in self._trained_sides(None):
            meta, write = chosen.backend.save_async(directory if self.implicit else os.path.join(directory, chosen.name))
            meta["policy_version"] = chosen.policy_version
            metas[chosen.name] = meta
            writes.append(write)

        def write_all() -> None:
            for write in writes:
                write()

        return (metas[IMPLICIT_SIDE] if self.implicit else {"sides": metas}), write_all

    def load(self, directory: str, meta: dict[str, Any]) -> None:
        """Collective: restore every side that trains from ``save``'s shards and state."""
        trained = [chosen.name for chosen in self._trained_sides(None)]
        saved = meta.get("sides")
        if self.implicit != (saved is None) or (saved is not None and sorted(saved) != sorted(trained)):
            have = "a single-side recipe" if saved is None else f"sides {', '.join(sorted(saved))}"
            want = "a single-side recipe" if self.implicit else f"sides {', '.join(sorted(trained))}"
            raise RuntimeError(f"the checkpoint in {directory} was written by {have}, but this recipe trains {want}: "
                               "resume it with the recipe that wrote it, or start a new trainer.run_name")
        for chosen in self._trained_sides(None):
            state = meta if self.implicit else saved[chosen.name]
            chosen.backend.load(directory if self.implicit else os.path.join(directory, chosen.name), state)
            chosen.stack.policy_version = int(state["policy_version"])
