"""The supervisor's watchdog and the in-process recovery protocol, without processes: the
watchdog is fed progress samples, the protocol runs on an in-memory store."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from antifragile.trainer import supervisor
from antifragile.trainer.placement import first_slots
from antifragile.trainer.progress import Phase, SharedProgress
from antifragile.trainer.recovery import (
    CRASH_LOOP_FAILURES,
    Formation,
    JobStore,
    declare_dead,
    end_of_run,
    finish,
    first_formation,
    gather,
    job_done,
    recover,
    register_spare,
    report_death,
    wait_for_assignment,
)
from antifragile.trainer.supervisor import Watchdog, main_thread_state


def _feed(dog: Watchdog, samples: list[tuple[float, int, Phase, bool]]) -> list[str | None]:
    return [dog.observe(t, counter, phase, stopped) for t, counter, phase, stopped in samples]


def test_a_stopped_thread_is_a_hang_in_any_phase_after_the_timeout() -> None:
    for phase in (Phase.TRAINING, Phase.CHECKPOINT, Phase.PAUSED, Phase.RESTORING):
        dog = Watchdog(hang_timeout_s=2.0)
        out = _feed(dog, [(0.0, 1, phase, False), (0.5, 1, phase, True),
                          (2.4, 1, phase, True), (2.6, 1, phase, True)])
        assert out == [None, None, None, "stopped"], phase


def test_a_thread_stopped_at_the_first_look_is_a_hang_after_the_timeout() -> None:
    """The stop is timed from the first look that saw it, also when that is the watchdog's
    first (its clock reads 0 there): a start of 0.0 was taken for "not stopped yet" and
    restarted at the next look, so the hang was found one look late."""
    dog = Watchdog(hang_timeout_s=2.0)
    out = _feed(dog, [(0.0, 1, Phase.TRAINING, True), (1.0, 1, Phase.TRAINING, True),
                      (2.0, 1, Phase.TRAINING, True)])
    assert out == [None, None, "stopped"]


def test_a_resumed_thread_is_not_a_hang() -> None:
    dog = Watchdog(hang_timeout_s=2.0)
    out = _feed(dog, [(0.0, 1, Phase.TRAINING, True), (1.5, 1, Phase.TRAINING, False),
                      (2.5, 2, Phase.TRAINING, True), (4.0, 2, Phase.TRAINING, True)])
    assert out == [None, None, None, None]


def test_a_stall_without_a_stopped_thread_escalates_only_while_training() -> None:
    dog = Watchdog(hang_timeout_s=1.0, escalate=3.0)
    assert _feed(dog, [(0.0, 5, Phase.TRAINING, False), (2.9, 5, Phase.TRAINING, False),
                       (3.1, 5, Phase.TRAINING, False)]) == [None, None, "stalled"]
    for phase in (Phase.CHECKPOINT, Phase.RESTORING, Phase.PAUSED, Phase.SPARE, Phase.DONE):
        dog = Watchdog(hang_timeout_s=1.0, escalate=3.0)
        assert _feed(dog, [(0.0, 5, phase, False), (100.0, 5, phase, False)]) == [None, None]


def test_the_adaptive_timeout_follows_slow_steps() -> None:
    dog = Watchdog(floor_s=10.0, k=20.0)
    assert dog.timeout_s() == 10.0
    t = 0.0
    for i in range(200):  # a bump every 2 s: a slow, loaded machine
        t += 2.0
        assert dog.observe(t, i, Phase.TRAINING, False) is None
    assert dog.timeout_s() == 40.0  # 20 x p99, above the floor


def test_the_watchdogs_memory_does_not_grow_with_the_length_of_the_run() -> None:
    """The supervisor lives as long as its slot (every generation of an in-process job), and
    its watchdog kept every interval it saw (up to 20 a second: 1.7 million a day), of which
    the timeout reads the latest 1,000."""
    import tracemalloc

    dog = Watchdog(floor_s=0.1, k=20.0)
    t = 0.0

    def look(n: int) -> None:
        nonlocal t
        for _ in range(n):
            t += 0.05
            assert dog.observe(t, int(t * 20), Phase.TRAINING, False) is None

    look(2_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        look(50_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100_000, grown
    assert dog.timeout_s() == pytest.approx(1.0)  # 20 x p99 of the latest (0.05 s)


def test_saves_restores_and_pauses_are_not_taken_for_training_intervals() -> None:
    # a 30 s blocking save between fast steps: the counter moves into CHECKPOINT and back
    # into TRAINING; the 30 s between those two changes is not an interval between bumps of
    # the training loop (before the fix it became one: p99 30 s, timeout 600 s, a stall seen
    # after 1800 s instead of 30 s)
    for phase in (Phase.CHECKPOINT, Phase.RESTORING, Phase.PAUSED):
        dog = Watchdog(floor_s=10.0, k=20.0)
        t, counter = 0.0, 0
        for _ in range(50):
            t, counter = t + 0.1, counter + 1
            assert dog.observe(t, counter, Phase.TRAINING, False) is None
        t, counter = t + 0.05, counter + 1
        dog.observe(t, counter, phase, False)
        t += 30.0
        dog.observe(t, counter, phase, False)
        t, counter = t + 0.05, counter + 1
        dog.observe(t, counter, Phase.TRAINING, False)
        for _ in range(20):
            t, counter = t + 0.1, counter + 1
            dog.observe(t, counter, Phase.TRAINING, False)
        assert dog.timeout_s() == 10.0, phase


def test_main_thread_state_of_this_process_is_running() -> None:
    import os

    assert main_thread_state(os.getpid()) == "R"
    assert main_thread_state(2**22 + 12345) == "?"


def test_shared_progress_round_trips() -> None:
    progress = SharedProgress()
    progress.set(Phase.TRAINING, generation=3, rank=2, step=7)
    progress.bump()
    counter, phase, generation, rank, step, _ = progress.read()
    assert (phase, generation, rank, step) == (Phase.TRAINING, 3, 2, 7) and counter == 2


def test_shared_progress_is_never_read_half_written() -> None:
    """The supervisor reads the page while the training process writes it. ``pack_into``
    zeroes the whole record before it packs the fields, and ``unpack_from`` reads a field a
    byte at a time: a read in between saw the counter go back (to 0), phase STARTING, rank 0,
    and a last write at time 0. A write and a read now copy the record at once."""
    import os

    progress = SharedProgress()
    progress.set(Phase.TRAINING, generation=2, rank=3, step=5)
    pid = os.fork()
    if pid == 0:  # the training process: bump as fast as it can
        try:
            for _ in range(300_000):
                progress.bump()
        finally:
            os._exit(0)
    seen: list[tuple[int, Phase, int, int, int, float]] = []
    while not os.waitpid(pid, os.WNOHANG)[0]:
        seen.append(progress.read())
    seen.append(progress.read())
    counters = [s[0] for s in seen]
    assert counters[-1] == 300_001
    assert counters == sorted(counters)
    assert {s[1:5] for s in seen} == {(Phase.TRAINING, 2, 3, 5)}
    assert min(s[5] for s in seen) > 0


def test_a_hold_ends_in_the_phase_it_began_in() -> None:
    """A save's pause point holds the save's own thread while the training thread may wait in
    a blocking save (CHECKPOINT). The release set TRAINING, so the watchdog took the rest of
    that save (the counter still) for a stall and killed the healthy rank after 3 x its
    timeout. A hold now ends in the phase it began in, unless the phase moved meanwhile."""
    progress = SharedProgress()
    progress.set(Phase.CHECKPOINT, step=8)
    progress.hold(True)
    assert progress.read()[1] == Phase.PAUSED
    progress.hold(False)
    counter, phase, *_ = progress.read()
    assert phase == Phase.CHECKPOINT
    watchdog = Watchdog(hang_timeout_s=1.0)
    assert watchdog.observe(0.0, counter, phase, stopped=False) is None
    assert watchdog.observe(10.0, counter, phase, stopped=False) is None  # a long save: no hang
    progress.hold(True)  # the training thread moved on while the save's thread was held
    progress.set(Phase.TRAINING, step=9)
    progress.hold(False)
    assert progress.read()[1] == Phase.TRAINING


def test_a_hold_ended_while_another_holds_on_stays_paused() -> None:
    """Two holds at once: a save's thread held at a phase of its save while the training
    thread, gone on, is held at the end of a later step. The save's release set the phase
    back to TRAINING under the step's hold, whose still counter the watchdog then took for a
    stall. The phase goes back only when the last hold ends."""
    progress = SharedProgress()
    progress.set(Phase.TRAINING, step=20)
    progress.hold(True)  # the save of step 20, held while persisting
    progress.set(Phase.TRAINING, step=21)  # the training thread went on
    progress.hold(True)  # and is held at the end of step 21
    progress.hold(False)  # the save's hold ends
    counter, phase, *_ = progress.read()
    assert phase == Phase.PAUSED
    watchdog = Watchdog(hang_timeout_s=1.0)
    assert watchdog.observe(0.0, counter, phase, stopped=False) is None
    assert watchdog.observe(10.0, counter, phase, stopped=False) is None  # held: no hang
    progress.hold(False)
    assert progress.read()[1] == Phase.TRAINING


def _store() -> dist.Store:
    return dist.HashStore()


@pytest.mark.parametrize(("slots", "world", "local_slots", "active"), [
    (3, 2, 3, [0, 1]),  # one host, one spare: slot 2
    (2, 2, 1, [0, 1]),  # two hosts, no spares
    (4, 2, 2, [0, 2]),  # two hosts, a spare on each (slots 1 and 3)
    (12, 8, 6, [0, 1, 2, 3, 6, 7, 8, 9]),  # 2x2x2 on two hosts, two spares each
])
def test_ranks_spread_over_the_hosts_and_every_host_keeps_its_spares(
        slots: int, world: int, local_slots: int, active: list[int]) -> None:
    """Slots are numbered host by host; had slots 0..world-1 played the ranks, a 2-host job
    with a spare per host would have put both ranks on host 0 and both spares on host 1."""
    assert first_slots(slots, world, local_slots) == active


def test_a_dead_rank_is_replaced_by_a_live_warm_spare() -> None:
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(2))  # workers 0.0 and 1.0 play; 2.0 and 3.0 are spares
    assert first == Formation(0, ("0.0", "1.0"))
    assert first_formation(JobStore(store, "a0"), 1, range(2)) == first
    for spare in ("2.0", "3.0"):
        register_spare(js, spare)
    assigned: list[Formation | None] = []
    waiter = threading.Thread(target=lambda: assigned.append(
        wait_for_assignment(JobStore(store, "a0"), "3.0")))
    waiter.start()
    assert report_death(js, me="2.0", successor="2.1", generation=-1, how="signal 9",
                        member=False, reform_timeout_s=1.0)  # spare 2.0 died while idle
    dead_member = threading.Thread(target=lambda: assigned.append(report_death(
        JobStore(store, "a0"), me="1.0", successor="1.1", generation=0, how="signal 9",
        member=True, reform_timeout_s=5.0)))
    dead_member.start()
    nxt = recover(js, "0.0", first, timeout_s=5.0)
    waiter.join(5.0)
    dead_member.join(5.0)
    assert nxt == Formation(1, ("0.0", "3.0"))  # the warm spare, not a cold successor
    assert nxt in assigned and True in assigned  # the spare joined; the dead slot respawns


def _fail_in_turn(reached: list[int]) -> list[Formation | str]:
    """Rank 1 dies in every generation, the survivor having reached ``reached[i]``; a warm
    spare is always there to take its place."""
    store = _store()
    js = JobStore(store, "a0")
    formation = first_formation(js, 0, range(2))
    outcomes: list[Formation | str] = []
    for i, step in enumerate(reached):
        register_spare(js, f"2.{i}")
        js.set(f"spare/2.{i}/ready", 1.0)
        declare_dead(js, me=formation.members[1], generation=formation.generation,
                     how="signal 9", member=True)
        nxt = recover(js, "0.0", formation, timeout_s=5.0, reached=step)
        outcomes.append(nxt)
        if isinstance(nxt, str):
            break
        formation = nxt
    return outcomes


def test_a_failure_that_recurs_where_it_happened_is_handed_to_the_restart() -> None:
    """A bug or bad data that fails every generation at the same step was re-formed in process
    forever (each death refills the spare pool; 400 generations in 10 minutes): after
    CRASH_LOOP_FAILURES failures in a row that got no further than the job had, the next
    re-formation is a torchrun restart, which --max-restarts bounds."""
    outcomes = _fail_in_turn([12, 11, 12, 11, 12])
    assert [isinstance(o, Formation) for o in outcomes] == [True, True, True, False]
    assert f"{CRASH_LOOP_FAILURES} failures in a row got no further than step 12" in outcomes[-1]


def test_failures_that_each_get_further_are_all_re_formed_in_process() -> None:
    outcomes = _fail_in_turn([12, 11, 20, 19, 19, 25, 30, 29, 28])
    assert all(isinstance(o, Formation) for o in outcomes) and len(outcomes) == 9


def test_a_second_loss_while_re_forming_takes_the_first_dead_slots_successor() -> None:
    """Rank 2 dies; rank 1, stuck in the failed collective, ends itself before the survivors
    re-form. Each dead slot's supervisor registered its successor as a spare before reporting
    the death, so two ranks lost find two spares: no restart."""
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(3))
    register_spare(js, "3.0")
    js.set("spare/3.0/ready", 1.0)
    reported: list[bool] = []
    supervisors = [threading.Thread(target=lambda me=me: reported.append(report_death(
        JobStore(store, "a0"), me=me, successor=me[0] + ".1", generation=0, how="signal 9",
        member=True, reform_timeout_s=5.0))) for me in ("2.0", "1.0")]
    for thread in supervisors:
        thread.start()
    nxt = recover(js, "0.0", first, timeout_s=5.0)
    # the warm spare first; then whichever successor was registered first (the threads race)
    assert nxt.generation == 1 and nxt.members[:2] == ("0.0", "3.0"), nxt
    assert nxt.members[2] in ("2.1", "1.1"), nxt
    for thread in supervisors:
        thread.join(5.0)
    assert reported == [True, True]


def test_when_every_rank_died_there_is_nobody_to_wait_for() -> None:
    """A cut link or a job-wide hang: every rank is killed by its supervisor. No survivor is
    left to coordinate, so the supervisors waited ``reform_timeout_s`` for a re-formation that
    could never come (60 s of a 105 s recovery in a two-host drop_link run) before torchrun
    restarted the group; now the last death they see decides the restart."""
    store = _store()
    first_formation(JobStore(store, "a0"), 0, range(2))
    for spare in ("2.0", "3.0"):
        register_spare(JobStore(store, "a0"), spare)
    reported: list[bool] = []
    supervisors = [threading.Thread(target=lambda me=me: reported.append(report_death(
        JobStore(store, "a0"), me=me, successor=None, generation=0, how="signal 9",
        member=True, reform_timeout_s=60.0))) for me in ("0.0", "1.0")]
    t0 = time.monotonic()
    for thread in supervisors:
        thread.start()
    for thread in supervisors:
        thread.join(10.0)
    assert reported == [False, False] and time.monotonic() - t0 < 10.0
    nxt = JobStore(store, "a0").get("g0/next")
    assert "every rank of generation 0 died" in nxt["restart"], nxt


def test_a_respawned_slot_is_a_spare_again() -> None:
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(2))
    register_spare(js, "1.1")  # slot 1's fresh process, after 1.0 died
    js.set("dead/1.0", {})
    assert recover(js, "0.0", first, timeout_s=5.0) == Formation(1, ("0.0", "1.1"))


def test_too_few_spares_falls_back_to_a_restart() -> None:
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(3))
    register_spare(js, "3.0")
    for dead in ("1.0", "2.0"):  # as ``declare_dead`` says it (``report_death`` reads it)
        js.set(f"dead/{dead}", {"how": "signal 9", "generation": 0, "member": True})
    reason = recover(js, "0.0", first, timeout_s=5.0)
    assert isinstance(reason, str) and "2 rank(s) lost and 1 spare(s) left" in reason
    assert not report_death(js, me="1.0", successor=None, generation=0, how="signal 9",
                            member=True, reform_timeout_s=1.0)


def test_a_spare_registered_as_the_job_finished_is_released() -> None:
    js = JobStore(_store(), "a0")
    finish(js)
    register_spare(js, "4.1")  # after ``finish`` looked at the pool
    assert wait_for_assignment(js, "4.1") is None


def test_a_member_that_dies_after_the_job_finished_is_not_waited_for() -> None:
    """Rank 1 dies after rank 0 finished the run (its last checkpoint committed on every rank:
    ``finish``), in its own teardown: nobody is left to re-form the generation, and its
    supervisor waited the whole re-formation timeout (2 x the collective timeout), then exited
    non-zero, for torchrun to restart a finished job. The job is done: nothing to wait for."""
    store = _store()
    js = JobStore(store, "a0")
    first_formation(js, 0, range(2))
    finish(js)
    t0 = time.monotonic()
    assert report_death(JobStore(store, "a0"), me="1.0", successor=None, generation=0,
                        how="signal 9", member=True, reform_timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("finished", [True, False])
def test_rank_0_killed_after_the_others_finished_ends_the_job(finished: bool) -> None:
    """Rank 1 trained to the end and exited 0 (the last checkpoint committed on every rank);
    rank 0 was killed before it said the job was done. Nobody is left to re-form the
    generation: its supervisor waited the whole re-formation timeout, then exited non-zero,
    for torchrun to restart a finished job, and the idle spares waited until then. Without
    the finished member (a death while training) it waits for a re-formation, as before."""
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(2))
    register_spare(js, "2.0")
    released: list[Formation | str | None] = []
    spare = threading.Thread(target=lambda: released.append(
        wait_for_assignment(JobStore(store, "a0"), "2.0")), daemon=True)
    spare.start()
    if finished:
        end_of_run(JobStore(store, "a0"), "1.0", first)
    t0 = time.monotonic()
    ended = report_death(JobStore(store, "a0"), me="0.0", successor="0.1", generation=0,
                         how="signal 9", member=True, reform_timeout_s=3.0)
    spare.join(1.0)
    if finished:
        assert ended and time.monotonic() - t0 < 2.0
        assert released == [None] and job_done(js)  # the spare exits 0
        assert wait_for_assignment(js, "0.1") is None  # and so does the dead slot's successor
    else:  # nobody re-formed the generation within the timeout: torchrun restarts the group
        assert not ended and time.monotonic() - t0 >= 3.0
        assert released == [] and not job_done(js)
        end_of_run(js, "1.0", first)  # ends the spare's thread


def test_a_member_that_dies_after_it_finished_fails_nothing() -> None:
    """Rank 1 trained to the end and its process died on the way out (rank 0 still closing
    its engine): not a failure of the generation, which would interrupt rank 0's close and
    send it into a re-formation; the job is done."""
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(2))
    end_of_run(js, "1.0", first)
    t0 = time.monotonic()
    assert report_death(JobStore(store, "a0"), me="1.0", successor=None, generation=0,
                        how="signal 9", member=True, reform_timeout_s=3.0)
    assert time.monotonic() - t0 < 2.0
    assert not js.has("g0/fail") and job_done(js)


def test_finish_releases_idle_spares() -> None:
    store = _store()
    js = JobStore(store, "a0")
    register_spare(js, "5.0")
    released: list[Formation | None] = []
    spare = threading.Thread(target=lambda: released.append(
        wait_for_assignment(JobStore(store, "a0"), "5.0")))
    spare.start()
    finish(js)
    spare.join(5.0)
    assert released == [None] and job_done(js)


_STALE_PID_SCRIPT = """
import os, signal
import pytest
import torch.distributed as dist
import antifragile.trainer.supervisor as supervisor
from antifragile.trainer.recovery import JobStore, first_formation

