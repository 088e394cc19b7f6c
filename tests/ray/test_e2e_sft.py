"""End to end on CPU for the SFT trainer: Ray Train workers (FSDP2; 2 ranks over gloo for the resume
and kill runs) reading their shards of a Ray Data dataset (for the resume and kill runs read by Ray Data's
tasks and split by Ray Train, as files beyond the driver's read size are; the others' split by the driver),
MLflow, checkpoints and export. A resumed run
continues with exactly the records an uninterrupted one trains on (packing and bad records included), and
a worker killed mid-call replays the lost steps on the same records (one straight run, with that kill,
serves both: the resume is of a copy of its storage taken after step 3, with two steps per call instead
of one); the tiny SD3 learns image-caption pairs. That the tiny LM learns chat records (its loss falls,
periodic evaluation, per-step metrics, an export a GRPO run starts from) is asserted on the SFT run that
starts the agentic trainer: ``tests/ray/test_e2e_agentic.py``."""

import json
import os

import pytest
import torch
from omegaconf import OmegaConf
from support import ONE_WORKER, ROOT, attempts, copy_run, kill_rank, load, logged, recipe_path

import unirl_ray.data.records as records_module
from unirl_ray.train.rank import StackWorker
from unirl_ray.runtime.worker import SHARDS_DIR, STATE_FILE
from unirl_ray.train.configs import TrainTopology
from unirl_ray.trainer.sft import SFTTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

CHAT = str(ROOT / "unirl_ray" / "assets" / "data" / "sft_chat.jsonl")
# the learning tests run on ONE_WORKER; the kill / resume runs keep two FSDP2 ranks reading their shards


def recipe(tmp_path, name, run_name, *overrides):
    return load(recipe_path("sft", "tiny", name), tmp_path, run_name, *overrides, experiment="e2e-sft")


def test_record_sources_read_jsonl_and_parquet_and_hold_out_a_fraction(ray_local, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from unirl_ray.data.records import RecordSource
    from unirl_ray.data.sft_examples import parse_record

    source = RecordSource(path=CHAT, eval_fraction=0.25, seed=3)
    sets = {name: ds.take_all() for name, ds in source.datasets().items()}
    records = [json.dumps(parse_record(r, json_line=True)["messages"]) for name in ("train", "eval") for r in sets[name]]
    with open(CHAT) as f:
        assert sorted(records) == sorted(json.dumps(json.loads(line)["messages"]) for line in f)  # a partition
    assert 0 < len(sets["eval"]) < 16 and all(r["path"].endswith("sft_chat.jsonl") for r in sets["train"])

    folder = tmp_path / "pq"
    folder.mkdir()
    for part in range(2):
        table = pa.table({"prompt": [f"p{part}{i}" for i in range(3)], "completion": [f"c{part}{i}" for i in range(3)]})
        pq.write_table(table, folder / f"part{part}.parquet")
    parquet = RecordSource(path=str(folder), shuffle=False)
    assert parquet.format == "prompt_completion" and parquet.file_kind == "parquet"
    rows = parquet.datasets()["train"].take_all()
    assert sorted(r["prompt"] for r in rows) == ["p00", "p01", "p02", "p10", "p11", "p12"]
    assert all(parse_record(r, json_line=False)["completion"] == "c" + r["prompt"][1:] for r in rows)


def test_small_jsonl_files_are_read_on_the_driver_into_the_rows_and_blocks_ray_data_reads(ray_local, tmp_path,
                                                                                         monkeypatch):
    """Local .jsonl files of at most ``DRIVER_READ_BYTES`` are read by the driver (``driver_rows``, no Ray Data):
    the same rows Ray Data's reader gives, in the same order and blocks (one per file), with and without a
    held-out fraction; ``DRIVER_READ_BYTES = -1`` forces Ray Data. (How the SFT trainer splits those rows over
    the ranks itself: ``tests/unit/test_sft_data.py``; Ray Train splits the others: the kill and resume runs
    below.)"""
    import ray.data

    from unirl_ray.data.records import RecordSource

    folder = tmp_path / "lines"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b'{"text": "a"}\r\n\n  \n{"text": "b \\u00e9"}\n{"text": "\xc3\xa9t\xc3\xa9"}\n')
    (folder / "b.jsonl").write_bytes(b"".join(b'{"text": "%d"}\n' % i for i in range(7)) + b'{"text": "last"}')

    def refuse(*args, **kwargs):
        raise AssertionError("a small local file went through Ray Data's reader")

    def blocks(ds):
        return [m.num_rows for bundle in ds.iter_internal_ref_bundles() for m in bundle.metadata if m.num_rows]

    for options in ({"shuffle": False}, {"eval_fraction": 0.4, "seed": 1}):
        source = RecordSource(path=str(folder), **options)
        with monkeypatch.context() as patch:
            patch.setattr(ray.data, "read_text", refuse)
            on_driver = source.driver_rows()
        with monkeypatch.context() as patch:
            patch.setattr(records_module, "DRIVER_READ_BYTES", -1)
            assert source.driver_rows() is None
            by_ray_data = {name: ds.materialize() for name, ds in source.datasets().items()}
        assert set(on_driver) == set(by_ray_data) == ({"train", "eval"} if "eval_fraction" in options else {"train"})
        for name, ds in by_ray_data.items():
            assert [r for per_file in on_driver[name] for r in per_file] == ds.take_all(), (options, name)
            assert [len(rows) for rows in on_driver[name] if rows] == blocks(ds), (options, name)
        if "eval_fraction" not in options:
            assert [len(rows) for rows in on_driver["train"]] == [3, 8]  # one block per file, in the files' order
        rows = [r for per_file in on_driver.values() for rows in per_file for r in rows]
        assert len(rows) == 11 and {r["path"] for r in rows} == {str(folder / "a.jsonl"), str(folder / "b.jsonl")}


