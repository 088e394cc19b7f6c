"""SFT data without Ray: records -> Parts (chat masks, prompt/completion, truncation, bad records),
packing, the resumable shard stream, and the driver-side checks of ``RecordSource``."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from unirl_ray.data.records import RecordPathError, RecordSource, record_digest
from unirl_ray.data.shard_stream import ShardStream, windowed_shuffle
from unirl_ray.data.sft_examples import (
    BadRecord,
    ImageExampleBuilder,
    SFTTextPart,
    TextExampleBuilder,
    pack_rows,
    parse_record,
)
from unirl_ray.models.causal_lm import build_char_tokenizer

FIELDS = {"messages": "messages", "prompt": "prompt", "completion": "completion", "text": "text",
          "image": "image", "caption": "caption"}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def marked(tok, part):
    """The row's text with trained tokens in brackets."""
    return "".join(f"[{tok.decode([i])}]" if m else tok.decode([i]) for i, m in zip(part.input_ids.tolist(), part.target_mask.tolist()))


def builder(tok, fmt="messages", max_length=64, **kwargs):
    return TextExampleBuilder(tok, format=fmt, max_length=max_length, fields=FIELDS, **kwargs)


def test_chat_record_trains_only_assistant_turns(tok):
    record = {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ab"}, {"role": "user", "content": "more"}, {"role": "assistant", "content": "c"},
    ]}
    part = builder(tok).build(record)
    assert marked(tok, part) == (
        "<|bos|><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>[a][b][<|end|>]<|user|>more<|end|><|assistant|>[c][<|end|>]"
    )
    assert part.segment_lengths == [len(part.input_ids)] and part.num_targets == 5 and not part.truncated


def test_prompt_completion_renders_the_prompt_like_the_rollout_pipeline(tok):
    from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, CausalLMPipeline

    pipeline = CausalLMPipeline(CausalLMBundle.from_config(CausalLMConfig()), system_prompt="sys")
    part = builder(tok, "prompt_completion", system_prompt="sys").build({"prompt": "say a", "completion": "aa"})
    prompt_ids = pipeline.encode_prompts(["say a"])[0]
    assert part.input_ids[: len(prompt_ids)].tolist() == prompt_ids  # GRPO from this model sees the same layout
    assert marked(tok, part).endswith("<|assistant|>[a][a][<|end|>]")
    plain = builder(tok, "prompt_completion", use_chat_template=False).build({"prompt": "q", "completion": "r"})
    assert marked(tok, plain) == "q[r][<|end|>]"


def test_text_record_trains_every_token_but_the_first(tok):
    part = builder(tok, "text").build({"text": "abc"})
    assert marked(tok, part) == "a[b][c][<|end|>]"


def test_truncation_keeps_the_start_and_a_record_without_targets_is_bad(tok):
    part = builder(tok, "prompt_completion", max_length=14).build({"prompt": "hi", "completion": "abcdefgh"})
    assert len(part.input_ids) == 14 and part.truncated
    assert marked(tok, part) == "<|bos|><|user|>hi<|end|><|assistant|>[a][b][c][d][e][f][g][h]"  # EOS cut
    with pytest.raises(BadRecord) as err:
        builder(tok, max_length=10).build({"messages": [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "a"}]})
    assert err.value.reason == "no_trainable_tokens"


@pytest.mark.parametrize("record, reason", [
    ({"prompt": "p"}, "missing_field"),
    ({"prompt": "p", "completion": "   "}, "empty_text"),
    ({"prompt": 3, "completion": "c"}, "missing_field"),
])
def test_bad_prompt_completion_records(tok, record, reason):
    with pytest.raises(BadRecord) as err:
        builder(tok, "prompt_completion").build(record)
    assert err.value.reason == reason


