"""FSDPBackend on 2 gloo ranks: every FSDPConfig mode trains like the unsharded single process,
and the EMA switches work on DTensor shards."""

import torch

from _dist import DIM, full, full_params, make_backend, run_ranks, train
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig, FSDPConfig

MODES = {
    "full": FSDPConfig(),
    "full_ac_no_reshard": FSDPConfig(activation_checkpointing=True, reshard_after_forward=False),
    "hybrid_shard2": FSDPConfig(fsdp_mode="hybrid", hsdp_shard_size=2),
    "hybrid_shard1": FSDPConfig(fsdp_mode="hybrid", hsdp_shard_size=1),
    "no_shard": FSDPConfig(fsdp_mode="no_shard"),
    "cpu_offload": FSDPConfig(cpu_offload=True),
}
STEPS = 3


def shadow_of(name):
    head, _, leaf = name.rpartition(".")
    return f"{head}.shadow_{leaf}"


def _modes_rank():
    out = {}
    for name, cfg in MODES.items():
        backend = make_backend(fsdp_cfg=cfg)
        train(backend, STEPS)
        weight = backend.module.blocks[0].to_q.weight
        out[name] = {
            "params": full_params(backend),
            "local_rows": weight.to_local().shape[0],
            "mesh": tuple(weight.device_mesh.shape),
        }
    try:
        make_backend(fsdp_cfg=FSDPConfig(fsdp_mode="hybrid", hsdp_shard_size=3))
    except ValueError as exc:
        out["bad_shard_size"] = str(exc)
    return out


def test_every_mode_matches_the_unsharded_reference():
    reference = make_backend()
    train(reference, STEPS)
    expected = {n: p.detach() for n, p in reference.module.named_parameters()}
    initial = make_backend()
    ranks = run_ranks(_modes_rank)
    # rows of the 5x5 weight held by each rank: sharded 3/2 (FSDP2 chunks dim 0), replicated 5/5
    layout = {"full": (3, 2), "full_ac_no_reshard": (3, 2), "hybrid_shard2": (3, 2), "hybrid_shard1": (5, 5),
              "no_shard": (5, 5), "cpu_offload": (3, 2)}
    meshes = {"full": (2,), "full_ac_no_reshard": (2,), "hybrid_shard2": (1, 2), "hybrid_shard1": (2, 1),
              "no_shard": (2, 1), "cpu_offload": (2,)}
    for name in MODES:
        assert tuple(r[name]["local_rows"] for r in ranks) == layout[name], name
        assert ranks[0][name]["mesh"] == meshes[name], name
        for r in ranks:
            for pname, value in r[name]["params"].items():
                torch.testing.assert_close(value, expected[pname], rtol=1e-5, atol=1e-6, msg=f"{name} {pname}")
    moved = expected["blocks.0.to_q.weight"] - initial.module.blocks[0].to_q.weight.detach()
    assert moved.abs().max() > 1e-3  # the steps did train
    for r in ranks:
        assert "hsdp_shard_size=3 does not divide the world size 2" in r["bad_shard_size"]


def _ema_rank():
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))
    out = {}
    backend = make_backend(ema_full_cfg=EmaFullConfig(target_decay=0.5, decay_warmup=False))
    train(backend, STEPS)
    mirror = backend.mirror_ema
    param = backend.module.blocks[0].to_q.weight
    shadow = mirror.shadow["blocks.0.to_q.shadow_weight"]
    out["same_layout"] = (shadow.placements == param.placements and shadow.to_local().shape == param.to_local().shape)
    out["shadow"] = {k: full(v) for k, v in mirror.shadow.items()}
    before = {n: p.to_local().clone() for n, p in backend.module.named_parameters()}
    with torch.no_grad():
        out["live_out"] = backend.module(x)
        with backend.ema_weights() as module:
            out["ema_params"] = full_params(backend)
            out["ema_out"] = module(x)
            out["exported"] = backend.full_trainable_state_dict()
        out["back_out"] = backend.module(x)
    out["restored_bitwise"] = all(torch.equal(p.to_local(), before[n]) for n, p in backend.module.named_parameters())

    nft = make_backend(ema_lora_cfg=EmaLoraConfig(rank=2, alpha=2, target_modules=["to_q"], init_lora_weights="gaussian",
                                                  ema_decay_type="constant", ema_decay=0.5))
    train(nft, 2)
    nft.update_ema(timing="rollout_end")
    out["nft_params"] = full_params(nft)
    with torch.no_grad():
        out["nft_out"] = nft.module(x)
        with nft.shadow_policy() as module:
            out["nft_old_out"] = module(x)
        out["nft_back_out"] = nft.module(x)
    out["nft_trainable"] = sorted(n for n, p in nft.module.named_parameters() if p.requires_grad)
    return out


