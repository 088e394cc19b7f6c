"""The vision-language family (tiny Qwen2.5-VL from config): prompts with images, exactly recomputable log-probs
(ratio 1 at step start) with Qwen2.5-VL's 3D positions as the model computes them itself, a frozen vision tower,
images as paths / bytes / data URLs, save / load, the colour reward and the tiny recipe."""

import base64
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from unirl_ray.models.vlm import VLMBundle, VLMConfig, VLMPipeline
from unirl_ray.models.vlm.pipeline import load_image
from unirl_ray.rewards.text import answer_char_fraction

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "What colour is this image?"


def png(color, size=(16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), color, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def request(i, image=None, prompt=PROMPT):
    return {"sample_id": f"s{i}", "prompt": prompt, "seed": 100 + i, "columns": {} if image is None else {"image": image}}


@pytest.fixture(scope="module")
def bundle():
    return VLMBundle.from_config(VLMConfig())


@pytest.fixture(scope="module")
def pipe(bundle):
    return VLMPipeline(bundle, max_prompt_tokens=64, max_new_tokens=6)


@pytest.fixture(scope="module")
def batch_out(pipe):
    reqs = [request(0, png((200, 0, 0))), request(1, png((0, 0, 200))), request(2), request(3, [png((0, 200, 0)), png((9, 9, 9), (24, 16))])]
    return reqs, pipe.sample_requests(reqs, micro_batch_size=4)


def test_tiny_model_builds_offline_seeded_with_a_frozen_tower(bundle):
    assert bundle.is_demo and type(bundle.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    frozen = {id(p) for p in bundle.model.frozen_parameters()}
    assert frozen == {id(p) for p in bundle.model.model.visual.parameters()} and frozen
    again = VLMBundle.from_config(VLMConfig()).model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in bundle.model.state_dict().items())
    assert not hasattr(VLMBundle.from_config(VLMConfig(freeze_vision=False)).model, "frozen_parameters")
    with pytest.raises(ValueError, match="min_pixels"):
        VLMConfig(min_pixels=100, max_pixels=10)


def test_prompts_carry_their_image_tokens(pipe, batch_out):
    reqs, out = batch_out
    tok = pipe.tokenizer
    for req, (part, _) in zip(reqs, out):
        ids = part.prompt_ids.tolist()
        n_images = len(req["columns"]["image"]) if isinstance(req["columns"].get("image"), list) else int("image" in req["columns"])
        if not n_images:
            assert part.vision is None and pipe.image_token_id not in ids
            continue
        grid = part.vision["image_grid_thw"]
        assert grid.shape == (n_images, 3) and part.vision["pixel_values"].shape[0] == int(grid.prod(-1).sum())
        assert ids.count(pipe.image_token_id) == int(grid.prod(-1).sum()) // 4  # 2 x 2 patches merge into a token
        text = tok.decode(ids)
        assert text.count("<|vision_start|>") == n_images and text.endswith(PROMPT + "<|im_end|>\n<|im_start|>assistant\n")
    # 24 x 16 pixels: resized within the 16 x 16 area, still taller than wide (rows 4 patches, columns 2)
    assert out[3][0].vision["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 2]]
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        pipe.encode_request("x" * 80, [])


def test_recorded_log_probs_are_recomputed_exactly_with_the_images(pipe, bundle, batch_out):
    reqs, out = batch_out
    parts = [p for p, _ in out]
    batch = pipe.collate(parts)
    assert batch["position_ids"].shape == (3, 4, batch["input_ids"].shape[1])
    assert batch["pixel_values"].shape[0] == sum(p.vision["pixel_values"].shape[0] for p in parts if p.vision is not None)
    logp, _ = pipe.token_log_probs(bundle.model, batch)
    mask = batch["completion_mask"]
    assert float(((logp.detach() - batch["old_log_probs"]).abs() * mask).max()) < 1e-5  # the ratio is 1 at step start
    # our 3D positions are the model's own (it computes them when given no position_ids)
    types = (batch["input_ids"] == pipe.image_token_id).int()
    with torch.no_grad():
        own = bundle.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], mm_token_type_ids=types,
                           pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]).logits
        ours = bundle.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"], pixel_values=batch["pixel_values"],
                            image_grid_thw=batch["image_grid_thw"]).logits
    real = batch["attention_mask"].bool()
    assert torch.allclose(own[real], ours[real], atol=1e-5)
    # the images are in the graph: the loss reaches the vision tower (which the backend may freeze)
    (logp * mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.model.model.visual.parameters())
    bundle.model.zero_grad(set_to_none=True)


