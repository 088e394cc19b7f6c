"""The reward service as a standalone Serve app.

From a config file (HTTP proxy on 127.0.0.1 only)::

    serve deploy serve_apps/reward_config.yaml      # or: serve run serve_apps/reward_config.yaml

From the command line (arguments are parsed as YAML; ``rewards`` may also be a comma-separated list of
reward fns, bare names meaning ``unirl_ray.rewards.image.<name>``, each with weight 1)::

    serve run serve_apps.reward_app:app_builder rewards=brightness,jpeg_compressibility timeout_s=30

A trainer attaches to a running app with ``RewardClient.connect(app_name)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from unirl_ray.rewards import image as _image_rewards
from unirl_ray.rewards.combine import RewardConfig
from unirl_ray.rewards.service import build_reward_app


def _parse_value(value: Any) -> Any:
    return yaml.safe_load(value) if isinstance(value, str) else value


def _parse_rewards(value: Any) -> Any:
    """A rewards mapping, from a mapping, a YAML/JSON string, or ``"fn_a,fn_b"``."""
    value = _parse_value(value)
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list):
        entries = {}
        for fn in value:
            name = fn.replace(":", ".").rsplit(".", 1)[-1]
            if "." not in fn and ":" not in fn and hasattr(_image_rewards, fn):
                fn = f"{_image_rewards.__name__}.{fn}"
            entries[name] = {"fn": fn, "weight": 1.0}
        return entries
    return value


def app_builder(args: dict) -> Any:
    """Build the bound ``RewardService`` from ``RewardConfig`` fields given as Serve app args."""
    if not isinstance(args, Mapping) or "rewards" not in args:
        raise ValueError(
            "the reward app needs a 'rewards' argument, e.g. "
            "`serve run serve_apps.reward_app:app_builder rewards=brightness`"
        )
    config = {k: (_parse_rewards(v) if k == "rewards" else _parse_value(v)) for k, v in args.items()}
    return build_reward_app(RewardConfig.from_dict(config))
