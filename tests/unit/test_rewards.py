"""Rule rewards, reward config validation, scoring and weighting (no Ray)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from unirl_ray.rewards import (
    RewardConfig,
    RewardError,
    RewardFnSpec,
    brightness,
    combine,
    jpeg_compressibility,
    jpeg_incompressibility,
    make_target_color,
    reward_metrics,
    score_batch,
    target_color,
)


def _flat(value: int, size: int = 32) -> np.ndarray:
    return np.full((size, size, 3), value, dtype=np.uint8)


def _noise(seed: int = 0, size: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def test_brightness_by_hand():
    white, black, grey = _flat(255), _flat(0), _flat(51)
    assert brightness(images=[white, black, grey], prompts=["a", "b", "c"]) == pytest.approx([1.0, 0.0, 0.2])


def test_frames_are_averaged():
    video = np.stack([_flat(0), _flat(255)])  # [F=2, H, W, 3]
    assert brightness(images=[video], prompts=["v"]) == pytest.approx([0.5])
    flat_video = np.stack([_flat(10), _flat(10)])
    assert jpeg_compressibility(images=[flat_video], prompts=["v"]) == pytest.approx(
        jpeg_compressibility(images=[_flat(10)], prompts=["i"])
    )


def test_jpeg_noise_is_less_compressible_than_flat():
    flat, noisy = _flat(128), _noise()
    comp = jpeg_compressibility(images=[flat, noisy], prompts=["", ""])
    incomp = jpeg_incompressibility(images=[flat, noisy], prompts=["", ""])
    assert comp[0] > comp[1]
    assert all(c < 0 for c in comp)
    assert incomp == pytest.approx([-c for c in comp])


def test_target_color():
    red, blue = np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.uint8)
    red[..., 0], blue[..., 2] = 255, 255
    assert target_color(images=[red], prompts=[""]) == pytest.approx([1.0])
    r_vs_b = target_color(images=[red, blue], prompts=["", ""], rgb=(0, 0, 255))
    assert r_vs_b[1] == pytest.approx(1.0) and r_vs_b[0] < 0.7
    assert make_target_color((0, 0, 255))(images=[blue], prompts=[""]) == pytest.approx([1.0])
    white_to_black = target_color(images=[_flat(255)], prompts=[""], rgb=(0, 0, 0))
    assert white_to_black == pytest.approx([0.0], abs=1e-6)
    with pytest.raises(ValueError, match="three numbers"):
        target_color(images=[red], prompts=[""], rgb=(300, 0, 0))


def test_bad_image_shapes_and_dtypes():
    with pytest.raises(ValueError, match="uint8"):
        brightness(images=[np.zeros((4, 4, 3), np.float32)], prompts=[""])
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        brightness(images=[np.zeros((4, 4), np.uint8)], prompts=[""])


def test_combine_weights_and_none():
    per_source = {"a": [1.0, 2.0, None, 4.0], "b": [10.0, None, 1.0, 0.0], "log_only": [None, None, None, 1.0]}
    weights = {"a": 1.0, "b": 0.5, "log_only": 0.0}
    assert combine(per_source, weights) == [6.0, None, None, 4.0]
    with pytest.raises(ValueError, match="no scores for weighted"):
        combine({"a": [1.0]}, {"a": 1.0, "b": 2.0})


def test_score_batch_nan_to_none_and_stacked_images():
    def nan_odd(*, images, prompts, **columns):
        return [float("nan") if i % 2 else 1.0 for i in range(len(prompts))]

    def inf_and_numpy(*, images, prompts, **columns):
        return np.array([np.inf, 2.0, -np.inf])

    stacked = np.stack([_flat(0), _flat(255), _flat(51)])
    out = score_batch({"nan": nan_odd, "inf": inf_and_numpy, "b": brightness}, stacked, ["x", "y", "z"], {})
    assert out["nan"] == [1.0, None, 1.0]
    assert out["inf"] == [None, 2.0, None]
    assert out["b"] == pytest.approx([0.0, 1.0, 0.2])


def test_columns_reach_reward_fns():
    def uses_answer(*, images, prompts, answer, **columns):
        return [float(p == a) for p, a in zip(prompts, answer)]

    out = score_batch({"match": uses_answer}, [None, None], ["cat", "dog"], {"answer": ["cat", "cow"]})
    assert out["match"] == [1.0, 0.0]


def test_wrong_length_names_reward_and_lengths():
    def short(*, images, prompts, **columns):
        return [1.0]

    with pytest.raises(RewardError, match=r"'short'.*1 scores for 3 samples") as info:
        score_batch({"short": short}, [_flat(0)] * 3, ["a", "b", "c"], {})
    assert info.value.reward == "short"


def test_exception_and_non_numeric_name_the_reward():
    def boom(*, images, prompts, **columns):
        raise KeyError("missing thing")

    def words(*, images, prompts, **columns):
        return ["high"] * len(prompts)

    with pytest.raises(RewardError, match=r"'boom'.*KeyError.*missing thing"):
        score_batch({"boom": boom}, [None], ["a"], {})
    with pytest.raises(RewardError, match=r"'words'.*non-numeric"):
        score_batch({"words": words}, [None], ["a"], {})

    def numeric_strings(*, images, prompts, **columns):  # float("0.75") accepted these before
        return ["0.75"] * len(prompts)

    with pytest.raises(RewardError, match=r"'parsed'.*non-numeric score \(got the string '0.75'\)"):
        score_batch({"parsed": numeric_strings}, [None], ["a"], {})


def test_config_bad_import_path_suggests_close_match():
    with pytest.raises(ValueError, match=r"'bright'.*did you mean 'unirl_ray.rewards.image.brightness'"):
        RewardConfig(rewards={"bright": {"fn": "unirl_ray.rewards.image.brightnes"}})
    with pytest.raises(ValueError, match=r"did you mean 'unirl_ray.rewards.image'"):
        RewardConfig(rewards={"b": {"fn": "unirl_ray.rewards.imag.brightness"}})
    with pytest.raises(ValueError, match="no_such_pkg"):
        RewardConfig(rewards={"b": {"fn": "no_such_pkg.fn"}})


def test_config_validation():
    with pytest.raises(ValueError, match="at least one"):
        RewardConfig(rewards={})
    with pytest.raises(ValueError, match="finite"):
        RewardConfig(rewards={"b": {"fn": "unirl_ray.rewards.image.brightness", "weight": float("inf")}})
    with pytest.raises(ValueError, match="did you mean 'weight'"):
        RewardConfig(rewards={"b": {"fn": "unirl_ray.rewards.image.brightness", "wieght": 1.0}})
    with pytest.raises(ValueError, match="on_error"):
        RewardConfig(rewards={"b": {"fn": "unirl_ray.rewards.image.brightness"}}, on_error="ignore")
    with pytest.raises(ValueError, match="did you mean 'timeout_s'"):
        RewardConfig.from_dict({"rewards": {"b": {"fn": "unirl_ray.rewards.image.brightness"}}, "timeout": 3})


def test_config_specs_kwargs_and_round_trip():
    cfg = RewardConfig.from_dict({
        "rewards": {
            "blue": {"fn": "unirl_ray.rewards.image:target_color", "weight": 2, "kwargs": {"rgb": [0, 0, 255]}},
            "b": {"fn": brightness, "weight": 0.0},
        },
        "on_error": "skip",
    })
    assert cfg.weights == {"blue": 2.0, "b": 0.0}
    assert cfg.ray_actor_options == {"num_cpus": 0.25}
    blue = np.zeros((4, 4, 3), np.uint8)
    blue[..., 2] = 255
    fns = {s.name: s.bound() for s in cfg.specs}
    assert score_batch(fns, [blue], ["x"], {})["blue"] == pytest.approx([1.0])
    assert RewardConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert isinstance(cfg.specs[0], RewardFnSpec)


def test_reward_metrics():
    m = reward_metrics({"a": [1.0, 3.0, None]}, [1.0, 3.0, None])
    assert m["reward/a/mean"] == 2.0 and m["reward/a/std"] == 1.0
    assert m["reward/mean"] == 2.0 and m["reward/invalid_frac"] == pytest.approx(1 / 3)
    assert math.isnan(reward_metrics({"a": [None]}, [None])["reward/mean"])


def test_rewards_package_does_not_import_ray():
    code = "import sys, unirl_ray.rewards; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_sources_with_their_own_app_are_placed_apart():
    cfg = RewardConfig.from_dict({
        "rewards": {
            "bright": {"fn": "unirl_ray.rewards.image.brightness"},
            "jpeg": {"fn": "unirl_ray.rewards.image.jpeg_compressibility", "weight": 0.5,
                     "app": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.25}}},
        },
        "num_replicas": 3,
        "ray_actor_options": {"num_cpus": 0.5},
        "timeout_s": 7.0,
    })
    (s0, shared), (s1, own) = cfg.placements()
    assert (s0, s1) == ("", "-jpeg")
    assert [s.name for s in shared.specs] == ["bright"] and shared.num_replicas == 3
    assert [s.name for s in own.specs] == ["jpeg"] and own.num_replicas == 2 and own.timeout_s == 7.0
    assert own.ray_actor_options == {"num_cpus": 1, "num_gpus": 0.25} and own.weights == {"jpeg": 0.5}
    assert cfg.weights == {"bright": 1.0, "jpeg": 0.5}  # combined on the driver over all apps
    assert cfg.resources() == {"CPU": 2 * 1, "GPU": 0.5}  # the rule source runs locally: no replica
    assert RewardConfig.from_dict({**cfg.to_dict(), "placement": "serve"}).resources() == {"CPU": 3 * 0.5 + 2 * 1, "GPU": 0.5}
    with pytest.raises(ValueError, match="unknown app key 'num_replica'.*did you mean 'num_replicas'"):
        RewardConfig.from_dict({"rewards": {"b": {"fn": "unirl_ray.rewards.image.brightness",
                                                  "app": {"num_replica": 2}}}})
    with pytest.raises(ValueError, match="num_replicas must be an int >= 1"):
        RewardConfig.from_dict({"rewards": {"b": {"fn": "unirl_ray.rewards.image.brightness",
                                                  "app": {"num_replicas": 0}}}})
    only_own = RewardConfig.from_dict({"rewards": {"b": {"fn": "unirl_ray.rewards.image.brightness", "app": {}}}})
    assert [suffix for suffix, _ in only_own.placements()] == ["-b"]


# a reward that hangs until released: every call past its deadline keeps a thread
_HANG = __import__("threading").Event()


def _hangs(*, images, prompts, **columns):
    _HANG.wait(60)
    return [1.0] * len(prompts)


def test_a_hanging_reward_never_starves_the_healthy_ones():
    """With ``on_error: skip`` a hung source's timed-out calls kept their threads of one shared pool; once
    it was full, healthy sources timed out too and every sample turned invalid. Each source now has its
    own threads, and a source whose threads are all stuck is not started again (named in the error)."""
    import asyncio

    from unirl_ray.rewards.service import RewardService

    config = RewardConfig(rewards={"bright": {"fn": "unirl_ray.rewards.image.brightness"}, "hang": {"fn": _hangs}},
                          on_error="skip", timeout_s=0.2, max_ongoing_requests=1).to_dict()
    service = RewardService(config)
    images = [np.full((4, 4, 3), 255, np.uint8)]

    async def calls(n):
        return [await service.score_detailed(images, ["p"]) for _ in range(n)]

    try:
        results = asyncio.run(calls(6))
    finally:
        _HANG.set()
    assert all(r["scores"]["bright"] == [pytest.approx(1.0)] for r in results)  # never starved
    assert "did not finish within timeout_s=0.2 s" in results[0]["errors"]["hang"]
    assert all("still running past timeout_s" in r["errors"]["hang"] for r in results[1:])


def _slow(*, images, prompts, **columns):
    __import__("time").sleep(1.0)
    return [1.0] * len(prompts)


def test_rule_rewards_run_in_the_clients_process_with_the_replicas_policy():
    """``placement: auto`` runs function sources (rule rewards) in the client's process: no Ray, no Serve, the
    same deadlines, retries and ``on_error`` as a replica; a class source (a model) goes to Serve; the client
    pickles (into an async trainer's rollout stage) and builds its sources again where it lands."""
    import pickle

    from unirl_ray.rewards import RewardClient, RewardError
    from unirl_ray.rewards.service import LocalRewardHandle

    rules = {"bright": {"fn": "unirl_ray.rewards.image.brightness"}, "slow": {"fn": _slow, "weight": 0.0}}
    assert RewardConfig.from_dict({"rewards": rules}).shared_runs_locally()
    assert not RewardConfig.from_dict({"rewards": rules, "placement": "serve"}).shared_runs_locally()
    model = {"rm": {"fn": "unirl_ray.rewards.model.SequenceClassifierReward", "kwargs": {"tiny": True}}}
    assert not RewardConfig.from_dict({"rewards": {**rules, **model}}).shared_runs_locally()  # a class: Serve
    assert RewardConfig.from_dict({"rewards": {**rules, **model}, "placement": "local"}).shared_runs_locally()
    with pytest.raises(ValueError, match="placement"):
        RewardConfig.from_dict({"rewards": rules, "placement": "driver"})

    images = np.stack([_flat(0), _flat(255)])
    client = RewardClient.deploy({"rewards": rules, "timeout_s": 0.3, "max_retries": 0, "on_error": "skip"}, app_name="r")
    try:
        assert [(a.name, a.local) for a in client.apps] == [("r", True)] and client.app_names() == []
        assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
        scores, retries, skipped = client.score_inputs(images, ["a", "b"])
        assert scores["bright"] == [pytest.approx(0.0), pytest.approx(1.0)]
        assert scores["slow"] == [None, None] and (retries, skipped) == (0, 1)  # past its deadline: skipped
        copy = pickle.loads(pickle.dumps(client))
        assert isinstance(copy.apps[0].handle, LocalRewardHandle) and copy.apps[0].handle is not client.apps[0].handle
        assert copy.score_inputs(images, ["a", "b"])[0]["bright"] == scores["bright"]
        copy.shutdown()
    finally:
        client.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        client.score_inputs(images, ["a", "b"])
    strict = RewardClient.deploy({"rewards": rules, "timeout_s": 0.3, "max_retries": 1}, app_name="r")
    try:
        with pytest.raises(RewardError, match=r"'slow' failed: did not finish within timeout_s=0.3 s \(after 2 attempt"):
            strict.score_inputs(images, ["a", "b"])
    finally:
        strict.shutdown()


def test_http_requests_the_reward_app_cannot_score_get_400_with_the_reason():
    """The reward app's HTTP route: a count mismatch or a bad image gave a bare 500 and an empty body a 200
    with nothing scored; each now gets 400 and a reason, and a ``data:`` URL image is read."""
    import asyncio
    import base64
    import io
    import json
    import re

    from PIL import Image

    from unirl_ray.rewards.service import RewardService

    class Request:
        def __init__(self, body):
            self.body = body

        async def json(self):
            if isinstance(self.body, bytes):
                return json.loads(self.body)
            return self.body

    png = io.BytesIO()
    Image.fromarray(_flat(255, 8)).save(png, format="PNG")
    b64 = base64.b64encode(png.getvalue()).decode()
    service = RewardService({"rewards": {"bright": {"fn": "unirl_ray.rewards.image.brightness"}}})

    def call(body):
        return asyncio.run(service(Request(body)))

    ok = call({"prompts": ["a", "b"], "images": [b64, f"data:image/png;base64,{b64}"]})
    assert ok["errors"] == {} and ok["reward"] == [pytest.approx(1.0), pytest.approx(1.0)]
    bad = {
        b"{not json": "the body is not JSON",
        b"[1, 2]": "the body is a JSON list, not an object",
        b"{}": "'prompts' must be a non-empty list of strings, got None",
        json.dumps({"prompts": []}).encode(): "'prompts' must be a non-empty list of strings, got \\[\\]",
        json.dumps({"prompts": ["a"], "image": [b64]}).encode(): "unknown field\\(s\\) \\['image'\\]",
        json.dumps({"prompts": ["a", "b"], "images": [b64]}).encode(): "got 1 images for 2 prompts",
        json.dumps({"prompts": ["a"], "images": ["%%%"]}).encode(): "image 0 is not valid base64",
        json.dumps({"prompts": ["a"], "images": [base64.b64encode(b"text").decode()]}).encode(): "image 0 is not a PNG/JPEG",
        json.dumps({"prompts": ["a"], "images": ["data:image/png," + b64]}).encode(): "data URL without ';base64,'",
        json.dumps({"prompts": ["a"], "columns": {"answer": [1, 2]}}).encode(): "column 'answer' must be a list with one value",
    }
    for body, reason in bad.items():
        response = call(body)
        assert response.status_code == 400, body
        assert re.search(reason, json.loads(response.body)["error"]), (body, response.body)
