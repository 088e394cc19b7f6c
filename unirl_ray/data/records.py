"""``RecordSource``: the ``data:`` section of an SFT recipe, streamed by Ray Data into the train workers.

On the driver it checks, before any worker starts, that every path exists and holds records of
the expected format (the first record of the first file is read), and builds the Ray Data datasets
(``datasets()``) that ``TorchTrainer(datasets=...)`` splits over the train ranks: lazy reads, except for
local .jsonl files of at most ``DRIVER_READ_BYTES`` in all, which the driver reads and the SFT trainer
splits over the ranks itself (``driver_shards``: a read task, Ray Train's dataset manager and its split
coordinator are each a new worker process on the first step's path). JSON lines are read as
text lines (``read_text``) and parsed on the ranks, so one malformed line is one bad record rather
than an unreadable file; parquet rows are read as they are. Any path Ray Data reads works: a local
file or folder, or a URI (``s3://``, ``gs://``...).

On the ranks the same object (shipped in the ``sft_start`` command, not rebuilt) says how records
become examples (``builder``). Epochs, shuffling and the resumable cursor are ``ShardStream``'s.

Held-out evaluation data is either another path (``eval_path``) or a fraction of the records
(``eval_fraction``), picked by a hash of each record's content: stable across runs and worker
counts, and duplicates of a record all land on the same side.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from unirl_ray.config.checks import check_literal_fields
from unirl_ray.data.prompts import DRIVER_READ_BYTES, fits_on_driver
from unirl_ray.data.sft_examples import ImageExampleBuilder, TextExampleBuilder
from unirl_ray.runtime.imports import import_ray_library

logger = logging.getLogger(__name__)

_DETECT_ORDER = ("messages", "prompt_completion", "image_caption", "text")
"""The record formats in the order ``format: auto`` tries them on the first record."""
_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
READ_NUM_CPUS = 0.25
"""CPUs each Ray Data read task asks for (so reads schedule next to Train workers on small machines)."""


class RecordPathError(FileNotFoundError, ValueError):
    """A record path does not exist (catch it as ValueError or FileNotFoundError)."""


@dataclass(kw_only=True)
class RecordSource:
    """Training records (and held-out ones) for SFT, read by Ray Data (see the module docstring)."""

    path: str
    """A .jsonl (.json with one object per line) or .parquet file, a folder of one kind, or a URI Ray Data reads."""
    format: Literal["auto", "messages", "prompt_completion", "text", "image_caption"] = "auto"
    """Record format; ``auto`` picks it from the first record's fields (messages > prompt+completion > image+caption > text)."""
    messages_field: str = "messages"
    """``messages`` records: the list of ``{role, content}`` messages."""
    prompt_field: str = "prompt"
    """``prompt_completion`` records: the prompt text."""
    completion_field: str = "completion"
    """``prompt_completion`` records: the trained completion text."""
    text_field: str = "text"
    """``text`` records: the text (every token trained)."""
    image_field: str = "image"
    """``image_caption`` records: a path (relative to the record file), a URI, bytes, or a {bytes, path} struct."""
    caption_field: str = "caption"
    """``image_caption`` records: the caption."""
    max_length: int = 1024
    """Most tokens per example (longer ones are cut, keeping the start); with ``packing`` also the row length."""
    packing: bool = False
    """Pack several examples into rows of ``max_length`` tokens (positions restart per example, no attention across them)."""
    on_bad_record: Literal["skip", "fail"] = "skip"
    """A record that cannot be used (bad JSON, missing field, empty text, undecodable image, nothing to train
    after truncation): ``skip`` counts it in ``data/skipped_<reason>`` and logs the first few; ``fail`` stops the run."""
    shuffle: bool = True
    """Shuffle the file order once and each epoch's records per rank through a window of ``shuffle_buffer_size``."""
    shuffle_buffer_size: int = 1024
    """Records in each rank's shuffle window (larger mixes more, costs memory; 1 keeps the file order)."""
    seed: int = 0
    """Seed of the file order, the per-epoch shuffles, the eval split and per-example noise."""
    eval_path: str | None = None
    """Held-out records (same format) for ``eval/loss``; a file, folder or URI."""
    eval_fraction: float = 0.0
    """Instead of ``eval_path``: hold out this fraction of ``path``'s records (by content hash) for evaluation."""

    def __post_init__(self) -> None:
        check_literal_fields(self, "data")
        if not isinstance(self.max_length, int) or self.max_length < 2:
            raise ValueError(f"data.max_length must be an int >= 2 (tokens per example), got {self.max_length!r}")
        if self.shuffle_buffer_size < 1:
            raise ValueError(f"data.shuffle_buffer_size must be >= 1, got {self.shuffle_buffer_size}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_path:
            raise ValueError("set data.eval_path or data.eval_fraction, not both")
        self.files, self.file_kind = list_record_files(self.path, "data.path")
        if self.shuffle:
            import numpy as np

            self.files = [self.files[i] for i in np.random.default_rng([self.seed, 7]).permutation(len(self.files))]
        first = _first_record(self.files[0], self.file_kind)
        if self.format == "auto":
            self.format = self._detect(first)
            logger.info("data: %s records (from the fields of the first record of %s)", self.format, self.files[0])
        self._check_fields(first, self.files[0])
        self.eval_files: list[str] = []
        if self.eval_path:
            self.eval_files, kind = list_record_files(self.eval_path, "data.eval_path")
            if kind != self.file_kind:
                raise ValueError(f"data.eval_path holds {kind} files but data.path {self.file_kind} files; use one kind")
            self._check_fields(_first_record(self.eval_files[0], kind), self.eval_files[0])
        if self.packing and self.is_image:
            raise ValueError("data.packing applies to token sequences; image_caption records are not packed")

    # ------------------------------------------------------------------ driver: checks and datasets
    @property
    def is_image(self) -> bool:
        return self.format == "image_caption"

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_files) or self.eval_fraction > 0

    def _fields(self) -> dict[str, str]:
        return {
            "messages": self.messages_field, "prompt": self.prompt_field, "completion": self.completion_field,
            "text": self.text_field, "image": self.image_field, "caption": self.caption_field,
        }

    def _required(self, fmt: str) -> list[str]:
        f = self._fields()
        return {"messages": [f["messages"]], "prompt_completion": [f["prompt"], f["completion"]],
                "text": [f["text"]], "image_caption": [f["image"], f["caption"]]}[fmt]

    def _detect(self, first: dict[str, Any]) -> str:
        for fmt in _DETECT_ORDER:
            if all(name in first for name in self._required(fmt)):
                return fmt
        wanted = {fmt: self._required(fmt) for fmt in _DETECT_ORDER}
        raise ValueError(
            f"cannot tell the record format of {self.files[0]}: its first record has fields {sorted(first)}; "
            f"expected one of {wanted} (or set data.format and the data.*_field names)"
        )

    def _check_fields(self, first: dict[str, Any], where: str) -> None:
        for name in self._required(self.format):
            if name not in first:
                close = difflib.get_close_matches(name, list(first), n=1)
                hint = f"; did you mean {close[0]!r} (set data.{self._field_option(name)}={close[0]})?" if close else ""
                raise ValueError(
                    f"the first record of {where} has no {name!r} field for {self.format} records "
                    f"(fields: {sorted(first)}){hint}"
                )

    def _field_option(self, name: str) -> str:
        return next(f"{key}_field" for key, value in self._fields().items() if value == name)

    def datasets(self) -> dict[str, Any]:
        """Ray Data datasets ``{"train": ..., "eval": ...}`` (no eval key without eval data), read lazily by Ray
        Data's tasks: for the records the driver does not split itself (``driver_shards``)."""
        import_ray_library("data")
        if self.eval_files:
            return {"train": self._read_with_ray_data(self.files), "eval": self._read_with_ray_data(self.eval_files)}
        if self.eval_fraction > 0:
            fraction, seed = self.eval_fraction, self.seed
            held = lambda row: _in_eval(row, fraction, seed)  # noqa: E731
            ds = self._read_with_ray_data(self.files)
            return {"train": ds.filter(lambda row: not held(row), num_cpus=READ_NUM_CPUS),
                    "eval": ds.filter(held, num_cpus=READ_NUM_CPUS)}
        return {"train": self._read_with_ray_data(self.files)}

    def on_driver(self) -> bool:
        """Whether the driver reads the records itself: local .jsonl files of at most ``DRIVER_READ_BYTES`` in all
        (the training and the held-out files each)."""
        return self.file_kind == "jsonl" and all(fits_on_driver(files, DRIVER_READ_BYTES)
                                                 for files in (self.files, self.eval_files) if files)

    def driver_rows(self) -> dict[str, list[list[dict[str, Any]]]] | None:
        """Each file's rows (``_rows_on_driver``) of the training and held-out records, ``{"train": ..., "eval":
        ...}`` (no eval key without eval data), where the driver reads them: local .jsonl files of at most
        ``DRIVER_READ_BYTES`` in all (the training and the held-out files each); None where Ray Data does."""
        if not self.on_driver():
            return None
        if self.eval_files:
            return {"train": self._rows_on_driver(self.files), "eval": self._rows_on_driver(self.eval_files)}
        per_file = self._rows_on_driver(self.files)
        if self.eval_fraction <= 0:
            return {"train": per_file}
        fraction, seed = self.eval_fraction, self.seed
        sides: tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]]] = ([], [])
        for rows in per_file:  # each row's side decided once
            split: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
            for row in rows:
                split[_in_eval(row, fraction, seed)].append(row)
            sides[0].append(split[0])
            sides[1].append(split[1])
        return {"train": sides[0], "eval": sides[1]}

    def driver_shards(self, world_size: int) -> list[dict[str, Any]] | None:
        """Each rank's records where the driver reads them (``driver_rows``), split here instead of by Ray Train:
        ``[{"train": rank 0's rows, "eval": every held-out row or None}, ...]``; None where Ray Data reads them
        (or a side has no row: Ray Data's reader then says what is wrong). The training rows, in file order, are
        cut into ``world_size`` contiguous runs of ``len // world_size`` rows (the remainder left out, as Ray
        Train's ``streaming_split(equal=True)`` leaves it): the same shards on every run, each in its order, as
        ``ShardStream``'s cursor needs. The ranks get them with their start command: no dataset manager, split
        coordinator or read task starts (each a Ray worker process on the first step's path)."""
        rows = self.driver_rows()
        if rows is None:
            return None
        train = [row for per_file in rows["train"] for row in per_file]
        held_out = [row for per_file in rows["eval"] for row in per_file] if "eval" in rows else None
        if not train or held_out == []:
            return None
        size = len(train) // world_size
        return [{"train": train[r * size:(r + 1) * size], "eval": held_out} for r in range(world_size)]

    def _rows_on_driver(self, files: list[str]) -> list[list[dict[str, Any]]]:
        """Each file's rows as ``read_text(drop_empty_lines=True, include_paths=True)`` gives them
        (``{"text": line, "path": file}``, the lines split as its text reader splits them: ``str.splitlines`` of
        the UTF-8 text, blank ones dropped)."""
        per_file = []
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"record file {path} is not UTF-8 text (byte {exc.start} cannot be decoded); "
                                 "save it as UTF-8") from None
            per_file.append([{"text": line, "path": path} for line in text.splitlines() if line.strip() != ""])
        return per_file

    def _read_with_ray_data(self, files: list[str]) -> Any:
        import ray.data

        uris = [_ray_uri(f) for f in files]
        if self.file_kind == "jsonl":
            ds = ray.data.read_text(uris, drop_empty_lines=True, include_paths=True, num_cpus=READ_NUM_CPUS,
                                    override_num_blocks=len(uris))
        else:
            ds = ray.data.read_parquet(uris, include_paths=True, num_cpus=READ_NUM_CPUS, override_num_blocks=len(uris))
        ds.context.enable_progress_bars = False
        return ds

    # ------------------------------------------------------------------ ranks: records -> examples
    def builder(self, *, bundle: Any, pipeline: Any) -> TextExampleBuilder | ImageExampleBuilder:
        """The example builder of this format for a rank's bundle and pipeline."""
        if self.is_image:
            if not hasattr(pipeline, "height"):
                raise ValueError("image_caption records need an image pipeline with height/width (e.g. SD3Pipeline)")
            return ImageExampleBuilder(height=pipeline.height, width=pipeline.width, fields=self._fields())
        tokenizer = getattr(bundle, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"{self.format} records need a bundle with a tokenizer (e.g. CausalLMBundle)")
        return TextExampleBuilder(
            tokenizer,
            format=self.format,
            max_length=self.max_length,
            fields=self._fields(),
            use_chat_template=bool(getattr(pipeline, "use_chat_template", True)),
            system_prompt=getattr(pipeline, "system_prompt", None),
        )


