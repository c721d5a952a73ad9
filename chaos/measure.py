"""Measurements (DESIGN 4.3), built only from the trainer's events and the injection log."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from chaos.faults import Injection
from chaos.runner import RunRecord

_FAILURES = {"kill_rank", "hang_rank", "crash_during_save"}


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
    if injection.skipped or injection.kind not in _FAILURES:
        return timings
    attempt = _attempt_at(record, injection.t)
    nxt = attempt + 1
    starts = _by_attempt(record.events, nxt, "start")
    if attempt not in record.attempt_ends or not starts:
        return timings  # the job never came back: recovery stays unmeasured (a failed verdict)
    torn_down = record.attempt_ends[attempt]
    started = max(e["t"] for e in starts)
    restores = _by_attempt(record.events, nxt, "restore_end")
    restored = max((e["t"] for e in restores), default=started)
    restored_step = min((e["step"] for e in restores), default=0)
    injected = injection.step or restored_step
    caught_up = [e["t"] for e in _by_attempt(record.events, nxt, "step_end")
                 if e["step"] >= injected]
    timings.detect_s = max(torn_down - injection.t, 0.0)
    timings.restart_s = max(started - torn_down, 0.0)
    timings.restore_s = max(restored - started, 0.0)
    timings.restored_step = restored_step
    timings.lost_steps = max(injected - restored_step, 0)
    if caught_up:
        timings.recompute_s = max(min(caught_up) - restored, 0.0)
        timings.recovery_s = (timings.detect_s + timings.restart_s + timings.restore_s
                              + timings.recompute_s)
    return timings


def checkpoints(record: RunRecord) -> list[dict[str, Any]]:
    """Per checkpoint: stall (slowest rank), persist (slowest rank), bytes, throughput."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for e in record.events:
        key = (e["attempt"], e.get("step", -1))
        if e["event"] == "ckpt_staged":
            c = out.setdefault(key, {"step": e["step"], "attempt": e["attempt"], "stall_s": 0.0,
                                     "persist_s": None, "bytes": None, "committed": False})
            c["stall_s"] = max(c["stall_s"], e["stall_s"])
        elif e["event"] == "ckpt_committed" and key in out:
            c = out[key]
            c["committed"] = True
            c["persist_s"] = max(c["persist_s"] or 0.0, e["persist_s"])
            c["bytes"] = max(c["bytes"] or 0, e["bytes"])
        elif e["event"] == "ckpt_failed" and key in out:
            out[key]["error"] = e.get("error")
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
