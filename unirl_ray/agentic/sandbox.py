"""``PythonSandbox``: run code a model wrote (an agent's tool call) where it can do no harm.

Each ``run`` gets a fresh scratch directory and a child process that:

- runs as an unprivileged uid of its own (where the parent is root: a uid no other process has, taken for
  this run only, so runs that go on at once never share a limit) with ``RLIMIT_NPROC`` (so a fork bomb
  stops at ``processes``, and only its own run is short of processes), ``RLIMIT_CPU``, ``RLIMIT_AS``
  (memory), ``RLIMIT_FSIZE`` (file size) and ``RLIMIT_NOFILE``;
- lives in new user, network, mount and PID namespaces (``unshare``): no network interface is up (not even
  the host's loopback services are reachable), every mount is remounted read-only except the scratch
  directory, which is its working directory and HOME; every process it starts dies with it;
- drops every capability (bounding set emptied, ``no_new_privs``) before the code runs, so it cannot undo
  the read-only mounts;
- inherits no environment (only ``PATH`` and ``LANG``): none of the trainer's variables or secrets;
- is killed (the whole PID namespace) after ``wall_s``; the result says so (``timed_out``, ``reason``).

It needs Linux with unprivileged user namespaces and ``unshare`` (util-linux), and a parent that may
switch uids (root, as in a container) or already is unprivileged. An unprivileged parent's runs keep its
uid: ``processes`` then counts on top of that user's processes at the start of a run, and runs that go on
at once share what is left. Where any of that is missing
``PythonSandbox.available()`` is False and ``run`` raises ``SandboxUnavailable``: the tool is refused,
never run unsandboxed. A mount that cannot be made read-only while writable also refuses the run.
"""

from __future__ import annotations

import functools
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

NOBODY = 65534
"""The uid / gid the availability probe runs as (outside its user namespace)."""
RUN_UIDS = range(0x6A000000, 0x6A000000 + (1 << 24))
"""Where a root parent takes each run's own uid / gid from (far above any account's), one not in use."""

_BOOTSTRAP = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
scratch, main = sys.argv[1], sys.argv[2]

def mount(source, target, flags):
    if libc.mount(source, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)

mount(None, "/", MS_REC | MS_PRIVATE)
mount(scratch.encode(), scratch, MS_BIND)
for line in open("/proc/self/mountinfo"):
    point = line.split()[4].replace("\\040", " ")
    if point == scratch:
        continue
    try:
        mount(None, point, MS_REMOUNT | MS_BIND | MS_RDONLY)
    except OSError:
        try:
            if not os.statvfs(point).f_flag & os.ST_RDONLY:
                sys.stderr.write("sandbox: cannot make %s read-only; refusing to run\n" % point)
                os._exit(97)
        except OSError:
            pass  # a mount point the namespace cannot reach
