"""DCP (torch.distributed.checkpoint) save/load that never unpickles arbitrary objects.

DCP writes tensor shards in its own format and a ``.metadata`` index with ``pickle``. We only put
tensors into DCP state dicts, and read the index with an unpickler that admits the handful of
classes DCP's metadata consists of, so a tampered checkpoint cannot run code on load.
"""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from typing import Any

import torch



def quiet_single_process_warning() -> None:
    """One rank saves without DCP's plan exchange (``no_dist``, ``_one_rank``), which DCP warns about at every
    save as if it were a mistake ("assuming the intent is to save in a single process": it is). Hide only that
    warning (done on import: a filter set once, not per save from the writer thread, which would race)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming "
                            "the intent is to save in a single process", category=UserWarning)


quiet_single_process_warning()

_ALLOWED_MODULE_PREFIXES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._extension",
    "torch.distributed.checkpoint.default_planner",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"), ("torch", "float64"),
    ("torch", "int64"), ("torch", "int32"), ("torch", "int8"), ("torch", "uint8"), ("torch", "bool"),
    ("torch", "strided"), ("torch", "sparse_coo"), ("torch", "contiguous_format"),
    ("torch", "preserve_format"), ("torch", "channels_last"),
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "object"),
    ("pathlib", "PosixPath"),
    ("_codecs", "encode"),
    ("torch.serialization", "_get_layout"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or module.startswith(_ALLOWED_MODULE_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata references {module}.{name}, which is not a DCP metadata type; "
            "refusing to load it (the checkpoint may be corrupt or tampered with)"
        )


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use (~1 s, with DTensor and sympy): a driver that only
    checks a recipe's targets never needs it."""
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        """A ``FileSystemReader`` whose metadata is read with a restricted unpickler."""

        def read_metadata(self):  # noqa: D401 - DCP hook
            path = self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def safe_reader(directory: str) -> Any:
    """A DCP ``FileSystemReader`` of ``directory`` whose metadata is read with a restricted unpickler."""
    return _safe_reader_class()(directory)


def _check_tensors_only(tree: Any, path: str = "") -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            _check_tensors_only(value, f"{path}.{key}" if path else str(key))
    elif not isinstance(tree, torch.Tensor):
        raise TypeError(f"DCP state must hold only tensors (pickled objects are not loaded safely); {path} is {type(tree)}")


def save(state: dict[str, Any], directory: str) -> None:
    """Collective: every rank writes its shards of ``state`` (tensors only) under ``directory``."""
    _check_tensors_only(state)
    _dcp().save(state, checkpoint_id=directory, no_dist=_one_rank())


def _one_rank(group: Any = None) -> bool:
    """Whether a DCP collective over ``group`` (default: the default group) has one rank: DCP's plan exchange
    between ranks is then pure overhead (a third of a small model's save: ~6 of ~20 ms of CPU here)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1


_GROUP: list[Any] = []  # this process's checkpoint process group, once made


def checkpoint_group() -> Any:
    """A gloo process group over every rank, for the checkpoint's own collectives (``save_staged`` from a
    background thread, whose planning then never interleaves with the training's on the default group, and
    the ranks' agreement before a commit); None when this process is not distributed. Collective the first time: every
    rank makes it in the same call (a save)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of this rank's shards of ``state`` (tensors only) in CPU memory, as DCP's ``async_save``
    stages them: what ``save_staged`` writes while the live tensors change."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    _check_tensors_only(state)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        return stager.stage(state)
    finally:
        stager.close()


def save_staged(staged: dict[str, Any], directory: str) -> None:
    """Collective over ``checkpoint_group()``: write ``stage``'s copy under ``directory`` (from a background
    thread while the training runs collectives of its own on the default group). The ranks write their
    staged states in the same order (one thread per rank, one save after another)."""
    group = checkpoint_group()
    if _one_rank(group):
        _dcp().save(staged, checkpoint_id=directory, no_dist=True)
    else:
        _dcp().save(staged, checkpoint_id=directory, process_group=group)


def load(state: dict[str, Any], directory: str) -> None:
    """Collective: fill ``state``'s tensors in place from ``directory`` (resharding as needed)."""
    _check_tensors_only(state)
    reader = safe_reader(directory)
    try:
        reader.read_metadata()  # fail here, clearly, before DCP's collective machinery
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise ValueError(f"checkpoint shards at {directory} are unreadable or unsafe: {exc}") from exc
    _dcp().load(state, storage_reader=reader)


def stored_keys(directory: str) -> set[str]:
    """Flattened keys (``"model.blocks.0.weight"``) of the tensors a checkpoint holds."""
    try:
        metadata = safe_reader(directory).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise ValueError(f"checkpoint shards at {directory} are unreadable or unsafe: {exc}") from exc
    return set(metadata.state_dict_metadata)
