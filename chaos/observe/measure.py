"""Measurements (DESIGN 4.3), built only from the trainer's events and the injection log."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from antifragile.chaos.faults import Injection
from antifragile.chaos.observe.record import RunRecord

_FAILURES = {"kill_rank", "hang_rank", "crash_during_save", "drop_link"}
# Faults on storage (not on the job): what they did is measured by outage_effects, and which of
# their injection's detail fields the report keeps.
STORAGE_FAULTS: dict[str, tuple[str, ...]] = {
    "storage_outage": ("mode", "duration_s", "latency_s", "requests_faulted",
                       "connections_passed", "requests_delayed"),
    "storage_node_down": ("mode", "duration_s", "server", "pid", "restarted_pid", "error"),
}


@dataclass(slots=True)
class FaultTimings:
    kind: str
    injected_t: float
    injected_step: int | None
    rank: int | None
    skipped: str | None = None
    checkpoint_step: int | None = None
    detect_s: float | None = None
    restart_s: float | None = None
    restore_s: float | None = None
    recompute_s: float | None = None
    recovery_s: float | None = None
    restored_step: int | None = None
    lost_steps: int | None = None
    outage: dict[str, Any] | None = None  # a storage fault: what it did (see outage_effects)


def _by_attempt(events: list[dict[str, Any]], attempt: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["attempt"] == attempt and e["event"] == kind]


def _attempt_at(record: RunRecord, t: float) -> int:
    """The attempt that was running at time ``t``."""
    starts = sorted({e["attempt"]: e["t"] for e in reversed(record.events)
                     if e["event"] == "start"}.items())
    current = 0
    for attempt, start_t in starts:
        if start_t <= t:
            current = attempt
    return current


def fault_timings(record: RunRecord, injection: Injection) -> FaultTimings:
    timings = FaultTimings(kind=injection.kind, injected_t=injection.t,
                           injected_step=injection.step, rank=injection.rank,
                           skipped=injection.skipped,
                           checkpoint_step=injection.detail.get("checkpoint_step"))
    if injection.kind in STORAGE_FAULTS and not injection.skipped:
        timings.outage = outage_effects(record, injection)
    attempt = _attempt_at(record, injection.t)
    # The runner reads event files as they are written, so it fires a step-triggered fault a
    # little after the step; the trainer may be further on. What counts is where the trainer
    # was when the fault hit, and everything the failed attempt finished must be redone.
    done = _by_attempt(record.events, attempt, "step_end")
    timings.injected_step = max((e["step"] for e in done if e["t"] <= injection.t),
                                default=injection.step)
    if injection.skipped or injection.kind not in _FAILURES:
        return timings
    nxt = attempt + 1
    starts = _by_attempt(record.events, nxt, "start")
    if attempt not in record.attempt_ends or not starts:
        return timings  # the job never came back: recovery stays unmeasured (a failed verdict)
    torn_down = record.attempt_ends[attempt]
    started = max(e["t"] for e in starts)
    restores = _by_attempt(record.events, nxt, "restore_end")
    restored = max((e["t"] for e in restores), default=started)
    restored_step = min((e["step"] for e in restores), default=0)
    injected = max((e["step"] for e in done), default=timings.injected_step or restored_step)
    caught_up = [e["t"] for e in _by_attempt(record.events, nxt, "step_end")
                 if e["step"] >= injected]
    timings.detect_s = max(torn_down - injection.t, 0.0)
    timings.restart_s = max(started - torn_down, 0.0)
    timings.restore_s = max(restored - started, 0.0)
    timings.restored_step = restored_step
    timings.lost_steps = max(injected - restored_step, 0)
    if restored_step >= injected:  # restored at or past the fault's step: nothing to redo
        caught_up = [restored]
    if caught_up:
        timings.recompute_s = max(min(caught_up) - restored, 0.0)
        timings.recovery_s = (timings.detect_s + timings.restart_s + timings.restore_s
                              + timings.recompute_s)
    return timings


def _save_lifecycles(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (attempt, step) save: when it was staged (first rank), when it committed (staged +
    slowest rank's persist_s: the committed event itself only comes at the next poll), or the
    failure the trainer reported (a save skipped while another persisted has no staging)."""
    saves: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        if e["event"] not in ("ckpt_staged", "ckpt_committed", "ckpt_failed"):
            continue
        c = saves.setdefault((e["attempt"], e["step"]), {
            "step": e["step"], "attempt": e["attempt"], "staged_t": None, "stall_s": 0.0,
            "persist_s": None, "committed": False, "failed_t": None, "error": None})
        if e["event"] == "ckpt_staged":
            c["staged_t"] = min(c["staged_t"] or e["t"], e["t"])
            c["stall_s"] = max(c["stall_s"], e["stall_s"])
        elif e["event"] == "ckpt_committed":
            c["committed"] = True
            c["persist_s"] = max(c["persist_s"] or 0.0, e["persist_s"])
        else:
            c["failed_t"] = min(c["failed_t"] or e["t"], e["t"])
            c["error"] = c["error"] or e.get("error")
    return sorted(saves.values(), key=lambda c: (c["attempt"], c["step"]))


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else None


