"""unirl_ray: Ray-native RL post-training for generative models.

Train stacks run as Ray Train workers, rewards (and rollout engines) as Ray Serve apps, prompts
stream through Ray Data, every run is tracked in MLflow, and recipes are flat ``_target_`` YAML.
The core (bundles, pipelines, algorithms, FSDPBackend, TrainStack) imports no Ray.
"""

__version__ = "0.1.0"

from unirl_ray import _lean_imports

_lean_imports.install()  # transformers without scikit-learn's import cost (see the module)
