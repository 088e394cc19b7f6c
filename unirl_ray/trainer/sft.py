"""``SFTTrainer``: supervised fine-tuning on Ray Train with Ray Data. No rollout, reward, advantage or sync.

The seed's lifecycle ``records -> build Part -> train_track`` in one placement (the Ray Train
workers). This controller, on the driver, decides the steps, the evaluations and the checkpoints;
large record files never pass through it: Ray Data streams each rank's shard into its worker, which
builds, packs and trains (``unirl_ray.data.sft_feed``); small local ones it reads and splits itself
(``worker_datasets``). The loop:

    for each call (up to trainer.steps_per_call steps, cut at every eval / checkpoint):
        results = group.call("sft_train", {"seeds": seeds})   # per step, on every rank: take records -> build ->
                                                   #   pack -> balance rows over ranks -> TrainStack
        log each step: train/loss, train/lr, train/grad_norm, perf/tokens_per_s, data/skipped_*, ...
        every eval_every steps: group.call("sft_eval") -> eval/loss
        every checkpoint_every steps: save weights, optimizer, RNG and the data cursor

How it departs from a plain SFT loop: a step is one optimizer step over ``trainer.batch_size``
records of all ranks together (each rank takes ``batch_size / workers``); a bad record still
counts towards its step and is skipped (``data.on_bad_record``), and the loss is normalised by the
trained tokens (images) of the whole step over all ranks, so packing and skips change neither the
loss nor which records a step sees. Resuming continues at the saved cursor with exactly the next
records (same workers, same files).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from unirl_ray.config.recipe import RecipeError, instantiate
from unirl_ray.data.sft_examples import SKIP_REASONS, BuildStats
from unirl_ray.runtime.train_group import WorkerGroupRestarted
from unirl_ray.trainer.base import BaseTrainer, RunConfig, console, derive_seed

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SFTRunConfig(RunConfig):
    """The ``trainer:`` block of an SFT recipe."""

    num_steps: int
    """Optimizer steps to train (each over ``batch_size`` records)."""
    batch_size: int = 16
    """Records per optimizer step over all ranks (each rank takes batch_size / num_workers); must divide evenly."""
    eval_every: int = 0
    """Evaluate the held-out loss every N steps and after the last one (0: never); needs data.eval_path or data.eval_fraction."""
    eval_on_start: bool = False
    """Also evaluate before the first step (logged at step 0)."""
    steps_per_call: int = 8
    """Most optimizer steps per command to the workers (fewer driver round trips); calls end at every eval and
    checkpoint, and every step is logged, so results do not depend on it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("batch_size", "steps_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"trainer.eval_every must be >= 0 (0: never), got {self.eval_every}")


class SFTTrainer(BaseTrainer):
    domain = "sft"
    worker_sections = ("bundle", "pipeline", "backend", "algorithm", "stack")
    driver_sections = ("trainer", "data", "tracking", "ray")

    # ------------------------------------------------------------ validation
    def validate_domain(self) -> None:
        recipe, cfg = self.recipe, self.run_cfg
        self.data = self._build("data")  # RecordSource: every path exists and holds the expected fields
        self._shards: list[dict[str, Any]] | None = None  # each rank's records where the driver splits them
        self._build("algorithm")
        stack = self._build("stack")
        workers = self.ray_cfg.num_workers
        if cfg.batch_size % workers:
            raise RecipeError(f"trainer.batch_size={cfg.batch_size} records must divide evenly over "
                              f"ray.scaling.num_workers={workers} (every rank takes the same number per step)")
        self.records_per_rank = cfg.batch_size // workers
        if stack.cfg.mini_batch_size is not None or stack.cfg.num_updates_per_batch != 1:
            raise RecipeError("an SFT step is one optimizer step over trainer.batch_size records: set "
                              "stack.mini_batch_size: null and stack.num_updates_per_batch: 1 (stack.micro_batch_size "
                              "sets the rows per forward)")
        if (cfg.eval_every or cfg.eval_on_start) and not self.data.has_eval:
            raise RecipeError("trainer.eval_every / eval_on_start need held-out data: set data.eval_path or "
                              "data.eval_fraction")
        if self.data.has_eval and not (cfg.eval_every or cfg.eval_on_start):
            log.warning("data has held-out records but trainer.eval_every=0: they are never evaluated")
        self.bundle_cfg = instantiate(recipe.bundle.config) if "config" in recipe.bundle else None
        self._check_family()
        fsdp = recipe.backend.get("fsdp_cfg")
        if fsdp is not None:
            try:
                instantiate(fsdp).mesh_shape(workers)
            except ValueError as exc:
                raise RecipeError(f"backend.fsdp_cfg: {exc}") from None
        if self.ray_cfg.max_failures:
            log.warning("ray.max_failures=%d: the SFT controller does not re-issue steps after a worker-group restart, "
                        "so a restart fails the run; start it again to resume from its last checkpoint",
                        self.ray_cfg.max_failures)
        self.cursor = {"epoch": 0, "offset": 0}
        self.totals: dict[str, float] = {}

    def _check_family(self) -> None:
        """Image records need an image model (SD3), text records a causal LM; SD3 SFT trains without CFG."""
        image_model = hasattr(self.bundle_cfg, "latent_factor")
        if self.data.is_image != image_model:
            want = ("an image model (e.g. unirl_ray.models.sd3.SD3Bundle)" if self.data.is_image
                    else "a causal LM (unirl_ray.models.causal_lm.CausalLMBundle)")
            raise RecipeError(f"data.format={self.data.format} records need {want} in bundle:")
        image_options = sorted(k for k in ("timestep_sampling", "logit_mean", "logit_std", "caption_dropout")
                               if k in self.recipe.algorithm)
        if image_options and not self.data.is_image:
            log.warning("algorithm options %s apply to image records only; ignored for %s records",
                        image_options, self.data.format)
        if self.data.is_image and float(self.recipe.pipeline.get("guidance_scale", 1.0)) != 1.0:
            raise RecipeError("SFT trains the conditional velocity: set pipeline.guidance_scale=1.0 "
                              "(CFG is a sampling option; algorithm.caption_dropout trains the unconditional branch)")

    def is_demo(self) -> bool:
        return bool(getattr(self.bundle_cfg, "is_demo", False))

    # ------------------------------------------------------------ workers and state
    def worker_datasets(self) -> dict[str, Any] | None:
        """The records for Ray Train to split over the ranks; None where the driver reads them
        (``RecordSource.driver_shards``): it then splits them itself and sends each rank its shard with
        ``sft_start``, so the run starts no dataset manager and no split coordinator (two Ray worker processes
        on the first step's path)."""
        self._shards = self.data.driver_shards(self.ray_cfg.num_workers)
        return None if self._shards is not None else self.data.datasets()

    def _split(self) -> str:
        """Who split the records over the ranks (kept with the data cursor: the other split gives each rank
        other records)."""
        return "driver" if self._shards is not None else "ray_train"

    def _start_payloads(self) -> list[dict[str, Any]]:
        """Each rank's ``sft_start``: the record source, the count per rank and step, the cursor, and the rank's
        records where the driver split them (None: Ray Train's shard, ``ray.train.get_dataset_shard``)."""
        common = {"source": self.data, "records_per_rank": self.records_per_rank, "cursor": self.cursor}
        return [{**common, "rows": None if self._shards is None else self._shards[rank]}
                for rank in range(self.ray_cfg.num_workers)]

    def driver_libraries(self) -> tuple[str, ...]:
        # the records reach the ranks as Ray Data shards, unless the driver splits them itself
        return (*super().driver_libraries(), *(() if self.data.on_driver() else ("data",)))

    def start_workers(self) -> dict[str, Any]:
        """Start the ranks, then their feeds at the restored data cursor (the start of the data when new)."""
        announced = super().start_workers()
        state = announced.get("controller") or {}
        self.cursor = self._resume_cursor(state.get("data"))
        self.group.call("sft_start", self._start_payloads(), timeout_s=self.ray_cfg.start_timeout_s)
        return announced

    def _resume_cursor(self, saved: dict[str, int] | None) -> dict[str, int]:
        if not saved:
            return {"epoch": 0, "offset": 0}
        split = saved.get("split", "ray_train")  # checkpoints from before the driver's split: Ray Train's
        if split != self._split():
            log.warning("the checkpoint's records were split over the ranks by %s, this run's by %s (the record "
                        "files grew or shrank past the driver's read size, or the checkpoint predates the driver's "
                        "split): each rank's shard holds other records now, so the run continues at the same point "
                        "of epoch %s, not at exactly the next records",
                        split.replace("_", " "), self._split().replace("_", " "), saved.get("epoch"))
        workers = self.ray_cfg.num_workers
        if saved.get("world_size", workers) == workers:
            return {"epoch": int(saved["epoch"]), "offset": int(saved["offset"])}
        offset = int(saved["offset"]) * int(saved["world_size"]) // workers
        log.warning("resuming on %d workers, the checkpoint was written by %d: each rank's shard holds other records "
                    "now, so the run continues at the same fraction of epoch %d, not at exactly the next records",
                    workers, saved["world_size"], saved["epoch"])
        return {"epoch": int(saved["epoch"]), "offset": offset}

    def restore(self, state: dict[str, Any]) -> None:
        self.totals = dict(state.get("data_totals") or {})

    def controller_state(self) -> dict[str, Any]:
        data = {**self.cursor, "world_size": self.ray_cfg.num_workers, "records_per_rank": self.records_per_rank,
                "split": self._split()}
        return {**super().controller_state(), "data": data, "data_totals": self.totals}

    # ------------------------------------------------------------ the loop
    def run_steps(self, start_step: int) -> dict[str, Any]:
        cfg = self.run_cfg
        if cfg.eval_on_start and start_step == 0:
            self.tracker.log_metrics(self.evaluate(), step=0)
        step, metrics = start_step, {}
        while step < cfg.num_steps:
            try:
                count = self._steps_in_call(step)
                for metrics in self.train_steps(step + 1, count):
                    step += 1
                    if self._eval_due(step):  # calls end at eval steps: the weights are this step's
                        metrics |= self.evaluate()
                    self.tracker.log_metrics({**metrics, **self._first_step_done()}, step=step)
                    console(sft_progress_line(step, cfg.num_steps, metrics, self.totals))
                if step % cfg.checkpoint_every == 0 or step == cfg.num_steps:
                    self.save_checkpoint(step)
            except WorkerGroupRestarted as exc:  # a rank died: rewind to the restarted group's checkpoint
                step = self.recover(step + 1, exc)
        return metrics

    def after_restart(self, announced: dict[str, Any], restored_step: int) -> None:
        """The restarted ranks restart their feeds at the checkpoint's data cursor."""
        state = announced.get("controller") or self._start_state
        self.cursor = self._resume_cursor(state.get("data"))
        self.group.call("sft_start", self._start_payloads(), timeout_s=self.ray_cfg.start_timeout_s)

    def run_step(self, step: int) -> dict[str, Any]:
        """Step ``step`` alone (one command), with its evaluation when one is due."""
        metrics = self.train_steps(step, 1)[0]
        if self._eval_due(step):
            metrics |= self.evaluate()
        return metrics

    def _eval_due(self, step: int) -> bool:
        every = self.run_cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.run_cfg.num_steps)

    def _steps_in_call(self, step: int) -> int:
        """Steps of the next command: up to ``steps_per_call``, ending at the next eval, checkpoint or the end."""
        cfg = self.run_cfg
        ends = [cfg.num_steps, step + cfg.steps_per_call, (step // cfg.checkpoint_every + 1) * cfg.checkpoint_every]
        if cfg.eval_every:
            ends.append((step // cfg.eval_every + 1) * cfg.eval_every)
        return min(ends) - step

    def train_steps(self, first: int, count: int) -> list[dict[str, float]]:
        """Steps ``first .. first + count - 1`` in one ``sft_train`` command; their metrics, in order."""
        seeds = [derive_seed(self.run_cfg.seed, "sft", s) for s in range(first, first + count)]
        t0 = time.perf_counter()
        results = self.group.call("sft_train", {"seeds": seeds})
        seconds = (time.perf_counter() - t0) / count
        return [self._step_metrics([rank[i] for rank in results], seconds) for i in range(count)]

    def _step_metrics(self, ranks: list[dict[str, Any]], seconds: float) -> dict[str, float]:
        cursors = [r["cursor"] for r in ranks]
        if any(c != cursors[0] for c in cursors):  # equal takes from equal shards: the ranks move together
            raise RuntimeError(f"train ranks disagree on the data cursor {cursors}")
        self.cursor = dict(cursors[0])
        stats = BuildStats(
            records=sum(r["stats"]["records"] for r in ranks),
            skipped={k: sum(r["stats"]["skipped"].get(k, 0) for r in ranks) for k in SKIP_REASONS},
            truncated=sum(r["stats"]["truncated"] for r in ranks),
        )
        metrics = dict(ranks[0]["metrics"])  # already reduced over the ranks by the stack
        metrics |= stats.as_metrics()
        for key, value in stats.as_metrics().items():
            if key.startswith("data/skipped_") or key == "data/records":
                self.totals[key] = self.totals.get(key, 0.0) + value
        metrics["data/skipped_total"] = sum(v for k, v in self.totals.items() if k.startswith("data/skipped_"))
        total = {k: sum(r[k] for r in ranks) for k in ("rows", "pad_rows", "tokens", "targets", "images")}
        metrics |= {"data/epoch": float(self.cursor["epoch"]), "data/rows": total["rows"], "data/pad_rows": total["pad_rows"],
                    "train/policy_version": float(ranks[0]["policy_version"]), "timing/train": seconds,
                    "timing/data": max(r["data_seconds"] for r in ranks)}
        if self.data.is_image:
            metrics |= {"data/images": total["images"], "perf/images_per_s": total["images"] / seconds}
        else:
            metrics |= {"data/tokens": total["tokens"], "data/trained_tokens": total["targets"],
                        "perf/tokens_per_s": total["tokens"] / seconds,
                        "perf/trained_tokens_per_s": total["targets"] / seconds}
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out loss over the whole eval data (every rank streams its shard): ``eval/loss`` and counts."""
        t0 = time.perf_counter()
        ranks = self.group.call("sft_eval", {})
        units = sum(r["units"] for r in ranks)
        if units <= 0:
            log.warning("evaluation found no usable held-out record: eval/loss is NaN")
        unit = "images" if self.data.is_image else "tokens"
        loss = sum(r["loss_sum"] for r in ranks) / units if units > 0 else float("nan")
        return {
            **self._watch_overfitting(loss),
            "eval/loss": loss,
            f"eval/{unit}": units,
            "eval/records": float(sum(r["stats"]["records"] for r in ranks)),
            "eval/skipped": float(sum(sum(r["stats"]["skipped"].values()) for r in ranks)),
            "timing/eval": time.perf_counter() - t0,
        }


    def _watch_overfitting(self, loss: float) -> dict[str, float]:
        """``eval/rising_evals``: evaluations in a row whose held-out loss is above the best one by more
        than 2%; from the second one the run says, once, that it is overfitting."""
        best = getattr(self, "_best_eval_loss", None)
        rising = getattr(self, "_rising_evals", 0)
        if best is None or not loss > best:
            self._best_eval_loss, rising = loss, 0
        elif loss > best * (1 + OVERFIT_MARGIN):
            rising += 1
        self._rising_evals = rising
        if rising >= 2 and not getattr(self, "_warned_overfitting", False):
            self._warned_overfitting = True
            console(f"eval/loss has been above its best ({best:.4f}) for {rising} evaluations (now {loss:.4f}): the "
                    "model is overfitting the training records. Stop earlier (trainer.num_steps), train on more "
                    "records, or lower backend.optimizer_cfg.learning_rate / raise its weight_decay")
        return {"eval/rising_evals": float(rising), "eval/best_loss": float(self._best_eval_loss)}


OVERFIT_MARGIN = 0.02


def sft_progress_line(step: int, total: int, metrics: dict[str, float], totals: dict[str, float]) -> str:
    """One line per step for the driver's console."""
    def get(key: str) -> float:
        return float(metrics.get(key, float("nan")))

    speed = (f"{get('perf/images_per_s'):.1f} images/s" if "perf/images_per_s" in metrics
             else f"{get('perf/tokens_per_s'):.0f} tokens/s")
    evaluated = f" | eval {get('eval/loss'):.4g}" if "eval/loss" in metrics else ""
    skipped = int(sum(v for k, v in totals.items() if k.startswith("data/skipped_")))
    return (f"step {step}/{total} | loss {get('train/loss'):.4g}{evaluated} | lr {get('train/lr'):.3g} | "
            f"grad {get('train/grad_norm'):.3g} | {speed} | epoch {int(get('data/epoch'))} | skipped {skipped}")
