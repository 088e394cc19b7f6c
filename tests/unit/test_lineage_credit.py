"""Credit along a Part's lineage (the prompt enhancer's prompt -> rewrites -> images), by hand-computed numbers."""

from __future__ import annotations

import pytest

from unirl_ray.algorithms.credit import LineageCredit
from unirl_ray.core.sample import DiffusionPart, Sample, TextPart


def samples(rewards_per_rewrite, *, prompt="g0", ids=True):
    """One sample per image: [rewrite Part (a copy per image, one part_id per rewrite), image Part]."""
    out = []
    for r, rewards in enumerate(rewards_per_rewrite):
        for i, reward in enumerate(rewards):
            parts = [TextPart(stage="ar", text=f"rewrite {r}", part_id=f"{prompt}-r{r}" if ids else None),
                     DiffusionPart(stage="diffusion")]
            out.append(Sample(sample_id=f"{prompt}-r{r}-i{i}", group_id=prompt, prompt="a cat", parts=parts,
                              reward=reward, advantage=7.0))
    return out


def text(s):
    return s.parts[0]


def image(s):
    return s.parts[1]


def test_images_are_grouped_by_rewrite_and_rewrites_by_prompt_with_their_images_mean_reward():
    batch = samples([[1.0, 3.0], [0.0, None]]) + samples([[5.0], [5.0]], prompt="g1")
    metrics = LineageCredit(normalize_std=False)(1, batch)
    # images: (1, 3) around 2 -> -1, +1; the second rewrite has one valid image -> no signal
    assert [image(s).advantage for s in batch[:4]] == [-1.0, 1.0, 0.0, 0.0]
    assert [image(s).reward for s in batch[:4]] == [1.0, 3.0, 0.0, None]
    # rewrites: mean image reward 2 and 0 (the invalid image left out), around 1 -> +1 and -1, on every copy
    assert [(text(s).reward, text(s).advantage) for s in batch[:4]] == [(2.0, 1.0), (2.0, 1.0), (0.0, -1.0), (0.0, -1.0)]
    # the second prompt's rewrites score alike: no signal anywhere
    assert [(text(s).advantage, image(s).advantage) for s in batch[4:]] == [(0.0, 0.0), (0.0, 0.0)]
    assert all(s.advantage is None for s in batch)  # nothing may train on the sample-level 7.0
    assert metrics["credit/ar/rewrites"] == 4.0 and metrics["credit/diffusion/invalid_reward_frac"] == 1 / 6
    assert metrics["credit/ar/zero_std_group_frac"] == 0.5  # prompt g1


def test_max_pooling_prompt_scope_std_normalisation_and_bad_input():
    batch = samples([[1.0, 3.0], [0.0, None]])
    LineageCredit(rewrite_reward="max", image_group_scope="prompt", normalize_std=False).assign(batch)
    assert [text(s).advantage for s in batch] == [1.5, 1.5, -1.5, -1.5]  # max 3 and 0 around 1.5
    # all N x M images of the prompt form one group: valid (1, 3, 0) around 4/3
    assert [image(s).advantage for s in batch] == pytest.approx([-1 / 3, 5 / 3, -4 / 3, 0.0])

    batch = samples([[1.0, 3.0], [None, None]])
    LineageCredit().assign(batch)
    assert [image(s).advantage for s in batch[:2]] == pytest.approx([-1 / (1 + 1e-4), 1 / (1 + 1e-4)])
    assert text(batch[2]).reward is None and text(batch[2]).advantage == 0.0  # no valid image: no credit
    assert text(batch[0]).advantage == 0.0  # one rewrite with a reward in its prompt: no signal either

    with pytest.raises(ValueError, match="rewrite Part of sample 'g0-r0-i0' has no part_id"):
        LineageCredit().assign(samples([[1.0, 2.0]], ids=False))
    with pytest.raises(ValueError, match="rewrite_reward must be one of 'mean' or 'max'"):
        LineageCredit(rewrite_reward="sum")
    with pytest.raises(ValueError, match="image_group_scope must be one of 'rewrite', 'prompt' or 'shared'"):
        LineageCredit(image_group_scope="batch")
    with pytest.raises(ValueError, match="no Part of stage 'image' \\(its Parts are of stage ar, diffusion\\)"):
        LineageCredit(image_stage="image").assign(samples([[1.0, 2.0]]))


def test_shared_scope_gives_each_image_its_text_segments_advantage():
    """UniGRPO's shared advantage (the unified model with one image per think segment): the image Part trains on
    its text's advantage; an image whose own reward is invalid gets 0 and stays out of its text's reward."""
    batch = samples([[1.0], [3.0], [2.0], [None]])  # four texts of one prompt, one image each
    metrics = LineageCredit(image_group_scope="shared", normalize_std=False).assign(batch)
    assert [text(s).reward for s in batch] == [1.0, 3.0, 2.0, None]
    assert [text(s).advantage for s in batch] == [-1.0, 1.0, 0.0, 0.0]  # mean of the valid ones is 2
    assert [image(s).advantage for s in batch] == [-1.0, 1.0, 0.0, 0.0]
    assert all(s.advantage is None for s in batch)
    two = samples([[1.0, 3.0], [0.0, 0.0]])  # two images per text: both images of a text share its advantage
    LineageCredit(image_group_scope="shared", normalize_std=False).assign(two)
    assert [image(s).advantage for s in two] == [1.0, 1.0, -1.0, -1.0]
    assert metrics["credit/ar/rewrites"] == 4.0 and "credit/diffusion/adv_mean" in metrics
