"""The suite's summary: one entry per scenario, ``summary.json``/``summary.html``, the table
printed at the end, and the comparison with a previous summary (regressions).

The summary keeps only what a regression check and a person scanning a table need (verdict,
recovery, lost steps, goodput, checkpoint stall); the whole story stays in each scenario's report.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import mean
from typing import Any
from urllib.parse import quote

from antifragile.chaos.report import document as report
from antifragile.chaos.report import strict_json

FORMAT = 3  # 2: verdict ``skipped``, counts.skipped and the skipped names; 3: see below
# the format since which each compared figure means what it means now: the checkpoint stall is
# the built-in trainer's whole wait for save() (state dicts, the save's collectives, staging)
# since 3; before, our engine's figure was its staging copy alone
SINCE = {"stall (mean)": 3}


class SuiteError(Exception):
    """Bad suite input (folder, names, baseline); the message is for the user as is."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Tolerances:
    """How much worse than the baseline a figure may get before it is a regression.

    The absolute floors keep run-to-run noise of tiny CPU scenarios from reading as a regression:
    a recovery of 8 s against 6 s is +33% but well within the jitter of a torchrun restart.
    """

    recovery_rel: float = 0.20
    recovery_floor_s: float = 1.0
    stall_rel: float = 0.20
    stall_floor_s: float = 0.05
    goodput_points: float = 0.05


def summarize(name: str, file: str, doc: dict[str, Any], report: str | None) -> dict[str, Any]:
    """The summary entry of one scenario from its ``report.json`` document."""
    faults = doc.get("faults", [])
    recoveries = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    # faults that ended one attempt (two kills at one moment) each report the steps that
    # attempt lost: counted once, the most any of them says
    lost_by_attempt: dict[int, int] = {}
    lost = []
    for f in faults:
        if f.get("lost_steps") is None:
            continue
        if f.get("ended_attempt") is None:
            lost.append(f["lost_steps"])
        else:
            attempt = f["ended_attempt"]
            lost_by_attempt[attempt] = max(lost_by_attempt.get(attempt, 0), f["lost_steps"])
    lost += lost_by_attempt.values()
    # the run's final blocking save waits for its whole persist: the job's shutdown, not a
    # stall of training (the report shows it)
    stalls = [c["stall_s"] for c in doc.get("checkpoints", [])
              if c.get("stall_s") is not None and not c.get("final")]
    recovered = [f for f in faults if f.get("recovery_s") is not None]

    def mean_of(key: str) -> float | None:
        xs = [f[key] for f in recovered if f.get(key) is not None]
        return mean(xs) if xs else None

    run, verdict = doc.get("run", {}), doc.get("verdict", {})
    return {
        "name": name, "file": file, "verdict": verdict.get("verdict", "fail"),
        "reasons": list(verdict.get("reasons", [])), "error": None,
        "bitwise_equal": verdict.get("bitwise_equal"),
        "faults": len(faults),
        "faults_made": sum(1 for f in faults if not f.get("skipped") and not f.get("missed")),
        "skipped": [{"kind": f["kind"], "reason": f["skipped"]} for f in faults
                    if f.get("skipped")],
        "recovery_max_s": max(recoveries) if recoveries else None,
        "recovery_mean_s": mean(recoveries) if recoveries else None,
        # restart vs in-process, side by side: how recoveries were made and where time went
        "recovery_modes": sorted({f["recovery_mode"] for f in recovered
                                  if f.get("recovery_mode")}),
        "detect_mean_s": mean_of("detect_s"), "reform_mean_s": mean_of("restart_s"),
        "restore_mean_s": mean_of("restore_s"), "recompute_mean_s": mean_of("recompute_s"),
        "lost_steps": sum(lost) if lost else None,
        "goodput": run.get("goodput"), "goodput_vs_reference": run.get("goodput_vs_reference"),
        "stall_mean_s": mean(stalls) if stalls else None,
        "stall_max_s": max(stalls) if stalls else None,
        "wall_s": run.get("wall_s"), "paused_s": run.get("paused_s"), "report": report,
    }


