"""Leases (``trainer.lease``): a slot that died whole, supervisor and all (a lost host), is found
by its silence and declared dead, so the survivors re-form without waiting for a report that
never comes. No processes: the protocol on an in-memory store, threads for the supervisors."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from antifragile.trainer.lease import (
    Heartbeat,
    Holder,
    LeaseMonitor,
    Lost,
    declare_lost,
    renewal_interval_s,
)
from antifragile.trainer.progress import MIN_LEASE_S, default_lease_s
from antifragile.trainer.recovery import (
    Formation,
    JobStore,
    declare_dead,
    first_formation,
    recover,
    register_spare,
)


def _js(store: dist.Store) -> JobStore:
    return JobStore(store, "fresh")


def _monitor(js: JobStore, slots: int, *, lease_s: float, within_s: float, then_s: float = 0.0
             ) -> list[Lost]:
    """A lease monitor of ``slots`` on ``js`` until it tells of a loss (at most ``within_s``),
    then ``then_s`` more (a second word on it would come there); the job then ends, which
    stops it. What it told."""
    told: list[Lost] = []
    LeaseMonitor(slots, lease_s=lease_s, interval_s=0.02).start(js, told.append)
    deadline = time.monotonic() + within_s
    while not told and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(then_s)
    js.set("done", 1.0)
    return told


def _lease(slot: int, worker: str, n: int, *, generation: int = 0, member: bool = True
           ) -> tuple[int, dict[str, object]]:
    return slot, {"worker": worker, "generation": generation, "member": member, "n": n}


def test_renewals_slow_down_in_large_jobs_but_stay_several_per_lease() -> None:
    assert renewal_interval_s(8, 5.0) == 0.25
    assert renewal_interval_s(4000, 5.0) == 1.0  # 4,000 renewals a second
    assert renewal_interval_s(100_000, 5.0) == 1.25  # a quarter of the lease


def test_the_default_lease_is_never_shorter_than_a_lease_one_may_give() -> None:
    assert default_lease_s(None) == 5.0
    assert default_lease_s(2.0) == 3.0
    assert default_lease_s(0.4) == MIN_LEASE_S  # not 0.6 s: renewed every 0.15 s


def test_a_silent_slot_is_lost_once_after_its_lease_by_the_monitors_clock() -> None:
    monitor = LeaseMonitor(slots=4, lease_s=2.0, interval_s=0.25)
    # a round every interval: slot 0 renews; slot 1 says the same number: silent since t=0
    # (its own clock is unread)
    for i in range(9):
        assert monitor.observe(0.25 * i, dict([_lease(0, "0.0", 7 + i), _lease(1, "1.0", 3)])) == []
    lost = monitor.observe(2.25, dict([_lease(0, "0.0", 16), _lease(1, "1.0", 3)]))
    assert lost == [(1, Holder("1.0", 0, True), 2.25)]
    assert monitor.observe(9.0, dict([_lease(0, "0.0", 10), _lease(1, "1.0", 3)])) == []


def test_spares_are_declared_before_members_and_retired_slots_not_at_all() -> None:
    monitor = LeaseMonitor(slots=4, lease_s=1.0, interval_s=0.25)
    # a host's two slots went silent together; the member's last renewal came a little later
    monitor.observe(0.0, dict([_lease(3, "3.0", 1, generation=-1, member=False),
                               (2, {"retired": True})]))
    monitor.observe(0.1, dict([_lease(1, "1.0", 1)]))
    leases = dict([_lease(1, "1.0", 1), _lease(3, "3.0", 1, generation=-1, member=False),
                   (2, {"retired": True})])
    for t in (0.35, 0.6, 0.85):  # a round every interval
        assert monitor.observe(t, leases) == []
    # a coordinator woken by the lost member must find the spare of the same host dead already
    assert [holder.worker for _, holder, _ in monitor.observe(1.1, leases)] == ["3.0"]
    assert [holder.worker for _, holder, _ in monitor.observe(1.35, leases)] == ["1.0"]
    assert monitor.observe(9.0, leases) == []


def test_a_death_said_by_its_supervisor_and_by_the_monitor_counts_once() -> None:
    js = _js(dist.HashStore())
    first_formation(js, 0, range(2))
    declare_dead(js, me="1.0", generation=0, how="signal 9", member=True)
    declare_lost(js, 1, Holder("1.0", 0, True), 6.0)
    assert js.add("g0/deaths", 0) == 1  # two would read as "every rank of generation 0 died"
    assert js.get("dead/1.0")["how"] == "signal 9"


def test_a_lost_member_is_declared_in_the_generation_it_re_formed_into() -> None:
    js = _js(dist.HashStore())
    first_formation(js, 0, range(2))
    js.set("g0/next", {"generation": 1, "members": ["0.0", "1.0"]})
    js.set("g1/members", ["0.0", "1.0"])
    # its last lease still named generation 0
    lost = declare_lost(js, 1, Holder("1.0", 0, True), 5.0)
    assert (lost.generation, lost.rank) == (1, 1)
    assert js.has("g1/fail") and "no lease renewal from slot 1" in js.get("g1/fail")["reason"]


def test_a_retired_heartbeat_says_so() -> None:
    js = _js(dist.HashStore())
    beat = Heartbeat(js, 3, lambda: Holder("3.0", 0, True), interval_s=0.01)
    beat.start()
    time.sleep(0.05)
    assert js.get("lease/3")["n"] >= 1
    beat.retire()
    assert js.get("lease/3") == {"retired": True}


def test_a_heartbeat_renews_again_after_the_store_failed_it_once() -> None:
    """One write refused (a store request that timed out while the link to the store's host
    was cut, for the seconds a drop_link lasts) ended the heartbeat thread for good: the slot
    fell silent, its healthy rank was declared lost after lease_s, and every later process of
    the slot ran without a lease."""
    js = _js(dist.HashStore())
    store_set, refused = js.set, []

    def flaky_set(key: str, value: object) -> None:
        if not refused:
            refused.append(key)
            raise RuntimeError("Socket Timeout")
        store_set(key, value)

    js.set = flaky_set  # type: ignore[method-assign]
    beat = Heartbeat(js, 3, lambda: Holder("3.0", 0, True), interval_s=0.01)
    beat.start()
    deadline = time.monotonic() + 5
    while not (js.has("lease/3") and js.get("lease/3").get("n", 0) >= 2) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    renewed = js.has("lease/3") and js.get("lease/3").get("n", 0) >= 2
    beat.retire()
    assert refused == ["lease/3"] and renewed


def test_a_monitor_goes_on_judging_after_the_store_failed_it_once() -> None:
    """Any store error ended the monitor's thread for good: no slot was judged again."""
    js = _js(dist.HashStore())
    beat = Heartbeat(js, 1, lambda: Holder("1.0", 0, True), interval_s=0.01)
    beat.start()
    time.sleep(0.05)
    beat._stop.set()  # slot 1 falls silent (its host is gone), without retiring
    attempt, failed = js.attempt, []

    class FlakyOnce:  # the store's first read of the leases times out
        def multi_get(self, keys: list[str]) -> list[bytes]:
            if not failed:
                failed.append(keys)
                raise RuntimeError("Socket Timeout")
            return attempt.multi_get(keys)

        def __getattr__(self, name: str) -> object:
            return getattr(attempt, name)

    js.attempt = FlakyOnce()  # type: ignore[assignment]
    lost = _monitor(js, 4, lease_s=0.3, within_s=5)
    assert failed and [x.worker for x in lost] == ["1.0"]


