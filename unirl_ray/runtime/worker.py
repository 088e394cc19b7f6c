"""The Ray Train worker program: build the rank's objects once, then serve the controller.

``worker_main`` is the ``train_loop_per_worker`` of the long-lived ``TorchTrainer`` run. On every
start (first start, resume, or restart after a failure) it restores the run's newest committed
checkpoint, announces ``{restored_step, controller_state}`` to the broker and then executes
commands until ``stop``. ``save`` is collective: every rank writes its DCP shards and copies them into the
run's storage, and rank 0 marks the folder committed once all are there (``_save``); a synchronous save is
acknowledged once committed, an asynchronous one once the shards are copied to memory (a thread writes,
stores and commits them; ``wait_checkpoint`` waits for that).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any

import pyarrow.fs
import ray
import ray.train
import torch

from unirl_ray.runtime.broker import pack, unpack
from unirl_ray.runtime.checkpoint_layout import (  # noqa: F401 - STATE_FILE, SHARDS_DIR, COMMIT_FILE: read from here too
    CHECKPOINT_NAME as _CHECKPOINT_NAME,
    COMMIT_FILE,
    SHARDS_DIR,
    STATE_FILE,
    checkpoint_folders,
    committed_checkpoints,
)
from unirl_ray.runtime.checkpoint_layout import delete_checkpoint as _delete_checkpoint
from unirl_ray.runtime.cluster import set_niceness
from unirl_ray.runtime.operations import dispatch
from unirl_ray.train.backend import dcp_io
from unirl_ray.train.configs import TrainTopology

log = logging.getLogger(__name__)

DEFAULT_RANK_CLASS = "unirl_ray.train.rank.StackWorker"
"""What a train rank builds unless the trainer names another class (``TrainGroup(rank_class=...)``): an
object built as ``cls(sections, topology=, device=, open_shard=)`` with ``save``, ``load``,
``policy_version`` and its commands marked ``@operation`` (``runtime.operations``); with ``save_async``
(``StackWorker.save_async``) too, its asynchronous checkpoints are written in the background, else in the
save command."""


def _device(use_gpu: bool) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        local = ray.train.get_context().get_local_rank()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def read_checkpoint_state(directory: str, name: str | None = None) -> dict[str, Any]:
    """The ``controller_state.json`` of a checkpoint folder, checked; RuntimeError naming the folder
    and what to do when the file is missing or not the state ``_save`` writes, or the shards are gone.

    ``name`` is how the folder is named in messages (its storage path; default ``directory``).
    """
    where = name or directory
    fix = (f"the checkpoint {where} is damaged ({{}}). A run resumes from its newest committed checkpoint, so this "
           f"run cannot resume as is: restore the folder from a backup, delete its {COMMIT_FILE} to resume from "
           "the checkpoint before it, or start over with a new trainer.run_name (or after deleting the run folder)")
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise RuntimeError(fix.format(f"{STATE_FILE} is missing")) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RuntimeError(fix.format(f"{STATE_FILE} is unreadable: {type(exc).__name__}: {exc}")) from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(state.get("backend"), dict):
        raise RuntimeError(fix.format(f"{STATE_FILE} lacks a 'step' >= 0 and a 'backend' entry"))
    if not os.path.isdir(os.path.join(directory, SHARDS_DIR)):
        raise RuntimeError(fix.format(f"its {SHARDS_DIR}/ folder is missing"))
    return state


def _restore(worker: Any) -> tuple[int, dict[str, Any] | None]:
    """Load the newest committed checkpoint of the run (``_save``'s, or one Ray Train registered: a run
    checkpointed before this project committed its own); ``(0, None)`` for a new run. Rank 0 chooses and
    every rank loads its choice (a listing on another node may lag behind a commit)."""
    storage = ray.train.get_context().get_storage()
    own = committed_checkpoints(storage.storage_filesystem, storage.experiment_fs_path)
    registered = ray.train.get_checkpoint()
    choice = own[-1][1] if own else None
    if registered is not None:
        match = _CHECKPOINT_NAME.match(posixpath.basename(registered.path.rstrip("/")))
        if choice is None or (match is not None and int(match.group(1)) > own[-1][0]):
            choice = _REGISTERED
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [choice]
        torch.distributed.broadcast_object_list(box, src=0)
        choice = box[0]
    if choice is None:
        return 0, None
    checkpoint = registered if choice == _REGISTERED else ray.train.Checkpoint(choice, filesystem=storage.storage_filesystem)
    if checkpoint is None:
        raise RuntimeError("rank 0 resumes from the checkpoint Ray Train registered, which this rank was not given")
    with checkpoint.as_directory() as directory:
        state = read_checkpoint_state(directory, name=checkpoint.path)
        worker.load(os.path.join(directory, SHARDS_DIR), state["backend"])
    return int(state["step"]), state


_REGISTERED = "<the checkpoint Ray Train registered>"


class _Writing:
    """This rank's asynchronous checkpoint still being written (``_save``): a thread that waits for the
    shards, then stores and commits them."""

    current: _Writing | None = None

    def __init__(self, name: str, run: Any) -> None:
        self.name, self.error = name, None
        self.thread = threading.Thread(target=self._run, args=(run,), name=f"unirl-save-{name}", daemon=True)
        self.thread.start()

    def _run(self, run: Any) -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - raised in the command that waits for it
            log.exception("writing checkpoint %s failed", self.name)
            self.error = exc

    @classmethod
    def join(cls, timeout_s: float) -> None:
        """Wait for this rank's asynchronous checkpoint (if any) to be written and committed; raise its error
        (``CheckpointWriteError``). One still running after ``timeout_s`` stays this rank's current one."""
        writing = cls.current
        if writing is None:
            return
        writing.thread.join(timeout_s)
        if writing.thread.is_alive():
            raise TimeoutError(f"checkpoint {writing.name} was not written within {timeout_s:.0f}s")
        cls.current = None
        if writing.error is not None:
            raise CheckpointWriteError(f"writing checkpoint {writing.name} failed: {type(writing.error).__name__}: "
                                       f"{writing.error}") from writing.error


