"""``ShardStream``: one train rank's records, epoch after epoch, in a deterministic, resumable order.

The rank's records come the same, in the same order, every epoch: its Ray Data shard
(``ray.train.get_dataset_shard``: the dataset is read with ``preserve_order`` and split with
``streaming_split(equal=True)``, whose block assignment is then a function of the data alone), or the rows the
driver gave it (``RecordSource.driver_shards``, for small local files). On top
of it each epoch is shuffled through a window of ``shuffle_buffer_size`` records, with an RNG drawn
from ``(seed, epoch, rank)``: a different order every epoch, the same order on every re-run.

The cursor is ``(epoch, offset)``: ``offset`` records of that epoch's shuffled order were handed
out. ``seek`` makes the stream re-read that epoch from its start and drop ``offset`` records
(reading is cheap next to training; nothing is tokenised), so a resumed run continues with exactly
the next record.

With ``prefetch > 0`` a reader thread keeps up to that many records ready (passed through
``transform``, e.g. tokenised), so reading, preparing, and the start of the next epoch overlap with
training. Ray Data starts the next epoch of a split only
when every rank asks for it (a barrier; the driver's rows have none); the SFT feed takes the same number of records on every
rank at every step and the shards have equal sizes, so every rank's reader reaches the end of an
epoch once its rank has taken the records before it, and the barrier always completes.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np

Keyed = tuple[Any, tuple[int, int]]


def windowed_shuffle(rows: Iterable[Any], rng: np.random.Generator, size: int) -> Iterator[Any]:
    """Rows in a shuffled order: a buffer of ``size`` rows, each new row replacing a random one that
    is emitted; the rest in a random order at the end. ``size <= 1`` keeps the order."""
    if size <= 1:
        yield from rows
        return
    buffer: list[Any] = []
    for row in rows:
        if len(buffer) < size:
            buffer.append(row)
            continue
        j = int(rng.integers(size))
        yield buffer[j]
        buffer[j] = row
    for j in rng.permutation(len(buffer)):
        yield buffer[int(j)]


class ShardStream:
    """A rank's records with a ``(epoch, offset)`` cursor (see the module docstring)."""

    def __init__(
        self,
        open_epoch: Callable[[], Iterable[Any]],
        *,
        seed: int,
        rank: int,
        shuffle_buffer_size: int = 0,
        prefetch: int = 0,
        transform: Callable[[Any, tuple[int, int]], Any] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self._open = open_epoch
        self._transform = transform
        self.seed, self.rank, self.shuffle_buffer_size = int(seed), int(rank), int(shuffle_buffer_size)
        self.prefetch, self.timeout_s = int(prefetch), float(timeout_s)
        self.epoch, self.offset = 0, 0
        self._records: Iterator[Keyed] | None = None
        self._stop: threading.Event | None = None

    def keyed(self, epoch: int, offset: int) -> Iterator[Keyed]:
        """``(record, (epoch, offset))`` from the cursor on, forever (epoch after epoch); the record
        passed through ``transform(record, key)`` when one is given."""
        while True:
            rng = np.random.default_rng([self.seed, epoch, self.rank])
            n = 0
            for row in windowed_shuffle(self._open(), rng, self.shuffle_buffer_size):
                if n >= offset:
                    key = (epoch, n)
                    yield (row if self._transform is None else self._transform(row, key)), key
                n += 1
            if n == 0:
                raise ValueError(f"the data shard of rank {self.rank} is empty: the dataset has fewer records than "
                                 "train workers (each rank gets an equal share; the remainder is dropped)")
            if n < offset:
                raise ValueError(f"cannot resume rank {self.rank} at record {offset} of epoch {epoch}: its shard has "
                                 f"{n} records; the data changed since the checkpoint (restore the same files and "
                                 "worker count)")
            epoch, offset = epoch + 1, 0

    def seek(self, epoch: int, offset: int) -> None:
        """Continue after the first ``offset`` records of epoch ``epoch`` (re-read and dropped on the next take)."""
        if epoch < 0 or offset < 0:
            raise ValueError(f"cursor must be non-negative, got epoch={epoch}, offset={offset}")
        self.close()
        self.epoch, self.offset = int(epoch), int(offset)

    def take(self, n: int) -> list[Keyed]:
        """The next ``n`` records, each with its key ``(epoch, offset)``, crossing into new epochs as needed."""
        if self._records is None:
            keyed = self.keyed(self.epoch, self.offset)
            self._records = self._prefetched(keyed) if self.prefetch > 0 else keyed
        out = [next(self._records) for _ in range(n)]
        if out:
            epoch, offset = out[-1][1]
            self.epoch, self.offset = epoch, offset + 1
        return out

    def cursor(self) -> dict[str, int]:
        """``{"epoch", "offset"}`` of the next record (JSON-able, for checkpoints)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def close(self) -> None:
        """Stop the reader thread (it exits at its next record); the next ``take`` starts at the cursor."""
        if self._stop is not None:
            self._stop.set()
        self._records, self._stop = None, None

    def _prefetched(self, keyed: Iterator[Keyed]) -> Iterator[Keyed]:
        """``keyed`` read ahead by a daemon thread into a queue of ``prefetch`` records."""
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = self._stop = threading.Event()

        def read() -> None:
            try:
                for item in keyed:
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as exc:  # handed to the consumer, raised there
                ready.put(_Failure(exc))

        thread = threading.Thread(target=read, name=f"shard-reader-rank{self.rank}", daemon=True)
        thread.start()
        return self._drain(ready, thread)

    def _drain(self, ready: queue.Queue, thread: threading.Thread) -> Iterator[Keyed]:
        while True:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    item = ready.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not thread.is_alive() and ready.empty():
                        raise RuntimeError(f"the data reader of rank {self.rank} stopped") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no record from the data shard of rank {self.rank} within "
                                           f"{self.timeout_s:.0f}s (a stalled Ray Data read?)") from None
            if isinstance(item, _Failure):
                raise item.exc
            yield item


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
