"""In-process recovery: survivors re-form the process group with a warm spare, no new processes.

Who plays which trainer rank is a *generation*: ``members[r]`` is the worker id
(``<slot>.<incarnation>``: the torchrun slot, and which of that slot's training processes) that
plays trainer rank ``r``. Generations are numbered job-wide by a counter in the launcher's
store (the torchrun agent's TCPStore, which outlives every worker), so event logs and process
group prefixes never collide, also across torchrun restarts. Every key of one torchrun attempt
lives under ``antifragile/a<restart count>/`` (or ``antifragile/fresh/`` where each rendezvous
round gets a fresh store).

Spares: the torchrun slots beyond dp*tp*pp start as spares (on each host its last ones,
``placement.first_slots``), and in-process mode turns every
slot whose training process died into a spare again (its supervisor registers a fresh one at
once, before the survivors re-form, and forks it once they have), so the pool refills. Spares
register in ``spares/<n>``, warm up (torch is already imported; the model is built) and wait on
``spare/<id>/assign``.

A failure of generation ``g`` (a worker died, its supervisor says so; or a collective failed)
sets ``g<g>/fail``. Every survivor's watcher thread is blocked on that key: it shuts down the
sockets of the generation's gloo process groups (``abort``), so a training thread blocked in
any collective gets an error at once. The survivors then register (``g<g>/alive/<id>``); the
first of them claims the coordination, waits until every member is either alive or reported
dead (``dead/<id>``), gives each dead rank a live spare and publishes the new generation in
``g<g>/next``, which the others wait for. With too few spares it publishes a restart instead:
the survivors exit with ``RESTART_EXIT_CODE`` and torchrun restarts the whole group.

torchrun stays the launcher and its store the rendezvous; nothing here starts processes.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "antifragile"
_SCAN_S = 0.25  # how often a coordinator looks every member up (see ``_dead_members``)
# how often a supervisor whose child died starting looks for the first formation (see
# ``first_generation_of``): a SIGTERM waits at most this long to be acted on
FIRST_POLL_S = 0.25
# Failures in a row that got no further than the job had before them: a crash loop (a bug,
# bad data, a bad host fails every generation at the same place), which re-forming in process
# would repeat forever (each failure refills the spare pool). The next one is handed to the
# torchrun restart instead, whose --max-restarts ends it.
CRASH_LOOP_FAILURES = 3


@dataclass(frozen=True, slots=True)
class Formation:
    """One generation: its job-wide number and ``members[rank] = worker id``."""

    generation: int
    members: tuple[str, ...]


def worker_id(slot: int, incarnation: int) -> str:
    """A training process: the torchrun slot it runs in and which of that slot's processes it
    is (a supervisor forks a fresh spare after its process dies)."""
    return f"{slot}.{incarnation}"


class JobStore:
    """The keys of one torchrun attempt in the launcher's store (not thread-safe: one client
    per thread, as TCPStore clients block each other)."""

    def __init__(self, store: Any, attempt_key: str, *, counter: Any = None) -> None:
        self.raw = store
        self.attempt = dist.PrefixStore(f"{PREFIX}/{attempt_key}", store)
        self.counter = counter if counter is not None else store

    def new_generation(self) -> int:
        """A job-wide, never reused generation number."""
        return int(self.counter.add(f"{PREFIX}/generations", 1)) - 1

    def failed_at(self, reached: int) -> tuple[int, int]:
        """Record a failed generation whose ranks had reached step ``reached``: (failures in a
        row, this one included, that got no further than the job had before them, 0 when
        this one got further; the furthest step the job has reached). Job-wide."""
        # one key, "furthest failures token", swapped whole (compare_set): two coordinators
        # judging at once must not move the furthest step back or lose a count. The token
        # makes every value written unique, so a swap that lost cannot read as its own.
        key = f"{PREFIX}/furthest_and_failures"
        token = secrets.token_hex(8)
        while True:
            old = self.counter.get(key).decode() if self.counter.check([key]) else ""
            best, in_place = (int(x) for x in old.split()[:2]) if old else (-1, 0)
            best, in_place = (reached, 0) if reached > best else (best, in_place + 1)
            new = f"{best} {in_place} {token}"
            if self.counter.compare_set(key, old, new).decode() == new:
                return in_place, best

    def set(self, key: str, value: Any) -> None:
        self.attempt.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        return json.loads(self.attempt.get(key))

    def has(self, key: str) -> bool:
        return bool(self.attempt.check([key]))

    def add(self, key: str, amount: int) -> int:
        return int(self.attempt.add(key, amount))

    def wait(self, key: str, timeout_s: float) -> bool:
        """True once ``key`` exists; False after ``timeout_s`` (the store logs a warning on
        every timed-out wait, so callers wait long, and wake each other by setting keys)."""
        try:
            self.attempt.wait([key], timedelta(seconds=timeout_s))
        except (dist.DistStoreError, RuntimeError):
            return self.has(key)
        return True


def first_formation(js: JobStore, slot: int, active: Sequence[int]) -> Formation:
    """Generation of a fresh start: ``active[r]`` plays rank r (``first_slots``; slot 0,
    always rank 0, numbers it). Called by every active slot; the others are spares."""
    if slot == 0:
        doc = {"generation": js.new_generation(), "members": [worker_id(s, 0) for s in active]}
        js.set(f"g{doc['generation']}/members", doc["members"])
        js.set("first", doc)
    doc = js.get("first")
    return Formation(int(doc["generation"]), tuple(doc["members"]))


def first_generation_of(js: JobStore, me: str, timeout_s: float) -> int | None:
    """A worker of a fresh start that died before its progress named a generation: the first
    formation's generation if ``me`` is one of its members (its death fails it), -1 if not (a
    spare), None if no first formation will come (``me`` numbers it, or nobody did within
    ``timeout_s``): a generation that never formed cannot be re-formed.

    Polled, not one store ``wait``: the caller is a supervisor, whose SIGTERM handler (torchrun
    tearing the group down) runs only between bytecodes, never inside a blocking store call;
    one long wait held it off until torchrun's grace ended in a SIGKILL, 30 s later."""
    if me == worker_id(0, 0) and not js.has("first"):
        return None
    deadline = time.monotonic() + timeout_s
    while not js.has("first"):
        if time.monotonic() > deadline:
            return None
        time.sleep(FIRST_POLL_S)
    doc = js.get("first")
    return int(doc["generation"]) if me in doc["members"] else -1


