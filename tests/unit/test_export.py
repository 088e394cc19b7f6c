"""Export of the trained model as a from_pretrained folder (train.export): causal LM and SD3, full and
LoRA (merged / PEFT adapter), the FSDP2 gather over 2 gloo ranks, and MLflow registration."""

import json
import os

import pytest
import torch
from _dist import free_port, start_ranks
from safetensors.torch import load_file

from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, TinyLMConfig
from unirl_ray.models.sd3 import SD3Bundle, SD3PipelineConfig
from unirl_ray.train.backend.fsdp import FSDPBackend
from unirl_ray.train.configs import LoraConfig, TrainTopology
from unirl_ray.train.export import (
    ADAPTER_DIR,
    INFO_FILE,
    ExportInfo,
    check_export_dir,
    export_model,
    register_exported_model,
    write_export,
)
from unirl_ray.trainer.base import RunConfig

LM_LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"])
SD3_LORA = LoraConfig(rank=2, alpha=4.0)
TOKENS = torch.tensor([[2, 10, 20, 30, 40, 50, 60], [2, 11, 12, 13, 14, 15, 16]])


def lm_backend(lora_cfg=None, tiny=None):
    bundle = CausalLMBundle.from_config(CausalLMConfig(tiny=tiny))
    backend = FSDPBackend(block_class_names=["Qwen2DecoderLayer"], trainable_attr="model", bundle=bundle, lora_cfg=lora_cfg)
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    return bundle, backend


def sd3_backend(lora_cfg=None):
    bundle = SD3Bundle.from_config(SD3PipelineConfig())
    backend = FSDPBackend(
        block_class_names=["JointTransformerBlock"], trainable_attr="transformer", bundle=bundle, lora_cfg=lora_cfg
    )
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    return bundle, backend


