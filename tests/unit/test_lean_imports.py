"""Importing a transformers model in a process that imported unirl_ray does not import scikit-learn
(~1 s per train worker / replica, for assisted decoding only), and scikit-learn stays importable."""

import subprocess
import sys

PROBE = """
import sys
import unirl_ray  # noqa: F401
from transformers import AutoModelForCausalLM  # noqa: F401  (pulls in transformers.generation)
import transformers.generation.candidate_generator as cg
assert "sklearn" not in sys.modules, "transformers imported scikit-learn"
assert cg.is_sklearn_available() is False
import sklearn.metrics  # noqa: F401  (still there for whoever needs it)
print("ok")
"""


def test_transformers_models_import_without_scikit_learn():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
