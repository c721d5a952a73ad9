"""``hang_rank``: a rank stops making progress without dying.

``mode: process`` SIGSTOPs the rank's training process (every thread), SIGCONT after
``duration_s`` if it is still alive. ``mode: thread`` stops only its training (main) thread
with ptrace (``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT``), its other threads (checkpoint persist,
watchers) running on, and detaches after ``duration_s``: the hang a heartbeat thread cannot
see. Either mode ends with the run at the latest (``Endings``). ptrace needs CAP_SYS_PTRACE
(root here) or a permissive Yama scope; where it is refused the fault is reported skipped with
the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from typing import Annotated, Literal

from pydantic import Field

from antifragile.chaos.faults.base import (
    FaultBase,
    Injection,
    RankTarget,
    Seconds,
    Target,
    alive,
)
from antifragile.chaos.infra.weed import process_state, start_time, wait_stopped

_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_WALL = 0x40000000
#: the states of a rank another hang holds: ``T`` SIGSTOPped (its SIGCONT would end a second
#: hang early), ``t`` its training thread held by ptrace (which a second tracer cannot seize,
#: and which never shows the ``T`` a SIGSTOP waits for)
_HELD = ("T", "t")
_EXITED = "the thread exited before it stopped"  # a rank dying as it was seized (a kill)
_NO_STOP = "no stop"  # seized, but the thread did not stop (asleep in uninterruptible I/O)
STOP_WAIT_S = 10.0  # how long a seized thread is given to stop


class HangRank(FaultBase):
    kind: Literal["hang_rank"]
    rank: RankTarget = "random"
    duration_s: Annotated[Seconds, Field(gt=0)] = 30.0
    mode: Literal["process", "thread"] = "process"

    def inject(self, target: Target, step: int | None) -> Injection:
        rank = target.resolve(self.rank)
        pid = target.pids[rank]
        detail = {"pid": pid, "duration_s": self.duration_s, "mode": self.mode}
        if process_state(pid) in _HELD:  # by another fault: it would end this one, or refuse it
            return Injection(self.kind, time.time(), step=step, rank=rank, detail=detail,
                             missed=f"rank {rank} (pid {pid}) was stopped already (another "
                                    "fault's hang) when this fault was due")
        if self.mode == "thread":
            hold = _ThreadHold(pid, target.started.get(rank))
            sent_t = time.time()
            error = hold.start()
            if error and (error == _EXITED or not alive(pid)):  # nothing to stop: no fault
                return Injection(self.kind, time.time(), step=step, rank=rank, detail=detail,
                                 missed=f"rank {rank} (pid {pid}) had already exited")
            if error == _NO_STOP:  # ptrace worked, the fault did not happen
                return Injection(self.kind, time.time(), step=step, rank=rank, detail=detail,
                                 missed=f"rank {rank} (pid {pid}): its thread did not stop "
                                        f"within {STOP_WAIT_S:g} s of the ptrace interrupt")
            if error:
                return Injection(self.kind, time.time(), step=step, rank=rank,
                                 skipped=f"ptrace of pid {pid} refused: {error}", detail=detail)
            target.hit.add(rank)
            done_t = time.time()
            target.endings.after(self.duration_s, lambda on_time: hold.release())
            return Injection(self.kind, sent_t, step=step, rank=rank,
                             detail={**detail, "tid": pid, "done_t": done_t})
        # continued as it is stopped: with its group, if it leads one. Told now, while it is
        # there: once the hung leader is killed and reaped its pid names no process, but the
        # rest of its group (a wrapper's training process, data loader workers) is still
        # stopped, and a resume that looked the group up by the leader's pid left it so
        try:
            group = os.getpgid(pid) == pid
        except ProcessLookupError:
            group = False  # gone: the signal finds it so
        started = target.started.get(rank)

        def resume() -> None:
            # a pid is not given again while its process or a group it led has members: one
            # that names another process now (the rank killed and reaped) names nothing of ours
            if start_time(pid) not in (None, started):
                return
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(pid, signal.SIGCONT)
                else:
                    os.kill(pid, signal.SIGCONT)

        sent_t = time.time()
        missed = target.signal(rank, signal.SIGSTOP)
        if missed:
            return Injection(self.kind, time.time(), step=step, rank=rank, missed=missed,
                             detail=detail)
        if not wait_stopped(pid):  # shows as stopped a moment after the signal, if ever
            # dying as it was stopped (a kill of the same moment): nothing is held, and the
            # attempt it ends is the kill's, not this fault's
            resume()
            why = ("had already exited" if not alive(pid)
                   else "was sent SIGSTOP but did not stop")
            return Injection(self.kind, time.time(), step=step, rank=rank, detail=detail,
                             missed=f"rank {rank} (pid {pid}) {why}")
        done_t = time.time()
        target.endings.after(self.duration_s, lambda on_time: resume())
        return Injection(self.kind, sent_t, step=step, rank=rank,
                         detail={**detail, "done_t": done_t})


class _ThreadHold:
    """Stops one thread with ptrace and lets it go at :meth:`release`. Every ptrace request
    must come from the tracing thread, so attach, hold and detach run in one thread here. The
    release is the fault's end in ``Endings`` (its time, or the run's end, whichever comes
    first): a hold that kept its own deadline outlived a run that ended sooner, its rank
    still stopped while ``chaos suite`` went on to the next scenario."""

    def __init__(self, tid: int, started: int | None) -> None:
        self.tid = tid
        self.started = started  # the start time of the process ``tid`` must still name
        self._stopped = threading.Event()
        self._release = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"ptrace-hold-{tid}",
                                        daemon=True)

    def start(self) -> str | None:
        """Returns once the thread is stopped (None), or why it is not: the attach failed
        (the reason), the thread exited (or its tid names another process now), or it did
        not stop within ``STOP_WAIT_S``."""
        self._thread.start()
        if self._stopped.wait(STOP_WAIT_S):
            return self._error
        self._release.set()  # given up (missed): a stop that comes later is let go at once
        return _NO_STOP

    def release(self) -> None:
        """Let the thread go; returns once the tracer has detached (or the tracee died)."""
        self._release.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        if self.started is None or start_time(self.tid) != self.started:  # reaped, pid reused
            self._error = _EXITED
            self._stopped.set()
            return
        if libc.ptrace(_PTRACE_SEIZE, self.tid, None, None) != 0:
            self._error = os.strerror(ctypes.get_errno())
            self._stopped.set()
            return
        libc.ptrace(_PTRACE_INTERRUPT, self.tid, None, None)
        try:
            _, status = os.waitpid(self.tid, _WALL)  # the interrupt stop, or its death
        except ChildProcessError:
            status = None
        if status is None or not os.WIFSTOPPED(status):  # killed as it was seized
            self._error = _EXITED
            self._stopped.set()
            return
        # a signal that reached the thread before the interrupt stops it first (a
        # signal-delivery stop: no ptrace event in the status); the detach hands it back,
        # else the tracer discards it and the rank never gets it
        pending = os.WSTOPSIG(status) if status >> 16 == 0 else 0
        self._stopped.set()
        while not self._release.wait(0.05):
            try:  # the process may be killed meanwhile (its supervisor found the hang)
                done, _ = os.waitpid(self.tid, _WALL | os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
        libc.ptrace(_PTRACE_DETACH, self.tid, None, pending or None)  # ESRCH: it died
