"""A rank's SFT feed without Ray (shards are plain lists): the bad-record policy, and two gloo ranks
with uneven packed shards that still run the same forwards and compute the single-process loss."""

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from _dist import run_ranks
from unirl_ray.config.recipe import load_recipe
from unirl_ray.train.rank import StackWorker
from unirl_ray.train.configs import TrainTopology
from unirl_ray.trainer.sft import SFTTrainer

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
RECIPE = os.path.join(REPO, "recipes", "sft", "tiny", "char_chat_sft.yaml")
CHAT = os.path.join(REPO, "unirl_ray", "assets", "data", "sft_chat.jsonl")
BAD_LINES = [
    "{not json",                                                                              # bad_json
    json.dumps({"prompt": "no messages"}),                                                    # missing_field
    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}),  # empty_text
    json.dumps({"messages": "a string"}),                                                     # bad_messages
    json.dumps({"messages": [{"role": "user", "content": "x" * 90}, {"role": "assistant", "content": "a"}]}),  # no_trainable_tokens
]


def source(tmp_path, *overrides):
    """The recipe's RecordSource (built on the "driver") over the chat file."""
    trainer = SFTTrainer(load_recipe(RECIPE, [f"trainer.storage_path={tmp_path}", "data.eval_fraction=0.0",
                                              "trainer.eval_every=0", *overrides]))
    return trainer.data, {n: OmegaConf.to_container(trainer.recipe[n], resolve=True) for n in trainer.worker_sections}


def lines_of(path, extra=()):
    with open(path) as f:
        return [{"text": line, "path": path} for line in [*f.read().splitlines(), *extra]]


def start(sections, src, rows, *, per_rank, topology=TrainTopology(), eval_rows=None):
    torch.manual_seed(0)
    shards = {"train": lambda: iter(rows), "eval": (lambda: iter(eval_rows)) if eval_rows else None}
    worker = StackWorker(sections, topology=topology, device=torch.device("cpu"), open_shard=shards.get)
    worker.sft_start(source=src, records_per_rank=per_rank, cursor={"epoch": 0, "offset": 0})
    return worker


def test_bad_records_are_counted_and_skipped(tmp_path):
    src, sections = source(tmp_path, "data.shuffle=false")
    rows = lines_of(CHAT)[:11] + [{"text": line, "path": "/data/bad.jsonl"} for line in BAD_LINES]
    worker = start(sections, src, rows, per_rank=16)
    (step,) = worker.sft_train([0])
    assert step["stats"]["records"] == 16
    assert step["stats"]["skipped"] == {"bad_json": 1, "missing_field": 1, "empty_text": 1, "bad_messages": 1,
                                        "no_trainable_tokens": 1}
    assert step["rows"] == 11 and step["pad_rows"] == 5 and torch.isfinite(torch.tensor(step["metrics"]["train/loss"]))
    assert step["cursor"] == {"epoch": 0, "offset": 16}


def test_fail_policy_names_the_file_and_the_reason(tmp_path):
    src, sections = source(tmp_path, "data.shuffle=false", "data.on_bad_record=fail")
    rows = lines_of(CHAT)[:3] + [{"text": BAD_LINES[1], "path": "/data/bad.jsonl"}]
    worker = start(sections, src, rows, per_rank=4)
    with pytest.raises(ValueError, match=r"bad record in /data/bad.jsonl .*missing_field.*on_bad_record=skip"):
        worker.sft_train([0])


def _rank_step(sections, src, shards, eval_rows):
    import torch.distributed as dist

    rank = dist.get_rank()
    worker = start(sections, src, shards[rank], per_rank=len(shards[rank]), topology=TrainTopology.from_env(),
                   eval_rows=eval_rows)
    (step,) = worker.sft_train([0])
    return {"loss": step["metrics"]["train/loss"], "rows": step["rows"], "pad_rows": step["pad_rows"],
            "eval": worker.sft_eval()}


def test_two_ranks_with_uneven_packed_shards_match_one_process(tmp_path):
    src, sections = source(tmp_path, "data.shuffle=false", "data.packing=true", "stack.micro_batch_size=1")
    rows = lines_of(CHAT)
    short = sorted(rows[:16], key=lambda r: len(r["text"]))
    shards = [short[:8], short[8:]]  # rank 0 gets the short conversations: fewer packed rows
    ranks = run_ranks(_rank_step, sections, src, shards, rows[16:])
    assert ranks[0]["rows"] < ranks[1]["rows"]  # uneven packing ...
    assert ranks[0]["rows"] + ranks[0]["pad_rows"] == ranks[1]["rows"] + ranks[1]["pad_rows"]  # ... same forwards
    assert ranks[0]["loss"] == ranks[1]["loss"]  # reduced over ranks

    single = start(sections, src, short, per_rank=16, eval_rows=rows[16:])
    (step,) = single.sft_train([0])
    assert ranks[0]["loss"] == pytest.approx(step["metrics"]["train/loss"], rel=1e-5)  # global token mean
    evaluated = single.sft_eval()
    assert sum(r["eval"]["units"] for r in ranks) == evaluated["units"] > 0
    assert sum(r["eval"]["loss_sum"] for r in ranks) == pytest.approx(evaluated["loss_sum"], rel=1e-4)


def _rank_fails(sections, src, shards):
    import torch.distributed as dist

    worker = start(sections, src, shards[dist.get_rank()], per_rank=2, topology=TrainTopology.from_env())
    try:
        worker.sft_train([0])
    except ValueError as exc:
        return str(exc)
    return None


def test_fail_policy_stops_every_rank_not_only_the_one_with_the_bad_record(tmp_path):
    src, sections = source(tmp_path, "data.shuffle=false", "data.on_bad_record=fail")
    good = lines_of(CHAT)
    shards = [good[:2], [good[2], {"text": BAD_LINES[0], "path": "/data/bad.jsonl"}]]
    errors = run_ranks(_rank_fails, sections, src, shards)  # returns: nobody waits in a collective for rank 1
    assert "another rank hit a bad record" in errors[0]
    assert errors[1].startswith("bad record in /data/bad.jsonl") and "bad_json" in errors[1]
