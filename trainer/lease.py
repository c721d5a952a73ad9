"""Leases: in-process recovery learns of a slot that died whole, which nobody reports.

A dead training process is reported by its supervisor (``recovery.report_death``). When the
supervisor goes too (a host that loses power or its kernel, an OOM kill of the supervisor, a
host cut off the network for good), nobody reports it: the survivors' collectives fail or,
with a powered-off peer that sends no reset, hang, and the survivors waited for the whole
re-formation timeout (2 x ``collective_timeout_s``) for a member neither alive nor reported
dead, while the coordinator could give a lost rank to a spare on the lost host.

So every supervisor holds a lease: its :class:`Heartbeat` thread writes ``lease/<slot>`` (the
slot's current training process, the generation it plays in, a sequence number) every
``renewal_interval_s`` (0.25 s in small jobs). The supervisor of slot 0 runs a
:class:`LeaseMonitor` thread that reads every lease with one request a round; a slot whose
sequence number has not moved for ``lease_s`` by the monitor's own clock (no clocks are
compared across hosts) is lost, and its worker is declared dead (``recovery.declare_dead``):
idle spares first, so that a coordinator woken by a lost member never picks a spare of the
same lost host, then members, whose generation fails, which aborts the survivors'
collectives and lets them re-form at once.

Slot 0's supervisor serves the job's store on several hosts, so whatever takes it down takes
the store (and the job) with it: it is the one place that outlives every slot it can judge.
(On one host torchrun's agent serves the store; there the loss of slot 0's supervisor alone
leaves nobody to judge, and its rank is counted lost at the re-formation deadline, as before.) A
slot judged lost that was only slow is handled as a death (its process, no longer a member,
finds itself left out of the next generation, exits, and its slot becomes a spare again): a
needless recovery, never a wrong one. ``lease_s`` should be below the survivors' own stall
escalation (3 x ``hang_timeout_s``), or their watchdogs kill them first.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from antifragile.trainer.progress import LEASE_S
from antifragile.trainer.recovery import JobStore, declare_dead, job_done, register_spare

INTERVAL_S = 0.25  # how often a lease is renewed, and the monitor looks (small jobs)
RENEWALS_PER_S = 4000  # what the leases may cost the store, at most (requests per second)


def register_when_leased(js: JobStore, slot: int, me: str, *, timeout_s: float) -> None:
    """Offer ``me``, a spare's process, to re-formations (``register_spare``) once its slot's
    supervisor holds a lease (it starts it while its child starts, over a store connection of
    its own), or after ``timeout_s`` as before. Offered sooner, a spare whose host was lost in
    between was never judged by the lease monitor (a slot never seen is not), and a
    re-formation could give a rank to that dead process."""
    deadline = time.monotonic() + timeout_s
    while not js.has(f"lease/{slot}") and time.monotonic() < deadline:
        time.sleep(0.05)
    register_spare(js, me)


def renewal_interval_s(slots: int, lease_s: float) -> float:
    """How often leases are renewed and judged: every 0.25 s, less often in large jobs so
    that renewals cost the store at most ``RENEWALS_PER_S`` requests a second (4,000 slots: 1
    s), and at least 4 times per lease."""
    return min(lease_s / 4, max(INTERVAL_S, slots / RENEWALS_PER_S))


@dataclass(frozen=True, slots=True)
class Holder:
    """What a lease says about its slot's current training process."""

    worker: str  # its worker id (``recovery.worker_id``)
    generation: int  # the generation it plays in (-1: not yet)
    member: bool  # it plays a rank (False: an idle spare)


@dataclass(frozen=True, slots=True)
class Lost:
    """A worker declared dead for its slot's silence."""

    slot: int
    worker: str
    generation: int  # the newest it played in (-1: an idle spare)
    rank: int  # its rank there (-1: an idle spare)
    how: str


class Heartbeat:
    """A supervisor's lease on its slot: a daemon thread renewing ``lease/<slot>`` with what
    ``holder()`` says (called on that thread; it must only read). After a failed renewal the
    next one goes through a fresh client from ``reconnect``, where given: a TCPStore client
    whose connection was reset fails every later request, the store alive or not."""

    def __init__(self, js: JobStore, slot: int, holder: Callable[[], Holder], *,
                 interval_s: float = INTERVAL_S,
                 reconnect: Callable[[], JobStore] | None = None) -> None:
        self._js, self._slot, self._holder, self._interval_s = js, slot, holder, interval_s
        self._reconnect, self._failed = reconnect, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{slot}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def retire(self) -> None:
        """The slot's process ended on purpose (the job is done): stop renewing, and say so,
        so that the silence that follows is not taken for a loss. Not where the store was out
        of reach at the last renewal (it is gone with the job, or its monitor, which stops
        judging once the job is done, is out of reach too): a renewal still connecting to it
        (up to twice the connect timeout) is not waited for."""
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 1.0)
        if not self._thread.is_alive() and not self._failed:
            self._write({"retired": True})

    def _write(self, doc: dict[str, Any]) -> bool:
        try:
            if self._failed and self._reconnect is not None:
                self._js = self._reconnect()
            self._js.set(f"lease/{self._slot}", doc)
        except Exception:  # the store is gone (the job is over or restarting), or unreachable
            self._failed = True  # for a while (a cut link): the next renewal tries again
            return False
        self._failed = False
        return True

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            held = self._holder()
            if self._write({"worker": held.worker, "generation": held.generation,
                            "member": held.member, "n": seq}):
                seq += 1
            self._stop.wait(self._interval_s)


