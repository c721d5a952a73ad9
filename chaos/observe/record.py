"""What a run leaves to be measured: the trainer's events as they come, and the injection log.

Everything the measurements, the checker and the reports say about a run comes from a
:class:`RunRecord`: the events every rank appended to ``events/rank<r>.jsonl`` and what the
runner did to the job (:class:`~antifragile.chaos.faults.Injection`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from antifragile.chaos.faults.base import Injection

STARTS = ("start", "worker_started")  # reported by a rank; a command's rank seen in /proc


@dataclass(slots=True)
class RunRecord:
    """Everything measured afterwards comes from here: events and the injection log."""

    returncode: int
    started_t: float
    ended_t: float
    events: list[dict[str, Any]]
    injections: list[Injection]
    attempt_ends: dict[int, float] = field(default_factory=dict)  # generation -> torn down
    paused_s: float = 0.0  # time the trainer spent held at pause points (not the job's)

    @property
    def wall_s(self) -> float:
        return self.ended_t - self.started_t

    def attempt_at(self, t: float) -> int:
        """The attempt that was running at time ``t``."""
        starts = sorted({e["attempt"]: e["t"] for e in reversed(self.events)
                         if e["event"] in STARTS}.items())
        current = 0
        for attempt, start_t in starts:
            if start_t <= t:
                current = attempt
        return current


class EventTail:
    """Reads new lines of every ``events/*.jsonl`` since the last call."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "events"
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.dir.exists():
            return new
        for path in sorted(self.dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, encoding="utf-8") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            self._offsets[path] = offset + len(complete.encode())
            new += [json.loads(line) for line in complete.splitlines() if line.strip()]
        new.sort(key=lambda e: e["t"])
        self.events += new
        return new
