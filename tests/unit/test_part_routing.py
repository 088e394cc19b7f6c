"""Per-Part scores cross the driver -> rank boundary intact, and algorithms take the Parts routed to them.

A trainside rollout keeps its full samples on the rank and sends light copies to the driver; the driver
sets rewards and advantages (per sample, and per Part where credit assignment gives Parts their own) and
sends the light samples back. The rank completes them from its cache: every score the driver set must
survive that, or a Part trains on the wrong advantage without any error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf
from support import load, recipe_path, rollout_requests

from unirl_ray.algorithms.flow_grpo import diffusion_part
from unirl_ray.algorithms.grpo import text_part
from unirl_ray.core.sample import DiffusionPart, Sample, TextPart, complete_sample
from unirl_ray.train.configs import TrainTopology
from unirl_ray.train.rank import StackWorker

SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    cfg = load(recipe_path("ar", "tiny", "char_grpo_direct.yaml"), tmp_path_factory.mktemp("r"), "routing",
               "algorithm.group_size=2", "stack.mini_batch_size=2", "stack.micro_batch_size=2")
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in SECTIONS}
    return StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))


def test_per_part_rewards_and_advantages_set_on_the_driver_reach_the_algorithm(worker):
    light = worker.generate(rollout_requests("write a word"))
    assert all(s.is_light for s in light)
    for i, s in enumerate(light):  # what the driver's credit assignment sets
        s.rewards, s.reward, s.advantage = {"r": 0.5 + i}, 0.5 + i, 0.25
        s.parts[0].reward, s.parts[0].advantage = 2.0 + i, -1.5 + 3 * i
    completed = [worker._complete(s) for s in light]
    for i, s in enumerate(completed):
        assert not s.is_light and s.advantage == 0.25 and s.reward == 0.5 + i
        assert (s.parts[0].reward, s.parts[0].advantage) == (2.0 + i, -1.5 + 3 * i)
    # the algorithm trains each sample's Part on the Part's advantage, not the sample's
    assert worker.algorithm.advantages(completed).tolist() == [-1.5, 1.5]
    result = worker.train(light, seed=0)  # the light samples again: completed from the cache and trained
    assert result["num_samples"] == 2 and result["policy_version"] == 1


def _text(**kw) -> TextPart:
    return TextPart(prompt_ids=torch.tensor([1, 2]), completion_ids=torch.tensor([3]), log_probs=torch.zeros(1),
                    text="x", **kw)


def _image(**kw) -> DiffusionPart:
    return DiffusionPart(latents=torch.zeros(3, 1), log_probs=torch.zeros(2), sigmas=torch.ones(3), **kw)


def test_completing_a_sample_checks_that_its_parts_are_the_cached_ones():
    full = Sample(sample_id="a", group_id="g", prompt="p", parts=[_text(stage="ar"), _image(stage="diffusion")])
    light = full.light()
    light.parts[1].advantage, light.parts[0].reward = 0.75, 1.0
    done = complete_sample(light, dataclasses.replace(full, parts=[dataclasses.replace(p) for p in full.parts]))
    assert done.parts[1].advantage == 0.75 and done.parts[0].reward == 1.0 and done.parts[0].advantage is None
    assert done.parts[1].latents is not None  # the trajectory is the cached one

    with pytest.raises(ValueError, match="sample 'a'.*2 Parts.*1"):
        complete_sample(dataclasses.replace(light, parts=light.parts[:1]), full)
    swapped = dataclasses.replace(light, parts=[light.parts[1], light.parts[0]])
    with pytest.raises(ValueError, match="Part 0 of sample 'a'"):
        complete_sample(swapped, full)
    with pytest.raises(ValueError, match="not the same sample"):
        complete_sample(dataclasses.replace(light, sample_id="b"), full)


def test_algorithms_take_the_part_routed_to_their_stage_never_the_first_of_a_kind():
    rewrite, answer = _text(stage="ar"), _text(stage="judge")
    image = _image(stage="diffusion")
    sample = Sample(sample_id="a", group_id="g", prompt="p", parts=[rewrite, image, answer])
    assert text_part(sample, "ar") is rewrite and text_part(sample, "judge") is answer
    assert diffusion_part(sample, "diffusion") is image
    with pytest.raises(ValueError, match="2 TextParts.*'a'.*stage"):  # ambiguous without a stage
        text_part(sample)
    with pytest.raises(ValueError, match="no TextPart of stage 'other'"):
        text_part(sample, "other")
    single = Sample(sample_id="b", group_id="g", prompt="p", parts=[_text()])
    assert text_part(single) is single.parts[0]  # a single-side recipe: its one Part, stage unset
    assert text_part(single, "policy") is single.parts[0]  # an unnamed Part belongs to any (the only) side