def test_survivors_re_form_without_a_host_that_died_whole() -> None:
    """Two hosts of two slots: rank 0 and spare 2.0 on host 0, rank 1 and spare 3.0 on host 1.
    Host 1 dies: its supervisors too, so nobody reports its deaths. Without leases the survivor
    waited the whole re-formation timeout for rank 1, and the coordinator could have picked
    the lost host's spare (registered first and warm); now the monitor declares both dead
    after the lease, and the survivor re-forms with host 0's spare at once."""
    store = dist.HashStore()
    js = _js(store)
    first = first_formation(js, 0, [0, 1])
    for spare in ("3.0", "2.0"):
        register_spare(js, spare)
        js.set(f"spare/{spare}/ready", 1.0)
    living = {0: Holder("0.0", 0, True), 2: Holder("2.0", -1, False)}
    beats = [Heartbeat(_js(store), slot, lambda h=h: h, interval_s=0.02)
             for slot, h in living.items()]
    for beat in beats:
        beat.start()
    # host 1's supervisors wrote their leases once, then died with their host
    for slot, holder in ((1, Holder("1.0", 0, True)), (3, Holder("3.0", -1, False))):
        js.set(f"lease/{slot}", {"worker": holder.worker, "generation": holder.generation,
                                 "member": holder.member, "n": 0})
    lost: list[Lost] = []
    LeaseMonitor(4, lease_s=0.5, interval_s=0.02).start(_js(store), lost.append)
    t0 = time.monotonic()
    nxt = recover(js, "0.0", first, timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0
    assert nxt == Formation(1, ("0.0", "2.0")), nxt
    assert sorted((x.slot, x.worker, x.generation, x.rank) for x in lost) == [
        (1, "1.0", 0, 1), (3, "3.0", -1, -1)]
    js.set("done", 1.0)  # the monitor stops judging
    for beat in beats:
        beat.retire()


def test_a_monitor_that_was_itself_paused_does_not_count_its_pause_as_silence() -> None:
    """Slot 0's supervisor (the monitor) and the slots of its host were paused together for
    5 s (a VM or container pause, a swap storm): when they resume, whichever reads first wins.
    The monitor read the leases before slot 1's heartbeat had renewed and took the 5 s it had
    not looked for slot 1's silence: a healthy rank declared lost, its generation failed."""
    monitor = LeaseMonitor(slots=2, lease_s=1.0, interval_s=0.25)
    assert monitor.observe(0.0, dict([_lease(0, "0.0", 1), _lease(1, "1.0", 1)])) == []
    assert monitor.observe(0.25, dict([_lease(0, "0.0", 2), _lease(1, "1.0", 2)])) == []
    # paused from 0.25 to 5.25; slot 0's heartbeat renewed first, slot 1's not yet
    assert monitor.observe(5.25, dict([_lease(0, "0.0", 3), _lease(1, "1.0", 2)])) == []
    assert monitor.observe(5.5, dict([_lease(0, "0.0", 4), _lease(1, "1.0", 3)])) == []
    # a slot that stays silent after the pause is still lost, after its lease of looking
    t, lost = 5.5, []
    while not lost and t < 10.0:
        t += 0.25
        lost = monitor.observe(t, dict([_lease(0, "0.0", int(t * 4)), _lease(1, "1.0", 3)]))
    assert [holder.worker for _, holder, _ in lost] == ["1.0"] and t == 6.75


def test_the_monitor_tells_of_a_death_its_supervisor_reported_first_not_again() -> None:
    # a rank's process died and its supervisor reported it; then the slot fell silent (the
    # host went down after its GPU killed the process): the store counted the death once, but
    # the monitor still told of it, and slot 0's supervisor logged a second ``rank_died``
    # (``lost``) for the same death, with another cause
    js = _js(dist.HashStore())
    first_formation(js, 0, range(3))
    declare_dead(js, me="1.0", generation=0, how="signal 9", member=True)
    js.set("lease/1", {"worker": "1.0", "generation": 0, "member": True, "n": 7})
    js.set("lease/2", {"worker": "2.0", "generation": 0, "member": True, "n": 7})
    told = _monitor(js, 3, lease_s=0.2, within_s=10.0, then_s=0.3)
    assert [lost.worker for lost in told] == ["2.0"]



def test_an_idle_spare_declared_lost_that_was_only_slow_learns_it_and_leaves() -> None:
    # a cut link of a few seconds (drop-link.yaml, in process): the monitor declared the idle
    # spare of the cut host dead; once the link healed, the spare waited on for an
    # assignment no coordinator would ever give it (dead spares are skipped), and its
    # supervisor never refilled the slot: one spare fewer for the rest of the job
    import threading

    from antifragile.trainer.recovery import finish, wait_for_assignment

    store = dist.HashStore()
    js = _js(store)
    first_formation(js, 0, range(2))
    register_spare(js, "2.0")
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(wait_for_assignment(_js(store), "2.0")),
                              daemon=True)
    waiter.start()
    try:
        time.sleep(0.1)
        declare_lost(js, 2, Holder("2.0", -1, False), 6.0)
        waiter.join(5.0)
        assert got and isinstance(got[0], str) and "lost" in got[0], got
    finally:
        finish(js)  # releases the waiter should it still wait


