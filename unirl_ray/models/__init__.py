"""Model families (each sub-package holds a config, a component bundle and a sampling pipeline).

Import a family explicitly (e.g. ``from unirl_ray.models.sd3 import SD3Pipeline``) so that importing
``unirl_ray.models`` stays cheap and does not pull in diffusers / transformers.
"""
