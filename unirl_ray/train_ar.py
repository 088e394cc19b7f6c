"""Entry point: ``python -m unirl_ray.train_ar RECIPE.yaml key=value ...``."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.ar import ARTrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(ARTrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