def failed_entry(name: str, file: str, reason: str, *, error: str | None = None
                 ) -> dict[str, Any]:
    """An entry for a scenario that produced no report (invalid file, crashed runner)."""
    entry = summarize(name, file, {}, None)
    entry.update(verdict="fail", reasons=[reason], error=error)
    return entry


def build(entries: list[dict[str, Any]], *, suite: str, wall_s: float,
          baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``summary.json`` document; ``ok`` is what the exit code says (see ``exit_code``):
    every scenario passed and nothing regressed."""
    failed = [e["name"] for e in entries if e["verdict"] not in ("pass", "skipped")]
    skipped = [e["name"] for e in entries if e["verdict"] == "skipped"]
    regressed = bool(baseline and baseline["regressions"])
    return {"format": FORMAT, "suite": suite,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_s": wall_s, "environment": report.environment(),
            "ok": not failed and not skipped and not regressed,
            "counts": {"pass": len(entries) - len(failed) - len(skipped), "fail": len(failed),
                       "skipped": len(skipped)},
            "failed": failed, "skipped": skipped, "scenarios": entries, "baseline": baseline}


def exit_code(summary: dict[str, Any]) -> int:
    """0 every scenario passed and nothing regressed; 1 a scenario failed or a figure
    regressed; 3 nothing failed, but a scenario was skipped (a fault could not be made here),
    so the suite did not test what it says, even when every scenario was skipped."""
    if summary["failed"] or (summary.get("baseline") or {}).get("regressions"):
        return 1
    return 3 if summary.get("skipped") else 0


#: the largest baseline read: a summary is some KiB a scenario (26 scenarios: 23 KiB)
MAX_BASELINE_BYTES = 64 << 20


def load_baseline(path: Path) -> dict[str, Any]:
    """A previous ``summary.json``; anything else is bad input, before the suite runs."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BASELINE_BYTES + 1)  # /dev/zero would be read until memory ran out
        if len(raw) > MAX_BASELINE_BYTES:
            raise SuiteError(f"{path}: larger than {MAX_BASELINE_BYTES >> 20} MiB: not a summary")
        doc = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise SuiteError(f"{path}: cannot read the baseline: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SuiteError(f"{path}: the baseline is not JSON: {exc}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SuiteError(f"{path}: the baseline is not JSON this can read: {exc}") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise SuiteError(f"{path}: the baseline is nested too deeply to be a summary") from None
    scenarios = doc.get("scenarios") if isinstance(doc, dict) else None
    if not isinstance(scenarios, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) for e in scenarios):
        raise SuiteError(f"{path}: not a chaos suite summary (no 'scenarios' list of named "
                         f"entries)")
    problem = _garbled(doc)
    if problem is not None:
        raise SuiteError(f"{path}: {problem}; not a summary chaos suite wrote (compare with "
                         "another baseline, or drop --baseline)")
    return doc


def load_baselines(names: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each ``--baseline`` as given, with its summary (``load_baseline``); one file named
    twice (however spelt) is bad input: it would count one night twice."""
    seen: dict[str, str] = {}
    for name in names:
        real = os.path.realpath(name)
        if real in seen:
            same = "" if seen[real] == name else f" ({seen[real]} is the same file)"
            raise SuiteError(f"--baseline {name}: given twice{same}")
        seen[real] = name
    return [(name, load_baseline(Path(name))) for name in names]


#: the figures of a baseline entry that ``compare`` computes with (None: not measured)
_COMPARED_SECONDS = ("recovery_max_s", "stall_mean_s", "goodput", "wall_s", "paused_s")


def _garbled(doc: dict[str, Any]) -> str | None:
    """What in a baseline ``compare`` could not compute with, or None. Checked when it is
    loaded: ``compare`` runs after every scenario did, and a TypeError there lost the whole
    suite's summary; a NaN or a negative figure compared as a regression from it; a name
    given twice was compared with its last entry only."""
    fmt = doc.get("format", 1)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        return f"format: {fmt!r} is not a summary format (a whole number >= 1)"
    if fmt > FORMAT:  # its figures may mean what this code does not know
        return (f"format: {fmt} is newer than this chaos reads (format {FORMAT}): a baseline "
                "from a newer chaos")
    if not doc["scenarios"]:  # every scenario would be "new": nothing compared, exit 0
        return ("scenarios: none (no chaos suite writes a summary of no scenario): nothing to "
                "compare with")
    first: dict[str, int] = {}
    for i, e in enumerate(doc["scenarios"]):
        if e["name"] in first:  # compare would keep the last entry of a name only
            return (f"scenarios.{i} ({e['name']}): the name of scenarios.{first[e['name']]} "
                    "again")
        first[e["name"]] = i
        for key in _COMPARED_SECONDS:
            x = e.get(key)
            if x is not None and not (_is_number(x) and math.isfinite(x) and x >= 0):
                return f"scenarios.{i} ({e['name']}).{key}: {_shown(x)} is not a number >= 0"
        made = e.get("faults_made")
        if made is not None and not (_is_number(made) and isinstance(made, int) and made >= 0):
            return (f"scenarios.{i} ({e['name']}).faults_made: {_shown(made)} is not a whole "
                    "number >= 0")
    return None


def _is_number(x: Any) -> bool:
    """An int or a float that computes as a float (an integer of 400 digits overflows)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _shown(x: Any) -> str:
    """``x`` as the error shows it: its repr, cut at 40 characters."""
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:40]}..."


def _worse(metric: str, base: float | None, cur: float | None, rel: float, floor: float
           ) -> dict[str, Any] | None:
    if base is None or cur is None or cur <= base * (1 + rel) or cur - base < floor:
        return None
    change = f"+{(cur / base - 1) * 100:.0f}%" if base > 0 else "from 0"
    return {"metric": metric, "baseline": base, "current": cur,
            "reason": f"{metric} {report.figure(base)} s -> {report.figure(cur)} s ({change}, "
                      f"limit +{rel:.0%} and +{floor:g} s)"}


def _lost(entry: dict[str, Any]) -> float | None:
    """Wall time not spent on steps that count, chaos's holds at pause points left out (as
    goodput leaves them out; a baseline without ``paused_s`` held none)."""
    goodput, wall = entry.get("goodput"), entry.get("wall_s")
    if goodput is None or wall is None:
        return None
    return float((wall - (entry.get("paused_s") or 0.0)) * (1 - goodput))


def _lost_per_fault(entry: dict[str, Any]) -> float | None:
    made, lost = entry.get("faults_made"), _lost(entry)
    return None if not made or lost is None else lost / made


def _other_fault_count(base: dict[str, Any], cur: dict[str, Any]) -> bool:
    """Both runs made faults, a different number: their goodputs compare the time per fault."""
    n_base, n_cur = base.get("faults_made"), cur.get("faults_made")
    return bool(n_base and n_cur and n_base != n_cur)


def _goodput_worse(base: dict[str, Any], cur: dict[str, Any], tol: Tolerances
                   ) -> dict[str, Any] | None:
    """Goodput lower by more than ``goodput_points``, and by at least the recovery's floor in
    lost wall time (a 15 s scenario's goodput swings by 5 points with a start-up 0.8 s
    slower). Faults that arrive in wall time (``mtbf_s``) strike a slower run more often, so
    when the two runs made different numbers of faults the time each fault cost is compared
    instead, with the recovery's limits."""
    b, c = base.get("goodput"), cur["goodput"]
    if b is None or c is None:
        return None
    n_base, n_cur = base.get("faults_made"), cur.get("faults_made")
    if _other_fault_count(base, cur):
        worse = _worse("lost time per fault", _lost_per_fault(base), _lost_per_fault(cur),
                       tol.recovery_rel, tol.recovery_floor_s)
        if worse is not None:
            worse["reason"] = (f"goodput {b:.3f} -> {c:.3f} with {n_cur} faults against "
                               f"{n_base}: {worse['reason']}")
        return worse
    lost_b, lost_c = _lost(base), _lost(cur)
    if b - c <= tol.goodput_points or (lost_b is not None and lost_c is not None
                                       and lost_c - lost_b < tol.recovery_floor_s):
        return None
    return {"metric": "goodput", "baseline": b, "current": c,
            "reason": f"goodput {b:.3f} -> {c:.3f} ({(c - b) * 100:+.1f} points, "
                      f"limit -{tol.goodput_points * 100:g})"}


