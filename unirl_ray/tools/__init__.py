"""Developer tools (``python -m unirl_ray.tools.reference`` writes ``unirl_ray/README.md``)."""