def signal_failure(js: JobStore, generation: int, reason: str) -> None:
    """Tell every member that generation ``generation`` failed."""
    if not js.has(f"g{generation}/fail"):
        js.set(f"g{generation}/fail", {"reason": reason, "t": time.time()})


def recover(js: JobStore, me: str, failed: Formation, *, timeout_s: float,
            reached: int | None = None) -> Formation | str:
    """A survivor's part of re-forming: the next formation (which may not hold ``me``: it came
    too late and was counted lost), or why the job must restart. ``reached``: the last step
    this rank completed (a coordinator judges crash loops by it: ``CRASH_LOOP_FAILURES``).

    One generation is published per failure, by the first survivor to claim
    ``g<g>/coordinator/by``, and none once ``g<g>/next`` exists (a survivor that comes after the
    others' deadline finds them gone and must not coordinate again). The others only wait for
    it: one blocking request each, so that a recovery of N ranks costs the store O(N)
    requests, not N survivors each looking up every member every few milliseconds (N^2)."""
    g = failed.generation
    deadline = time.monotonic() + timeout_s
    signal_failure(js, g, f"worker {me} saw the failure")
    js.set(f"g{g}/alive/{me}", time.time())
    js.add(f"g{g}/arrived_alive", 1)
    # should the coordinator die before it publishes, its supervisor takes over
    if not js.has(f"g{g}/next") and _claim(js, g, me):
        _coordinate(js, failed, _dead_members(js, failed, deadline), reached)
    # the coordinator publishes after its own deadline (a member neither alive nor dead by
    # then is counted lost), and a take-over (``report_death``) after one more: a survivor
    # that waited only ``timeout_s`` gave up first and took the restart
    if not js.wait(f"g{g}/next", 2 * timeout_s):
        return f"no new generation was published within {2 * timeout_s:.0f} s"
    nxt = js.get(f"g{g}/next")
    if "restart" in nxt:
        return str(nxt["restart"])
    return Formation(int(nxt["generation"]), tuple(nxt["members"]))


def _claim(js: JobStore, g: int, by: str) -> bool:
    """Claim the coordination of generation ``g``'s re-formation for ``by``: True for the
    first claim only. One request that names the claimant (``g<g>/coordinator/by``), so a
    claimant killed right after it is known to its supervisor, which takes over; a claim and
    its name in two requests left one killed between them unnamed, and nobody coordinated."""
    mine = json.dumps(by)
    return js.attempt.compare_set(f"g{g}/coordinator/by", "", mine).decode() == mine


