"""Execute the notebooks end to end with papermill (as the README says to run them), small parameters injected.

Each notebook runs in its own kernel process, the driver of its runs. The quick start and the SFT -> GRPO
notebook join the session's head node (``ray_head``: a cluster started with ``ray start --head``, as users
join one, through their ``RAY_ADDRESS`` parameter); the AR GRPO notebook starts the embedded Ray a notebook
gets on a laptop. What they print and display is checked, then their MLflow runs are read back from the store.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support import stop_ray_in_this_process

papermill = pytest.importorskip("papermill")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("ipywidgets")  # the progress bars of Ray Data and tqdm in a kernel

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT_S = 600

KERNEL_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "120", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}


def execute(name: str, tmp_path: Path, env: dict[str, str], **parameters) -> tuple[str, int]:
    """Run ``notebooks/<name>.ipynb`` with papermill (kernel cwd: ``notebooks/``); all its stream and text output,
    and how many PNG images it displayed. The executed notebook is kept in ``tmp_path`` for inspection."""
    stop_ray_in_this_process()
    out = tmp_path / f"{name}.executed.ipynb"
    kernel_env = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    kernel_env.update(KERNEL_ENV)
    t0 = time.perf_counter()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(kernel_env)  # papermill's kernel inherits this process's environment
    try:
        nb = papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters=parameters,
                                        kernel_name="python3", cwd=str(NOTEBOOKS), execution_timeout=CELL_TIMEOUT_S,
                                        progress_bar=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(f"{name} executed in {time.perf_counter() - t0:.1f}s")
    texts, pngs = [], 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                texts.append(output.get("text", ""))
            elif output.get("output_type") in ("execute_result", "display_data"):
                data = output.get("data", {})
                texts.append(data.get("text/plain", ""))
                pngs += "image/png" in data
    injected = [c for c in nb.cells if "injected-parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(injected) == 1, "papermill did not find the cell tagged 'parameters'"
    return "\n".join(texts), pngs


def mlflow_runs(storage: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {run.info.run_name: (client, run) for run in runs}


def steps_of(client, run, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


def test_quickstart_on_a_ray_start_cluster(ray_head, tmp_path):
    storage = tmp_path / "runs"
    text, pngs = execute("quickstart", tmp_path, ray_head.env, NUM_STEPS=2, NUM_WORKERS=1,
                         STORAGE_PATH=str(storage), RAY_ADDRESS=ray_head.address)
    assert f"Ray cluster at {ray_head.address}" in text, text[-3000:]  # joined the head, no embedded Ray
    assert "step 2/2" in text, text[-3000:]
    assert "final reward:" in text, text[-3000:]
    assert "image grids logged at steps: [1, 2]" in text, text[-3000:]
    assert "mlflow ui --backend-store-uri sqlite:///" in text, text[-3000:]
    assert "quickstart finished" in text, text[-3000:]
    assert pngs >= 2, "expected the reward curve and the sample grid as images"
    assert (storage / "quickstart" / "checkpoint_000002" / "controller_state.json").is_file()
    client, run = mlflow_runs(storage)["quickstart"]
    assert steps_of(client, run, "reward/mean") == [1, 2] and run.info.status == "FINISHED"


def test_ar_grpo_on_an_embedded_ray(tmp_path):
    storage = tmp_path / "runs"
    text, pngs = execute("ar_grpo", tmp_path, dict(os.environ), NUM_STEPS=2, NUM_WORKERS=1,
                         STORAGE_PATH=str(storage), REGISTER_AS="nb-char-lm")
    assert "embedded local Ray" in text, text[-3000:]
    assert "step 2/2" in text and "reward/mean: " in text, text[-3000:]
    assert "sample tables logged: ['step_000001.json', 'step_000002.json']" in text, text[-3000:]
    assert "completion" in text and "advantage" in text, text[-3000:]  # the sample table's DataFrame
    assert "exported policy version: 2" in text and "greedy answer to 'write a word':" in text, text[-3000:]
    assert f"python -m unirl_ray.serve models:/nb-char-lm/1 --tracking-uri sqlite:///{storage}/mlflow.db" in text, text[-3000:]
    assert "ar_grpo finished" in text and pngs >= 1, text[-3000:]
    client, run = mlflow_runs(storage)["ar-grpo-notebook"]
    assert steps_of(client, run, "reward/mean") == [1, 2] and run.info.status == "FINISHED"
    assert client.get_model_version("nb-char-lm", "1").run_id == run.info.run_id


def test_sft_then_grpo_on_a_ray_start_cluster(ray_head, tmp_path):
    storage = tmp_path / "runs"
    text, pngs = execute("sft_then_grpo", tmp_path, ray_head.env, SFT_STEPS=4, GRPO_STEPS=2, NUM_WORKERS=1,
                         STORAGE_PATH=str(storage), RAY_ADDRESS=ray_head.address)
    assert f"Ray cluster at {ray_head.address}" in text, text[-3000:]
    assert "train/loss: " in text and "config.json" in text, text[-3000:]  # the loss curve, the export's files
    assert "reward/mean: " in text and "sft_then_grpo finished" in text, text[-3000:]
    assert pngs >= 2, "expected the SFT loss curve and the GRPO reward curve"
    runs = mlflow_runs(storage)
    client, sft = runs["sft-notebook"]
    assert steps_of(client, sft, "train/loss") == [1, 2, 3, 4] and steps_of(client, sft, "eval/loss") == [1, 2, 3, 4]
    client, grpo = runs["grpo-after-sft-notebook"]
    assert steps_of(client, grpo, "reward/mean") == [1, 2]
    # GRPO started from the SFT export
    assert grpo.data.params["bundle.config.pretrained_model_path"] == str(storage / "sft_export")
    assert sft.info.status == grpo.info.status == "FINISHED"
