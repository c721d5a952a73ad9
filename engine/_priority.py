"""While the training loop waits for a staging copy, the engine's writer threads yield the CPU.

Writers start on the cells already staged while later ones are still being copied (so the disk
works during the copy), and each computes its object's chunk CRCs first. Where every core is
busy (a CPU trainer; 2 cores) those CRCs take cores from the copy the loop is waiting for: in
three paired runs of ``bench.engine`` (2 GiB, 2 cores, the same code otherwise) ``save()``
stalled 1.10-1.47x a plain memcpy of the state, against 0.75-0.96x with the writers at nice 19
while the copy runs. The price is paid by persistence: with the CPU given to the copy the disk
waits for it (engine persist 0.77-0.85x an O_DIRECT write of the same bytes, against
0.85-1.04x). The loop's time is the scarcer: it is paid by every rank at every save. After the
copy the writers get their own niceness back. (From a GPU the copy is a device-to-host
transfer and writers start after it anyway.)

Lowering a thread's niceness back needs ``CAP_SYS_NICE`` or a ``RLIMIT_NICE`` that allows it.
Where this process may not, a writer lowered once would stay at nice 19 for the life of the
process, so the writers are then left alone (the stall is as it was). Linux only: elsewhere,
and on any error, nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator

log = logging.getLogger("antifragile.engine")

YIELD_NICE = 19


class WriterThreads:
    """The native ids of a pool's threads (``register`` is the pool's initializer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tids: set[int] = set()
        self._pid = os.getpid()
        self._lowered: dict[int, int] | None = None  # while yielding: tid -> niceness before

    def register(self) -> None:
        with self._lock:
            self._forget_other_process()
            tid = threading.get_native_id()
            self._tids.add(tid)
            if self._lowered is not None:  # started during a copy: yields at once
                self._lower(tid)

    @contextlib.contextmanager
    def yielding(self) -> Iterator[None]:
        """For the block: every registered thread at nice ``YIELD_NICE``, then as before."""
        with self._lock:
            self._forget_other_process()
            if self._lowered is not None or not may_raise_priority():
                entered = False
            else:
                entered, self._lowered = True, {}
                for tid in self._tids:
                    self._lower(tid)
        try:
            yield
        finally:
            if entered:
                with self._lock:
                    lowered, self._lowered = self._lowered or {}, None
                for tid, before in lowered.items():
                    try:
                        os.setpriority(os.PRIO_PROCESS, tid, before)
                    except ProcessLookupError:
                        continue
                    except OSError as exc:
                        log.warning("checkpoint writer thread %d stays at nice %d: %s", tid,
                                    YIELD_NICE, exc)

    def _forget_other_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's threads are not its own
            self._tids, self._pid, self._lowered = set(), os.getpid(), None

    def _lower(self, tid: int) -> None:
        assert self._lowered is not None
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            if before < YIELD_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, YIELD_NICE)
                self._lowered[tid] = before
        except OSError:  # the thread has ended
            self._tids.discard(tid)


@functools.cache
def may_raise_priority() -> bool:
    """Whether a thread of this process may get back the niceness it had before it was
    raised (tried on a thread of its own, which then ends)."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, YIELD_NICE)
            os.setpriority(os.PRIO_PROCESS, tid, before)
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="ckpt-nice-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])
