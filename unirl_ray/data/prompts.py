"""Prompt sources: read prompts with Ray Data once, then serve deterministic epochs from the driver.

At construction a ``PromptSource`` checks its files on the driver (an empty file, a .jsonl line that
is not a JSON object or lacks the prompt column: ``ValueError`` naming the file and line), so bad data
fails before any worker starts. It reads its files when first used: .txt and .json/.jsonl files of more than
``DRIVER_READ_BYTES`` in all with Ray Data (read tasks ask for 0.25 CPU so they schedule next to Train workers on
small machines; on a multi-node cluster paths go through ``local://`` so they are read on the driver's node, no
shared storage needed), smaller ones on the driver, which has just parsed every line to check it (a Ray Data read
of a small file starts a read task and Ray Data's own actors: ~5 CPU-s and ~3.7 s on 2 cores while the train
workers start, for a 40-line file), and .parquet with pyarrow on the driver (Ray 2.60's ``read_parquet`` needs a
free whole CPU, see ``_read_parquet_on_driver``). Either way the rows are the same. Rows are kept on the driver:
prompt tables are small (a million short prompts is ~100 MB), and per-step cost is then a list slice,
with no Ray Data execution per step. Each epoch visits every row once, in a permutation drawn from
``(seed, epoch)``; batches wrap across epoch boundaries. ``state_dict()`` / ``load_state_dict()``
hold ``{"epoch", "offset"}``, so a resumed run continues with exactly the next prompts.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from unirl_ray.runtime.imports import import_ray_library

logger = logging.getLogger(__name__)

_KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
READ_NUM_CPUS = 0.25
"""CPUs each Ray Data read task asks for."""
DRIVER_READ_BYTES = 64 << 20
""".txt / .json / .jsonl prompt files of at most this many bytes in all are read on the driver, larger ones with
Ray Data (see the module docstring)."""
READ_TIMEOUT_S = 600.0
"""Longest wait for a background read of the prompts (``PromptSource.prefetch``)."""


def fits_on_driver(files: list[str], limit: int | None = None) -> bool:
    """Whether ``files`` are local and hold at most ``limit`` (``DRIVER_READ_BYTES``) bytes in all: the driver
    reads them itself (a URI is read by Ray Data wherever it is)."""
    if any("://" in f for f in files):
        return False
    return sum(os.path.getsize(f) for f in files) <= (DRIVER_READ_BYTES if limit is None else limit)


class PromptPathError(FileNotFoundError, ValueError):
    """The prompt path does not exist (catch it as ValueError or FileNotFoundError)."""


def _kind_of(path: str) -> str | None:
    return _KINDS.get(os.path.splitext(path)[1].lower())


def _list_files(path: str) -> list[str]:
    """The prompt files under a directory (recursive, sorted, hidden files skipped)."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        found += [os.path.join(root, f) for f in sorted(files) if not f.startswith((".", "_")) and _kind_of(f)]
    return sorted(found)


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _lines(path: str):
    """``(line number, text)`` of a UTF-8 file; a byte sequence that is not UTF-8 names its line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}, line {number} is not UTF-8 text ({exc.reason} at byte {exc.start} of the "
                                 "line); save the file as UTF-8") from None


def text_rows(path: str) -> list[dict[str, str]]:
    """The rows of a .txt prompt file (``{"text": line}`` per non-blank line, as Ray Data's
    ``read_text(drop_empty_lines=True)`` gives them). It must be UTF-8 and hold at least one non-blank line;
    ValueError naming the file (and the line) otherwise."""
    rows = [{"text": line.rstrip("\r\n")} for _, line in _lines(path) if line.strip()]  # every line decoded
    if rows:
        return rows
    raise ValueError(f"prompt file {path} is empty (no non-blank lines); write one prompt per line "
                     "or point data.path at another file")


def _check_row(row: Any, where: str, prompt_column: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object like "
                         f"{{{prompt_column!r}: ...}}: fix or delete that line")
    if prompt_column not in row:
        raise ValueError(f"{where} has no {prompt_column!r} key (keys: {sorted(row)}){_did_you_mean(prompt_column, list(row))}; "
                         "add the prompt to that line, delete it, or set data.prompt_column")
    value = row[prompt_column]
    if value is not None and not isinstance(value, str):  # null / "" are skipped with a warning
        raise ValueError(f"{where}: {prompt_column!r} is a {type(value).__name__} ({str(value)[:40]!r}), not a string; "
                         "prompts are text: quote it, or set data.prompt_column to the column holding the text")


def check_jsonl_file(path: str, prompt_column: str) -> int:
    """The number of rows of a .jsonl prompt file (see ``jsonl_rows``)."""
    return len(jsonl_rows(path, prompt_column))


def jsonl_rows(path: str, prompt_column: str) -> list[dict[str, Any]]:
    """The rows of a .jsonl prompt file: every non-blank line must be a JSON object holding ``prompt_column``
    (a string). The first bad line raises ValueError naming the file, the line number and what to fix (Ray
    Data would otherwise fail later, inside a read task, without them)."""
    rows = []
    for number, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON ({exc.msg}): {line.strip()[:80]!r}; each line of a "
                             ".jsonl prompt file must be one JSON object: fix or delete that line") from None
        _check_row(row, where, prompt_column)
        rows.append(row)
    if not rows:
        raise ValueError(f"prompt file {path} is empty (no JSON lines); add prompts or point data.path at another file")
    return rows


def json_rows(path: str, prompt_column: str) -> list[dict[str, Any]]:
    """The rows of a .json prompt file: a JSON array of objects (checked item by item), or JSON lines (as .jsonl)."""
    text = "".join(line for _, line in _lines(path))
    if not text.lstrip().startswith("["):
        return jsonl_rows(path, prompt_column)
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {exc.lineno} is not valid JSON ({exc.msg}); a .json prompt file is one "
                         "array of objects, or one object per line") from None
    for index, row in enumerate(items):
        _check_row(row, f"{path}, item {index}", prompt_column)
    if not items:
        raise ValueError(f"prompt file {path} is an empty array; add prompts or point data.path at another file")
    return items


@dataclass(kw_only=True)
class PromptSource:
    """Prompts (and extra columns for rewards) from a file or a directory of files."""

    path: str
    """A .txt (one prompt per line, blank lines skipped), .jsonl/.json, .parquet file, or a directory of one kind."""
    prompt_column: str = "prompt"
    """Column holding the prompt text (ignored for .txt)."""
    columns: list[str] | None = None
    """Extra columns carried to rewards; None carries every other column, [] none."""
    shuffle: bool = True
    """Visit each epoch in a random order drawn from (seed, epoch); False keeps file order."""
    seed: int = 0
    """Seed of the per-epoch permutations."""


    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"PromptSource.path must be a file or directory path, got {self.path!r}")
        self.path = os.path.abspath(os.path.expanduser(str(self.path)))
        if not os.path.exists(self.path):
            raise PromptPathError(f"prompt file or directory not found: {self.path}; check PromptSource.path")
        if self.columns is not None:
            self.columns = list(self.columns)
            if "row_index" in self.columns or "prompt" in self.columns:
                raise ValueError("columns may not include 'row_index' or 'prompt' (both are always set)")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        self._rows: list[dict[str, Any]] | None = None
        self._epoch, self._offset = 0, 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self._files = self._find_files()
        self._kind = _kind_of(self._files[0])
        self._check_columns()

    def _find_files(self) -> list[str]:
        supported = ", ".join(_KINDS)
        if os.path.isfile(self.path):
            if _kind_of(self.path) is None:
                raise ValueError(f"unsupported prompt file {self.path}: use one of {supported}")
            return [self.path]
        files = _list_files(self.path)
        if not files:
            raise ValueError(f"no prompt files ({supported}) in directory {self.path}")
        kinds = sorted({_kind_of(f) for f in files})
        if len(kinds) > 1:
            raise ValueError(f"directory {self.path} mixes prompt file kinds {kinds}; keep one kind per directory")
        return files

    def _check_columns(self) -> None:
        """Checks on the driver before anything starts: no empty file, every .jsonl line a JSON object
        with the prompt column, the first row / parquet schema holding the requested columns. The rows of
        small .txt / .json / .jsonl files, parsed to check them, are kept for the read (``_read_on_driver``)."""
        self._parsed: list[dict[str, Any]] | None = None
        if self._kind == "text" and self.columns:
            raise ValueError(f"a .txt prompt file has no columns; drop columns={self.columns}")
        if self._kind != "parquet":
            small = fits_on_driver(self._files)
            rows = []
            for path in self._files:
                checked = self._file_rows(path)
                if small:
                    rows += checked
            self._parsed = rows if small else None
        if self._kind == "text":
            return
        available = self._peek_columns(self._files[0])
        if available is None:
            return
        for col in [self.prompt_column, *(self.columns or [])]:
            if col not in available:
                raise ValueError(
                    f"column {col!r} not in {self._files[0]} (columns: {sorted(available)}){_did_you_mean(col, available)}"
                )

    def _peek_columns(self, path: str) -> list[str] | None:
        if self._kind == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        first_line = next((line for _, line in _lines(path) if line.strip()), "")  # whole, however long
        if not first_line:
            raise ValueError(f"prompt file {path} is empty; add prompts or point data.path at another file")
        if first_line.lstrip().startswith("["):
            items = json.loads("".join(line for _, line in _lines(path)))  # checked by json_rows
            return list(items[0]) if items and isinstance(items[0], dict) else None
        try:
            first = json.loads(first_line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"first line of {path} is not a JSON object ({exc}); use one object per line") from None
        if not isinstance(first, dict):
            raise ValueError(f"first line of {path} is a {type(first).__name__}, expected a JSON object")
        return list(first)

    # ---- reading (once, with Ray Data) -------------------------------------------------------

    def prefetch(self) -> None:
        """Start reading the rows in a background thread; the first ``open`` then waits for it (bounded) and
        raises what the read raised. A trainer calls this while its workers start, so the Ray Data read is
        off the first step's path."""
        if self._rows is not None or getattr(self, "_prefetch", None) is not None:
            return
        self._fetched: list[dict[str, Any]] | BaseException | None = None

        def read() -> None:
            try:
                self._fetched = self._normalize(self._read_rows())
            except BaseException as exc:  # noqa: BLE001 - raised by open()
                self._fetched = exc

        self._prefetch = threading.Thread(target=read, name="unirl-prompt-prefetch", daemon=True)
        self._prefetch.start()

    def open(self) -> "PromptSource":
        """Read every row with Ray Data (first call only); later calls are free."""
        if self._rows is None:
            reading = getattr(self, "_prefetch", None)
            if reading is not None:
                reading.join(timeout=READ_TIMEOUT_S)
                if reading.is_alive():
                    raise TimeoutError(f"reading the prompts of {self.path} took over {READ_TIMEOUT_S:.0f}s (Ray Data)")
                fetched, self._prefetch, self._fetched = self._fetched, None, None
                if isinstance(fetched, BaseException):
                    raise fetched
                rows = fetched
            else:
                rows = self._normalize(self._read_rows())
            self._rows = rows
            self._check_cursor()
            logger.info("prompt source %s: %d prompts from %d file(s)", self.path, len(rows), len(self._files))
        return self

    def _read_rows(self) -> list[dict[str, Any]]:
        if self._kind == "parquet":
            return self._read_parquet_on_driver()
        if self._parsed is not None or fits_on_driver(self._files):
            return self._read_on_driver()
        import_ray_library("data")  # not concurrently with the fit thread's import of Ray Train
        import ray.data

        uris = [self._uri(p) for p in self._files]
        if self._kind == "text":
            ds = ray.data.read_text(uris, drop_empty_lines=True, num_cpus=READ_NUM_CPUS)
        else:
            ds = ray.data.read_json(uris, num_cpus=READ_NUM_CPUS)
        ds.context.execution_options.preserve_order = True  # file order, so row_index is stable
        ds.context.enable_progress_bars = False
        return ds.take_all()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable without a read in flight (the thread stays with this process)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_prefetch", "_fetched", "_parsed")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._parsed = None  # an unopened source reads its files again where it is unpickled

    @staticmethod
    def _uri(path: str) -> str:
        """``local://`` (read on the driver's node) on multi-node clusters, the plain path otherwise."""
        import ray

        if not ray.is_initialized():
            return path  # Ray Data starts a local cluster
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        return f"local://{path}" if alive > 1 else path

    def _read_parquet_on_driver(self) -> list[dict[str, Any]]:
        """Parquet is read with pyarrow on the driver: Ray 2.60's ``read_parquet`` needs a free whole CPU.

        Measured on 2.60: its file-listing (V2) or sampling (V1) task ignores ``num_cpus`` and hangs
        when Train workers and replicas leave less than 1 CPU free; a small prompt table reads in ms.
        """
        import pyarrow.parquet as pq

        wanted = None if self.columns is None else [self.prompt_column, *self.columns]
        rows: list[dict[str, Any]] = []
        for path in self._files:
            rows += pq.read_table(path, columns=wanted).to_pylist()
        return rows

    def _file_rows(self, path: str) -> list[dict[str, Any]]:
        """The checked rows of one .txt / .json / .jsonl file."""
        if self._kind == "text":
            return text_rows(path)
        return (jsonl_rows if self._kind == "jsonl" else json_rows)(path, self.prompt_column)

    def _read_on_driver(self) -> list[dict[str, Any]]:
        """The rows of small .txt / .json / .jsonl files as Ray Data's readers give them (a key a row lacks is
        None): those parsed by the constructor's checks, once (a source unpickled before it opened parses again)."""
        rows, self._parsed = self._parsed, None
        if rows is None:
            rows = [row for path in self._files for row in self._file_rows(path)]
        keys = list(dict.fromkeys(k for row in rows for k in row))
        return [{k: row.get(k) for k in keys} for row in rows]

    def _normalize(self, raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
        key = "text" if self._kind == "text" else self.prompt_column
        if raw and key not in raw[0]:
            available = sorted(raw[0])
            raise ValueError(f"column {key!r} not in {self.path} (columns: {available}){_did_you_mean(key, available)}")
        extra = self.columns
        if extra is None:
            extra = [k for k in (raw[0] if raw else {}) if k not in (key, "prompt", "row_index")]
        rows: list[dict[str, Any]] = []
        for r in raw:
            prompt = r.get(key)
            if not isinstance(prompt, str) or not prompt.strip():
                continue
            prompt = prompt.strip() if self._kind == "text" else prompt
            rows.append({"prompt": prompt, **{c: r.get(c) for c in extra}, "row_index": len(rows)})
        if not rows:
            raise ValueError(f"no prompts in {self.path}: read {len(raw)} row(s), none with a non-empty {key!r}")
        if len(rows) < len(raw):
            logger.warning("prompt source %s: skipped %d row(s) without a prompt", self.path, len(raw) - len(rows))
        return rows

    # ---- epochs and batches (driver only, no Ray calls) ------------------------------------------

    def __len__(self) -> int:
        """Number of prompts (reads the source on first use)."""
        return len(self.open()._rows)

    @property
    def epoch(self) -> int:
        """Current epoch (0-based); it advances when the last row of an epoch is handed out."""
        return self._epoch

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self._epoch:
            n = len(self._rows)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self._epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self._epoch
        return self._order

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows ``{"prompt", <columns>, "row_index"}``, wrapping into the next epoch."""
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"next_batch needs a batch size >= 1, got {n!r}")
        rows = self.open()._rows
        out: list[dict[str, Any]] = []
        while len(out) < n:
            order = self._epoch_order()
            take = min(n - len(out), len(rows) - self._offset)
            out += [dict(rows[i]) for i in order[self._offset : self._offset + take]]
            self._offset += take
            if self._offset == len(rows):
                self._epoch, self._offset = self._epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        """The cursor: the next batch starts at position ``offset`` of epoch ``epoch``'s order."""
        return {"epoch": self._epoch, "offset": self._offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a cursor from ``state_dict()``; the next batch continues exactly where it left off."""
        if not isinstance(state, dict) or set(state) != {"epoch", "offset"}:
            raise ValueError(f"expected a state like {{'epoch': 0, 'offset': 0}} from state_dict(), got {state!r}")
        epoch, offset = state["epoch"], state["offset"]
        if not all(isinstance(v, (int, np.integer)) and v >= 0 for v in (epoch, offset)):
            raise ValueError(f"epoch and offset must be ints >= 0, got {state!r}")
        self._epoch, self._offset = int(epoch), int(offset)
        self._order_epoch = -1
        if self._rows is not None:
            self._check_cursor()

    def _check_cursor(self) -> None:
        if self._offset > len(self._rows):
            raise ValueError(
                f"restored offset {self._offset} is past the {len(self._rows)} prompts of {self.path}; "
                "the prompt data changed since the checkpoint: restore the same data or start a new run"
            )
        if self._offset == len(self._rows):
            self._epoch, self._offset = self._epoch + 1, 0
