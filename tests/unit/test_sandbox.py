"""The agent tools' sandbox and parsers (no Ray). Every escape test must fail to escape: a network
connection, a write outside the scratch directory, reading the trainer's environment, a fork bomb, an
infinite loop, a memory bomb; and the sandbox refuses to run where it cannot isolate (never runs open)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from unirl_ray.agentic import (
    Calculator,
    PythonSandbox,
    PythonTool,
    SandboxLimits,
    SandboxUnavailable,
    ToolError,
    parse_tool_calls,
)
from unirl_ray.agentic import sandbox as sandbox_module

needs_sandbox = pytest.mark.skipif(not PythonSandbox.available(), reason="no user namespaces / unshare here")
FAST = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, processes=16)


@pytest.fixture(params=["call", "session"])
def run(request):
    """``code -> SandboxResult``: a fresh process per call (``PythonSandbox.run``), or the runs of one
    ``PythonSession`` (the Python tool's process per trajectory), which must hold every escape test as well."""
    if request.param == "call":
        yield PythonSandbox(FAST).run
    else:
        with PythonSandbox(FAST).session() as session:
            yield session.run


@needs_sandbox
def test_code_runs_in_its_scratch_directory_with_nothing_of_the_trainers_environment(run, monkeypatch):
    monkeypatch.setenv("UNIRL_TEST_SECRET", "hunter2")
    code = (
        "import os, glob\n"
        "print(os.getcwd().startswith('/tmp/unirl-sandbox-'), sorted(os.environ))\n"
        "print('SECRET' if any('hunter2' in v for v in os.environ.values()) else 'clean')\n"
        "seen = []\n"
        "for path in glob.glob('/proc/[0-9]*/environ'):\n"
        "    try:\n"
        "        seen.append(open(path, 'rb').read())\n"
        "    except OSError:\n"
        "        pass\n"
        "print('LEAK' if any(b'hunter2' in e for e in seen) else 'no leak', len(glob.glob('/proc/[0-9]*')))\n"
        "open('note.txt', 'w').write('scratch is writable')\n"
        "print(open('note.txt').read())\n"
    )
    result = run(code)
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[0] == "True ['HOME', 'LANG', 'PATH']" and lines[1] == "clean"
    assert lines[2].startswith("no leak") and int(lines[2].split()[-1]) <= 4  # its own PID namespace: a few processes
    assert lines[3] == "scratch is writable"


@needs_sandbox
def test_no_network_not_even_the_hosts_loopback(run):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(server.accept())
                return
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (f"import socket\n"
            f"for host in ('127.0.0.1', '8.8.8.8', 'pypi.org'):\n"
            f"    try:\n"
            f"        socket.create_connection((host, {port} if host == '127.0.0.1' else 443), timeout=2)\n"
            f"        print('CONNECTED', host)\n"
            f"    except OSError as exc:\n"
            f"        print('refused', host, type(exc).__name__)\n")
    result = run(code)
    done.set()
    thread.join(timeout=10)
    server.close()
    assert "CONNECTED" not in result.stdout and result.stdout.count("refused") == 3, result
    assert not accepted


@needs_sandbox
def test_nothing_outside_the_scratch_directory_can_be_written_or_made_writable(run, tmp_path):
    os.chmod(tmp_path, 0o777)
    targets = [str(tmp_path / "escape.txt"), "/tmp/unirl-escape.txt", "/dev/shm/unirl-escape.txt",
               os.path.expanduser("~/unirl-escape.txt"), "/etc/unirl-escape"]
    code = ("import os, subprocess\n"
            f"for path in {targets!r}:\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('WROTE', path)\n"
            "    except OSError as exc:\n"
            "        print('refused', exc.errno)\n"
            "for args in (['mount', '-o', 'remount,rw,bind', '/tmp'], ['mount', '-t', 'tmpfs', 'x', '/tmp']):\n"
            "    try:\n"
            "        ok = subprocess.run(args, capture_output=True).returncode == 0\n"
            "    except OSError:\n"
            "        ok = False\n"
            "    print('REMOUNTED' if ok else 'mount refused')\n")
    result = run(code)
    assert "WROTE" not in result.stdout and "REMOUNTED" not in result.stdout, result
    assert result.stdout.count("refused") == len(targets) + 2
    assert not any(os.path.exists(t) for t in targets)


@needs_sandbox
def test_a_fork_bomb_an_infinite_loop_and_a_memory_bomb_are_stopped_and_reported(run):
    t0 = time.monotonic()
    bomb = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert bomb.timed_out and "wall-clock limit" in bomb.reason, bomb
    loop = run("while True:\n    pass\n")
    assert not loop.ok and ("CPU 2s" in loop.reason or "wall-clock" in loop.reason), loop  # the CPU limit or the clock
    assert "could not be set up" not in loop.reason and not loop.stderr.startswith("unshare:")
    memory = run("x = bytearray(8 * 1024 ** 3)\nprint('ALLOCATED')\n")
    assert "ALLOCATED" not in memory.stdout and not memory.ok and "MemoryError" in memory.stderr, memory
    assert "memory limit" in memory.reason
    assert time.monotonic() - t0 < 3 * FAST.wall_s + 20  # every run ended (nothing hung)
    assert run("print(6 * 7)").stdout.strip() == "42"  # and the machine still runs sandboxes


@needs_sandbox
@pytest.mark.skipif(os.geteuid() != 0, reason="a run gets a uid of its own only under a root parent")
def test_runs_at_the_same_time_have_a_process_limit_each_and_a_fork_bomb_starves_only_its_own():
    """Eight runs at once (an agent's tool_workers), each starting a child process, all run while a fork bomb
    fills its own limit: with one uid for every run they shared one RLIMIT_NPROC and some failed to start
    ("unshare: fork failed")."""
    from concurrent.futures import ThreadPoolExecutor

    sandbox = PythonSandbox(FAST)
    bomb_code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    child = ("import subprocess, sys\n"
             "print(subprocess.run([sys.executable, '-c', 'print({} * 2)'], capture_output=True, text=True).stdout.strip())\n")
    with ThreadPoolExecutor(9) as pool:
        bomb = pool.submit(sandbox.run, bomb_code)
        time.sleep(0.5)  # the bomb is at its limit
        runs = list(pool.map(lambda i: sandbox.run(child.format(i)), range(8)))
    assert [(r.stdout.strip(), r.reason) for r in runs] == [(str(2 * i), None) for i in range(8)]
    assert bomb.result().timed_out
    assert not sandbox_module._claimed  # every run gave its uid back


def test_without_namespaces_the_python_tool_is_refused_not_run_open(monkeypatch):
    sandbox_module._probe.cache_clear()
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    try:
        assert not PythonSandbox.available()
        with pytest.raises(SandboxUnavailable, match="never runs unsandboxed"):
            PythonTool().for_trajectory()(code="print(1)")
        with pytest.raises(SandboxUnavailable, match="never runs unsandboxed"):
            PythonTool(session=False)(code="print(1)")
    finally:
        monkeypatch.undo()
        sandbox_module._probe.cache_clear()


@needs_sandbox
def test_the_python_tool_reports_output_errors_and_limits_to_the_model():
    tool = PythonTool(limits={"wall_s": 5.0, "cpu_s": 3}, session=False)
    assert tool(code="print(sum(range(10)))") == "45"
    assert "ZeroDivisionError" in tool(code="1 / 0")
    assert tool(code="x = 1") == "(no output)"
    with pytest.raises(ToolError, match="python takes only 'code'"):
        tool(code="1", cmd="ls")
    with pytest.raises(ValueError, match="sandbox limit wall_s must be a number > 0"):
        SandboxLimits(wall_s=0)


def _processes_of(uid):
    return sandbox_module._uids_in_use().get(uid, 0)


@needs_sandbox
def test_a_session_keeps_its_state_ends_on_a_timeout_and_leaves_nothing_behind(request):
    """The Python tool's process per trajectory: variables and files live from call to call; a call past the
    wall clock (or one that ends the process) ends the session and says so, and the next call starts a new
    one with no variables; ``close`` kills everything it started (a process left running in the background
    included) and removes its scratch directory; two trajectories of one shared tool never share a process."""
    shared = PythonTool(limits={"wall_s": 3.0, "cpu_s": 4, "memory_mb": 256})
    one, two = shared.for_trajectory(), shared.for_trajectory()
    request.addfinalizer(one.close)  # (idempotent) also when an assertion below fails
    request.addfinalizer(two.close)
    assert one is not two and one._session is not two._session
    assert one(code="x = 20\nopen('kept.txt', 'w').write('file')") == "(no output)"
    assert two(code="x = 1") == "(no output)"
    assert one(code="x += 1\nprint(x * 2, open('kept.txt').read())") == "42 file"  # its own state only
    assert two(code="print(x)") == "1"
    traceback = one(code="import sys\nprint('out')\nprint('err', file=sys.stderr)\n1 / 0")
    assert traceback.startswith("out\n") and "err\nTraceback" in traceback and "ZeroDivisionError" in traceback
    assert 'main.py' not in traceback  # the session's own frames are not shown to the model
    assert one(code="print(x)") == "21"  # an exception does not end the session

    session = one._session
    box = session._box
    scratch, uid = box.scratch, box.uid
    assert one(code="import subprocess\nsubprocess.Popen(['sleep', '300'])\nprint('started')") == "started"
    late = one(code="print('before', flush=True)\nimport time\ntime.sleep(30)")
    assert late.startswith("before") and "wall-clock limit of 3s" in late and "the session is gone" in late
    assert not os.path.exists(scratch) and session._proc is None
    if os.geteuid() == 0:
        assert _processes_of(uid) == 0  # the background sleep died with the session
    assert "NameError" in one(code="print(x)") and session.restarts == 1  # a new session, no variables
    ended = one(code="import os\nos._exit(3)")
    assert "exit code 3" in ended and "the session is gone" in ended
    assert one(code="print('again')") == "again" and session.restarts == 2

    one(code="import subprocess\nsubprocess.Popen(['sleep', '300'])")
    box = session._box
    scratch, uid = box.scratch, box.uid
    one.close()
    two.close()
    assert not os.path.exists(scratch)
    if os.geteuid() == 0:
        assert _processes_of(uid) == 0 and not sandbox_module._claimed
    with pytest.raises(RuntimeError, match="closed"):
        one(code="print(1)")
    with pytest.raises(RuntimeError, match="for_trajectory"):
        shared(code="print(1)")  # the shared object itself has no process: it is never run directly


def test_the_calculator_computes_arithmetic_and_refuses_everything_else():
    calc = Calculator()
    assert calc(expression="(3 + 4) * 2") == "14" and calc(expression="7 / 2") == "3.5"
    assert calc(expression="sqrt(16) + 2 ** 3 - -1") == "13" and calc(expression="round(pi, 3)") == "3.142"
    for bad, message in (("__import__('os').system('id')", "only numbers"), ("().__class__", "only numbers"),
                         ("x + 1", "only numbers"), ("2 ** 100000", "exponents above 100"),
                         ("1 / 0", "cannot compute"), ("1 +", "not an arithmetic expression"),
                         ("", "non-empty string"), ("9" * 300, "longer than 200")):
        with pytest.raises(ToolError, match=message):
            calc(expression=bad)
    with pytest.raises(ToolError, match="only 'expression'"):
        calc(expression="1", code="2")


def test_tool_calls_are_parsed_and_malformed_ones_carry_their_error():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>{\"arguments\": {}}</tool_call>"
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call><tool_call>{"name": "x"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "2+2"}, True), ("python", {"code": "print(1)"}, True)]
    assert "not valid JSON" in calls[2].error and 'needs a "name"' in calls[3].error
    assert '"arguments" must be an object' in calls[4].error and "unclosed <tool_call>" in calls[5].error
    assert parse_tool_calls("no calls here") == []
