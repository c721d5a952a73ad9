"""Measurements (DESIGN 4.3), built only from the trainer's events and the injection log."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from antifragile.chaos.faults import Injection
from antifragile.chaos.observe.effects import (
    STORAGE_FAULTS,
    corrupt_effect,
    crash_effect,
    disk_full_effect,
    holds,
    link_noticed,
    node_down_effect,
    outage_effect,
    outage_effects,
    restore_skipped_step,
    stopped_by,
)
from antifragile.chaos.observe.record import STARTS, RunRecord
from antifragile.trainer.progress import HANG_FLOOR_S, STALL_ESCALATION

if TYPE_CHECKING:
    from antifragile.chaos.scenario import Scenario


#: Added to the job's own detection bound (the slower of ``hang_timeout_s`` and
#: ``collective_timeout_s``) for the agents to tear the group down (``--monitor-interval`` 0.2 s,
#: ``--shutdown-timeout`` 3 s) on a loaded machine.
TEARDOWN_S = 30.0
RESTART_EXIT_CODE = 44  # trainer.supervisor: in-process recovery found no spare


def detection_window_s(s: Scenario) -> float:
    """How long after its injection a fault may end its attempt and still be the cause: the
    slowest way the job notices a failure, plus the teardown (a ``drop_link``'s window starts
    when the link comes back up). A command trainer's bound is its ``detect_timeout_s``."""
    if s.is_command:
        return s.trainer.detect_timeout_s + TEARDOWN_S
    hang_s = (s.trainer.hang_timeout_s or HANG_FLOOR_S) * STALL_ESCALATION
    return max(hang_s, s.trainer.collective_timeout_s) + TEARDOWN_S

@dataclass(slots=True)
class FaultTimings:
    kind: str
    injected_t: float
    injected_step: int | None
    rank: int | None
    fault_index: int | None = None  # which of the scenario's faults (``faults.<index>``)
    skipped: str | None = None
    missed: str | None = None
    checkpoint_step: int | None = None
    # how many attempts had finished ``injected_step`` when the fault hit (its pass there, or
    # more: an in-process generation that failed while held at a step is held there again)
    times_at_step: int | None = None
    # what the fault observably did (None: not made here, see ``skipped``); ``effect`` is the
    # evidence, or why none was seen (then the verdict fails)
    effect_observed: bool | None = None
    effect: str | None = None
    ended_attempt: int | None = None  # the attempt this fault ended (None: it caused no restart)
    recovery_mode: str | None = None  # "in_process" (re-formed with a spare) or "restart"
    fallback: str | None = None  # why an in-process recovery fell back to a torchrun restart
    paused_s: float | None = None  # how long chaos held the trainer at the fault's pause point
    # the next fault hit the job before it was back at this fault's step: this recovery was
    # cut short (the later fault's recovery covers both); the injection time of that fault
    interrupted_by_t: float | None = None
    detect_s: float | None = None
    restart_s: float | None = None
    restore_s: float | None = None
    recompute_s: float | None = None
    recovery_s: float | None = None
    restored_step: int | None = None
    # the newest step a rank had seen commit when the fault hit that no restore up to this
    # recovery's skipped (as damaged or unreadable): the restore must not go back further
    restorable_step: int | None = None
    restore_memory_bytes: int | None = None  # restored from host memory (in-process survivors)
    restore_storage_bytes: int | None = None  # read from storage
    lost_steps: int | None = None
    # the newest step the attempt after the fault reported (None: it reported none)
    retrained_to_step: int | None = None
    outage: dict[str, Any] | None = None  # a storage fault: what it did (see outage_effects)
    unmeasured: str | None = None  # what of the recovery could not be measured, and why


KILLS = ("kill_rank", "crash_during_save", "host_down")  # faults that kill ranks outright


def _by_attempt(events: list[dict[str, Any]], attempt: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["attempt"] == attempt and e["event"] == kind]


