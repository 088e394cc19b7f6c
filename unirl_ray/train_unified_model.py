"""Entry point: ``python -m unirl_ray.train_unified_model RECIPE.yaml key=value ...``."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.unified import UnifiedModelTrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(UnifiedModelTrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
