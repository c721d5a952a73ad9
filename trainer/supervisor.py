"""A rank's torchrun worker: it forks the training process and watches it from outside.

torchrun's agent tears the whole group down when any of its workers fails, and gives a worker
30 s after SIGTERM before SIGKILL, which a stopped (hung) worker never acts on. So the process
torchrun starts is this small supervisor; the training process is its child (forked after the
imports, so it starts with torch loaded, and killed with the supervisor: PR_SET_PDEATHSIG).

Watchdog: the training thread bumps a shared progress counter (``trainer.progress``). The
supervisor SIGKILLs its child, with no grace, when

- the child's main thread has been stopped (SIGSTOP: ``T``; a ptrace stop of that thread alone,
  with the other threads running: ``t``) for the hang timeout, in any phase, or
- the counter has not moved for ``escalate`` x the timeout while the child says it is training
  (a hang that stops no thread: a deadlock, a cut link). Checkpoints, restores, pause points
  and spares are not training, so they are never taken for hangs.

The timeout is ``--hang-timeout-s`` when given, else ``max(floor, k x p99)`` of the intervals
between bumps seen so far, so slow steps (8 ranks on 2 cores) are not false alarms.

When the child dies: in ``restart`` mode the supervisor exits with the child's code and torchrun
restarts the group. In ``in_process`` mode it reports the death in the launcher's store, waits
until the survivors have re-formed the group with a spare (else it exits non-zero and torchrun
restarts everything), and forks a fresh child that starts as a spare: the pool refills. Where
the job has spares, that child is registered as one before the death is reported, so a second
loss during the re-formation still finds a spare (``report_death``). It also holds a lease on
its slot, and slot 0's supervisor judges every slot's, so that a slot that dies whole (its
supervisor too: a lost host) is declared dead by someone (``trainer.lease``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from antifragile.engine._events import open_event_file
from antifragile.trainer.lease import (
    Heartbeat,
    Holder,
    LeaseMonitor,
    Lost,
    renewal_interval_s,
)
from antifragile.trainer.progress import (
    HANG_FLOOR_S,
    STALL_ESCALATION,
    WATCH_POLL_S,
    Phase,
    SharedProgress,
    default_lease_s,
)
from antifragile.trainer.recovery import (
    first_generation_of,
    job_done,
    register_spare,
    report_death,
    restart_reason,
    worker_id,
)

HANG_EXIT_CODE = 43  # the supervisor killed a hung child
RESTART_EXIT_CODE = 44  # in-process recovery found no spare: torchrun restarts the group
STUCK_EXIT_CODE = 45  # in-process recovery: stuck after the abort, or counted lost (a death)
USAGE_EXIT_CODE = 2  # the launch does not fit the configuration: a fresh process would fail too
# the last step's checkpoint failed for its patience (every rank agreed): a restart trains the
# steps since the last committed one again and saves them
FINAL_SAVE_EXIT_CODE = 46
# the run has checkpoints and none loads (all damaged, or not this state's): starting over
# would lose them, a restart meets the same; the job ends for an operator to look
NO_RESUME_EXIT_CODE = 47
SPARE_RETRIES = 3  # fresh processes of a slot that die in a row before they train: give up
# a look of the watchdog that comes later than this after the previous one counts as this
# long: the supervisor was paused with its child (a container or VM pause), which could not
# bump meanwhile (see ``Watchdog.observe``)
LATE_LOOK_S = 1.0
_PR_SET_PDEATHSIG = 1
# the latest intervals the adaptive timeout is judged from: a window, not the whole run (the
# supervisor lives as long as its slot, and sees up to 1 / WATCH_POLL_S intervals a second)
INTERVAL_WINDOW = 1000


@dataclass(slots=True)
class Watchdog:
    """Judges progress samples; pure logic (the supervisor feeds it, tests too)."""

    hang_timeout_s: float | None = None  # None: adaptive
    floor_s: float = HANG_FLOOR_S
    k: float = 20.0
    escalate: float = STALL_ESCALATION
    max_round_s: float | None = None  # a later look counts as this long (None: as it came)
    _intervals: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVAL_WINDOW))
    _last_counter: int = -1
    _last_change: float = 0.0
    _last_phase: Phase | None = None  # the phase seen at the last change of the counter
    _stopped_since: float | None = None
    _looked: float | None = None  # ``now`` of the previous look
    _clock: float = 0.0  # seconds the watchdog looked for (see ``observe``)

    def timeout_s(self) -> float:
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        if len(self._intervals) < 10:
            return self.floor_s
        ordered = sorted(self._intervals)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return max(self.floor_s, self.k * p99)

    def observe(self, now: float, counter: int, phase: Phase, stopped: bool) -> str | None:
        """``"stopped"`` or ``"stalled"`` when the child is hung, else None.

        Time is counted on the watchdog's own clock of looking, a look that comes late counting
        as ``max_round_s`` at most: a supervisor paused with its host saw nothing meanwhile,
        and its child, paused too, could not bump; its first look after the pause must not
        take the pause for a stall."""
        if self._looked is not None:
            late = now - self._looked
            self._clock += late if self.max_round_s is None else min(late, self.max_round_s)
        self._looked = now
        now = self._clock
        if counter != self._last_counter:
            # an interval of the training loop: both of its ends seen while training (the
            # time from entering a save, a restore or a pause to leaving it is not one)
            if phase == Phase.TRAINING and self._last_phase == Phase.TRAINING:
                self._intervals.append(now - self._last_change)
            self._last_counter, self._last_change, self._last_phase = counter, now, phase
        if not stopped:
            self._stopped_since = None
        elif self._stopped_since is None:  # not ``or``: the first look's clock reads 0.0
            self._stopped_since = now
        if phase in (Phase.DONE, Phase.SPARE) and not stopped:
            return None
        timeout = self.timeout_s()
        if self._stopped_since is not None and now - self._stopped_since >= timeout:
            return "stopped"
        if phase == Phase.TRAINING and now - self._last_change >= self.escalate * timeout:
            return "stalled"
        return None

    def stall_s(self) -> float:
        return self._clock - self._last_change


def main_thread_state(pid: int) -> str:
    """The scheduler state of ``pid``'s main thread (``R``, ``S``, ``T``, ``t``, ``Z``...)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1][:1].decode()
    except (OSError, IndexError):
        return "?"


