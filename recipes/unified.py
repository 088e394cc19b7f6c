"""Train a unified model (one backbone that writes a think segment and draws the image) on Ray.

    python recipes/unified.py [RECIPE.yaml] [key=value ...]

Without a recipe path it runs ``recipes/unified/tiny/unified_tiny.yaml`` (a tiny demo backbone trained on
its text and its image in one optimizer step, embedded local Ray, local MLflow store). On a cluster:

    ray job submit --working-dir . -- python recipes/unified.py recipes/unified/tiny/unified_tiny.yaml
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout / a `ray job submit` working dir

from unirl_ray.cli import run_trainer  # noqa: E402
from unirl_ray.trainer.unified import UnifiedModelTrainer  # noqa: E402

DEFAULT_RECIPE = os.path.join(HERE, "unified", "tiny", "unified_tiny.yaml")

if __name__ == "__main__":
    sys.exit(run_trainer(UnifiedModelTrainer, sys.argv[1:], default_recipe=DEFAULT_RECIPE))