# ---------------------------------------------------------------------------------------------- helpers
def _filesystem(path: str) -> tuple[Any, str, str]:
    """(pyarrow filesystem, path inside it, URI prefix to rebuild a full path) of a local path or URI."""
    import pyarrow.fs

    if "://" in path and not path.startswith("local://"):
        fs, inner = pyarrow.fs.FileSystem.from_uri(path)
        return fs, inner, path.split("://", 1)[0] + "://"
    local = os.path.abspath(os.path.expanduser(path.removeprefix("local://")))
    return pyarrow.fs.LocalFileSystem(), local, ""


def list_record_files(path: str, option: str) -> tuple[list[str], str]:
    """The record files under ``path`` (sorted; hidden files skipped) and their kind; ValueError with a fix otherwise."""
    import pyarrow.fs

    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{option} must be a file, folder or URI, got {path!r}")
    try:
        fs, inner, prefix = _filesystem(path)
        info = fs.get_file_info(inner)
    except (OSError, ValueError) as exc:
        raise RecordPathError(f"{option}={path!r} cannot be opened: {exc}") from None
    if info.type == pyarrow.fs.FileType.NotFound:
        raise RecordPathError(f"{option}={path!r} does not exist; point it at a .jsonl/.parquet file or a folder of them")
    if info.type == pyarrow.fs.FileType.File:
        found = [inner]
    else:
        selector = pyarrow.fs.FileSelector(inner, recursive=True)
        found = sorted(
            i.path for i in fs.get_file_info(selector)
            if i.type == pyarrow.fs.FileType.File and os.path.splitext(i.path)[1].lower() in _KINDS
            and not any(part.startswith((".", "_")) for part in i.path[len(inner):].split("/"))
        )
        if not found:
            raise ValueError(f"{option}={path!r} is a folder without record files ({', '.join(_KINDS)})")
    kinds = {_KINDS.get(os.path.splitext(f)[1].lower()) for f in found}
    if None in kinds:
        raise ValueError(f"{option}={path!r}: unsupported record file; use {', '.join(_KINDS)}")
    if len(kinds) > 1:
        raise ValueError(f"{option}={path!r} mixes record file kinds {sorted(kinds)}; keep one kind per folder")
    return [prefix + f for f in found], kinds.pop()


