"""Run-wide figures (DESIGN 4.3), from the trainer's events: each checkpoint's stall, persist
and cost to the training loop, goodput, the warm spares' fate, the losses. What each fault did
is ``measure``'s."""

from __future__ import annotations

from typing import Any

from antifragile.chaos.observe.record import RunRecord


def checkpoints(record: RunRecord) -> list[dict[str, Any]]:
    """Per checkpoint: stall (slowest rank: staging, plus the write itself when the loop waited
    for it), persist (slowest rank), bytes, throughput, and ``slowdown_s``: how much longer
    than the attempt's median the steps were while it persisted (the persist's threads take
    cores and the GIL from training: a cost the stall does not show; the time a hang held the
    job is not the persist's). A save refused before
    staging (the previous one still persisting) is listed too: uncommitted, ``stall_s`` None,
    its error. A save with neither a committed nor a failed event whose step a later attempt
    restored did commit (its processes ended before they saw the COMMIT): committed, with
    ``restored_by`` that attempt and its persist time unknown. ``final``: the blocking (or
    synchronous) save after the last attempt's last step (its stall is its persist: the job's
    shutdown, not a stall of training); of a script that reports no step, its last attempt's
    newest save."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    stalls: dict[tuple[int, int], dict[int, float]] = {}  # checkpoint -> rank -> seconds
    windows = persist_windows(record)
    blocked: set[tuple[int, int]] = set()

    def entry(e: dict[str, Any]) -> dict[str, Any]:
        return out.setdefault((e["attempt"], e["step"]), {
            "step": e["step"], "attempt": e["attempt"], "stall_s": None, "persist_s": None,
            "bytes": None, "committed": False})

    for e in record.events:
        if e["event"] not in ("ckpt_staged", "ckpt_blocked", "ckpt_committed", "ckpt_failed"):
            continue
        key, c = (e["attempt"], e["step"]), entry(e)
        if e["event"] in ("ckpt_staged", "ckpt_blocked"):
            if e["event"] == "ckpt_blocked":
                blocked.add(key)
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
    restores = sorted({(e["attempt"], e["step"]) for e in record.events
                       if e["event"] == "restore_end" and e.get("step") is not None})
    for (attempt, step), c in sorted(out.items(), reverse=True):  # a step's last save first
        by = next((a for a, s in restores if s == step and a > attempt), None)
        if by is not None and not c["committed"] and "error" not in c and not any(
                a > attempt and s == step and out[(a, s)]["committed"] for a, s in out):
            c["committed"], c["restored_by"] = True, by
    steps = _slowest_steps(record)
    paces = {a: _median(sorted(s for _, s in v)) for a, v in steps.items() if v}
    # by step, not time: the ranks' events of one moment differ by milliseconds; a script
    # that reports no step (no probe): its last attempt's newest save is its loop's last
    ends = [(e["attempt"], e["step"]) for e in record.events if e["event"] == "step_end"]
    if not ends and record.events:
        last = max(e["attempt"] for e in record.events)
        ends = [key for key in out if key[0] == last]
    # a synchronous save (``probe.dcp_save``: one time, reported as stall and as persist)
    # blocked the loop to its commit as well
    blocked |= {key for key, c in out.items() if c["committed"] and c["persist_s"] is not None
                and c["stall_s"] is not None and c["stall_s"] >= c["persist_s"]}
    if ends:
        last_attempt, last_step = max(ends)
        for attempt, step in blocked:
            if attempt == last_attempt and step >= last_step:
                out[(attempt, step)]["final"] = True
    for (attempt, _), c in out.items():
        if c["committed"] and c["persist_s"]:
            c["throughput_gib_s"] = c["bytes"] / c["persist_s"] / 2**30
        span = windows.get((attempt, c["step"]))
        if c["committed"] and c["persist_s"] and span and attempt in paces:
            start, end = span
            c["slowdown_s"] = sum(max(seconds - paces[attempt], 0.0)
                                  for t, seconds in steps[attempt]
                                  if t > start and t - seconds < end)
    return sorted(out.values(), key=lambda c: (c["attempt"], c["step"]))


def persist_windows(record: RunRecord) -> dict[tuple[int, int], tuple[float, float]]:
    """Per checkpoint (attempt, step): from its first staging (or blocking wait) to its last
    commit, across ranks: while it persisted, its threads beside training."""
    windows: dict[tuple[int, int], list[float]] = {}
    for e in record.events:
        if e["event"] in ("ckpt_staged", "ckpt_blocked"):
            window = windows.setdefault((e["attempt"], e["step"]), [e["t"], e["t"]])
            window[0] = min(window[0], e["t"])
        elif e["event"] == "ckpt_committed":
            window = windows.setdefault((e["attempt"], e["step"]), [e["t"], e["t"]])
            window[1] = max(window[1], e["t"])
    return {key: (start, end) for key, (start, end) in windows.items()}


def _slowest_steps(record: RunRecord) -> dict[int, list[tuple[float, float]]]:
    """Per attempt, each step's end and duration on its slowest rank."""
    hangs = hang_windows(record)
    found: dict[tuple[int, int], tuple[float, float]] = {}
    for e in record.events:
        if e["event"] == "step_end" and (unheld := _unheld_s(e, hangs)) is not None:
            t, seconds = found.get((e["attempt"], e["step"]), (0.0, 0.0))
            found[(e["attempt"], e["step"])] = (max(t, e["t"]), max(seconds, unheld))
    out: dict[int, list[tuple[float, float]]] = {}
    for (attempt, _), value in sorted(found.items()):
        out.setdefault(attempt, []).append(value)
    return out