class _SupervisorEvents:
    """``events/supervisor<slot>.jsonl``: what the supervisor saw and did."""

    def __init__(self, run_dir: str | None, slot: int) -> None:
        self._file = None
        if run_dir:
            os.makedirs(os.path.join(run_dir, "events"), exist_ok=True)
            self._file = open_event_file(os.path.join(run_dir, "events",
                                                      f"supervisor{slot}.jsonl"))
        self.slot = slot

    def emit(self, event: str, *, rank: int, attempt: int, **fields: Any) -> None:
        """Best effort: a line the disk has no room for is lost, never the death's handling."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.write(json.dumps({"t": time.time(), "rank": rank,
                                             "attempt": attempt, "event": event,
                                             "by": "supervisor", "slot": self.slot,
                                             **fields}) + "\n")


def _fork_child(child_main: Callable[[SharedProgress, int], int], progress: SharedProgress,
                incarnation: int) -> int:
    supervisor = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # the supervisor died between fork and prctl: reparented, to init or to a subreaper
        if os.getppid() != supervisor:
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        code = child_main(progress, incarnation)
    except SystemExit as exc:  # as Python's own exit: None is 0, any other object is said, 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # unreachable


@dataclass(slots=True)
class _Death:
    code: int  # the exit code (negative: the signal)
    hung: bool
    rank: int
    generation: int
    phase: Phase
    pid: int


def _reap(current: dict[str, Any], *, block: bool) -> int | None:
    """The exit code of the child ``current["pid"]`` once it has exited (None: it runs on,
    ``block`` False), reaped only after ``current`` forgets its pid. Until it is reaped the
    pid is the child's (a zombie's), which the SIGTERM handler of :func:`supervise` may signal
    at any moment; once reaped it may be another process's, and a handler run between
    ``waitpid`` and the forgetting SIGKILLed that process."""
    pid = current["pid"]
    flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
    if os.waitid(os.P_PID, pid, flags) is None:
        return None
    current["pid"] = 0
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _watch(current: dict[str, Any], progress: SharedProgress, watchdog: Watchdog,
           events: _SupervisorEvents, slot: int, poll_s: float) -> _Death:
    """Until the child ``current["pid"]`` exits (or is killed here, hung); it is reaped, and
    ``current["pid"]`` 0, on return."""
    pid = current["pid"]
    while True:
        code = _reap(current, block=False)
        counter, phase, generation, rank, step, _ = progress.read()
        if code is not None:
            return _Death(code, False, rank, generation, phase, pid)
        state = main_thread_state(pid)
        hung = watchdog.observe(time.monotonic(), counter, phase, stopped=state in ("T", "t"))
        if hung:
            judged_at = time.time()  # the event's time: a big process takes a while to reap
            os.kill(pid, signal.SIGKILL)
            code = _reap(current, block=True)
            assert code is not None  # waited for
            if code != -signal.SIGKILL:  # it exited on its own as it was judged: no hang
                counter, phase, generation, rank, step, _ = progress.read()
                return _Death(code, False, rank, generation, phase, pid)
            events.emit("hang_detected", rank=rank, attempt=generation, pid=pid, how=hung,
                        t=judged_at, thread_state=state, stall_s=watchdog.stall_s(),
                        timeout_s=watchdog.timeout_s(), step=step, phase=phase.name.lower())
            print(f"[supervisor {slot}] rank {rank} hung ({hung}, main thread {state!r}, no "
                  f"progress for {watchdog.stall_s():.1f} s): SIGKILL pid {pid}",
                  file=sys.stderr, flush=True)
            return _Death(-signal.SIGKILL, True, rank, generation, phase, pid)
        time.sleep(poll_s)


def supervise(child_main: Callable[[SharedProgress, int], int], *, slot: int, recovery: str,
              hang_timeout_s: float | None, run_dir: str | None,
              store_factory: Callable[[], Any] | None = None, poll_s: float = WATCH_POLL_S,
              reform_timeout_s: float = 120.0, spares: int = 0, slots: int = 1,
              lease_s: float | None = None) -> int:
    """Run ``child_main(progress, incarnation)`` in a forked child and watch it; returns this
    worker's exit code. In in-process mode a dead child is reported and replaced by a fresh
    one that starts as a spare (incarnation + 1); ``spares``: how many the job started with.
    In in-process mode the supervisor also holds a lease on its slot, and slot 0's judges the
    leases of all ``slots`` (``trainer.lease``; ``lease_s``: default ``default_lease_s``)."""
    events = _SupervisorEvents(run_dir, slot)
    current: dict[str, Any] = {"pid": 0, "incarnation": 0, "progress": None}

    def stop(signum: int, _: object) -> None:  # torchrun tears the group down
        if current["pid"]:
            with contextlib.suppress(OSError):
                os.kill(current["pid"], signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    js = heartbeat = None
    incarnation = idle_deaths = 0
    while True:
        progress = SharedProgress()
        current.update(progress=progress, incarnation=incarnation)
        current["pid"] = _fork_child(child_main, progress, incarnation)
        if js is None and recovery == "in_process" and store_factory is not None:
            # connected now, while the network is whole: a death reported across a cut link
            # (or one just healed) goes over a live connection, not a new one whose connect
            # attempts time out (30 s) and back off (another 33 s) in torch's TCPStore client
            js = store_factory()
            heartbeat = _hold_leases(store_factory, slot, slots, current, events,
                                     lease_s if lease_s is not None
                                     else default_lease_s(hang_timeout_s))
        watchdog = Watchdog(hang_timeout_s=hang_timeout_s, max_round_s=LATE_LOOK_S)
        death = _watch(current, progress, watchdog, events, slot, poll_s)  # reaped, forgotten
        if death.code == 0:
            if heartbeat is not None:
                heartbeat.retire()
            return 0
        how = f"signal {-death.code}" if death.code < 0 else f"exit code {death.code}"
        if death.code == STUCK_EXIT_CODE:
            how += " (stuck in the failed generation's collective after the abort, or came " \
                   "too late to the re-formation: counted lost)"
        events.emit("rank_died", rank=death.rank, attempt=death.generation, pid=death.pid,
                    how=how, hung=death.hung, phase=death.phase.name.lower(),
                    incarnation=incarnation)
        exit_code = HANG_EXIT_CODE if death.hung else (death.code if death.code > 0 else 1)
        if recovery != "in_process" or store_factory is None or \
                death.code in (RESTART_EXIT_CODE, USAGE_EXIT_CODE, FINAL_SAVE_EXIT_CODE,
                               NO_RESUME_EXIT_CODE):
            return exit_code
        member = death.phase != Phase.SPARE and death.generation >= 0
        generation = death.generation
        if incarnation == 0 and death.phase == Phase.STARTING and death.generation < 0:
            # died starting: a member of the first formation all the same if listed there
            first = first_generation_of(js, worker_id(slot, 0), reform_timeout_s)
            if first is None:
                events.emit("fallback", rank=death.rank, attempt=death.generation,
                            error="died before the first generation formed: nothing to "
                                  "re-form, torchrun restarts the group")
                return exit_code
            generation, member = first, first >= 0
        idle_deaths = 0 if member else idle_deaths + 1
        refill = idle_deaths < SPARE_RETRIES
        successor = worker_id(slot, incarnation + 1)  # this slot becomes a spare again
        # registered at once where the job has spares: the pool refills as the survivors re-form
        if not report_death(js, me=worker_id(slot, incarnation), generation=generation,
                            successor=successor if spares and refill else None, how=how,
                            member=member, reform_timeout_s=reform_timeout_s):
            # the survivors could not re-form (or there were none): torchrun restarts the group
            events.emit("fallback", rank=death.rank, attempt=generation,
                        error=restart_reason(js, generation, reform_timeout_s))
            return exit_code
        if not refill:
            return _give_up(js, events, death, slot, idle_deaths)
        if not spares:
            register_spare(js, successor)
        if job_done(js):  # after registering: ``finish`` released the spare or ran before
            return 0
        incarnation += 1


def _hold_leases(store_factory: Callable[[], Any], slot: int, slots: int,
                 current: dict[str, Any], events: _SupervisorEvents, lease_s: float
                 ) -> Heartbeat:
    """Renew this slot's lease on a thread of its own (its own store client); slot 0 also
    judges every slot's."""
    def holder() -> Holder:
        _, phase, generation, _, _, _ = current["progress"].read()
        return Holder(worker_id(slot, current["incarnation"]), generation,
                      phase != Phase.SPARE and generation >= 0)

    def lost(found: Lost) -> None:
        events.emit("rank_died", rank=found.rank, attempt=found.generation, slot=found.slot,
                    worker=found.worker, how=found.how, hung=False, lost=True,
                    phase="spare" if found.rank < 0 else "unknown")
        print(f"[supervisor {slot}] {f'rank {found.rank}' if found.rank >= 0 else 'spare'} "
              f"(worker {found.worker}) {found.how}", file=sys.stderr, flush=True)

    every_s = renewal_interval_s(slots, lease_s)
    heartbeat = Heartbeat(store_factory(), slot, holder, interval_s=every_s,
                          reconnect=store_factory)
    heartbeat.start()
    if slot == 0:
        LeaseMonitor(slots, lease_s, every_s).start(store_factory(), lost,
                                                    reconnect=store_factory)
    return heartbeat


def _give_up(js: Any, events: _SupervisorEvents, death: _Death, slot: int, deaths: int) -> int:
    """The slot's fresh processes died ``deaths`` times in a row before they trained: stop
    forking (a crash loop helps nobody), say so, and wait for the job to end without this slot
    (torchrun's teardown, on a restart, ends this process as any other)."""
    events.emit("spare_lost", rank=death.rank, attempt=death.generation, deaths=deaths)
    print(f"[supervisor {slot}] gives up on this slot: {deaths} fresh processes in a row died "
          "before they trained; the job goes on with one spare fewer", file=sys.stderr,
          flush=True)
    while not job_done(js):
        time.sleep(0.5)
    return 0
