"""Progress of the training loop, shared between a rank's training process and its supervisor.

The training thread bumps a counter at every step and every block's forward (micro-steps), and
says which phase it is in; the supervisor (``trainer.supervisor``) reads both to tell a hang
from a slow step, and a checkpoint or a restore (not hangs) from training. One anonymous shared
memory page, created before the fork, so reading it costs the supervisor no system call and
writing it costs the training thread a store to memory. Nothing here imports torch.
"""

from __future__ import annotations

import enum
import mmap
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

# How the supervisor's watchdog judges a silent counter (``trainer.supervisor.Watchdog``);
# here, torch-free, for chaos's validation and measurements too:
HANG_FLOOR_S = 10.0  # the adaptive hang timeout never goes below this
STALL_ESCALATION = 3.0  # a counter still while training: a hang after this x the timeout
# the shortest lease (``trainer.lease``): four renewals at the heartbeat's pace (0.25 s). A
# shorter one is renewed faster (every lease / 4), and a renewal late by a store round trip or
# a busy host's scheduling takes a healthy slot for lost
MIN_LEASE_S = 1.0
WATCH_POLL_S = 0.05  # how often the supervisor looks at the counter
# the shortest hang timeout: two looks; a shorter one cannot tell a block's forward from a hang
MIN_HANG_TIMEOUT_S = 2 * WATCH_POLL_S
# the shortest collective timeout: it also bounds each worker's connection to the launcher's
# store and the wait for every worker to start (importing torch takes seconds); below a second
# every training process failed with a traceback, which a restart only repeated
MIN_COLLECTIVE_TIMEOUT_S = 1.0
LEASE_S = 5.0  # the default silence after which a slot is lost (see ``default_lease_s``)


def default_lease_s(hang_timeout_s: float | None) -> float:
    """5 s, or 1.5 x the hang timeout where that is shorter (a survivor waiting in a collective
    for a lost peer is killed by its own watchdog after 3 x the hang timeout), never below
    ``MIN_LEASE_S``: so a hang timeout of 1/3 s or less leaves no lease that works."""
    return LEASE_S if hang_timeout_s is None else max(MIN_LEASE_S, min(LEASE_S,
                                                                      1.5 * hang_timeout_s))


def lease_conflict(recovery: str, lease_s: float | None, hang_timeout_s: float | None, *,
                   option: Callable[[str], str] = str) -> str | None:
    """Why a lease (given, or the default one) cannot work beside this hang timeout, or None.
    A survivor waiting in a collective for a lost host is killed by its own watchdog after
    ``STALL_ESCALATION`` x the hang timeout (x its floor when adaptive), so the lease that
    declares the host lost must end first. ``option`` names a setting as the caller's user
    writes it (a scenario's key, or the trainer's flag); the message starts with the one to
    change. Checked by the trainer and, before a launch, by ``chaos validate``."""
    lease, hang = option("lease_s"), option("hang_timeout_s")
    if lease_s is not None and recovery != "in_process":
        return (f"{lease}: leases are held only under recovery in_process (in restart mode "
                "torchrun's agents watch the workers)")
    if recovery != "in_process":
        return None
    if lease_s is None:
        if hang_timeout_s is None or default_lease_s(hang_timeout_s) < (
                STALL_ESCALATION * hang_timeout_s):
            return None
        return (f"{hang}: {hang_timeout_s:g} is too short under recovery in_process: the lease "
                f"that finds a lost host (at least {MIN_LEASE_S:g} s) must be below "
                f"{STALL_ESCALATION:g} x it; set {hang} above "
                f"{MIN_LEASE_S / STALL_ESCALATION:.2f}")
    if hang_timeout_s is not None:
        if lease_s < STALL_ESCALATION * hang_timeout_s:
            return None
        return (f"{lease}: {lease_s:g} s is not below the watchdog's stall escalation, "
                f"{STALL_ESCALATION:g} x {hang} = {STALL_ESCALATION * hang_timeout_s:g} s: "
                "survivors waiting for a lost host would be killed by their own watchdogs "
                "before it is declared lost")
    if lease_s < STALL_ESCALATION * HANG_FLOOR_S:
        return None
    # the adaptive timeout may stay at its floor (steps of a second or less)
    return (f"{lease}: {lease_s:g} s is not below the watchdog's stall escalation under the "
            f"adaptive hang timeout, {STALL_ESCALATION:g} x its floor of {HANG_FLOOR_S:g} s = "
            f"{STALL_ESCALATION * HANG_FLOOR_S:g} s: set {hang}, or a shorter {lease}")