store = dist.HashStore()
first_formation(JobStore(store, "a0"), 0, [0, 1])  # slot 1's process plays rank 1
real_kill = os.kill

def report_death(js, **kwargs):
    # torchrun tears the group down (SIGTERM) while this supervisor waits for the survivors
    # to re-form; its child was reaped before
    real_kill(os.getpid(), signal.SIGTERM)
    return True

def kill(pid, sig):
    if sig == signal.SIGKILL:
        print("SIGKILL", pid, flush=True)
        return None
    return real_kill(pid, sig)

supervisor.report_death = report_death
supervisor.os.kill = kill
supervisor.supervise(lambda progress, incarnation: 3, slot=1, recovery="in_process",
                     hang_timeout_s=None, run_dir=None, poll_s=0.01, reform_timeout_s=1.0,
                     store_factory=lambda: JobStore(store, "a0"), spares=1)
"""


def test_a_supervisor_told_to_stop_does_not_kill_the_number_of_a_child_it_reaped() -> None:
    # SIGTERM while it waits in ``report_death`` (up to ``reform_timeout_s``, when torchrun
    # tears the group down): the SIGKILL went to the reaped child's pid, which by then may
    # be another process's
    import signal
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _STALE_PID_SCRIPT], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 128 + signal.SIGTERM, out.stdout + out.stderr
    assert "SIGKILL" not in out.stdout, out.stdout


def _spares_ready(js: JobStore, *spares: str) -> None:
    for spare in spares:
        register_spare(js, spare)
        js.set(f"spare/{spare}/ready", 1.0)


def test_a_late_lowest_survivor_does_not_publish_a_second_generation() -> None:
    # 1.0 reaches recover first; 0.0, the lowest, comes after 1.0's deadline (a blocking save,
    # a collective the abort did not end yet): 1.0 counts it lost and coordinates; 0.0 then
    # found everyone accounted for and coordinated again, overwriting g0/next with another
    # generation (two generations for one failure)
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(3))
    _spares_ready(js, "3.0", "4.0", "5.0")
    js.set("dead/2.0", {})
    by_1 = recover(JobStore(store, "a0"), "1.0", first, timeout_s=0.3)
    by_0 = recover(JobStore(store, "a0"), "0.0", first, timeout_s=5.0)
    assert by_1 == by_0 == Formation(1, ("3.0", "1.0", "4.0"))  # 0.0 counted lost, replaced


def test_a_survivor_that_died_after_registering_alive_is_replaced() -> None:
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(3))
    _spares_ready(js, "3.0", "4.0")
    js.set("dead/2.0", {})
    js.set("g0/alive/1.0", 1.0)  # 1.0 registered as a survivor, then died
    js.set("dead/1.0", {})
    assert recover(js, "0.0", first, timeout_s=5.0) == Formation(1, ("0.0", "3.0", "4.0"))


def _re_formed(store: dist.Store) -> JobStore:
    """g0 = (0.0, 1.0, 2.0); 2.0 died; 0.0 and 1.0 re-formed as g1 = (0.0, 1.0, 3.0)."""
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(3))
    _spares_ready(js, "3.0", "4.0")
    js.set("dead/2.0", {})
    other = threading.Thread(target=lambda: recover(JobStore(store, "a0"), "1.0", first,
                                                    timeout_s=5.0))
    other.start()
    assert recover(js, "0.0", first, timeout_s=5.0) == Formation(1, ("0.0", "1.0", "3.0"))
    other.join(5.0)
    return js


def test_a_member_of_the_next_generation_that_dies_before_joining_it_fails_it() -> None:
    # a survivor that dies after the re-formation was published (its progress still says
    # generation 0), or an assigned spare that dies before it read its assignment: nobody told
    # generation 1, whose other members then waited in its rendezvous for the collective
    # timeout and crashed
    for me, generation, member in (("1.0", 0, True), ("3.0", -1, False)):
        js = _re_formed(_store())
        assert report_death(js, me=me, successor=None, generation=generation, how="signal 9",
                            member=member, reform_timeout_s=1.0)
        assert js.has("g1/fail"), me


def test_a_member_found_dead_after_the_re_formation_is_published_fails_it() -> None:
    # the other order: the death is reported (and read by its supervisor) before the
    # coordinator publishes; the coordinator's check after publishing catches it
    store = _store()
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(2))
    _spares_ready(js, "2.0")
    js.set("dead/1.0", {})
    real_set = js.set

    def set_then_spare_dies(key: str, value: object) -> None:
        real_set(key, value)
        if key == "spare/2.0/assign":
            real_set("dead/2.0", {})  # the spare died as it was assigned

    js.set = set_then_spare_dies  # type: ignore[method-assign]
    assert recover(js, "0.0", first, timeout_s=5.0) == Formation(1, ("0.0", "2.0"))
    assert js.has("g1/fail")


def test_a_generation_that_failed_before_its_members_met_is_not_waited_for() -> None:
    from antifragile.trainer.recovery import gather

    store = _store()
    js = _re_formed(store)
    assert gather(js, Formation(1, ("0.0", "1.0", "3.0")), timeout_s=0.2) == \
        "not every member of generation 1 arrived within 0 s"
    js.set("g1/fail", {"reason": "worker 3.0 died"})
    assert gather(js, Formation(1, ("0.0", "1.0", "3.0")), timeout_s=30.0) == \
        "generation 1 failed before its members met: worker 3.0 died"
    js.add("g2/arrived", 2)  # 1.0 and 3.0 arrived
    assert gather(js, Formation(2, ("0.0", "1.0", "3.0")), timeout_s=5.0) is None


_JOIN_SCRIPT = """
import os, sys, time
from datetime import timedelta
import pytest
import torch.distributed as dist
from antifragile.trainer.config import TrainConfig
from antifragile.trainer.distributed import Launch
from antifragile.trainer.progress import SharedProgress
from antifragile.trainer.recovery import Formation, JobStore
from antifragile.trainer.train import _generation

