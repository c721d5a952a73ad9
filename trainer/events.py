"""Per-rank event log: JSON lines in ``<run_dir>/events/rank<r>.jsonl``.

``chaos`` builds its whole timeline from these lines and its own injection log. Each line is
flushed as written, so a SIGKILL loses at most the line being written.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's events of a run, in time order (a torn last line is skipped): the
    ``events/*.jsonl`` files, as chaos's runner reads them (a file of a user's script beside
    them is not an event file)."""
    out = []
    folder = os.path.join(run_dir, "events")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".jsonl") or not os.path.isfile(os.path.join(folder, name)):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    return sorted(out, key=lambda e: e["t"])


class EventLog:
    """Appends to ``events/<name>.jsonl`` (default ``rank<rank>``; spares and supervisors
    write their own files). Thread-safe: a background save reports its outcome from its own
    thread; a line's time is taken under the lock, so the file is in time order. Not safe
    across processes beyond whole-line appends."""

    def __init__(self, run_dir: str | None, rank: int, attempt: int, *,
                 name: str | None = None) -> None:
        self.rank = rank
        self.attempt = attempt
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        if run_dir:
            # here, not at import: read_events (chaos) would load the engine, and torch, with it
            from antifragile.engine._events import open_event_file

            os.makedirs(os.path.join(run_dir, "events"), exist_ok=True)
            path = os.path.join(run_dir, "events", f"{name or f'rank{rank}'}.jsonl")
            self._file = open_event_file(path)

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            if self._file is None:
                return
            line = {"t": time.time(), "rank": self.rank, "attempt": self.attempt,
                    "event": event, **fields}
            self._file.write(json.dumps(line, allow_nan=True) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