def _first_record(path: str, kind: str) -> dict[str, Any]:
    """The first record of a file (JSON lines: the first non-blank line; parquet: the schema's fields)."""
    fs, inner, _ = _filesystem(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open_input_file(inner) as f:
            return {name: None for name in pq.read_schema(f).names}
    with fs.open_input_stream(inner) as f:
        head = f.read(1 << 20).decode("utf-8", errors="replace")
    line = next((ln for ln in head.splitlines() if ln.strip()), None)
    if line is None:
        raise ValueError(f"record file {path} is empty")
    if line.lstrip().startswith("["):
        raise ValueError(f"{path} is a JSON array; write one JSON object per line (JSON lines, .jsonl)")
    try:
        first = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the first line of {path} is not JSON ({exc}); write one JSON object per line") from None
    if not isinstance(first, dict):
        raise ValueError(f"the first line of {path} is a JSON {type(first).__name__}, expected an object")
    return first


def _ray_uri(path: str) -> str:
    """``local://`` for local paths on a multi-node cluster (read on the driver's node), else the path."""
    import ray

    if "://" in path or not ray.is_initialized():
        return path
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"local://{path}" if alive > 1 else path


def record_digest(row: dict[str, Any]) -> bytes:
    """A stable digest of a row's content (its source file path left out)."""
    h = hashlib.sha256()
    for key in sorted(k for k in row if k != "path"):
        value = row[key]
        if isinstance(value, (bytes, bytearray)):
            data = bytes(value)
        else:
            data = json.dumps(value, default=str, sort_keys=True).encode()
        h.update(key.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.digest()


def _in_eval(row: dict[str, Any], fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(seed.to_bytes(8, "little") + record_digest(row)).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction
