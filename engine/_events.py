"""Checkpoint events for ``chaos run``, written by the engine itself when a run is under chaos.

A training script that ``chaos run`` launches (``trainer: {command: [...]}``) finds
``ANTIFRAGILE_RUN_DIR`` in its environment. Then every :class:`CheckpointEngine` of the process
appends its checkpoint events to ``<run_dir>/events/rank<RANK>.jsonl``, the same lines the
built-in trainer writes (``trainer/events.py``)::

    ckpt_staged     step, stall_s            the state may be mutated again
    ckpt_blocked    step, seconds            a blocking save waited this long for its commit
    ckpt_committed  step, bytes, rank_bytes, persist_s
    ckpt_failed     step, error
    restore_begin
    restore_skipped step, reason             a damaged step passed over by load(step=None)
    restore_end     step, seconds

The first line a process writes is ``start`` (pid, world_size; ``attempt`` is torchrun's
restart count), whoever writes first: the engine or ``antifragile.probe``, which shares this
process-wide :func:`channel`.

No duplicates: a trainer that reports these events itself (ours does) builds its engine with
``CheckpointEngine(..., chaos_events=False)``. Not under chaos (no ``ANTIFRAGILE_RUN_DIR``)
nothing is opened or written. Events are best effort: a failed write never fails a save.

Standard library only: ``antifragile.probe`` uses this module too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any, TextIO

RUN_DIR_ENV = "ANTIFRAGILE_RUN_DIR"
#: ``<pid>:<run_dir>`` of the process that opened its channel, set in its environment then: a
#: process it starts (an evaluation subprocess) inherits ``ANTIFRAGILE_RUN_DIR`` and ``RANK``
#: but is not the rank, and writes no events (its ``start`` had chaos take its pid for the
#: rank's). Only for this run folder: a marker left in a launcher's environment by a channel
#: of another run turns nothing off.
OWNER_ENV = "ANTIFRAGILE_EVENTS_OWNER"


def open_event_file(path: str) -> TextIO:
    """``path`` opened to append JSON lines, line-buffered (one write per line).

    A writer killed in the middle of a line (SIGKILL between the pages of one write, a full
    disk) leaves it without its newline, and the next attempt's first line would complete it
    into one garbled line that the readers refuse. That torn tail is cut off first: the line
    its writer never finished is lost, as a kill may lose it. Only the file's one writer
    opens it (a rank, a spare or a supervisor of one attempt at a time)."""
    with contextlib.suppress(FileNotFoundError), open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        keep = end
        while keep > 0:
            start = max(keep - 65536, 0)
            f.seek(start)
            block = f.read(keep - start)
            if keep == end and block.endswith(b"\n"):
                break  # whole lines: nothing torn
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        if keep < end:
            f.truncate(keep)
    return open(path, "a", buffering=1, encoding="utf-8")


class Channel:
    """One process's event file under chaos. Thread-safe (background saves emit too).

    ``loop_t`` is when the training thread last emitted: ``probe.step_end`` measures a step
    from there, so a checkpoint stall or a pause is not counted as step time. The training
    thread is the main thread until a ``probe`` call names another (``loop_thread``): a loop
    run in a thread of its own; the engine's background saves never move ``loop_t``."""

    def __init__(self, run_dir: str, *, rank: int, world_size: int, attempt: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.restored_step: int | None = None  # a restore_end this process reported
        self.loop_thread = threading.main_thread()
        self._lock = threading.Lock()
        folder = os.path.join(run_dir, "events")
        os.makedirs(folder, exist_ok=True)
        # open for the life of the process
        self._file: TextIO = open_event_file(os.path.join(folder, f"rank{rank}.jsonl"))
        self.started_t = time.time()
        self.loop_t = self.started_t
        self.emit("start", pid=os.getpid(), world_size=world_size)

    def emit(self, event: str, **fields: Any) -> None:
        now = time.time()
        line = json.dumps({"t": now, "rank": self.rank, "attempt": self.attempt,
                           "event": event, **fields}, allow_nan=True, default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError):  # disk full, closed at exit: the run goes on
                return
            if event == "restore_end":
                self.restored_step = fields.get("step")
            if threading.current_thread() is self.loop_thread:
                self.loop_t = now


_channel: Channel | None = None
_lock = threading.Lock()
#: the event file could not be opened or named: events are off for the life of the process
_unusable = False


def channel() -> Channel | None:
    """This process's channel, opened on first use; None when not under chaos, or when its
    event file cannot be opened (no folder can be made at ``ANTIFRAGILE_RUN_DIR``) or named
    (``RANK`` is no number): events are best effort, and the error raised into the caller
    failed a training step, or a save's thread that was reporting its commit. Said once, then
    not tried again."""
    global _channel, _unusable
    if _channel is not None:
        return _channel
    if _unusable:
        return None
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    with _lock:
        if _channel is None and not _unusable:
            env = os.environ
            owner, _, owner_dir = env.get(OWNER_ENV, "").partition(":")
            if owner_dir == run_dir and owner != str(os.getpid()):
                _unusable = True  # a process the rank started: its events are not the rank's
                return None
            try:
                _channel = Channel(run_dir, rank=int(env.get("RANK", "0")),
                                   world_size=int(env.get("WORLD_SIZE", "1")),
                                   attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
                env[OWNER_ENV] = f"{os.getpid()}:{run_dir}"
            except OSError as exc:
                _unusable = True
                logging.getLogger("antifragile.engine").warning(
                    "chaos events off: cannot write them under %s=%s (%s)", RUN_DIR_ENV,
                    run_dir, exc)
            except ValueError as exc:
                _unusable = True
                logging.getLogger("antifragile.engine").warning(
                    "chaos events off: RANK, WORLD_SIZE or TORCHELASTIC_RESTART_COUNT is no "
                    "number (%s)", exc)
    return _channel


def _forked() -> None:
    """In a child forked from the rank (a DataLoader worker, a fork-started pool) after its
    event file opened: that file is not the child's to write; events are off in it."""
    global _channel, _unusable
    if _channel is not None:
        _channel, _unusable = None, True


os.register_at_fork(after_in_child=_forked)


class EngineEvents:
    """What one engine reports; every method does nothing when off (``chaos_events=False``)
    or not under chaos. Called from ``engine.py`` at the points its docstring lists."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled

    def _emit(self, event: str, **fields: Any) -> None:
        """Best effort: whatever reporting raises, the save or load it reports goes on (raised
        on a save's thread, it failed a committed save and left its handle unresolved)."""
        if not self._enabled:
            return
        try:
            ch = channel()  # opened on first use: it writes the process's start event
            if ch is not None:
                ch.emit(event, **fields)
        except Exception as exc:
            logging.getLogger("antifragile.engine").warning(
                "chaos event %s not written: %s: %s", event, type(exc).__name__, exc)

    def staged(self, step: int, stall_s: float) -> None:
        self._emit("ckpt_staged", step=step, stall_s=stall_s)

    def blocked(self, step: int, since: float) -> None:
        self._emit("ckpt_blocked", step=step, seconds=time.perf_counter() - since)

    def committed(self, step: int, nbytes: int, rank_nbytes: int, persist_s: float) -> None:
        self._emit("ckpt_committed", step=step, bytes=nbytes or rank_nbytes,
                   rank_bytes=rank_nbytes, persist_s=persist_s)

    def failed(self, step: int, error: BaseException | str) -> None:
        self._emit("ckpt_failed", step=step, error=str(error))

    def restore_begin(self) -> float:
        self._emit("restore_begin")
        return time.perf_counter()

    def restore_skipped(self, step: int, reason: BaseException | str) -> None:
        self._emit("restore_skipped", step=step, reason=str(reason))

    def restore_end(self, step: int, since: float) -> None:
        self._emit("restore_end", step=step, seconds=time.perf_counter() - since)
