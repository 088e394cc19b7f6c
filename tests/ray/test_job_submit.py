"""``ray start --head`` + ``ray job submit --working-dir <repo> -- python recipes/sd3.py ...`` on a real head.

The head node is the session's ``ray_head`` (``support.RayHead``: dashboard on, token auth off, its own free
ports and temp dir, stopped through its own process, never with ``ray stop --force``); the notebooks run on
it after this test.

The job inherits the environment of the process that started the head: PATH starts with the venv's
``bin`` so the job's ``python`` is the venv's. The working dir upload honours ``.gitignore`` (so the
2+ GB ``.venv`` is not uploaded): checked on the unpacked package on the head node.

The recipe's ``ray.runtime_env`` ships a reward module of the user's (``py_modules``, outside the working dir)
and a variable (``env_vars``) to the job, and ``ray job submit --runtime-env-json`` another variable: Ray merges
the two environments, and the reward, which reads both variables, scores in the reward app's Serve replica.

The job is also the diffusion trainer's learning test (the tiny SD3 recipe, Flow-GRPO, one worker): the
reward rises, the metrics, parameters, images and recipe reach MLflow, and the synchronous checkpoints are
complete when saved (the other diffusion runs, in ``tests/ray/test_e2e_diffusion.py``, save asynchronously).
Then ``mlflow server`` (the MLflow UI's server) on the job's store serves the run, its metrics and its images
through its REST API.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support import free_port, venv_bin

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

REPO_ROOT = Path(__file__).resolve().parents[2]
CMD_TIMEOUT_S = 600


def _ray(env: dict, *args: str) -> subprocess.CompletedProcess:
    ray_cli = str(Path(env["VIRTUAL_ENV"]) / "bin" / "ray")
    return subprocess.run(
        [ray_cli, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )


STEPS = 8


def assert_learned_and_logged(storage: Path) -> None:
    """The job's MLflow run (the store in its storage path) and its checkpoints."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
               for key in ("reward/mean", "reward/std", "rollout/logp_gap")}
    rewards = history["reward/mean"]
    assert len(rewards) == STEPS
    # seen: steps 1-3 average 0.4906 with a spread of 0.0016, steps 6-8 0.5156 (about 15 spreads higher):
    # a clear margin, several times the within-step spread of the untrained model
    first, last, spread = np.mean(rewards[:3]), np.mean(rewards[-3:]), np.mean(history["reward/std"][:3])
    assert last - first > 3 * spread, (first, last, spread, rewards)
    for key in ("train/loss", "algo/clip_frac", "algo/approx_kl", "algo/adv_std", "rollout/logp_gap",
                "timing/rollout", "timing/reward", "timing/train", "perf/samples_per_s", "reward/brightness/mean"):
        assert key in run.data.metrics, key
    assert run.data.params["algorithm._target_"] == "unirl_ray.algorithms.FlowGRPO"
    assert run.data.tags["unirl.demo_model"] == "true" and run.info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "recipe.yaml" in artifacts
    assert any("images" in a or "samples" in a for a in artifacts), artifacts
    assert max(history["rollout/logp_gap"]) < 1e-4  # on-policy trainside rollout: recomputed == recorded log-probs
    ckpt = storage / "sd3-tiny-flowgrpo" / f"checkpoint_{STEPS:06d}"
    assert (ckpt / "controller_state.json").is_file()
    assert any(p.name == ".metadata" for p in (ckpt / "shards").iterdir())
    waits = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "checkpoint/commit_wait_s")}
    # each save returned once committed
    assert sorted(waits) == [4, STEPS] and all(v > 0 for v in waits.values()), waits


