"""Daemon threads kept for reuse: the save path's workers and the engine's I/O pool.

Starting a thread waits until the new thread runs: a hand-over of the GIL that costs
milliseconds on a busy machine, paid by the training loop on every save. An idle worker takes
the next job at once instead. Every thread here is a daemon thread (unlike a
``ThreadPoolExecutor``'s, which the interpreter joins at exit before any atexit hook), so a
write stuck on storage never holds up the interpreter's exit, nor ``close()`` for more than
``CLOSE_WAIT_S``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

log = logging.getLogger("antifragile.engine")

_Job = tuple[str, Callable[..., None], tuple[Any, ...]]

# Workers of engines never closed are closed at exit, before the interpreter finalizes: a
# daemon thread still running then is ended inside ``take_gil`` by ``pthread_exit``, and if it
# is freeing a tensor at that moment the unwind crosses a noexcept C++ destructor and the
# process aborts ("terminate called without an active exception") after a successful run.
_LIVE: weakref.WeakSet[DaemonWorkers | DaemonPool] = weakref.WeakSet()
EXIT_WAIT_S = 5.0
#: how long ``close()`` waits for busy threads before it leaves them running (stuck)
CLOSE_WAIT_S = 30.0


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
                try:
                    thread.start()
                except BaseException:
                    # not started (at the thread limit): never joined, which would raise. Or
                    # started, and interrupted while ``start()`` waited for it to run: it
                    # gets no job, so it ends instead of waiting for one forever
                    inbox.put(None)
                    raise
                finally:
                    self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
        inbox.put((name, target, args))

    def close(self, timeout: float | None = None) -> list[str]:
        """End the idle workers and wait up to ``timeout`` s (``CLOSE_WAIT_S``) for the busy
        ones to finish their jobs; return the names of those still running then (stuck, e.g.
        on storage: left as daemon threads, so they never hold up the interpreter's exit)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            threads = list(self._threads) if self._pid == os.getpid() else []
        for inbox in idle:
            inbox.put(None)
        return _join(threads, timeout)

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


class DaemonPool(Executor):
    """A pool of daemon threads that runs up to ``threads`` jobs at once (the engine's reads
    and writes; a job waiting in :meth:`lend` does not count), its threads started as jobs
    queue up. A ``ThreadPoolExecutor``'s threads are joined at interpreter exit before
    any atexit hook: one write stuck on storage held the exit of a script that never closed
    its engine forever, and ``close()`` with it."""

    def __init__(self, threads: int, name: str) -> None:
        self._max = threads
        self._name = name
        # one per job running, outside ``lend``: at most ``threads`` at once
        self._running = threading.Semaphore(threads)
        self._lent = 0
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...],
                                            dict[str, Any]] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False
        _LIVE.add(self)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False):
                try:
                    self._grow()
                except RuntimeError:  # "can't start new thread": a process at its limit
                    if self._threads:  # queued: a thread of the pool runs it in turn
                        return future
                    future.cancel()  # refused: the thread that takes it later skips it
                    raise
        return future

    def _grow(self) -> None:
        """A thread more, up to one per job that may run (under the lock)."""
        if len(self._threads) < self._max + self._lent:
            thread = threading.Thread(target=self._serve, daemon=True,
                                      name=f"{self._name}_{len(self._threads)}")
            thread.start()
            self._threads.append(thread)

    @contextlib.contextmanager
    def lend(self) -> Iterator[None]:
        """Called by a job: run the body (a wait for something that is not its own I/O: a
        write waiting for the end of a staging copy) without counting the job as running:
        meanwhile a queued job may run in its place, on a thread more. Up to ``threads`` jobs
        at once may be lent (beyond that the body runs as part of the job); the job counts
        again as running once the body is over, which may wait for a running job to end."""
        with self._lock:
            lent = self._lent < self._max
            if lent:
                self._lent += 1
                # at the thread limit ("can't start new thread") the job is lent all the
                # same: a thread already started takes the queued job, and the write that
                # lends does not fail for a thread it only offered
                with contextlib.suppress(RuntimeError):
                    self._grow()
        if not lent:
            yield
            return
        self._running.release()
        try:
            yield
        finally:
            self._running.acquire()
            with self._lock:
                self._lent -= 1

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            del job
            with self._running:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as exc:
                        future.set_exception(exc)
            del future, fn, args, kwargs  # an idle thread holds nothing of its last job
            self._idle.release()
        self._jobs.put(None)  # the next thread ends too

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if cancel_futures:
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:  # and notified, as a worker would: a future only
                        # cancelled is not done for ``concurrent.futures.wait``
                        job[0].cancel()
                        job[0].set_running_or_notify_cancel()
            # at every shutdown, as ``ThreadPoolExecutor`` does: the drain above may have taken
            # the marker an earlier shutdown queued, and a busy thread would then never end
            self._shut = True
            self._jobs.put(None)
        if wait:
            _join(self._threads, math.inf)

    def close(self, timeout: float | None = None) -> list[str]:
        """Shut down, waiting up to ``timeout`` s (``CLOSE_WAIT_S``) for the jobs queued and
        running; the names of the threads still running then (stuck on storage: left, as
        daemon threads)."""
        self.shutdown(wait=False)
        return _join(self._threads, timeout)


def _join(threads: list[threading.Thread], timeout: float | None) -> list[str]:
    """Wait up to ``timeout`` s (``CLOSE_WAIT_S``) for ``threads``; those still running."""
    deadline = time.monotonic() + (CLOSE_WAIT_S if timeout is None else timeout)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(None if deadline == math.inf
                        else max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


@atexit.register
def _close_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S  # for all of them together
    # the save threads first: a save in flight still submits its writes to its engine's pool,
    # and would fail ("cannot schedule new futures after shutdown") where the pool closed first
    for threads in sorted(_LIVE, key=lambda live: isinstance(live, DaemonPool)):
        try:
            stuck = threads.close(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # logged; the others are closed all the same
            log.warning("closing checkpoint threads at exit failed: %s: %s",
                        type(exc).__name__, exc)
            continue
        if stuck:
            log.warning("exiting with checkpoint threads still running: %s", ", ".join(stuck))
