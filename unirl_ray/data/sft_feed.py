"""``SFTFeed``: a train rank's side of SFT. Records from its shard -> examples -> rows -> ``TrainStack``.

The controller sends ``sft_train`` with one seed per optimizer step; for each step every rank

1. takes exactly ``records_per_rank`` records from its ``ShardStream`` (the same count on every rank,
   so all ranks stay at the same cursor and cross epoch boundaries together), already built into
   examples (``RecordSource.builder``) by the stream's reader thread while the previous steps train;
2. counts and skips a bad record, or fails the run (``on_bad_record``);
3. packs them into rows of ``max_length`` tokens (``packing``) or keeps one example per row;
4. pads the row count to the largest over all ranks, rounded up to whole micro-batches, with rows
   that train nothing (FSDP2 needs every rank to run the same forwards; the loss is normalised by
   the global count of trained tokens / images, so padding changes nothing);
5. runs ``TrainStack.train`` (one optimizer step: the stack's ``mini_batch_size`` is unset).

``evaluate`` streams the held-out records once (each rank every ``world_size``-th one), in chunks
with the same padding rule, and returns the summed loss and its units; the controller adds the
ranks up. Nothing here imports Ray: the
shards arrive as functions that open an epoch iterator, so tests drive the feed with plain lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import Counter
from itertools import islice
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from unirl_ray.core.sample import Sample
from unirl_ray.data.records import RecordSource
from unirl_ray.data.shard_stream import ShardStream
from unirl_ray.data.sft_examples import (
    BadRecord,
    BuildStats,
    SFTImagePart,
    SFTTextPart,
    pack_rows,
    padding_row,
    parse_record,
    preview,
)

logger = logging.getLogger(__name__)

PREFETCH_STEPS = 4
"""Steps of records each rank's reader thread keeps ready (reading overlaps training)."""
LOGGED_PER_REASON = 3
"""Bad records logged (with a preview) per reason and rank; the rest are only counted."""


