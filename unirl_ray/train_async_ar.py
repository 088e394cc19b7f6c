"""Entry point: ``python -m unirl_ray.train_async_ar RECIPE.yaml key=value ...`` (two slabs, bounded staleness)."""

from __future__ import annotations

import sys

from unirl_ray.cli import run_trainer
from unirl_ray.trainer.async_rl import AsyncARTrainer


def main(argv: list[str] | None = None) -> int:
    return run_trainer(AsyncARTrainer, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