os.environ["MASTER_ADDR"] = "127.0.0.1"
base = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=8))
os.environ["MASTER_PORT"] = str(base.port)
launch = Launch(0, 3, 0, 3, base, "a0", None, timedelta(seconds=8))
js = JobStore(base, "a0")
formation = Formation(7, ("0.0", "3.0"))
# 3.0 died before it joined generation 7; its supervisor said so, and the next
# generation (or a restart) is already decided
js.set("dead/3.0", {"how": "signal 9", "generation": 7})
js.set("g7/fail", {"reason": "worker 3.0 died"})
js.set("g7/next", {"restart": "1 rank(s) lost and 0 spare(s) left"})
cfg = TrainConfig(recovery="in_process", collective_timeout_s=8.0)
t0 = time.monotonic()
try:
    out = _generation(cfg, launch, "0.0", formation, SharedProgress(), None, "in_process",
                      None)
    print("RETURNED", out, round(time.monotonic() - t0, 1))
except BaseException as exc:
    print("RAISED", type(exc).__name__, round(time.monotonic() - t0, 1))
sys.stdout.flush()
os._exit(0)
"""


def test_a_member_of_a_generation_that_failed_before_it_met_re_forms_instead_of_crashing(
) -> None:
    # generation 7 = (0.0, 3.0); 3.0 died before it joined and g7/fail is set: 0.0 goes
    # through the recovery (here a restart, as decided) and returns; it waited in the
    # rendezvous for the whole collective timeout and crashed with the error
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _JOIN_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith(("RETURNED", "RAISED"))]
    assert line, out.stdout + out.stderr
    assert line[0].startswith("RETURNED 44"), line[0]


_LOOP_SCRIPT = """
import sys, threading, time
import pytest
import torch.distributed as dist
import antifragile.trainer.supervisor as supervisor
from antifragile.trainer.recovery import JobStore, finish, first_formation

