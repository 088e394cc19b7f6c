"""unirl_ray: Ray-native RL post-training for generative models.

Train stacks run as Ray Train workers, rewards (and rollout engines) as Ray Serve apps, prompts
stream through Ray Data, every run is tracked in MLflow, and recipes are flat ``_target_`` YAML.
The core (bundles, pipelines, algorithms, FSDPBackend, TrainStack) imports no Ray.
"""

__version__ = "0.1.0"
