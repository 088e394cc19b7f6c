"""save()/load(): an exact resume (weights, optimizer, EMA shadows, per-rank RNG, schedule) on
1 and 2 FSDP2 gloo ranks (one rank writes without DCP's plan exchange; one unwrapped float32 rank is resumed
by the end-to-end tests), also from a save_async whose ranks train on while it writes, and a 2-rank
checkpoint continued on 1 rank and a 1-rank one on 2 (DCP resharding)."""

import json
import logging
import threading

import pytest
import torch

from _dist import backward, full, full_params, make_backend, rank_world, run_ranks
from unirl_ray.train.backend.wrap import local
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig, LrSchedulerConfig

K, N = 2, 4  # save after K optimizer steps, compare after N


def _configs():
    return dict(
        ema_lora_cfg=EmaLoraConfig(rank=2, alpha=2, target_modules=["to_q"], init_lora_weights="gaussian",
                                   ema_decay_type="constant", ema_decay=0.5, timing="optimizer_step"),
        ema_full_cfg=EmaFullConfig(target_decay=0.8, timing="rollout_end"),
        lr_scheduler_cfg=LrSchedulerConfig(kind="cosine", warmup_steps=1, total_steps=6, min_lr_ratio=0.1),
    )


def _run(backend, start, stop, *, noise):
    """Train steps start..stop-1, each followed by the per-step (rollout_end) EMA update, as TrainStack does."""
    for step in range(start, stop):
        backward(backend, step, noise=noise)
        backend.optimizer_step(max_grad_norm=1.0)
        backend.update_ema(timing="rollout_end")


def _state(backend):
    """Everything that must match after an exact resume (this rank's local shards)."""
    out = {f"param.{n}": local(p).clone() for n, p in backend.module.named_parameters()}
    names = {id(p): n for n, p in backend.module.named_parameters()}
    for p, state in backend.optimizer.state.items():
        out.update({f"optim.{names[id(p)]}.{k}": local(v).clone() for k, v in state.items()})
    out.update({f"ema.{k}": local(v).clone() for k, v in backend.mirror_ema.shadow.items()})
    out["lr"] = torch.tensor([g["lr"] for g in backend.optimizer.param_groups], dtype=torch.float64)
    out["counters"] = torch.tensor([backend.optimizer_steps, backend.scheduler.last_epoch,
                                    backend.adapter_ema.updates, backend.mirror_ema.updates])
    out["rng"] = torch.get_rng_state()
    return out


def _force_fsdp2():
    """Wrap with FSDP2 on one rank too (a float32 rank alone runs unwrapped): its state dicts hold DTensors."""
    from unirl_ray.train.backend.fsdp import FSDPBackend

    FSDPBackend._shards = lambda self: self._distributed


def _exact_resume_rank(directory, asynchronous=False, wrap=False):
    if wrap:
        _force_fsdp2()
    rank, _ = rank_world()
    straight = make_backend(**_configs())
    torch.manual_seed(100 + rank)  # distinct per-rank RNG streams: each rank must get its own back
    _run(straight, 0, N, noise=True)

    first = make_backend(**_configs())
    torch.manual_seed(100 + rank)
    _run(first, 0, K, noise=True)
    if asynchronous:  # the shards are copied when save_async returns: training on at once changes nothing saved
        meta, write = first.save_async(directory)
        rng_at_save = torch.get_rng_state()
        _run(first, K, N + 2, noise=True)
        from unirl_ray.train.backend.dcp_io import checkpoint_group
        checkpoint_group()  # made collectively, as the rank's save command does before its thread writes
        thread = threading.Thread(target=write)
        thread.start()
        _run(first, N + 2, N + 4, noise=True)  # and while the thread writes (on the checkpoint group)
        thread.join(120)
        torch.set_rng_state(rng_at_save)
    else:
        meta = first.save(directory)
        rng_at_save = torch.get_rng_state()
    meta = json.loads(json.dumps(meta))  # the meta travels as JSON
    del first

    resumed = make_backend(**_configs())  # setup reseeds: the RNG differs until load
    rng_differed = not torch.equal(torch.get_rng_state(), rng_at_save)
    resumed.load(directory, meta)
    rng_restored = torch.equal(torch.get_rng_state(), rng_at_save)
    _run(resumed, K, N, noise=True)

    a, b = _state(straight), _state(resumed)
    mismatched = sorted(k for k in a if not torch.equal(a[k], b[k]))
    return {"keys_equal": a.keys() == b.keys(), "mismatched": mismatched, "rng_differed": rng_differed,
            "rng_restored": rng_restored, "n_compared": len(a)}


