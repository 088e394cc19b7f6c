"""Weight sync contract without Ray: checksums, and an engine that refuses bad or stale weights."""

import asyncio

import pytest
import torch

from unirl_ray.rollout.engines.hf import HFRolloutEngine
from unirl_ray.rollout.weight_sync import StaleWeightsError, TensorWeightSync, state_bytes, state_checksum

SECTIONS = {
    "bundle": {
        "_target_": "unirl_ray.models.causal_lm.CausalLMBundle.from_config",
        "config": {"_target_": "unirl_ray.models.causal_lm.CausalLMConfig", "seed": 0},
    },
    "pipeline": {"_target_": "unirl_ray.models.causal_lm.CausalLMPipeline", "max_new_tokens": 4},
    "trainable_attr": "model",
}


def test_checksum_is_content_and_order_sensitive_only_to_content():
    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    b = {"y": torch.ones(2, 2), "x": torch.arange(4.0)}
    assert state_checksum(a) == state_checksum(b)
    c = {"x": torch.arange(4.0), "y": torch.ones(2, 2) * (1 + 1e-7)}
    assert state_checksum(a) != state_checksum(c)
    assert state_checksum({"x": torch.arange(4.0)}) != state_checksum({"x": torch.arange(4.0).double()})
    assert state_bytes(a) == 4 * 4 + 4 * 4


def test_checksum_covers_every_slice_of_a_large_tensor(monkeypatch):
    """Tensors longer than one hashed slice: a change in any slice, a swap of two tensors' contents, a
    reshape and a non-contiguous view each change the checksum; an empty tensor hashes by name and shape."""
    import unirl_ray.rollout.weight_sync as ws

    monkeypatch.setattr(ws, "_CHUNK_BYTES", 64)  # 16 float32 per slice: a 1000-element tensor has 63 slices
    base = {"w": torch.arange(1000.0), "v": torch.arange(1000.0).flip(0), "e": torch.empty(0, 3)}
    digest = state_checksum(base)
    assert digest == state_checksum({k: t.clone() for k, t in base.items()})
    for index in (0, 15, 16, 500, 999):  # first slice, a slice's end and start, the middle, the last (short) slice
        changed = {**base, "w": base["w"].clone()}
        changed["w"][index] += 1
        assert state_checksum(changed) != digest, index
    assert state_checksum({**base, "w": base["v"], "v": base["w"]}) != digest
    assert state_checksum({**base, "w": base["w"].reshape(10, 100)}) != digest
    assert state_checksum({**base, "e": torch.empty(3, 0)}) != digest
    strided = torch.arange(2000.0)[::2]  # hashed as its values, laid out contiguously
    assert state_checksum({**base, "w": strided}) == state_checksum({**base, "w": strided.contiguous()})


def test_sync_every_validated():
    with pytest.raises(ValueError, match="every"):
        TensorWeightSync(every=0)
    assert TensorWeightSync(every=2).due(4) and not TensorWeightSync(every=2).due(3)


@pytest.fixture(scope="module")
def engine():
    return HFRolloutEngine(SECTIONS)


def request(i):
    return {"sample_id": f"s{i}", "group_id": "g", "prompt": "hi", "columns": {}, "seed": i}


def test_engine_generates_only_with_published_weights(engine):
    with pytest.raises(StaleWeightsError, match="v-1"):
        asyncio.run(engine.generate([request(0)], expected_version=0))
    state = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    engine.load_weights(0, state, state_checksum(state))
    samples = asyncio.run(engine.generate([request(0), request(1)], expected_version=0))
    assert [s.policy_version for s in samples] == [0, 0]
    assert samples[0].parts[0].log_probs is not None


def test_engine_refuses_corrupt_or_foreign_weights_and_keeps_its_version(engine):
    name, param = next(iter(engine.module.named_parameters()))
    state = {name: param.detach().clone() + 1}
    before = engine.status()
    with pytest.raises(ValueError, match="corrupted"):
        engine.load_weights(7, state, "0" * 32)
    with pytest.raises(ValueError, match="lacks"):
        bad = {"no.such.weight": torch.zeros(1)}
        engine.load_weights(7, bad, state_checksum(bad))
    wrong_shape = {name: torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="wrong shapes"):
        engine.load_weights(7, wrong_shape, state_checksum(wrong_shape))
    assert engine.status() == before
    engine.load_weights(8, state, state_checksum(state))
    assert engine.status()["version"] == 8
    assert torch.equal(dict(engine.module.named_parameters())[name], state[name])


def test_a_waking_replica_serves_the_older_version_a_rewind_published(engine, monkeypatch):
    """After a worker-group restart the controller republishes the checkpoint's (older) version; a colocated
    replica records only the newest it loaded, so waking must load that exact version, not keep the newer one."""
    import ray

    name, param = next(iter(engine.module.named_parameters()))
    newer = {name: param.detach().clone() + 2}
    engine.load_weights(9, newer, state_checksum(newer))
    older = {name: param.detach().clone() - 2}

    class Store:  # the run's weight store, holding the republished v5
        class get_latest:
            @staticmethod
            def remote():
                return {"version": 5, "ref": [older], "checksum": state_checksum(older)}

    monkeypatch.setattr(engine, "store", ("weights", "ns"))
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: Store)
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    engine._catch_up(5)  # generation accepts a newer version ("at least"): nothing to load
    assert engine.status()["version"] == 9
    assert engine.wake(5)["version"] == 5  # a wake serves exactly the expected one
    assert torch.equal(dict(engine.module.named_parameters())[name], older[name])


def test_checksum_of_live_parameters_leaves_them_offloadable():
    """A one-rank export hands over the live parameters: hashing them must not pin their storage."""
    from unirl_ray.train.backend.offload import StorageOffloader

    layer = torch.nn.Linear(4, 3)
    before = state_checksum(dict(layer.named_parameters()))
    offloader = StorageOffloader(torch.device("cpu"))
    assert offloader.offload(list(layer.parameters())) > 0
    offloader.onload()
    assert state_checksum(dict(layer.named_parameters())) == before


def test_staged_weights_pickle_out_of_band_from_the_live_memory_and_leave_it_resizable():
    """What ``stage_weights`` puts in the object store: each tensor one out-of-band buffer read in place
    (protocol 5, as Ray serialises), rebuilt over the received bytes with names, dtypes and shapes intact;
    the live parameter's storage can still be freed afterwards (colocated layouts do)."""
    import pickle

    from unirl_ray.rollout.weight_sync import _BufferTensor

    live = torch.nn.Parameter(torch.randn(4, 3))
    state = {"w": live, "b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "s": torch.tensor(2.5),
             "e": torch.empty(0, 3), "t": torch.randn(3, 5).t()}
    buffers = []
    data = pickle.dumps({k: _BufferTensor(v) for k, v in state.items()}, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(state) and len(data) < 1024  # the bytes travel out of band, not in the pickle
    got = pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v.detach()), k
    assert state_checksum(got) == state_checksum(state)
    in_band = pickle.loads(pickle.dumps({"w": _BufferTensor(live)}, protocol=4))
    assert torch.equal(in_band["w"], live.detach())
    live.data.untyped_storage().resize_(0)  # not pinned by the export
