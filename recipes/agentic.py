"""Agentic RL: a causal LM that calls tools over several turns, its answer scored by a service, on Ray.

    python recipes/agentic.py [RECIPE.yaml] [key=value ...]

Without a recipe path it runs ``recipes/agentic/tiny/calculator_grpo.yaml`` (tiny demo model, calculator
tool, colocated HF engine, embedded local Ray, local MLflow store); start it from the tiny tool-use SFT
export (see that recipe's header). On a cluster:

    ray job submit --working-dir . -- python recipes/agentic.py recipes/agentic/qwen2_5/gsm8k_python_vllm.yaml
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout / a `ray job submit` working dir

from unirl_ray.cli import run_trainer  # noqa: E402
from unirl_ray.trainer.agentic import AgenticTrainer  # noqa: E402

DEFAULT_RECIPE = os.path.join(HERE, "agentic", "tiny", "calculator_grpo.yaml")

if __name__ == "__main__":
    sys.exit(run_trainer(AgenticTrainer, sys.argv[1:], default_recipe=DEFAULT_RECIPE))
