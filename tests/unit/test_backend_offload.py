"""offload()/onload(): device storages are released while offloaded, and training then continues
exactly as if nothing had happened (unsharded, and FSDP2 on 2 gloo ranks)."""

import pytest
import torch

from _dist import backward, make_backend, run_ranks, train
from unirl_ray.train.backend.wrap import local
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig


def _tensors(backend):
    """Parameters, gradients, optimizer state and EMA shadows (local shards)."""
    out = {}
    for name, p in backend.module.named_parameters():
        out[f"param.{name}"] = local(p)
        if p.grad is not None:
            out[f"grad.{name}"] = local(p.grad)
    names = {id(p): n for n, p in backend.module.named_parameters()}
    for p, state in backend.optimizer.state.items():
        for key, value in state.items():
            out[f"optim.{names[id(p)]}.{key}"] = local(value)
    if backend.mirror_ema is not None:
        out.update({f"ema.{k}": local(v) for k, v in backend.mirror_ema.shadow.items()})
    return out


def _offload_roundtrip(**backend_kwargs):
    """Two identical runs; one offloads mid-step (gradients present) and onloads. Returns what the test checks."""
    plain = make_backend(**backend_kwargs)
    moved = make_backend(**backend_kwargs)
    for backend in (plain, moved):
        train(backend, 2)
        backward(backend, 2)  # gradients of step 2 are pending
    stored = _tensors(moved)
    result = {"kinds": sorted({k.split(".")[0] for k in stored})}
    freed = moved.offload()
    result["offloaded_flag"] = moved.offloaded()
    result["offloaded_bytes"] = {k: t.untyped_storage().nbytes() for k, t in stored.items()}
    result["freed"] = freed
    result["second_offload"] = moved.offload()
    errors = []
    attempts = (lambda: moved.module(torch.zeros(1, 5)), lambda: moved.optimizer_step(1.0), lambda: moved.save("/nowhere"))
    for attempt in attempts:
        try:
            attempt()
        except RuntimeError as exc:
            errors.append(str(exc))
    result["errors"] = errors
    result["restored"] = moved.onload()
    result["onloaded_flag"] = moved.offloaded()
    for backend in (plain, moved):
        backend.optimizer_step(1.0)
        train(backend, 2, start=3)
    a, b = _tensors(plain), _tensors(moved)
    result["bit_identical"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result["bytes_total"] = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in stored.values()}.values())
    return result


def _check(result):
    assert result["kinds"] == ["ema", "grad", "optim", "param"]
    assert result["offloaded_flag"] and not result["onloaded_flag"]
    assert all(n == 0 for n in result["offloaded_bytes"].values()), result["offloaded_bytes"]
    assert result["freed"] > 0 and result["freed"] == result["restored"]
    assert result["second_offload"] == 0
    assert len(result["errors"]) == 3 and all("call backend.onload()" in e for e in result["errors"])
    assert result["bit_identical"]


def test_offload_unsharded_frees_storages_and_resumes_bit_identically():
    _check(_offload_roundtrip(ema_full_cfg=EmaFullConfig(target_decay=0.9)))


def test_offload_with_nft_adapters_and_mirror_ema_resumes_bit_identically():
    result = _offload_roundtrip(ema_lora_cfg=EmaLoraConfig(rank=2, alpha=2, target_modules=["to_q"]),
                                ema_full_cfg=EmaFullConfig())
    _check(result)


def test_exported_weights_are_a_snapshot_that_leaves_offload_possible():
    # unsharded on the CPU, torch's full state dict is the parameters themselves: packed for the object
    # store (numpy), they pinned the parameters' storage and a colocated engine's first offload failed
    from unirl_ray.core.wire import pack_tree

    backend = make_backend()
    train(backend, 1)
    state = backend.full_trainable_state_dict()
    packed = pack_tree(state)
    before = {k: v.clone() for k, v in state.items()}
    assert backend.offload() > 0
    backend.onload()
    train(backend, 1, start=2)
    live = dict(backend.module.named_parameters())
    assert any(not torch.equal(live[k], before[k]) for k in before)  # the weights moved on...
    assert all(torch.equal(state[k], before[k]) for k in before)  # ...the snapshot did not
    assert all(p.untyped_storage().resizable() for p in backend.module.parameters())
    assert packed.keys() == state.keys()