def test_ema_switches_on_dtensor_shards_match_the_unsharded_run():
    ref = make_backend(ema_full_cfg=EmaFullConfig(target_decay=0.5, decay_warmup=False))
    train(ref, STEPS)
    nft_ref = make_backend(ema_lora_cfg=EmaLoraConfig(rank=2, alpha=2, target_modules=["to_q"], init_lora_weights="gaussian",
                                                      ema_decay_type="constant", ema_decay=0.5))
    train(nft_ref, 2)
    nft_ref.update_ema(timing="rollout_end")
    ranks = run_ranks(_ema_rank)
    for r in ranks:
        assert r["same_layout"]
        assert r["restored_bitwise"]
        for name, value in ref.mirror_ema.shadow.items():
            torch.testing.assert_close(r["shadow"][name], value, rtol=1e-5, atol=1e-6)
        for name, value in r["ema_params"].items():  # inside: the live weights are the shadows
            assert torch.equal(value, r["shadow"][shadow_of(name)])
        assert not torch.allclose(r["ema_out"], r["live_out"])
        assert torch.equal(r["back_out"], r["live_out"])
        torch.testing.assert_close(r["nft_params"], {n: p.detach() for n, p in nft_ref.module.named_parameters()},
                                   rtol=1e-5, atol=1e-6)
        assert not torch.allclose(r["nft_old_out"], r["nft_out"])
        assert torch.equal(r["nft_back_out"], r["nft_out"])
        assert r["nft_trainable"] == sorted(n for n, p in nft_ref.module.named_parameters() if p.requires_grad)
    assert ranks[0]["exported"].keys() == {n for n, p in ref.module.named_parameters()}
    for name, value in ranks[0]["exported"].items():
        assert torch.equal(value, ranks[0]["shadow"][shadow_of(name)])
    assert ranks[1]["exported"] == {}
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), ref.ema_weights() as module:
        torch.testing.assert_close(ranks[0]["ema_out"], module(x))


def _sampling_rank():
    """Forwards inside ``sampling()`` after each of two optimizer steps: without FSDP2's hooks (gathered
    once), on the weights of that step; with gradients on, the hooked path; every hook back after."""
    backend = make_backend()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))
    sharded = [m for m in backend.module.modules() if hasattr(m, "unshard")]
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in sharded]
    out = {"outputs": [], "fast": [], "plain_params_inside": []}
    for step in range(2):
        train(backend, 1, start=step)
        with torch.no_grad(), backend.sampling() as module:
            inside = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in sharded]  # FSDP2's pair set aside,
            out["fast"].append(inside == [(a - 1, b - 1) for a, b in hooks_before])  # the backend's own guard kept
            out["plain_params_inside"].append(all(type(p) is torch.nn.Parameter for p in module.parameters()))
            out["outputs"].append(module(x).detach().clone())
        out[f"params_{step}"] = full_params(backend)
    with backend.sampling() as module:  # gradients on: FSDP2's hooks stay (a backward must reach the shards)
        out["hooked_with_grad"] = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in sharded] == hooks_before
    out["hooks_after"] = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in sharded] == hooks_before
    out["sharded_after"] = all(type(p).__name__ == "DTensor" for p in backend.module.parameters())
    return out


def test_sampling_runs_plain_forwards_on_the_current_weights_and_restores_the_hooks():
    """The gathered, hook-free forwards of ``sampling()`` give exactly what the unsharded module with the
    same weights gives, after every optimizer step (never a stale gather), on both ranks."""
    for r in run_ranks(_sampling_rank):
        assert r["fast"] == [True, True] and r["plain_params_inside"] == [True, True]
        assert r["hooked_with_grad"] and r["hooks_after"] and r["sharded_after"]
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))
        for step in range(2):
            reference = make_backend().module  # unsharded (no process group here), loaded with that step's weights
            reference.load_state_dict(r[f"params_{step}"])
            with torch.no_grad():
                torch.testing.assert_close(r["outputs"][step], reference(x), rtol=1e-6, atol=1e-6)
        assert not torch.equal(r["outputs"][0], r["outputs"][1])  # the second step's weights were used
