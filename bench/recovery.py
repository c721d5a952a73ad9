"""Recovery below the restart floor, measured: restart vs in-process, side by side, one run.

    python -m bench.recovery [--only quickstart,3d,hang,goodput,goodput-long] [--out DIR]
                             [--json PATH]

Each case runs shipped scenarios through ``chaos run`` (a fault-free reference first, run
in this bench with a fresh cache unless ``--cached-reference``) and reads the faulty runs'
reports: recovery (injection -> training back at the fault step), its parts, lost steps and
goodput (time of the steps that count / wall, and that as a fraction of the fault-free
reference's own goodput: what the faults cost, with start-up and checkpoint stalls, which the
reference pays too, factored out). Targets (issue 11) are printed PASS/MISS next to the figures;
nothing here is a unit test, so nothing here fails a build.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from antifragile.chaos.run.pipeline import run
from antifragile.chaos.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent / "scenarios"
CASES: dict[str, list[str]] = {
    "quickstart": ["quickstart.yaml", "quickstart-in-process.yaml"],
    "3d": ["kill-rank-3d.yaml", "kill-rank-3d-in-process.yaml"],
    "hang": ["nightly/hang-thread-dp2-restart.yaml", "nightly/hang-thread-dp2-in-process.yaml",
             "hang-rank.yaml"],
    "goodput": ["goodput/kill-every-15s-in-process.yaml", "goodput/kill-every-60s-in-process.yaml",
                "goodput/kill-every-15s-restart.yaml", "goodput/kill-every-60s-restart.yaml"],
    "goodput-long": ["goodput/kill-every-60s-in-process-long.yaml"],
}


def _run(name: str, out: Path) -> dict[str, Any]:
    s = load_scenario(ROOT / name)
    if "hang-rank" in name:  # the shipped hang scenario with the 2 s timeout
        s = s.model_copy(update={"trainer": s.trainer.model_copy(update={"hang_timeout_s": 2.0})})
    outcome = run(s, out / s.name, progress=lambda line: print(f"  {line}", file=sys.stderr))
    report = outcome.report
    faults = [f for f in report["faults"] if f.get("recovery_s") is not None]
    mean = lambda key: (sum(f[key] for f in faults) / len(faults)) if faults else None  # noqa: E731
    return {"scenario": s.name, "verdict": report["verdict"]["verdict"],
            "bitwise_equal": report["verdict"]["bitwise_equal"],
            "recovery_mode": sorted({f.get("recovery_mode") for f in faults} - {None}),
            "faults": len(report["faults"]), "recovered": len(faults),
            "detect_s": mean("detect_s"), "reform_s": mean("restart_s"),
            "restore_s": mean("restore_s"), "recompute_s": mean("recompute_s"),
            "recovery_s": mean("recovery_s"), "lost_steps": mean("lost_steps"),
            "goodput": report["run"]["goodput"],
            "goodput_vs_reference": report["run"].get("goodput_vs_reference"),
            "reference_goodput": report["run"].get("reference_goodput"),
            "wall_s": report["run"]["wall_s"]}


def _check(label: str, value: float | None, op: str, target: float,
           runs: list[dict[str, Any]]) -> str:
    """PASS when ``value`` meets the target and every run it comes from passed its chaos
    checks: a time or a goodput of a recovery that failed them (state not bitwise equal, a
    fault that never recovered, one skipped) is no figure of recovery."""
    ok = value is not None and (value <= target if op == "<=" else value >= target)
    shown = "n/a" if value is None else f"{value:.3f}"
    failed = [f"{r['scenario']}: {r['verdict']}" for r in runs if r["verdict"] != "pass"]
    why = f"; run verdict {', '.join(failed)}" if failed else ""
    verdict = "PASS" if ok and not failed else "MISS"
    return f"{verdict}  {label}: {shown} (target {op} {target}{why})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="quickstart,3d,hang", help="comma-separated cases "
                   f"({', '.join(CASES)}); goodput runs take ~10 min each, "
                   "goodput-long ~17")
    p.add_argument("--out", type=Path, help="where the reports go (default: a temp folder)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--cached-reference", action="store_true",
                   help="reuse fault-free reference runs cached by earlier runs (else they run "
                        "here, on the machine as it is now)")
    a = p.parse_args(argv)
    cases = a.only.split(",")
    for case in cases:  # all of them before the first case's runs (minutes each)
        if case not in CASES:
            p.error(f"--only: unknown case {case!r}; the cases are {', '.join(CASES)}")
    out = a.out or Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    if not a.cached_reference:
        os.environ["ANTIFRAGILE_CACHE"] = str(out / "cache")
    rows: dict[str, dict[str, Any]] = {}
    for case in cases:
        for name in CASES[case]:
            print(f"{case}: {name}", file=sys.stderr)
            rows[name] = _run(name, out)
    cols = ("scenario", "verdict", "recovery_mode", "detect_s", "reform_s", "restore_s",
            "recompute_s", "recovery_s", "lost_steps", "goodput", "goodput_vs_reference")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows.values():
        print("  ".join(f"{(f'{v:.3f}' if isinstance(v, float) else str(v))[:30]:>14}"
                        for v in (r[c] for c in cols)))
    checks = []
    get = lambda n, k: rows[n][k] if n in rows else None  # noqa: E731
    if "quickstart.yaml" in rows:
        ip, rs = get("quickstart-in-process.yaml", "recovery_s"), get("quickstart.yaml",
                                                                      "recovery_s")
        ip_run, rs_run = rows["quickstart-in-process.yaml"], rows["quickstart.yaml"]
        checks.append(_check("quickstart kill, in-process recovery s", ip, "<=", 1.0,
                             [ip_run]))
        checks.append(_check("quickstart kill, in-process / restart recovery", (ip / rs)
                             if ip is not None and rs else None, "<=", 0.35, [ip_run, rs_run]))
    if "kill-rank-3d-in-process.yaml" in rows:
        checks.append(_check("2x2x2 kill, in-process recovery s",
                             get("kill-rank-3d-in-process.yaml", "recovery_s"), "<=", 2.0,
                             [rows["kill-rank-3d-in-process.yaml"]]))
    for name in CASES["hang"]:
        if name in rows:
            checks.append(_check(f"{rows[name]['scenario']} detect s (timeout 2)",
                                 get(name, "detect_s"), "<=", 3.5, [rows[name]]))
    for name, target in (("goodput/kill-every-15s-in-process.yaml", 0.80),
                         ("goodput/kill-every-60s-in-process.yaml", 0.95),
                         ("goodput/kill-every-60s-in-process-long.yaml", 0.95)):
        if name in rows:
            checks.append(_check(f"{rows[name]['scenario']} goodput", get(name, "goodput"),
                                 ">=", target, [rows[name]]))
            checks.append(_check(f"{rows[name]['scenario']} goodput / fault-free goodput",
                                 get(name, "goodput_vs_reference"), ">=", target, [rows[name]]))
    print("\n".join(checks))
    print(f"reports: {out}")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "checks": checks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