BAD_LINES = [
    "{not json",
    json.dumps({"prompt": "no messages"}),
    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}),
    json.dumps({"messages": [{"role": "user", "content": "x" * 90}, {"role": "assistant", "content": "a"}]}),
]
KILLED_STEPS = 6


def checkpoint_state(cfg, directory):
    with open(os.path.join(directory, STATE_FILE)) as f:
        state = json.load(f)
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in ("bundle", "pipeline", "backend", "algorithm", "stack")}
    worker = StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))
    worker.load(os.path.join(directory, SHARDS_DIR), state["backend"])
    return {k: v.detach().clone() for k, v in worker.backend.module.state_dict().items()}, state


@pytest.fixture(scope="module")
def bad_records(tmp_path_factory):
    """The shipped chat records with the BAD_LINES spread through the file, and the overrides that read them."""
    lines = open(CHAT).read().splitlines()
    for i, bad in enumerate(BAD_LINES):  # spread through the file
        lines.insert(7 * i + 3, bad)
    data = tmp_path_factory.mktemp("data") / "chat_with_bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return [f"data.path={data}", "data.packing=true", "data.eval_fraction=0.0", "trainer.eval_every=0",
            "trainer.batch_size=8", "trainer.checkpoint_every=3"]


@pytest.fixture(scope="module")
def killed(ray_local, tmp_path_factory, bad_records):
    """The straight SFT run of this module: 6 steps over the records with bad lines, packed, a checkpoint
    at step 3, one step per call; rank 1 is SIGKILLed while step 5 trains (step 4 already logged). Ray
    Train restarts the group from the step-3 checkpoint and the feeds start again at its data cursor. Its
    storage is copied as step 4 starts (``support.copy_run``: the step-3 checkpoint committed, nothing newer)."""
    storage = tmp_path_factory.mktemp("straight")
    copy = tmp_path_factory.mktemp("sft-copy") / "after_step_3"
    trainer = SFTTrainer(recipe(storage, "char_chat_sft.yaml", "straight", f"trainer.num_steps={KILLED_STEPS}",
                                "trainer.steps_per_call=1", "++ray.max_failures=1", "ray.scaling.num_workers=2",
                                *bad_records))
    killed, original = [], trainer.train_steps

    def train_steps(first, count):
        if first == 4 and not copy.exists():
            copy_run(trainer, copy)
        if first == 5 and not killed:
            killed.append(kill_rank(trainer, 1))
        return original(first, count)

    trainer.train_steps = train_steps
    with pytest.MonkeyPatch.context() as patch:  # read and split by Ray Data and Ray Train, as large files are
        patch.setattr(records_module, "DRIVER_READ_BYTES", -1)
        assert trainer.worker_datasets() is not None
        trainer.fit()
    return trainer, storage, killed, copy


