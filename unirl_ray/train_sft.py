"""Entry point: ``python -m unirl_ray.train_sft RECIPE.yaml key=value ...``."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.sft import SFTTrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(SFTTrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
