"""What a run leaves to be measured: the trainer's events as they come, and the injection log.

Everything the measurements, the checker and the reports say about a run comes from a
:class:`RunRecord`: the events every rank appended to ``events/rank<r>.jsonl`` and what the
runner did to the job (:class:`~antifragile.chaos.faults.Injection`).
"""

from __future__ import annotations

import json
import math
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
        """The attempt that was running at time ``t`` (one begins at its first start, in time:
        events come file by file, not in time order)."""
        first: dict[int, float] = {}
        for e in self.events:
            if e["event"] in STARTS:
                first[e["attempt"]] = min(e["t"], first.get(e["attempt"], e["t"]))
        starts = sorted(first.items())
        current = 0
        for attempt, start_t in starts:
            if start_t <= t:
                current = attempt
        return current


class EventLogError(ValueError):
    """A complete line of an event file that is not an event (garbled, or not an object with
    ``t`` (a finite time), ``rank``, ``attempt`` and ``event``); the message names the file
    and the line. Never skipped: the lost event could be the ``ckpt_committed`` or
    ``restore_skipped`` a verdict rests on, so a run that has one has no verdict."""


_FIELDS = {"t": (int, float), "rank": (int,), "attempt": (int,), "event": (str,)}


def _event(path: Path, number: int, line: bytes) -> dict[str, Any]:
    """Line ``number`` (from 1) of ``path`` as an event, or EventLogError saying why not."""
    try:
        e = json.loads(line.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError too
        raise EventLogError(f"{path}:{number}: not a JSON event ({exc}): "
                            f"{line[:120]!r}") from None
    wrong = list(_FIELDS) if not isinstance(e, dict) else [
        k for k, types in _FIELDS.items()
        if not isinstance(e.get(k), types) or isinstance(e.get(k), bool)
        or (k == "t" and not math.isfinite(e[k]))]  # JSON's NaN: compares false with all
    if wrong:
        raise EventLogError(f"{path}:{number}: not an event (missing or wrong "
                            f"{', '.join(wrong)}): {line[:120]!r}")
    return e


class EventTail:
    """Reads new lines of every ``events/*.jsonl`` since the last call; a line still being
    written (no newline yet) waits for the next call. Raises :class:`EventLogError` at a
    complete line that is not an event."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "events"
        self._offsets: dict[Path, int] = {}
        self._lines: dict[Path, int] = {}  # complete lines read so far, per file
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.dir.exists():
            return new
        for path in sorted(self.dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:  # bytes: the offsets are byte counts, as written
                f.seek(offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            lines = complete.split(b"\n")[:-1]
            first = self._lines.get(path, 0) + 1
            new += [_event(path, first + i, line) for i, line in enumerate(lines)
                    if line.strip()]
            self._offsets[path] = offset + len(complete)
            self._lines[path] = first - 1 + len(lines)
        new.sort(key=lambda e: e["t"])
        self.events += new
        return new