def outage_effects(record: RunRecord, injection: Injection) -> dict[str, Any]:
    """What a storage outage (or a storage node down) did: the saves in flight during it
    (delayed if they committed, else failed or skipped), the extra time the training loop lost,
    whether training kept going, and the first save that committed after it (recovery). The
    loop's pace is the gap between rank 0's consecutive steps; the extra stall is
    what the gaps overlapping the outage took beyond the median gap outside it."""
    d = injection.detail
    t0 = injection.t
    t1 = d.get("ended_t") or t0 + d["duration_s"]
    saves = _save_lifecycles(record.events)
    affected, clean_persist = [], []
    for c in saves:
        end_t = (c["staged_t"] + c["persist_s"]) if c["committed"] else c["failed_t"]
        began = c["staged_t"] if c["staged_t"] is not None else c["failed_t"]
        if began is not None and began <= t1 and (end_t is None or end_t >= t0):
            affected.append(c)
        elif c["committed"]:
            clean_persist.append(c["persist_s"])
    baseline_persist_s = _median(clean_persist)
    rows = []
    for c in affected:
        error = c["error"] or ""
        outcome = "committed" if c["committed"] else (
            "skipped" if "still persisting" in error else "failed" if c["failed_t"] else "lost")
        delay = (c["persist_s"] - baseline_persist_s
                 if c["committed"] and baseline_persist_s is not None else None)
        rows.append({"step": c["step"], "attempt": c["attempt"], "outcome": outcome,
                     "persist_s": c["persist_s"], "delay_s": delay, "error": c["error"]})
    steps = sorted((e["t"], e["attempt"]) for e in record.events
                   if e["event"] == "step_end" and e["rank"] == 0)
    during: list[float] = []
    outside: list[float] = []
    for (prev_t, prev_a), (t, a) in itertools.pairwise(steps):
        if a == prev_a:
            (during if prev_t <= t1 and t >= t0 else outside).append(t - prev_t)
    pace_s = _median(outside)
    attempt = _attempt_at(record, t0)
    restarted = any(e["event"] == "start" and e["attempt"] > attempt and t0 <= e["t"] <= t1
                    for e in record.events)
    steps_during = sum(1 for t, a in steps if t0 <= t <= t1 and a == attempt)
    later = [c["step"] for c in saves if c["committed"] and c["staged_t"] is not None
             and c["staged_t"] > t1]
    return {
        **{k: d.get(k) for k in STORAGE_FAULTS.get(injection.kind,
                                                    STORAGE_FAULTS["storage_outage"])},
        "outage_s": (d["ended_t"] - t0) if d.get("ended_t") else None,
        "checkpoints": rows,
        "checkpoints_failed": [r["step"] for r in rows if r["outcome"] in ("failed", "lost")],
        "checkpoints_skipped": [r["step"] for r in rows if r["outcome"] == "skipped"],
        "checkpoints_delayed": [r["step"] for r in rows if r["outcome"] == "committed"],
        "baseline_persist_s": baseline_persist_s,
        "first_commit_after_step": later[0] if later else None,
        "extra_stall_s": sum(max(g - pace_s, 0.0) for g in during) if pace_s else None,
        "step_pace_s": pace_s,
        "steps_during_outage": steps_during,
        "training_continued": steps_during > 0 and not restarted,
    }


def checkpoints(record: RunRecord) -> list[dict[str, Any]]:
    """Per checkpoint: stall (slowest rank: staging, plus the write itself when the loop waited
    for it), persist (slowest rank), bytes, throughput. A save refused before staging (the
    previous one still persisting) is listed too: uncommitted, ``stall_s`` None, its error."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    stalls: dict[tuple[int, int], dict[int, float]] = {}  # checkpoint -> rank -> seconds

    def entry(e: dict[str, Any]) -> dict[str, Any]:
        return out.setdefault((e["attempt"], e["step"]), {
            "step": e["step"], "attempt": e["attempt"], "stall_s": None, "persist_s": None,
            "bytes": None, "committed": False})

    for e in record.events:
        if e["event"] not in ("ckpt_staged", "ckpt_blocked", "ckpt_committed", "ckpt_failed"):
            continue
        key, c = (e["attempt"], e["step"]), entry(e)
        if e["event"] in ("ckpt_staged", "ckpt_blocked"):
            per_rank = stalls.setdefault(key, {})
            seconds = e["stall_s"] if e["event"] == "ckpt_staged" else e["seconds"]
            per_rank[e["rank"]] = per_rank.get(e["rank"], 0.0) + seconds
            c["stall_s"] = max(per_rank.values())
        elif e["event"] == "ckpt_committed":
            c["committed"] = True
            c["persist_s"] = max(c["persist_s"] or 0.0, e["persist_s"])
            c["bytes"] = max(c["bytes"] or 0, e["bytes"])
        else:
            c.setdefault("error", e.get("error"))
    for c in out.values():
        if c["committed"] and c["persist_s"]:
            c["throughput_gib_s"] = c["bytes"] / c["persist_s"] / 2**30
    return sorted(out.values(), key=lambda c: (c["attempt"], c["step"]))


def goodput(record: RunRecord) -> float:
    """Time of the steps that count (each step's final execution, slowest rank) / wall time."""
    final: dict[int, tuple[int, float]] = {}
    for e in record.events:
        if e["event"] == "step_end":
            attempt, seconds = final.get(e["step"], (-1, 0.0))
            if e["attempt"] > attempt:
                final[e["step"]] = (e["attempt"], e["seconds"])
            elif e["attempt"] == attempt:
                final[e["step"]] = (attempt, max(seconds, e["seconds"]))
    useful = sum(s for _, s in final.values())
    return useful / record.wall_s if record.wall_s > 0 else 0.0


def losses(record: RunRecord) -> list[dict[str, Any]]:
    return [{"step": e["step"], "attempt": e["attempt"], "loss": e["loss"], "t": e["t"]}
            for e in record.events if e["event"] == "step_end" and e["loss"] is not None]


def as_dicts(timings: list[FaultTimings]) -> list[dict[str, Any]]:
    return [asdict(t) for t in timings]
