"""Samples cross several processes per step; their parts pickle CPU tensors as numpy arrays."""

import pickle

import numpy as np
import pytest
import ray.cloudpickle
import torch

from unirl_ray.core.sample import DiffusionPart, Part, Sample, TextPart


def roundtrip(obj):
    return pickle.loads(ray.cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert b.dtype == a.dtype and b.shape == a.shape and b.device.type == "cpu"
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_every_dtype_round_trips_bit_exact(dtype):
    values = torch.randn(3, 5) * 100
    tensor = values.to(dtype) if dtype != torch.complex64 else torch.complex(values, -values)
    part = DiffusionPart(latents=tensor, log_probs=tensor[0])
    back = roundtrip(part)
    assert_same(tensor, back.latents)
    assert_same(tensor[0], back.log_probs)


def test_sample_with_text_and_diffusion_parts_keeps_every_field():
    sample = Sample(
        sample_id="s3-1", group_id="g3-0", prompt="a cat", columns={"answer": "4"}, policy_version=7,
        image=np.zeros((4, 4, 3), np.uint8), rewards={"r": 0.5}, reward=0.5, advantage=-1.0,
        parts=[
            DiffusionPart(latents=torch.randn(4, 2, 3, 3), log_probs=torch.randn(3), sigmas=torch.linspace(1, 0, 4),
                          cond={"prompt_embeds": torch.randn(5, 8, dtype=torch.bfloat16), "pooled": torch.randn(8)},
                          advantage=0.25),
            TextPart(prompt_ids=torch.arange(6), completion_ids=torch.arange(4), log_probs=torch.randn(4),
                     loss_mask=torch.tensor([1, 1, 0, 1]), text="abcd", num_tokens=4),
        ],
    )
    back = roundtrip(sample)
    assert (back.sample_id, back.group_id, back.prompt, back.columns, back.policy_version) == \
        ("s3-1", "g3-0", "a cat", {"answer": "4"}, 7)
    assert (back.rewards, back.reward, back.advantage) == ({"r": 0.5}, 0.5, -1.0)
    np.testing.assert_array_equal(back.image, sample.image)
    d, t = back.parts
    assert isinstance(d, DiffusionPart) and isinstance(t, TextPart)
    for name in ("latents", "log_probs", "sigmas"):
        assert_same(getattr(sample.parts[0], name), getattr(d, name))
    assert sorted(d.cond) == ["pooled", "prompt_embeds"]
    for key, value in sample.parts[0].cond.items():
        assert_same(value, d.cond[key])
    assert d.advantage == 0.25 and d.kind == "diffusion"
    for name in ("prompt_ids", "completion_ids", "log_probs", "loss_mask"):
        assert_same(getattr(sample.parts[1], name), getattr(t, name))
    assert (t.text, t.num_tokens, t.kind) == ("abcd", 4, "text")


def test_light_parts_and_views_travel_without_their_storage():
    base = torch.randn(1000, 64)
    view = base[10:12, ::2]  # non-contiguous view of a large storage
    part = TextPart(completion_ids=None, log_probs=view)
    data = ray.cloudpickle.dumps(part)
    assert len(data) < 4 * base.numel() // 10  # only the view's 64 values, not the 64,000 of its storage
    back = pickle.loads(data)
    assert_same(view, back.log_probs)
    light = roundtrip(TextPart(completion_ids=torch.arange(3), text="x").light())
    assert light.is_light and light.num_tokens == 3 and light.log_probs is None


def test_unpickled_tensors_are_writable_and_independent():
    part = DiffusionPart(latents=torch.zeros(2, 2))
    back = roundtrip(part)
    back.latents += 1  # no read-only buffer underneath, no warning turned into an error
    assert torch.equal(part.latents, torch.zeros(2, 2))
    assert torch.equal(back.latents, torch.ones(2, 2))


def test_out_of_band_read_only_buffers_as_ray_hands_them_over():
    big = DiffusionPart(latents=torch.randn(64, 16, 8, 8), cond={"e": torch.randn(77, 32, dtype=torch.bfloat16)})
    buffers: list[pickle.PickleBuffer] = []
    data = ray.cloudpickle.dumps(big, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2 and len(data) < 2000  # the arrays travel out of band (Ray: zero-copy shared memory)
    back = pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers])
    assert_same(big.latents, back.latents)
    assert_same(big.cond["e"], back.cond["e"])
    back.latents.mul_(2)  # writable: copied out of the read-only buffer
    assert torch.equal(back.latents, big.latents * 2)


def test_other_values_and_subclasses_pass_unchanged():
    class Custom(Part):
        pass

    part = Custom(kind="custom", advantage=1.5)
    part.extra = {"nested": [torch.ones(2), "s", 3]}
    back = roundtrip(part)
    assert type(back).__name__ == "Custom" and back.kind == "custom" and back.advantage == 1.5
    assert back.extra["nested"][1:] == ["s", 3]
    assert_same(torch.ones(2), back.extra["nested"][0])


def test_wire_gives_back_state_dicts_and_payload_trees():
    from collections import OrderedDict

    from unirl_ray.core.wire import wire

    state = OrderedDict([("b.weight", torch.randn(4, 3)), ("a.bias", torch.randn(4).to(torch.bfloat16))])
    payload = {"state": state, "checksum": "abc", "ids": (torch.arange(3), [torch.ones(2, dtype=torch.bool), 7]),
               "samples": [Sample(sample_id="s1-0", group_id="g", prompt="p", parts=[TextPart(log_probs=torch.randn(2))])]}
    back = pickle.loads(ray.cloudpickle.dumps(wire(payload), protocol=pickle.HIGHEST_PROTOCOL))
    assert type(back["state"]) is OrderedDict and list(back["state"]) == ["b.weight", "a.bias"]
    for key, value in state.items():
        assert_same(value, back["state"][key])
    assert back["checksum"] == "abc" and isinstance(back["ids"], tuple) and back["ids"][1][1] == 7
    assert_same(payload["ids"][0], back["ids"][0])
    assert_same(payload["ids"][1][0], back["ids"][1][0])
    assert_same(payload["samples"][0].parts[0].log_probs, back["samples"][0].parts[0].log_probs)
    assert pickle.loads(ray.cloudpickle.dumps(wire(3))) == 3 and pickle.loads(ray.cloudpickle.dumps(wire(None))) is None


def test_parameters_and_tensor_subclasses_keep_their_own_pickling():
    from unirl_ray.core.wire import pack_tree

    param = torch.nn.Parameter(torch.randn(2))
    assert pack_tree({"p": param})["p"] is param
    back = pickle.loads(ray.cloudpickle.dumps(DiffusionPart(latents=param)))
    assert isinstance(back.latents, torch.nn.Parameter) and torch.equal(back.latents, param)