def train_a_little(module, seed=0):
    """Move every trainable weight (LoRA: only the adapters, B included, so they matter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_unchanged(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()  # adapters still injected, nothing merged
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def lm_logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def sd3_inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(2, 4, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 9, 32, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.tensor([300.0, 700.0]),
    }


def sd3_out(transformer):
    with torch.no_grad():
        return transformer(**sd3_inputs()).sample


# ----------------------------------------------------------------------------------------------- causal LM


@pytest.mark.parametrize(
    "lora, merge, tied",
    [(False, True, False), (False, True, True), (True, True, False), (True, False, False)],
    ids=["full", "full-tied", "lora-merged", "lora-adapter"],
)
def test_causal_lm_export_loads_with_the_live_logits(tmp_path, lora, merge, tied):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    bundle, backend = lm_backend(LM_LORA if lora else None, TinyLMConfig(seed=3, tie_word_embeddings=tied))
    untrained = lm_logits(backend.module)
    train_a_little(backend.module)
    live, before = lm_logits(backend.module), snapshot(backend.module)
    assert not torch.allclose(live, untrained, atol=1e-3)  # so a stale export cannot pass

    info = export_model(bundle, backend, str(tmp_path / "out"), merge_lora=merge, policy_version=7)

    assert_unchanged(backend.module, before)
    assert info.model_path == info.path == str(tmp_path / "out")
    assert (info.lora, info.merged_lora, info.policy_version) == (lora, lora and merge, 7)
    assert ExportInfo.read(info.path) == info
    model = AutoModelForCausalLM.from_pretrained(info.model_path)
    weights = load_file(os.path.join(info.model_path, "model.safetensors"))
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    if lora and not merge:
        assert info.adapter_path == os.path.join(info.path, ADAPTER_DIR)
        assert sorted(f for f in os.listdir(info.adapter_path) if f != "README.md") == [
            "adapter_config.json", "adapter_model.safetensors"
        ]
        assert torch.allclose(lm_logits(model), untrained, atol=1e-5)  # base weights: adapters left out
        model = PeftModel.from_pretrained(model, info.adapter_path)
    else:
        assert info.adapter_path is None and not os.path.exists(os.path.join(info.path, ADAPTER_DIR))
    torch.testing.assert_close(lm_logits(model), live, atol=1e-5, rtol=0)

    # the demo char tokenizer (see CausalLMBundle.save_pretrained: AutoTokenizer maps qwen2 folders to Qwen2Tokenizer)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(info.path)
    text = "2+2? #### 4\n"
    assert tokenizer.encode(text) == bundle.tokenizer.encode(text) and tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "hi there"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|bos|><|user|>hi there<|end|><|assistant|>"
    )
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (0, 3, "left")
    if merge:  # the export is a valid starting point for another run
        again = CausalLMBundle.from_config(CausalLMConfig(pretrained_model_path=info.path))
        torch.testing.assert_close(lm_logits(again.model), live, atol=1e-5, rtol=0)


def test_only_the_active_adapter_is_exported(tmp_path):
    """A second, inactive adapter (e.g. an EMA shadow) is left out; the active one is saved as ``default``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    bundle, backend = lm_backend(LM_LORA)
    train_a_little(backend.module)
    shadow = PeftLoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    inject_adapter_in_model(shadow, backend.module, adapter_name="shadow")

    def activate(name):
        for layer in backend.module.modules():
            if isinstance(layer, BaseTunerLayer):
                layer.set_adapter(name)

    activate("default")
    live_default = lm_logits(backend.module)
    merged = export_model(bundle, backend, str(tmp_path / "default"))
    torch.testing.assert_close(lm_logits(AutoModelForCausalLM.from_pretrained(merged.path)), live_default, atol=1e-5, rtol=0)

    activate("shadow")
    live_shadow = lm_logits(backend.module)
    assert not torch.allclose(live_shadow, live_default, atol=1e-3)
    split = export_model(bundle, backend, str(tmp_path / "shadow"), merge_lora=False)
    adapter = load_file(os.path.join(split.adapter_path, "adapter_model.safetensors"))
    assert adapter and not any("shadow" in k for k in adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(split.path), split.adapter_path)
    torch.testing.assert_close(lm_logits(model), live_shadow, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------- SD3


@pytest.mark.parametrize("lora, merge", [(False, True), (True, True), (True, False)], ids=["full", "lora-merged", "lora-adapter"])
def test_sd3_export_is_a_diffusers_pipeline_with_the_trained_transformer(tmp_path, lora, merge):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import PeftModel

    bundle, backend = sd3_backend(SD3_LORA if lora else None)
    train_a_little(backend.module, seed=1)
    live, before = sd3_out(backend.module), snapshot(backend.module)

    info = export_model(bundle, backend, str(tmp_path / "sd3"), merge_lora=merge)

    assert_unchanged(backend.module, before)
    assert info.model_path == os.path.join(info.path, "transformer") and info.trainable_attr == "transformer"
    pipe = StableDiffusion3Pipeline.from_pretrained(info.path)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        for key, value in getattr(bundle, name).state_dict().items():
            assert torch.equal(getattr(pipe, name).state_dict()[key], value), (name, key)
    assert pipe.tokenizer_3("a cat").input_ids == bundle.tokenizer_3("a cat").input_ids
    assert pipe.scheduler.config.shift == bundle.scheduler.config.shift
    transformer = SD3Transformer2DModel.from_pretrained(info.path, subfolder="transformer")
    if lora and not merge:
        assert os.path.isfile(os.path.join(info.adapter_path, "adapter_model.safetensors"))
        transformer = PeftModel.from_pretrained(transformer, info.adapter_path)
    else:
        torch.testing.assert_close(sd3_out(pipe.transformer), live, atol=1e-5, rtol=0)
    torch.testing.assert_close(sd3_out(transformer), live, atol=1e-5, rtol=0)
    # the policy app's image model serves the trained transformer (an adapter kept apart merged on load)
    from unirl_ray.serve.openai_api import ImagePolicy, load_policy

    served = load_policy(info.path)
    assert isinstance(served, ImagePolicy) and served.name == "sd3"
    torch.testing.assert_close(sd3_out(served.pipe.transformer), live, atol=1e-5, rtol=0)
    reloaded = SD3Bundle.from_config(SD3PipelineConfig(pretrained_model_ckpt_path=info.path))
    assert reloaded.transformer.config.num_layers == bundle.transformer.config.num_layers


# ------------------------------------------------------------------------------------------ folder checks


def test_export_dir_checks_and_overwrite(tmp_path):
    with pytest.raises(ValueError, match="is a URI"):
        check_export_dir("s3://bucket/model")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="existing file"):
        check_export_dir(str(tmp_path / "file"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "old.txt").write_text("old")
    with pytest.raises(ValueError, match="not empty; pass overwrite=True"):
        check_export_dir(str(busy))
    assert check_export_dir(str(tmp_path / "new")) == str(tmp_path / "new")

    bundle, backend = lm_backend()
    with pytest.raises(ValueError, match="not empty"):
        export_model(bundle, backend, str(busy))
    assert (busy / "old.txt").exists()
    info = export_model(bundle, backend, str(busy), overwrite=True)
    assert not (busy / "old.txt").exists() and os.path.isfile(os.path.join(info.path, INFO_FILE))
    assert [p for p in os.listdir(tmp_path) if "partial" in p] == []


def test_failed_export_leaves_no_folder(tmp_path):
    bundle, backend = lm_backend()
    state = {k: v for k, v in backend.module.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="do not match a fresh Qwen2ForCausalLM: missing"):
        write_export(bundle, "model", state, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_run_config_export_options(tmp_path):
    base = dict(run_name="r", num_steps=1, storage_path=str(tmp_path))
    with pytest.raises(ValueError, match="export_register_as needs trainer.export_dir"):
        RunConfig(**base, export_register_as="m")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        RunConfig(**base, export_dir=str(foreign))
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / INFO_FILE).write_text("{}")
    assert RunConfig(**base, export_dir=str(earlier)).export_dir == str(earlier)  # a re-run replaces its export
    assert RunConfig(**base, export_dir="~/x").export_dir == os.path.expanduser("~/x")


def test_trainer_export_checks_arguments_before_any_worker(tmp_path):
    from unirl_ray.config.recipe import RecipeError, load_recipe
    from unirl_ray.trainer.ar import ARTrainer

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "ar", "tiny", "char_grpo_direct.yaml")

    def trainer(*overrides):
        return ARTrainer(load_recipe(recipe, [f"trainer.storage_path={tmp_path}", *overrides]))

    with pytest.raises(RecipeError, match="export_register_as needs trainer.export_dir"):
        trainer("+trainer.export_register_as=m")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        trainer().export(str(busy))
    with pytest.raises(ValueError, match="register_model_name must be a non-empty string"):
        trainer().export(str(tmp_path / "new"), register_model_name=" ")
    with pytest.raises(ValueError, match="needs MLflow tracking"):
        trainer("+tracking.enabled=false").export(str(tmp_path / "new"), register_model_name="m")
    with pytest.raises(ValueError, match="has no checkpoint under"):  # after fit() it restarts from one
        trainer().export(str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()  # nothing started, nothing written


# ------------------------------------------------------------------------------------------------- MLflow


def test_register_exported_model_creates_a_version_of_the_logged_folder(tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    bundle, backend = lm_backend(LM_LORA)
    train_a_little(backend.module)
    live = lm_logits(backend.module)
    info = export_model(bundle, backend, str(tmp_path / "out"))

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("export", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    first = register_exported_model(info.path, name="tiny-lm", tracking_uri=uri, run_id=run_id)
    second = register_exported_model(info.path, name="tiny-lm", tracking_uri=uri, run_id=run_id)

    assert (first.version, second.version) == (1, 2)
    version = client.get_model_version("tiny-lm", "1")
    assert (version.source, version.run_id) == (first.artifact_uri, run_id)
    assert version.tags["unirl.logged_model_id"] == first.model_id
    logged = client.get_logged_model(first.model_id)
    assert logged.source_run_id == run_id and logged.artifact_location == first.artifact_uri
    assert logged.params["merged_lora"] == "True" and logged.tags["unirl.bundle"] == "CausalLMBundle"
    assert first.model_id in [o.model_id for o in client.get_run(run_id).outputs.model_outputs]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # models:/ URIs resolve through the default store
    local = mlflow.artifacts.download_artifacts(artifact_uri=first.uri, dst_path=str(tmp_path / "download"))
    assert sorted(os.listdir(local)) == sorted(os.listdir(info.path))
    with open(os.path.join(local, INFO_FILE)) as f:
        assert json.load(f)["bundle"] == "CausalLMBundle"
    torch.testing.assert_close(lm_logits(AutoModelForCausalLM.from_pretrained(local)), live, atol=1e-5, rtol=0)

    with pytest.raises(ValueError, match="has no unirl_export.json"):
        register_exported_model(str(tmp_path), name="tiny-lm", tracking_uri=uri, run_id=run_id)


# ------------------------------------------------------------------------------------- FSDP2, 2 gloo ranks


def _two_rank_export(rank, port, out_dir):
    """One rank: shard the tiny LM (full / LoRA), take a real optimizer step, export, check on rank 0."""
    import torch.distributed as dist
    from peft import PeftModel
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        topology = TrainTopology(world_size=2, rank=rank, dp_size=2, dp_rank=rank)
        # init_lora_weights=False: B is random too, so the adapters change the output from the start
        random_lora = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        for name, lora_cfg in (("full", None), ("lora", random_lora)):
            bundle = CausalLMBundle.from_config(CausalLMConfig())
            backend = FSDPBackend(block_class_names=["Qwen2DecoderLayer"], trainable_attr="model", bundle=bundle, lora_cfg=lora_cfg)
            backend.setup(topology=topology, device=torch.device("cpu"))
            assert any(isinstance(p, DTensor) for p in backend.module.parameters())
            loss = backend.module(input_ids=TOKENS[rank : rank + 1]).logits.float().pow(2).mean()
            loss.backward()
            backend.optimizer_step(max_grad_norm=1.0)
            full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in backend.module.state_dict().items()}
            with torch.no_grad():
                live = backend.module(input_ids=TOKENS).logits
            merged = export_model(bundle, backend, os.path.join(out_dir, f"{name}-merged"), merge_lora=True)
            split = export_model(bundle, backend, os.path.join(out_dir, f"{name}-adapter"), merge_lora=False)
            if rank != 0:
                assert merged is None and split is None
                continue
            base = load_file(os.path.join(split.model_path, "model.safetensors"))
            expected_base = {k.replace(".base_layer.", "."): v for k, v in full.items() if "lora_" not in k}
            assert base.keys() == expected_base.keys()
            for k, v in expected_base.items():
                assert torch.equal(base[k], v), k
            if lora_cfg is not None:
                adapter = load_file(os.path.join(split.adapter_path, "adapter_model.safetensors"))
                expected = {"base_model.model." + k.replace(".default.", "."): v for k, v in full.items() if "lora_" in k}
                assert adapter.keys() == expected.keys()
                for k, v in expected.items():
                    assert torch.equal(adapter[k], v), k
            model = AutoModelForCausalLM.from_pretrained(merged.model_path)
            torch.testing.assert_close(lm_logits(model), live, atol=1e-5, rtol=0)
            model = AutoModelForCausalLM.from_pretrained(split.model_path)
            if lora_cfg is not None:
                model = PeftModel.from_pretrained(model, split.adapter_path)
            torch.testing.assert_close(lm_logits(model), live, atol=1e-5, rtol=0)
            with open(os.path.join(out_dir, f"{name}.ok"), "w") as f:
                f.write("checked")
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_rank_export_equals_the_unsharded_weights(tmp_path):
    start_ranks(_two_rank_export, (free_port(), str(tmp_path)), 2)
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".ok")) == ["full.ok", "lora.ok"]
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]
