"""Test-wide environment: offline hubs, quiet Ray, no telemetry."""

import os

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}.items():
    os.environ.setdefault(key, value)
