"""The SFT losses without Ray: packed rows attend only within their examples (same per-token
log-probs as separate forwards on the tiny Qwen2), packing and micro-batching change neither the
loss nor the step, and the flow-matching loss of the tiny SD3 is deterministic and ignores padding."""

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from unirl_ray.algorithms.base import LossContext
from unirl_ray.algorithms.sft import SFT, collate_text
from unirl_ray.config.recipe import load_recipe
from unirl_ray.core.sample import Sample
from unirl_ray.data.sft_examples import SFTImagePart, SFTTextPart, TextExampleBuilder, pack_rows, padding_row
from unirl_ray.train.rank import StackWorker
from unirl_ray.train.configs import TrainTopology

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
CHAT = os.path.join(REPO, "unirl_ray", "assets", "data", "sft_chat.jsonl")
FIELDS = {"messages": "messages", "prompt": "prompt", "completion": "completion", "text": "text",
          "image": "image", "caption": "caption"}


def worker(recipe, *overrides):
    cfg = load_recipe(os.path.join(REPO, "recipes", "sft", "tiny", recipe), ["trainer.storage_path=/tmp/unused", *overrides])
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in ("bundle", "pipeline", "backend", "algorithm", "stack")}
    torch.manual_seed(0)
    return StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))


@pytest.fixture(scope="module")
def chat_parts():
    from unirl_ray.models.causal_lm import build_char_tokenizer

    build = TextExampleBuilder(build_char_tokenizer(), format="messages", max_length=64, fields=FIELDS)
    with open(CHAT) as f:
        return [build.build(json.loads(line)) for line in f.read().splitlines()[:12]]


