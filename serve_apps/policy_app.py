"""The trained policy as a standalone Serve app with OpenAI's routes (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``).

From a config file (HTTP proxy on 127.0.0.1 only)::

    serve run serve_apps/policy.yaml          # edit its `source` first; or: serve deploy serve_apps/policy.yaml

From the command line (arguments are parsed as YAML)::

    serve run serve_apps.policy_app:app_builder source=/path/to/export num_replicas=2

``python -m unirl_ray.serve SOURCE`` does the same in one command (it also starts Ray).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from unirl_ray.serve.deployment import build_policy_app


def app_builder(args: dict) -> Any:
    """Build the bound ``PolicyServer`` from ``build_policy_app``'s arguments given as Serve app args."""
    if not isinstance(args, Mapping) or not args.get("source"):
        raise ValueError("the policy app needs a 'source' argument (an exported folder, a Hugging Face model folder "
                         "or models:/<name>/<version>), e.g. `serve run serve_apps.policy_app:app_builder "
                         "source=/path/to/export`")
    text = ("source", "name", "api_key", "tracking_uri", "engine")  # kept as given; the other args are YAML values
    kwargs = {k: yaml.safe_load(v) if isinstance(v, str) and k not in text else v for k, v in args.items()}
    return build_policy_app(kwargs.pop("source"), **kwargs)