def assert_the_runtime_env_reached_the_reward_replica(storage: Path) -> None:
    """Every step the user's module scored 7.5 in the reward app's replica (imported from py_modules; 7 from the
    recipe's env_vars plus 0.5 from the job's --runtime-env-json), with weight 0: the total reward is the
    brightness alone."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in ("reward/mark/mean", "reward/brightness/mean", "reward/mean")}
    assert history["reward/mark/mean"] == {step: 7.5 for step in range(1, STEPS + 1)}, history["reward/mark/mean"]
    assert history["reward/mean"] == pytest.approx(history["reward/brightness/mean"], abs=1e-9)


def assert_the_mlflow_ui_serves_the_run(storage: Path) -> None:
    """``mlflow server`` (what ``mlflow ui`` runs) on the finished job's store: the run, its metric histories
    and its images come back through the server's REST API, as the UI reads them."""
    import io
    import json
    from urllib.parse import quote

    from mlflow.tracking import MlflowClient
    from PIL import Image

    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    port = free_port()
    server = subprocess.Popen([str(venv_bin() / "mlflow"), "server", "--backend-store-uri",
                               f"sqlite:///{storage / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def get(path: str) -> bytes:
        with urllib.request.urlopen(base + path, timeout=60) as response:
            return response.read()

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if get("/health"):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not come up"
                time.sleep(0.5)
        rid = run.info.run_id
        (experiment,) = [e for e in json.loads(get("/api/2.0/mlflow/experiments/search?max_results=100"))["experiments"]
                         if e["experiment_id"] == run.info.experiment_id]
        got = json.loads(get(f"/api/2.0/mlflow/runs/get?run_id={rid}"))["run"]
        assert got["info"]["status"] == "FINISHED" and got["info"]["run_name"] == run.info.run_name, got["info"]
        assert experiment["name"] == client.get_experiment(run.info.experiment_id).name
        for key in ("reward/mean", "train/loss"):
            served = json.loads(get(f"/api/2.0/mlflow/metrics/get-history?run_id={rid}&metric_key={key}"))["metrics"]
            want = client.get_metric_history(rid, key)
            assert sorted((m["step"], m["value"]) for m in served) == sorted((m.step, m.value) for m in want), key
        folders = [a.path for a in client.list_artifacts(rid) if a.is_dir and ("images" in a.path or "samples" in a.path)]
        pngs = [a.path for folder in folders for a in client.list_artifacts(rid, folder) if a.path.endswith(".png")]
        assert pngs, folders
        listed = json.loads(get(f"/api/2.0/mlflow/artifacts/list?run_id={rid}&path={quote(folders[0])}"))["files"]
        assert {f["path"] for f in listed if f["path"].endswith(".png")} >= {p for p in pngs if p.startswith(folders[0])}
        image = Image.open(io.BytesIO(get(f"/get-artifact?path={quote(pngs[0])}&run_uuid={rid}")))
        assert image.format == "PNG" and min(image.size) > 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def test_job_submit_runs_the_sd3_recipe(ray_head, tmp_path):
    url, env, temp_dir = ray_head.url, ray_head.env, ray_head.temp_dir
    storage = tmp_path / "runs"
    # a reward module of the user's outside the working dir, shipped by the recipe's ray.runtime_env (py_modules),
    # reading a variable that only the recipe's env_vars set and one that only the job's runtime env sets: it scores
    # in the reward app's Serve replica
    package = tmp_path / "project" / "my_job_rewards"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text("import os\n\n\ndef mark(*, images, prompts, **_):\n"
                                        "    value = float(os.environ['UNIRL_TEST_MARK']) + float(os.environ['UNIRL_JOB_OFFSET'])\n"
                                        "    return [value] * len(prompts)\n")
    t0 = time.perf_counter()
    proc = _ray(
        env, "job", "submit", "--address", url, "--working-dir", str(REPO_ROOT),
        "--runtime-env-json", json.dumps({"env_vars": {"UNIRL_JOB_OFFSET": "0.5"}}), "--",
        "python", "recipes/sd3.py",
        f"trainer.num_steps={STEPS}", "trainer.checkpoint_every=4", "tracking.log_samples_every=4",
        f"trainer.storage_path={storage}", "ray.scaling.num_workers=1", "ray.scaling.resources_per_worker.CPU=2",
        "++ray.async_checkpoint=false",  # synchronous checkpoints: every save returns once committed
        f"+ray.runtime_env={{py_modules: [{package}], env_vars: {{UNIRL_TEST_MARK: '7'}}}}",
        "+reward.rewards.mark={fn: my_job_rewards.rewards.mark, weight: 0.0}", "++reward.placement=serve",
    )
    elapsed = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    print(f"ray job submit finished in {elapsed:.1f}s with exit code {proc.returncode}")
    assert proc.returncode == 0, out[-8000:]
    assert f"step {STEPS}/{STEPS}" in out, out[-8000:]
    assert re.search(r"MLflow run \w+ \(FINISHED\) in sqlite:///\S*mlflow\.db", out), out[-8000:]
    assert re.search(r"open it with: \S*mlflow ui --backend-store-uri sqlite:///", out), out[-8000:]
    assert "running on Ray cluster at" in out, out[-8000:]  # joined the head, no embedded Ray
    assert (storage / "mlflow.db").is_file()
    assert_learned_and_logged(storage)
    assert_the_runtime_env_reached_the_reward_replica(storage)
    assert_the_mlflow_ui_serves_the_run(storage)

    # the working dir package on the head: the repo's sources, without the git-ignored venv
    packages = {p.resolve().parent.parent for p in temp_dir.glob("session_2*/runtime_resources/working_dir_files/*/recipes/sd3.py")}
    assert len(packages) == 1, list(temp_dir.glob("session_2*/runtime_resources/working_dir_files/*"))
    (package,) = packages
    assert (package / "unirl_ray" / "trainer" / "diffusion.py").is_file()
    assert not (package / ".venv").exists(), "the .venv was uploaded with the working dir"
    size = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    assert size < 50 * 1024**2, f"working dir package is {size / 1024**2:.1f} MiB"
    print(f"working dir package on the head: {size / 1024**2:.2f} MiB, no .venv")

    # the job's `python` is the venv's (the head was started with the venv's bin first on PATH)
    job_python = re.search(r"driver python: (/\S+)\)", out)
    assert job_python, out[-8000:]
    assert Path(job_python.group(1)).parent == Path(env["VIRTUAL_ENV"]) / "bin", job_python.group(1)
