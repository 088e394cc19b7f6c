"""Train SD3 with Flow-GRPO on Ray.

    python recipes/sd3.py [RECIPE.yaml] [key=value ...]

Without a recipe path it runs ``recipes/diffusion/sd3/sd3_tiny_flowgrpo.yaml`` (tiny demo model,
embedded local Ray, local MLflow store). On a cluster:

    ray job submit --working-dir . -- python recipes/sd3.py trainer.num_steps=50
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout / a `ray job submit` working dir

from unirl_ray.cli import run_trainer  # noqa: E402
from unirl_ray.trainer.diffusion import DiffusionTrainer  # noqa: E402

DEFAULT_RECIPE = os.path.join(HERE, "diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")

if __name__ == "__main__":
    sys.exit(run_trainer(DiffusionTrainer, sys.argv[1:], default_recipe=DEFAULT_RECIPE))