store = dist.HashStore()
first_formation(JobStore(store, "a0"), 0, [0])  # slot 0 plays; slot 1 is a spare
code = int(sys.argv[1])

def child(progress, incarnation):
    return code

real_fork = supervisor._fork_child
def counting_fork(*args):
    print("fork", flush=True)
    return real_fork(*args)
supervisor._fork_child = counting_fork
if code != 2:  # the job ends 3 s in: a supervisor that gave up on its slot returns then
    threading.Timer(3.0, lambda: finish(JobStore(store, "a0"))).start()
rc = supervisor.supervise(child, slot=1, recovery="in_process", hang_timeout_s=None,
                          run_dir=None, poll_s=0.01, reform_timeout_s=1.0,
                          store_factory=lambda: JobStore(store, "a0"), spares=1)
print("rc", rc, flush=True)
"""


def _supervise_failing_child(code: int) -> tuple[int, str]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LOOP_SCRIPT, str(code)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.count("fork"), out.stdout + out.stderr


def test_a_training_process_refused_by_its_launch_is_not_forked_again() -> None:
    # exit code 2 (a launch that does not fit the configuration): every fresh process would
    # be refused the same way; the supervisor forked one after another, forever
    forks, out = _supervise_failing_child(2)
    assert forks == 1 and "rc 2" in out, out


def test_a_slot_whose_fresh_processes_keep_dying_before_they_train_stops_refilling() -> None:
    # a spare that dies at once, again and again (a broken node, a missing file): the
    # supervisor forked a successor after every death, a crash loop; now it gives up on the
    # slot after a few, says so, and waits for the job to end without it
    forks, out = _supervise_failing_child(3)
    assert forks == supervisor.SPARE_RETRIES and "rc 0" in out, out
    assert "gives up" in out, out


class _CountingStore(dist.Store):
    """A store that counts the requests made to it (every client, every thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.requests = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def set(self, key, value):  # type: ignore[no-untyped-def]
        self._count()
        self.inner.set(key, value)

    def get(self, key):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.get(key)

    def add(self, key, amount):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.add(key, amount)

    def check(self, keys):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):  # type: ignore[no-untyped-def]
        self._count()
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)


