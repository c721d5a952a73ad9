"""What a fault observably did, beside the recovery it caused (``measure``): the evidence a
corrupted shard, a storage outage, a volume server down, a cut link or a crash during a save
left in the events, or why there is none (then the verdict fails).

Storage faults hit storage, not the job: :func:`outage_effects` measures the saves in flight
during them, the loop's extra stall and whether training went on.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from antifragile.chaos.faults import Injection
from antifragile.chaos.observe.record import STARTS, RunRecord

# Faults on storage (not on the job): what they did is measured by outage_effects, and which of
# their injection's detail fields the report keeps.
STORAGE_FAULTS: dict[str, tuple[str, ...]] = {
    "storage_outage": ("mode", "duration_s", "latency_s", "requests_faulted",
                       "connections_passed", "requests_delayed"),
    "storage_node_down": ("mode", "duration_s", "server", "pid", "restarted_pid", "error"),
    "disk_full": ("duration_s", "volume_mib", "filled_bytes", "error"),
}


def stopped_by(record: RunRecord, hang_detected: dict[str, Any]) -> Injection | None:
    """The ``hang_rank`` that held the rank a watchdog found hung when it found it: that
    finding is the stop's evidence, not a cut link's."""
    for i in record.injections:
        held_s = i.detail.get("duration_s") or float("inf")
        if i.kind == "hang_rank" and not i.skipped and not i.missed \
                and i.rank == hang_detected["rank"] \
                and i.t <= hang_detected["t"] <= i.t + held_s:
            return i
    return None


def link_noticed(record: RunRecord, injection: Injection, why_not: str) -> tuple[bool, str]:
    """A cut that ended no attempt is still observed if a watchdog found a rank hung while
    the link was down (the job noticed, and got through); a rank that a ``hang_rank`` had
    stopped is not one the cut hung."""
    up_t = injection.t + (injection.detail.get("duration_s") or 0.0)
    for e in record.events:
        if e["event"] == "hang_detected" and injection.t <= e["t"] <= up_t \
                and stopped_by(record, e) is None:
            return True, (f"rank {e['rank']}'s supervisor found it hung ({e['how']}) while the "
                          "link was down; the job went on without a restart")
    return False, (f"the cut was not observed: no watchdog found a rank hung while the link "
                   f"was down, and {why_not}")


def restore_skipped_step(event: dict[str, Any]) -> int | None:
    """The checkpoint step a ``restore_skipped`` event names: its ``step`` field, else the first
    step its reason names (every backend's reads ``checkpoint step N skipped, trying ...``)."""
    if isinstance(event.get("step"), int):
        return int(event["step"])
    found = re.search(r"\bstep (\d+)", event.get("reason") or "")
    return int(found.group(1)) if found else None


def corrupt_effect(record: RunRecord, injection: Injection) -> tuple[bool, str]:
    """The engine noticed the damage: the first restore after it that read the damaged step
    skipped it. A restore that loaded it (no complaint; a later skip of that step is another
    fault's or reason's) or none that read it means the damage had no observable effect: the
    run proves nothing about it."""
    damaged = injection.detail.get("checkpoint_step")
    for e in sorted((e for e in record.events if e["t"] >= injection.t), key=lambda e: e["t"]):
        if e["event"] == "restore_skipped" and restore_skipped_step(e) == damaged:
            return True, (f"attempt {e['attempt']}'s restore skipped the damaged step "
                          f"{damaged}: {e.get('reason')}")
        if e["event"] == "restore_end" and e.get("step") == damaged:
            return False, (f"attempt {e['attempt']} restored the damaged step {damaged} "
                           "without noticing the damage")
    return False, (f"no restore read the damaged step {damaged} (no restart followed, or a "
                   "newer step was restored)")


def outage_effect(injection: Injection) -> tuple[bool, str]:
    d = injection.detail
    if d.get("requests_faulted") is None:
        return False, ("the outage had not ended when the run did: the proxy's counts were "
                       "never taken")
    faulted, delayed = d["requests_faulted"], d.get("requests_delayed") or 0
    if faulted + delayed == 0:
        return False, f"no request reached the proxy during the {d['duration_s']:g} s outage"
    return True, (f"{faulted} requests faulted ({d['mode']}), {delayed} requests delayed "
                  "during the outage")


def node_down_effect(outage: dict[str, Any] | None) -> tuple[bool, str]:
    """A volume server down matters if saves ran while it was: they committed late, failed
    or were skipped (retried or not); a down window no save touched proved nothing, and one
    that had not ended when the run did never showed the server coming back."""
    if outage is None:
        return False, "the volume server's down window was never measured"
    if outage.get("error"):
        return False, f"the volume server did not come back: {outage['error']}"
    if outage.get("outage_s") is None:  # its end had not come: never seen back
        return False, (f"the volume server was still down when the run ended (a "
                       f"{outage.get('duration_s')} s down window): it was never seen to "
                       "come back")
    rows = outage.get("checkpoints") or []
    if not rows:
        return False, (f"no save ran while the volume server was down for "
                       f"{outage.get('duration_s')} s")
    outcomes = ", ".join(f"step {r['step']} {r['outcome']}" for r in rows)
    return True, f"{len(rows)} save(s) in flight while the volume server was down: {outcomes}"


def disk_full_effect(outage: dict[str, Any] | None) -> tuple[bool, str]:
    """A full disk matters if a save ran into it: one failed for want of space. Saves that all
    committed meanwhile (the fill lost the race) or none at all proved nothing, and a disk
    still full when the run ended never showed the job saving again."""
    if outage is None:
        return False, "the full disk's window was never measured"
    if outage.get("error"):
        return False, f"the disk was never filled: {outage['error']}"
    if outage.get("outage_s") is None:
        return False, (f"the disk was still full when the run ended (a "
                       f"{outage.get('duration_s')} s fill): it never had space again")
    rows = outage.get("checkpoints") or []
    if not rows:
        return False, f"no save ran while the disk was full for {outage.get('duration_s')} s"
    full = [r for r in rows if "No space left" in (r.get("error") or "")]
    outcomes = ", ".join(f"step {r['step']} {r['outcome']}" for r in rows)
    if not full:
        return False, (f"no save failed for want of space while the disk was full "
                       f"({outcomes})")
    return True, (f"{len(full)} save(s) refused for want of space (ENOSPC) while the disk "
                  f"was full: {outcomes}")


def crash_effect(record: RunRecord, injection: Injection, attempt: int,
                  restored_step: int | None) -> tuple[bool, str] | None:
    """Why a ``crash_during_save`` that ended its attempt did not crash during the save:
    COMMIT was already there, or the step committed after all (whole, or torn: a later restore
    skipped it, which only a committed step can be). None: it did, and nothing of it
    committed."""
    step = injection.detail.get("checkpoint_step")
    if injection.detail.get("committed_before_kill"):
        return False, (f"COMMIT of step {step} was already written when rank {injection.rank} "
                       "was killed: the save won the race, no crash during it happened")
    # until the step is saved again (a restart that resumed before it): a skip after that
    # is of the new save
    resaved_t = min((e["t"] for e in record.events if e["event"] == "ckpt_committed"
                     and e["step"] == step and e["t"] >= injection.t), default=float("inf"))
    for e in record.events:
        if e["event"] == "restore_skipped" and injection.t <= e["t"] < resaved_t \
                and restore_skipped_step(e) == step:
            return False, (f"step {step} committed torn: rank {injection.rank} was killed "
                           f"saving it, yet attempt {e['attempt']}'s restore found it committed "
                           f"and skipped it ({e.get('reason')})")
    committed = any(e["event"] == "ckpt_committed" and e["attempt"] == attempt
                    and e["step"] == step for e in record.events)
    if committed or (restored_step is not None and restored_step == step):
        return False, (f"step {step} committed after the kill (rank {injection.rank}'s part "
                       "was already written): no torn checkpoint was left")
    return None


def _save_lifecycles(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (attempt, step) save: when it was staged (first rank), when it committed (staged +
    slowest rank's persist_s, not the committed event's time: an older trainer wrote that at its
    next poll), or the failure the trainer reported (a save skipped while another persisted has
    no staging)."""
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


def holds(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The times some rank was held at a pause point (``resumed``'s ``held_s`` back from it),
    overlapping holds merged."""
    spans = sorted((e["t"] - (e.get("held_s") or 0.0), e["t"]) for e in events
                   if e["event"] == "resumed")
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def outage_effects(record: RunRecord, injection: Injection) -> dict[str, Any]:
    """What a storage outage (or a storage node down) did: the saves in flight during it
    (delayed if they committed, else failed or skipped), the extra time the training loop lost,
    whether training kept going, and the first save that committed after it (recovery). The
    loop's pace is the gap between rank 0's consecutive steps; the extra stall is
    what the gaps overlapping the outage took beyond the median gap outside it (chaos's holds
    at pause points left out of both). Training went on
    if rank 0 ended a step during the outage (``steps_during_outage``), or, for an outage
    shorter than two steps at that pace, within two steps' time from its start (no step may
    end inside a shorter one), and the fault did not end its attempt. A script that reports
    no step: ``steps_during_outage`` None, and training went on unless the fault ended its
    attempt."""
    d = injection.detail
    t0 = injection.t
    t1 = d.get("ended_t") or t0 + d["duration_s"]
    saves = _save_lifecycles(record.events)
    affected, clean_persist = [], []
    for c in saves:
        # a save that neither committed nor failed was lost with its attempt (torn down)
        end_t = ((c["staged_t"] + c["persist_s"]) if c["committed"] else c["failed_t"]
                 or record.attempt_ends.get(c["attempt"]))
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
    spans = holds(record.events)
    during: list[float] = []
    outside: list[float] = []
    for (prev_t, prev_a), (t, a) in itertools.pairwise(steps):
        if a == prev_a:
            # chaos's holds at pause points (the outage's own, made while held) are not the
            # loop's: left out of the gaps, as goodput leaves them out of the wall time
            held = sum(max(min(t, end) - max(prev_t, start), 0.0) for start, end in spans)
            (during if prev_t <= t1 and t >= t0 else outside).append(t - prev_t - held)
    pace_s = _median(outside)
    attempt = record.attempt_at(t0)
    # The attempt the fault struck went on if it committed a save after the fault or ran to
    # the end, or a fault on the job (a kill) ended it. Else the storage fault did, even where
    # the restart came after the window (a script whose next save() raised the failed one's
    # error crashed a few steps later; torchrun took seconds to start it again). A damaged
    # checkpoint on storage ends no attempt: it excuses nothing.
    next_t = min((e["t"] for e in record.events
                  if e["event"] in STARTS and e["attempt"] > attempt), default=None)
    ended_by_it = next_t is not None and not any(
        c["committed"] and c["attempt"] == attempt and c["staged_t"] is not None
        and c["staged_t"] > t1 for c in saves) and not any(
        i.kind not in STORAGE_FAULTS and i.kind != "corrupt_shard" and not i.skipped
        and not i.missed and t0 <= i.t <= next_t for i in record.injections)
    # a script that reports no step (no probe): only a restart says training did not go on
    judged_to = max(t1, t0 + 2 * pace_s) if pace_s else t1
    steps_during = sum(1 for t, a in steps if t0 <= t <= judged_to and a == attempt) \
        if any(e["event"] == "step_end" for e in record.events) else None
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
        "training_continued": steps_during != 0 and not ended_by_it,
    }
