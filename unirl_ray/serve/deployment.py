"""The policy app on Ray Serve: ``PolicyServer`` (one policy per replica, text or image, behind the OpenAI routes of
``openai_api``) and ``build_policy_app``, its builder (``serve_apps/policy_app.py`` wraps it for deploy files)."""

from __future__ import annotations

from typing import Any

from ray import serve

from unirl_ray.serve import openai_api, resolve_model_source

api = openai_api.make_app()


@serve.deployment(name="PolicyServer")
@serve.ingress(api)
class PolicyServer:
    """Loads the model once per replica; the routes are ``openai_api``'s."""

    def __init__(self, source: str, name: str | None = None, api_key: str | None = None,
                 torch_dtype: str = "float32", tracking_uri: str | None = None,
                 default_max_tokens: int = openai_api.DEFAULT_MAX_TOKENS) -> None:
        folder = resolve_model_source(source, tracking_uri=tracking_uri)
        openai_api._PROCESS.update(policy=openai_api.load_policy(folder, name=name, torch_dtype=torch_dtype),
                                   api_key=api_key, default_max_tokens=default_max_tokens)


def build_policy_app(source: str, *, name: str | None = None, api_key: str | None = None, num_replicas: int = 1,
                     ray_actor_options: dict[str, Any] | None = None, torch_dtype: str = "float32",
                     tracking_uri: str | None = None, max_ongoing_requests: int = 8) -> Any:
    """The bound Serve application serving ``source`` (see ``resolve_model_source``) as model ``name`` (default:
    the folder's name, or the registered model's name for ``models:/<name>/<version>``)."""
    if name is None and source.startswith("models:/"):
        name = source[len("models:/"):].split("/")[0] or None
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    options = {"num_cpus": 1, **(ray_actor_options or {})}
    return PolicyServer.options(num_replicas=num_replicas, ray_actor_options=options,
                                max_ongoing_requests=max_ongoing_requests).bind(
        source, name=name, api_key=api_key, torch_dtype=torch_dtype, tracking_uri=tracking_uri)
