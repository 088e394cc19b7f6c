"""Entry point: ``python -m unirl_ray.train_diffusion RECIPE.yaml key=value ...``."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.diffusion import DiffusionTrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(DiffusionTrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