@pytest.mark.parametrize("messages, reason", [
    ("oops", "bad_messages"),
    ([{"role": "user"}], "bad_messages"),
    ([{"role": "user", "content": "hi"}], "empty_text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "empty_text"),
])
def test_bad_chat_records(tok, messages, reason):
    with pytest.raises(BadRecord) as err:
        builder(tok).build({"messages": messages})
    assert err.value.reason == reason


def test_json_lines_are_parsed_per_record():
    assert parse_record({"text": '{"a": 1}', "path": "/d/f.jsonl"}, json_line=True) == {"a": 1, "path": "/d/f.jsonl"}
    for line in ("{not json", "[1, 2]"):
        with pytest.raises(BadRecord) as err:
            parse_record({"text": line}, json_line=True)
        assert err.value.reason == "bad_json"
    assert parse_record({"text": "raw"}, json_line=False) == {"text": "raw"}  # parquet "text" records stay as they are


def test_image_records_decode_resize_and_reject_broken_images(tmp_path):
    Image.new("RGB", (64, 32), (255, 0, 0)).save(tmp_path / "red.png")
    build = ImageExampleBuilder(height=16, width=16, fields=FIELDS)
    part = build.build({"image": "red.png", "caption": "red", "path": str(tmp_path / "x.jsonl")}, seed=5)
    assert part.pixels.shape == (3, 16, 16) and part.seed == 5 and part.weight == 1.0
    assert torch.allclose(part.pixels[0], torch.ones(16, 16)) and torch.allclose(part.pixels[1], -torch.ones(16, 16))
    raw = (tmp_path / "red.png").read_bytes()
    assert torch.equal(build.build({"image": {"bytes": raw}, "caption": "red"}).pixels, part.pixels)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    for image in ("broken.png", "missing.png"):
        with pytest.raises(BadRecord) as err:
            build.build({"image": image, "caption": "c", "path": str(tmp_path / "x.jsonl")})
        assert err.value.reason == "bad_image"
    with pytest.raises(BadRecord) as err:
        build.build({"image": "red.png", "caption": ""})
    assert err.value.reason == "empty_text"


def row(n, start=0):
    ids = torch.arange(start, start + n)
    return SFTTextPart(input_ids=ids, target_mask=torch.ones(n), segment_lengths=[n])


def test_packing_fills_rows_first_fit_decreasing_and_keeps_examples_whole():
    parts = [row(5, 0), row(3, 10), row(6, 20), row(2, 30), row(4, 40)]
    rows = pack_rows(parts, max_length=8)
    assert [r.segment_lengths for r in rows] == [[6, 2], [5, 3], [4]]
    assert rows[0].input_ids.tolist() == [*range(20, 26), 30, 31]
    assert sum(len(r.input_ids) for r in rows) == 20
    with pytest.raises(ValueError, match="longer than max_length"):
        pack_rows([row(9)], max_length=8)


def test_windowed_shuffle_is_a_seeded_permutation():
    rows = list(range(50))
    a = list(windowed_shuffle(rows, np.random.default_rng(1), 8))
    assert sorted(a) == rows and a != rows
    assert a == list(windowed_shuffle(rows, np.random.default_rng(1), 8))
    assert list(windowed_shuffle(rows, np.random.default_rng(1), 1)) == rows


@pytest.mark.parametrize("prefetch", [0, 3])
def test_shard_stream_crosses_epochs_and_seek_resumes_exactly(prefetch):
    data = list(range(10))
    stream = ShardStream(lambda: iter(data), seed=3, rank=1, shuffle_buffer_size=4, prefetch=prefetch)
    taken, cursors = [], []
    for _ in range(6):  # 24 records: two full epochs and a bit
        taken.append(stream.take(4))
        cursors.append(stream.cursor())
    flat = [r for batch in taken for r, _ in batch]
    assert sorted(flat[:10]) == data and sorted(flat[10:20]) == data and flat[:10] != flat[10:20]
    assert taken[3][1][1] == (1, 3)  # keys are (epoch, offset)
    assert cursors[1] == {"epoch": 0, "offset": 8} and cursors[2] == {"epoch": 1, "offset": 2}
    for k in range(6):  # resume after every step: the rest is identical
        again = ShardStream(lambda: iter(data), seed=3, rank=1, shuffle_buffer_size=4, prefetch=prefetch)
        again.seek(**cursors[k])
        assert [again.take(4) for _ in range(5 - k)] == taken[k + 1 :]
        again.close()
    stream.close()
    with pytest.raises(ValueError, match="empty"):
        ShardStream(lambda: iter([]), seed=0, rank=0, prefetch=prefetch).take(1)
    short = ShardStream(lambda: iter(data), seed=0, rank=0, prefetch=prefetch)
    short.seek(0, 11)
    with pytest.raises(ValueError, match="the data changed"):
        short.take(1)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_record_source_checks_paths_and_fields_on_the_driver(tmp_path):
    with pytest.raises(RecordPathError, match="does not exist"):
        RecordSource(path=str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without record files"):
        RecordSource(path=str(tmp_path / "empty"))
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    assert RecordSource(path=chat).format == "messages"
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "p", "answer": "c"}])
    with pytest.raises(ValueError, match="cannot tell the record format"):
        RecordSource(path=pc)
    with pytest.raises(ValueError, match="did you mean 'answer'"):
        RecordSource(path=pc, format="prompt_completion", completion_field="answr")
    assert RecordSource(path=pc, format="prompt_completion", completion_field="answer").format == "prompt_completion"
    with pytest.raises(RecordPathError, match="eval_path"):
        RecordSource(path=chat, eval_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        RecordSource(path=chat, eval_path=chat, eval_fraction=0.1)
    (tmp_path / "array.json").write_text('[{"text": "a"}]')
    with pytest.raises(ValueError, match="JSON array"):
        RecordSource(path=str(tmp_path / "array.json"))
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"text": "a"}])
    (tmp_path / "mixed" / "b.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="mixes record file kinds"):
        RecordSource(path=str(tmp_path / "mixed"))


def test_record_source_lists_folders_and_shuffles_files_by_seed(tmp_path):
    for name in ("a", "b", "c", "d"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": name}])
    write_jsonl(tmp_path / ".hidden.jsonl", [{"text": "h"}])
    (tmp_path / "notes.txt").write_text("ignored")
    names = lambda src: [f.rsplit("/", 1)[1] for f in src.files]  # noqa: E731
    assert names(RecordSource(path=str(tmp_path), shuffle=False)) == ["a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl"]
    shuffled = names(RecordSource(path=str(tmp_path), seed=1))
    assert sorted(shuffled) == ["a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl"]
    assert shuffled == names(RecordSource(path=str(tmp_path), seed=1))


def test_eval_split_by_content_hash_is_stable():
    from unirl_ray.data.records import _in_eval

    rows = [{"text": json.dumps({"text": f"r{i}"}), "path": f"/f{i % 3}"} for i in range(2000)]
    held = [_in_eval(r, 0.1, 0) for r in rows]
    assert 150 < sum(held) < 250
    assert held == [_in_eval(dict(r, path="/elsewhere"), 0.1, 0) for r in rows]  # the file path does not matter
    assert record_digest({"image": b"\x00\x01", "caption": "c"}) != record_digest({"image": b"\x00\x02", "caption": "c"})


def test_the_driver_splits_small_files_into_equal_contiguous_shards(tmp_path, monkeypatch):
    """``driver_shards``: the rows of small local .jsonl files, in file order, cut into one contiguous run per rank
    of ``len // ranks`` rows (the remainder left out), the same every time, each rank with every held-out row;
    None where Ray Data reads the files (larger than ``DRIVER_READ_BYTES``)."""
    import unirl_ray.data.records as records_module

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(4)])
    write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(7)])
    source = RecordSource(path=str(tmp_path), shuffle=False)
    assert source.on_driver() and source.driver_rows() is not None
    texts = lambda rows: [json.loads(r["text"])["text"] for r in rows]  # noqa: E731
    shards = source.driver_shards(3)
    assert [texts(s["train"]) for s in shards] == [["a0", "a1", "a2"], ["a3", "b0", "b1"], ["b2", "b3", "b4"]]
    assert all(s["eval"] is None for s in shards) and shards == source.driver_shards(3)
    assert [texts(s["train"]) for s in source.driver_shards(2)] == [["a0", "a1", "a2", "a3", "b0"],
                                                                  ["b1", "b2", "b3", "b4", "b5"]]
    assert {r["path"] for s in shards for r in s["train"]} == {a, str(tmp_path / "b.jsonl")}
    assert [len(s["train"]) for s in source.driver_shards(12)] == [0] * 12  # fewer rows than ranks: ShardStream says so

    held = RecordSource(path=str(tmp_path), shuffle=False, eval_fraction=0.3, seed=1)
    sides = held.driver_shards(2)
    rows = held.driver_rows()
    flat = {name: [r for per_file in rows[name] for r in per_file] for name in ("train", "eval")}
    assert sides[0]["eval"] == sides[1]["eval"] == flat["eval"] != []
    size = len(flat["train"]) // 2
    assert sides[0]["train"] + sides[1]["train"] == flat["train"][:2 * size]
    assert sorted(texts(flat["train"] + flat["eval"])) == sorted([f"a{i}" for i in range(4)] + [f"b{i}" for i in range(7)])

    evals = RecordSource(path=a, eval_path=str(tmp_path / "b.jsonl"))
    assert [texts(s["eval"]) for s in evals.driver_shards(2)] == [[f"b{i}" for i in range(7)]] * 2

    monkeypatch.setattr(records_module, "DRIVER_READ_BYTES", -1)  # every file counts as large: Ray Data's
    assert not source.on_driver() and source.driver_shards(2) is None and source.driver_rows() is None
