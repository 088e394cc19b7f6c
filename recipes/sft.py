"""Supervised fine-tuning (SFT) on Ray: records streamed by Ray Data into Ray Train workers.

    python recipes/sft.py [RECIPE.yaml] [key=value ...]

Without a recipe path it runs ``recipes/sft/tiny/char_chat_sft.yaml`` (tiny demo LM, 32 chat
records, embedded local Ray, local MLflow store). Other recipes:

    python recipes/sft.py recipes/sft/tiny/sd3_caption_sft.yaml          # tiny SD3, image-caption flow matching
    ray job submit --working-dir . -- python recipes/sft.py recipes/sft/qwen2_5/chat_sft_0_5b.yaml
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout / a `ray job submit` working dir

from unirl_ray.cli import run_trainer  # noqa: E402
from unirl_ray.trainer.sft import SFTTrainer  # noqa: E402

DEFAULT_RECIPE = os.path.join(HERE, "sft", "tiny", "char_chat_sft.yaml")

if __name__ == "__main__":
    sys.exit(run_trainer(SFTTrainer, sys.argv[1:], default_recipe=DEFAULT_RECIPE))
