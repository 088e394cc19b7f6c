"""The GenEval-style reward: its checks on chosen detections (the detector replaced by a list of boxes: the one
fake here), metadata parsing, NMS, and the tiny OWLv2's own detections read back by hand from its logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from unirl_ray.rewards.geneval import Detection, GenEvalReward, check, nms, requirements

DOG_LEFT_OF_CAT = {"include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["right of", 0]}],
                   "exclude": [{"class": "dog", "count": 2}]}


def det(cls, cx, cy, score=0.9, color=None):
    return Detection(cls, score, (cx, cy, 0.2, 0.2), color)


def test_checks_count_colour_position_and_exclusion():
    inc, exc = requirements(DOG_LEFT_OF_CAT)
    assert check(inc, exc, [det("dog", 0.2, 0.5), det("cat", 0.8, 0.5)]) == [True, True, True, True]
    assert check(inc, exc, [det("dog", 0.8, 0.5), det("cat", 0.2, 0.5)]) == [True, True, False, True]  # swapped
    assert check(inc, exc, [det("dog", 0.45, 0.5), det("cat", 0.5, 0.5)]) == [True, True, False, True]  # within the margin
    assert check(inc, exc, [det("dog", 0.2, 0.5), det("dog", 0.1, 0.1), det("cat", 0.8, 0.5)]) == [True, True, True, False]
    assert check(inc, exc, [det("cat", 0.8, 0.5)]) == [False, True, False, True]  # no dog: no count, no relation
    # the best-scoring box of each class places it
    assert check(inc, [], [det("dog", 0.9, 0.5, score=0.4), det("dog", 0.1, 0.5, score=0.8), det("cat", 0.6, 0.5)]) == [True, True, True]
    below = [{"class": "cup", "count": 1}, {"class": "book", "count": 1, "position": ["below", 0]}]
    assert check(*requirements(include=below), [det("cup", 0.5, 0.2), det("book", 0.5, 0.7)]) == [True, True, True]
    assert check(*requirements(include=below), [det("cup", 0.5, 0.7), det("book", 0.5, 0.2)]) == [True, True, False]
    # colours: at least `count` of the class in that colour
    red_cars = requirements({"include": [{"class": "car", "count": 2, "color": "red"}]})
    assert check(*red_cars, [det("car", 0.2, 0.2, color="red"), det("car", 0.7, 0.7, color="blue")]) == [True, False]
    assert check(*red_cars, [det("car", 0.2, 0.2, color="red"), det("car", 0.7, 0.7, color="red")]) == [True, True]


def test_metadata_forms_and_bad_metadata():
    as_json = requirements(json.dumps(DOG_LEFT_OF_CAT))
    assert as_json == requirements(DOG_LEFT_OF_CAT) == requirements(include=DOG_LEFT_OF_CAT["include"],
                                                                     exclude=DOG_LEFT_OF_CAT["exclude"])
    assert as_json[0][1]["position"] == ("right of", 0) and as_json[1] == [{"class": "dog", "count": 2}]
    dict_position = {"include": [{"class": "a"}, {"class": "b", "position": {"relation": "above", "of": 0}}]}
    assert requirements(dict_position)[0][1] == {"class": "b", "count": 1, "position": ("above", 0)}
    assert requirements(None) is None and requirements("") is None and requirements({"include": []}) is None
    for bad, match in ((("{not json",), "not JSON"), (({"include": [{"count": 2}]},), "needs a 'class'"),
                       (({"include": [{"class": "a", "position": ["behind", 0]}]},), "relation must be one of"),
                       (({"include": [{"class": "a", "position": ["above", 3]}]},), "index one of the 1 include")):
        with pytest.raises(ValueError, match=match):
            requirements(*bad)


def test_nms_keeps_the_best_of_overlapping_boxes():
    boxes = torch.tensor([[0.5, 0.5, 0.4, 0.4], [0.52, 0.5, 0.4, 0.4], [0.1, 0.1, 0.1, 0.1]])
    scores = torch.tensor([0.6, 0.9, 0.5])
    assert nms(boxes, scores, 0.5) == [1, 2]  # IoU of the first two: 0.38 x 0.4 / (0.32 - 0.152) = 0.905
    assert nms(boxes, scores, 0.95) == [1, 0, 2]


@pytest.fixture(scope="module")
def owl():
    return GenEvalReward(tiny=True, threshold=0.0, nms_iou=1.0, colors=["red", "blue"], device="cpu")


def test_the_tiny_detectors_boxes_classes_and_colours_are_its_own_logits(owl, tmp_path):
    """threshold 0 and nms_iou 1 keep every predicted box: each one's class, score, colour and box are read back
    by hand from the model's own forward pass; the scores follow from the checks; a local folder gives the same."""
    image = np.random.default_rng(3).integers(0, 256, size=(24, 40, 3), dtype=np.uint8)  # wide: padded at the bottom
    texts = ["a photo of a dog", "a photo of a cat", "a photo of a red dog", "a photo of a blue dog"]
    enc = owl.processor(text=[texts], images=[image], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = owl.model(**enc)
    logits, boxes = out.logits[0], out.pred_boxes[0]
    found = owl.detect(image, ["dog", "cat"], ["dog"])
    assert len(found) == len(boxes) == 16  # 4 x 4 patches of the tiny 32-pixel tower
    by_index = {d.index: d for d in found}
    for k in range(len(boxes)):
        cls = int(logits[k, :2].argmax())
        box = boxes[k] * torch.tensor([1.0, 40 / 24, 1.0, 40 / 24])  # y and h: fractions of the image, not the square
        d = by_index[k]
        assert d.box == pytest.approx(tuple(float(v) for v in box), abs=1e-6)
        assert d.cls == ["dog", "cat"][cls] and d.score == pytest.approx(float(torch.sigmoid(logits[k, cls])), abs=1e-6)
        assert d.color == ((["red", "blue"][int(logits[k, 2:].argmax())]) if cls == 0 else None)

    meta = {"include": [{"class": "dog", "count": 1, "color": "red"}, {"class": "cat", "count": 20}]}
    met = check(*requirements(meta), found)
    want = [True, any(d.color == "red" for d in found if d.cls == "dog"), False]
    assert met == want and sum(d.cls == "dog" for d in found) >= 1
    scores = owl(images=[image, image], prompts=["p", "q"], metadata=[json.dumps(meta), None])
    assert scores == [pytest.approx(sum(want) / 3), None]
    strict = GenEvalReward(tiny=True, threshold=0.0, nms_iou=1.0, colors=["red", "blue"], strict=True, device="cpu")
    assert strict(images=[image], prompts=["p"], metadata=[meta]) == [0.0]
    assert owl(images=[np.stack([image, image])], prompts=["p"], metadata=[meta]) == [pytest.approx(sum(want) / 3)]
    owl.save_pretrained(str(tmp_path / "owl"))
    loaded = GenEvalReward(str(tmp_path / "owl"), threshold=0.0, nms_iou=1.0, colors=["red", "blue"], device="cpu")
    assert loaded(images=[image], prompts=["p"], metadata=[meta]) == scores[:1]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="exactly one of"):
        GenEvalReward()
    with pytest.raises(ValueError, match="threshold must be in"):
        GenEvalReward(tiny=True, threshold=2.0)
    with pytest.raises(ValueError, match="colors must be"):
        GenEvalReward(tiny=True, colors=[])
    with pytest.raises(ValueError, match="OWLv2 folder not found"):
        GenEvalReward("/nonexistent/owl")
    reward = GenEvalReward(tiny=True, device="cpu")
    with pytest.raises(ValueError, match="uint8"):
        reward(images=[np.zeros((8, 8, 3), np.float32)], prompts=["p"], metadata=[DOG_LEFT_OF_CAT])


def test_geneval_metadata_converts_to_a_prompt_file_the_prompt_source_reads(tmp_path):
    from unirl_ray.data.prompts import check_jsonl_file
    from unirl_ray.rewards.geneval import convert

    lines = [{"tag": "position", "prompt": "a photo of a cat right of a dog", **DOG_LEFT_OF_CAT},
             {"tag": "single_object", "prompt": "a photo of a clock", "include": [{"class": "clock", "count": 1}]}]
    (tmp_path / "meta.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert convert(str(tmp_path / "meta.jsonl"), str(tmp_path / "prompts.jsonl")) == 2
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [line["prompt"] for line in lines]
    assert requirements(rows[0]["metadata"]) == requirements(DOG_LEFT_OF_CAT)
    assert check_jsonl_file(str(tmp_path / "prompts.jsonl"), "prompt") == 2  # the prompt source's own check
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "include": [{"count": 1}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a GenEval metadata line"):
        convert(str(tmp_path / "bad.jsonl"), str(tmp_path / "out.jsonl"))
