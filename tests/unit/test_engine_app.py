"""The standalone engine app (serve_apps/engine_app.py, serve_apps/engine.yaml) and ``rollout.attach``, without
Ray: the app built from a recipe serves exactly the sections a trainer of that recipe checks for; what differs
is named; bad arguments and layouts are refused with the reason. (Attaching a trainer to a running app, end to
end: tests/ray/test_e2e_ar.py.)"""

import os

import pytest
import yaml

from serve_apps.engine_app import engine_parts
from unirl_ray.config.recipe import load_recipe
from unirl_ray.rollout.dedicated import DedicatedRollout, section_differences
from unirl_ray.trainer.ar import ARTrainer
from unirl_ray.trainer.rl import engine_sections

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_YAML = os.path.join(ROOT, "serve_apps", "engine.yaml")


def shipped_args():
    with open(ENGINE_YAML) as f:
        config = yaml.safe_load(f)
    (app,) = config["applications"]
    assert app["name"] == app["args"]["name"] == "engine" and app["route_prefix"] is None
    return config, {**app["args"], "recipe": os.path.join(ROOT, app["args"]["recipe"])}


def test_the_shipped_app_serves_what_a_trainer_of_its_recipe_expects():
    from ray.serve.schema import ServeDeploySchema

    config, args = shipped_args()
    ServeDeploySchema(**config)  # `serve deploy` accepts the file as it is
    cfg, sections, seed, name = engine_parts(args)
    assert (cfg.engine, cfg.num_replicas, cfg.ray_actor_options, name) == ("hf", 1, {"num_cpus": 0.5}, "engine")
    assert cfg.attach is None and cfg.placement == "separate"
    trainer = ARTrainer(load_recipe(args["recipe"], ["rollout.attach=engine"]))
    assert seed == trainer.run_cfg.seed and trainer.dedicated.attach == "engine"
    assert section_differences(sections, engine_sections(trainer.recipe, trainer.backend_cfgs)) == []
    assert trainer.extra_resources() == trainer.reward_cfg.resources()  # the app's replicas are not counted again

    # the same recipe with other overrides: each difference named, as the attaching trainer reports it
    other = load_recipe(args["recipe"], ["pipeline.max_new_tokens=7", "backend.trainable_attr=model2"])
    differ = section_differences(sections, engine_sections(other, {}))
    assert differ == [f"pipeline.max_new_tokens: served {sections['pipeline']['max_new_tokens']}, recipe 7",
                      "trainable_attr: served 'model', recipe 'model2'"]
    # arguments override the recipe's rollout block; overrides apply as on the trainer's command line
    cfg, sections, _, _ = engine_parts({**args, "num_replicas": "2", "overrides": "pipeline.max_new_tokens=7"})
    assert cfg.num_replicas == 2 and sections["pipeline"]["max_new_tokens"] == 7


def test_a_diffusion_recipe_builds_its_engine_app_with_the_adapters_it_trains():
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    recipe = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_tiny_flowgrpo_engine.yaml")
    cfg, sections, _, _ = engine_parts({"recipe": recipe, "name": "sd3-engine"})
    assert (cfg.engine, cfg.num_replicas, cfg.ray_actor_options) == ("hf", 1, {"num_cpus": 0.5})  # the recipe's
    assert sections["trainable_attr"] == "transformer" and sections["lora_cfg"]["rank"] > 0
    trainer = DiffusionTrainer(load_recipe(recipe, ["+rollout.attach=sd3-engine"]))
    assert section_differences(sections, engine_sections(trainer.recipe, trainer.backend_cfgs)) == []


def test_bad_arguments_and_layouts_are_refused_with_the_reason():
    _, args = shipped_args()
    with pytest.raises(ValueError, match="needs a 'recipe' argument"):
        engine_parts({"name": "engine"})
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['replicas'\]"):
        engine_parts({**args, "replicas": 2})
    with pytest.raises(ValueError, match="rollout.engine must be one of"):
        engine_parts({**args, "engine": "sglang"})
    with pytest.raises(ValueError, match="cannot take turns with the train workers"):
        DedicatedRollout(attach="engine", placement="colocated")
    with pytest.raises(ValueError, match="rollout.attach must be the name of a running engine app"):
        DedicatedRollout(attach=" ")
    assert DedicatedRollout(attach="engine").resources() == {}
    assert DedicatedRollout().resources() == {"CPU": 0.5}


def test_the_engine_apps_a_trainer_deploys_count_in_its_resources_and_make_the_driver_import_serve(tmp_path):
    from unirl_ray.trainer.diffusion import DiffusionTrainer
    from unirl_ray.trainer.unified import UnifiedModelTrainer

    def recipe(*parts, overrides=()):
        return load_recipe(os.path.join(ROOT, "recipes", *parts), [f"trainer.storage_path={tmp_path}", *overrides])

    def add(*needs):
        total = {}
        for need in needs:
            for key, value in need.items():
                total[key] = total.get(key, 0.0) + value
        return total

    direct = ARTrainer(recipe("ar", "tiny", "char_grpo_direct.yaml"))
    assert direct.engine_configs() == {} and direct.extra_resources() == direct.reward_cfg.resources()
    engine = ARTrainer(recipe("ar", "tiny", "char_grpo_engine.yaml"))
    assert engine.engine_configs() == {"rollout": engine.dedicated} and "serve" in engine.driver_libraries()
    assert engine.extra_resources() == add(engine.reward_cfg.resources(), engine.dedicated.resources())
    pair = UnifiedModelTrainer(recipe("unified", "tiny", "janus_tiny_engines.yaml"))
    apps = pair.engine_configs()
    assert len(apps) == 2 and all(isinstance(cfg, DedicatedRollout) for cfg in apps.values())
    assert pair.extra_resources() == add(pair.reward_cfg.resources(), *(cfg.resources() for cfg in apps.values()))
    sd3 = DiffusionTrainer(recipe("diffusion", "sd3", "sd3_tiny_flowgrpo.yaml"))  # brightness: scored on the driver
    assert sd3.engine_configs() == {} and "serve" not in sd3.driver_libraries()
