"""``runtime.process_group``: the backend config that Ray Train's controller holds for every run. Unpickled
where the controller runs, it imports neither torch nor this project's torch-side modules (the
controller of every run used to import torch for it: ~2 CPU-seconds on the critical path of each start);
on a worker it joins and leaves a real gloo process group. The multi-rank path (rank 0's address, the
torchrun variables, ``init_process_group`` on every rank) runs in every two-worker end-to-end test."""

import json
import subprocess
import sys

import pytest
import ray.cloudpickle as cloudpickle

from unirl_ray.runtime.process_group import ProcessGroupBackend, ProcessGroupConfig

CONTROLLER = """
import json, sys
import ray.cloudpickle as cloudpickle
config = cloudpickle.loads(bytes.fromhex(sys.stdin.read()))
backend = config.backend_cls()
print(json.dumps({"torch": "torch" in sys.modules, "unirl": sorted(m for m in sys.modules if m.startswith("unirl_ray")),
                  "backend": type(backend).__name__, "share": backend.share_cuda_visible_devices,
                  "framework": str(config.framework), "dict": config.to_dict()}))
"""


def test_the_controller_unpickles_it_without_importing_torch():
    blob = cloudpickle.dumps(ProcessGroupConfig(backend="gloo", timeout_s=60)).hex()
    out = subprocess.run([sys.executable, "-c", CONTROLLER], input=blob, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["torch"] is False, seen["unirl"]
    assert seen["unirl"] == ["unirl_ray", "unirl_ray._lean_imports", "unirl_ray.runtime", "unirl_ray.runtime.process_group"]
    assert seen["backend"] == ProcessGroupBackend.__name__ and seen["share"] is True  # as TorchConfig's backend
    assert seen["framework"].endswith("TORCH")  # Ray Train records the run as a torch run
    assert seen["dict"] == {"backend": "gloo", "init_method": "env", "timeout_s": 60}


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="gloo"):
        ProcessGroupConfig(backend="mpi")


WORKER = """
import json, os, socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
import torch, torch.distributed as dist
from unirl_ray.runtime import process_group as pg
pg._init("gloo", world_rank=0, world_size=1, timeout_s=30)
joined = dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
t = torch.ones(3); dist.all_reduce(t)
pg._shutdown(destroy=True)
print(json.dumps({"joined": joined, "sum": t.tolist(), "left": not dist.is_initialized()}))
"""


def test_a_worker_joins_and_leaves_a_gloo_group():
    out = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"joined": True, "sum": [1.0, 1.0, 1.0], "left": True}