def example_seed(*key: Any) -> int:
    """A stable 63-bit seed from a key such as ``(data seed, "train", epoch, rank, offset)``."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


def all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise maximum over the ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


class SFTFeed:
    """One rank's SFT data path and steps (see the module docstring)."""

    def __init__(
        self,
        source: RecordSource,
        *,
        records_per_rank: int,
        bundle: Any,
        pipeline: Any,
        algorithm: Any,
        stack: Any,
        rank: int,
        world_size: int,
        open_train: Callable[[], Iterable[dict]],
        open_eval: Callable[[], Iterable[dict]] | None = None,
    ) -> None:
        if records_per_rank < 1:
            raise ValueError(f"records_per_rank must be >= 1, got {records_per_rank}")
        self.source = source
        self.records_per_rank = int(records_per_rank)
        self.pipeline, self.algorithm, self.stack = pipeline, algorithm, stack
        self.rank, self.world_size = int(rank), int(world_size)
        self.builder = source.builder(bundle=bundle, pipeline=pipeline)
        window = source.shuffle_buffer_size if source.shuffle else 1
        self.stream = ShardStream(open_train, seed=source.seed, rank=rank, shuffle_buffer_size=window,
                                  prefetch=PREFETCH_STEPS * self.records_per_rank,
                                  transform=lambda row, key: self.prepare(row, ("train", key[0], self.rank, key[1])))
        self.open_eval = open_eval
        self.json_lines = source.file_kind == "jsonl"
        self._logged: Counter[str] = Counter()
        self._builder_lock = threading.Lock()  # the reader thread and evaluation share the tokenizer
        self._packing_checked = not source.packing

    # ------------------------------------------------------------------ cursor
    def seek(self, cursor: dict[str, int]) -> None:
        """Continue at ``{"epoch", "offset"}`` (from a checkpoint's controller state)."""
        self.stream.seek(int(cursor["epoch"]), int(cursor["offset"]))

    def cursor(self) -> dict[str, int]:
        return self.stream.cursor()

    # ------------------------------------------------------------------ training
    def train(self, seeds: list[int]) -> list[dict[str, Any]]:
        """One optimizer step per seed (collective); per step: the stack's metrics and this rank's data counts."""
        return [self._train_step(int(seed)) for seed in seeds]

    def _train_step(self, seed: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        parts, stats, failure = self.collect([prepared for prepared, _ in self.stream.take(self.records_per_rank)])
        rows = self.rows(parts)
        counts = _counts(rows)
        rows = self.balance(rows, failure)
        data_seconds = time.perf_counter() - t0
        if not self._packing_checked:  # every rank reaches its first packed step in the same command
            gap = self.algorithm.check_packing(self.stack.backend.module)
            logger.info("packing check: packed vs separate log-prob gap %.2e", gap)
            self._packing_checked = True
        result = self.stack.train([_sample(i, row) for i, row in enumerate(rows)], seed=seed)
        return {
            "metrics": result.metrics,
            "policy_version": result.policy_version,
            "stats": dataclasses.asdict(stats),
            **counts,
            "pad_rows": len(rows) - counts["rows"],
            "data_seconds": data_seconds,
            "cursor": self.stream.cursor(),
        }

    def prepare(self, row: Any, key: tuple) -> tuple[Any, Any, tuple]:
        """``(example or BadRecord, row, key)`` of one record (runs in the reader thread when prefetching)."""
        try:
            record = parse_record(row, json_line=self.json_lines)
            with self._builder_lock:
                if self.source.is_image:
                    return self.builder.build(record, seed=example_seed(self.source.seed, *key)), None, key
                return self.builder.build(record), None, key
        except BadRecord as bad:
            return bad, row, key

    def collect(self, prepared: list[tuple[Any, Any, tuple]]) -> tuple[list[Any], BuildStats, str | None]:
        """The examples of prepared records, their counts, and with ``on_bad_record=fail`` the error of the
        first bad record (raised by ``balance`` on every rank together, so that no rank hangs in a collective)."""
        parts, stats, failure = [], BuildStats(), None
        for part, row, key in prepared:
            stats.records += 1
            if isinstance(part, BadRecord):
                stats.skipped[part.reason] = stats.skipped.get(part.reason, 0) + 1
                failure = failure or self._bad_record(part, row, key)
                continue
            stats.truncated += int(getattr(part, "truncated", False))
            parts.append(part)
        return parts, stats, failure

    def _bad_record(self, bad: BadRecord, row: Any, key: tuple) -> str | None:
        """Log a skipped record (the first few per reason), or return the error that stops the run."""
        what = f"epoch {key[1]}, record {key[3]} of rank {key[2]}'s shard" if key[0] == "train" else f"held-out record {key[1]}"
        where = f"{row.get('path', '?') if isinstance(row, dict) else '?'} ({what})"
        if self.source.on_bad_record == "fail":
            return (f"bad record in {where}: {bad}; record: {preview(row)}. Fix the data or set "
                    "data.on_bad_record=skip to count and skip such records")
        if self._logged[bad.reason] < LOGGED_PER_REASON:
            self._logged[bad.reason] += 1
            more = " (further ones of this kind are only counted)" if self._logged[bad.reason] == LOGGED_PER_REASON else ""
            logger.warning("skipping a bad record in %s: %s; record: %s%s", where, bad, preview(row), more)
        return None

    def rows(self, parts: list[Any]) -> list[Any]:
        """Packed rows (``packing``) or one example per row."""
        if self.source.packing:
            return pack_rows(parts, self.source.max_length)
        return parts

    def balance(self, rows: list[Any], failure: str | None = None, *, at_least_one: bool = True) -> list[Any]:
        """Collective: pad ``rows`` to the most rows on any rank, rounded up to whole micro-batches (at least
        one unless ``at_least_one`` is false); raises on every rank when any rank brings a ``failure``."""
        micro = self.stack.cfg.micro_batch_size
        most, failed = all_reduce_max([len(rows), int(failure is not None)])
        if failed:
            raise ValueError(failure or "another rank hit a bad record (data.on_bad_record=fail); see its error")
        target = max(micro if at_least_one else 0, -(-most // micro) * micro)
        return rows + [self._padding() for _ in range(target - len(rows))]

    def _padding(self) -> Any:
        if self.source.is_image:
            return padding_row("sft_image", height=self.pipeline.height, width=self.pipeline.width)
        return padding_row("sft_text", pad_token_id=int(self.pipeline.tokenizer.pad_token_id))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any]:
        """Collective: this rank's summed held-out loss and its units. Every rank reads the whole held-out
        data (small, and nothing is dropped to make equal shards) and evaluates every world_size-th record."""
        if self.open_eval is None:
            raise ValueError("no eval data: set data.eval_path or data.eval_fraction")
        rows_iter = islice(self.open_eval(), self.rank, None, self.world_size)
        micro = self.stack.cfg.micro_batch_size
        module = self.stack.backend.module
        total = units = 0.0
        seen, stats, counts = 0, BuildStats(), Counter()
        while True:
            chunk = list(islice(rows_iter, self.records_per_rank))
            keys = [("eval", self.rank + self.world_size * (seen + i)) for i in range(len(chunk))]  # global index
            parts, chunk_stats, failure = self.collect([self.prepare(row, key) for row, key in zip(chunk, keys)])
            seen += len(chunk)
            stats = _merge(stats, chunk_stats)
            rows = self.rows(parts)
            counts.update(_counts(rows))
            (more,) = all_reduce_max([int(len(chunk) == self.records_per_rank)])
            rows = self.balance(rows, failure, at_least_one=False)
            for start in range(0, len(rows), micro):
                s, c = self.algorithm.evaluate(module, rows[start : start + micro])
                total, units = total + s, units + c
            if not more:
                return {"loss_sum": total, "units": units, "stats": dataclasses.asdict(stats), **counts}


def _sample(index: int, row: Any) -> Sample:
    return Sample(sample_id=f"row{index}", group_id="sft", prompt="", parts=[row])


def _counts(rows: list[Any]) -> dict[str, int]:
    """Rows, tokens (non-padding) and trained targets of token rows; rows and images of image rows."""
    text = [r for r in rows if isinstance(r, SFTTextPart)]
    images = sum(1 for r in rows if isinstance(r, SFTImagePart) and r.weight > 0)
    return {
        "rows": len(rows),
        "tokens": sum(len(r.input_ids) for r in text),
        "targets": sum(r.num_targets for r in text),
        "images": images,
    }


def _merge(a: BuildStats, b: BuildStats) -> BuildStats:
    skipped = Counter(a.skipped)
    skipped.update(b.skipped)
    return BuildStats(records=a.records + b.records, skipped=dict(skipped), truncated=a.truncated + b.truncated)
