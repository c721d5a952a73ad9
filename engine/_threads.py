"""Daemon threads kept for reuse by the save path.

Starting a thread waits until the new thread runs: a hand-over of the GIL that costs
milliseconds on a busy machine, paid by the training loop on every save. An idle worker takes
the next job at once instead. Workers are daemon threads (unlike a ``ThreadPoolExecutor``'s),
so a save stuck on storage never holds up the interpreter's exit, as before.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("antifragile.engine")

_Job = tuple[str, Callable[..., None], tuple[Any, ...]]

# Workers of engines never closed are closed at exit, before the interpreter finalizes: a
# daemon thread still running then is ended inside ``take_gil`` by ``pthread_exit``, and if it
# is freeing a tensor at that moment the unwind crosses a noexcept C++ destructor and the
# process aborts ("terminate called without an active exception") after a successful run.
_LIVE: weakref.WeakSet[DaemonWorkers] = weakref.WeakSet()
EXIT_WAIT_S = 5.0


class DaemonWorkers:
    """Run each job on an idle worker, or on a new one when all are busy (a save whose
    retention still runs keeps its worker; the next save takes another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Job | None]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._pid = os.getpid()  # a forked child has none of the parent's threads
        _LIVE.add(self)

    def run(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Run ``target(*args)`` on a worker thread named ``name`` while it runs."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._threads, self._pid = [], [], os.getpid()
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                inbox = queue.SimpleQueue()
                thread = threading.Thread(target=self._serve, args=(inbox,), name=name,
                                          daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()
        inbox.put((name, target, args))

    def close(self, timeout: float = 30.0) -> list[str]:
        """End the idle workers and wait up to ``timeout`` s for the busy ones to finish their
        jobs; return the names of those still running then (stuck, e.g. on storage: left as
        daemon threads, so they never hold up the interpreter's exit)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            threads = list(self._threads) if self._pid == os.getpid() else []
        for inbox in idle:
            inbox.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]

    def _serve(self, inbox: queue.SimpleQueue[_Job | None]) -> None:
        me = threading.current_thread()
        while (job := inbox.get()) is not None:
            self._run(me, *job)  # its frame, and with it the job's arguments, is gone after
            del job  # an idle worker holds nothing of its last job (a staging area: GiBs)
            me.name = "ckpt-idle"
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)

    @staticmethod
    def _run(me: threading.Thread, name: str, target: Callable[..., None],
             args: tuple[Any, ...]) -> None:
        me.name = name
        try:
            target(*args)
        except BaseException:  # a job reports its own failures; this one escaped them
            log.exception("%s failed", name)


@atexit.register
def _close_at_exit() -> None:
    for workers in list(_LIVE):
        stuck = workers.close(EXIT_WAIT_S)
        if stuck:
            log.warning("exiting with checkpoint threads still running: %s", ", ".join(stuck))