class _RefusesOnce:
    """The attempt's store with the first write of ``key`` refused (a TCPStore request that
    hit a connection reset or a timeout): raised before it takes effect."""

    def __init__(self, attempt: object, key: str) -> None:
        self._attempt, self._key, self.refused = attempt, key, False

    def _write(self, name: str, key: str, *args: object) -> object:
        if key == self._key and not self.refused:
            self.refused = True
            raise RuntimeError("Connection reset by peer")
        return getattr(self._attempt, name)(key, *args)

    def set(self, key: str, value: object) -> object:
        return self._write("set", key, value)

    def compare_set(self, key: str, expected: object, desired: object) -> object:
        return self._write("compare_set", key, expected, desired)

    def __getattr__(self, name: str) -> object:
        return getattr(self._attempt, name)


def test_a_death_declared_in_part_is_completed_by_the_next_declaration() -> None:
    """A store error between the steps of a declaration (the death counted as said, the
    generation not yet failed) left it half made for good: every later declaration found it
    said and did nothing, so no survivor learnt of the death before the coordinator's deadline
    (a whole collective timeout, not the lease). A declaration is now safe to repeat: the next
    one completes it, and one more changes nothing."""
    js = _js(dist.HashStore())
    first_formation(js, 0, range(2))
    refusing = _RefusesOnce(js.attempt, "g0/fail")
    js.attempt = refusing  # type: ignore[assignment]
    how = "lost: no lease renewal from slot 1's supervisor for 6.0 s"
    with pytest.raises(RuntimeError, match="reset"):
        declare_dead(js, me="1.0", generation=0, how=how, member=True)
    assert refusing.refused and not js.has("g0/fail")
    assert declare_dead(js, me="1.0", generation=0, how=how, member=True)  # the same word
    assert js.has("g0/fail") and js.get("dead/1.0")["how"] == how
    assert not declare_dead(js, me="1.0", generation=0, how="signal 9", member=True)
    assert js.get("dead/1.0")["how"] == how and js.add("g0/deaths", 0) == 1