def _struck_attempt(record: RunRecord, injection: Injection) -> int:
    """The attempt ``injection`` hit: the latest that the process it signalled started as
    that rank (a survivor of an in-process recovery keeps its pid into the next generation),
    where a rank's start names that pid (exact, whatever the clocks say), else the one
    running at its time."""
    pid = injection.detail.get("pid")
    if injection.rank is not None and pid is not None:
        started = [int(e["attempt"]) for e in record.events
                   if e["event"] in STARTS and e.get("pid") == pid
                   and e["rank"] == injection.rank and e["t"] <= injection.t]
        if started:
            return max(started)
    return record.attempt_at(injection.t)


def _resumed_at(record: RunRecord, attempt: int, first: int | None) -> int | None:
    """Where ``attempt`` stood before its first step: the step it restored; killed before its
    restore ended, where the attempt before it stopped (the recovery from the fault that ended
    that one restored nothing to count its lost steps from: they are still to be redone);
    ``first`` for the first attempt. (Not a time-based fault's recorded step: that is the
    runner's last view of the job, which lags the attempt the fault hit.)"""
    restored = [e["step"] for e in _by_attempt(record.events, attempt, "restore_end")]
    if restored:
        return min(restored)
    earlier = [e["attempt"] for e in record.events
               if e["event"] in STARTS and e["attempt"] < attempt]
    if not earlier:
        return first
    before = max(earlier)
    steps = [e["step"] for e in _by_attempt(record.events, before, "step_end")]
    return max(steps) if steps else _resumed_at(record, before, first)


