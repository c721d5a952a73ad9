"""Run test functions on N gloo ranks on CPU.

A :class:`RankGroup` starts its processes once; each joins a gloo process group (through a TCP
store that the test process hosts on 127.0.0.1, on a port the OS picks) and then runs, in
order, every function the test sends it. Ranks are forked from a fork server that has imported
torch once, so only the first group of a test process pays for that import (seconds).

Guarantees for :meth:`RankGroup.run`: it returns each rank's return value (index = rank;
pickled with plain ``pickle``, so tensors are copied, not shared), or raises
:class:`RankFailure` naming every rank that raised (with its traceback), died, or did not answer
within the timeout. After a failure the processes are killed and the next ``run`` starts fresh
ones, so one failing test cannot leave ranks in mismatched collectives for the next.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")
if sys.platform.startswith("linux"):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

HOST = "127.0.0.1"
GRACE_S = 10.0  # how long the other ranks may still report once one rank has failed
# Imported once by the fork server, then inherited by every rank it forks: a rank starts in
# a fraction of a second instead of importing torch itself (seconds of CPU each).
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.fsdp", "antifragile.engine")
STARTUP_S = 300.0  # the first group waits for the fork server to import torch


class RankFailure(AssertionError):
    """A function failed on some ranks: the message names each rank and why."""


def _rank_main(
    rank: int, world_size: int, port: int, pg_timeout_s: float, tasks: Any, results: Any
) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=pg_timeout_s)
    store = dist.TCPStore(HOST, port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    results.put((rank, None, "ready"))
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, pickle.dumps(fn(*args))))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)  # every answer is flushed; skip the seconds torch's interpreter teardown takes


class RankGroup:
    """``world_size`` gloo ranks on CPU, spawned on first use and reused by every ``run``."""

    def __init__(self, world_size: int, *, timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(PRELOAD))
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: Any = None

    def _start(self) -> None:
        self._store = dist.TCPStore(
            HOST,
            0,
            self.world_size + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_rank_main,
                name=f"rank{rank}",
                daemon=True,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    self.timeout_s,
                    self._tasks[rank],
                    self._results,
                ),
            )
            for rank in range(self.world_size)
        ]
        try:
            for proc in self._procs:
                proc.start()
        except BaseException:
            self._kill()
            raise
        ready, failures = self._collect(time.monotonic() + STARTUP_S)
        if len(ready) < self.world_size:
            self._fail("joining the process group", ready, failures)

    def _collect(self, deadline: float) -> tuple[dict[int, Any], dict[int, str]]:
        """Each rank's answer until all answered, the deadline, or GRACE_S after a failure."""
        done: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(done) + len(failures) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, ok, payload = self._results.get(timeout=min(deadline - now, 0.5))
            except queue.Empty:
                for rank, proc in enumerate(self._procs):
                    if not proc.is_alive() and rank not in done and rank not in failures:
                        failures[rank] = f"process exited with code {proc.exitcode}"
                        deadline = min(deadline, time.monotonic() + GRACE_S)
                continue
            if ok is None or ok:
                done[rank] = payload if ok is None else pickle.loads(payload)
            else:
                failures[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_S)
        return done, failures

    def _fail(self, what: str, done: dict[int, Any], failures: dict[int, str]) -> None:
        self._kill()
        silent = [r for r in range(self.world_size) if r not in done and r not in failures]
        lines = [f"{what} failed on {self.world_size} gloo ranks:"]
        lines += [f"--- rank {r} raised:\n{failures[r]}" for r in sorted(failures)]
        if silent:
            lines.append(f"--- ranks {silent} did not finish in time (hung; killed)")
        raise RankFailure("\n".join(lines))

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call ``fn(*args)`` on every rank (``fn`` importable by name); results by rank."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        done, failures = self._collect(time.monotonic() + (timeout_s or self.timeout_s))
        if len(done) < self.world_size:
            self._fail(getattr(fn, "__name__", repr(fn)), done, failures)
        return [done[r] for r in range(self.world_size)]

    def _kill(self) -> None:
        started = [proc for proc in self._procs if proc.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.kill()
        for proc in started:
            proc.join(10)
        self._procs, self._tasks, self._results, self._store = [], [], None, None

    def close(self) -> None:
        """Stop the ranks (cleanly if they are idle, else by killing them)."""
        for q in self._tasks:
            q.put(None)
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(10)
        self._kill()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Spawn ``world_size`` ranks, call ``fn(*args)`` on each, stop them; results by rank."""
    with RankGroup(world_size, timeout_s=timeout_s) as group:
        return group.run(fn, *args)