_LAYOUT = struct.Struct("<QQqqqd")  # counter, phase, generation, rank, step, bumped_at


class Phase(enum.IntEnum):
    STARTING = 0  # importing, building, joining the process group
    TRAINING = 1  # the loop: a counter that stops moving here is a hang
    CHECKPOINT = 2  # waiting for a save (staging, or the final blocking save)
    RESTORING = 3  # loading a checkpoint
    PAUSED = 4  # held at a pause point by chaos
    RECOVERING = 5  # re-forming the process group after a failure
    SPARE = 6  # a warm spare, idle until it takes over a rank
    DONE = 7


class SharedProgress:
    """Written by the training process only; read by its supervisor (and tests)."""

    def __init__(self, buffer: mmap.mmap | bytearray | None = None) -> None:
        self._buf = buffer if buffer is not None else mmap.mmap(-1, mmap.PAGESIZE)
        self._counter = 0
        self._phase = Phase.STARTING
        self._generation = -1
        self._rank = -1
        self._step = 0
        # the latest times between two writes while training: what "no progress for a while"
        # means for this model on this machine (read by this process only, not shared)
        self.gaps_s: deque[float] = deque(maxlen=512)
        self._written = 0.0  # monotonic time of the last write (set by _write)
        self._before_hold = Phase.TRAINING  # the phase a pause point's hold returns to
        self._holds = 0  # pause points holding a thread of this process now
        self._hold_lock = threading.Lock()
        self._write(time.monotonic())

    def _gap(self, *, counts: bool = True) -> float:
        """Now; the time since the last write counts as a gap if it was spent training (and
        ``counts``: not when it ended in a failure). Monotonic: a step of the wall clock (NTP) is
        neither a gap nor progress."""
        now = time.monotonic()
        if counts and self._phase == Phase.TRAINING:
            self.gaps_s.append(now - self._written)
        return now

    def _write(self, now: float) -> None:
        # one copy of the packed record: ``pack_into`` zeroes the record before it packs each
        # field, which a read meanwhile would see (a counter gone back to 0, a write at time 0)
        self._written = now
        self._buf[:_LAYOUT.size] = _LAYOUT.pack(self._counter, int(self._phase),
                                                self._generation, self._rank, self._step, now)

    def bump(self) -> None:
        """A unit of training progress (a block's forward, a step)."""
        self._counter += 1
        self._write(self._gap())

    def set(self, phase: Phase, *, generation: int | None = None, rank: int | None = None,
            step: int | None = None) -> None:
        # a wait that ended in the generation's failure (a collective the abort broke) is no
        # gap of the loop: it would lengthen the next generation's stuck bound
        now = self._gap(counts=phase != Phase.RECOVERING)
        self._phase = phase
        if generation is not None:
            self._generation = generation
        if rank is not None:
            self._rank = rank
        if step is not None:
            self._step = step
        self._counter += 1
        self._write(now)

    def hold(self, held: bool) -> None:
        """Held at a chaos pause point (``PAUSED``), and released: once no hold is left, back
        to the phase it was in when held, unless that moved meanwhile. A save's pause point
        holds the save's own thread while the training thread may wait in a blocking save
        (``CHECKPOINT``), whose rest ``TRAINING`` would have the watchdog take for a stall, or
        go on to be held at a later step's point, which the save's release does not end."""
        with self._hold_lock:  # the two holds are on two threads
            if held:
                if self._phase != Phase.PAUSED:
                    self._before_hold = self._phase
                self._holds += 1
                self.set(Phase.PAUSED)
            else:
                self._holds -= 1
                if self._holds == 0 and self._phase == Phase.PAUSED:
                    self.set(self._before_hold)

    def read(self) -> tuple[int, Phase, int, int, int, float]:
        """(counter, phase, generation, rank, step, ``time.monotonic()`` of the last write:
        the same clock in every process of the host)."""
        # a copy first: ``unpack_from`` reads each field a byte at a time, across a write
        counter, phase, generation, rank, step, at = _LAYOUT.unpack(self._buf[:_LAYOUT.size])
        return counter, Phase(phase), generation, rank, step, at
