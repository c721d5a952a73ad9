"""Run a scenario: launch the trainer, inject its faults from outside, record what happened.

The runner only watches the trainer's event files and the worker processes; faults are
signals and storage operations done to the job, never code inside it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from antifragile.chaos.faults import Injection, Target
from antifragile.chaos.faults.base import Endings, alive, send
from antifragile.chaos.infra.launch import launch, launch_hosts
from antifragile.chaos.infra.netns import NetnsUnavailable, Network
from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.chaos.infra.s3 import ENDPOINT_VARS, RunStorage
from antifragile.chaos.infra.weed import start_time
from antifragile.chaos.observe.measure import detection_window_s
from antifragile.chaos.observe.record import EventLogError, EventTail, RunRecord
from antifragile.chaos.run.draws import Draws
from antifragile.chaos.run.pauses import (
    Pending,
    Point,
    mesh_coordinates,
    pause_plan,
    release,
    write_plan,
)
from antifragile.chaos.run.workers import WorkerWatch, children, left_behind, started_at
from antifragile.chaos.scenario import Scenario

#: the job's silence (no event) after which the user is told that chaos still waits for it
QUIET_S = 60.0


class ChaosRunError(Exception):
    """A run that could not be made, for a reason the user must fix (the fault-free reference
    run failed or left no checkpoint, a run went past its time limit): no verdict. The message
    is meant for the user as is."""


class RunTimeout(ChaosRunError, TimeoutError):
    """A run went past its time limit; the job was killed."""


def run_scenario(s: Scenario, run_dir: Path, ckpt_url: str, *, faults: bool = True,
                 storage: RunStorage | None = None,
                 on_event: Callable[[dict[str, Any], list[Injection]], None] | None = None,
                 note: Callable[[str], None] | None = None, quiet_s: float = QUIET_S
                 ) -> RunRecord:
    """Run the trainer for ``s`` (with its faults unless ``faults=False``) to the end.
    ``storage``: S3 set up for the run (the trainer's endpoint, the fault proxy). On emulated
    hosts the trainer reaches that endpoint through a relay on the network's bridge.
    ``note`` is told when the job has reported nothing for ``quiet_s`` seconds (then again
    after twice that silence, and so on): a script hung at its exit, or anywhere else, holds
    the run to ``time_limit_s``, and the user is to know that chaos is waiting and for what.

    Step- and checkpoint-triggered faults land through pause points (``trainer.pause``): the
    trainer holds where the fault is due, the runner injects, then releases it. Random
    (``mtbf_s``) arrivals and ``at_s`` faults are injected when they fall due, wherever the
    trainer is, once every rank of the current attempt is up.

    A command trainer's ranks are also found from outside (``workers.WorkerWatch``), so
    time-based faults reach a script that never calls the probe."""
    draws = Draws(s.seed)
    wait_s = detection_window_s(s)  # for every rank to reach a pause point
    pending = [Pending(f, i) for i, f in enumerate(s.faults if faults else [])]
    max_restarts = 2 * len(pending) + (50 if any(p.fault.mtbf_s for p in pending) else 0)
    points = pause_plan(s, pending, draws)
    write_plan(run_dir, points)
    hosts = _Hosts.open(s.trainer.nodes)
    relay: FaultProxy | None = None
    agents = _Agents([])
    tail = EventTail(run_dir)
    watch: WorkerWatch | None = None
    observed: list[dict[str, Any]] = []  # worker_started, seen by chaos in /proc
    injections: list[Injection] = []
    job = _Job(s.trainer.world_size)
    endings = Endings()  # of the faults that last: made by the end of the run at the latest
    heard_t, silence_s = time.time(), quiet_s  # the newest event; the silence worth a note
    try:
        env = storage.trainer_env if storage else None
        if hosts.network is not None and env and storage and storage.endpoint:
            # emulated hosts reach only the emulated network: S3 is relayed from the bridge
            listener = hosts.network.listen()
            try:
                relay = FaultProxy.in_front_of(env["AWS_ENDPOINT_URL"], listener=listener)
            except BaseException:  # once made, the relay closes it
                listener.close()
                raise
            env = {**env, **{var: relay.endpoint_url for var in ENDPOINT_VARS}}
        # the run's wall time is the job's: from its launch (not from making its hosts)
        started = time.time()
        for p in pending:
            if p.fault.mtbf_s:
                p.next_t = started + draws.arrivals(p.index).expovariate(1 / p.fault.mtbf_s)
            elif p.fault.at_s is not None:
                p.next_t = started + p.fault.at_s
        agents.procs = (launch_hosts(s, run_dir, ckpt_url, max_restarts=max_restarts,
                                     network=hosts.network, env=env) if hosts.network
                        else [launch(s, run_dir, ckpt_url, max_restarts=max_restarts, env=env)])
        if s.is_command:
            watch = WorkerWatch(agents.procs[0].pid)

        def make_time_fault(p: Pending, picks: random.Random) -> None:
            injection = _inject(p.fault, _target(s, job, ckpt_url, picks, storage, hosts,
                                                 endings),
                                job.step or (None if s.is_command else 0))
            agents.note(injection)
            injection.fault_index = p.index
            injections.append(injection)

        while agents.running(job.finished):
            if time.time() - started > s.time_limit_s:
                raise RunTimeout(f"the {'faulty' if faults else 'fault-free'} run of {s.name} "
                                 f"went past its time limit of {s.time_limit_s:g} s "
                                 f"(time_limit_s) and was killed; see "
                                 f"{run_dir / 'torchrun.log'}")
            for e in watch.poll() if watch else []:
                observed.append(e)
                job.see(e)
                heard_t, silence_s = time.time(), quiet_s
            for e in _read(tail):
                job.see(e)
                heard_t, silence_s = time.time(), quiet_s
                if on_event:
                    on_event(e, injections)
                if e["event"] == "paused":
                    point = points.get(e["point"])
                    if point is not None and job.all_paused(point, e):
                        # one target for the point: a random rank avoids those already hit
                        # there; each fault picks with its own generator (``Draws``)
                        target: Target | None = None
                        for index, fault in point.faults:
                            picks = draws.targets(index)
                            if target is None:
                                target = _target(s, job, ckpt_url, picks, storage, hosts,
                                                 endings)
                            target.rng = picks
                            injection = _inject(fault, target, point.step)
                            agents.note(injection)
                            injection.fault_index = index
                            injection.detail["paused_s"] = time.time() - point.first_paused_t
                            injections.append(injection)
                        release(run_dir, point)
                        job.hold_ended(point, time.time(), complete=True)
            now = time.time()
            for point in points.values():
                if job.waits_in_vain(point, now, wait_s):
                    # a rank that never comes (a script that calls the probe on rank 0 only)
                    # would hold the others until the run's time limit: the faults due here
                    # did not happen, and the held ranks go on
                    missing = point.missing(s.trainer.world_size)
                    ranks = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(
                        map(str, missing))
                    why = (f"{ranks} never reached {point.describe()} in {wait_s:g} s after "
                           "the others (a script must call antifragile.probe.step_end on "
                           "every rank)")
                    for index, fault in point.faults:
                        injections.append(Injection(fault.kind, now, step=point.step,
                                                    missed=why, fault_index=index))
                    release(run_dir, point)
                    job.hold_ended(point, now, complete=False)
            if job.generations:
                _time_faults(pending, now, lambda: _up(s, job), draws, make_time_fault)
            job.check_ends(time.time())
            if note is not None and time.time() - heard_t >= silence_s:
                note(_silence(s, job, faults=faults, silent_s=silence_s,
                              elapsed_s=time.time() - started))
                silence_s *= 2
            time.sleep(0.02)
        # ... to the end of its last worker: undoing the faults that last, stopping leftover
        # agents and taking the hosts down below are chaos's time
        ended = time.time()
    finally:
        _every(endings.end_now,  # a link restored before its network goes, a fill stopped
               agents.kill, functools.partial(_kill_left_behind, run_dir) if s.is_command
               else None, relay.close if relay is not None else None,
               hosts.network.close if hosts.network is not None else None)
    for e in _read(tail):
        job.see(e)
    for generation in job.generations:
        job.ends.setdefault(generation, ended)
    events = sorted(tail.events + observed, key=lambda e: e["t"])  # polls read file by file
    return RunRecord(agents.returncode, started, ended, events, injections, job.ends,
                     paused_s=job.paused_s)


def _silence(s: Scenario, job: _Job, *, faults: bool, silent_s: float,
             elapsed_s: float) -> str:
    """What the runner tells the user when the job has been silent for ``silent_s``."""
    g = max(job.generations, default=None)
    running = 0 if g is None else sum(job.runs(g, r) for r in job.generations[g])
    # a restarted attempt before its first step is not back at step 0
    newest = (f"step {job.step}" if g in job.steps
              else f"no step{f' of attempt {g}' if g else ''} yet")
    ranks = "1 rank still runs" if running == 1 else f"{running} ranks still run"
    return (f"the {'faulty' if faults else 'fault-free'} run: nothing reported for "
            f"{silent_s:g} s (newest: {newest}; {ranks}); waiting for it to end, up to "
            f"time_limit_s {s.time_limit_s:g} s ({elapsed_s:.0f} s gone)")


def _time_faults(pending: list[Pending], now: float, up: Callable[[], bool], draws: Draws,
                 make: Callable[[Pending, random.Random], None]) -> None:
    """Make each time-triggered fault of ``pending`` due at ``now`` (``make``, given the
    generator its targets are picked from) if the job is ``up``, and draw its next arrival.

    An arrival while the job is down (re-forming, restarting) or after its last step has
    nothing to hit: it is drawn again rather than fired at dead pids. How many arrivals are
    drawn again depends on how long the job is down, so the targets are picked from generators
    of their own (``Draws``): the k-th firing of a fault picks the same ones in every run with
    the scenario's seed."""
    for p in pending:
        if p.next_t is None or now < p.next_t:
            continue
        fire = up()
        if fire:
            make(p, draws.targets(p.index))
        if p.fault.mtbf_s:
            p.next_t = now + draws.arrivals(p.index).expovariate(1 / p.fault.mtbf_s)
        elif fire:  # at_s: once, at the first moment the job is up after it
            p.next_t = None


def _up(s: Scenario, job: _Job) -> bool:
    """Every rank of the job's newest generation runs, and (the built-in trainer) it is before
    its last step: a time-triggered fault has something to hit."""
    pids = job.current_pids()
    return (len(pids) == s.trainer.world_size
            and (s.is_command or job.step < s.trainer.steps)
            and all(job.runs(max(job.generations), r) for r in pids))


def _every(*steps: Callable[[], None] | None) -> None:
    """Run each cleanup step in order, the later ones also after one raised: a Ctrl-C or
    SIGTERM during one (``lifetime.stop_once`` raises it once, then lets cleanup run) must
    not leave the job running or the emulated hosts up. What was raised is raised after."""
    with contextlib.ExitStack() as stack:
        for step in reversed(steps):
            if step is not None:
                stack.callback(step)


def _kill_left_behind(run_dir: Path, *, wait_s: float = 2.0) -> None:
    """SIGKILL what the script's ranks started and left running (``workers.left_behind``),
    until none is left (one may fork as it is killed), and wait for them to be gone."""
    folder = os.path.abspath(run_dir)  # as the script was given it (``launch.command_env``)
    deadline = time.monotonic() + wait_s
    while (pids := [p for p in left_behind(folder) if alive(p)]) \
            and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _inject(fault: Any, target: Target, step: int | None) -> Injection:
    """Make ``fault``; one whose making raised (storage failing under it, a checkpoint an
    earlier fault damaged) did not happen as the scenario says: it is missed, naming the
    error (the verdict fails), and the run goes on to its end instead of a traceback."""
    try:
        injection: Injection = fault.inject(target, step)
    except Exception as exc:
        rank = getattr(fault, "rank", None)  # "random" or absent: not known
        return Injection(fault.kind, time.time(), step=step,
                         rank=rank if isinstance(rank, int) else None,
                         missed=f"{fault.kind} failed as it was made: "
                                f"{type(exc).__name__}: {exc}")
    return injection


def _read(tail: EventTail) -> list[dict[str, Any]]:
    """The events written since the last read; a line that is no event ends the run with no
    verdict (ChaosRunError naming the file and the line), since the verdict may rest on it."""
    try:
        return tail.poll()
    except EventLogError as exc:
        raise ChaosRunError(f"an event file of the run is damaged, so the run cannot be "
                            f"judged (an event the verdict needs may be lost): {exc}") from None


#: how much later than the event that named it a process may seem to have started (its start
#: is read in clock ticks on the boot clock, the event's time on the wall clock)
START_SLACK_S = 1.0


class _Job:
    """What the runner knows of the job: every generation's ranks and pids (from ``start``
    events), where it is, and when each generation ended (all its ranks dead, or past it)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.generations: dict[int, dict[int, int]] = {}  # generation -> rank -> pid
        self.named_t: dict[tuple[int, int], float] = {}  # (generation, rank) -> when its pid was
        #: (generation, rank) -> its process's start time (``start_time``), read when an event
        #: first named it; None: it no longer ran then
        self.started: dict[tuple[int, int], int | None] = {}
        self.left: dict[int, set[int]] = {}  # generation -> ranks that tore it down
        self.clean: dict[int, set[int]] = {}  # generation -> ranks that exited with code 0
        self.ends: dict[int, float] = {}
        self.steps: dict[int, int] = {}  # generation -> newest step it finished or restored
        self.paused_s = 0.0
        #: generation -> the steps whose save a rank of it staged
        self.staged: dict[int, set[int]] = {}

    def see(self, e: dict[str, Any]) -> None:
        g = e["attempt"]
        if e["event"] == "start" or (e["event"] == "worker_started"  # a command's, in /proc
                                     and e["rank"] not in self.generations.get(g, {})):
            self.generations.setdefault(g, {})[e["rank"]] = e["pid"]
            self.named_t[(g, e["rank"])] = e["t"]
            started = start_time(e["pid"])
            self.started[(g, e["rank"])] = started if self.runs(g, e["rank"]) else None
        elif e["event"] in ("generation_end", "exit", "rank_died"):
            self.left.setdefault(g, set()).add(e["rank"])
            if e["event"] == "exit" and e.get("code") == 0:
                self.clean.setdefault(g, set()).add(e["rank"])
            if e["event"] == "generation_end" and self.ended(g):
                self.ends.setdefault(g, e["t"])
        elif e["event"] in ("step_end", "restore_end") and isinstance(e.get("step"), int):
            self.steps[g] = max(self.steps.get(g, 0), e["step"])
        elif e["event"] == "ckpt_staged" and isinstance(e.get("step"), int):
            self.staged.setdefault(g, set()).add(e["step"])
        elif e["event"] == "ckpt_failed":  # not in flight (one may fail before any marker)
            self.staged.get(g, set()).discard(e.get("step"))

    def hold_ended(self, point: Point, now: float, *, complete: bool) -> None:
        """Count in ``paused_s`` what the hold at ``point``, released at ``now``, cost the job.
        ``complete``: every rank got there; the ranks that came first would have waited for
        the last in the next step's collectives without the hold (a rank slowed by a fault,
        or held by another point first), so the hold counts from the last arrival. A point
        given up as never reached held its ranks from the first."""
        since = point.last_paused_t if complete else point.first_paused_t
        self.paused_s += max(now - since, 0.0)

    def staged_saves(self) -> frozenset[int]:
        """The steps up to where the newest generation is whose save it staged: one may be in
        flight without having written anything yet (a save staged past that point was an
        earlier attempt's, which a restart went back from)."""
        newest = max(self.generations, default=0)
        return frozenset(s for s in self.staged.get(newest, ()) if s <= self.step)

    @property
    def step(self) -> int:
        """Where the newest generation is: the newest step it finished, else the step it
        restored (0 before either). Not an older generation's: a restart that resumed from
        an earlier checkpoint redoes those steps, and a job that is back before its last step
        still takes time-based faults."""
        return self.steps.get(max(self.generations), 0) if self.generations else 0

    def finished(self) -> bool:
        """Every rank of the newest generation exited normally: the job is over."""
        if not self.generations:
            return False
        newest = max(self.generations)
        return set(range(self.world_size)) <= self.clean.get(newest, set())

    def current_pids(self) -> dict[int, int]:
        return dict(self.generations[max(self.generations)]) if self.generations else {}

    def current_started(self) -> dict[int, int | None]:
        """The start time of each rank's process in the newest generation (see ``started``)."""
        g = max(self.generations, default=None)
        return {r: self.started[(g, r)] for r in self.generations[g]} if g is not None else {}

    def runs(self, g: int, rank: int) -> bool:
        """Whether ``rank``'s process of generation ``g`` still runs: its pid is alive and is
        still that process, started by the time an event named it. Pids are recycled (32768
        of them on many machines, threads included): once the rank has died, its pid may be
        another process's, even one that is not the job's, which a fault must never hit."""
        pid = self.generations[g][rank]
        started = started_at(pid)
        return (alive(pid) and started is not None
                and started <= self.named_t[(g, rank)] + START_SLACK_S)

    def ended(self, g: int) -> bool:
        ranks = self.generations.get(g, {})
        return len(ranks) > 0 and all(r in self.left.get(g, set()) or not self.runs(g, r)
                                      for r in ranks)

    def check_ends(self, now: float) -> None:
        for g in self.generations:
            if g not in self.ends and self.ended(g):
                self.ends[g] = now

    def waits_in_vain(self, point: Point, now: float, wait_s: float) -> bool:
        """The ranks held at ``point`` have waited ``wait_s`` since the last of them arrived
        for a rank of their generation, the newest, that never comes: the point is to be given
        up. Not once that generation has ended (another fault killed one of its ranks before
        it got there): the point was not released, so the next generation, back at that step,
        is held there again (``trainer.pause``), and the point waits for it however long the
        restart takes. Should none get there, its faults are never injected (the verdict
        says so)."""
        if not point.paused or point.released or now - point.last_paused_t <= wait_s:
            return False
        held = max(g for g, _ in point.paused)
        return held >= max(self.generations, default=0) and not self.ended(held)

    def all_paused(self, point: Point, e: dict[str, Any]) -> bool:
        """Record a ``paused`` event; True once every rank the point holds is there (in the
        current generation), and the point has not been released yet. The hold's times are the
        newest generation's there (``hold_ended``): an older one's ranks held here ended with
        it, and the restart after it is the job's time, not chaos's."""
        if e["attempt"] > max((g for g, _ in point.paused), default=-1):
            point.first_paused_t = point.last_paused_t = e["t"]
        point.last_paused_t = max(point.last_paused_t, e["t"])
        point.paused.add((e["attempt"], e["rank"]))
        if point.released:
            return False
        current = max(self.generations, default=0)
        wanted = point.ranks if point.ranks is not None else range(self.world_size)
        return all((current, r) in point.paused for r in wanted)


@dataclass(slots=True)
class _Hosts:
    """Where the ranks run: emulated hosts when ``trainer.nodes > 1`` and namespaces can be
    made here; otherwise this machine, with ``error`` saying why not emulated hosts."""

    network: Network | None = None
    error: str | None = None

    @classmethod
    def open(cls, nodes: int) -> _Hosts:
        if nodes < 2:
            return cls()
        network = Network(nodes)
        try:
            network.open()
        except NetnsUnavailable as exc:
            return cls(error=f"network namespaces unavailable: {exc}")
        return cls(network)


class _Agents:
    """The run's torchrun agents (one per host). The run ends when all have exited; one that
    failed leaves the others waiting in the rendezvous, so they get ``grace_s`` to follow.

    The agent of a host that a fault took down (``host_down``) is out of the count. Once
    every rank of the last generation has exited normally and host 0's agent has had no
    worker left for ``linger_s``, the job is over and the agents still running are leftovers:
    host 0's waits in torchrun's exit barrier (300 s) for a lost host's agent, or for one that
    the job went on without (declared lost by its leases while cut off; once the link is
    back its workers find the job's store gone with host 0's, and its agent would wait in a
    rendezvous for ``join_timeout``). They are ended and count as having succeeded: the job's
    outcome is in its events and its checkpoints, which the verdict checks."""

    def __init__(self, procs: list[subprocess.Popen[str]], *, grace_s: float = 60.0,
                 linger_s: float = 2.0) -> None:
        self.procs = procs
        self.grace_s = grace_s
        self.linger_s = linger_s
        self.lost: set[int] = set()  # hosts a fault took down, with their agents
        self._failed_t: float | None = None
        self._idle_t: float | None = None
        self._released = False  # the agents left were ended as leftovers of a finished job

    def note(self, injection: Injection) -> None:
        if injection.detail.get("lost_node") is not None:
            self.lost.add(int(injection.detail["lost_node"]))

    def _live(self) -> list[subprocess.Popen[str]]:
        return [p for i, p in enumerate(self.procs) if i not in self.lost]

    def running(self, job_finished: Callable[[], bool]) -> bool:
        codes = [p.poll() for p in self._live()]
        if all(c is not None for c in codes):
            return False
        if any(codes) and self._failed_t is None:
            self._failed_t = time.time()
        if self._failed_t is not None and time.time() - self._failed_t > self.grace_s:
            self.kill()
            return False
        head = self.procs[0]  # host 0's agent: never lost (it serves the stores)
        if len(self.procs) > 1 and job_finished():
            idle = head.poll() == 0 or (head.poll() is None and not children(head.pid))
            self._idle_t = (self._idle_t or time.time()) if idle else None
            if self._idle_t is not None and time.time() - self._idle_t >= self.linger_s:
                self._released = True
                self.kill()
                return False
        return True

    def kill(self) -> None:
        """SIGKILL each agent that still runs, with its workers: torchrun starts each in a
        session of its own, which a signal to the agent's group does not reach (a user's
        script outlived an aborted run). A worker is killed only while its pid still names
        it: one that died since it was listed may have been reaped, its pid another's."""
        for p in self.procs:
            if p.poll() is None:
                workers = {pid: start_time(pid) for pid in children(p.pid)}
                os.killpg(p.pid, signal.SIGKILL)
                for pid, started in workers.items():  # each with what it started (its group)
                    if started is not None and start_time(pid) == started:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            send(pid, signal.SIGKILL)
                p.wait()

    @property
    def returncode(self) -> int:
        """0 only if every agent not lost succeeded (or was released from its exit barrier),
        else the first failing agent's code."""
        if self._released:
            return 0
        codes = [p.returncode if p.returncode is not None else -9 for p in self._live()]
        return next((c for c in codes if c), 0)


def _target(s: Scenario, job: _Job, ckpt_url: str, rng: random.Random,
            storage: RunStorage | None = None, hosts: _Hosts | None = None,
            endings: Endings | None = None) -> Target:
    """The newest generation's ranks as the faults see them: each its pid and the start time
    of the process an event named, so that a fault never acts on a later holder of the pid."""
    return Target(pids=job.current_pids(), started=job.current_started(),
                  coordinates=mesh_coordinates(s), ckpt_url=ckpt_url,
                  rng=rng, ckpt_engine=s.checkpoint.engine, staged=job.staged_saves(),
                  network=hosts.network if hosts else None,
                  network_error=hosts.error if hosts else None,
                  storage_proxy=storage.proxy if storage else None,
                  storage_proxy_unavailable=storage.proxy_unavailable if storage else None,
                  storage_cluster=storage.cluster if storage else None,
                  storage_cluster_unavailable=storage.cluster_unavailable if storage else None,
                  volume=storage.volume if storage else None,
                  volume_unavailable=storage.volume_unavailable if storage else None,
                  endings=endings or Endings())
