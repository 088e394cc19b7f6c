"""Train a causal LM with the GRPO family on Ray.

    python recipes/ar.py [RECIPE.yaml] [key=value ...]

Without a recipe path it runs ``recipes/ar/tiny/char_grpo_direct.yaml`` (tiny demo model, direct
rollout, embedded local Ray, local MLflow store). On a cluster:

    ray job submit --working-dir . -- python recipes/ar.py recipes/ar/qwen2_5/gsm8k_grpo_engine.yaml
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout / a `ray job submit` working dir

from unirl_ray.cli import run_trainer  # noqa: E402
from unirl_ray.trainer.ar import ARTrainer  # noqa: E402

DEFAULT_RECIPE = os.path.join(HERE, "ar", "tiny", "char_grpo_direct.yaml")

if __name__ == "__main__":
    sys.exit(run_trainer(ARTrainer, sys.argv[1:], default_recipe=DEFAULT_RECIPE))