def test_an_unwrapped_module_exports_what_dcp_would_without_dcp():
    """One unwrapped rank hands out its trainable parameters by name: the same names and values as DCP's
    full state dict (LoRA adapters only, frozen base weights left out), a snapshot unless asked not to be."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from unirl_ray.train.configs import LoraConfig

    backend = make_backend(lora_cfg=LoraConfig(rank=2, alpha=2, target_modules=["to_q"]))
    train(backend, 1)
    assert backend._wrapped is False
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    trainable = {n for n, p in backend.module.named_parameters() if p.requires_grad}
    reference = {k: v for k, v in get_model_state_dict(backend.module, options=options).items() if k in trainable}
    state = backend.full_trainable_state_dict()
    assert sorted(state) == sorted(reference) and state and all("lora_" in k for k in state)
    assert all(torch.equal(state[k], reference[k]) for k in state)
    live = {p.untyped_storage().data_ptr() for p in backend.module.parameters()}
    assert not any(t.untyped_storage().data_ptr() in live for t in state.values())  # copies
    in_place = backend.full_trainable_state_dict(snapshot=False)
    assert all(t.untyped_storage().data_ptr() in live for t in in_place.values())  # the parameters themselves


def _offload_rank():
    return _offload_roundtrip(ema_full_cfg=EmaFullConfig(target_decay=0.9))


def test_offload_fsdp2_two_ranks_resumes_bit_identically():
    for result in run_ranks(_offload_rank):
        _check(result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_releases_cuda_memory():
    backend = make_backend(dim=1024, device="cuda", ema_full_cfg=EmaFullConfig())
    train(backend, 1)
    backward(backend, 1)
    tensors = {id(t): t for t in _tensors(backend).values()}.values()
    held = sum(t.untyped_storage().nbytes() for t in tensors if t.is_cuda)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    backend.offload()
    after = torch.cuda.memory_allocated()
    assert before - after >= 0.9 * held, (before, after, held)
    backend.onload()
    assert torch.cuda.memory_allocated() >= before - 0.01 * held
    backend.optimizer_step(1.0)
    train(backend, 1, start=2)


def test_unindexed_accelerator_devices_are_pinned_to_the_current_index(monkeypatch):
    # tensors report cuda:0, and torch.device("cuda") != torch.device("cuda:0"): an unindexed backend
    # device made offload skip every storage (found on a GPU)
    from unirl_ray.train.backend.offload import canonical_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert canonical_device("cuda") == torch.device("cuda", 3)
    assert canonical_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert canonical_device("cpu") == torch.device("cpu") and canonical_device("meta") == torch.device("meta")


def test_weights_loaded_from_a_folder_are_owned_so_a_colocated_layout_can_free_them(tmp_path):
    """``from_pretrained`` memory-maps safetensors: such storages cannot be resized, so offload (and a colocated
    engine's sleep) would refuse them. The backend and the HF engine give those tensors storage of their own
    (a tied weight stays one Parameter)."""
    from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, TinyLMConfig
    from unirl_ray.train.backend.offload import StorageOffloader, own_storage

    tied = CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(tie_word_embeddings=True)))
    tied.save_pretrained(str(tmp_path))
    model = CausalLMBundle.from_config(CausalLMConfig(pretrained_model_path=str(tmp_path))).model
    mapped = [n for n, p in model.named_parameters() if not p.untyped_storage().resizable()]
    assert mapped  # what the loader hands over is memory-mapped
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    copied = own_storage([model])
    assert copied == len(mapped) and all(p.untyped_storage().resizable() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    offloader = StorageOffloader(torch.device("cpu"))
    assert offloader.offload(model.parameters()) > 0 and offloader.onload() > 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