#: the figures ``compare`` compares: name, summary key, unit
_FIGURES = (("recovery (max)", "recovery_max_s", " s"), ("stall (mean)", "stall_mean_s", " s"),
            ("goodput", "goodput", ""))


#: what of ``environment`` a timing depends on, in the order the differences are listed
_MACHINE = ("cpus", "python", "torch", "cuda", "platform")


def _other_machine(baseline: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """How the baseline's machine differs from this one (``key: then -> now``); nothing
    where the baseline recorded none."""
    then = baseline.get("environment")
    if not isinstance(then, dict):
        return []
    return [f"{key}: {then[key]} -> {here.get(key)}" for key in _MACHINE
            if key in then and then[key] != here.get(key)]


def compare(entries: list[dict[str, Any]], baseline: dict[str, Any], *, file: str,
            tol: Tolerances = Tolerances(), environment: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Regressions of each scenario present in both summaries and passing in both.

    A scenario that fails now is already a failure; one that failed in the baseline has no
    trustworthy figures. New and missing scenarios are noted, never regressions. A baseline
    from another machine (``environment``: this one's, by default measured here) is compared
    all the same, the differences listed under ``environment``: every figure is a time.
    """
    here = report.environment() if environment is None else environment
    before = {e["name"]: e for e in baseline["scenarios"]}
    now = {e["name"]: e for e in entries}
    regressions, not_compared = [], []
    # a figure whose meaning changed since the baseline's format is not compared at all (a
    # nightly that compares with the last successful one would otherwise fail for good)
    was = baseline.get("format", 1)
    other_meaning = [m for m, since in SINCE.items() if was < since]
    not_compared += [{"scenario": "*", "reason": f"{m}: measured otherwise in the baseline "
                                                 f"(format {was}; now format {FORMAT})"}
                     for m in other_meaning]
    for name, cur in now.items():
        base = before.get(name)
        if base is None:
            continue
        if base.get("verdict") != "pass" or cur["verdict"] != "pass":
            was = base.get("verdict", "fail") if base.get("verdict") != "pass" \
                else cur["verdict"]
            which = "the baseline" if base.get("verdict") != "pass" else "this run"
            not_compared.append({"scenario": name,
                                 "reason": f"{'skipped' if was == 'skipped' else 'failed'} "
                                           f"in {which}"})
            continue
        not_compared += [{"scenario": name, "reason": f"{metric}: measured in the baseline "
                                                      f"({_figure(base[key], unit, 3)}{unit}), not "
                                                      "in this run"}
                         for metric, key, unit in _FIGURES
                         if base.get(key) is not None and cur.get(key) is None]
        found = _checks(base, cur, tol, stall="stall (mean)" not in other_meaning)
        regressions += [{"scenario": name, **r} for r in found.values() if r]
    return {"file": file, "tolerances": asdict(tol),
            "regressions": regressions, "not_compared": not_compared,
            "new": sorted(set(now) - set(before)), "missing": sorted(set(before) - set(now)),
            "environment": _other_machine(baseline, here)}


def _checks(base: dict[str, Any], cur: dict[str, Any], tol: Tolerances, *, stall: bool
            ) -> dict[str, dict[str, Any] | None]:
    """Each figure both entries measured (the stall only with ``stall``; the goodput, between
    runs of different fault counts, only when both give the time lost per fault), keyed as
    in ``_FIGURES``: its regression, or None."""
    found: dict[str, dict[str, Any] | None] = {}
    if base.get("recovery_max_s") is not None and cur.get("recovery_max_s") is not None:
        found["recovery_max_s"] = _worse("recovery (max)", base["recovery_max_s"],
                                         cur["recovery_max_s"], tol.recovery_rel,
                                         tol.recovery_floor_s)
    if stall and base.get("stall_mean_s") is not None and cur.get("stall_mean_s") is not None:
        found["stall_mean_s"] = _worse("stall (mean)", base["stall_mean_s"],
                                       cur["stall_mean_s"], tol.stall_rel, tol.stall_floor_s)
    if base.get("goodput") is not None and cur.get("goodput") is not None and (
            not _other_fault_count(base, cur)
            or None not in (_lost_per_fault(base), _lost_per_fault(cur))):
        found["goodput"] = _goodput_worse(base, cur, tol)
    return found


def _figure(x: float, unit: str, digits: int) -> str:
    """A compared figure as the reasons show it: seconds as report.md shows them, goodput to
    ``digits`` decimals."""
    return report.figure(x) if unit == " s" else _fmt(x, digits)


def _band(values: list[float], unit: str, digits: int) -> str:
    low, high = _figure(min(values), unit, digits), _figure(max(values), unit, digits)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def compare_many(entries: list[dict[str, Any]], baselines: Sequence[tuple[str, dict[str, Any]]],
                 *, tol: Tolerances = Tolerances(), environment: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """Regressions against several previous summaries (``(file, summary)``, e.g. the last
    nightlies): a figure regresses only when it is worse than every baseline that passed the
    scenario and measured it, by more than ``tol`` (``compare``'s rules against each), so one
    lucky night no longer fails the next. Each regression is the one against the worst of
    those baselines (``against``) with the band of their figures (``band``). One baseline is
    ``compare`` exactly.

    A scenario is compared with the baselines that have it and passed it; one that none
    passed, or that fails now, is noted under ``not_compared``. ``new``: in no baseline;
    ``missing``: in a baseline, not in this run.
    """
    if len(baselines) == 1:
        ((file, doc),) = baselines
        return compare(entries, doc, file=file, tol=tol, environment=environment)
    here = report.environment() if environment is None else environment
    files = [file for file, _ in baselines]
    now = {e["name"]: e for e in entries}
    before = [(file, {e["name"]: e for e in doc["scenarios"]}, doc.get("format", 1))
              for file, doc in baselines]
    not_compared = [{"scenario": "*", "reason": f"{m}: measured otherwise in {file} "
                                                f"(format {was}; now format {FORMAT})"}
                    for file, _, was in before for m, since in SINCE.items() if was < since]
    regressions = []
    for name, cur in now.items():
        having = [(file, b[name], was) for file, b, was in before if name in b]
        if not having:
            continue
        if cur["verdict"] != "pass":
            how = "skipped" if cur["verdict"] == "skipped" else "failed"
            not_compared.append({"scenario": name, "reason": f"{how} in this run"})
            continue
        passed = [(file, base, was) for file, base, was in having
                  if base.get("verdict") == "pass"]
        if not passed:
            verdicts = {"skipped" if base.get("verdict") == "skipped" else "failed"
                        for _, base, _ in having}
            how = " or ".join(sorted(verdicts))
            not_compared.append({"scenario": name, "reason": f"{how} in every baseline"})
            continue
        found = [(file, base, _checks(base, cur, tol, stall=was >= SINCE["stall (mean)"]))
                 for file, base, was in passed]
        for metric, key, unit in _FIGURES:
            digits = 3 if key == "goodput" else 2
            measured = [base[key] for _, base, _ in passed if base.get(key) is not None]
            if measured and cur.get(key) is None:
                not_compared.append({"scenario": name, "reason": f"{metric}: measured in the "
                                     f"baselines ({_band(measured, unit, digits)}), not in "
                                     "this run"})
            against = [(file, base, checks[key]) for file, base, checks in found if key in checks]
            if not against or any(r is None for _, _, r in against):
                continue
            # goodput: lower is worse; recovery and stall: higher is; of baselines as bad as
            # each other, the first by file name (not the first given: the order of the
            # --baseline options must not change the regression)
            sign = 1.0 if key == "goodput" else -1.0
            file, _, worst = min(against, key=lambda a: (sign * float(a[1][key]), a[0]))
            assert worst is not None
            values = [float(base[key]) for _, base, _ in against]
            n = len(values)
            band = (f"{metric} {_figure(cur[key], unit, digits)}{unit} against "
                    f"{_band(values, unit, digits)} of {n} baseline{'s' if n > 1 else ''}")
            regressions.append({"scenario": name, **worst, "against": file,
                                "band": {"low": min(values), "high": max(values),
                                         "baselines": n},
                                "reason": f"{worst['reason']}; {band}"})
    names = set().union(*(b for _, b, _ in before))
    return {"file": ", ".join(files), "files": files, "tolerances": asdict(tol),
            "regressions": regressions, "not_compared": not_compared,
            "new": sorted(set(now) - names), "missing": sorted(names - set(now)),
            "environment": [f"{file}: {d}" for file, doc in baselines
                            for d in _other_machine(doc, here)]}


def write_json(out: Path, summary: dict[str, Any]) -> Path:
    path = out / "summary.json"
    path.write_text(strict_json(summary, indent=2))
    return path


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


_COLUMNS = ("scenario", "verdict", "recovery", "detect s", "re-form s", "restore s",
            "recompute s", "recovery max s", "lost steps", "goodput", "stall mean s", "wall s",
            "regression")


def _regressed(summary: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in (summary.get("baseline") or {}).get("regressions", []):
        out.setdefault(r["scenario"], []).append(r["metric"])
    return out


def _row(e: dict[str, Any], regressed: list[str]) -> list[str]:
    return [e["name"], e["verdict"].upper(), "+".join(e.get("recovery_modes") or []) or "-",
            _fmt(e.get("detect_mean_s")), _fmt(e.get("reform_mean_s")),
            _fmt(e.get("restore_mean_s")), _fmt(e.get("recompute_mean_s")),
            _fmt(e["recovery_max_s"]), _fmt(e["lost_steps"]),
            _fmt(e["goodput"], 3), _fmt(e["stall_mean_s"], 3), _fmt(e["wall_s"], 0),
            ", ".join(regressed)]


def format_table(summary: dict[str, Any]) -> str:
    """The table ``chaos suite`` prints, then failures, skipped faults and regressions."""
    regressed = _regressed(summary)
    rows = [list(_COLUMNS)] + [_row(e, regressed.get(e["name"], []))
                               for e in summary["scenarios"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for e in summary["scenarios"]:
        verdict = "SKIPPED" if e["verdict"] == "skipped" else "FAIL"
        lines += [f"{verdict} {e['name']}: {reason}" for reason in e["reasons"]]
        if e["verdict"] != "skipped":  # a skipped scenario's reasons are its skipped faults
            lines += [f"skipped {e['name']}: {s['kind']}: {s['reason']}" for s in e["skipped"]]
    b = summary.get("baseline")
    if b:
        if b.get("environment"):
            lines.append(_machine_note(b))
        lines += [f"REGRESSION {r['scenario']}: {r['reason']}" for r in b["regressions"]]
        lines += [f"not compared {n['scenario']}: {n['reason']}" for n in b["not_compared"]]
        lines += [f"{label}: {', '.join(names)}" for label, names in _new_and_missing(b)]
    c = summary["counts"]
    lines.append(f"{c['pass']} passed, {c['fail']} failed"
                 + (f", {c['skipped']} skipped" if c.get("skipped") else "")
                 + (f", {len(b['regressions'])} regression(s)" if b else "")
                 + f" in {summary['wall_s']:.0f} s")
    return "\n".join(lines)


def _new_and_missing(compared: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The new and the missing scenarios, each labelled (left out when there are none);
    with several baselines there is no one baseline they are new or missing since."""
    several = bool(compared.get("files"))
    labels = (("new (in no baseline)", "missing (in a baseline, not in this run)") if several
              else ("new since the baseline", "missing since the baseline"))
    return [(label, names) for label, names in zip(labels, (compared["new"],
                                                             compared["missing"])) if names]


def _machine_note(compared: dict[str, Any]) -> str:
    who = "a baseline" if compared.get("files") else "the baseline"
    return (f"{who} ran on another machine ({'; '.join(compared['environment'])}): "
            "its times were compared all the same; a regression may be the machine's")


_CSS = """td{text-align:left}tr.pass td.verdict{background:#d9f2d9}
tr.fail td.verdict{background:#f8d0d0}tr.skipped td.verdict{background:#fff1c2}
td.regression{color:#a00;font-weight:bold}
td.num{text-align:right}ul{margin:.3em 0}"""  # on top of the report pages' CSS


def write_html(out: Path, summary: dict[str, Any]) -> Path:
    """``summary.html``: self-contained (inline CSS), every value escaped, reports linked."""
    esc = html.escape
    regressed = _regressed(summary)
    c = summary["counts"]
    status = "OK" if summary["ok"] else "FAILED" if exit_code(summary) == 1 else "SKIPPED"
    parts = [f"<h1>chaos suite {esc(summary['suite'])}: {status}</h1>",
             f"<p>{c['pass']} passed, {c['fail']} failed, {c.get('skipped', 0)} skipped, "
             f"created {esc(summary['created'])}, "
             f"{summary['wall_s']:.0f} s</p><table><tr>"
             + "".join(f"<th>{esc(h)}</th>" for h in _COLUMNS) + "<th>report</th></tr>"]
    for e in summary["scenarios"]:
        cells = _row(e, regressed.get(e["name"], []))
        # only this suite's files: an invalid or never-run scenario's folder may hold an
        # earlier suite's report
        mine = [*(("report.html", "report.md") if e.get("report") else ()),
                *(("error.txt",) if e.get("error") else ())]
        links = [f"<a href='{quote(e['name'])}/{f}'>{f}</a>" for f in mine
                 if (out / e["name"] / f).is_file()]
        cls = ["name", "verdict", "mode", *["num"] * 9, "regression"]
        row = e["verdict"] if e["verdict"] in ("pass", "skipped") else "fail"
        parts.append(f"<tr class='{row}'>"
                     + "".join(f"<td class='{k}'>{esc(v)}</td>" for k, v in zip(cls, cells))
                     + f"<td>{' '.join(links)}</td></tr>")
    parts.append("</table>")
    # labelled as the table labels them: a skipped scenario is not a failure
    notes = [f"<li>{'SKIPPED' if e['verdict'] == 'skipped' else 'FAIL'} "
             f"<b>{esc(e['name'])}</b>: {esc(r)}</li>"
             for e in summary["scenarios"] for r in e["reasons"]]
    notes += [f"<li><b>{esc(e['name'])}</b>: {esc(s['kind'])} skipped: {esc(s['reason'])}</li>"
              for e in summary["scenarios"] if e["verdict"] != "skipped" for s in e["skipped"]]
    if notes:
        parts.append("<h2>Failures and skipped faults</h2><ul>" + "".join(notes) + "</ul>")
    b = summary.get("baseline")
    if b:
        items = [f"<li><b>{esc(r['scenario'])}</b>: {esc(r['reason'])}</li>"
                 for r in b["regressions"]] or ["<li>none</li>"]
        parts.append(f"<h2>Regressions against {esc(b['file'])}</h2><ul>{''.join(items)}</ul>")
        if b.get("environment"):
            parts.append(f"<p>{esc(_machine_note(b))}</p>")
        if b["not_compared"]:
            parts.append("<p>not compared:</p><ul>" + "".join(
                f"<li><b>{esc(n['scenario'])}</b>: {esc(n['reason'])}</li>"
                for n in b["not_compared"]) + "</ul>")
        parts += [f"<p>{esc(label)}: {esc(', '.join(names))}</p>"
                  for label, names in _new_and_missing(b)]
    path = out / "summary.html"
    path.write_text(report.html_page(f"chaos suite: {status}", "\n".join(parts), _CSS),
                    encoding="utf-8")
    return path