def test_a_re_formation_costs_the_store_requests_linear_in_the_ranks() -> None:
    """16 ranks, one dead, one survivor 0.3 s late (a slow abort). Every survivor looked up
    every member every 2 ms while waiting: ~N^2 requests per round, 10^9 a second at 1,000
    ranks. Now one coordinator counts, the others wait for what it publishes."""
    store = _CountingStore()
    n = 16
    first = first_formation(JobStore(store, "a0"), 0, range(n))
    _spares_ready(JobStore(store, "a0"), f"{n}.0")
    results: list[Formation | str] = []

    def survivor(me: str, late_s: float) -> None:
        time.sleep(late_s)
        results.append(recover(JobStore(store, "a0"), me, first, timeout_s=30.0))

    before = store.requests
    threads = [threading.Thread(target=survivor, args=(f"{i}.0", 0.3 if i == 5 else 0.0))
               for i in range(n - 1)]
    for thread in threads:
        thread.start()
    report_death(JobStore(store, "a0"), me=f"{n - 1}.0", successor=None, generation=0,
                 how="signal 9", member=True, reform_timeout_s=30.0)
    for thread in threads:
        thread.join(30.0)
    assert len(results) == n - 1 and len(set(results)) == 1, results
    assert results[0] == Formation(1, (*(f"{i}.0" for i in range(n - 1)), f"{n}.0"))
    # 12,759-41,746 requests before; ~330 now (the supervisor of the dead rank polls too)
    assert store.requests - before < 40 * n, store.requests - before


def _coordinator_claimed(store: dist.Store, reason: str) -> tuple[Formation, JobStore]:
    """Generation 0 of ranks 0-2 with spares 3.0 and 4.0 ready, failed for ``reason``; rank
    0 has arrived in ``recover`` and claimed the coordination (and dies there, in the
    tests). The first formation and a store client."""
    first = first_formation(JobStore(store, "a0"), 0, range(3))
    _spares_ready(JobStore(store, "a0"), "3.0", "4.0")
    js = JobStore(store, "a0")
    js.set("g0/fail", {"reason": reason})
    js.set("g0/alive/0.0", 1.0)  # rank 0's part of recover(), up to its claim
    js.add("g0/arrived_alive", 1)
    js.set("g0/coordinator/by", "0.0")  # the claim
    return first, js


def test_a_coordinator_that_dies_before_publishing_is_taken_over_by_its_supervisor() -> None:
    """Rank 0 arrives first and claims the coordination, and dies while it waits for the
    others (an 8-rank job waits up to seconds for a stuck survivor): rank 1 waited for a
    generation nobody would publish, until its deadline, then the job restarted."""
    store = _store()
    first, js = _coordinator_claimed(store, "rank 2 died")
    declare_dead(js, me="2.0", generation=0, how="signal 9", member=True)
    survivor, took_s = _supervisor_takes_over(store, first, timeout_s=30.0,
                                              reform_timeout_s=30.0, join_s=30.0)
    assert survivor == [Formation(1, ("3.0", "1.0", "4.0"))]
    assert took_s < 5.0


def test_a_take_over_publishes_before_the_survivors_give_up() -> None:
    """The coordinator dies while it waits for a member that is neither alive nor reported
    dead (stuck): its supervisor takes over, counting that member lost at a deadline of its
    own. The supervisor waits ``reform_timeout_s`` = 2 x the collective timeout, as long as a
    survivor waits for the next generation, and gave the take-over that whole time too: it
    published after the survivors had given up, and the job restarted. The take-over now
    decides within one collective timeout, the "one more" a survivor waits for."""
    timeout_s = 1.0  # the collective timeout: a survivor waits 2 x for the next generation
    store = _store()
    first, _ = _coordinator_claimed(store, "rank 2 stuck")
    # rank 0 dies a while after the others arrived; rank 2 never shows
    survivor, _ = _supervisor_takes_over(store, first, timeout_s=timeout_s,
                                         reform_timeout_s=2 * timeout_s, delay_s=0.3)
    assert survivor == [Formation(1, ("3.0", "1.0", "4.0"))]


def _supervisor_takes_over(store: dist.Store, first: Formation, *, timeout_s: float,
                           reform_timeout_s: float, delay_s: float = 0.0, join_s: float = 10.0
                           ) -> tuple[list[Formation | str], float]:
    """Rank 1 waits in ``recover`` for generation 0's successor while, ``delay_s`` later, rank
    0's supervisor reports its death and takes the coordination over (it must say it did):
    what rank 1 got, and the seconds from its start until it had it."""
    survivor: list[Formation | str] = []
    thread = threading.Thread(target=lambda: survivor.append(
        recover(JobStore(store, "a0"), "1.0", first, timeout_s=timeout_s)))
    t0 = time.monotonic()
    thread.start()
    time.sleep(delay_s)
    assert report_death(JobStore(store, "a0"), me="0.0", successor=None, generation=0,
                        how="signal 9", member=True, reform_timeout_s=reform_timeout_s)
    thread.join(join_s)
    return survivor, time.monotonic() - t0


class _Died(Exception):
    """The coordinator's process died here."""


