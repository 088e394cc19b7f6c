"""The unified model family and ``UnifiedModelTrainStack`` in one process (no Ray, no process group)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from support import recipe_path

from unirl_ray.algorithms import FlowGRPO, GRPO
from unirl_ray.algorithms.credit import LineageCredit
from unirl_ray.config.recipe import load_recipe
from unirl_ray.core.sample import DiffusionPart, Sample, TextPart, routed_part
from unirl_ray.models.unified import UnifiedBundle, UnifiedConfig, UnifiedPipeline, unified_attention_mask
from unirl_ray.train.backend.fsdp import FSDPBackend
from unirl_ray.train.configs import OptimizerConfig, TrainTopology
from unirl_ray.train.rank import StackWorker
from unirl_ray.train.stack import UnifiedModelTrainStack

RECIPE = recipe_path("unified", "tiny", "unified_tiny.yaml")


def pipeline(bundle=None, **kw):
    bundle = bundle or UnifiedBundle.from_config(UnifiedConfig())
    return UnifiedPipeline(bundle, max_prompt_tokens=24, max_new_tokens=6, num_inference_steps=3, **kw)


def requests(n_texts=2, images_per_text=2):
    return [{"sample_id": f"t{t}-i{i}", "prompt": f"a {'cat' if t % 2 else 'dog'}", "seed": 10 * t + i,
             "text_id": f"t{t}", "text_seed": 100 + t} for t in range(n_texts) for i in range(images_per_text)]


def samples_of(pipe, reqs, **kw):
    out = pipe.sample_requests(reqs, **kw)
    return [Sample(sample_id=r["sample_id"], group_id="g", prompt=r["prompt"], parts=list(parts), image=img)
            for r, (parts, img) in zip(reqs, out)]


def test_attention_mask_is_causal_over_text_and_bidirectional_over_the_image():
    text = torch.tensor([[1, 1, 0]])  # two valid text positions, one pad
    allowed = unified_attention_mask(text, 2, torch.float32)[0, 0] == 0
    expected = torch.tensor([
        [1, 0, 0, 0, 0],  # text 0: itself
        [1, 1, 0, 0, 0],  # text 1: causal
        [0, 0, 1, 0, 0],  # the pad: itself only (never a row without a key)
        [1, 1, 0, 1, 1],  # image: every valid text position and the whole image block
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    assert unified_attention_mask(text, 2, torch.float32).dtype == torch.float32  # additive float, never boolean


def test_perturbations_prove_the_mask_and_eager_equals_sdpa():
    torch.manual_seed(0)
    sdpa = UnifiedBundle.from_config(UnifiedConfig(attn_implementation="sdpa")).transformer
    eager = UnifiedBundle.from_config(UnifiedConfig(attn_implementation="eager")).transformer
    ids = torch.randint(10, 60, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # row 1: two pad positions
    x, sigma = torch.randn(2, 4, 8, 8), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        base = sdpa.hidden_states(ids, mask, x, sigma)
        assert torch.allclose(eager.hidden_states(ids, mask, x, sigma), base, atol=1e-5)  # the same float mask
        assert torch.allclose(eager(input_ids=ids, attention_mask=mask, image_latents=x, sigma=sigma),
                              sdpa(input_ids=ids, attention_mask=mask, image_latents=x, sigma=sigma), atol=1e-5)

        later = ids.clone()
        later[:, 4] += 1  # a later text token: earlier text positions do not see it, the image does
        h = sdpa.hidden_states(later, mask, x, sigma)
        assert torch.allclose(h[:, :4], base[:, :4], atol=1e-6)
        assert not torch.allclose(h[:, 4], base[:, 4], atol=1e-4)
        assert not torch.allclose(h[0, 7:], base[0, 7:], atol=1e-4)

        other = x.clone()
        other[:, :, 6:, 6:] += 1.0  # the last image patch: text positions do not see the image; every patch does
        h = sdpa.hidden_states(ids, mask, other, sigma)
        assert torch.allclose(h[:, :7], base[:, :7], atol=1e-6)
        assert not torch.allclose(h[:, 8], base[:, 8], atol=1e-4)  # the first patch sees the last one

        padded = ids.clone()
        padded[1, 5:] = 3  # what sits under the pad positions of row 1 is invisible to every valid position
        h = sdpa.hidden_states(padded, mask, x, sigma)
        assert torch.allclose(h[1, :5], base[1, :5], atol=1e-6) and torch.allclose(h[1, 7:], base[1, 7:], atol=1e-6)


def test_sampling_records_log_probs_that_training_recomputes_and_folders_round_trip(tmp_path):
    pipe = pipeline()
    batch = samples_of(pipe, requests(), micro_batch_size=3)
    texts = [routed_part(s, TextPart, "text") for s in batch]
    images = [routed_part(s, DiffusionPart, "image") for s in batch]
    assert [t.part_id for t in texts] == ["t0", "t0", "t1", "t1"]  # two images per text segment
    assert torch.equal(texts[0].completion_ids, texts[1].completion_ids)
    assert batch[0].image.shape == (32, 32, 3)
    # the image is conditioned on prompt + the generated tokens, as ids (never re-tokenised)
    n = len(texts[0].prompt_ids) + len(texts[0].completion_ids)
    assert images[0].cond["cond_mask"].sum() == n
    assert torch.equal(images[0].cond["cond_ids"][:n], torch.cat([texts[0].prompt_ids, texts[0].completion_ids]))

    text_batch = pipe.text.collate(texts)
    logp, _ = pipe.text.token_log_probs(pipe.bundle.transformer, text_batch)
    m = text_batch["completion_mask"].bool()
    assert (logp[m] - text_batch["old_log_probs"][m]).abs().max() < 1e-5
    image_batch = pipe.image.collate(images)
    for j in range(3):
        lp, _, _ = pipe.image.step_log_prob(pipe.bundle.transformer, image_batch, torch.full((4,), j))
        assert torch.allclose(lp, image_batch["log_probs"][:, j], atol=1e-5)

    folder = pipe.bundle.save_pretrained(str(tmp_path / "model"))
    assert folder.endswith("transformer")
    loaded = UnifiedBundle.from_config(UnifiedConfig(pretrained_model_path=str(tmp_path / "model")))
    again = samples_of(pipeline(loaded), requests(), micro_batch_size=3)
    assert [routed_part(s, TextPart, "text").text for s in again] == [t.text for t in texts]
    assert all(torch.equal(routed_part(a, DiffusionPart, "image").latents, i.latents) for a, i in zip(again, images))


def _stack(bundle, pipe, *, weights):
    backend = FSDPBackend(block_class_names=["Qwen2DecoderLayer"], trainable_attr="transformer", bundle=bundle,
                          optimizer_cfg=OptimizerConfig(learning_rate=1e-3))
    algorithms = {"text": GRPO(group_size=2, pipeline=pipe.text), "image": FlowGRPO(group_size=2, clip_range=0.5, pipeline=pipe.image)}
    stack = UnifiedModelTrainStack(loss_weights=weights, micro_batch_size=3, max_grad_norm=None,
                                   fsdp_backend=backend, algorithm=algorithms)
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    return stack, backend


def test_one_unified_step_is_the_gradient_of_the_weighted_sum_of_both_losses():
    pipe = pipeline()
    batch = samples_of(pipe, requests(), micro_batch_size=4)
    text_adv, image_adv = {"t0": 0.7, "t1": -0.4}, [0.5, -1.2, 0.9, 0.3]
    for s, a in zip(batch, image_adv):
        routed_part(s, TextPart, "text").advantage = text_adv[s.sample_id.split("-")[0]]
        routed_part(s, DiffusionPart, "image").advantage = a
    stack, backend = _stack(pipe.bundle, pipe, weights={"text": 0.3, "image": 2.0})
    module = backend.module

    # by hand, at the step's starting weights: GRPO's token mean over the two distinct segments and Flow-GRPO's
    # mean over (image, step) pairs of -A * ratio (both ratios are 1 here, inside every clip)
    segments = [routed_part(batch[0], TextPart, "text"), routed_part(batch[2], TextPart, "text")]
    tb = pipe.text.collate(segments)
    logp, _ = pipe.text.token_log_probs(module, tb)
    mask = tb["completion_mask"]
    adv = torch.tensor([0.7, -0.4])[:, None]
    text_loss = (-adv * torch.exp(logp - tb["old_log_probs"]) * mask).sum() / mask.sum()
    ib = pipe.image.collate([routed_part(s, DiffusionPart, "image") for s in batch])
    pairs = []
    for j in range(3):
        lp, _, _ = pipe.image.step_log_prob(module, ib, torch.full((4,), j))
        pairs.append(-torch.tensor(image_adv) * torch.exp(lp - ib["log_probs"][:, j]))
    image_loss = torch.stack(pairs).mean()
    (0.3 * text_loss + 2.0 * image_loss).backward()
    expected = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)

    seen = {}
    step = backend.optimizer_step

    def spy(max_grad_norm):
        seen.update({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        return step(max_grad_norm)

    backend.optimizer_step = spy
    result = stack.train(batch, seed=5)
    assert sorted(seen) == sorted(expected)
    for name, grad in expected.items():
        assert torch.allclose(seen[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max())), name
    m = result.metrics
    assert result.num_optimizer_steps == 1 and result.policy_version == 1
    assert m["text/train/parts"] == 2 and m["image/train/parts"] == 4  # each text segment trained once
    assert m["text/algo/ratio"] == pytest.approx(1.0, abs=1e-5) and m["image/algo/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert m["text/rollout/logp_gap"] < 1e-5 and m["image/rollout/logp_gap"] < 1e-5
    assert m["text/train/loss"] == pytest.approx(text_loss.item(), rel=1e-4)
    assert m["image/train/loss"] == pytest.approx(image_loss.item(), rel=1e-4)
    assert m["train/grad_norm"] > 0 and "train/lr" in m


def test_the_stack_refuses_what_it_cannot_train():
    pipe = pipeline()
    algorithms = {"text": GRPO(group_size=2, pipeline=pipe.text), "image": FlowGRPO(group_size=2, pipeline=pipe.image)}
    with pytest.raises(ValueError, match="loss_weights names stage"):
        UnifiedModelTrainStack(loss_weights={"video": 1.0}, algorithm=algorithms)
    with pytest.raises(ValueError, match="loss_weights.image must be a finite number > 0"):
        UnifiedModelTrainStack(loss_weights={"image": 0.0}, algorithm=algorithms)
    with pytest.raises(ValueError, match=r"mapping \{stage: StageAlgorithm\}"):
        UnifiedModelTrainStack(algorithm=algorithms["text"])
    single = FlowGRPO(group_size=2, pipeline=pipe.image)
    single.supports_multi_update = False  # as the SFT losses are
    with pytest.raises(ValueError, match="stage\\(s\\) image does not support multiple updates"):
        UnifiedModelTrainStack(num_updates_per_batch=2, algorithm={**algorithms, "image": single})
    UnifiedModelTrainStack(num_updates_per_batch=2, algorithm=algorithms)  # GRPO and Flow-GRPO both do


def test_a_rank_built_from_the_recipe_trains_both_stages_and_reports_their_advantages():
    recipe = load_recipe(RECIPE)
    sections = {k: OmegaConf.to_container(recipe[k], resolve=True) for k in
                ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")}
    sections["pipeline"].update(max_new_tokens=4, num_inference_steps=2)
    worker = StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))
    assert set(worker.algorithm) == {"text", "image"} and isinstance(worker.stack, UnifiedModelTrainStack)
    assert worker.algorithm["text"].pipeline is worker.pipeline.text  # each stage gets its view of the pipeline
    reqs = [dict(r, group_id="g0") for r in requests(n_texts=4, images_per_text=1)]
    light = worker.generate(reqs)
    assert all([p.stage for p in s.parts] == ["text", "image"] for s in light)  # the pipeline names its stages
    for s, r in zip(light, [0.1, 0.5, 0.2, 0.9]):
        s.reward = r
    LineageCredit(text_stage="text", image_stage="image", image_group_scope="shared").assign(light)
    out = worker.train(copy.deepcopy(light), seed=3)
    want = [routed_part(s, TextPart, "text").advantage for s in light]
    assert out["advantages"] == {"text": want, "image": want}  # shared: the image takes its segment's advantage
    assert out["policy_version"] == 1 and out["metrics"]["text/rollout/logp_gap"] < 1e-5
    assert out["metrics"]["image/rollout/logp_gap"] < 1e-5


# ------------------------------------------------------------------ Janus-Pro (discrete image tokens)
def test_janus_writes_then_draws_tokens_whose_log_probs_training_recomputes_and_round_trips(tmp_path):
    from unirl_ray.models.janus import JanusBundle, JanusModelConfig, JanusPipeline

    bundle = JanusBundle.from_config(JanusModelConfig())
    pipe = JanusPipeline(bundle, max_prompt_tokens=24, max_new_tokens=5)
    batch = samples_of(pipe, requests(), micro_batch_size=3)
    texts = [routed_part(s, TextPart, "text") for s in batch]
    images = [routed_part(s, TextPart, "image") for s in batch]  # both Parts are TextParts: the stage routes them
    assert [t.part_id for t in texts] == ["t0", "t0", "t1", "t1"] and batch[0].image.shape == (16, 16, 3)
    n = bundle.model.num_image_tokens
    assert all(len(i.completion_ids) == n == 16 for i in images)
    # the image's context is prompt + the generated tokens + <begin_of_image>
    assert images[0].prompt_ids.tolist() == texts[0].prompt_ids.tolist() + texts[0].completion_ids.tolist() + [bundle.boi_token_id]
    assert not torch.equal(images[0].completion_ids, images[1].completion_ids)  # two images of one segment differ
    for view, parts in ((pipe.text, texts), (pipe.image, images)):
        b = view.collate(parts)
        logp, _ = view.token_log_probs(bundle.model, b)
        m = b["completion_mask"].bool()
        assert m.sum() > 0 and (logp[m] - b["old_log_probs"][m]).abs().max() < 1e-5

    algorithms = {"text": GRPO(group_size=2, pipeline=pipe.text), "image": GRPO(group_size=2, pipeline=pipe.image)}
    backend = FSDPBackend(block_class_names=["LlamaDecoderLayer"], trainable_attr="model", bundle=bundle,
                          optimizer_cfg=OptimizerConfig(learning_rate=1e-3))
    stack = UnifiedModelTrainStack(micro_batch_size=2, fsdp_backend=backend, algorithm=algorithms)
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    for s, a in zip(batch, (0.5, -0.5, 1.0, -1.0)):
        routed_part(s, TextPart, "text").advantage = 1.0 if s.sample_id.startswith("t0") else -1.0
        routed_part(s, TextPart, "image").advantage = a
    head = bundle.model.janus.model.generation_head.vision_head.weight.detach().clone()
    lm_head = bundle.model.janus.lm_head.weight.detach().clone()
    m = stack.train(batch, seed=1).metrics
    assert m["text/train/parts"] == 2 and m["image/train/parts"] == 4
    assert m["text/rollout/logp_gap"] < 1e-5 and m["image/rollout/logp_gap"] < 1e-5
    assert not torch.equal(head, bundle.model.janus.model.generation_head.vision_head.weight)  # the image stage trained
    assert not torch.equal(lm_head, bundle.model.janus.lm_head.weight)  # and the text stage, in the same step

    folder = bundle.save_pretrained(str(tmp_path / "janus"))
    from transformers import JanusForConditionalGeneration

    assert isinstance(JanusForConditionalGeneration.from_pretrained(folder), JanusForConditionalGeneration)
    loaded = JanusBundle.from_config(JanusModelConfig(pretrained_model_path=folder))
    live = samples_of(pipe, requests(), micro_batch_size=3)
    again = samples_of(JanusPipeline(loaded, max_prompt_tokens=24, max_new_tokens=5), requests(), micro_batch_size=3)
    for a, b in zip(live, again):
        assert routed_part(a, TextPart, "text").text == routed_part(b, TextPart, "text").text
        assert torch.equal(routed_part(a, TextPart, "image").completion_ids, routed_part(b, TextPart, "image").completion_ids)
        assert (a.image == b.image).all()


@pytest.mark.parametrize("name", ["unified_tiny.yaml", "janus_tiny.yaml"])
def test_a_checkpoint_of_both_stages_resumes_exactly(tmp_path, name):
    """One rank of each family: a step, a checkpoint (weights + AdamW state of the one backbone), the next step;
    a fresh rank loaded from the checkpoint takes the same next step to the last bit."""
    recipe = load_recipe(recipe_path("unified", "tiny", name))
    sections = {k: OmegaConf.to_container(recipe[k], resolve=True) for k in
                ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")}
    sections["pipeline"]["max_new_tokens"] = 4
    if "num_inference_steps" in sections["pipeline"]:
        sections["pipeline"]["num_inference_steps"] = 2
    credit = LineageCredit(text_stage="text", image_stage="image", image_group_scope="shared")

    def step(worker, n):
        reqs = [dict(r, group_id="g0", seed=r["seed"] + 100 * n, text_seed=r["text_seed"] + 100 * n)
                for r in requests(n_texts=4, images_per_text=1)]
        light = worker.generate(reqs)
        for s in light:
            s.reward = float(s.image.mean()) / 255.0
        credit.assign(light)
        return worker.train(light, seed=n)["metrics"]

    def rank():
        return StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))

    straight = rank()
    step(straight, 1)
    meta = straight.save(str(tmp_path / "ckpt"))
    want = step(straight, 2)
    resumed = rank()
    resumed.load(str(tmp_path / "ckpt"), meta)
    assert resumed.policy_version == 1
    got = step(resumed, 2)
    for key in ("text/train/loss", "image/train/loss", "train/grad_norm", "text/algo/ratio", "image/algo/ratio"):
        assert got[key] == want[key], key
    for (n, a), (_, b) in zip(straight.backend.module.state_dict().items(), resumed.backend.module.state_dict().items()):
        assert torch.equal(a, b), n
