"""Getting the survivors of a failed generation out of its collectives.

gloo's ``abort`` does not interrupt a collective in flight; a closed connection does, on both
ends. So each generation's TCP connections are captured as its process groups form
(``GlooSockets``), and a watcher thread (``FailureWatch``) blocked on the generation's
``fail`` key shuts them down when it appears. A training thread that is still not out after
that (parked in gloo, see ``FailureWatch``) is judged stuck and its process ended, so that the
others re-form without it instead of waiting out the collective timeout. The store protocol
of a re-formation is ``recovery``'s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from antifragile.trainer.progress import LEASE_S, Phase, SharedProgress

if TYPE_CHECKING:
    from antifragile.trainer.recovery import JobStore

# How long a training thread may show no progress after its generation's connections were shut
# down before it counts as stuck in a collective (it leaves one in milliseconds), judged from
# the latest gaps between its progress marks while training (a block's forward, a backward, an
# optimizer step): 4x their 95th percentile, at least 1 s, at most 5 s, but never less than
# 1.5x the longest (a backward of a deep model is a rare gap: one per micro-step; a survivor
# inside one of its usual gaps at the abort, in a compute with no collective to leave, is not
# stuck); 5 s (or 1.5x the longest) until STUCK_GAPS marks.
STUCK_AFTER_S = 5.0
STUCK_MIN_S = 1.0
STUCK_GAPS = 20

# A training thread asleep in one kernel wait (state S, neither context-switch counter moving)
# this long after its generation's connections were shut down is stuck at once, whatever its
# gaps: a collective woken by the shutdown leaves in milliseconds, a compute runs (state R,
# or switches), a wait for the GIL is woken every switch interval. What parks a thread for
# good there is a gloo send queued when its connection failed, which nothing wakes before
# the group's timeout (see ``FailureWatch``). 0.25 s: five samples of the watch; with 0.5 s
# the 2x2x2 recoveries with a parked survivor took 2.0-2.1 s (1.1-1.6 s without one).
PARKED_S = 0.25

# A watch whose store client fails (a connection reset, a request timed out) connects again,
# first after 50 ms, backing off to 1 s; a store it has not reached for ``store_gone_s`` (the
# lease: by then slot 0's monitor judges this slot lost, or the store itself is gone) counts
# as a failure of the generation, which can no longer be coordinated.
STORE_RETRY_S = (0.05, 1.0)


def thread_wait(tid: int) -> tuple[str, int, int] | None:
    """A thread of this process: its scheduler state and its voluntary and involuntary
    context switches (``/proc``), or None where they cannot be read (not Linux, gone)."""
    try:
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
        with open(f"/proc/self/task/{tid}/status", encoding="ascii") as f:
            counts = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        return (state, int(counts["voluntary_ctxt_switches"]),
                int(counts["nonvoluntary_ctxt_switches"]))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def stuck_bound(gaps_s: Sequence[float]) -> float:
    """Seconds without progress after the abort that mean "stuck" (see ``STUCK_AFTER_S``)."""
    longest = 1.5 * max(gaps_s, default=0.0)
    if len(gaps_s) < STUCK_GAPS:
        return max(STUCK_AFTER_S, longest)
    ordered = sorted(gaps_s)
    p95 = ordered[int(0.95 * (len(ordered) - 1))]
    return max(STUCK_MIN_S, min(STUCK_AFTER_S, 4 * p95), longest)


class GlooSockets:
    """The TCP connections a process group formation opened, so that they can be shut down.

    Captured as the sockets this process holds after the formation that it did not hold
    before, told apart by inode, not by descriptor number: a socket closed during the
    formation frees its number for a gloo connection, and a captured number closed later may
    be reused by another connection, which must not be shut down. Connections to the stores
    are not touched (their peer port is excluded), except the connection the groups rendezvous
    through (``links``), and only before :meth:`end`: cut, it ends a rendezvous wait for a
    member that died while the generation's groups were forming, which no gloo connection
    does; the next generation then connects again (``cut``). Only then: a fresh connection
    for every generation stalled the next rendezvous on torchrun's store for 5 s in 3 of 5
    2x2x2 recoveries (0 of 3 without; why is not known), and cutting a formed generation's
    connection did so every time.
    """

    def __init__(self, keep_ports: set[int], links: dict[int, int] | None = None) -> None:
        self.keep_ports = keep_ports
        self._before: set[int] = set()
        self.fds: dict[int, int] = {}  # descriptor -> socket inode
        self.links = dict(links or {})  # the group's store connection (see ``store_link``)
        self.cut = False  # the store connection was shut down: the next group needs another
        self._ended = False
        self._aborted = False  # ``shutdown`` was called (the generation failed)

    @staticmethod
    def _sockets() -> dict[int, int]:
        found = {}
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    found[int(name)] = int(link[len("socket:["):-1])
        return found

    def begin(self) -> None:
        self._before = set(self._sockets().values())

    def end(self) -> None:
        """The formation is over: capture its connections. Where the generation failed while
        it formed (``shutdown`` cut only the store link, and gloo's connections formed before
        that are not woken by it), they are shut down here, at once: else the training thread
        would go on into the next collectives of a failed generation."""
        self.fds = {fd: inode for fd, inode in self._sockets().items()
                    if inode not in self._before}
        self._ended = True
        if self._aborted:  # set before ``shutdown`` reads ``_ended``: one of the two shuts
            self.shutdown()

    def shutdown(self) -> int:
        """While forming, the generation's store link; once formed, every captured connection
        (not listeners, not store connections). Returns how many were shut down. Thread-safe
        with respect to the collectives and store waits it interrupts, and to :meth:`end`."""
        self._aborted = True
        if not self._ended:  # forming: a rendezvous may wait in the store for a dead member
            cut = sum(_shut(fd, inode, keep_ports=set()) for fd, inode in self.links.items())
            self.cut = self.cut or cut > 0
            return cut
        return sum(_shut(fd, inode, self.keep_ports) for fd, inode in sorted(self.fds.items()))


def store_link(connect: Callable[[], Any], ports: set[int]) -> tuple[Any, dict[int, int]]:
    """``connect()`` (a store client) and its connections to ``ports`` (descriptor -> inode),
    for :class:`GlooSockets` to cut."""
    before = set(GlooSockets._sockets().values())
    client = connect()
    return client, {fd: inode for fd, inode in GlooSockets._sockets().items()
                    if inode not in before and _peer_port(fd) in ports}


def _as_socket(fd: int) -> socket.socket | None:
    """A socket on a duplicate of ``fd`` (the caller closes it), or None where ``fd`` is
    closed or no socket (a number reused by a file or a pipe): the duplicate is closed
    then, not left to hold what it refers to open."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _peer_port(fd: int) -> int | None:
    sock = _as_socket(fd)
    if sock is None:
        return None
    try:
        with sock:
            peer = sock.getpeername()
    except OSError:
        return None
    return peer[1] if isinstance(peer, tuple) else None


