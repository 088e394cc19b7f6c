"""Entry point: ``python -m unirl_ray.train_pe RECIPE.yaml key=value ...``."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.pe import PETrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(PETrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