def _ended_attempt(record: RunRecord, injection: Injection, attempt: int, window_s: float
                   ) -> tuple[bool, str]:
    """Whether ``injection`` ended ``attempt`` (the one running when it was made), with the
    evidence or why not. Caused means: the attempt ended within ``window_s`` of the fault (of
    the link coming back, for ``drop_link``) and the fault's own mark is on the failure:

    - ``kill_rank``, ``crash_during_save``, ``host_down``: the rank (the lowest of the lost
      host's) wrote nothing once the signal had taken effect (``done_t``: a killed process
      cannot; one that did was not killed by it).
    - ``hang_rank``: the rank's supervisor found it hung, or the rank wrote nothing after the
      stop (it was still stopped when the group was torn down). A rank that resumed and
      trained on was not the cause of a later restart.
    - ``drop_link``: the attempt failed in the window (a watchdog that found a rank hung is
      named as the evidence; not one that found a rank a ``hang_rank`` held stopped).

    A stop or a cut without a watchdog's evidence, in an attempt that a kill of another rank
    ended (for a cut, also a stop that a watchdog found), is ``masked``: that fault, not it,
    ended the attempt.

    Supervisors write their own events (``rank_died``, ``hang_detected``) about a rank; only
    the rank's own events count as "it wrote".

    An attempt whose every rank exited normally was ended by nobody; so was the last attempt
    of a job that exited 0, for a stop or a cut (a script reports no exit).
    """
    end = record.attempt_ends.get(attempt)
    if end is None or end < injection.t:
        return False, f"attempt {attempt} did not end after it"
    waited = end - injection.t
    cut_s = (injection.detail.get("duration_s") or 0.0) if injection.kind == "drop_link" else 0.0
    limit = window_s + cut_s
    if waited > limit:
        return False, (f"no restart followed within {limit:.0f} s (attempt {attempt} ended "
                       f"{waited:.1f} s later)")
    ranks = {e["rank"] for e in _by_attempt(record.events, attempt, "start")}
    clean = {e["rank"] for e in _by_attempt(record.events, attempt, "exit") if e.get("code") == 0}
    if ranks and ranks <= clean:
        return False, f"no restart followed: every rank of attempt {attempt} finished normally"
    if injection.kind in ("hang_rank", "drop_link") and record.returncode == 0 and not any(
            e["event"] in STARTS and e["attempt"] > attempt for e in record.events):
        # a stop or a cut the job rode out; a script writes no ``exit`` (nor, without the
        # probe, anything that shows it went on): the job's own exit code says it
        return False, (f"no restart followed: the job finished normally (exit 0) in attempt "
                       f"{attempt}, {waited:.1f} s after the fault")
    events = [e for e in record.events if e["attempt"] == attempt and e["t"] >= injection.t]
    r = injection.rank
    hung = [e for e in events if e["event"] == "hang_detected" and (r is None or e["rank"] == r)
            and (injection.kind != "drop_link" or stopped_by(record, e) is None)]
    # the signal takes effect a moment after it is sent: what the rank wrote before its
    # death (or stop) showed is not a sign that it went on
    took_effect = injection.detail.get("done_t", injection.t)
    wrote = [e for e in events if e["rank"] == r and e.get("by") not in ("supervisor", "chaos")
             and e["t"] >= took_effect]
    killer = None if hung else _killed_by_another(record, injection, attempt, end)
    masked = None if killer is None else (
        f"masked: {killer.kind} of rank {killer.rank} {killer.t - injection.t:+.2f} s from it "
        f"ended attempt {attempt} before any watchdog saw this {injection.kind}")
    if injection.kind == "drop_link":
        if masked:  # a cut shows itself only through a watchdog (or a lease)
            return False, masked
        lost = sorted(e["rank"] for e in events if e["event"] == "rank_died" and e.get("lost")
                      and e["rank"] >= 0 and e["t"] <= end)
        how = (f"rank(s) {lost} declared lost (their supervisors' leases lapsed); " if lost
               else f"rank {hung[0]['rank']}'s supervisor found it hung ({hung[0]['how']}); "
               if hung else "")
        return True, f"{how}attempt {attempt} ended {waited:.2f} s after the cut"
    if injection.kind == "hang_rank" and hung:
        return True, (f"rank {r}'s supervisor found it hung ({hung[0]['how']}, main thread "
                      f"{hung[0].get('thread_state')!r}) {hung[0]['t'] - injection.t:.2f} s "
                      f"after the stop; attempt {attempt} ended {waited:.2f} s after it")
    if wrote:
        return False, (f"no restart followed: rank {r} went on ({wrote[0]['event']} "
                       f"{wrote[0]['t'] - injection.t:.2f} s later), and attempt {attempt} "
                       f"ended {waited:.1f} s after the fault for another reason")
    if masked:  # the stopped rank wrote nothing, but the kill ended the attempt
        return False, masked
    if injection.kind == "host_down":
        return True, (f"node {injection.detail['node']} went down with rank(s) "
                      f"{injection.detail['ranks']}; attempt {attempt} ended {waited:.2f} s "
                      "later")
    what = "stopped" if injection.kind == "hang_rank" else "killed"
    return True, f"rank {r} {what}; attempt {attempt} ended {waited:.2f} s later"


def _killed_by_another(record: RunRecord, injection: Injection, attempt: int, end: float
                       ) -> Injection | None:
    """For a stop or a cut: a kill of another rank, made in the same attempt before it
    ended, which ends it whatever the stop or cut did; for a cut, also a stop (``hang_rank``)
    that a watchdog found in that attempt, and had killed."""
    if injection.kind not in ("hang_rank", "drop_link"):
        return None
    for other in record.injections:
        if other is not injection and other.kind in KILLS \
                and not other.missed and not other.skipped and other.rank != injection.rank \
                and other.t <= end and _struck_attempt(record, other) == attempt:
            return other
    if injection.kind == "drop_link":
        for e in _by_attempt(record.events, attempt, "hang_detected"):
            stop = stopped_by(record, e)
            if stop is not None and e["t"] <= end:
                return stop
    return None


