"""Run a scenario: launch the trainer, inject its faults from outside, record what happened.

The runner only watches the trainer's event files and the worker processes; faults are
signals and storage operations done to the job, never code inside it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.faults import FaultBase, Injection, Target
from chaos.launch import EventTail, launch
from chaos.scenario import Scenario


@dataclass(slots=True)
class RunRecord:
    """Everything measured afterwards comes from here: events and the injection log."""

    returncode: int
    started_t: float
    ended_t: float
    events: list[dict[str, Any]]
    injections: list[Injection]
    attempt_ends: dict[int, float] = field(default_factory=dict)  # attempt -> all workers gone

    @property
    def wall_s(self) -> float:
        return self.ended_t - self.started_t


@dataclass(slots=True)
class _Pending:
    fault: FaultBase
    next_t: float | None = None  # for mtbf arrivals


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by torchrun) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _coordinates(s: Scenario) -> dict[int, tuple[int, int, int]]:
    p = s.trainer.parallel
    return {r: (r // (p.pp * p.tp), (r // p.tp) % p.pp, r % p.tp)
            for r in range(p.world_size)}


def run_scenario(s: Scenario, run_dir: Path, ckpt_url: str, *, faults: bool = True,
                 timeout_s: float = 3600.0,
                 on_event: Callable[[dict[str, Any], list[Injection]], None] | None = None
                 ) -> RunRecord:
    """Run the trainer for ``s`` (with its faults unless ``faults=False``) to the end."""
    rng = random.Random(s.seed)
    pending = [_Pending(f) for f in (s.faults if faults else [])]
    started = time.time()
    for p in pending:
        if p.fault.mtbf_s:
            p.next_t = started + rng.expovariate(1 / p.fault.mtbf_s)
    max_restarts = 2 * len(pending) + (50 if any(p.next_t for p in pending) else 0)
    proc = launch(s, run_dir, ckpt_url, max_restarts=max_restarts)
    tail = EventTail(run_dir)
    injections: list[Injection] = []
    pids: dict[int, dict[int, int]] = {}  # attempt -> rank -> pid
    attempt_ends: dict[int, float] = {}
    step = 0
    checkpoints_seen: dict[int, int] = {}  # checkpoint step -> ordinal
    try:
        while proc.poll() is None:
            if time.time() - started > timeout_s:
                raise TimeoutError(f"scenario {s.name} ran past {timeout_s:.0f} s")
            for e in tail.poll():
                if e["event"] == "start":
                    pids.setdefault(e["attempt"], {})[e["rank"]] = e["pid"]
                elif e["event"] == "step_end":
                    step = max(step, e["step"]) if e["attempt"] == max(pids, default=0) \
                        else step
                elif e["event"] == "ckpt_staged":
                    checkpoints_seen.setdefault(e["step"], len(checkpoints_seen) + 1)
                if on_event:
                    on_event(e, injections)
                _fire(pending, injections, e, s, pids, ckpt_url, rng, checkpoints_seen)
            now = time.time()
            for p in pending:
                if p.next_t is not None and now >= p.next_t and pids:
                    current = max(pids)
                    if len(pids[current]) == s.trainer.parallel.world_size:
                        injections.append(p.fault.inject(_target(s, pids[current], ckpt_url,
                                                                 rng), step))  # type: ignore[attr-defined]
                    p.next_t = now + rng.expovariate(1 / p.fault.mtbf_s)  # type: ignore[operator]
            for attempt, ranks in pids.items():
                if attempt not in attempt_ends and not any(_alive(pid) for pid in ranks.values()):
                    attempt_ends[attempt] = time.time()
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail.poll()
    ended = time.time()
    for attempt in pids:
        attempt_ends.setdefault(attempt, ended)
    return RunRecord(proc.returncode, started, ended, tail.events, injections, attempt_ends)


def _target(s: Scenario, pids: dict[int, int], ckpt_url: str, rng: random.Random) -> Target:
    return Target(pids=dict(pids), coordinates=_coordinates(s), ckpt_url=ckpt_url, rng=rng)


def _fire(pending: list[_Pending], injections: list[Injection], e: dict[str, Any],
          s: Scenario, pids: dict[int, dict[int, int]], ckpt_url: str, rng: random.Random,
          checkpoints_seen: dict[int, int]) -> None:
    """Inject every step- or checkpoint-triggered fault whose moment ``e`` marks."""
    attempt = e["attempt"]
    ranks = pids.get(attempt, {})
    if attempt != max(pids, default=0) or len(ranks) < s.trainer.parallel.world_size:
        return
    for p in list(pending):
        f = p.fault
        due = (f.at_step is not None and e["event"] == "step_end" and e["step"] >= f.at_step) \
            or (f.at_checkpoint is not None and e["event"] == "ckpt_staged"
                and checkpoints_seen.get(e["step"]) == f.at_checkpoint)
        if due:
            pending.remove(p)
            injections.append(f.inject(_target(s, ranks, ckpt_url, rng),  # type: ignore[attr-defined]
                                       e["step"]))