for cap in range(64):  # empty the bounding set: the code's exec keeps no capability
    libc.prctl(24, cap, 0, 0, 0)
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    os._exit(98)
os.chdir(scratch)
os.execv(sys.executable, [sys.executable, "-I", "-S", main])
'''


class SandboxUnavailable(RuntimeError):
    """This machine cannot sandbox code (no user namespaces, no ``unshare``); the tool is refused."""


@dataclass(kw_only=True)
class SandboxLimits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0
    """Wall-clock time before every process of the run is killed."""
    cpu_s: int = 5
    """CPU seconds per process (``RLIMIT_CPU``)."""
    memory_mb: int = 512
    """Address space per process (``RLIMIT_AS``)."""
    file_mb: int = 16
    """Largest file a process may write (``RLIMIT_FSIZE``)."""
    processes: int = 16
    """Processes of one run at once (``RLIMIT_NPROC`` of its own uid): a fork bomb stops here."""
    open_files: int = 64
    """Open file descriptors per process."""
    output_chars: int = 8192
    """stdout / stderr kept (each); the rest is cut and marked."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_mb", "processes", "open_files", "output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox limit {name} must be a number > 0, got {value!r}")


@dataclass(kw_only=True)
class SandboxResult:
    """What a sandboxed run did."""

    stdout: str
    """Its standard output (cut to ``output_chars``)."""
    stderr: str
    """Its standard error (cut to ``output_chars``)."""
    exit_code: int | None
    """The process' exit status (negative: the signal that ended it); None when it was killed on timeout."""
    timed_out: bool
    """Killed after ``wall_s``."""
    reason: str | None
    """Why it did not end normally (timeout, a signal, a limit), for the model's observation and the metrics."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters cut]"


def _check_available() -> str | None:
    """None where sandboxing works here, else why not."""
    return _probe()[1]


@functools.cache
def _probe() -> tuple[str | None, str | None]:
    """(the interpreter the sandbox runs, None) where sandboxing works here, else (None, why not). The
    interpreter is the first of this one, ``/usr/bin/python3`` and ``/usr/local/bin/python3`` that the sandbox
    user can run inside the namespaces (the trainer's own may sit in a home directory closed to others)."""
    if not sys.platform.startswith("linux"):
        return None, "the sandbox needs Linux (user and network namespaces)"
    unshare = shutil.which("unshare")
    if unshare is None:
        return None, "the sandbox needs `unshare` (util-linux) on PATH"
    why = "no Python interpreter the sandbox user may run"
    for candidate in dict.fromkeys([os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]):
        if not os.path.isfile(candidate):
            continue
        try:
            done = subprocess.run([unshare, "-r", "-n", "-m", "-p", "--fork", candidate, "-I", "-S", "-c", "pass"],
                                  capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"},
                                  preexec_fn=functools.partial(_drop_to, NOBODY) if os.geteuid() == 0 else None)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"unprivileged user namespaces do not work here ({exc})"
        if done.returncode == 0:
            return candidate, None
        why = f"unprivileged user namespaces do not work here, or {candidate} is closed to the sandbox user " \
              f"({done.stderr.decode(errors='replace').strip()})"
    return None, why


def _uids_in_use() -> dict[int, int]:
    """``{uid: processes}`` of the processes alive now."""
    counts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            counts[uid] = counts.get(uid, 0) + 1
    return counts


_claimed: set[int] = set()  # run uids of this process' runs in flight
_claim_lock = threading.Lock()


def _claim_uid() -> int:
    """A uid of ``RUN_UIDS`` that no process has and no run of this process holds (until ``_release_uid``).
    Another process' sandbox picking the same one at the same instant is a 1-in-millions chance that
    only makes the two runs share their process limit."""
    with _claim_lock:
        live = _uids_in_use()
        while True:
            uid = random.choice(RUN_UIDS)
            if uid not in live and uid not in _claimed:
                _claimed.add(uid)
                return uid


def _release_uid(uid: int) -> None:
    with _claim_lock:
        _claimed.discard(uid)


def _wait_for_exit(uid: int, timeout_s: float = 10.0) -> None:
    """Until the processes a run left under its own ``uid`` (a killed fork bomb's, dying with its PID namespace)
    are gone, bounded."""
    import time

    deadline = time.monotonic() + timeout_s
    while uid in _uids_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


class PythonSandbox:
    """Runs Python source in an isolated child process (see the module docstring)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    @staticmethod
    def available() -> bool:
        return _check_available() is None

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (a Python program) and return what it printed and how it ended."""
        why = _check_available()
        if why is not None:
            raise SandboxUnavailable(f"cannot sandbox the Python tool: {why}; the tool is refused (it never runs "
                                     "unsandboxed)")
        limits = self.limits
        scratch = os.path.realpath(tempfile.mkdtemp(prefix="unirl-sandbox-"))
        root = os.geteuid() == 0
        uid = _claim_uid() if root else os.getuid()  # released in the finally below
        already = 0 if root else _uids_in_use().get(uid, 0)  # an unprivileged parent's limit counts its own processes
        try:
            main = os.path.join(scratch, "main.py")
            with open(main, "w", encoding="utf-8") as f:
                f.write(code)
            if root:
                os.chown(scratch, uid, uid)
                os.chown(main, uid, uid)

            def child() -> None:
                os.setsid()  # its own process group: a timeout kills all of it
                if root:
                    _drop_to(uid)
                mb = 1024 * 1024
                for which, value in ((resource.RLIMIT_CPU, int(limits.cpu_s)),
                                     (resource.RLIMIT_AS, int(limits.memory_mb) * mb),
                                     (resource.RLIMIT_FSIZE, int(limits.file_mb) * mb),
                                     (resource.RLIMIT_NPROC, already + int(limits.processes)),
                                     (resource.RLIMIT_NOFILE, int(limits.open_files)),
                                     (resource.RLIMIT_CORE, 0)):
                    resource.setrlimit(which, (value, value))

            command = [shutil.which("unshare"), "-r", "-n", "-m", "-p", "--fork", "--kill-child", "--mount-proc",
                       _probe()[0], "-I", "-S", "-c", _BOOTSTRAP, scratch, main]
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch}
            proc = subprocess.Popen(command, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, preexec_fn=child, close_fds=True)
            timed_out = False
            try:
                out, err = proc.communicate(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # unshare dies, its namespace's init with it: the kernel kills the rest
                out, err = proc.communicate(timeout=30)
            if root:  # (an unprivileged parent's uid also has its other processes, which come and go)
                _wait_for_exit(uid)
            stdout, stderr = (b.decode("utf-8", errors="replace") for b in (out, err))
            code_ = None if timed_out else proc.returncode
            reason = None
            if timed_out:
                reason = f"killed after the sandbox's wall-clock limit of {limits.wall_s:g}s"
            elif code_ is not None and code_ < 0:
                reason = f"ended by signal {signal.Signals(-code_).name}"
            elif code_ in (97, 98) or (code_ and stderr.startswith("unshare:")):
                reason = f"the sandbox could not be set up ({stderr.strip()[:200]}); the code did not run"
            elif code_ is not None and code_ >= 128 + 1 and code_ - 128 in {s.value for s in signal.Signals}:
                reason = f"ended by signal {signal.Signals(code_ - 128).name} (a CPU, memory or file limit)"
            elif "MemoryError" in stderr:
                reason = f"hit the memory limit of {limits.memory_mb} MB"
            return SandboxResult(stdout=_cut(stdout, limits.output_chars), stderr=_cut(stderr, limits.output_chars),
                                 exit_code=code_, timed_out=timed_out, reason=reason)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            if root:
                _release_uid(uid)