def fault_timings(record: RunRecord, injection: Injection, *, window_s: float = 90.0
                  ) -> FaultTimings:
    """What one fault did. Recovery is measured on the restart the fault caused (see
    ``_ended_attempt``; ``window_s``: ``detection_window_s`` of the scenario); a fault that
    caused none has no recovery, whatever restarts came later."""
    timings = FaultTimings(kind=injection.kind, injected_t=injection.t,
                           injected_step=injection.step, rank=injection.rank,
                           fault_index=injection.fault_index, skipped=injection.skipped,
                           missed=injection.missed,
                           checkpoint_step=injection.detail.get("checkpoint_step"),
                           paused_s=injection.detail.get("paused_s"))
    made = not injection.skipped and not injection.missed
    if injection.kind in STORAGE_FAULTS and made:
        timings.outage = outage_effects(record, injection)
    attempt = _struck_attempt(record, injection)
    # The runner reads event files as they are written, so it fires a step-triggered fault a
    # little after the step; the trainer may be further on. What counts is where the trainer
    # was when the fault hit, and everything the failed attempt finished must be redone.
    done = _by_attempt(record.events, attempt, "step_end")
    timings.injected_step = max((e["step"] for e in done if e["t"] <= injection.t),
                                default=_resumed_at(record, attempt, injection.step))
    timings.times_at_step = len({e["attempt"] for e in record.events
                                 if e["event"] == "step_end" and e["attempt"] <= attempt
                                 and e["step"] == timings.injected_step
                                 and e["t"] <= injection.t})
    if injection.skipped:
        return timings
    if injection.missed:
        timings.effect_observed, timings.effect = False, f"not made: {injection.missed}"
        return timings
    if injection.kind == "corrupt_shard":
        timings.effect_observed, timings.effect = corrupt_effect(record, injection)
        return timings
    if injection.kind == "storage_outage":
        timings.effect_observed, timings.effect = outage_effect(injection)
        return timings
    if injection.kind == "storage_node_down":
        timings.effect_observed, timings.effect = node_down_effect(timings.outage)
        return timings
    if injection.kind == "disk_full":
        timings.effect_observed, timings.effect = disk_full_effect(timings.outage)
        return timings
    if injection.kind == "drop_link" and injection.detail.get("error"):
        timings.effect_observed = False  # the verdict fails, naming why
        timings.effect = (f"the link was never restored, so the job could not heal: "
                          f"{injection.detail['error']}")
        return timings
    caused, timings.effect = _ended_attempt(record, injection, attempt, window_s)
    timings.effect_observed = caused
    if not caused:
        if injection.kind == "drop_link":
            timings.effect_observed, timings.effect = link_noticed(record, injection,
                                                                    timings.effect)
        return timings
    timings.ended_attempt = attempt
    _recovery(record, injection, attempt, done, timings, window_s)
    if injection.kind == "crash_during_save":
        missed = crash_effect(record, injection, attempt, timings.restored_step)
        if missed is not None:
            timings.effect_observed, timings.effect = missed
    return timings