@dataclass(slots=True)
class LeaseMonitor:
    """Judges the leases of ``slots`` (pure logic: :meth:`observe`; :meth:`start` runs it on a
    thread against a store)."""

    slots: int
    lease_s: float = LEASE_S
    interval_s: float = INTERVAL_S
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # slot -> (n, changed at)
    _lost: set[str] = field(default_factory=set)  # workers already declared
    _known: set[str] = field(default_factory=set)  # lease keys that exist
    _due: list[tuple[int, Holder, float]] = field(default_factory=list)  # found, not declared
    _looked: float | None = None  # ``now`` of the previous round
    _clock: float = 0.0  # seconds the monitor looked for (see ``observe``)

    def observe(self, now: float, leases: dict[int, dict[str, Any]]
                ) -> list[tuple[int, Holder, float]]:
        """(slot, holder, silent seconds) of every slot found lost at ``now`` (once per
        worker), idle spares first. A slot never seen is not judged: it has not started.

        Silence is counted on the monitor's own clock of looking: a round that comes late
        counts as two intervals at most. A monitor paused with its host (a VM or container
        pause) saw nothing meanwhile, and the heartbeats paused with it may renew just after
        it reads: a slot is lost only after ``lease_s`` of rounds that saw it silent.

        A member is judged one interval later than a spare: the slots of a lost host fall
        silent together, but their last renewals differ by up to an interval, and a spare of
        that host still counted alive when its member is declared could be given the rank."""
        if self._looked is not None:
            self._clock += min(now - self._looked, 2 * self.interval_s)
        self._looked = now
        lost = []
        for slot, doc in leases.items():
            if doc.get("retired"):  # its process ended on purpose (the job is over)
                continue
            n = int(doc["n"])
            if slot not in self._seen or self._seen[slot][0] != n:
                self._seen[slot] = (n, self._clock)
                continue
            silent = self._clock - self._seen[slot][1]
            holder = Holder(str(doc["worker"]), int(doc["generation"]), bool(doc["member"]))
            due = self.lease_s + (self.interval_s if holder.member else 0.0)
            if silent >= due and holder.worker not in self._lost:
                self._lost.add(holder.worker)
                lost.append((slot, holder, silent))
        return sorted(lost, key=lambda found: found[1].member)

    def start(self, js: JobStore, on_lost: Callable[[Lost], None], *,
              reconnect: Callable[[], JobStore] | None = None) -> None:
        """Judge on a daemon thread until the job is done; ``on_lost`` is told of each worker
        declared dead (not of one whose death its supervisor had reported). After a store
        error the next round goes through a fresh client from ``reconnect``, where given (as
        :class:`Heartbeat`)."""
        threading.Thread(target=self._run, args=(js, on_lost, reconnect),
                         name="lease-monitor", daemon=True).start()

    def _run(self, js: JobStore, on_lost: Callable[[Lost], None],
             reconnect: Callable[[], JobStore] | None) -> None:
        keys = [f"lease/{slot}" for slot in range(self.slots)]
        failed = False
        while True:
            try:
                if failed and reconnect is not None:
                    js = reconnect()
                failed = False
                if job_done(js):
                    return
                self._known.update(k for k in keys if k not in self._known and js.has(k))
                present = [k for k in keys if k in self._known]
                values = js.attempt.multi_get(present) if present else []
                leases = {int(k.rpartition("/")[2]): json.loads(v)
                          for k, v in zip(present, values)}
                # found lost once (``observe``), declared until a declaration got through:
                # one a store error cut short is made again, whole, on the next round
                self._due.extend(self.observe(time.monotonic(), leases))
                while self._due:
                    lost = declare_lost(js, *self._due[0])
                    self._due.pop(0)
                    if lost is not None:
                        on_lost(lost)
            except Exception:  # the store is gone (the job is over or restarting: this
                failed = True  # process ends soon), or unreachable for a while: the next
            time.sleep(self.interval_s)  # round retries, through a fresh client


def declare_lost(js: JobStore, slot: int, holder: Holder, silent_s: float) -> Lost | None:
    """Declare ``holder``'s worker dead for its slot's silence, in the newest generation it
    plays in (a lease is up to ``INTERVAL_S`` old, and a member may have re-formed since).
    None where its death was said before (by its supervisor): nothing new to tell."""
    generation = holder.generation
    member = holder.member and generation >= 0
    while member and js.has(f"g{generation}/next"):
        nxt = js.get(f"g{generation}/next")
        if "restart" in nxt or holder.worker not in nxt["members"]:
            break
        generation = int(nxt["generation"])
    how = (f"lost: no lease renewal from slot {slot}'s supervisor for {silent_s:.1f} s (its "
           "host or its supervisor is gone)")
    if not declare_dead(js, me=holder.worker, generation=generation, member=member, how=how):
        return None
    members = js.get(f"g{generation}/members") if member and js.has(
        f"g{generation}/members") else []
    rank = members.index(holder.worker) if holder.worker in members else -1
    return Lost(slot, holder.worker, generation if member else -1, rank, how)