def test_sft_worker_killed_mid_call_replays_the_lost_steps_on_the_same_records(killed):
    """Step 4's loss logged before the kill equals the one logged after it: the same records, the same result."""
    trainer, _, pids, _ = killed
    assert pids and trainer.restarts == 1
    losses = attempts(trainer, "train/loss")
    assert sorted(losses) == list(range(1, KILLED_STEPS + 1))
    assert len(losses[4]) == 2 and losses[4][0] == pytest.approx(losses[4][1], rel=1e-6)  # replayed exactly
    assert all(len(v) == 1 for s, v in losses.items() if s != 4)
    tokens = attempts(trainer, "data/trained_tokens")
    assert tokens[4][0] == tokens[4][1] > 0  # the same records, from the checkpoint's data cursor


def test_resume_continues_with_exactly_the_next_records(killed, bad_records, monkeypatch):
    """Stopped after step 3 (the straight run's copy) and started again with two steps per call: the same
    records and numbers, step by step, as the straight run (packing and bad records included), and the same
    final weights."""
    monkeypatch.setattr(records_module, "DRIVER_READ_BYTES", -1)  # as the straight run read them
    straight, straight_dir, _, copy = killed
    split = SFTTrainer(recipe(copy, "char_chat_sft.yaml", "straight", "trainer.num_steps=6", "trainer.steps_per_call=2",
                              *bad_records))
    calls, original = [], split.train_steps

    def train_steps(first, count):
        calls.append((first, count))
        return original(first, count)

    split.train_steps = train_steps
    split.fit()
    assert calls == [(4, 2), (6, 1)]  # resumed after step 3, two steps per call (the last cut at the end)
    assert split.tracker.run_id == straight.tracker.run_id  # resumed in (a copy of) the same MLflow run
    for key in ("train/loss", "data/trained_tokens", "data/skipped_total", "data/epoch"):
        assert logged(split, key) == logged(straight, key), key  # the same records, step by step
    skipped = sum(logged(straight, f"data/skipped_{r}")[s] for r in ("bad_json", "missing_field", "empty_text",
                                                                    "no_trainable_tokens") for s in range(1, 7))
    assert skipped >= 3  # 6 steps x 8 records cover most of the 36 records, bad ones included
    assert logged(straight, "data/epoch")[6] == 1  # crossed an epoch boundary after the resume point

    cfg = recipe(copy, "char_chat_sft.yaml", "straight", *bad_records)
    want, want_state = checkpoint_state(cfg, straight_dir / "straight" / "checkpoint_000006")
    got, got_state = checkpoint_state(cfg, copy / "straight" / "checkpoint_000006")
    assert want_state["controller"]["data"] == got_state["controller"]["data"]
    assert want_state["controller"]["data"]["split"] == "ray_train"  # the path these runs took
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_sd3_image_caption_sft_loss_falls(ray_local, tmp_path):
    sft = SFTTrainer(recipe(tmp_path, "sd3_caption_sft.yaml", "sd3", "trainer.num_steps=12", "trainer.eval_every=12",
                            "trainer.eval_on_start=true", "trainer.checkpoint_every=12", *ONE_WORKER))
    sft.fit()
    evals = logged(sft, "eval/loss")  # fixed noise per held-out record: comparable across evaluations
    assert sorted(evals) == [0, 12] and evals[12] < 0.95 * evals[0], evals
    assert len(logged(sft, "perf/images_per_s")) == 12
    assert logged(sft, "data/images")[12] == 8