def _recovery(record: RunRecord, injection: Injection, attempt: int,
              done: list[dict[str, Any]], timings: FaultTimings, window_s: float) -> None:
    """Detect, restart, restore and recompute of the attempt that started after ``attempt``,
    which the fault ended; left None when the job never came back (a failed verdict).

    A command trainer that reports nothing (no probe, no engine events): detect and restart
    only, from its processes; the rest is ``unmeasured``. One whose engine reports restores
    but that reports no steps: restore too. One that reports steps but no restore: the step
    it resumed from is the one before its first step, and recovery is measured end to end."""
    # the next attempt that started: in process, a generation published for the re-formation
    # fails before its members meet when another death is found meanwhile, and writes nothing
    nxt = min((e["attempt"] for e in record.events
               if e["event"] in STARTS and e["attempt"] > attempt), default=attempt + 1)
    starts = _by_attempt(record.events, nxt, "start")
    reported = bool(starts)
    if not starts:
        starts = _by_attempt(record.events, nxt, "worker_started")
    if attempt not in record.attempt_ends or not starts:
        return
    torn_down = record.attempt_ends[attempt]
    started = max(e["t"] for e in starts)
    timings.recovery_mode = ("in_process" if any(e.get("cause") == "in_process" for e in starts)
                             else "restart")
    # a survivor that found too few spares, or a dead rank's supervisor that found no survivor
    gave_up = [e for e in _by_attempt(record.events, attempt, "exit")
               if e.get("code") == RESTART_EXIT_CODE]
    gave_up += _by_attempt(record.events, attempt, "fallback")
    if timings.recovery_mode == "restart" and gave_up:
        timings.fallback = str(gave_up[0].get("error"))
    timings.detect_s = max(torn_down - injection.t, 0.0)
    timings.restart_s = max(started - torn_down, 0.0)
    # what can cut this recovery short: a later fault made during the next attempt that
    # ended it (a fault on the job; one on storage ends it through the saves it fails, and
    # fails the verdict when it does: one the attempt trained on through did not), not one
    # that was missed or damaged a checkpoint
    later = [i.t for i in record.injections if i.t > injection.t and not i.skipped
             and not i.missed and i.kind != "corrupt_shard"
             and started - 0.5 <= i.t <= record.attempt_ends.get(nxt, record.ended_t)
             and (not outage_effects(record, i)["training_continued"]
                  if i.kind in STORAGE_FAULTS else _ended_attempt(record, i, nxt, window_s)[0])]
    if not reported:
        if later and any(e["event"] == "start" for e in record.events):
            # a script that reports, whose next attempt a later fault ended before its ranks'
            # first report (still starting up): cut short, not unmeasurable
            timings.interrupted_by_t = min(later)
            return
        timings.unmeasured = ("restore, recompute, recovery and lost steps: the script "
                              "reported nothing (it does not call antifragile.probe); restart "
                              "is measured to when its processes started")
        return
    restores = _by_attempt(record.events, nxt, "restore_end")
    if any("storage_bytes" in e for e in restores):
        timings.restore_memory_bytes = sum(e.get("memory_bytes", 0) for e in restores)
        timings.restore_storage_bytes = sum(e.get("storage_bytes", 0) for e in restores)
    # probe.restored as the process's first report: when the restore began is not known
    untimed = bool(restores) and all(e.get("seconds", 0.0) is None for e in restores)
    # the restore begins when the last rank begins it: what comes before (building the model,
    # opening storage) is the attempt getting back up, as the timeline draws it, not restore
    begun = [e["t"] for e in _by_attempt(record.events, nxt, "restore_begin")]
    ready = (min(max([started, *begun]), max(e["t"] for e in restores))
             if restores and begun and not untimed else started)
    timings.restart_s = max(ready - torn_down, 0.0)
    if not any(e["event"] == "step_end" for e in record.events):  # the engine's events only
        if restores:
            timings.restored_step = min(e["step"] for e in restores)
        if restores and not untimed:
            timings.restore_s = max(max(e["t"] for e in restores) - ready, 0.0)
        timings.unmeasured = ("recompute, recovery and lost steps: the script reported no "
                              "step (it does not call antifragile.probe.step_end)"
                              + ("; restore: probe.restored was its first report, so when its "
                                 "restore began is unknown" if untimed else ""))
        return
    stepped = _by_attempt(record.events, nxt, "step_end")
    timings.retrained_to_step = max((e["step"] for e in stepped), default=None)
    restored: float | None = max((e["t"] for e in restores), default=started)
    restored_step: int | None = min((e["step"] for e in restores), default=None)
    if not restores and stepped:  # no checkpoint to restore (step 0), or one it did not report
        restored_step = min(e["step"] for e in stepped) - 1
        if restored_step > 0:
            restored = None
            timings.unmeasured = ("restore and recompute apart: the script reported no "
                                  "restore (load through CheckpointEngine or probe.dcp_load, or "
                                  "call probe.restored); recovery is measured end to end")
    elif untimed:
        restored = None
        timings.unmeasured = ("restore and recompute apart: probe.restored was the script's "
                              "first report, so when its restore began is unknown; recovery "
                              "is measured end to end")
    injected = max((e["step"] for e in done), default=timings.injected_step or 0)
    # back at the fault's step when every rank is through it again (as restart and restore
    # end with the last rank): each rank's first step there, the last of them (ranks a later
    # fault stopped before it, or that report no steps, are not waited for)
    firsts: dict[int, float] = {}
    for e in stepped:
        if e["step"] >= injected:
            firsts[e["rank"]] = min(e["t"], firsts.get(e["rank"], e["t"]))
    caught_up = [max(firsts.values())] if firsts else []
    if not caught_up and later:  # a later fault cut this recovery short
        timings.interrupted_by_t = min(later)
    if restored_step is None:
        return  # never restored (the job did not come back, or a later fault hit first)
    timings.restored_step = restored_step
    # also where no restore was reported: a script that ignored its checkpoints and started
    # over (deterministic, it ends bit-identical) resumed before what had committed
    timings.restorable_step = _restorable(record, injection.t, restored)
    timings.lost_steps = max(injected - restored_step, 0)
    if restored_step >= injected:  # restored at or past the fault's step: nothing to redo
        caught_up = [restored if restored is not None else started]
    # chaos's holds at pause points on the way back (a later pass's fault due there) are the
    # test's time, not the job's: left out, as goodput leaves them out of the wall time
    spans = holds([e for e in record.events if e["attempt"] == nxt])

    def held(start: float, end: float) -> float:
        return sum(max(min(end, b) - max(start, a), 0.0) for a, b in spans)

    if restored is None:
        if caught_up:
            back = min(caught_up)
            timings.recovery_s = max(back - injection.t - held(injection.t, back), 0.0)
        return
    timings.restore_s = max(restored - ready, 0.0)
    if caught_up:
        back = min(caught_up)
        timings.recompute_s = max(back - restored - held(restored, back), 0.0)
        timings.recovery_s = (timings.detect_s + timings.restart_s + timings.restore_s
                              + timings.recompute_s)


