"""Execute notebooks/quickstart.ipynb end to end with nbclient, with small injected parameters.

The notebook runs in its own kernel process, which starts its own embedded Ray (the test process
does not share it). The parameters cell (tagged ``parameters``, papermill style) is replaced with
small CPU values and a temporary storage path.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = REPO_ROOT / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 600

KERNEL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "120",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}


def _parameters_cell(nb) -> int:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            return index
    raise AssertionError("the notebook has no code cell tagged 'parameters'")


def _stop_ray_in_this_process() -> None:
    """A Ray left initialised in the test process (another module's fixture) only costs CPUs here."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        if "ray.serve" in sys.modules:
            try:
                sys.modules["ray.serve"].shutdown()
            except Exception:  # noqa: BLE001 - best effort; ray.shutdown() ends it anyway
                pass
        ray.shutdown()


def _outputs(nb) -> tuple[str, int]:
    """All stream / text output of the executed notebook, and how many PNG images it displayed."""
    texts, pngs = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out.get("text", ""))
            elif out.get("output_type") in ("execute_result", "display_data"):
                data = out.get("data", {})
                texts.append(data.get("text/plain", ""))
                pngs += "image/png" in data
    return "\n".join(texts), pngs


def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(QUICKSTART, as_version=4)
    index = _parameters_cell(nb)
    storage = tmp_path / "runs"
    nb.cells[index].source = "\n".join(
        [
            "NUM_STEPS = 2",
            "NUM_WORKERS = 1",
            f"STORAGE_PATH = {str(storage)!r}",
            "RAY_ADDRESS = None",
        ]
    )

    _stop_ray_in_this_process()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(KERNEL_ENV)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(QUICKSTART.parent)}},
    )
    t0 = time.perf_counter()
    try:
        client.execute(env=env)
    finally:
        # keep the executed notebook for inspection when something fails
        nbformat.write(nb, tmp_path / "quickstart.executed.ipynb")
    print(f"quickstart notebook executed in {time.perf_counter() - t0:.1f}s")

    text, pngs = _outputs(nb)
    assert "step 2/2" in text, text[-3000:]
    assert "final reward:" in text, text[-3000:]
    assert "image grids logged at steps: [1, 2]" in text, text[-3000:]
    assert "mlflow ui --backend-store-uri sqlite:///" in text, text[-3000:]
    assert "quickstart finished" in text, text[-3000:]
    assert pngs >= 2, "expected the reward curve and the sample grid as images"
    assert (storage / "mlflow.db").is_file()
    assert (storage / "quickstart" / "checkpoint_000002" / "controller_state.json").is_file()