def checkpoint_cost(record: RunRecord, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the checkpoints cost the training loop in all: the stalls, the slower steps while
    they persisted, and the two as a share of the steps' time (None without steps). The
    ``final`` save's stall is the job's shutdown, after the loop: not counted."""
    step_time = sum(s for v in _slowest_steps(record).values() for _, s in v)
    if not step_time:
        return None
    stall = sum(c["stall_s"] or 0.0 for c in rows if not c.get("final"))
    slowdown = sum(c.get("slowdown_s") or 0.0 for c in rows)
    return {"stall_s": stall, "slowdown_s": slowdown,
            "share_of_step_time": (stall + slowdown) / step_time}


def hang_windows(record: RunRecord) -> dict[int, list[tuple[float, float]]]:
    """Per attempt, the spans a ``hang_rank`` held one of its ranks: from the stop to the
    continue (``duration_s`` after it stopped), the attempt's end or the run's, whichever
    came first. Hangs that overlap (two ranks held at once) are one span: their common
    seconds are lost once."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for i in record.injections:
        if i.kind != "hang_rank" or i.skipped or i.missed or "duration_s" not in i.detail:
            continue
        attempt = record.attempt_at(i.t)
        end = min(i.detail.get("done_t", i.t) + i.detail["duration_s"], record.ended_t,
                  record.attempt_ends.get(attempt, record.ended_t))
        spans.setdefault(attempt, []).append((i.t, end))
    out: dict[int, list[tuple[float, float]]] = {}
    for attempt, found in spans.items():
        merged = out.setdefault(attempt, [])
        for start, end in sorted(found):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
    return out


def _unheld_s(step_end: dict[str, Any],
              hangs: dict[int, list[tuple[float, float]]]) -> float | None:
    """A step's seconds less the time a hang held a rank of its attempt meanwhile; None when
    its time is not known (a script's first report of a process: ``probe.step_end``)."""
    t, seconds = step_end["t"], step_end["seconds"]
    if seconds is None:
        return None
    return seconds - sum(max(min(end, t) - max(start, t - seconds), 0.0)
                         for start, end in hangs.get(step_end["attempt"], ()))


def goodput(record: RunRecord) -> float | None:
    """Time of the steps that count (each step's final execution, slowest rank) / wall time,
    the time chaos held the trainer at pause points left out (a test artifact, not the job's).
    A step's time while a hang held a rank of its attempt is not counted: a job that waited
    the hang out stood still (the time is lost, as a restart's). None when the trainer
    reported no step (a script without the probe). A step whose time no rank knew (a
    script's first report of a process) counts at the median of its attempt's known steps:
    it ran, and as 0 s goodput lost a step per attempt."""
    hangs = hang_windows(record)
    final: dict[int, tuple[int, float | None]] = {}
    for e in record.events:
        if e["event"] == "step_end":
            attempt, seconds = final.get(e["step"], (-1, None))
            unheld = _unheld_s(e, hangs)
            if e["attempt"] > attempt:
                final[e["step"]] = (e["attempt"], unheld)
            elif e["attempt"] == attempt:
                known = [s for s in (seconds, unheld) if s is not None]
                final[e["step"]] = (attempt, max(known) if known else None)
    if not final:
        return None
    timed: dict[int, list[float]] = {}
    for a, s in final.values():
        timed.setdefault(a, []).extend([] if s is None else [s])
    everywhere = [s for v in timed.values() for s in v]
    paces = {a: _median(sorted(v or everywhere)) for a, v in timed.items()}
    useful = sum(paces[a] if s is None else s for a, s in final.values())
    wall = record.wall_s - record.paused_s
    return useful / wall if wall > 0 else 0.0


def _median(ordered: list[float]) -> float:
    """The middle of ``ordered`` (sorted), as the persist windows' paces take it; 0 if empty."""
    return ordered[len(ordered) // 2] if ordered else 0.0


def spares(record: RunRecord) -> dict[str, Any]:
    """The warm spares of an in-process run: how many became ready, which took over a rank,
    which were lost with their slot (its supervisor too, or their host: found by the lease
    monitor, ``trainer.lease``; nobody is left to replace them), and which died while idle
    (each is replaced: its supervisor forks a fresh spare, unless the slot's fresh processes
    kept dying before they trained: ``given_up``)."""
    ready = [e for e in record.events if e["event"] == "spare_ready"]
    spare_ids = {r.get("worker") for r in ready}
    first_starts: dict[str, dict[str, Any]] = {}  # a spare took over at its first start; it
    for e in sorted(record.events, key=lambda e: e["t"]):  # survives later re-formations
        if e["event"] == "start" and e.get("cause") == "in_process" \
                and e.get("worker") in spare_ids:
            first_starts.setdefault(e["worker"], e)
    took_over = [{"attempt": e["attempt"], "rank": e["rank"], "worker": e.get("worker")}
                 for e in first_starts.values()]
    idle = [e for e in record.events if e["event"] == "rank_died" and e.get("phase") == "spare"]

    def death(e: dict[str, Any]) -> dict[str, Any]:
        return {"t": e["t"], "slot": e.get("slot"), "how": e.get("how")}

    lost = [death(e) for e in idle if not e.get("lost")]
    with_host = [death(e) for e in idle if e.get("lost")]
    given_up = [{"t": e["t"], "slot": e.get("slot"), "deaths": e.get("deaths")}
                for e in record.events if e["event"] == "spare_lost"]
    return {"ready": len(ready), "took_over": took_over, "lost_while_idle": lost,
            "lost_with_slot": with_host, "given_up": given_up}


def losses(record: RunRecord) -> list[dict[str, Any]]:
    return [{"step": e["step"], "attempt": e["attempt"], "loss": e["loss"], "t": e["t"]}
            for e in record.events if e["event"] == "step_end" and e["loss"] is not None]
