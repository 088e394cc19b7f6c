"""Where a command's CPU goes, by process kind: the driver, Ray Train's controller and workers, Serve
replicas, this project's actors, Ray's own daemons.

A benchmark, not a test. It runs the command as a child process and reads ``/proc/<pid>/stat`` of every
process on the machine every ``--interval`` seconds until the command ends; a process is named by the
title Ray gives it (``ray::TrainController``, ``ray::RayTrainWorker``, ``ray::SERVE_REPLICA::...``; the most
specific one it had, not ``ray::IDLE``) or by its program. CPU is user + system time used while the
command ran (processes that were already running count only what they used meanwhile). What a process
used between the last sample and its exit is missed, so the totals are a lower bound by up to one
interval per process.

    python bench/process_cpu.py -- .venv/bin/python -m pytest -q -p no:cacheprovider tests/ray/test_e2e_ar.py
    python bench/process_cpu.py --json-out /tmp/cpu.json -- .venv/bin/python recipes/ar.py trainer.num_steps=2
    python bench/process_cpu.py --timeline 1 -- .venv/bin/python recipes/ar.py trainer.num_steps=2   # serial chains

It answers the questions the CI budget and the cold start raise: is a run CPU-bound (utilisation of
the cores near 1) or waiting, and how many CPU-seconds each Ray Train run, Serve app and actor costs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit_json, fmt_num, loadavg_1min, print_table  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    start_ticks: int  # CPU ticks it had used when first seen (0 for a process started meanwhile)
    ticks: int = 0
    title: str = ""  # the most specific title seen: an actor's name rather than the ray::IDLE before or after it


def _read(pid: str) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12]), cmdline  # utime + stime


def kind(cmdline: str) -> str:
    """A process's kind from its title: Ray's actor / task name without run names, ids and methods."""
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0][len("ray::"):]
        if name.startswith("SERVE_REPLICA::"):  # SERVE_REPLICA::<app>#<Deployment>#<id>
            parts = name[len("SERVE_REPLICA::"):].split("#")
            return f"ray::ServeReplica:{parts[1] if len(parts) > 1 else parts[0]}"
        name = name.rsplit(":", 1)[-1]  # <named actor>:<Class>.<method> -> <Class>.<method>
        name = re.split(r"[.(]", name, maxsplit=1)[0]  # drop the method or the task's arguments
        return f"ray::{name}"
    words = cmdline.split()
    if not words:
        return "?"
    program = os.path.basename(words[0])
    if program.startswith("python") and len(words) > 1:
        script = next((w for w in words[1:] if not w.startswith("-")), words[1])
        if words[1] in ("-m", "-c"):
            script = words[2] if words[1] == "-m" and len(words) > 2 else "-c"
        return f"python {os.path.basename(script)}"
    return program


def sample(procs: dict[str, Proc], baseline: bool) -> dict[str, int]:
    """Read every process; update ``procs``; the CPU ticks each used since the previous sample."""
    used: dict[str, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        read = _read(pid)
        if read is None:
            continue
        ticks, cmdline = read
        proc = procs.get(pid)
        if proc is None:
            proc = procs[pid] = Proc(start_ticks=ticks if baseline else 0, ticks=ticks if baseline else 0)
        used[pid] = ticks - proc.ticks
        proc.ticks = ticks
        if cmdline and (not proc.title or not cmdline.startswith("ray::IDLE")):
            proc.title = cmdline
    return used


class Timeline:
    """CPU per window of ``window_s`` seconds: its utilisation of the cores and the kinds that used most.

    A window at 1/cores utilisation with one kind in it is a serial chain (one process importing or
    building while the other cores wait): the latency a start-up pays that more cores cannot buy back."""

    def __init__(self, window_s: float, cores: int, top: int = 3) -> None:
        self.window_s, self.cores, self.top = window_s, cores, top
        self.start = self.next = time.monotonic()
        self.acc: dict[str, float] = {}

    def add(self, used: dict[str, int], procs: dict[str, Proc], me: str) -> None:
        for pid, ticks in used.items():
            if pid != me and ticks > 0:
                name = kind(procs[pid].title)
                self.acc[name] = self.acc.get(name, 0.0) + ticks / TICK
        now = time.monotonic()
        if now - self.next >= self.window_s:
            total = sum(self.acc.values())
            ranked = sorted(self.acc.items(), key=lambda kv: -kv[1])[: self.top]
            print(f"[{self.next - self.start:7.1f}-{now - self.start:7.1f} s] {total / ((now - self.next) * self.cores):4.0%} "
                  + ", ".join(f"{name} {cpu:.1f}" for name, cpu in ranked), flush=True)
            self.acc, self.next = {}, now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples (default 0.2)")
    parser.add_argument("--top", type=int, default=25, help="kinds shown (default 25)")
    parser.add_argument("--json-out", help="write the JSON result line here too")
    parser.add_argument("--timeline", type=float, metavar="SECONDS",
                        help="also print, every SECONDS, the cores' utilisation and the kinds that used the most CPU")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")

    load_start = loadavg_1min()
    procs: dict[str, Proc] = {}
    sample(procs, baseline=True)
    me = str(os.getpid())
    start = time.monotonic()
    timeline = Timeline(args.timeline, os.cpu_count() or 1) if args.timeline else None
    child = subprocess.Popen(command)
    while child.poll() is None:
        time.sleep(args.interval)
        used = sample(procs, baseline=False)
        if timeline is not None:
            timeline.add(used, procs, me)
    wall = time.monotonic() - start
    sample(procs, baseline=False)

    table: dict[str, list[float]] = {}
    for pid, proc in procs.items():
        used = (proc.ticks - proc.start_ticks) / TICK
        if pid == me or used <= 0:
            continue
        row = table.setdefault(kind(proc.title), [0.0, 0])
        row[0] += used
        row[1] += 1
    total = sum(cpu for cpu, _ in table.values())
    cores = os.cpu_count() or 1
    ranked = sorted(table.items(), key=lambda kv: -kv[1][0])
    print()
    print_table(["kind", "CPU-s", "share", "procs"],
                [[name, fmt_num(cpu, 8, 1), fmt_num(100 * cpu / total, 6, 1, unit="%"), str(n)]
                 for name, (cpu, n) in ranked[: args.top]], [40, 8, 7, 5])
    print(f"total {total:.1f} CPU-s in {wall:.1f} s wall on {cores} cores: utilisation {total / (wall * cores):.0%}; "
          f"1-min load {load_start:.1f} at start, {loadavg_1min():.1f} at end (command exit {child.returncode})")
    emit_json({"command": command, "wall_s": wall, "cores": cores, "cpu_s": total, "exit": child.returncode,
               "kinds": {k: {"cpu_s": c, "processes": n} for k, (c, n) in ranked}}, args.json_out)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
