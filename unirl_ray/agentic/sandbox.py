"""``PythonSandbox``: run code a model wrote (an agent's tool call) where it can do no harm.

Each ``run`` gets a fresh scratch directory and a child process that (``PythonSession``: one such process
and directory for several runs, state kept between them):

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
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
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
os.write(1, b"\x06")  # STARTED: isolated, limits set; the code runs next
os.execv(sys.executable, [sys.executable, "-I", "-S", main])
'''


STARTED = b"\x06"
"""The byte the bootstrap writes to stdout just before the code's interpreter starts: its absence means the
sandbox could not be set up and the code never ran."""


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
    deadline = time.monotonic() + timeout_s
    while uid in _uids_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


class _Box:
    """What one sandboxed process needs: a scratch directory holding ``main.py`` and, under a root parent, a
    uid of its own. ``spawn`` starts the namespaced child; ``cleanup`` removes the directory and frees the uid."""

    def __init__(self, limits: SandboxLimits, program: str) -> None:
        why = _check_available()
        if why is not None:
            raise SandboxUnavailable(f"cannot sandbox the Python tool: {why}; the tool is refused (it never runs "
                                     "unsandboxed)")
        self.limits = limits
        self.scratch = os.path.realpath(tempfile.mkdtemp(prefix="unirl-sandbox-"))
        self.root = os.geteuid() == 0
        self.uid = _claim_uid() if self.root else os.getuid()  # released by cleanup
        self.already = 0 if self.root else _uids_in_use().get(self.uid, 0)  # an unprivileged parent's limit counts its own processes
        try:
            self.main = os.path.join(self.scratch, "main.py")
            with open(self.main, "w", encoding="utf-8") as f:
                f.write(program)
            if self.root:
                os.chown(self.scratch, self.uid, self.uid)
                os.chown(self.main, self.uid, self.uid)
        except BaseException:
            self.cleanup()
            raise

    def spawn(self, stdin: int) -> subprocess.Popen:
        limits, root, uid, already = self.limits, self.root, self.uid, self.already

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
                   _probe()[0], "-I", "-S", "-c", _BOOTSTRAP, self.scratch, self.main]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.scratch}
        return subprocess.Popen(command, cwd=self.scratch, env=env, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=child, close_fds=True)

    def kill(self, proc: subprocess.Popen) -> None:
        """Kill ``proc`` and everything it started (unshare dies, its namespace's init with it: the kernel kills
        the rest), then wait, bounded, until the run's own uid has no process left."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        if self.root:  # (an unprivileged parent's uid also has its other processes, which come and go)
            _wait_for_exit(self.uid)

    def cleanup(self) -> None:
        """Remove the scratch directory and free the uid (once)."""
        if self.scratch is None:
            return
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch = None
        if self.root:
            _release_uid(self.uid)


def _reason(limits: SandboxLimits, timed_out: bool, code: int | None, stderr: str, started: bool) -> str | None:
    """Why a run did not end normally (None: it did); ``started``: the bootstrap got as far as the code."""
    if timed_out:
        return f"killed after the sandbox's wall-clock limit of {limits.wall_s:g}s"
    if not started and code:
        return f"the sandbox could not be set up ({stderr.strip()[:200]}); the code did not run"
    if code is not None and code < 0:
        return f"ended by signal {signal.Signals(-code).name}"
    if code and stderr.startswith("unshare:"):  # the code's process died of a signal unshare could not pass on
        return (f"ended by a signal, from one of its limits (CPU {limits.cpu_s}s, memory {limits.memory_mb} MB, "
                f"file size {limits.file_mb} MB)")
    if code is not None and code >= 128 + 1 and code - 128 in {s.value for s in signal.Signals}:
        return f"ended by signal {signal.Signals(code - 128).name} (a CPU, memory or file limit)"
    if "MemoryError" in stderr:
        return f"hit the memory limit of {limits.memory_mb} MB"
    return None


def _result(limits: SandboxLimits, out: bytes, err: bytes, code: int | None, timed_out: bool, started: bool,
            reason: str | None = None) -> SandboxResult:
    stdout, stderr = (b.decode("utf-8", errors="replace") for b in (out, err))
    reason = reason or _reason(limits, timed_out, code, stderr, started)
    if started:  # unshare's own complaint about passing on a signal is not the code's output
        stderr = "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("unshare: "))
    return SandboxResult(stdout=_cut(stdout, limits.output_chars), stderr=_cut(stderr, limits.output_chars),
                         exit_code=code, timed_out=timed_out,
                         reason=reason)


