"""Train a prompt enhancer (an LLM rewriter + a diffusion model) on Ray.

    python recipes/pe.py [RECIPE.yaml] [key=value ...]

Without a recipe path it runs ``recipes/pe/tiny/pe_tiny.yaml`` (a tiny demo rewriter and
image model, both trained, embedded local Ray, local MLflow store). On a cluster:

    ray job submit --working-dir . -- python recipes/pe.py recipes/pe/qwen2_5/qwen0_5b_sd3_5_medium.yaml
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout / a `ray job submit` working dir

from unirl_ray.cli import run_trainer  # noqa: E402
from unirl_ray.trainer.pe import PETrainer  # noqa: E402

DEFAULT_RECIPE = os.path.join(HERE, "pe", "tiny", "pe_tiny.yaml")

if __name__ == "__main__":
    sys.exit(run_trainer(PETrainer, sys.argv[1:], default_recipe=DEFAULT_RECIPE))
