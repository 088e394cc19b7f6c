"""Where a run's checkpoints live in its storage, and which of them count: the folder layout the train ranks
write (``runtime.worker._save``) and the driver reads (``BaseTrainer._has_checkpoint``), without the ranks'
imports (Ray Train, torch): the driver asks before it starts Ray."""

from __future__ import annotations

import posixpath
import re
from typing import Any, NamedTuple

import pyarrow.fs

STATE_FILE = "controller_state.json"
SHARDS_DIR = "shards"
COMMIT_FILE = ".unirl_committed"
"""Written last into a checkpoint folder in the run's storage, by rank 0 once every rank's shards are there:
the folder is complete (``runtime.worker._save``)."""
CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")


class CheckpointFolder(NamedTuple):
    step: int
    path: str
    committed: bool
    """It holds ``COMMIT_FILE``: complete, and the only kind a restart or resume loads."""
    has_state: bool
    """It holds rank 0's ``STATE_FILE`` (always true of a committed folder, which is not asked). An uncommitted
    folder with one: written by a run from before the marker, or a save killed between its state file and its
    marker; without one: a save killed (or failed) before it, never a checkpoint."""


def checkpoint_folders(fs: Any, root: str, *, state: bool = True) -> list[CheckpointFolder]:
    """Every ``checkpoint_<step>`` folder under ``root`` (on pyarrow filesystem ``fs``), oldest first.
    ``state=False``: ``has_state`` is not asked (False for uncommitted folders: one request less per folder)."""
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    folders = sorted((int(m.group(1)), info.path) for info in infos
                     if info.type == pyarrow.fs.FileType.Directory and (m := CHECKPOINT_NAME.match(info.base_name)))
    if not folders:
        return []
    marked = [i.type == pyarrow.fs.FileType.File for i in fs.get_file_info([posixpath.join(p, COMMIT_FILE) for _, p in folders])]
    open_ = [path for (_, path), m in zip(folders, marked) if not m] if state else []
    stated = {path for path, i in zip(open_, fs.get_file_info([posixpath.join(p, STATE_FILE) for p in open_]) if open_ else [])
              if i.type == pyarrow.fs.FileType.File}
    return [CheckpointFolder(step, path, m, m or path in stated) for (step, path), m in zip(folders, marked)]


def committed_checkpoints(fs: Any, root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint folder under ``root`` (on pyarrow filesystem ``fs``) that holds
    ``COMMIT_FILE``, oldest first."""
    return [(f.step, f.path) for f in checkpoint_folders(fs, root, state=False) if f.committed]


def delete_checkpoint(fs: Any, path: str) -> None:
    """Remove a checkpoint folder from storage, its commit marker first (a folder half deleted is never
    taken for a complete one)."""
    marker = posixpath.join(path, COMMIT_FILE)
    if fs.get_file_info(marker).type == pyarrow.fs.FileType.File:
        fs.delete_file(marker)
    if fs.get_file_info(path).type == pyarrow.fs.FileType.Directory:
        fs.delete_dir(path)
