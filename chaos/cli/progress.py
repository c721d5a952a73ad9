"""The live progress display of long commands (``chaos run``, ``chaos suite``).

On a terminal: a ``rich`` bar that updates in place (step, attempt, faults injected, recoveries,
ETA), with notes (restores, hangs, injections) printed above it. Otherwise (CI logs, pipes):
plain timestamped lines, notes as they come and a status line at most every
``plain_interval_s`` seconds, or when the attempt or the count of faults or recoveries changes,
before a note, and the newest one when the display closes; never one line per step.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from antifragile.chaos.run.status import RunStatus


def _eta(status: RunStatus) -> str:
    if status.eta_s is None:
        return "-:--"
    minutes, seconds = divmod(int(status.eta_s), 60)
    return f"{minutes}:{seconds:02d}"


class Progress:
    """Callable with a note (``progress("restored step 20")``); ``status`` takes step updates."""

    def __init__(self, *, stream: Any = None, plain_interval_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.plain_interval_s = plain_interval_s
        self._live: Any = None
        self._task: Any = None
        self._last_plain_t = 0.0
        self._last_key: tuple[int, int, int] | None = None
        self._last_total: int | None = None
        self._unprinted: str | None = None  # the newest status line not printed (plain)
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream), transient=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, line: str) -> None:
        if self._live is not None:
            from rich.markup import escape  # a note is text: a path's "[wip]" is no style

            self._live.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(line)}",
                                     markup=True, highlight=False)
        else:
            if self._unprinted is not None:  # where the run stood when this happened: in time
                self._plain(self._unprinted)  # order, not after the notes that followed it
                self._unprinted = None
            self._plain(line)

    def status(self, s: RunStatus) -> None:
        info = (f"attempt {s.attempt} · faults {s.faults_injected} · recoveries "
                f"{s.recoveries} · ETA {_eta(s)}")
        if self._live is not None:
            if self._task is None:
                self._live.start()
                self._task = self._live.add_task(s.name, total=s.total_steps, info=info)
            self._live.update(self._task, description=s.name, completed=s.step,
                              total=s.total_steps, info=info)
            return
        key = (s.attempt, s.faults_injected, s.recoveries)
        now = time.monotonic()
        # the last step, of a total known before it: a total that grows with the step (a
        # command trainer without a reference run, its end unknown) made every step the last
        last = s.step == s.total_steps == self._last_total
        self._last_total = s.total_steps
        line = f"{s.name}: step {s.step}/{s.total_steps}  {info}"
        if key != self._last_key or now - self._last_plain_t >= self.plain_interval_s or last:
            self._last_key, self._last_plain_t, self._unprinted = key, now, None
            self._plain(line)
        else:
            self._unprinted = line

    def _plain(self, line: str) -> None:
        self.stream.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        self.stream.flush()

    def close(self) -> None:
        """Stop the bar; in plain mode, print the newest status if it was not (where the run
        ended: a log must not stop at the last interval's step)."""
        if self._live is not None and self._task is not None:
            self._live.stop()
            self._task = None
        if self._unprinted is not None:
            self._plain(self._unprinted)
            self._unprinted = None
