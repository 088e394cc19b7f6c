"""The OCR reward: the target text taken from the prompt's quotes, the edit similarity written out by hand,
the tiny OCR model's reading checked against its own generate, frames, save/load, and invalid scores for
prompts without a target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl_ray.rewards.ocr import OCRReward, edit_similarity, levenshtein, quoted_text


def test_the_target_and_the_similarity_by_hand():
    assert quoted_text('a neon sign that says "Open 24 Hours" at night') == "Open 24 Hours"
    assert quoted_text("a poster reading \u201cSALE\u201d and \"later\"") == "SALE"  # curly quotes, the first span
    assert quoted_text("a cat on a mat") is None and quoted_text(None) is None
    assert quoted_text('an empty "" sign') == ""
    assert [levenshtein(a, b) for a, b in [("kitten", "sitting"), ("flaw", "lawn"), ("", "abc"), ("abc", "abc")]] == [3, 2, 3, 0]
    assert edit_similarity("open 24 HOURS", "OPEN 24 HOURS") == 1.0  # case and spaces do not count
    assert edit_similarity("OPEN", "OPEN 24") == pytest.approx(1 - 2 / 6)  # "open" vs "open24": 2 insertions over 6
    assert edit_similarity("sale!", "SALE") == pytest.approx(1 - 1 / 4)
    assert edit_similarity("xyz", "ab") == 0.0  # more edits than the target has characters: clamped at 0
    assert edit_similarity("anything", "  ") is None  # no target


@pytest.fixture(scope="module")
def ocr():
    return OCRReward(tiny=True, batch_size=2, max_new_tokens=8, device="cpu")


def _images(n, size=40, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _read_by_hand(reward, image):
    pixels = reward.processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ids = reward.model.generate(pixels, max_new_tokens=8, do_sample=False, num_beams=1)
    return reward.processor.batch_decode(ids, skip_special_tokens=True)[0]


def test_scores_are_the_similarity_of_what_the_model_reads(ocr, tmp_path):
    images = _images(4)
    prompts = ['a sign "ab"', 'a sign that says "???"', "no quotes here", 'a label "QQ Q"']
    read = [_read_by_hand(ocr, image) for image in images]
    assert ocr.read(list(images)) == read  # batched as one at a time
    scores = ocr(images=images, prompts=prompts)
    assert scores[2] is None  # no target: invalid, not 0
    for i in (0, 1, 3):
        assert scores[i] == pytest.approx(edit_similarity(read[i], quoted_text(prompts[i]))), (i, read[i])
        assert 0.0 <= scores[i] <= 1.0
    video = _images(3, seed=1)  # frames: the mean
    per_frame = ocr(images=list(video), prompts=['"ab"'] * 3)
    assert ocr(images=[video], prompts=['"ab"']) == pytest.approx([float(np.mean(per_frame))])

    ocr.save_pretrained(str(tmp_path / "ocr"))
    loaded = OCRReward(str(tmp_path / "ocr"), max_new_tokens=8, device="cpu")
    assert loaded(images=images, prompts=prompts) == scores

    with pytest.raises(ValueError, match="exactly one of"):
        OCRReward()
    with pytest.raises(ValueError, match="not found"):
        OCRReward(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="uint8"):
        ocr(images=[np.zeros((8, 8, 3), dtype=np.float32)], prompts=['"a"'])
    with pytest.raises(ValueError, match="one per sample"):
        ocr(images=images[:2], prompts=['"a"'])
    assert ocr(images=images[:1], prompts=["no target"]) == [None]
