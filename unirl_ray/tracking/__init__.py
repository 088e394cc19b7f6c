"""Experiment tracking: MLflow on the driver, with a local JSON-lines fallback."""

from unirl_ray.tracking.mlflow_tracker import (
    MLflowTracker,
    TrackingConfig,
    image_grid,
    resolve_tracking_uri,
    sanitize_key,
)

__all__ = ["MLflowTracker", "TrackingConfig", "image_grid", "resolve_tracking_uri", "sanitize_key"]
