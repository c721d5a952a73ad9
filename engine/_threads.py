"""Daemon threads kept for reuse by the save path.

Starting a thread waits until the new thread runs: a hand-over of the GIL that costs
milliseconds on a busy machine, paid by the training loop on every save. An idle worker takes
the next job at once instead. Workers are daemon threads (unlike a ``ThreadPoolExecutor``'s),
so a save stuck on storage never holds up the interpreter's exit, as before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("antifragile.engine")

_Job = tuple[str, Callable[..., None], tuple[Any, ...]]


class DaemonWorkers:
    """Run each job on an idle worker, or on a new one when all are busy (a save whose
    retention still runs keeps its worker; the next save takes another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Job | None]] = []
        self._closed = False
        self._pid = os.getpid()  # a forked child has none of the parent's threads

    def run(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Run ``target(*args)`` on a worker thread named ``name`` while it runs."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put((name, target, args))

    def close(self) -> None:
        """Let the idle workers end; a busy one ends when its job does."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    def _serve(self, inbox: queue.SimpleQueue[_Job | None]) -> None:
        me = threading.current_thread()
        while (job := inbox.get()) is not None:
            name, target, args = job
            me.name = name
            try:
                target(*args)
            except BaseException:  # a job reports its own failures; this one escaped them
                log.exception("%s failed", name)
            me.name = "ckpt-idle"
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)