def _dead_members(js: JobStore, failed: Formation, deadline: float) -> list[str]:
    """The coordinator: wait until every member of ``failed`` is alive (registered in
    :func:`recover`) or dead (``dead/<id>``: reported by its supervisor, or declared lost by
    the lease monitor); those neither by ``deadline`` count as dead. Two counters a round; each
    member looked up only when they add up, and every ``_SCAN_S`` (a death some counter
    misses: a spare that died after its assignment, a member dead before it joined)."""
    g, size = failed.generation, len(failed.members)
    pause, scanned = 0.002, 0.0
    while True:
        now = time.monotonic()
        counted = js.add(f"g{g}/arrived_alive", 0) + js.add(f"g{g}/deaths", 0)
        if counted >= size or now - scanned >= _SCAN_S or now > deadline:
            scanned = now
            # dead first: a survivor that registered alive and died since is dead
            dead = [m for m in failed.members if js.has(f"dead/{m}")]
            alive = [m for m in failed.members
                     if m not in dead and js.has(f"g{g}/alive/{m}")]
            if len(alive) + len(dead) == size or now > deadline:
                return [m for m in failed.members if m not in alive]
        time.sleep(pause)
        pause = min(0.05, pause * 1.5)


def gather(js: JobStore, formation: Formation, *, timeout_s: float) -> str | None:
    """Before a generation's rendezvous: wait until every member has arrived. None once they
    have; else why not (the generation failed first: a member died before it arrived, see
    :func:`report_death`; or not everyone came within ``timeout_s``). A rendezvous with a dead
    member would wait for the whole collective timeout and then fail outside any recovery."""
    g = formation.generation
    if js.add(f"g{g}/arrived", 1) == len(formation.members):
        js.set(f"g{g}/met", time.time())
    deadline = time.monotonic() + timeout_s
    pause = 0.002  # polled (a timed-out store wait logs a warning), backing off to 50 ms
    while not js.has(f"g{g}/met"):
        if js.has(f"g{g}/fail"):
            return (f"generation {g} failed before its members met: "
                    f"{js.get(f'g{g}/fail').get('reason', '?')}")
        if time.monotonic() >= deadline:
            return f"not every member of generation {g} arrived within {timeout_s:.0f} s"
        time.sleep(pause)
        pause = min(0.05, pause * 1.5)
    return None


def _spares(js: JobStore) -> list[str]:
    """Every spare that ever registered (``register_spare``), oldest first. An index not
    named (yet, or ever: its registrant died between the two requests) is left out: a
    ``get`` of it would wait out the store's timeout and raise, in every re-formation and in
    ``finish`` after that."""
    keys = [f"spares/{i}" for i in range(js.add("spares/count", 0))]
    return [js.get(key) for key in keys if js.has(key)]


def _coordinate(js: JobStore, failed: Formation, dead: list[str],
                reached: int | None = None) -> None:
    """The coordinating survivor: give each dead rank a live spare, publish the generation;
    or, in a crash loop (judged from the step the generation ``reached``, when known), the
    restart."""
    g = failed.generation
    if reached is not None:
        in_place, furthest = js.failed_at(reached)
        if in_place >= CRASH_LOOP_FAILURES:
            js.set(f"g{g}/next", {"restart": (
                f"{in_place} failures in a row got no further than step {furthest}: a "
                "failure that recurs where it happened (a bug, bad data, a bad host) is not "
                "re-formed in process again; torchrun restarts the group, and its "
                "--max-restarts bounds what follows")})
            return
    lost = [r for r, m in enumerate(failed.members) if m in dead]
    free = [w for w in _spares(js)
            if not js.has(f"dead/{w}") and not js.has(f"spare/{w}/assign")]
    free.sort(key=lambda w: not js.has(f"spare/{w}/ready"))  # warm ones first (stable)
    if len(free) < len(lost):
        js.set(f"g{g}/next", {"restart": f"{len(lost)} rank(s) lost and {len(free)} spare(s) "
                                         "left: torchrun restarts the group"})
        return
    members = list(failed.members)
    for rank, spare in zip(lost, free):
        members[rank] = spare
    nxt: dict[str, Any] = {"generation": js.new_generation(), "members": members,
           "replaced": {str(r): w for r, w in zip(lost, free)}}
    js.set(f"g{nxt['generation']}/members", members)
    # recorded before any spare is taken: should this process die before it publishes, the
    # spares it told are taken for good (no longer free), so its supervisor's take-over
    # completes this decision instead of making one without them (``_take_over``)
    js.set(f"g{g}/decided", nxt)
    _publish(js, g, nxt)