@pytest.mark.parametrize("world_size", [1, 2], ids=["1rank-fsdp2", "2ranks"])  # (1 unwrapped rank: e2e tests)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "save_async"])
def test_exact_resume_is_bit_identical(tmp_path, asynchronous, world_size):
    for result in run_ranks(_exact_resume_rank, str(tmp_path / "ck"), asynchronous, True, world_size=world_size):
        assert result["keys_equal"] and result["n_compared"] > 20
        assert result["mismatched"] == []
        assert result["rng_differed"] and result["rng_restored"]


def _save_and_continue(directory, wrap=False):
    if wrap:
        _force_fsdp2()
    backend = make_backend(**_configs())
    _run(backend, 0, K, noise=False)
    meta = backend.save(directory)
    _run(backend, K, N, noise=False)
    shadows = {k: full(v) for k, v in backend.mirror_ema.shadow.items()}
    return {"meta": meta, "params": full_params(backend), "shadows": shadows}


def test_two_rank_checkpoint_continues_on_one_rank(tmp_path):
    directory = str(tmp_path / "ck")
    ranks = run_ranks(_save_and_continue, directory)
    assert ranks[0]["meta"]["world_size"] == 2
    one = make_backend(**_configs())  # no process group: the unsharded module loads the 2-rank shards
    one.load(directory, ranks[0]["meta"])
    _run(one, K, N, noise=False)
    # Not bit-identical: with 2 ranks each rank reduces over its half of the batch and FSDP2
    # averages the two partial gradients (and clips with a norm summed from two shard norms);
    # one rank sums the whole batch in a different order. Float addition is not associative, so
    # the results agree to fp32 rounding, not bit for bit.
    for name, value in full_params(one).items():
        torch.testing.assert_close(value, ranks[0]["params"][name], rtol=1e-5, atol=1e-6, msg=name)
    for name, value in one.mirror_ema.shadow.items():
        torch.testing.assert_close(value, ranks[0]["shadows"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert one.optimizer_steps == N and one.adapter_ema.updates == N and one.mirror_ema.updates == N


def _load_and_continue(directory, meta):
    backend = make_backend(**_configs())
    backend.load(directory, meta)
    _run(backend, K, N, noise=False)
    return {"params": full_params(backend), "shadows": {k: full(v) for k, v in backend.mirror_ema.shadow.items()},
            "counters": (backend.optimizer_steps, backend.adapter_ema.updates, backend.mirror_ema.updates)}


def test_one_rank_checkpoint_continues_on_two_ranks(tmp_path):
    """A checkpoint of a process group of one (written without DCP's plan exchange, here of an FSDP2-wrapped
    module: DTensors) is a DCP checkpoint like any other: two ranks load their shards of it."""
    directory = str(tmp_path / "ck")
    one = run_ranks(_save_and_continue, directory, True, world_size=1)[0]
    assert one["meta"]["world_size"] == 1
    for rank in run_ranks(_load_and_continue, directory, json.loads(json.dumps(one["meta"]))):
        for name, value in rank["params"].items():  # fp32 rounding apart, as above
            torch.testing.assert_close(value, one["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        for name, value in rank["shadows"].items():
            torch.testing.assert_close(value, one["shadows"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert rank["counters"] == (N, N, N)


def test_checkpoint_without_ema_restarts_the_ema_from_loaded_weights(tmp_path, caplog):
    plain = make_backend(lr_scheduler_cfg=_configs()["lr_scheduler_cfg"])
    _run(plain, 0, K, noise=False)
    meta = plain.save(str(tmp_path / "ck"))
    with_ema = make_backend(ema_full_cfg=EmaFullConfig(), lr_scheduler_cfg=_configs()["lr_scheduler_cfg"])
    with caplog.at_level(logging.WARNING):
        with_ema.load(str(tmp_path / "ck"), meta)
    assert "no full EMA shadow" in caplog.text
    assert with_ema.mirror_ema.updates == 0
    for name, p in plain.module.named_parameters():
        head, _, leaf = name.rpartition(".")
        assert torch.equal(with_ema.mirror_ema.shadow[f"{head}.shadow_{leaf}"], p.detach())
    assert [g["lr"] for g in with_ema.optimizer.param_groups] == [g["lr"] for g in plain.optimizer.param_groups]


def test_a_single_process_save_does_not_warn_that_it_is_single_process(tmp_path):
    import warnings

    from unirl_ray.train.backend import dcp_io

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp_io.quiet_single_process_warning()  # (as on import; pytest resets the filters per test)
        dcp_io.save({"w": torch.ones(3)}, str(tmp_path / "ck"))
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]  # only DCP's single-process one is hidden