def test_a_coordinator_that_dies_after_taking_a_spare_does_not_lose_it() -> None:
    """Rank 0 coordinates the loss of rank 2, gives it spare 3.0 (``spare/3.0/assign``) and
    dies before publishing ``g0/next``. Its supervisor's take-over decided anew from the store,
    where 3.0 was no longer free (assigned to a generation nobody published: it waited in that
    generation's rendezvous until its timeout): rank 0 and rank 2 lost, one spare left for
    them, and the job restarted. The take-over now completes the decision the coordinator
    recorded before it took any spare; that generation fails at once (rank 0 is dead), and
    the survivors re-form with the other spare."""
    store = _store()
    first = first_formation(JobStore(store, "a0"), 0, range(3))
    _spares_ready(JobStore(store, "a0"), "3.0", "4.0")
    js = JobStore(store, "a0")
    js.set("g0/alive/1.0", 1.0)  # rank 1's part of recover(), before rank 0 coordinates
    js.add("g0/arrived_alive", 1)
    declare_dead(js, me="2.0", generation=0, how="signal 9", member=True)
    dying = JobStore(store, "a0")
    real_set = dying.set

    def set_until_publishing(key: str, value: object) -> None:
        if key == "g0/next":
            raise _Died
        real_set(key, value)

    dying.set = set_until_publishing  # type: ignore[method-assign]
    with pytest.raises(_Died):
        recover(dying, "0.0", first, timeout_s=5.0)
    assert js.has("spare/3.0/assign") and not js.has("g0/next")  # taken, not published
    survivor, _ = _supervisor_takes_over(store, first, timeout_s=5.0, reform_timeout_s=5.0)
    assert survivor == [Formation(1, ("0.0", "1.0", "3.0"))]
    assert wait_for_assignment(JobStore(store, "a0"), "3.0") == survivor[0]
    assert js.has("g1/fail")  # rank 0 died before it joined
    # the members of generation 1 re-form it with the spare left
    other = threading.Thread(target=lambda: recover(JobStore(store, "a0"), "3.0", survivor[0],
                                                    timeout_s=5.0))
    other.start()
    assert recover(js, "1.0", survivor[0], timeout_s=5.0) == Formation(2, ("4.0", "1.0", "3.0"))
    other.join(10.0)


class _DiesAfterClaiming:
    """A coordinator's store: the process dies at its first request after the one that made
    it the coordinator of generation 0's re-formation."""

    def __init__(self, attempt: object) -> None:
        self._attempt, self.claimed = attempt, False

    def _request(self, name: str, key: object, *args: object) -> object:
        if self.claimed:
            raise _Died
        result = getattr(self._attempt, name)(key, *args)
        self.claimed = isinstance(key, str) and key.startswith("g0/coordinator")
        return result

    def __getattr__(self, name: str) -> object:
        return lambda key, *args: self._request(name, key, *args)


def test_a_coordinator_that_dies_right_after_claiming_is_taken_over_by_its_supervisor() -> None:
    """Rank 0 claims the coordination and is killed before its next store request. The
    claim (``g0/coordinator``) and the claimant's name (``g0/coordinator/by``) were two
    requests: killed between them, nobody was named, so its supervisor did not take over, no
    one else could claim, and rank 1 waited twice its timeout for a generation nobody would
    publish; the job restarted. The claim names its claimant in the same request."""
    store = _store()
    first = first_formation(JobStore(store, "a0"), 0, range(3))
    _spares_ready(JobStore(store, "a0"), "3.0", "4.0")
    declare_dead(JobStore(store, "a0"), me="2.0", generation=0, how="signal 9", member=True)
    dying = JobStore(store, "a0")
    dying.attempt = _DiesAfterClaiming(dying.attempt)  # type: ignore[assignment]
    with pytest.raises(_Died):
        recover(dying, "0.0", first, timeout_s=1.0)
    survivor, took_s = _supervisor_takes_over(store, first, timeout_s=1.0, reform_timeout_s=2.0)
    assert survivor == [Formation(1, ("3.0", "1.0", "4.0"))]
    assert took_s < 1.5