def test_a_monitor_declares_again_a_loss_the_store_refused() -> None:
    """The monitor marked a worker declared before it declared it: a store error in between
    (the write of ``dead/<id>`` refused) and the loss was never declared: the generation was
    not failed, and the survivors waited the coordinator's deadline instead of the lease."""
    js = _js(dist.HashStore())
    first_formation(js, 0, range(2))
    js.set("lease/1", {"worker": "1.0", "generation": 0, "member": True, "n": 1})  # silent
    refusing = _RefusesOnce(js.attempt, "dead/1.0")
    js.attempt = refusing  # type: ignore[assignment]
    told = _monitor(js, 2, lease_s=0.1, within_s=5.0, then_s=0.1)
    assert refusing.refused
    assert [lost.worker for lost in told] == ["1.0"] and js.has("g0/fail")
    assert js.add("g0/deaths", 0) == 1


class _BrokenAfterReset:
    """A store client whose connection was reset while the store lives (a proxy reset, a
    request that timed out mid-reply): torch's TCPStore client then fails every later request
    ("Broken pipe") and never connects again."""

    def __init__(self, js: JobStore) -> None:
        self._js, self.broken = js, False

    def reset(self) -> None:
        self.broken = True

    def __getattr__(self, name: str) -> object:
        if self.broken:
            raise RuntimeError("Broken pipe")
        return getattr(self._js, name)


