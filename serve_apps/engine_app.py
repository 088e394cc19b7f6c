"""A rollout engine (HF or vLLM) as a standalone Serve app, built from a recipe, for trainers to attach to.

From a config file (no HTTP route: trainers call it through its Serve handle)::

    serve deploy serve_apps/engine.yaml      # or: serve run serve_apps/engine.yaml

From the command line (arguments are parsed as YAML)::

    serve run serve_apps.engine_app:app_builder recipe=recipes/ar/tiny/char_grpo_engine.yaml name=engine

A trainer rolls out on it with ``rollout.attach=<name>`` in its recipe: before its workers start it checks
that the app serves the recipe's model (bundle, pipeline, adapter structure: build the app from the same
recipe and overrides), then pushes its weights to it after every ``sync.every`` steps, versioned and verified,
as to an engine it deployed itself; at the end the app keeps running with the last version. ``name`` must be
the app's name (the replicas find the weights a trainer publishes under ``<name>-weights``). Stop it with
``serve delete <name>``.

Arguments: ``recipe`` (a recipe file; required), ``overrides`` (``key=value`` strings, as on the trainer's
command line), ``side`` (a prompt-enhancer recipe's ``ar`` or ``diffusion`` block), ``name`` (default
``engine``), ``seed`` (default the recipe's ``trainer.seed``) and any field of ``DedicatedRollout``
(``engine``, ``engine_kwargs``, ``num_replicas``, ``ray_actor_options``, ``max_ongoing_requests``), which
default to the recipe's ``rollout`` block when it has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

_ENGINE_FIELDS = ("engine", "engine_kwargs", "num_replicas", "ray_actor_options", "max_ongoing_requests")


def _parse(value: Any) -> Any:
    return yaml.safe_load(value) if isinstance(value, str) else value


def engine_parts(args: Mapping[str, Any]) -> tuple[Any, dict[str, Any], int, str]:
    """``(DedicatedRollout, sections, seed, name)`` of the app ``args`` describe; ``ValueError`` naming a bad one."""
    from omegaconf import OmegaConf

    from unirl_ray.config.recipe import instantiate, load_recipe
    from unirl_ray.rollout.dedicated import DedicatedRollout
    from unirl_ray.trainer.rl import engine_sections

    if not isinstance(args, Mapping) or not args.get("recipe"):
        raise ValueError("the engine app needs a 'recipe' argument (the recipe whose model it serves), e.g. "
                         "`serve run serve_apps.engine_app:app_builder recipe=recipes/ar/tiny/char_grpo_engine.yaml`")
    known = {"recipe", "overrides", "side", "name", "seed", *_ENGINE_FIELDS}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"the engine app got unknown argument(s) {unknown}; it takes {sorted(known)}")
    overrides = _parse(args.get("overrides")) or []
    if isinstance(overrides, str):
        overrides = overrides.split()
    recipe = load_recipe(str(args["recipe"]), [str(o) for o in overrides])
    side = args.get("side")
    block = recipe[side] if side else recipe
    if "bundle" not in block or "pipeline" not in block or "backend" not in block:
        raise ValueError(f"{args['recipe']}{f' (side {side!r})' if side else ''} has no bundle / pipeline / backend "
                         "block to build an engine from")
    fields: dict[str, Any] = {}
    rollout = block.get("rollout")
    if rollout is not None and str(rollout.get("_target_", "")).endswith("DedicatedRollout"):
        own = OmegaConf.to_container(rollout, resolve=True)
        fields |= {k: own[k] for k in _ENGINE_FIELDS if k in own}
    fields |= {k: _parse(args[k]) for k in _ENGINE_FIELDS if k in args}
    cfg = DedicatedRollout(**fields)  # placement separate: the app has its own resources
    backend_cfgs = {}
    if block.backend.get("ema_lora_cfg") is not None:  # its default adapter is the structure the engine mirrors
        backend_cfgs["ema_lora_cfg"] = instantiate(block.backend.ema_lora_cfg)
    sections = engine_sections(block, backend_cfgs)
    seed = int(_parse(args.get("seed", recipe.get("trainer", {}).get("seed", 0))) or 0)
    name = str(args.get("name") or "engine")
    return cfg, sections, seed, name


def app_builder(args: dict) -> Any:
    """The bound engine deployment (``dedicated.engine_app``) for ``serve run`` / ``serve deploy``."""
    from unirl_ray.rollout.dedicated import engine_app

    cfg, sections, seed, name = engine_parts(args)
    return engine_app(cfg, sections=sections, seed=seed, app_name=name)