class CheckpointWriteError(RuntimeError):
    """A checkpoint a rank wrote in the background failed. It ends the rank (``worker_main`` lets it out), so
    Ray Train restarts the worker group from the last committed checkpoint, as far as ``ray.max_failures``
    allows, as a failed write always did."""


def _agree(group: Any, ok: bool) -> bool:
    """Whether every rank's ``ok`` is true (all of them learn it: no rank waits on one that failed)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


_STORAGE_SHARED = False  # every rank of this group saw rank 0's files in the run's storage (the first save)


def _all_or_none(group: Any, failed: BaseException | None, rank: int, fs: Any, dest: str, others: str) -> None:
    """The ranks agree on a phase of a save (``_agree``): if it failed on any rank, every rank raises (its own
    error, else ``others``: what another rank failed to do) and rank 0, once every rank is done with the slot,
    deletes what the save left in it."""
    if _agree(group, failed is None):
        return
    if rank == 0:
        try:
            _delete_checkpoint(fs, dest)
        except Exception as exc:  # noqa: BLE001 - the next save of this step clears the slot again
            log.warning("could not clear the failed checkpoint %s: %s", dest, exc)
    if failed is not None:
        raise failed
    raise RuntimeError(others)


_SWEPT = False  # this process cleared the half-written folders earlier jobs left (at its first commit)


def _clear_old_folders(fs: Any, root: str, step: int, keep: int | None) -> None:
    """Rank 0, after committing ``step``: delete the committed checkpoints beyond the newest ``keep`` (None:
    none) and, once per process (only an earlier job leaves them: a save that fails clears its own slot), the
    folders of earlier steps left half written (no state file: never a checkpoint). The checkpoint is
    committed already: a folder that cannot be deleted is logged, not raised."""
    global _SWEPT
    folders = checkpoint_folders(fs, root, state=not _SWEPT) if keep is not None or not _SWEPT else []
    doomed = [] if _SWEPT else [f.path for f in folders if not f.has_state and f.step < step]
    _SWEPT = True
    if keep is not None:
        doomed += [f.path for f in [f for f in folders if f.committed][:-max(1, int(keep))]]
    for old in doomed:
        try:
            _delete_checkpoint(fs, old)
        except Exception as exc:  # noqa: BLE001 - the next commit tries again
            log.warning("could not delete the old checkpoint folder %s: %s", old, exc)


def _save(worker: Any, payload: dict[str, Any], rank: int, timeout_s: float) -> dict[str, Any]:
    """Collective checkpoint of step ``payload["step"]``: every rank writes its DCP shards (and rank 0 the
    controller state) into the run's storage (``checkpoint_<step>/`` in Ray Train's storage context: in
    place in a local or mounted folder; to a local folder first, then copied, for a URI); once every rank's
    are there (the ranks agree, ``_agree``: a failure on one fails the save on all), rank 0 writes
    ``COMMIT_FILE`` into it: only then is it committed, and only a committed checkpoint is ever loaded
    (``_restore``). Rank 0 then deletes the committed checkpoints beyond ``payload["keep"]`` (None: keeps all)
    and, at its first commit, the folders of earlier steps a killed job left half written (``_clear_old_folders``);
    a save that fails on any rank fails on every rank, and rank 0 clears its slot.

    ``payload["asynchronous"]`` (with a rank object that has ``save_async``): return once this rank's shards
    are copied to memory; a thread writes, stores and commits them. ``wait_checkpoint`` waits for it, and
    so does the next save first: at most one checkpoint is ever uncommitted. Otherwise all of it happens
    here, and rank 0 returns the committed path."""
    step = int(payload["step"])
    t0 = time.perf_counter()
    _Writing.join(timeout_s)  # the previous checkpoint is stored (and, by rank 0, committed)
    previous_wait = time.perf_counter() - t0
    storage = ray.train.get_context().get_storage()
    fs, name = storage.storage_filesystem, f"checkpoint_{step:06d}"
    dest = posixpath.join(storage.experiment_fs_path, name)
    group = dcp_io.checkpoint_group()  # collective the first time: every rank is here
    failed: BaseException | None = None
    if rank == 0:  # what a killed job left in this slot (never committed, or the run resumed from before it)
        try:
            _delete_checkpoint(fs, dest)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            failed = exc
    if not _agree(group, failed is None):  # no rank writes into the slot before it is cleared
        raise RuntimeError(f"checkpoint {name}: rank 0 could not clear {dest}"
                           + (f": {type(failed).__name__}: {failed}" if failed is not None else "")) from failed
    # a local (or mounted, shared) storage folder is written in place; a URI through a local folder first
    direct = isinstance(fs, pyarrow.fs.LocalFileSystem)
    tmp = dest if direct else tempfile.mkdtemp(prefix=f"unirl_ckpt_{step}_")

    def store_and_commit(meta: dict[str, Any], folder: str, failed: BaseException | None = None) -> str:
        global _STORAGE_SHARED
        try:
            if failed is None and rank == 0:
                state = {"step": step, "backend": meta, "controller": payload["controller"]}
                with open(os.path.join(folder, STATE_FILE), "w") as f:
                    json.dump(state, f)
            if failed is None and not direct:
                storage.persist_current_checkpoint(ray.train.Checkpoint.from_directory(folder), name)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            failed = exc
        # every rank's shards are in storage, or none commits
        _all_or_none(group, failed, rank, fs, dest, f"checkpoint {name} is not committed: another rank failed to write its shards")
        # once per process: every rank sees rank 0's state file, so the storage is one (a local storage_path on
        # several nodes is not); the ranks save together, so they all make this check at the same save
        seen = _STORAGE_SHARED or fs.get_file_info(posixpath.join(dest, STATE_FILE)).type == pyarrow.fs.FileType.File
        if not _STORAGE_SHARED and not _agree(group, seen):
            raise RuntimeError(
                f"checkpoint {name}: " + (f"this rank does not see {posixpath.join(dest, STATE_FILE)}" if not seen
                                          else "a rank does not see the checkpoint rank 0 wrote") +
                ": trainer.storage_path must be one storage every node of the run reaches (a shared folder or a "
                "URI such as s3://...), not a local folder of each node")
        _STORAGE_SHARED = True
        if rank == 0:
            with fs.open_output_stream(posixpath.join(dest, COMMIT_FILE)) as f:
                f.write(json.dumps({"step": step}).encode())
            _clear_old_folders(fs, storage.experiment_fs_path, step, payload.get("keep"))
        return dest

    t0 = time.perf_counter()
    try:
        if payload.get("asynchronous") and hasattr(worker, "save_async"):
            try:
                meta, write = worker.save_async(os.path.join(tmp, SHARDS_DIR))
            except Exception as exc:  # noqa: BLE001 - every rank learns it below
                failed = exc
            # every rank has its copy, or no rank's thread starts writing (their collectives would not match)
            _all_or_none(group, failed, rank, fs, dest, f"checkpoint {name} is not written: another rank failed to copy its shards")
            staged = time.perf_counter()

            def write_and_commit(folder: str = tmp) -> None:
                try:
                    failed = None
                    try:
                        write()
                    except Exception as exc:  # noqa: BLE001 - the other ranks learn it in store_and_commit
                        failed = exc
                    store_and_commit(meta, folder, failed)
                finally:
                    if not direct:
                        shutil.rmtree(folder, ignore_errors=True)

            _Writing.current = _Writing(name, write_and_commit)
            tmp = None  # the thread owns it now
            return {"step": step, "path": None, "name": name, "write_s": staged - t0, "report_s": 0.0,
                    "commit_wait_s": previous_wait}
        failed = None
        try:
            meta = worker.save(os.path.join(tmp, SHARDS_DIR))
        except Exception as exc:  # noqa: BLE001 - every rank learns it in store_and_commit, which raises it here
            meta, failed = {}, exc
        written_at = time.perf_counter()
        path = store_and_commit(meta, tmp, failed)
        return {"step": step, "path": path if rank == 0 else None, "name": name, "write_s": written_at - t0,
                "report_s": time.perf_counter() - written_at, "commit_wait_s": previous_wait}
    finally:
        if tmp is not None and not direct:
            shutil.rmtree(tmp, ignore_errors=True)


def _dispatch(worker: Any, op: str, payload: Any, rank: int, save_timeout_s: float) -> Any:
    """The runtime's own commands (a collective checkpoint, a liveness ping), else the rank object's."""
    if op == "save":
        return _save(worker, payload, rank, save_timeout_s)
    if op == "wait_checkpoint":  # an asynchronous save's commit
        _Writing.join(float(payload.get("timeout_s") or save_timeout_s))
        storage = ray.train.get_context().get_storage()
        return {"path": posixpath.join(storage.experiment_fs_path, payload["name"])}
    if op == "ping":
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None  # (never starts a Ray)
        return {"policy_version": worker.policy_version, "niceness": os.nice(0), "pid": os.getpid(), "node_id": node}
    return dispatch(worker, op, payload)


def rank_class(path: str) -> type:
    """The rank class at dotted ``path`` (``module.Class``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _shard_opener(name: str) -> Any:
    """A function starting a new epoch over this rank's shard of dataset ``name`` (None if there is none)."""
    try:
        shard = ray.train.get_dataset_shard(name)
    except KeyError:
        return None
    return None if shard is None else shard.iter_rows


def worker_main(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: see module docstring. ``config`` comes from ``TrainGroup``."""
    logging.basicConfig(level=config.get("log_level", "INFO"))
    if logging.getLogger().level > logging.DEBUG:  # Ray Train's per-rank lines for every checkpoint and report
        logging.getLogger("ray.train").setLevel(logging.WARNING)
    set_niceness(config.get("worker_niceness"), "train worker")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    topology = TrainTopology(world_size=world, rank=rank, dp_size=world, dp_rank=rank)
    broker = ray.get_actor(config["broker_name"], namespace=config["namespace"])
    if ray.get(broker.is_closed.remote(), timeout=60):
        return  # the controller gave up on this run (a failed start) before this worker came up
    torch.manual_seed(int(config.get("seed", 0)))
    # a run without datasets has no shard provider at all (TrainGroup starts none): it opens no shards
    opener = _shard_opener if config.get("has_datasets", True) else (lambda name: None)
    try:
        cls = rank_class(config.get("rank_class") or DEFAULT_RANK_CLASS)
        worker = cls(config["sections"], topology=topology, device=_device(config["use_gpu"]), open_shard=opener)
        restored_step, state = _restore(worker)
    except Exception as exc:  # report build errors to the driver instead of a bare worker crash
        info = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        ray.get(broker.announce.remote(rank, info), timeout=60)
        raise
    info = {"restored_step": restored_step, "controller": (state or {}).get("controller") if rank == 0 else None,
            "policy_version": worker.policy_version, "pid": os.getpid()}
    generation = ray.get(broker.announce.remote(rank, info), timeout=60)
    poll_s = float(config.get("poll_s", 2.0))
    while True:
        cmd = ray.get(broker.next_command.remote(rank, poll_s), timeout=poll_s + 60)
        if cmd is None:
            continue
        if cmd["op"] == "stop":
            try:  # a checkpoint still being written is finished first (the driver waits for its commit before)
                _Writing.join(float(config.get("save_timeout_s", 300)))
            except Exception:  # noqa: BLE001 - it is not committed; a resume loads the one before
                log.exception("rank %d: the last checkpoint was not written", rank)
            ray.get(broker.post_result.remote(rank, generation, cmd["id"], {"stopped": True}), timeout=60)
            return
        try:
            payload = unpack(cmd["payload"])
            result = _dispatch(worker, cmd["op"], payload, rank, float(config.get("save_timeout_s", 300)))
            result = pack(result)  # inline when small, else through the object store
        except CheckpointWriteError:
            log.exception("rank %d: a checkpoint written in the background failed; ending the rank", rank)
            raise
        except Exception as exc:
            log.exception("rank %d failed on %s", rank, cmd["op"])
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        ray.get(broker.post_result.remote(rank, generation, cmd["id"], result), timeout=60)