def _shut(fd: int, inode: int, keep_ports: set[int]) -> bool:
    """Shut down the connection at ``fd`` if it is still the socket ``inode`` and its peer's
    port is not in ``keep_ports``."""
    sock = _as_socket(fd)
    if sock is None:
        return False
    try:
        if os.fstat(sock.fileno()).st_ino != inode:
            return False  # closed since, and the number reused
        peer = sock.getpeername()
        if isinstance(peer, tuple) and peer[1] in keep_ports:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False  # a listener, or already closed
    finally:
        sock.close()


class FailureWatch:
    """A thread blocked on ``g<g>/fail``; when it appears, ``on_failure`` runs (it aborts the
    generation's connections). ``fired`` tells the training thread an error was a failure of
    the generation, not a bug of its own.

    The abort must get the training thread out of its collective: it calls :meth:`left` once it
    is out. If it is not, and ``progress`` shows it training without a micro-step for
    ``stuck_after_s`` after the abort (default: :func:`stuck_bound` of what ``progress`` has
    seen), or asleep in one kernel wait for ``PARKED_S`` (``thread_id``: the training thread,
    sampled in ``/proc``), ``on_stuck(seconds)`` runs (it ends the process, so its supervisor
    reports the rank dead and the others re-form without it, instead of waiting for the
    collective timeout: a 2x2x2 survivor stayed in a collective after the abort in 4 of 18 runs
    of one session, 0 of 11 of the next, 2 of 18 of a third, which cost 60 s and a restart; the
    stack it leaves shows the training thread inside ``ProcessGroupGloo.all_gather_single``
    (FSDP2's unshard) or a tensor-parallel ``wait_tensor``). The cause is gloo's: when a
    connection fails, ``tcp::Pair::signalException`` wakes the unbound buffers still waiting for
    the peer's handshake but not those whose bytes sit in the transmit queue, which wait out the
    group's timeout; nothing outside gloo can wake them (README, "Known limits"). A thread that
    saves, restores, is held at a pause point (it leaves the hold itself:
    ``pause.HoldInterrupted``) or still makes progress is waited for.

    A store error does not end the watch: it connects again (``make_store``) and goes on
    watching, and a store out of reach for ``store_gone_s`` is a failure of the generation
    (``STORE_RETRY_S``)."""

    def __init__(self, make_store: Callable[[], JobStore], generation: int,
                 on_failure: Callable[[], None], *, progress: SharedProgress | None = None,
                 stuck_after_s: float | None = None,
                 on_stuck: Callable[[float], None] | None = None,
                 thread_id: int | None = None, store_gone_s: float = LEASE_S) -> None:
        self.generation = generation
        self._thread_id = thread_id  # the training thread's native id: parked there is stuck
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._left = threading.Event()
        # connected here, on the caller's thread, before the rendezvous: a connection opened
        # while ``store_link`` looks for a new store client's would be taken for it
        self._js = make_store()
        self._make_store = make_store
        self._store_gone_s = store_gone_s
        self._on_failure = on_failure
        self._progress = progress
        self._stuck_after_s = stuck_after_s
        self._on_stuck = on_stuck
        self._thread = threading.Thread(target=self._run, name=f"failure-watch-{generation}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def left(self) -> None:
        """The training thread is out of the generation's collectives."""
        self._left.set()

    def stop(self) -> None:
        """Disarm: a thread still blocked on the key fires nothing when it wakes."""
        self._stop.set()
        self._left.set()

    def _run(self) -> None:
        if not self._failed() or self._stop.is_set():
            return
        self.fired.set()
        self._on_failure()
        progress = self._progress
        if progress is None or self._on_stuck is None:
            return
        aborted = time.monotonic()  # the clock of ``progress``
        bound = self._stuck_after_s
        if bound is None:
            bound = stuck_bound(progress.gaps_s.copy())  # one C call: the training thread appends
        parked = _Parked(self._thread_id)
        while not self._left.wait(min(0.05, bound / 4)):
            _, phase, _, _, _, written = progress.read()
            now = time.monotonic()
            parked_s = parked.seconds(now)  # sampled in every phase: a change restarts it
            still_s = now - max(written, aborted)  # no progress since the abort
            if phase != Phase.TRAINING:
                continue
            if still_s >= bound:
                self._on_stuck(bound)
                return
            if parked_s >= PARKED_S and still_s >= PARKED_S:
                self._on_stuck(still_s)
                return


    def _failed(self) -> bool:
        """Wait until the generation fails (True), or the store is out of reach for
        ``store_gone_s`` (True: the job's coordination failed), or the watch is stopped."""
        key = f"g{self.generation}/fail"
        pause, unreached = STORE_RETRY_S[0], None
        while not self._stop.is_set():
            try:
                if self._js.wait(key, 24 * 3600.0):
                    return True
                continue
            except Exception as exc:  # this client is broken (a reset, a timed-out request)
                error = f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            unreached = now if unreached is None else unreached
            if now - unreached >= self._store_gone_s:
                print(f"in-process recovery: the job's store has been out of reach for "
                      f"{now - unreached:.1f} s ({error[:200]}): generation {self.generation} "
                      "can no longer be coordinated; aborting it", file=sys.stderr, flush=True)
                return True
            if self._stop.wait(pause):
                break
            pause = min(STORE_RETRY_S[1], 2 * pause)
            try:  # a fresh client: a store connection, which ``GlooSockets`` never shuts
                self._js = self._make_store()
                if self._js.has(key):
                    return True
                pause, unreached = STORE_RETRY_S[0], None  # reached again
            except Exception as exc:  # the store refused it, or it timed out connecting
                error = f"{type(exc).__name__}: {exc}"
        return False


class _Parked:
    """How long a thread has been asleep in one kernel wait, from samples of ``thread_wait``
    (0 while it runs, switches, or cannot be read)."""

    def __init__(self, tid: int | None) -> None:
        self.tid = tid
        self._last: tuple[str, int, int] | None = None
        self._since = 0.0

    def seconds(self, now: float) -> float:
        sample = thread_wait(self.tid) if self.tid is not None else None
        if sample is None or sample[0] != "S" or sample != self._last:
            self._last, self._since = sample, now
            return 0.0
        return now - self._since
