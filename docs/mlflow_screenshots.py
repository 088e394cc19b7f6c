"""Screenshots of a finished run in the MLflow UI, for the README (made by hand, not in CI).

    .venv/bin/python docs/mlflow_screenshots.py                      # trains the tiny SD3 recipe 30 steps first (~2 min)
    .venv/bin/python docs/mlflow_screenshots.py --store /tmp/shotrun   # an existing storage folder (its mlflow.db)

It starts ``mlflow ui`` on loopback on the run's store, opens the run's "Model metrics" tab in a headless
Chromium, filters the charts to ``reward/`` and saves ``docs/mlflow_run_metrics.png``. Needs a Chromium
(Debian: ``apt-get install chromium``) and Playwright's Python package in the project's venv
(``.venv/bin/pip install playwright``; not its browser download: ``--chromium`` names the browser to drive).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv" / "bin" / "python"


def train(store: Path, steps: int) -> None:
    """The tiny SD3 Flow-GRPO recipe on one worker, its run and MLflow store in ``store``."""
    subprocess.run([str(PYTHON), str(REPO / "recipes" / "sd3.py"), f"trainer.num_steps={steps}",
                    f"trainer.storage_path={store}", "ray.scaling.num_workers=1",
                    "ray.scaling.resources_per_worker.CPU=2"], check=True, cwd=REPO, timeout=1800)


def wait_up(url: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow ui did not come up at {url}") from None
            time.sleep(1)


def shoot(url: str, experiment_id: str, run_id: str, out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        charts = f"{url}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics"
        page.goto(charts, wait_until="load")  # the UI polls for updates: the network is never idle
        page.wait_for_timeout(6000)
        for selector in ('button[aria-label="Close"]', "text=Model training"):  # the assistant panel; the view
            try:
                page.locator(selector).first.click(timeout=2000)
                page.wait_for_timeout(1000)
            except Exception:  # noqa: BLE001 - absent in other MLflow versions
                pass
        page.goto(charts, wait_until="load")
        page.wait_for_timeout(4000)
        page.fill('input[placeholder="Search metric charts"]', "reward/")
        page.wait_for_timeout(5000)
        page.screenshot(path=str(out))
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="a storage folder with a finished run (default: train one)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--port", type=int, default=5055)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "mlflow_run_metrics.png")
    args = parser.parse_args()
    store = args.store
    if store is None:
        store = Path(tempfile.mkdtemp(prefix="unirl_screenshot_"))
        train(store, args.steps)
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([str(REPO / ".venv" / "bin" / "mlflow"), "ui", "--backend-store-uri",
                               f"sqlite:///{store / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(args.port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, server)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(url)
        experiments = [e.experiment_id for e in client.search_experiments()]
        run = client.search_runs(experiments, order_by=["attributes.start_time DESC"])[0]
        shoot(url, run.info.experiment_id, run.info.run_id, args.out, args.chromium)
        print(f"wrote {args.out} (run {run.info.run_name}, {run.info.run_id})")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    sys.exit(main())
