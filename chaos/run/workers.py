"""A command trainer's worker processes, found from outside the job.

A script that never calls ``antifragile.probe`` reports no pids, yet time-based faults must
reach its ranks. torchrun (``--no-python``) starts each rank as a direct child of its agent,
with ``RANK`` and ``TORCHELASTIC_RESTART_COUNT`` in the environment: reading ``/proc`` gives
every attempt's ranks, their pids and when each process started. Grandchildren (data-loader
workers, which inherit ``RANK``) are not ranks and are left out.

What this finds is recorded as ``worker_started`` events (``by: chaos``) beside the script's
own: the moment a process started, observed, never a claim about the script's progress.
"""

from __future__ import annotations

import os
import time
from typing import Any

from antifragile.chaos.scenario.trainer import RUN_DIR_ENV

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: two start times of one pid this close are one process's: each read is now less its age,
#: and ``/proc/uptime`` has 10 ms steps (a pid recycled this soon would need a rank to die and
#: every other pid to be taken in that time)
SAME_START_S = 0.5


def _uptime() -> float:
    """Seconds since boot on the clock ``/proc/<pid>/stat`` start times use. (``btime`` in
    ``/proc/stat`` is whole seconds and drifts from the wall clock as NTP adjusts it: a start
    time from it could be a second or more off, enough to put a restarted process before the
    kill that caused it.)"""
    with open("/proc/uptime", encoding="ascii") as f:
        return float(f.read().split()[0])


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, start time in seconds since boot) of ``pid``, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]) / _CLK_TCK


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def started_at(pid: int) -> float | None:
    """When ``pid`` started (unix seconds: now less its age), None if there is no such
    process. With the pid it tells one process from a later one given the same pid."""
    stat = _stat(pid)
    return None if stat is None else time.time() - (_uptime() - stat[1])


def children(pid: int) -> dict[int, float]:
    """``pid``'s live child processes and their start times (unix seconds): now less each
    process's age."""
    now, uptime = time.time(), _uptime()
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[0] == pid:
                out[int(name)] = now - (uptime - stat[1])
    return out


def left_behind(run_dir: str) -> list[int]:
    """Processes (this user's) whose environment names ``run_dir`` as ``ANTIFRAGILE_RUN_DIR``:
    what a command trainer's ranks started, wherever they are now. torchrun ends a rank's
    process group only while the rank runs, so a child of a rank that exited (a helper, an
    uploader, a crashed rank's worker) is orphaned and would outlive the run."""
    me = os.getpid()
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != me
            and _environ(int(name)).get(RUN_DIR_ENV) == run_dir]


class WorkerWatch:
    """Polls one torchrun agent's children; :meth:`poll` returns a ``worker_started`` event
    for each rank process seen for the first time. A process is its pid and its start time:
    pids are recycled, and a later attempt's rank may get the pid an earlier one had."""

    def __init__(self, agent_pid: int, *, every_s: float = 0.25) -> None:
        self.agent_pid = agent_pid
        self.every_s = every_s
        self._seen: dict[int, float] = {}  # pid -> start time of the process reported
        self._next_t = 0.0

    def poll(self, *, force: bool = False) -> list[dict[str, Any]]:
        now = time.monotonic()
        if not force and now < self._next_t:
            return []
        self._next_t = now + self.every_s
        found = []
        for pid, started_t in sorted(children(self.agent_pid).items()):
            if pid in self._seen and abs(self._seen[pid] - started_t) < SAME_START_S:
                continue
            env = _environ(pid)  # before its exec, a child still shows the agent's
            if "RANK" not in env or "TORCHELASTIC_RESTART_COUNT" not in env:
                continue
            self._seen[pid] = started_t
            found.append({"t": started_t, "rank": int(env["RANK"]),
                          "attempt": int(env["TORCHELASTIC_RESTART_COUNT"]),
                          "event": "worker_started", "pid": pid, "by": "chaos"})
        return found