def _restorable(record: RunRecord, fault_t: float, restored_t: float | None) -> int | None:
    """The newest step any rank had reported committed by ``fault_t`` (in any attempt) that no
    restore skipped after that commit, up to ``restored_t``; None when none had. (A skip
    excuses only the commit it read: the same step committed again later is restorable.) A
    commit of an older step (a script that rolled back in process) supersedes the newer ones
    committed before it: the engine hides them (at the first save after the rollback's
    load), and a restart resumes from the older one."""
    skipped = [(restore_skipped_step(e), e["t"]) for e in record.events
               if e["event"] == "restore_skipped" and (restored_t is None or e["t"] <= restored_t)]
    committed: dict[int, float] = {}
    for e in sorted((e for e in record.events if e["event"] == "ckpt_committed"
                     and e["t"] <= fault_t), key=lambda e: e["t"]):
        committed = {step: t for step, t in committed.items() if step <= e["step"]}
        committed[e["step"]] = e["t"]
    return max((step for step, committed_t in committed.items()
                if not any(s == step and t >= committed_t for s, t in skipped)), default=None)


def not_measured(record: RunRecord, timings: list[FaultTimings]) -> list[str]:
    """What this run's events cannot tell, each with why; empty when the trainer reported
    everything (the built-in trainer always does). Said, never estimated."""
    seen = {e["event"] for e in record.events}
    out = []
    if "step_end" not in seen:
        out.append("step times, losses and goodput: the script reported no step (call "
                   "antifragile.probe.step_end)")
    if "start" not in seen and "worker_started" in seen:
        out.append("where the script was when a fault hit: it never called antifragile.probe, "
                   "so faults were aimed at the processes torchrun started (found in /proc)")
    if not seen & {"ckpt_staged", "ckpt_committed", "ckpt_failed"}:
        out.append("checkpoint stall, persist time and size: no checkpoint events (checkpoint "
                   "through antifragile.engine.CheckpointEngine, or probe.dcp_save)")
    out += sorted({f"{t.kind}: {t.unmeasured}" for t in timings if t.unmeasured})
    return out


def as_dicts(timings: list[FaultTimings]) -> list[dict[str, Any]]:
    return [asdict(t) for t in timings]
