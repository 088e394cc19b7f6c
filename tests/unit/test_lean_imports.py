"""Importing transformers / diffusers models in a process that imported unirl_ray imports neither
scikit-learn nor scipy (~1.5 s per train worker / replica), and every feature that needs them still
works the same: the skipped names are lazy stand-ins (``unirl_ray._lean_imports``)."""

import json
import os
import subprocess
import sys

PROBE = """
import sys
import unirl_ray  # noqa: F401
from transformers import AutoModelForCausalLM, CLIPTextModel  # noqa: F401  (generation, losses)
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # noqa: F401
import diffusers.loaders.single_file_utils  # noqa: F401  (imports most schedulers)
imported = {"scipy": "scipy" in sys.modules, "sklearn": "sklearn" in sys.modules}
import diffusers.schedulers.scheduling_flow_match_euler_discrete as fm
import transformers.generation.candidate_generator as cg
import transformers.loss.loss_for_object_detection as od
scheduler = FlowMatchEulerDiscreteScheduler(use_beta_sigmas=True)  # scipy.stats.beta at call time
scheduler.set_timesteps(5)
rows, cols = od.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
fpr, tpr, _ = cg.roc_curve([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
print(json.dumps({
    "imported": imported,
    "sigmas": [round(float(s), 6) for s in scheduler.sigmas],
    "assignment": [[int(r) for r in rows], [int(c) for c in cols]],
    "roc": [[float(x) for x in fpr], [float(x) for x in tpr]],
    "checks": [fm.is_scipy_available(), od.is_scipy_available(), cg.is_sklearn_available()],
}))
"""


def _start(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import json\n" + code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def _results(*processes: subprocess.Popen) -> list[dict]:
    try:
        outputs = [p.communicate(timeout=180) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, (_, stderr) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]


def test_models_import_without_scikit_learn_or_scipy_and_what_needs_them_works_the_same():
    # both probes at once: each is one busy core, and the unit tests leave the other one idle
    lean, plain = _results(_start(PROBE), _start(PROBE, UNIRL_LEAN_IMPORTS="0"))
    assert lean.pop("imported") == {"scipy": False, "sklearn": False}
    # the finder is what keeps them out: without it, transformers and diffusers import both
    assert plain.pop("imported") == {"scipy": True, "sklearn": True}
    assert lean == plain  # beta sigmas (scipy.stats), Hungarian matching (scipy.optimize), ROC (sklearn)
    assert lean["assignment"] == [[0, 1, 2], [1, 0, 2]]  # the cheapest matching of that cost matrix
    assert lean["checks"] == [True, True, True]  # runtime availability checks give the real answer


DRIVER_PROBE = """
import sys
from unirl_ray.config.recipe import load_recipe
from unirl_ray.trainer.ar import ARTrainer
from unirl_ray.trainer.diffusion import DiffusionTrainer
from unirl_ray.trainer.sft import SFTTrainer
from unirl_ray.trainer.unified import UnifiedModelTrainer
root, storage = sys.argv[1], sys.argv[2]
for cls, recipe in ((DiffusionTrainer, "diffusion/sd3/sd3_tiny_flowgrpo.yaml"),
                    (ARTrainer, "ar/tiny/char_grpo_direct.yaml"), (SFTTrainer, "sft/tiny/char_chat_sft.yaml"),
                    (UnifiedModelTrainer, "unified/tiny/unified_tiny.yaml")):
    cls(load_recipe(f"{root}/recipes/{recipe}", [f"trainer.storage_path={storage}"]))
print(json.dumps({m: m in sys.modules for m in ("diffusers", "transformers", "peft", "torch.distributed.checkpoint")}))
"""


def test_checking_the_tiny_recipes_on_the_driver_imports_no_model_library(tmp_path):
    """Every ``_target_`` of a recipe is imported on the driver to check it, before Ray starts: the model modules
    (bundles, pipelines) and the train backend import diffusers, transformers, peft and DCP where they build or
    save (~2 s of the tiny SD3 recipe's start on 2 cores, ~1 s of AR's and SFT's, all before Ray's start). The
    default recipes of recipes/sd3.py, ar.py, sft.py and unified.py (the Janus family still imports transformers at
    its top: its output class subclasses transformers' ``ModelOutput``)."""
    probe = subprocess.Popen([sys.executable, "-c", "import json\n" + DRIVER_PROBE,
                              os.path.join(os.path.dirname(__file__), "..", ".."), str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (imported,) = _results(probe)
    assert imported == {"diffusers": False, "transformers": False, "peft": False,
                        "torch.distributed.checkpoint": False}
