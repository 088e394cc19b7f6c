"""Files shipped with the package (prompt lists for demos and tests)."""

import os

_ROOT = os.path.dirname(os.path.abspath(__file__))


def asset_path(rel: str) -> str:
    """Absolute path of a packaged asset, e.g. ``asset_path("prompts/animals.txt")``."""
    path = os.path.normpath(os.path.join(_ROOT, rel))
    if os.path.commonpath([path, _ROOT]) != _ROOT:
        raise ValueError(f"asset path {rel!r} leaves the assets folder; pass a path like 'prompts/animals.txt'")
    if not os.path.exists(path):
        available = sorted(
            os.path.relpath(os.path.join(d, f), _ROOT)
            for d, _, files in os.walk(_ROOT)
            for f in files
            if not f.endswith((".py", ".pyc"))
        )
        raise ValueError(f"no packaged asset {rel!r}; available: {available}")
    return path