def test_a_heartbeat_whose_store_connection_was_reset_connects_again() -> None:
    """The heartbeat kept its one store client for good: after a reset every renewal failed,
    the slot fell silent while its rank trained on, and the monitor declared it lost."""
    store = dist.HashStore()
    clients = [_BrokenAfterReset(_js(store)) for _ in range(2)]
    made = iter(clients)
    beat = Heartbeat(next(made), 3, lambda: Holder("3.0", 0, True),  # type: ignore[arg-type]
                     interval_s=0.01, reconnect=lambda: next(made))  # type: ignore[arg-type]
    beat.start()
    time.sleep(0.05)
    clients[0].reset()
    time.sleep(0.05)
    before = _js(store).get("lease/3")["n"]
    time.sleep(0.1)
    after = _js(store).get("lease/3")["n"]
    beat.retire()
    assert after > before, "no renewal after the reset"


def test_a_monitor_whose_store_connection_was_reset_connects_again() -> None:
    store = dist.HashStore()
    js = _js(store)
    beat = Heartbeat(js, 1, lambda: Holder("1.0", 0, True), interval_s=0.01)
    beat.start()
    time.sleep(0.05)
    beat._stop.set()  # slot 1 falls silent (its host is gone), without retiring
    client = _BrokenAfterReset(_js(store))
    client.reset()
    told: list[Lost] = []
    LeaseMonitor(4, lease_s=0.3, interval_s=0.02).start(
        client, told.append, reconnect=lambda: _js(store))  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while not told and time.monotonic() < deadline:
        time.sleep(0.02)
    js.set("done", 1.0)
    assert [x.worker for x in told] == ["1.0"]


def test_a_heartbeat_retires_at_once_while_it_connects_to_a_store_out_of_reach() -> None:
    """A store gone for good (slot 0's supervisor served it and ended first) makes a fresh
    client wait its whole connect timeout (twice the collective timeout in torch 2.13):
    retiring must not wait behind that connect, nor connect again itself."""
    js = _BrokenAfterReset(_js(dist.HashStore()))
    connecting = []

    def reconnect() -> JobStore:
        connecting.append(time.monotonic())
        time.sleep(10)  # a TCPStore client connecting to nothing, until its timeout
        raise RuntimeError("The client socket has timed out while trying to connect")

    beat = Heartbeat(js, 3, lambda: Holder("3.0", 0, True),  # type: ignore[arg-type]
                     interval_s=0.01, reconnect=reconnect)
    beat.start()
    time.sleep(0.05)
    js.reset()
    deadline = time.monotonic() + 5
    while not connecting and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    beat.retire()
    assert connecting and time.monotonic() - t0 < 2.0


def test_a_spare_is_offered_only_once_its_slots_lease_is_held() -> None:
    """A spare's training process registered itself (``register_spare``) as soon as it
    started, while its supervisor was still connecting to the store to start its lease: a
    host lost in that window (seen in the slow tier: host 1's spare ready 0.3 s before host 1
    went dark) left a registered, warm spare that no lease monitor would ever judge, and a
    re-formation that picked it (the oldest spare first) waited for a dead process. The
    spare now registers once its slot's lease exists (or after ``timeout_s``, as before)."""
    import threading

    from antifragile.trainer.lease import register_when_leased
    from antifragile.trainer.recovery import _spares

    store = dist.HashStore()
    js = _js(store)
    registered = threading.Thread(target=register_when_leased, args=(_js(store), 3, "3.0"),
                                  kwargs={"timeout_s": 30.0}, daemon=True)
    registered.start()
    time.sleep(0.3)
    assert _spares(js) == []  # no lease of slot 3 yet: not offered
    js.set("lease/3", _lease(3, "3.0", 0, generation=-1, member=False)[1])
    registered.join(5.0)
    assert not registered.is_alive() and _spares(js) == ["3.0"]
    started = time.monotonic()
    register_when_leased(js, 5, "5.0", timeout_s=0.2)  # a supervisor that never leases
    assert time.monotonic() - started < 2.0 and _spares(js) == ["3.0", "5.0"]