def _publish(js: JobStore, g: int, nxt: dict[str, Any]) -> None:
    """Tell the spares of the re-formation of generation ``g`` decided in ``nxt`` their
    places, then everyone the new generation."""
    for rank, spare in nxt["replaced"].items():
        js.set(f"spare/{spare}/assign", {**nxt, "rank": int(rank)})
    js.set(f"g{g}/next", nxt)
    members = nxt["members"]
    # a member that died as this was decided: its supervisor may have looked for the new
    # generation before it was published (see ``report_death``), so say it here
    gone = [m for m in members if js.has(f"dead/{m}")]
    if gone:
        signal_failure(js, nxt["generation"], f"worker {gone[0]} died before generation "
                                              f"{nxt['generation']} formed")


def register_spare(js: JobStore, me: str) -> None:
    """Make ``me`` a candidate for the next re-formation (before it is warm: the coordinator
    prefers warm spares, and a cold one joins once it is)."""
    index = js.add("spares/count", 1) - 1
    js.set(f"spares/{index}", me)


def wait_for_assignment(js: JobStore, me: str) -> Formation | str | None:
    """A warm spare: the generation it joins, None once the job is done (see
    :func:`end_of_run`), or why it was declared dead (:func:`declare_dead`: it must leave)."""
    js.set(f"spare/{me}/ready", time.time())
    if job_done(js):  # ``finish`` may have missed a spare registered as it ran
        return None
    while not js.wait(f"spare/{me}/assign", 24 * 3600.0):
        pass
    doc = js.get(f"spare/{me}/assign")
    if doc.get("done"):
        return None
    if doc.get("lost"):
        return str(doc["lost"])
    return Formation(int(doc["generation"]), tuple(doc["members"]))


def finish(js: JobStore) -> None:
    """The job is done: say so (``done``) and release the idle spares. Safe to repeat; a
    spare given a place meanwhile keeps it (one request each: it is never overwritten)."""
    js.set("done", time.time())
    done = json.dumps({"done": True})
    for spare in _spares(js):
        js.attempt.compare_set(f"spare/{spare}/assign", "", done)


def end_of_run(js: JobStore, me: str, formation: Formation) -> None:
    """A member whose generation trained to the end (its last checkpoint committed on every
    rank: the final save's ranks agree on it), before its process exits 0: the job is done.
    Every member says so (``done``, one request), and rank 0 also releases the idle spares
    (``finish``). Rank 0 alone said it before: killed after the others had exited, before it
    did, it left its supervisor waiting for a re-formation that could not come (nobody was
    left), then restarting a finished job, and the spares idle until then. Now that
    supervisor finds the job done and releases the spares itself (``report_death``)."""
    if formation.members.index(me) == 0:
        finish(js)
    else:
        js.set("done", time.time())


def declare_dead(js: JobStore, *, me: str, generation: int, how: str, member: bool) -> bool:
    """Say worker ``me`` is dead: a member fails ``generation``; an idle spare is only left
    out of re-formations, unless it was just given a place (see ``_coordinate``), whose
    generation then fails. Said by its supervisor (``report_death``) or, for a slot that died
    whole, by the lease monitor (``trainer.lease``). False: it had been said before, in other
    words (``how``).

    Safe to repeat, and to repeat after a store error part way: the first word on a death
    stands (``dead/<id>``, written once) and every declaration completes what it says, so the
    next one finishes a declaration cut short. The death is counted in ``g<g>/deaths`` at
    most once (twice would read as two ranks gone); a count a store error lost is found by the
    coordinator's scan of the members (``_dead_members``)."""
    said = {"how": how, "generation": generation, "member": member, "t": time.time()}
    first = json.loads(js.attempt.compare_set(f"dead/{me}", "", json.dumps(said)))
    generation, member, how = int(first["generation"]), bool(first["member"]), first["how"]
    if not member:
        # no place for it from now on, and it learns so (``wait_for_assignment``): one only
        # slow (its slot judged lost by the leases) leaves, and its supervisor refills the slot
        doc = json.loads(js.attempt.compare_set(f"spare/{me}/assign", "",
                                                json.dumps({"lost": how})))
        if not doc.get("done") and not doc.get("lost"):  # it was just given a place
            signal_failure(js, int(doc["generation"]), f"spare {me} died ({how}) before "
                                                       "it joined")
    else:
        if js.add(f"dead/{me}/counted", 1) == 1:
            js.add(f"g{generation}/deaths", 1)
        signal_failure(js, generation, f"worker {me} died ({how})")
    return how == said["how"]