class PythonSandbox:
    """Runs Python source in an isolated child process (see the module docstring)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    @staticmethod
    def available() -> bool:
        return _check_available() is None

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (a Python program) in a process of its own and return what it printed and how it ended."""
        box = _Box(self.limits, code)
        try:
            proc = box.spawn(subprocess.DEVNULL)
            timed_out = False
            try:
                out, err = proc.communicate(timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate(timeout=30)
            if box.root:
                _wait_for_exit(box.uid)
            started = out[:1] == STARTED
            return _result(self.limits, out[1:] if started else out, err, None if timed_out else proc.returncode,
                           timed_out, started)
        finally:
            box.cleanup()

    def session(self) -> PythonSession:
        """A sandboxed Python process that keeps its state between runs (``PythonSession``)."""
        return PythonSession(self.limits)


_SESSION = r'''
import os, sys, traceback
commands = os.fdopen(os.dup(0), "rb", buffering=0)
replies = os.dup(1)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
scope = {"__name__": "__main__", "__builtins__": __builtins__}


def read_exact(n):
    data = b""
    while len(data) < n:
        chunk = commands.read(n - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data


def captured(fd, name):
    os.unlink(name)  # a process the code left running keeps writing to its own (now nameless) file
    os.lseek(fd, 0, 0)
    parts = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        parts.append(chunk)
    os.close(fd)
    return b"".join(parts)


while True:
    header = commands.readline()
    if not header:
        os._exit(0)  # the parent closed the session (or died)
    code = read_exact(int(header)).decode("utf-8", errors="replace")
    out = os.open(".stdout", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(".stderr", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    status = 0
    try:
        exec(compile(code, "<tool call>", "exec"), scope)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # the traceback from the code's own frames on
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    body_out, body_err = captured(out, ".stdout"), captured(err, ".stderr")
    message = b"%d %d %d\n" % (status, len(body_out), len(body_err)) + body_out + body_err
    while message:
        message = message[os.write(replies, message):]
'''


class PythonSession:
    """One sandboxed Python process that keeps its globals (and its scratch directory) from one ``run`` to the
    next, like a notebook kernel: the Python tool's process per trajectory. Isolation and limits are those of
    ``PythonSandbox`` (the module docstring), except that the process lives for the whole session: ``wall_s``
    holds per run, ``cpu_s`` and ``processes`` for the session's life. A run that times out (or ends the process:
    ``os._exit``, a signal, a limit) ends the session, and its result says so; the next run starts a new one,
    with no state. The process starts at the first ``run``; ``close`` (the environment's, at the end of the
    trajectory) kills it and removes its scratch directory. It also exits by itself when the parent goes away."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._box: _Box | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        self._buffer = bytearray()  # what the process wrote to the reply channel and was not read yet
        self.restarts = 0
        """How many times a run found its session gone and started a new one."""

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` in the session's process and return what it printed and how it ended (``exit_code``: 0, or
        the ``SystemExit`` code; 1 for an uncaught exception, whose traceback is in ``stderr``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this Python session is closed")
            if self._proc is not None and self._proc.poll() is not None:  # ended between runs
                self._drop()
            if self._proc is None:
                self.restarts += self._started
                self._started = True
                self._box = _Box(self.limits, _SESSION)
                self._proc = self._box.spawn(subprocess.PIPE)
                self._buffer = bytearray()
            proc, box, buffer = self._proc, self._box, self._buffer
        data = code.encode("utf-8")
        try:
            proc.stdin.write(b"%d\n" % len(data) + data)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # it died; the reply read below sees the end
        deadline = time.monotonic() + self.limits.wall_s
        try:
            reply = _read_reply(proc.stdout.fileno(), buffer, deadline)
        except (OSError, ValueError):  # closed under it (``close`` from another thread)
            reply = "ended"
        if not isinstance(reply, str):
            status, out, err = reply
            return _result(self.limits, out, err, status, False, True)
        started, timed_out = buffer[:1] == STARTED, reply == "timeout"
        out, err = (_read_file(box, name) for name in (".stdout", ".stderr"))
        box.kill(proc)
        try:
            err += proc.stderr.read() or b""  # what unshare or the bootstrap said, if it ended early
        except (OSError, ValueError):
            pass
        with self._lock:
            if self._proc is proc:
                self._drop()
        code_ = None if timed_out else proc.returncode
        if self._closed:
            reason = "the session was closed while this ran"
        elif reply == "malformed":
            reason = "the code wrote over the sandbox's reply channel"
        else:
            reason = _reason(self.limits, timed_out, code_, err.decode("utf-8", errors="replace"), started) or \
                f"the Python process ended (exit code {code_})"
        reason += "; the session is gone: the next call starts a new one, with no variables"
        return _result(self.limits, out, err, code_, timed_out, started, reason)

    def _drop(self) -> None:
        proc, box, self._proc, self._box = self._proc, self._box, None, None
        if proc is not None:
            if proc.poll() is None:
                box.kill(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    pipe.close()
                except OSError:
                    pass
        if box is not None:
            box.cleanup()

    def close(self) -> None:
        """Kill the process (and everything it started) and remove the scratch directory; idempotent."""
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_file(box: _Box, name: str) -> bytes:
    """What a session's run printed so far (its capture file ``name``), at most ``output_chars`` x 4 bytes."""
    scratch = box.scratch
    try:
        with open(os.path.join(scratch, name), "rb") as f:
            return f.read(4 * box.limits.output_chars + 4)
    except (OSError, TypeError):  # gone (closed meanwhile), or never written
        return b""


def _read_reply(fd: int, buffer: bytearray, deadline: float) -> tuple[int, bytes, bytes] | str:
    """A session's reply read from ``fd`` before ``deadline``: after the bootstrap's ``STARTED`` byte (kept at the
    head of ``buffer``, the process' unread output), ``status len_out len_err\\n`` + stdout + stderr; else why
    not: ``"ended"`` (the process closed the channel), ``"timeout"`` or ``"malformed"`` (the code wrote to it)."""
    while True:
        if buffer[:1] not in (b"", STARTED):
            return "malformed"
        newline = buffer.find(b"\n")
        if newline > 0:
            try:
                status, n_out, n_err = (int(x) for x in buffer[1:newline].split())
            except ValueError:
                return "malformed"
            if n_out < 0 or n_err < 0:
                return "malformed"
            end = newline + 1 + n_out + n_err
            if len(buffer) >= end:
                reply = status, bytes(buffer[newline + 1 : newline + 1 + n_out]), bytes(buffer[newline + 1 + n_out : end])
                del buffer[1:end]  # keep the STARTED byte: it heads the next reply
                return reply
        elif len(buffer) > 64:
            return "malformed"
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return "timeout"
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return "ended"
        buffer += chunk
