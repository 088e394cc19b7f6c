"""runtime.imports: Ray's libraries imported one thread at a time (the fit thread vs the Ray Data threads)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from unirl_ray.runtime import imports


def test_imports_of_two_threads_never_overlap(monkeypatch):
    """Two threads importing two libraries at once: the imports run one after the other, each once."""
    monkeypatch.setattr(imports, "LIBRARIES", {"a": ("fake_lib_a.x", "fake_lib_a.y"), "b": ("fake_lib_b.x",)})
    monkeypatch.setattr(imports, "_DONE", set())
    active, overlaps, imported = [0], [], []

    def fake_import(name):
        active[0] += 1
        overlaps.append(active[0])
        time.sleep(0.05)
        imported.append(name)
        sys.modules[name] = object()
        active[0] -= 1

    monkeypatch.setattr(imports.importlib, "import_module", fake_import)
    for name in ("fake_lib_a.x", "fake_lib_a.y", "fake_lib_b.x"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    threads = [threading.Thread(target=imports.import_ray_library, args=(lib,)) for lib in ("a", "b", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert max(overlaps) == 1, "two imports ran at the same time"
    assert sorted(imported) == ["fake_lib_a.x", "fake_lib_a.y", "fake_lib_b.x"]  # each once
    imports.import_ray_library("a", "b")  # all there: returns without importing
    assert len(imported) == 3


def test_unknown_library_and_missing_public_module_raise(monkeypatch):
    with pytest.raises(ValueError, match="unknown Ray library.*known"):
        imports.import_ray_library("serve-ish")
    monkeypatch.setattr(imports, "LIBRARIES", {"x": ("ray._internal_gone._internal.nope", "ray.no_such_public_module")})
    monkeypatch.setattr(imports, "_DONE", set())
    with pytest.raises(ImportError, match="no_such_public_module"):
        imports.import_ray_library("x")  # the private one is skipped, the public one raises


def test_both_libraries_import_concurrently_and_leave_nothing_lazy():
    """A fresh interpreter: Train and Data imported from two threads at once; afterwards the modules the
    two trees share (the deadlock of CI) are loaded, so neither a fit nor a first dataset run imports them."""
    code = textwrap.dedent("""
        import sys, threading
        from unirl_ray.runtime.imports import LIBRARIES, import_ray_library
        errors = []
        def go(lib):
            try:
                import_ray_library(lib)
            except BaseException as exc:
                errors.append(repr(exc))
        ts = [threading.Thread(target=go, args=(lib,)) for lib in ("train", "data")]
        [t.start() for t in ts]; [t.join(240) for t in ts]
        assert not errors, errors
        missing = [m for lib in ("train", "data") for m in LIBRARIES[lib] if m not in sys.modules]
        assert not missing, missing
        assert "ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator" in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.ray
@pytest.mark.own_ray
def test_an_embedded_ray_init_imports_nothing_the_prefetch_thread_could():
    """``ensure_ray`` imports the ``init`` group, then lets a thread import the driver's next libraries while
    ``ray.init`` starts the daemons: safe only if ``ray.init`` itself then imports no module of its own (two
    threads importing the same modules can deadlock, see the module docstring). A fresh interpreter, a real
    embedded Ray; then the same with the prefetch, which must leave the libraries loaded."""
    code = textwrap.dedent("""
        import sys
        from unirl_ray.runtime.cluster import RayConfig, ensure_ray
        from unirl_ray.runtime.imports import LIBRARIES, import_ray_library
        import ray
        import_ray_library("init")
        before = set(sys.modules)
        ensure_ray(RayConfig(local_num_cpus=1))
        new = sorted(m for m in set(sys.modules) - before if not m.startswith("unirl_ray"))
        assert not new, f"ray.init imported {new}: add them to LIBRARIES['init']"
        ray.shutdown()
        ensure_ray(RayConfig(local_num_cpus=1), prefetch=("train", "mlflow"))
        missing = [m for lib in ("train", "mlflow") for m in LIBRARIES[lib] if m not in sys.modules]
        assert not missing, missing
        ray.shutdown()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