def report_death(js: JobStore, *, me: str, successor: str | None, generation: int, how: str,
                 member: bool, reform_timeout_s: float) -> bool:
    """The supervisor of a dead training process (in-process mode): register the fresh process
    it will fork (``successor``, if any) as a spare, then say ``me`` is dead; for a member of a
    generation, wait until the survivors have re-formed, or the job is done (``end_of_run``:
    then nothing fails, and the idle spares are released). False: they could not (no spare,
    no survivor at all, or nothing happened within ``reform_timeout_s``), and the job must
    restart.

    The successor is registered before the death is reported, so a coordinator that sees the
    death also sees the spare: a second loss while the survivors re-form (a survivor stuck in
    the failed collective ends itself) finds the pool refilled, not one short. Its process is
    forked only once the survivors have re-formed (a cold spare joins once it is warm), so
    its warm-up does not compete with their recovery for the cores."""
    if successor is not None:
        register_spare(js, successor)
    if member and job_done(js):
        # trained to the end (``end_of_run``): a death on the way out fails nothing (a
        # failure would interrupt the members still closing), and rank 0, should it be
        # this one, may have died before it released the spares
        finish(js)
        return True
    declare_dead(js, me=me, generation=generation, how=how, member=member)
    if not member:
        return True
    if js.has(f"g{generation}/coordinator/by") and js.get(f"g{generation}/coordinator/by") == me:
        # within half of it, the "one more" timeout of ``recover``: the survivors wait
        # ``reform_timeout_s`` (2 x the collective timeout) from their arrival, before this
        _take_over(js, generation, reform_timeout_s / 2)
    # published before the generation could start (None for one formed by hand, in tests)
    size = len(js.get(f"g{generation}/members")) if js.has(f"g{generation}/members") else None
    deadline = time.monotonic() + reform_timeout_s
    while not js.has(f"g{generation}/next"):
        # no survivor will ever coordinate: the first to see that decides the restart now
        # (one request a round, however large the job: the members' deaths are counted)
        if size is not None and js.add(f"g{generation}/deaths", 0) >= size \
                and _claim(js, generation, f"supervisor of {me}"):
            _nobody_left(js, generation)
        elif job_done(js):  # a death in the teardown of a finished run: nobody re-forms it,
            finish(js)  # and its last checkpoint committed on every rank (``end_of_run``)
            return True
        elif time.monotonic() > deadline:
            return False
        else:
            time.sleep(0.01)
    nxt = js.get(f"g{generation}/next")
    if "restart" in nxt:
        return False
    if me in nxt["members"]:  # a survivor that died after the re-formation was decided
        signal_failure(js, int(nxt["generation"]), f"worker {me} died ({how}) before "
                                                   "it joined")
    return True


def _take_over(js: JobStore, generation: int, timeout_s: float) -> None:
    """The survivor that claimed the coordination of ``generation``'s re-formation died
    before it published the next generation (it waits there for every member to be
    accounted for, up to the deadline): its supervisor finishes the coordination from the
    store, instead of the others waiting for it until their own deadline, then restarting.
    A decision it had recorded (``g<g>/decided``) is published as it stands."""
    if js.has(f"g{generation}/next") or not js.has(f"g{generation}/members"):
        return
    if js.has(f"g{generation}/decided"):
        # it died publishing: its spares may have read their places and be waiting for the
        # others in that generation, which then fails at once (the coordinator is a member)
        _publish(js, generation, js.get(f"g{generation}/decided"))
        return
    failed = Formation(generation, tuple(js.get(f"g{generation}/members")))
    dead = _dead_members(js, failed, time.monotonic() + timeout_s)
    if js.has(f"g{generation}/next"):
        return
    if len(dead) == len(failed.members):
        _nobody_left(js, generation)
    else:
        _coordinate(js, failed, dead)


def _nobody_left(js: JobStore, generation: int) -> None:
    """Publish the restart of a generation whose every rank died."""
    js.set(f"g{generation}/next", {"restart": f"every rank of generation {generation} died: "
                                              "no survivor to re-form it"})


def restart_reason(js: JobStore, generation: int, reform_timeout_s: float) -> str:
    """Why ``generation`` was not re-formed in process (after ``report_death`` said so)."""
    if js.has(f"g{generation}/next"):
        return str(js.get(f"g{generation}/next").get("restart", "re-formed"))
    return f"no re-formation of generation {generation} within {reform_timeout_s:.0f} s"


def job_done(js: JobStore) -> bool:
    return js.has("done")
