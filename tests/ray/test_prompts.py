"""PromptSource: reading txt / jsonl / json / parquet / directories (small files on the driver, larger ones with Ray
Data: the same rows), epochs, resume."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unirl_ray.assets import asset_path
from unirl_ray.data import PromptSource
from unirl_ray.data import prompts as prompts_module


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    (d / "p.txt").write_text("a cat\n\n  a dog  \n   \na fox\n")
    _write_jsonl(d / "p.jsonl", [{"prompt": f"q{i}", "answer": i, "meta": "m"} for i in range(7)])
    (d / "arr.json").write_text(json.dumps([{"text": "x", "k": 1}, {"text": "y", "k": 2}]))
    pq.write_table(pa.table({"caption": [f"c{i}" for i in range(5)], "score": list(range(5)), "big": ["z"] * 5}),
                   d / "p.parquet")
    sub = d / "dir"
    sub.mkdir()
    _write_jsonl(sub / "b.jsonl", [{"prompt": "b0"}, {"prompt": "b1"}])
    _write_jsonl(sub / "a.jsonl", [{"prompt": "a0"}, {"prompt": ""}, {"prompt": "a1"}])
    (d / "blank.txt").write_text("\n  \n\n")
    (d / "empty.jsonl").write_text("")
    (d / "p.csv").write_text("prompt\nx\n")
    _write_jsonl(d / "keys.jsonl", [{"prompt": "k0", "x": 1}, {"prompt": "k1", "y": [2, 3]}, {"prompt": "k2", "x": None}])
    return d


@pytest.fixture(params=["driver", "ray_data"])
def reader(request, monkeypatch):
    """Each reading test twice: small files read on the driver (Ray Data's readers raise if called), and with
    Ray Data (``DRIVER_READ_BYTES`` 0: every file is larger)."""
    import ray.data

    if request.param == "ray_data":
        monkeypatch.setattr(prompts_module, "DRIVER_READ_BYTES", 0)
    else:
        def refuse(*args, **kwargs):
            raise AssertionError("a small prompt file was read with Ray Data")

        monkeypatch.setattr(ray.data, "read_text", refuse)
        monkeypatch.setattr(ray.data, "read_json", refuse)
    return request.param


def _prompts(rows):
    return [r["prompt"] for r in rows]


def test_txt_skips_blank_lines(ray_local, files, reader):
    src = PromptSource(path=str(files / "p.txt"), shuffle=False)
    assert len(src) == 3
    rows = src.next_batch(3)
    assert rows == [{"prompt": "a cat", "row_index": 0}, {"prompt": "a dog", "row_index": 1},
                    {"prompt": "a fox", "row_index": 2}]


def test_jsonl_columns(ray_local, files, reader):
    all_cols = PromptSource(path=str(files / "p.jsonl"), shuffle=False).next_batch(2)
    assert all_cols[1] == {"prompt": "q1", "answer": 1, "meta": "m", "row_index": 1}
    some = PromptSource(path=str(files / "p.jsonl"), columns=["answer"], shuffle=False).next_batch(1)
    assert some == [{"prompt": "q0", "answer": 0, "row_index": 0}]
    arr = PromptSource(path=str(files / "arr.json"), prompt_column="text", shuffle=False).next_batch(2)
    assert arr == [{"prompt": "x", "k": 1, "row_index": 0}, {"prompt": "y", "k": 2, "row_index": 1}]
    keys = PromptSource(path=str(files / "keys.jsonl"), shuffle=False).next_batch(3)  # a key some rows lack: None
    assert keys == [{"prompt": "k0", "x": 1, "y": None, "row_index": 0}, {"prompt": "k1", "x": None, "y": [2, 3], "row_index": 1},
                    {"prompt": "k2", "x": None, "y": None, "row_index": 2}]


def test_parquet_and_directory(ray_local, files, reader):
    src = PromptSource(path=str(files / "p.parquet"), prompt_column="caption", columns=["score"], shuffle=False)
    assert src.next_batch(2) == [{"prompt": "c0", "score": 0, "row_index": 0}, {"prompt": "c1", "score": 1, "row_index": 1}]
    d = PromptSource(path=str(files / "dir"), shuffle=False)  # files in sorted order, empty prompt skipped
    assert _prompts(d.next_batch(4)) == ["a0", "a1", "b0", "b1"]


def test_epochs_are_deterministic_permutations(ray_local, files):
    a = PromptSource(path=str(files / "p.jsonl"), seed=3)
    b = PromptSource(path=str(files / "p.jsonl"), seed=3)
    c = PromptSource(path=str(files / "p.jsonl"), seed=4)
    seq_a = a.next_batch(7) + a.next_batch(7)
    assert seq_a == b.next_batch(14)
    assert _prompts(seq_a) != _prompts(c.next_batch(14))
    assert sorted(r["row_index"] for r in seq_a[:7]) == list(range(7))  # each epoch visits every row once
    assert sorted(r["row_index"] for r in seq_a[7:]) == list(range(7))
    assert [r["row_index"] for r in seq_a[:7]] != [r["row_index"] for r in seq_a[7:]]  # a new order per epoch
    assert a.state_dict() == {"epoch": 2, "offset": 0}


def test_resume_continues_exactly(ray_local, files):
    path = str(files / "p.jsonl")
    first = PromptSource(path=path, seed=1)
    first.next_batch(3)
    first.next_batch(3)
    state = first.state_dict()
    assert state == {"epoch": 0, "offset": 6}
    expected = [first.next_batch(3) for _ in range(4)]  # crosses two epoch boundaries
    resumed = PromptSource(path=path, seed=1)
    resumed.load_state_dict(state)  # before the first read: applied when it opens
    assert [resumed.next_batch(3) for _ in range(4)] == expected
    assert resumed.state_dict() == first.state_dict()


def test_packaged_animals(ray_local):
    src = PromptSource(path=asset_path("prompts/animals.txt"))
    assert 40 <= len(src) <= 60
    batch = src.next_batch(len(src) + 5)
    assert len({r["prompt"] for r in batch}) == len(src)


def test_empty_sources_fail_clearly(ray_local, files):
    with pytest.raises(ValueError, match=r"blank.txt is empty \(no non-blank lines\)"):  # found on the driver
        PromptSource(path=str(files / "blank.txt")).open()


def test_constructor_errors(files):
    with pytest.raises(FileNotFoundError, match="not found: .*nope.txt"):
        PromptSource(path=str(files / "nope.txt"))
    with pytest.raises(ValueError, match="not found"):
        PromptSource(path=str(files / "nope.txt"))
    with pytest.raises(ValueError, match="unsupported prompt file .*p.csv"):
        PromptSource(path=str(files / "p.csv"))
    with pytest.raises(ValueError, match=r"p.jsonl, line 1 has no 'promt' key .*did you mean 'prompt'"):
        PromptSource(path=str(files / "p.jsonl"), prompt_column="promt")
    with pytest.raises(ValueError, match=r"column 'scores' not in .*did you mean 'score'"):
        PromptSource(path=str(files / "p.parquet"), prompt_column="caption", columns=["scores"])
    with pytest.raises(ValueError, match="empty"):
        PromptSource(path=str(files / "empty.jsonl"))
    with pytest.raises(ValueError, match="no asset|no packaged asset"):
        asset_path("prompts/nope.txt")


def test_cursor_errors(files):
    src = PromptSource(path=str(files / "p.txt"))
    with pytest.raises(ValueError, match="state_dict"):
        src.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=">= 0"):
        src.load_state_dict({"epoch": -1, "offset": 0})
    src._rows = [{"prompt": "x", "row_index": 0}]  # as if opened, without Ray
    with pytest.raises(ValueError, match="prompt data changed"):
        src.load_state_dict({"epoch": 0, "offset": 5})
    with pytest.raises(ValueError, match="batch size"):
        src.next_batch(0)


def test_reads_when_only_a_quarter_cpu_is_free(ray_local, files, monkeypatch):
    """Train workers and replicas may hold all but a fraction of a CPU: a Ray Data read must still schedule."""
    import threading

    monkeypatch.setattr(prompts_module, "DRIVER_READ_BYTES", 0)

    from ray.util.placement_group import placement_group, remove_placement_group

    free = ray_local.available_resources().get("CPU", 0)
    hog = placement_group([{"CPU": free - 0.25}])  # reserve everything but 0.25 CPU
    try:
        ray_local.get(hog.ready(), timeout=60)
        sources = [PromptSource(path=str(files / "p.txt")), PromptSource(path=str(files / "p.jsonl")),
                   PromptSource(path=str(files / "p.parquet"), prompt_column="caption")]
        done = []
        worker = threading.Thread(target=lambda: done.extend(len(s) for s in sources), daemon=True)
        worker.start()
        worker.join(90)
        assert done == [3, 7, 5], "a prompt read did not schedule with 0.25 CPU free"
    finally:
        remove_placement_group(hog)


def test_prefetch_reads_in_the_background_and_open_raises_what_the_read_raised(ray_local, files, monkeypatch):
    import pickle

    src = PromptSource(path=str(files / "p.txt"), shuffle=False)
    src.prefetch()
    src.prefetch()  # one read in flight at most
    assert src.next_batch(3) == [{"prompt": "a cat", "row_index": 0}, {"prompt": "a dog", "row_index": 1},
                                 {"prompt": "a fox", "row_index": 2}]
    assert pickle.loads(pickle.dumps(src)).next_batch(1) == [{"prompt": "a cat", "row_index": 0}]  # epoch 2
    unopened = pickle.loads(pickle.dumps(PromptSource(path=str(files / "p.jsonl"), shuffle=False)))  # reads its file
    assert unopened.next_batch(1) == [{"prompt": "q0", "answer": 0, "meta": "m", "row_index": 0}]

    broken = PromptSource(path=str(files / "p.txt"))
    monkeypatch.setattr(broken, "_read_rows", lambda: (_ for _ in ()).throw(OSError("storage went away")))
    broken.prefetch()
    with pytest.raises(OSError, match="storage went away"):
        broken.open()
