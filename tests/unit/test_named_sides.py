"""A train rank with named sides (the prompt enhancer's topology), in one process: a tiny LM that writes
and a tiny SD3 that draws, each a side with its own bundle, pipeline, backend, algorithm and stack.

Each side trains on the Parts routed to it (``Part.stage``), the sides step in the recipe's order, their
metrics and versions are per side, checkpoints hold one folder per side and restore every side exactly;
a side without a backend is rollout-only: no optimizer, nothing checkpointed, version 0.
"""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf
from support import load, recipe_path, rollout_requests

from unirl_ray.core.sample import Sample
from unirl_ray.train.configs import TrainTopology
from unirl_ray.train.rank import StackWorker

SMALL = ("stack.mini_batch_size=2", "stack.micro_batch_size=2")


def side_sections(tmp, recipe, *overrides, drop=()):
    cfg = load(recipe, tmp, "sides", *SMALL, *overrides)
    names = ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")
    return {n: OmegaConf.to_container(cfg[n], resolve=True) for n in names if n not in drop}


@pytest.fixture(scope="module")
def sections(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sides")
    return {
        "ar": side_sections(tmp, recipe_path("ar", "tiny", "char_grpo_direct.yaml"), "algorithm.group_size=2"),
        "diffusion": side_sections(tmp, recipe_path("diffusion", "sd3", "sd3_tiny_flowgrpo.yaml"),
                                   "algorithm.group_size=2", "pipeline.num_inference_steps=2"),
    }


def build(sides):
    torch.manual_seed(0)
    return StackWorker({"sides": sides}, topology=TrainTopology(), device=torch.device("cpu"))


def composed(rank):
    """Two prompt-enhancer style samples: [rewrite (side ar), image (side diffusion)], each Part with its
    own advantage and the sample with another one (which no Part here trains on)."""
    rank.generate(rollout_requests("a red cat", prefix="t"), side="ar")
    rank.generate(rollout_requests("a red cat", prefix="i"), side="diffusion")
    texts, images = [rank._cache[f"t-{i}"] for i in range(2)], [rank._cache[f"i-{i}"] for i in range(2)]
    rank._cache.clear()
    samples = []
    for i, (text, image) in enumerate(zip(texts, images)):
        text.parts[0].advantage, image.parts[0].advantage = (1.0, -1.0)[i], (-0.5, 0.5)[i]
        samples.append(Sample(sample_id=f"s-{i}", group_id="g0", prompt="a red cat", advantage=9.0,
                              parts=[text.parts[0], image.parts[0]]))
    return samples


def weights(side):
    params = {k: v.detach().clone() for k, v in side.backend.module.state_dict().items()}
    moments = [t.clone() for s in side.backend.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
    return params, moments


def test_two_trained_sides_step_in_order_on_their_own_parts_and_restore_exactly(sections, tmp_path):
    rank = build(sections)
    assert list(rank.sides) == ["ar", "diffusion"] and rank.policy_version == {"ar": 0, "diffusion": 0}
    samples = composed(rank)
    assert [p.stage for p in samples[0].parts] == ["ar", "diffusion"]  # stamped by the side that generated them
    # each side's algorithm takes its own Part and that Part's advantage, never the sample's 9.0
    assert rank.side("ar").algorithm.advantages(samples).tolist() == [1.0, -1.0]
    assert rank.side("diffusion").algorithm.advantages(samples).tolist() == [-0.5, 0.5]

    before = {name: weights(rank.side(name))[0] for name in rank.sides}
    out = rank.train(samples, seed=0)
    assert out["policy_version"] == {"ar": 1, "diffusion": 1} == rank.policy_version
    assert list(out["policy_version"]) == ["ar", "diffusion"]  # stepped in the recipe's order (same on every rank)
    assert out["num_samples"] == {"ar": 2, "diffusion": 2}
    for name in rank.sides:
        assert f"{name}/train/loss" in out["metrics"] and f"{name}/algo/clip_frac" in out["metrics"]
        after = weights(rank.side(name))[0]
        assert any(not torch.equal(before[name][k], after[k]) for k in after), name  # both sides learned

    meta = rank.save(str(tmp_path / "shards"))
    assert sorted(meta["sides"]) == ["ar", "diffusion"] and meta["sides"]["ar"]["policy_version"] == 1
    for name in rank.sides:
        assert os.path.isfile(tmp_path / "shards" / name / ".metadata"), name
    saved = {name: weights(rank.side(name)) for name in rank.sides}
    rank.train(composed(rank), seed=1, side="diffusion")  # one side alone: the other one keeps its version
    assert rank.policy_version == {"ar": 1, "diffusion": 2}
    rank.load(str(tmp_path / "shards"), meta)
    assert rank.policy_version == {"ar": 1, "diffusion": 1}
    for name, (params, moments) in saved.items():
        got_params, got_moments = weights(rank.side(name))
        assert all(torch.equal(params[k], got_params[k]) for k in params), name
        assert all(torch.equal(a, b) for a, b in zip(moments, got_moments, strict=True)), name

    with pytest.raises(RuntimeError, match="written by a single-side recipe, but this recipe trains sides ar, diffusion"):
        rank.load(str(tmp_path / "shards" / "ar"), meta["sides"]["ar"])
    with pytest.raises(ValueError, match="holds sides ar, diffusion: name one"):
        rank.export_weights()
    with pytest.raises(ValueError, match="no side 'image'; it holds ar, diffusion"):
        rank.generate(rollout_requests("a red cat", prefix="x"), side="image")
    assert rank.export_weights(side="ar")["policy_version"] == 1


def test_a_side_without_backend_is_rollout_only(sections, tmp_path):
    frozen = {k: v for k, v in sections["ar"].items() if k in ("bundle", "pipeline", "rollout")}
    rank = build({"ar": frozen, "diffusion": sections["diffusion"]})
    ar = rank.side("ar")
    assert not ar.trainable and ar.backend is None and ar.stack is None
    samples = composed(rank)  # the frozen rewriter still writes
    assert samples[0].parts[0].stage == "ar" and samples[0].parts[0].text is not None
    out = rank.train(samples, seed=0)
    assert out["policy_version"] == {"diffusion": 1} and rank.policy_version == {"ar": 0, "diffusion": 1}
    assert not any(k.startswith("ar/") for k in out["metrics"])
    meta = rank.save(str(tmp_path / "shards"))
    assert list(meta["sides"]) == ["diffusion"] and sorted(os.listdir(tmp_path / "shards")) == ["diffusion"]
    for call in (lambda: rank.export_weights(side="ar"), lambda: rank.train(samples, seed=0, side="ar")):
        with pytest.raises(ValueError, match="side 'ar' is rollout-only"):
            call()
    two = dict(meta, sides={**meta["sides"], "ar": meta["sides"]["diffusion"]})
    with pytest.raises(RuntimeError, match="written by sides ar, diffusion, but this recipe trains sides diffusion"):
        rank.load(str(tmp_path / "shards"), two)


def test_bad_side_layouts_are_refused_before_anything_is_built(sections):
    ar = sections["ar"]
    half = {k: v for k, v in ar.items() if k != "backend"}
    for sides, message in [
        ({"ar": half}, "side 'ar' has an algorithm / stack but no backend"),
        ({"ar": {k: v for k, v in ar.items() if k != "stack"}}, "side 'ar' has a backend: it needs an algorithm and a stack"),
        ({"ar": {**ar, "optimizer": {}}}, "side 'ar': unknown section\\(s\\) optimizer"),
        ({"ar": {"pipeline": ar["pipeline"]}}, "side 'ar' needs bundle"),
        ({}, "sides must map side names"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(sides)
    with pytest.raises(ValueError, match="no top-level bundle: move them into a side"):
        StackWorker({"sides": {"ar": ar}, "bundle": ar["bundle"]}, topology=TrainTopology(), device=torch.device("cpu"))
    rollout_only = {k: v for k, v in ar.items() if k in ("bundle", "pipeline", "rollout")}
    with pytest.raises(ValueError, match="no side of this rank trains"):
        build({"ar": rollout_only})