def test_collate_restarts_positions_per_example_and_masks_boundaries():
    a = SFTTextPart(input_ids=torch.tensor([1, 2, 3]), target_mask=torch.tensor([0.0, 1, 1]), segment_lengths=[3])
    b = SFTTextPart(input_ids=torch.tensor([4, 5]), target_mask=torch.tensor([0.0, 1]), segment_lengths=[2])
    (packed,) = pack_rows([a, b], max_length=8)
    batch = collate_text([packed, b], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [4, 5, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]  # the padding tail is its own run
    # targets: input_ids[:, 1:]; the first token of the second example (4) is never a target
    assert batch["target_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]


def test_packed_forward_gives_the_separate_forwards_log_probs(chat_parts):
    w = worker("char_chat_sft.yaml")
    module, pipeline = w.backend.module, w.pipeline
    pad = int(pipeline.tokenizer.pad_token_id)
    rows = pack_rows(chat_parts[:6], max_length=64)
    assert any(len(r.segment_lengths) > 1 for r in rows)
    with torch.no_grad():
        packed = pipeline.teacher_forced_log_probs(module, **_inputs(collate_text(rows, pad)))
        for r, row in enumerate(rows):
            start = 0
            for n in row.segment_lengths:
                ids = row.input_ids[start : start + n]
                alone = pipeline.teacher_forced_log_probs(module, ids[None], torch.arange(n)[None])[0]
                torch.testing.assert_close(packed[r, start : start + n - 1], alone, rtol=0, atol=1e-5)
                start += n
    assert SFT(pipeline=pipeline).check_packing(module) < 1e-5


def test_packing_check_fails_when_attention_crosses_examples():
    w = worker("char_chat_sft.yaml")
    original = w.pipeline.teacher_forced_log_probs

    def ignores_positions(module, input_ids, position_ids):  # a model without packed-sequence attention
        return original(module, input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids))

    w.pipeline.teacher_forced_log_probs = ignores_positions
    with pytest.raises(RuntimeError, match="does not keep packed sequences apart"):
        SFT(pipeline=w.pipeline).check_packing(w.backend.module)


def one_step(parts, *, packing, micro):
    """One optimizer step on ``parts`` from the same initial weights; (train/loss, gradients, rows)."""
    w = worker("char_chat_sft.yaml", f"stack.micro_batch_size={micro}")
    rows = pack_rows(parts, 64) if packing else list(parts)
    rows += [padding_row("sft_text") for _ in range(-len(rows) % micro)]
    grads, step = {}, w.backend.optimizer_step

    def record_then_step(max_grad_norm):
        grads.update({k: p.grad.detach().clone() for k, p in w.backend.module.named_parameters()})
        return step(max_grad_norm)

    w.backend.optimizer_step = record_then_step
    result = w.stack.train([Sample(sample_id=f"r{i}", group_id="", prompt="", parts=[r]) for i, r in enumerate(rows)], seed=0)
    return result.metrics["train/loss"], grads, len(rows)


def test_packing_and_micro_batching_give_the_same_loss_and_gradient(chat_parts):
    loss_a, grads_a, n_a = one_step(chat_parts, packing=False, micro=4)
    loss_b, grads_b, n_b = one_step(chat_parts, packing=True, micro=1)
    loss_c, grads_c, _ = one_step(chat_parts, packing=False, micro=12)
    assert n_b < n_a  # packing did pack
    total = sum(p.num_targets for p in chat_parts)
    w = worker("char_chat_sft.yaml")
    with torch.no_grad():
        by_hand = sum(-w.pipeline.teacher_forced_log_probs(w.backend.module, p.input_ids[None], torch.arange(len(p.input_ids))[None])[0]
                      @ p.target_mask[1:] for p in chat_parts) / total
    assert loss_a == pytest.approx(float(by_hand), rel=1e-5)  # token mean over the whole step
    assert loss_b == pytest.approx(loss_a, rel=1e-5) and loss_c == pytest.approx(loss_a, rel=1e-5)
    assert any(g.abs().max() > 1e-3 for g in grads_a.values())
    for name in grads_a:  # the same gradient, however the tokens are packed and micro-batched
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(grads_c[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_loss_is_normalised_by_the_global_token_count():
    sft = SFT()
    sft.pipeline = object()  # not used: loss_sum is replaced below
    seen = {}

    def loss_sum(module, parts):
        total = torch.tensor(6.0, requires_grad=True)
        seen["total"] = total
        return total, 3.0

    sft.loss_sum = loss_sum
    part = SFTTextPart(input_ids=torch.tensor([1, 2, 3, 4]), target_mask=torch.tensor([0.0, 1, 1, 1]), segment_lengths=[4])
    samples = [Sample(sample_id="a", group_id="", prompt="", parts=[part])]
    assert sft.loss_units(samples) == 3.0
    out = sft.compute_loss_and_backward(samples, {}, LossContext(policy=None, reference=None, loss_scale=1.0,
                                                                  first_pass=True, global_units=12.0, world_size=2))
    assert out == {"loss": 6.0, "count": 3.0}
    assert seen["total"].grad.item() == pytest.approx(2 / 12)  # world_size / tokens of the step on all ranks


def test_flow_matching_loss_is_seeded_and_padding_weighs_nothing():
    w = worker("sd3_caption_sft.yaml")
    sft, module = w.algorithm, w.backend.module
    gen = torch.Generator().manual_seed(0)
    parts = [SFTImagePart(pixels=torch.rand(3, 32, 32, generator=gen) * 2 - 1, caption=f"shape {i}", seed=10 + i) for i in range(3)]
    with torch.no_grad():
        total, count = sft.loss_sum(module, parts)
        again, _ = sft.loss_sum(module, parts)
        padded, padded_count = sft.loss_sum(module, parts + [padding_row("sft_image", height=32, width=32)])
        reseeded, _ = sft.loss_sum(module, [SFTImagePart(pixels=p.pixels, caption=p.caption, seed=p.seed + 100) for p in parts])
    assert count == padded_count == 3.0 and torch.isfinite(total) and total > 0
    assert torch.equal(total, again)
    torch.testing.assert_close(padded, total, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(reseeded, total)  # the seed picks noise and noise level
    with pytest.raises(ValueError, match="guidance_scale"):
        SFT(pipeline=type("P", (), {"guidance_scale": 4.5})())


def _inputs(batch):
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