def test_a_sample_depends_on_its_own_image_and_seed_only(pipe, batch_out):
    reqs, out = batch_out
    alone = pipe.sample_requests([reqs[1]])[0][0]
    assert torch.equal(alone.completion_ids, out[1][0].completion_ids)
    assert torch.allclose(alone.log_probs, out[1][0].log_probs, atol=1e-5)
    other = pipe.sample_requests([dict(reqs[1], columns={"image": png((0, 200, 0))})])[0][0]  # another image
    batch = pipe.collate([out[1][0], other])
    assert not torch.equal(batch["pixel_values"][:16], batch["pixel_values"][16:])
    assert not torch.allclose(out[1][0].log_probs[:1], other.log_probs[:1])  # the first token's distribution moved


def test_completions_never_contain_vision_markers(bundle):
    """The processor alone places image slots: the sampled distribution gives the markers probability 0 (the
    random tiny model would draw one of them in ~1 of 28 tokens), and the recomputation uses the same one."""
    pipe = VLMPipeline(bundle, max_prompt_tokens=64, max_new_tokens=16)
    out = pipe.sample_requests([request(i, png((30 * i, 0, 0))) for i in range(8)])
    markers = set(pipe.vision_marker_ids.tolist())
    assert len(markers) == 4 and not any(markers & set(part.completion_ids.tolist()) for part, _ in out)
    batch = pipe.collate([p for p, _ in out])
    logp, entropy = pipe.token_log_probs(bundle.model, batch)
    mask = batch["completion_mask"]
    assert float(((logp.detach() - batch["old_log_probs"]).abs() * mask).max()) < 1e-5 and torch.isfinite(entropy).all()


def test_images_as_paths_bytes_data_urls_and_structs(tmp_path):
    raw = png((10, 20, 30))
    path = tmp_path / "x.png"
    path.write_bytes(raw)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    arrays = [np.asarray(load_image(v)) for v in (str(path), raw, url, {"bytes": raw}, Image.open(path))]
    assert all(a.shape == (16, 16, 3) and (a == arrays[0]).all() for a in arrays)
    with pytest.raises(ValueError, match="path, bytes or a data:image URL"):
        load_image(3)


def test_save_and_load_local_folder_the_reward_and_the_tiny_recipe(tmp_path, bundle, pipe):
    bundle.save_pretrained(str(tmp_path))
    loaded = VLMBundle.from_config(VLMConfig(pretrained_model_path=str(tmp_path)))
    assert not loaded.is_demo and hasattr(loaded.model, "frozen_parameters")
    assert all(torch.equal(v, loaded.model.state_dict()[k]) for k, v in bundle.model.state_dict().items())
    again = VLMPipeline(loaded, max_prompt_tokens=64, max_new_tokens=6)
    req = request(7, png((0, 0, 250)))
    a, b = pipe.sample_requests([req])[0][0], again.sample_requests([req])[0][0]
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.completion_ids, b.completion_ids)
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        os.remove(tmp_path / "preprocessor_config.json")
        VLMConfig(pretrained_model_path=str(tmp_path))

    assert answer_char_fraction(completions=["rrb", "", "x", "g"], answer=["r", "g", "xy", None]) == [2 / 3, 0.0, None, None]

    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.ar import ARTrainer

    trainer = ARTrainer(load_recipe(os.path.join(ROOT, "recipes", "ar", "tiny", "vlm_colors_grpo.yaml")))
    assert trainer.is_demo() and trainer.recipe.data.columns == ["image", "answer"]


QWEN25_VL_3B = dict(  # Qwen2.5-VL-3B-Instruct's published config (the parts that size it)
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rope_theta=1e6,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, tie_word_embeddings=True),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31]),
    tie_word_embeddings=True,
)


def test_the_real_recipe_passes_the_drivers_checks_on_a_configs_only_folder(tmp_path, monkeypatch, bundle):
    """The Qwen2.5-VL-3B recipe against a folder with the published config (3.75B parameters, counted on the meta
    device) and an image processor: the driver's checks pass, and its sample data has an image and an answer."""
    import json

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.ar import ARTrainer

    config = Qwen2_5_VLConfig(**QWEN25_VL_3B)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(3.75e9, rel=0.01)
    config.save_pretrained(tmp_path)
    bundle.image_processor.save_pretrained(tmp_path)
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path))
    monkeypatch.delenv("CHART_QA_JSONL", raising=False)
    trainer = ARTrainer(load_recipe(os.path.join(ROOT, "recipes", "ar", "qwen2_5", "vl_3b_chart_qa_grpo.yaml")))
    assert not trainer.is_demo() and trainer.bundle_cfg.max_pixels == 200704 and trainer.dedicated.engine == "hf"
    with open(trainer.data.path) as f:  # read here: the source's own reader would start Ray
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) == 16 and all(load_image(r["image"]).size == (224, 224) and r["answer"].isdigit() for r in rows)
