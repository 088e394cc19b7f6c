"""Serve a trained policy: an OpenAI-compatible HTTP API over a causal LM folder.

``python -m unirl_ray.serve SOURCE`` serves ``SOURCE`` (an exported folder, a Hugging Face model folder, or an
MLflow URI: ``models:/<name>/<version>``, ``runs:/<run_id>/<path>``) with Ray Serve on ``127.0.0.1:8000``;
``serve run serve_apps/policy.yaml`` does the same from a deploy file. ``openai_api`` holds the FastAPI app
(usable without Ray), ``deployment`` the Serve deployment and the builder, which serves LLMs with vLLM through
``ray.serve.llm`` where vLLM is installed (``vllm_app``).
"""

from __future__ import annotations

import os


def is_mlflow_uri(source: str) -> bool:
    """Whether ``source`` names an MLflow artifact (``models:/``, ``runs:/``, any ``scheme://``), not a folder."""
    return source.startswith(("models:/", "runs:/")) or "://" in source


def resolve_model_source(source: str, *, tracking_uri: str | None = None, dst_path: str | None = None) -> str:
    """A local folder for ``source``: a folder as is; an MLflow artifact URI (``models:/<name>/<version>``,
    ``runs:/<run_id>/<path>``, any ``scheme://``) downloaded (into ``dst_path``, else a temporary folder) from
    ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``). ``ValueError`` naming the source when it cannot be had."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"model source must be a folder or an MLflow URI such as models:/<name>/<version>, got {source!r}")
    if is_mlflow_uri(source):
        import mlflow
        from mlflow.exceptions import MlflowException

        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        try:
            artifact_uri = source
            if source.startswith("models:/"):  # the registry of that store (MLFLOW_REGISTRY_URI, else the store)
                client = mlflow.MlflowClient(tracking_uri=tracking_uri,
                                             registry_uri=os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri)
                name, _, version = source[len("models:/"):].partition("/")
                if "@" in name and not version:
                    name, _, alias = name.partition("@")
                    version = client.get_model_version_by_alias(name, alias).version
                if not name or not version:
                    raise ValueError(f"{source!r} is not models:/<name>/<version> or models:/<name>@<alias>")
                artifact_uri = client.get_model_version_download_uri(name, version)
            return mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, tracking_uri=tracking_uri,
                                                       dst_path=dst_path)
        except (MlflowException, OSError) as exc:
            where = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "the default MLflow store (./mlruns)"
            raise ValueError(f"could not download {source!r} from {where}: {exc}. Pass --tracking-uri (or set "
                             "MLFLOW_TRACKING_URI) to the store the model was registered in") from None
    folder = os.path.abspath(os.path.expanduser(source))
    if not os.path.isdir(folder):
        raise ValueError(f"model folder {folder!r} does not exist (pass an exported folder, a Hugging Face model folder, "
                         "or an MLflow URI such as models:/<name>/<version>)")
    return folder