class _ReadTogether:
    """A store whose first two reads wait for each other: two coordinators that look the job's
    furthest step up at the same time (the read-then-write window of ``failed_at``)."""

    def __init__(self, inner: dist.Store) -> None:
        self.inner = inner
        self.barrier = threading.Barrier(2, timeout=10)
        self.reads = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        with self.lock:
            self.reads += 1
            first = self.reads <= 2
        if first:
            self.barrier.wait()
            if threading.current_thread().name == "late":
                time.sleep(0.2)  # its write lands after the other's
        return value

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_two_failures_recorded_at_once_never_move_the_furthest_step_back() -> None:
    """Two failed generations judged at the same moment, one that reached step 12 and one
    that reached step 11, after the job had reached step 10: whichever order they land in,
    the job's furthest step is 12 afterwards (a read-then-write put it back to 11, so a loop
    failing at step 12 would have counted as progress again)."""
    store = _store()
    JobStore(store, "a0").failed_at(10)
    shared = _ReadTogether(store)
    results: dict[int, tuple[int, int]] = {}

    def fail(reached: int) -> None:
        results[reached] = JobStore(store, "a0", counter=shared).failed_at(reached)

    threads = [threading.Thread(target=fail, args=(12,), name="early"),
               threading.Thread(target=fail, args=(11,), name="late")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results[12] == (0, 12)
    assert results[11] in ((1, 12), (0, 11)), results  # after the 12, or before it
    assert JobStore(store, "a0").failed_at(12) == ((2, 12) if results[11] == (1, 12)
                                                   else (1, 12))


def _re_form_without_a_silent_member() -> dict[str, Formation | str]:
    """g0 = (0.0, 1.0, 2.0); 0.0 is neither alive nor reported dead; 1.0 and 2.0 recover at
    the same moment."""
    store = _store()
    first = first_formation(JobStore(store, "a0"), 0, range(3))
    _spares_ready(JobStore(store, "a0"), "3.0")
    results: dict[str, Formation | str] = {}
    together = threading.Barrier(2)

    def survivor(me: str) -> None:
        together.wait()
        results[me] = recover(JobStore(store, "a0"), me, first, timeout_s=0.5)

    threads = [threading.Thread(target=survivor, args=(me,)) for me in ("1.0", "2.0")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    return results


def test_a_member_counted_lost_at_the_deadline_is_replaced_for_every_survivor() -> None:
    """Rank 0 is neither alive nor reported dead (one host: its supervisor died with it, and
    no lease monitor is left to judge it): the coordinator counts it lost at its deadline and
    re-forms. The other survivor waited for the new generation exactly as long as the
    coordinator waited for rank 0, so its wait ran out first (the coordinator notices its
    deadline up to a poll late, then publishes) and it took the restart (20 of 20 rounds)."""
    for _ in range(3):
        assert _re_form_without_a_silent_member() == {
            me: Formation(1, ("3.0", "1.0", "2.0")) for me in ("1.0", "2.0")}


_STARTING_SCRIPT = """
import sys, time
import torch.distributed as dist
import antifragile.trainer.supervisor as supervisor
from antifragile.trainer.progress import Phase
from antifragile.trainer.recovery import JobStore

port, slot = int(sys.argv[1]), int(sys.argv[2])

def child(progress, incarnation):
    if incarnation == 0:
        return 1  # dies starting: its progress never named a generation
    progress.set(Phase.SPARE)
    print("spare", flush=True)
    time.sleep(4.0)  # waits for an assignment, as long as the job lasts
    return 0

def store():
    return JobStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                  wait_for_workers=False), "a0")

rc = supervisor.supervise(child, slot=slot, recovery="in_process", hang_timeout_s=None,
                          run_dir=None, poll_s=0.01, reform_timeout_s=2.0,
                          store_factory=store, spares=1, slots=3)
print("rc", rc, flush=True)
"""


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _supervise_starting(port: int, slot: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _STARTING_SCRIPT, str(port), str(slot)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_first_slot_dying_before_it_numbers_the_first_generation_restarts_the_job(
        ) -> None:
    """Slot 0's training process died before it published the first formation (a crash as
    it connects to the store): its supervisor took it for an idle spare and forked a fresh
    process, which starts as a spare; no first formation ever came, the other slots' processes
    died waiting for it and became spares too, and the job waited forever. Nobody can re-form
    a generation that never formed: torchrun restarts the group."""
    server = _server()
    supervised = _supervise_starting(server.port, 0)
    out, _ = supervised.communicate(timeout=60)
    assert "spare" not in out and "rc 1" in out, out


def test_a_rank_dying_before_it_joined_the_first_generation_fails_it_at_once() -> None:
    """Slot 1's training process died before it joined generation 0, a member of it (its
    progress still said generation -1): its supervisor reported an idle spare, which fails
    no generation, and rank 0 waited in ``gather`` for the whole collective timeout before
    it re-formed without it."""
    server = _server()
    js = JobStore(server, "a0")
    first = first_formation(js, 0, range(2))
    _spares_ready(js, "2.0")
    supervised = _supervise_starting(server.port, 1)
    t0 = time.monotonic()
    why = gather(js, first, timeout_s=30.0)
    waited_s = time.monotonic() - t0
    nxt = recover(js, "0.0", first, timeout_s=30.0)
    finish(js)
    out, _ = supervised.communicate(timeout=60)
    assert why is not None and "failed before its members met" in why, why
    assert waited_s < 15.0, waited_s
    assert nxt == Formation(1, ("0.0", "2.0")), nxt
    assert "rc 0" in out, out


def test_a_supervisor_paused_with_its_host_does_not_take_the_pause_for_a_stall() -> None:
    # a container or VM pause (docker pause, a live migration) stops the supervisor and its
    # child together; the supervisor's first look after it saw the counter unmoved for the
    # whole pause and SIGKILLed a child that had no chance to bump: a false hang
    dog = Watchdog(hang_timeout_s=1.0, escalate=3.0, max_round_s=supervisor.LATE_LOOK_S)
    t = 0.0
    for counter in range(20):  # training, a look every 50 ms
        t += 0.05
        assert dog.observe(t, counter, Phase.TRAINING, False) is None
    t += 60.0  # paused, both of them
    assert dog.observe(t, 19, Phase.TRAINING, False) is None
    assert dog.observe(t + 0.05, 20, Phase.TRAINING, False) is None  # it trains on
    # a real stall after the pause is still seen, after 3 x the timeout of looking
    looks = [dog.observe(t + 0.05 + 0.05 * i, 20, Phase.TRAINING, False) for i in range(1, 70)]
    assert "stalled" in looks[55:] and "stalled" not in looks[:55], looks


_ORPHAN_SCRIPT = """
import ctypes, os, sys, time
import antifragile.trainer.supervisor as supervisor
from antifragile.trainer.progress import SharedProgress

libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: as a container's init or systemd may be
if os.fork() == 0:  # the supervisor
    class SlowLibc:  # the child is descheduled between fork and its prctl
        def prctl(self, *args):
            time.sleep(0.5)
            return libc.prctl(*args)
    supervisor.ctypes.CDLL = lambda *a, **k: SlowLibc()
    def train(progress, incarnation):
        print("trained", flush=True)
        return 0
    supervisor._fork_child(train, SharedProgress(), 0)
    os._exit(143)  # SIGTERM before the child could set its parent-death signal
time.sleep(0.1)
while True:  # reap the supervisor and, reparented here, its orphan
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def test_a_child_whose_supervisor_died_before_it_armed_its_death_signal_does_not_train() -> None:
    # the child checked for an orphaning with ``getppid() == 1``; under a subreaper (a
    # container's init, systemd) an orphan's parent is that process, and the child trained
    # on unsupervised, beside the fresh one torchrun starts
    out = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "trained" not in out.stdout, out.stdout + out.stderr


_EXITED_AS_JUDGED_SCRIPT = """
import os, signal, time
import antifragile.trainer.supervisor as supervisor

real_kill = os.kill

def kill(pid, sig):  # the child exits on its own just as the watchdog judges it hung
    if sig == signal.SIGKILL:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    return real_kill(pid, sig)

def train(progress, incarnation):
    time.sleep(0.5)
    return 46  # the last step's checkpoint failed: a restart, not a re-formation

supervisor.os.kill = kill
supervisor.main_thread_state = lambda pid: "T"
print("rc", supervisor.supervise(train, slot=0, recovery="restart", hang_timeout_s=0.05,
                                 run_dir=None, poll_s=0.01), flush=True)
"""


def test_a_child_that_exits_as_it_is_judged_hung_keeps_its_exit_code() -> None:
    # the SIGKILL of a child judged hung found it exited on its own (a zombie): the
    # supervisor reported a hang (43) instead of the child's own code, which in process
    # decides between a re-formation and a restart
    out = subprocess.run([sys.executable, "-c", _EXITED_AS_JUDGED_SCRIPT], capture_output=True,
                         text=True, timeout=60)
    assert f"rc {supervisor.FINAL_SAVE_EXIT_CODE}" in out.stdout, out.stdout + out.stderr


_SIGTERM_AFTER_THE_REAP_SCRIPT = """
import os, signal, sys, time
import antifragile.trainer.supervisor as supervisor

hung = sys.argv[1] == "hung"
real_kill, real_waitpid = os.kill, os.waitpid
reaped = set()

def kill(pid, sig):
    if pid in reaped:  # said, not sent: the number may be another process's by now
        print("signalled the reaped pid", pid, flush=True)
        return None
    return real_kill(pid, sig)

def waitpid(pid, flags):
    done, status = real_waitpid(pid, flags)
    if done:  # torchrun's SIGTERM, handled just after the reap
        reaped.add(done)
        print("SIGTERM after the reap", flush=True)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    return done, status

def train(progress, incarnation):
    time.sleep(30 if hung else 0.1)
    return 0

supervisor.os.kill, supervisor.os.waitpid = kill, waitpid
if hung:
    supervisor.main_thread_state = lambda pid: "T"
supervisor.supervise(train, slot=0, recovery="restart", hang_timeout_s=0.05 if hung else None,
                     run_dir=None, poll_s=0.01)
print("supervise returned", flush=True)
"""


@pytest.mark.parametrize("how", ["exited", "hung"])
def test_a_sigterm_just_after_the_child_is_reaped_signals_nobody(how: str) -> None:
    """The supervisor forgot its child's pid only after ``_watch`` returned: a SIGTERM handled
    between the reap (``waitpid``) and that, in the poll or after the SIGKILL of a hung child
    (while the hang was reported), SIGKILLed a pid no longer its child's, another process's
    once the number is reused. The handler is run here at exactly that moment."""
    out = subprocess.run([sys.executable, "-c", _SIGTERM_AFTER_THE_REAP_SCRIPT, how],
                         capture_output=True, text=True, timeout=60)
    assert "SIGTERM after the reap" in out.stdout, out.stdout + out.stderr
    assert "signalled the reaped pid" not in out.stdout, out.stdout + out.stderr
    assert out.returncode == 128 + 15, out.stdout + out.stderr  # the handler's exit


def test_a_survivor_of_a_generation_that_failed_before_it_met_says_why_it_restarts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A member whose generation failed before its members met re-forms from ``gather``; when
    that re-formation is a restart (no spare left) it exited with the restart code and
    nothing of the reason: no event, no line on stderr (the other path emits it)."""
    from datetime import timedelta

    from antifragile.trainer.config import TrainConfig
    from antifragile.trainer.distributed import Launch
    from antifragile.trainer.train import _generation

    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the launcher's store is ``base``
    store = _store()
    launch = Launch(0, 2, 0, 2, store, "a0", None, timedelta(seconds=8))
    js = JobStore(store, "a0")
    js.set("g7/members", ["0.0", "3.0"])
    declare_dead(js, me="3.0", generation=7, how="signal 9", member=True)
    cfg = TrainConfig(recovery="in_process", collective_timeout_s=8.0)
    out = _generation(cfg, launch, "0.0", Formation(7, ("0.0", "3.0")), SharedProgress(),
                      None, "in_process", [None])
    assert out == supervisor.RESTART_EXIT_CODE
    err = capsys.readouterr().err
    assert "1 rank(s) lost and 0 spare(s) left" in err, err
    assert "generation 7" in err.splitlines()[-1], err


def test_a_spare_that_died_registering_does_not_stall_the_pool() -> None:
    """``register_spare`` reserves an index, then names it: two requests. A registrant killed
    between them (a supervisor registering its slot's successor as its host goes down) left
    an index without a name, and every later look at the pool (each re-formation, ``finish``
    at the end of a successful run) waited the store's timeout for it and raised."""
    from datetime import timedelta

    store = _store()
    store.set_timeout(timedelta(seconds=3))
    js = JobStore(store, "a0")
    first = first_formation(js, 0, range(2))
    js.add("spares/count", 1)  # index 0 reserved, never named
    _spares_ready(js, "2.0")
    js.set("dead/1.0", {})
    t0 = time.monotonic()
    assert recover(js, "0.0", first, timeout_s=5.0) == Formation(1, ("0.0", "2.0"))
    register_spare(js, "1.1")
    finish(js)  # rank 0, the run done: releases the idle spare, raises nothing
    assert wait_for_assignment(js, "1.1") is None
    assert time.monotonic() - t0 < 2.0


_SIGTERM_WAITING_FOR_THE_FIRST_FORMATION_SCRIPT = """
import os, signal, threading, time
import torch.distributed as dist
import antifragile.trainer.supervisor as supervisor
from antifragile.trainer.recovery import JobStore

store = dist.HashStore()  # slot 0 died before it numbered the first generation: no "first"

def train(progress, incarnation):
    return 1  # died starting (an error building the model): phase STARTING, no generation

def sigterm():  # torchrun tears the group down (slot 0's supervisor exited)
    print("SIGTERM", time.monotonic(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Timer(1.0, sigterm).start()
supervisor.supervise(train, slot=1, recovery="in_process", hang_timeout_s=None, run_dir=None,
                     poll_s=0.01, reform_timeout_s=15.0,
                     store_factory=lambda: JobStore(store, "a0"), spares=0, slots=2)
print("supervise returned", flush=True)
"""


def test_a_supervisor_waiting_for_the_first_formation_acts_on_sigterm_at_once() -> None:
    """A child that died starting (a rank's error building the model) has the supervisor
    wait up to ``reform_timeout_s`` for the first formation, in one store ``wait``: a Python
    signal handler runs only between bytecodes, so torchrun's SIGTERM (the group torn down
    because slot 0 failed the same way) waited out that wait, and torchrun's 30 s grace
    ended in a SIGKILL: every restart of a job whose ranks fail at start came 30 s late."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _SIGTERM_WAITING_FOR_THE_FIRST_FORMATION_SCRIPT],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + 15, out.stdout + out.stderr
    assert time.monotonic() - started < 10.0, out.stdout + out.stderr


_SYS_EXIT_SCRIPT = """
import sys
import antifragile.trainer.supervisor as supervisor

how = sys.argv[1]

def train(progress, incarnation):
    sys.exit() if how == "bare" else sys.exit("the data folder is empty")

print("rc", supervisor.supervise(train, slot=0, recovery="restart", hang_timeout_s=None,
                                 run_dir=None, poll_s=0.01), flush=True)
"""


@pytest.mark.parametrize(("how", "rc", "said"), [("bare", 0, ""),
                                                  ("message", 1, "the data folder is empty")])
def test_a_child_ending_with_sys_exit_exits_as_python_would(how: str, rc: int, said: str) -> None:
    """``sys.exit()`` (code None) is a success in any Python process, and ``sys.exit(msg)``
    prints ``msg`` and exits 1. The forked child took every non-int code for a failure, so a
    bare ``sys.exit()`` became exit code 1 (a restart, or a re-formation), and swallowed the
    message, the only word on why the training process stopped."""
    out = subprocess.run([sys.executable, "-c", _SYS_EXIT_SCRIPT, how], capture_output=True,
                         text=True, timeout=60)
    assert f"rc {rc}" in out.stdout, out.stdout + out.stderr
    assert said in out.stderr, out.stdout + out.stderr


_FULL_EVENT_DISK_SCRIPT = """
import errno, sys, tempfile, time
import antifragile.trainer.supervisor as supervisor

class Full:  # the run folder's disk is full: every write of an event line fails
    def write(self, line):
        raise OSError(errno.ENOSPC, "No space left on device")

supervisor.open_event_file = lambda path: Full()
supervisor.main_thread_state = lambda pid: "T"  # stopped: judged hung after the timeout

def train(progress, incarnation):
    time.sleep(30)
    return 0

print("rc", supervisor.supervise(train, slot=0, recovery="restart", hang_timeout_s=0.1,
                                 run_dir=tempfile.mkdtemp(), poll_s=0.01), flush=True)
"""


def test_a_supervisor_whose_event_file_cannot_be_written_still_handles_the_death() -> None:
    """Events are best effort (a rank's chaos channel drops a line the disk has no room
    for): the supervisor's raised, so a hang found while the run folder's disk was full
    ended the supervisor in a traceback (exit 1) instead of its hang code, and in process
    it never reported the death: a restart of the whole group instead of a re-formation."""
    out = subprocess.run([sys.executable, "-c", _FULL_EVENT_DISK_SCRIPT], capture_output=True,
                         text=True, timeout=60)
    assert f"rc {supervisor.HANG_EXIT_CODE}" in out.stdout, out.stdout + out.stderr
