"""Entry point: ``python -m unirl_ray.train_agentic RECIPE.yaml key=value ...``."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.agentic import AgenticTrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(AgenticTrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
