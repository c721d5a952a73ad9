"""``chaos suite``: per-scenario summaries, baseline regressions, exit codes, the nightly files.

Summaries and regressions are checked on synthetic report documents (no processes); one slow
test runs a real two-scenario suite, one scenario passing and one failing honestly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from antifragile.chaos import suite
from antifragile.chaos.cli import main
from antifragile.chaos.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
TRAINER = {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "steps": 20, "batch_size": 8,
           "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
           "collective_timeout_s": 30}


def _fault(kind: str = "kill_rank", **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "injected_step": 10, "skipped": None, "recovery_s": None,
            "lost_steps": None, **kw}


def _report(recoveries: list[float], *, verdict: str = "pass", goodput: float = 0.5,
            stalls: tuple[float, ...] = (0.01, 0.03), wall_s: float = 40.0,
            paused_s: float = 0.0) -> dict[str, Any]:
    return {"run": {"wall_s": wall_s, "goodput": goodput, "paused_s": paused_s},
            "faults": [_fault(recovery_s=r, lost_steps=2) for r in recoveries],
            "checkpoints": [{"step": 4 * (i + 1), "stall_s": s} for i, s in enumerate(stalls)],
            "verdict": {"verdict": verdict, "reasons": [] if verdict == "pass" else ["bad"],
                        "bitwise_equal": verdict == "pass"}}


def _entry(name: str, recoveries: list[float], **kw: Any) -> dict[str, Any]:
    return suite.summarize(name, f"{name}.yaml", _report(recoveries, **kw),
                           f"{name}/report.json")


def _passed(folder: Path, *, report_file: bool = False) -> Any:
    """What ``pipeline.run`` returns for a scenario that passed, its folder made (and its
    report.json written, with ``report_file``)."""
    folder.mkdir(parents=True, exist_ok=True)
    if report_file:
        (folder / "report.json").write_text(json.dumps(_report([1.0])))
    return type("Outcome", (), {"report": _report([1.0])})()


def _write(folder: Path, name: str, faults: list[dict[str, Any]], **expect: Any) -> Path:
    doc = {"name": name, "seed": 3, "trainer": TRAINER,
           "checkpoint": {"every_steps": 4, "keep_last": 3}, "faults": faults,
           "expect": {"bitwise_equal_to_reference": True, **expect}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# --- summaries ---------------------------------------------------------------------------------

def test_summary_entry_aggregates_faults_and_checkpoints() -> None:
    doc = _report([4.0, 8.0], stalls=(0.02, 0.04, 0.06))
    doc["faults"].append(_fault("drop_link", skipped="creating network namespaces needs root"))
    doc["faults"].append(_fault("corrupt_shard"))  # no recovery of its own
    e = suite.summarize("s", "s.yaml", doc, "s/report.json")
    assert e["verdict"] == "pass" and e["reasons"] == [] and e["faults"] == 4
    assert e["recovery_max_s"] == 8.0 and e["recovery_mean_s"] == pytest.approx(6.0)
    assert e["lost_steps"] == 4
    assert e["stall_mean_s"] == pytest.approx(0.04) and e["stall_max_s"] == 0.06
    assert e["goodput"] == 0.5 and e["wall_s"] == 40.0 and e["report"] == "s/report.json"
    assert e["skipped"] == [{"kind": "drop_link",
                             "reason": "creating network namespaces needs root"}]


def test_steps_lost_once_are_summed_once_when_two_faults_ended_one_attempt() -> None:
    """Two kills at one pause point end the same attempt; each fault's row reports the steps
    that attempt lost, and the summary added them twice (4 where 2 were trained again)."""
    doc = _report([])
    doc["faults"] = [_fault(recovery_s=3.0, lost_steps=2, ended_attempt=0, rank=r)
                     for r in (0, 1)]
    doc["faults"].append(_fault(recovery_s=3.0, lost_steps=1, ended_attempt=1))
    assert suite.summarize("s", "s.yaml", doc, None)["lost_steps"] == 3


def test_entry_without_figures_and_failed_entry() -> None:
    e = suite.summarize("quiet", "q.yaml", _report([], stalls=()), None)
    assert e["recovery_max_s"] is None and e["lost_steps"] is None and e["stall_mean_s"] is None
    f = suite.failed_entry("x", "x.yaml", "the runner crashed: OSError: disk full")
    assert f["verdict"] == "fail" and f["reasons"] == ["the runner crashed: OSError: disk full"]
    assert f["goodput"] is None and f["report"] is None


# --- baseline comparison -------------------------------------------------------------------------

def _baseline(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"format": suite.FORMAT, "scenarios": list(entries)}


def test_the_lost_time_floor_leaves_out_the_time_chaos_held_the_trainer() -> None:
    """Goodput is the steps' time over the wall time less chaos's holds at pause points;
    the lost time its floor is checked by took the whole wall time, holds included: 6
    points of a 40 s run held 25 s is 0.9 s more lost (under the 1 s floor), read as 2.4 s
    and a regression."""
    base = _baseline(_entry("held", [10.0], goodput=0.60, paused_s=25.0))
    now = [_entry("held", [10.0], goodput=0.54, paused_s=25.0)]
    assert suite.compare(now, base, file="prev/summary.json")["regressions"] == []
    now = [_entry("held", [10.0], goodput=0.52, paused_s=25.0)]  # 1.2 s more lost
    assert [r["metric"] for r in suite.compare(now, base, file="prev/summary.json")[
        "regressions"]] == ["goodput"]


def test_regressions_follow_the_thresholds_and_floors() -> None:
    base = _baseline(_entry("slow-recovery", [10.0]), _entry("noise", [2.0]),
                     _entry("stall", [10.0], stalls=(0.1, 0.1)),
                     _entry("tiny-stall", [10.0], stalls=(0.01, 0.01)),
                     _entry("goodput", [10.0], goodput=0.60),
                     _entry("goodput-ok", [10.0], goodput=0.60),
                     _entry("short", [10.0], goodput=0.638, wall_s=15.42))
    now = [_entry("slow-recovery", [12.5]),       # +25% and +2.5 s: regression
           _entry("noise", [2.9]),                # +45% but +0.9 s: under the 1 s floor
           _entry("stall", [10.0], stalls=(0.2, 0.2)),       # +100%, +0.1 s: regression
           _entry("tiny-stall", [10.0], stalls=(0.03, 0.03)),  # +200% but +0.02 s: floor
           _entry("goodput", [10.0], goodput=0.54),           # -6 points: regression
           _entry("goodput-ok", [10.0], goodput=0.56),         # -4 points: fine
           # -5.2 points, but 0.78 s more lost (a nightly storage outage, 15 s): the floor
           _entry("short", [10.0], goodput=0.586, wall_s=15.16)]
    got = suite.compare(now, base, file="prev/summary.json")
    found = {(r["scenario"], r["metric"]) for r in got["regressions"]}
    assert found == {("slow-recovery", "recovery (max)"), ("stall", "stall (mean)"),
                     ("goodput", "goodput")}
    slow = next(r for r in got["regressions"] if r["scenario"] == "slow-recovery")
    assert slow["baseline"] == 10.0 and slow["current"] == 12.5
    assert "10.00 s -> 12.50 s (+25%" in slow["reason"]
    assert got["new"] == [] and got["missing"] == [] and got["not_compared"] == []
    assert got["tolerances"]["goodput_points"] == 0.05


def test_a_stall_measured_otherwise_in_the_baseline_is_not_compared() -> None:
    """The stall became the trainer's whole wait for save() (state dicts and the save's
    collectives) instead of our engine's staging copy alone: every nightly against a summary
    of the older format flagged it (0.003 s -> 0.125 s on 2x2x2), and a nightly that compares
    with the last successful one would have failed for good."""
    old = {"format": 2, "scenarios": [_entry("s", [10.0], stalls=(0.003, 0.003))]}
    got = suite.compare([_entry("s", [10.0], stalls=(0.125, 0.125))], old, file="old.json")
    assert got["regressions"] == []
    assert [n["reason"] for n in got["not_compared"]] == [
        f"stall (mean): measured otherwise in the baseline (format 2; now format {suite.FORMAT})"]
    same = suite.compare([_entry("s", [10.0], stalls=(0.125, 0.125))],
                         _baseline(_entry("s", [10.0], stalls=(0.003, 0.003))), file="b.json")
    assert [r["metric"] for r in same["regressions"]] == ["stall (mean)"]


def test_a_regression_of_a_stall_of_milliseconds_names_both_figures() -> None:
    """Stalls are milliseconds: the reason printed two decimals, "stall (mean) 0.00 s ->
    0.12 s (+4067%...)" for 0.003 s -> 0.125 s, a figure of 0 grown by 4067%, and the band
    of several baselines read "0.00-0.01 s"; figures below 0.1 s now keep two significant
    digits, as report.md shows them."""
    got = suite.compare([_entry("s", [10.0], stalls=(0.125, 0.125))],
                        _baseline(_entry("s", [10.0], stalls=(0.003, 0.003))), file="b.json")
    (reason,) = [r["reason"] for r in got["regressions"]]
    assert reason.startswith("stall (mean) 0.003 s -> 0.12 s (+4067%"), reason
    bases = [(f"n{i}.json", _baseline(_entry("s", [10.0], stalls=(x, x))))
             for i, x in enumerate((0.003, 0.008))]
    got = suite.compare_many([_entry("s", [10.0], stalls=(0.125, 0.125))], bases)
    (reason,) = [r["reason"] for r in got["regressions"]]
    assert reason.startswith("stall (mean) 0.008 s -> 0.12 s"), reason
    assert reason.endswith("stall (mean) 0.12 s against 0.003-0.008 s of 2 baselines"), reason


def test_the_final_blocking_save_is_not_a_stall_of_training() -> None:
    doc = _report([4.0], stalls=(0.02, 0.04))
    doc["checkpoints"].append({"step": 12, "stall_s": 1.7, "final": True})
    e = suite.summarize("s", "s.yaml", doc, "s/report.json")
    assert e["stall_mean_s"] == pytest.approx(0.03) and e["stall_max_s"] == 0.04


def test_runs_with_different_numbers_of_faults_compare_the_time_each_fault_cost() -> None:
    """Faults that arrive in wall time (``mtbf_s``) strike a slower run more often: a nightly
    run with 8 kills in 46.8 s (goodput 0.443) against 5 in 38.2 s (0.534) read as a 9-point
    goodput regression, yet each kill cost less (3.26 s against 3.56 s of lost time). With
    different fault counts the lost time per fault is compared, with the recovery's limits."""
    base = _baseline(_entry("mtbf", [2.5] * 5, goodput=0.534, wall_s=38.2),
                     _entry("mtbf-worse", [2.5] * 5, goodput=0.534, wall_s=38.2))
    now = [_entry("mtbf", [2.5] * 8, goodput=0.443, wall_s=46.8),
           _entry("mtbf-worse", [2.5] * 8, goodput=0.2, wall_s=46.8)]  # 4.68 s a fault
    got = suite.compare(now, base, file="prev/summary.json")
    assert [(r["scenario"], r["metric"]) for r in got["regressions"]] == [
        ("mtbf-worse", "lost time per fault")]
    reason = got["regressions"][0]["reason"]
    assert "8 faults against 5" in reason and "3.56 s -> 4.68 s" in reason, reason


def test_new_missing_and_failed_scenarios_are_noted_not_regressions() -> None:
    base = _baseline(_entry("kept", [5.0]), _entry("gone", [5.0]),
                     _entry("was-failing", [5.0], verdict="fail"))
    now = [_entry("kept", [5.0]), _entry("added", [50.0]),
           _entry("was-failing", [50.0], goodput=0.1)]
    got = suite.compare(now, base, file="b.json")
    assert got["regressions"] == []
    assert got["new"] == ["added"] and got["missing"] == ["gone"]
    assert got["not_compared"] == [{"scenario": "was-failing", "reason": "failed in the baseline"}]


def test_a_regression_fails_the_summary() -> None:
    entries = [_entry("a", [20.0])]
    compared = suite.compare(entries, _baseline(_entry("a", [10.0])), file="b.json")
    summary = suite.build(entries, suite="dir", wall_s=1.0, baseline=compared)
    assert summary["failed"] == [] and summary["ok"] is False
    table = suite.format_table(summary)
    assert "REGRESSION a: recovery (max) 10.00 s -> 20.00 s" in table
    assert suite.build(entries, suite="dir", wall_s=1.0)["ok"] is True


def test_baseline_that_is_not_a_summary_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(suite.SuiteError, match="cannot read the baseline"):
        suite.load_baseline(tmp_path / "missing.json")
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(suite.SuiteError, match=r"garbage\.json: the baseline is not JSON"):
        suite.load_baseline(tmp_path / "garbage.json")
    (tmp_path / "report.json").write_text(json.dumps(_report([1.0])))
    with pytest.raises(suite.SuiteError, match="not a chaos suite summary"):
        suite.load_baseline(tmp_path / "report.json")
    # nested past the JSON decoder's recursion limit: a RecursionError traceback, exit 1
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(suite.SuiteError, match=r"deep\.json: the baseline is nested too deeply"):
        suite.load_baseline(tmp_path / "deep.json")
    # read whole, however large (--baseline /dev/zero until memory ran out): refused unread
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate(suite.MAX_BASELINE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(suite.SuiteError, match=r"huge\.json: larger than 64 MiB: not a summary"):
        suite.load_baseline(tmp_path / "huge.json")


@pytest.mark.parametrize(("change", "message"), [
    ({"format": "3"}, "format: '3' is not a summary format (a whole number >= 1)"),
    ({"format": None}, "format: None is not a summary format"),
    ({"format": True}, "format: True is not a summary format"),
    ({"entry": {"recovery_max_s": "5"}},
     "scenarios.0 (a).recovery_max_s: '5' is not a number >= 0"),
    ({"entry": {"goodput": "x"}}, "scenarios.0 (a).goodput: 'x' is not a number >= 0"),
    ({"entry": {"wall_s": [1]}}, "scenarios.0 (a).wall_s: [1] is not a number >= 0"),
    ({"entry": {"stall_mean_s": float("nan")}}, "scenarios.0 (a).stall_mean_s: nan is not"),
    ({"entry": {"recovery_max_s": -1.0}}, "scenarios.0 (a).recovery_max_s: -1.0 is not"),
    ({"entry": {"recovery_max_s": True}}, "scenarios.0 (a).recovery_max_s: True is not"),
    ({"entry": {"faults_made": "2"}},
     "scenarios.0 (a).faults_made: '2' is not a whole number >= 0"),
    # an integer too large for a float: float() of it raised OverflowError, a traceback (for
    # faults_made after every scenario had run, losing the suite's summary)
    ({"entry": {"wall_s": 10**400}}, "scenarios.0 (a).wall_s: 1000000000000000000000000000000"
                                     "000000000... is not a number >= 0"),
    ({"entry": {"faults_made": 10**400}}, "scenarios.0 (a).faults_made: 100000000000000000"
                                          "0000000000000000000000... is not a whole number"),
    # a newer chaos's summary was compared as if its figures meant what they mean here, and
    # one of no scenario (no suite writes one) made every scenario "new": nothing compared,
    # exit 0
    ({"format": suite.FORMAT + 1}, f"format: {suite.FORMAT + 1} is newer than this chaos "
                                   f"reads (format {suite.FORMAT}): a baseline from a newer "
                                   "chaos"),
    ({"scenarios": []}, "scenarios: none (no chaos suite writes a summary of no scenario): "
                        "nothing to compare with"),
])
def test_a_baseline_with_garbled_figures_is_bad_input(tmp_path: Path, change: dict[str, Any],
                                                      message: str) -> None:
    """The figures are compared only after every scenario ran: a baseline whose format or
    figures were not numbers (edited by hand, another tool's file) passed the check and then
    crashed ``compare`` with a TypeError after the whole suite, before summary.json was
    written. A NaN or a negative figure compared as a regression from it."""
    entry = _entry("a", [5.0])
    entry.update(change.get("entry", {}))
    doc = {"format": suite.FORMAT, "scenarios": [entry]}
    doc.update({k: v for k, v in change.items() if k != "entry"})
    path = tmp_path / "prev.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(suite.SuiteError) as raised:
        suite.load_baseline(path)
    assert str(raised.value).startswith(f"{path}: "), raised.value
    assert message in str(raised.value)


def test_a_baseline_with_a_number_python_will_not_read_is_bad_input(tmp_path: Path) -> None:
    """An integer of more than 4,300 digits is a ValueError of Python's int conversion, not a
    JSONDecodeError: the baseline's load ended in a traceback."""
    path = tmp_path / "prev.json"
    path.write_text('{"format": 1' + "0" * 5000 + ', "scenarios": []}')
    with pytest.raises(suite.SuiteError, match=r"prev\.json: the baseline is not JSON this can "
                       r"read: Exceeds the limit \(4300 digits\)"):
        suite.load_baseline(path)


def test_a_baseline_that_names_a_scenario_twice_is_bad_input(tmp_path: Path) -> None:
    """Two entries of one name (baselines merged by hand): ``compare`` kept the last one only
    and compared every figure with it, whichever run it came from."""
    doc = {"format": suite.FORMAT, "scenarios": [_entry("a", [5.0]), _entry("b", [1.0]),
                                                 _entry("a", [50.0])]}
    path = tmp_path / "prev.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(suite.SuiteError) as raised:
        suite.load_baseline(path)
    assert str(raised.value).startswith(f"{path}: scenarios.2 (a): "), raised.value
    assert "scenarios.0" in str(raised.value)


def test_a_baseline_of_the_first_format_without_figures_loads(tmp_path: Path) -> None:
    doc = {"scenarios": [{"name": "a", "verdict": "pass", "recovery_max_s": None}]}
    (tmp_path / "prev.json").write_text(json.dumps(doc))
    assert suite.load_baseline(tmp_path / "prev.json") == doc


def test_cli_a_garbled_baseline_is_bad_input_before_the_suite_runs(tmp_path: Path) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "broken.yaml").write_text("[1]\n")  # an entry of its own: nothing runs
    (tmp_path / "prev.json").write_text(json.dumps({"format": "3", "scenarios": []}))
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--baseline",
                                       str(tmp_path / "prev.json"), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "prev.json: format: '3' is not a summary format" in result.output
    assert not out.exists(), "bad input must be reported before anything runs"

# --- several baselines ---------------------------------------------------------------------------

#: storage-outage-s3-dp2's goodput over five nightlies; the fifth flagged against the fourth
TONIGHT = "storage-outage-s3-dp2"
NIGHTLIES = (0.580, 0.610, 0.535, 0.600)


def _nightly(goodput: float) -> dict[str, Any]:
    return _entry(TONIGHT, [10.0], goodput=goodput, wall_s=40.0)


def test_noise_against_the_last_night_is_no_regression_against_the_last_nights() -> None:
    """A nightly compared with the last summary alone failed whenever the previous night
    happened to be lucky: goodput 0.600 -> 0.545 (-5.5 points) flagged, yet the five nights
    read 0.580, 0.610, 0.535, 0.600, 0.545, and the code from before ran 0.554 and 0.566. A
    figure regresses only when it is worse than every baseline by more than the limits."""
    now = [_nightly(0.545)]
    last = suite.compare(now, _baseline(_nightly(0.600)), file="n4.json")
    assert [r["metric"] for r in last["regressions"]] == ["goodput"]  # tonight, with one
    bases = [(f"n{i}.json", _baseline(_nightly(g))) for i, g in enumerate(NIGHTLIES)]
    got = suite.compare_many(now, bases)
    assert got["regressions"] == [] and got["not_compared"] == []
    assert got["files"] == ["n0.json", "n1.json", "n2.json", "n3.json"]
    summary = suite.build(now, suite="nightly", wall_s=1.0, baseline=got)
    assert suite.exit_code(summary) == 0 and summary["ok"] is True


def test_a_run_worse_than_every_baseline_regresses_naming_the_band() -> None:
    bases = [(f"n{i}.json", _baseline(_nightly(g))) for i, g in enumerate(NIGHTLIES)]
    got = suite.compare_many([_nightly(0.45)], bases)
    (r,) = got["regressions"]
    assert (r["scenario"], r["metric"]) == (TONIGHT, "goodput")
    # compared with the worst of the baselines: the least the run had to beat
    assert r["baseline"] == 0.535 and r["against"] == "n2.json" and r["current"] == 0.45
    assert r["band"] == {"low": 0.535, "high": 0.610, "baselines": 4}
    assert "goodput 0.450 against 0.535-0.610 of 4 baselines" in r["reason"], r["reason"]
    summary = suite.build([_nightly(0.45)], suite="nightly", wall_s=1.0, baseline=got)
    assert suite.exit_code(summary) == 1
    assert f"REGRESSION {TONIGHT}: goodput 0.535 -> 0.450" in suite.format_table(summary)


def test_each_metric_regresses_only_past_its_worst_baseline() -> None:
    """Recovery and stall: higher is worse, so the highest baseline is the one to beat."""
    bases = [("a.json", _baseline(_entry("r", [10.0], stalls=(0.1, 0.1)))),
             ("b.json", _baseline(_entry("r", [12.0], stalls=(0.3, 0.3))))]
    # +25% over a's recovery, +4% over b's; the stall +100% over a's, +0% over b's
    assert suite.compare_many([_entry("r", [12.5], stalls=(0.3, 0.3))], bases)[
        "regressions"] == []
    got = suite.compare_many([_entry("r", [15.0], stalls=(0.5, 0.5))], bases)
    assert [(r["metric"], r["baseline"], r["against"]) for r in got["regressions"]] == [
        ("recovery (max)", 12.0, "b.json"), ("stall (mean)", 0.3, "b.json")]
    assert "recovery (max) 15.00 s against 10.00-12.00 s of 2 baselines" in got[
        "regressions"][0]["reason"]


def test_the_time_per_fault_counts_against_a_baseline_of_another_fault_count() -> None:
    """Goodput against a baseline that made as many faults, the time lost per fault against
    one that made another number: worse than both to regress."""
    same = _entry("mtbf", [2.5] * 8, goodput=0.50, wall_s=46.8)
    other = _entry("mtbf", [2.5] * 5, goodput=0.534, wall_s=38.2)  # 3.56 s a fault
    bases = [("same.json", _baseline(same)), ("other.json", _baseline(other))]
    # 9 points under the first, but each of its 8 faults cost 3.26 s: not worse than the other
    assert suite.compare_many([_entry("mtbf", [2.5] * 8, goodput=0.41, wall_s=46.8)],
                              bases)["regressions"] == []
    got = suite.compare_many([_entry("mtbf", [2.5] * 8, goodput=0.2, wall_s=46.8)], bases)
    assert [r["scenario"] for r in got["regressions"]] == ["mtbf"]


def test_a_baseline_that_cannot_give_the_time_per_fault_does_not_hold_a_regression_back(
        ) -> None:
    """Against a baseline of another fault count the time lost per fault is compared; one
    without ``wall_s`` (null: not measured) cannot give it, so it compared as 'not worse' and
    kept a run whose goodput fell from 0.500 to 0.050 from regressing against the other
    baseline, and its goodput widened the band it was never compared in."""
    same = _entry("mtbf", [2.5] * 8, goodput=0.50, wall_s=46.8)
    other = {**_entry("mtbf", [2.5] * 5, goodput=0.534), "wall_s": None}
    bases = [("same.json", _baseline(same)), ("other.json", _baseline(other))]
    got = suite.compare_many([_entry("mtbf", [2.5] * 8, goodput=0.05, wall_s=46.8)], bases)
    assert [(r["metric"], r["against"], r["band"]) for r in got["regressions"]] == [
        ("goodput", "same.json", {"low": 0.5, "high": 0.5, "baselines": 1})]


def test_several_baselines_compare_what_each_one_has() -> None:
    """A scenario missing from a baseline, or failing in it, is compared with the others; one
    that no baseline passed is noted, as with one baseline."""
    bases = [("a.json", _baseline(_entry("s", [10.0]), _entry("gone", [1.0]),
                                  _entry("never", [1.0], verdict="fail"))),
             ("b.json", _baseline(_entry("s", [30.0], verdict="fail"),
                                  _entry("never", [1.0], verdict="fail")))]
    now = [_entry("s", [20.0]), _entry("never", [1.0]), _entry("added", [1.0])]
    got = suite.compare_many(now, bases)
    assert [(r["scenario"], r["band"]) for r in got["regressions"]] == [
        ("s", {"low": 10.0, "high": 10.0, "baselines": 1})]
    assert got["not_compared"] == [{"scenario": "never", "reason": "failed in every baseline"}]
    assert got["new"] == ["added"] and got["missing"] == ["gone"]


def test_the_regression_reported_does_not_depend_on_the_order_of_the_baselines() -> None:
    """Two baselines as bad as each other: ``min``/``max`` kept the first given, so the same
    run regressed in 'goodput' against a.json given first and in 'lost time per fault'
    against b.json (another fault count) given first: the table's column, ``metric`` and
    ``against`` changed with the order of the --baseline options."""
    same = _entry("m", [2.5] * 8, goodput=0.50, wall_s=46.8)
    other = _entry("m", [2.5] * 5, goodput=0.50, wall_s=38.2)
    now = [_entry("m", [2.5] * 8, goodput=0.05, wall_s=46.8), _entry("r", [20.0])]
    bases = [("a.json", _baseline(same, _entry("r", [10.0]))),
             ("b.json", _baseline(other, _entry("r", [10.0])))]
    got = [suite.compare_many(now, order)["regressions"] for order in (bases, bases[::-1])]
    assert got[0] == got[1]
    assert [(r["metric"], r["against"]) for r in got[0]] == [("goodput", "a.json"),
                                                             ("recovery (max)", "a.json")]


def test_the_table_and_page_say_new_and_missing_of_several_baselines(tmp_path: Path) -> None:
    """With several baselines the table and the page said 'missing since the baseline: gone'
    of a scenario only the oldest of them had, and 'new since the baseline': there is no one
    baseline; new is in none of them, missing in one or more and not in this run."""
    bases = [("n0.json", _baseline(_entry("s", [1.0]), _entry("gone", [1.0]))),
             ("n1.json", _baseline(_entry("s", [1.0])))]
    now = [_entry("s", [1.0]), _entry("added", [1.0])]
    summary = suite.build(now, suite="s", wall_s=1.0, baseline=suite.compare_many(now, bases))
    page = suite.write_html(tmp_path, summary).read_text()
    for text in (suite.format_table(summary), page):
        assert "since the baseline" not in text, text
        assert "new (in no baseline): added" in text, text
        assert "missing (in a baseline, not in this run): gone" in text, text
    one = suite.build(now, suite="s", wall_s=1.0, baseline=suite.compare_many(now, bases[:1]))
    assert "new since the baseline: added" in suite.format_table(one)  # one: as it always was


def test_a_scenario_skipped_in_some_baselines_and_failed_in_the_others_is_said_so() -> None:
    """Skipped in one baseline (no CAP_NET_ADMIN that night), failed in the other: the note
    said 'failed in every baseline'."""
    bases = [("a.json", _baseline(_entry("s", [1.0], verdict="skipped"))),
             ("b.json", _baseline(_entry("s", [1.0], verdict="fail")))]
    got = suite.compare_many([_entry("s", [1.0])], bases)
    assert got["not_compared"] == [{"scenario": "s",
                                    "reason": "failed or skipped in every baseline"}]


def test_one_baseline_through_compare_many_is_compare() -> None:
    base = _baseline(_entry("a", [10.0]), _entry("b", [1.0], goodput=0.6))
    now = [_entry("a", [20.0]), _entry("b", [1.0], goodput=0.4)]
    env = {"cpus": 2}
    assert suite.compare_many(now, [("prev.json", base)], environment=env) == suite.compare(
        now, base, file="prev.json", environment=env)


def _fake_nightly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, goodput: float) -> Path:
    """A scenarios folder of tonight's scenario, whose run reports ``goodput``."""
    from antifragile.chaos.run import pipeline

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        folder.mkdir(parents=True, exist_ok=True)
        return type("Outcome", (), {"report": _report([10.0], goodput=goodput)})()

    monkeypatch.setattr(pipeline, "run", fake_run)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, TONIGHT, [])
    return scenarios


def _nightly_summaries(tmp_path: Path) -> list[str]:
    files = []
    for i, goodput in enumerate(NIGHTLIES):
        path = tmp_path / f"run{i}" / "summary.json"
        path.parent.mkdir()
        suite.write_json(path.parent, suite.build([_nightly(goodput)], suite="s", wall_s=1.0))
        files.append(str(path))
    return files


def test_cli_takes_several_baselines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenarios = _fake_nightly(monkeypatch, tmp_path, 0.545)
    files = _nightly_summaries(tmp_path)
    out = tmp_path / "o"
    args = ["suite", str(scenarios), "--out", str(out)]
    for f in files:
        args += ["--baseline", f]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    compared = json.loads((out / "summary.json").read_text())["baseline"]
    assert compared["files"] == files and compared["regressions"] == []
    # tonight's run against the last summary alone: flagged, as it was
    last = CliRunner().invoke(main, [*args[:4], "--baseline", files[3]])
    assert last.exit_code == 1, last.output
    assert f"REGRESSION {TONIGHT}: goodput 0.600 -> 0.545 (-5.5 points, limit -5)" in last.output
    assert json.loads((out / "summary.json").read_text())["baseline"]["file"] == files[3]


def test_cli_a_pattern_leaves_the_baselines_other_scenarios_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pattern`` runs some of the scenarios: the baseline's others were reported "missing
    since the baseline", as if the suite had lost them."""
    scenarios = _fake_nightly(monkeypatch, tmp_path, 0.58)
    _write(scenarios, "kill-rank-dp2", [])
    (tmp_path / "prev").mkdir()
    suite.write_json(tmp_path / "prev", suite.build(
        [_nightly(0.58), _entry("kill-rank-dp2", [1.0])], suite="s", wall_s=1.0))
    args = ["suite", str(scenarios), "--out", str(tmp_path / "o"), "--baseline",
            str(tmp_path / "prev" / "summary.json")]
    result = CliRunner().invoke(main, [*args, "--pattern", "storage-*"])
    assert result.exit_code == 0, result.output
    assert "missing" not in result.output, result.output
    compared = json.loads((tmp_path / "o" / "summary.json").read_text())["baseline"]
    assert compared["missing"] == [] and compared["new"] == []
    (scenarios / "kill-rank-dp2.yaml").unlink()  # gone from the folder: missing indeed
    result = CliRunner().invoke(main, args)
    assert "missing since the baseline: kill-rank-dp2" in result.output, result.output


def test_cli_a_clearly_worse_run_regresses_against_several_baselines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenarios = _fake_nightly(monkeypatch, tmp_path, 0.45)
    args = ["suite", str(scenarios), "--out", str(tmp_path / "o")]
    for f in _nightly_summaries(tmp_path):
        args += ["--baseline", f]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "goodput 0.450 against 0.535-0.610 of 4 baselines" in result.output
    assert "of 4 baselines" in (tmp_path / "o" / "summary.html").read_text()


def test_cli_a_bad_one_of_several_baselines_is_bad_input_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenarios = _fake_nightly(monkeypatch, tmp_path, 0.545)
    good = _nightly_summaries(tmp_path)[:2]
    (tmp_path / "damaged.json").write_text('{"scenarios": [')
    (tmp_path / "report.json").write_text(json.dumps(_report([1.0])))
    out = tmp_path / "o"
    for extra, message in ((str(tmp_path / "missing.json"), "missing.json: cannot read"),
                           (str(tmp_path / "damaged.json"), "damaged.json: the baseline is "
                                                            "not JSON"),
                           (str(tmp_path / "report.json"), "report.json: not a chaos suite"),
                           (good[0], f"--baseline {good[0]}: given twice"),
                           (str(Path(good[0]).parent / ".." / "run0" / "summary.json"),
                            "given twice"),
                           ("", "--baseline: empty")):
        result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out),
                                           "--baseline", good[0], "--baseline", extra,
                                           "--baseline", good[1]])
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output, (message, result.output)
        assert "Traceback" not in result.output
        assert not out.exists(), "bad input must be reported before anything runs"


# --- outputs -------------------------------------------------------------------------------------

def test_table_and_html_show_failures_regressions_and_escape(tmp_path: Path) -> None:
    good = _entry("good", [5.0])
    bad = _entry("bad", [5.0], verdict="fail")
    bad["reasons"] = ["final state differs <script>alert(1)</script>"]
    bad["skipped"] = [{"kind": "drop_link", "reason": "needs root & CAP_NET_ADMIN"}]
    compared = suite.compare([good, bad], _baseline(_entry("good", [1.0])), file="prev.json")
    summary = suite.build([good, bad], suite="scenarios/x", wall_s=12.0, baseline=compared)
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "report.html").write_text("<html></html>")
    (tmp_path / "good" / "report.md").write_text("# good")

    table = suite.format_table(summary).splitlines()
    assert table[0].split()[:2] == ["scenario", "verdict"]
    assert table[2].split()[:2] == ["good", "PASS"] and table[2].endswith("recovery (max)")
    assert table[3].split()[:2] == ["bad", "FAIL"]
    assert "FAIL bad: final state differs <script>alert(1)</script>" in table
    assert "skipped bad: drop_link: needs root & CAP_NET_ADMIN" in table
    assert table[-1] == "1 passed, 1 failed, 1 regression(s) in 12 s"

    page = suite.write_html(tmp_path, summary).read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "needs root &amp; CAP_NET_ADMIN" in page
    assert "href='good/report.html'" in page and "href='good/report.md'" in page
    assert "href='bad/" not in page  # no report was written for it: no dead link
    assert "<tr class='pass'>" in page and "<tr class='fail'>" in page
    assert "<td class='regression'>recovery (max)</td>" in page
    assert "<link" not in page and "src=" not in page  # self-contained


def test_the_html_says_which_scenarios_failed_and_which_were_skipped(tmp_path: Path) -> None:
    """summary.html listed a skipped scenario's reasons and a failed one's side by side under
    "Failures and skipped faults", each only "name: reason": the page did not say which of
    them failed, which the table prints as SKIPPED and FAIL (reports/README.md: "SKIPPED
    name: reason")."""
    skipped = _entry("netns", [5.0], verdict="skipped")
    skipped["reasons"] = ["drop_link at step 5: skipped: needs root"]
    bad = _entry("bad", [5.0], verdict="fail")
    bad["reasons"] = ["final state differs"]
    page = suite.write_html(tmp_path, suite.build([skipped, bad], suite="d", wall_s=1.0)
                            ).read_text()
    assert "<li>SKIPPED <b>netns</b>: drop_link at step 5: skipped: needs root</li>" in page
    assert "<li>FAIL <b>bad</b>: final state differs</li>" in page


def test_skipped_scenarios_are_counted_apart_and_never_ok(tmp_path: Path) -> None:
    """A scenario whose fault could not be made here was not tested: not a pass, not a
    failure. A suite with one (even only skipped ones) is not ok: exit 3 unless one failed."""
    skipped = _entry("netns", [5.0], verdict="skipped")
    skipped["reasons"] = ["drop_link at step 5: skipped: needs root"]
    skipped["skipped"] = [{"kind": "drop_link", "reason": "needs root"}]
    only = suite.build([skipped], suite="d", wall_s=1.0)
    assert only["counts"] == {"pass": 0, "fail": 0, "skipped": 1}
    assert only["ok"] is False and only["skipped"] == ["netns"] and only["failed"] == []
    assert suite.exit_code(only) == 3
    mixed = suite.build([_entry("good", [5.0]), skipped], suite="d", wall_s=1.0)
    assert mixed["ok"] is False and suite.exit_code(mixed) == 3
    failing = suite.build([_entry("bad", [5.0], verdict="fail"), skipped], suite="d", wall_s=1.0)
    assert failing["failed"] == ["bad"] and suite.exit_code(failing) == 1
    assert suite.exit_code(suite.build([_entry("good", [5.0])], suite="d", wall_s=1.0)) == 0

    table = suite.format_table(mixed).splitlines()
    assert table[3].split()[:2] == ["netns", "SKIPPED"]
    assert "SKIPPED netns: drop_link at step 5: skipped: needs root" in table
    assert not any(line.startswith(("FAIL netns", "skipped netns")) for line in table)
    assert table[-1] == "1 passed, 0 failed, 1 skipped in 1 s"
    page = suite.write_html(tmp_path, mixed).read_text()
    assert "<tr class='skipped'>" in page and "1 skipped" in page

    compared = suite.compare([skipped], _baseline(_entry("netns", [5.0])), file="b.json")
    assert compared["not_compared"] == [{"scenario": "netns", "reason": "skipped in this run"}]


def test_the_summary_page_says_what_was_not_compared_as_the_table_does(tmp_path: Path) -> None:
    """summary.html listed the regressions ("none"), new and missing scenarios, but not what
    was left out of the comparison: against an older format's baseline the page said no
    regression with the stall never compared, where summary.json and the table say so."""
    old = {"format": 2, "scenarios": [_entry("s", [10.0]), _entry("netns", [5.0])]}
    skipped = _entry("netns", [5.0], verdict="skipped")
    entries = [_entry("s", [10.0]), skipped]
    summary = suite.build(entries, suite="d", wall_s=1.0,
                          baseline=suite.compare(entries, old, file="old.json"))
    assert "not compared netns: skipped in this run" in suite.format_table(summary)
    page = suite.write_html(tmp_path, summary).read_text()
    assert "stall (mean): measured otherwise in the baseline" in page
    assert "<b>netns</b>: skipped in this run" in page


def test_the_summary_page_links_no_report_an_earlier_suite_left(tmp_path: Path) -> None:
    """``--out`` is reused (run folders are replaced when their scenario runs). A scenario
    whose file is now invalid, or that an interrupted suite never ran, has no report of this
    suite, yet summary.html linked the report.html an earlier suite left in its folder: a
    passing report beside a failed entry."""
    for name in ("broken", "never-ran", "ran"):
        (tmp_path / name).mkdir()
        for f in ("report.html", "report.md"):
            (tmp_path / name / f).write_text("an earlier suite's")
    entries = [suite.failed_entry("broken", "broken.yaml", "broken.yaml: faults.0: unknown"),
               suite.failed_entry("never-ran", "never-ran.yaml", "not run"),
               _entry("ran", [1.0])]
    page = suite.write_html(tmp_path, suite.build(entries, suite="d", wall_s=1.0)).read_text()
    assert "broken/report" not in page and "never-ran/report" not in page
    assert "href='ran/report.html'" in page and "href='ran/report.md'" in page


# --- discovery and planning ----------------------------------------------------------------------

def test_discover_and_plan_reject_bad_suites(tmp_path: Path) -> None:
    with pytest.raises(suite.SuiteError, match="no such folder"):
        suite.discover(tmp_path / "nope")
    (tmp_path / "one.yaml").write_text("name: one\n")
    with pytest.raises(suite.SuiteError, match="is a file, not a folder of scenarios"):
        suite.discover(tmp_path / "one.yaml")
    (tmp_path / "one.yaml").unlink()
    with pytest.raises(suite.SuiteError, match="no scenario files"):
        suite.discover(tmp_path)
    (tmp_path / "sub").mkdir()
    a = _write(tmp_path, "a", [])
    b = _write(tmp_path / "sub", "b", [])
    assert suite.discover(tmp_path) == [a, b]
    assert suite.discover(tmp_path, ["b"]) == [b]
    assert suite.discover(tmp_path, ["b.yaml", "a*"]) == [a, b]
    with pytest.raises(suite.SuiteError, match=r"matching 'z\*' or 'y'"):
        suite.discover(tmp_path, ["z*", "y"])

    (tmp_path / "bad.yaml").write_text("name: bad\ntrainer: {steps: 0}\n")
    planned = suite.plan(suite.discover(tmp_path), tmp_path / "out")
    invalid = next(p for p in planned if p.scenario is None)
    assert invalid.name == "bad" and "bad.yaml: trainer.steps" in (invalid.error or "")

    (tmp_path / "sub" / "again.yaml").write_text(a.read_text())
    with pytest.raises(suite.SuiteError, match=r"'a' is already used by .*a\.yaml"):
        suite.plan(suite.discover(tmp_path), tmp_path / "out")

    foreign = tmp_path / "out" / "b"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(suite.SuiteError, match="not a chaos run folder"):
        suite.plan([b], tmp_path / "out")


@pytest.mark.parametrize("link", ["gone", "loop"])
def test_a_scenario_link_that_leads_nowhere_fails_in_the_suite_not_left_out(
        tmp_path: Path, link: str) -> None:
    """A ``*.yaml`` link whose target is gone (a share not mounted) or that loops was left out
    of the suite without a word, as a folder is: the suite passed without that scenario (or
    said the folder had no scenario files). It is listed, and fails as unreadable."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    a = _write(scenarios, "a", [])
    b = scenarios / "b.yaml"
    b.symlink_to("nowhere.yaml" if link == "gone" else "b.yaml")
    (scenarios / "c.yaml").mkdir()  # a folder named so is no scenario: looked into
    assert suite.discover(scenarios) == [a, b]
    planned = suite.plan([b], tmp_path / "out")
    assert planned[0].scenario is None
    assert planned[0].error is not None and f"{b}: cannot read: " in planned[0].error


def test_a_file_where_a_scenarios_folder_goes_is_bad_input_not_a_traceback(
        tmp_path: Path) -> None:
    """A file in OUT named like a scenario (``OUT/a``, where its report folder goes) was
    listed as a folder to see whether it was a run's: NotADirectoryError, a traceback before
    anything ran."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    a = _write(scenarios, "a", [])
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("mine")
    with pytest.raises(suite.SuiteError, match=r"out/a: exists and is not a chaos run folder"):
        suite.plan([a], out)
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 2 and "not a chaos run folder" in result.output, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert (out / "a").read_text() == "mine"


@pytest.mark.parametrize("own", ["run", "ckpt"])
def test_a_folder_with_a_run_or_ckpt_of_its_own_is_not_replaced(tmp_path: Path,
                                                                 own: str) -> None:
    """A suite deletes ``OUT/<name>/`` whole before it runs the scenario there. A folder
    holding a ``run/`` or ``ckpt/`` counted as an earlier run's: ``chaos suite scenarios
    --out .`` in a project with a folder named like a scenario, holding a ``ckpt/`` of its
    own, deleted that folder. As for ``chaos run --out``, a run folder is one that holds
    ``report.json``, ``error.txt`` or the ``run/torchrun.log`` of a run cut short."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    a = _write(scenarios, "a", [])
    mine = tmp_path / "out" / "a" / own
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(suite.SuiteError, match=r"out/a: exists and is not a chaos run folder"):
        suite.plan([a], tmp_path / "out")
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "not a chaos run folder" in result.output, result.output
    assert (mine / "notes.txt").read_text() == "mine"

    for marker in ("report.json", "error.txt", "run/torchrun.log"):  # ours: replaced
        folder = tmp_path / marker.replace("/", "-") / "a"
        (folder / marker).parent.mkdir(parents=True)
        (folder / marker).write_text("")
        (folder / "ckpt").mkdir()
        assert [p.name for p in suite.plan([a], folder.parent)] == ["a"]


@pytest.mark.parametrize("name", ["summary.json", "summary.html"])
def test_a_scenario_may_not_be_named_after_the_summary_files(tmp_path: Path, name: str) -> None:
    """``OUT/<name>/`` is the scenario's report folder: one named summary.json ran, then
    writing the summary over its folder raised IsADirectoryError after every scenario had
    run, and the suite's summary was lost."""
    _write(tmp_path, "a", [])
    (tmp_path / "a.yaml").write_text((tmp_path / "a.yaml").read_text()
                                     .replace("name: a", f"name: {name}"))
    with pytest.raises(suite.SuiteError) as raised:
        suite.plan(suite.discover(tmp_path), tmp_path / "out")
    assert str(raised.value) == (f"{tmp_path / 'a.yaml'}: scenario name {name!r} is the "
                                 f"suite's own {name} in the output folder; rename the "
                                 "scenario")


def test_an_invalid_files_name_may_not_be_a_scenarios_name(tmp_path: Path) -> None:
    """An invalid file's entry is named after the file. ``foo.yaml`` invalid beside a valid
    ``name: foo`` in ``a.yaml`` passed the unique-name check, and the summary held two
    entries named ``foo``: the comparison with a baseline (keyed by name) kept only the later
    one, so the valid scenario's figures were never compared, or its regression was hidden."""
    doc = yaml.safe_load(_write(tmp_path, "a", []).read_text())
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({**doc, "name": "foo"}))
    (tmp_path / "foo.yaml").write_text("name: foo\ntrainer: {steps: 0}\n")
    with pytest.raises(suite.SuiteError, match=r"foo\.yaml: scenario name 'foo' is already "
                                               r"used by .*a\.yaml"):
        suite.plan(suite.discover(tmp_path), tmp_path / "out")
    (tmp_path / "sub").mkdir()  # two invalid files of one name, in two folders
    (tmp_path / "a.yaml").unlink()
    (tmp_path / "sub" / "foo.yml").write_text("name: [\n")
    with pytest.raises(suite.SuiteError, match=r"'foo' is already used by .*foo\.yaml"):
        suite.plan(suite.discover(tmp_path), tmp_path / "out")


def test_a_scenario_named_dot_or_dot_dot_is_invalid_not_run_into_out_or_its_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scenario runs into ``OUT/<name>/``, cleared first: a name ``.`` cleared OUT (the
    reports of the scenarios before it), ``..`` the folder above OUT."""
    from antifragile.chaos.run import pipeline

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        return _passed(folder, report_file=True)

    monkeypatch.setattr(pipeline, "run", fake_run)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "a.yaml").write_text("name: a\n")
    (scenarios / "b.yaml").write_text("name: '.'\n")
    (scenarios / "c.yaml").write_text("name: '..'\n")
    (tmp_path / "keep.txt").write_text("not the suite's")
    out = tmp_path / "out"
    planned = suite.plan(suite.discover(scenarios), out)
    entries = suite.run_suite(planned, out, progress=lambda _: None)
    assert (out / "a" / "report.json").is_file() and (tmp_path / "keep.txt").is_file()
    assert [e["verdict"] for e in entries] == ["pass", "fail", "fail"]
    assert "b.yaml: name: '.' names no folder of its own" in entries[1]["reasons"][0]
    assert "c.yaml: name: '..' names no folder of its own" in entries[2]["reasons"][0]


def test_cli_bad_input_exits_2_without_traceback(tmp_path: Path) -> None:
    runner = CliRunner()
    for args in (["suite", str(tmp_path / "missing")], ["suite", str(tmp_path)]):
        result = runner.invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and "Traceback" not in result.output
    _write(tmp_path, "a", [])
    (tmp_path / "prev.json").write_text("[]")
    result = runner.invoke(main, ["suite", str(tmp_path), "--baseline",
                                  str(tmp_path / "prev.json"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "not a chaos suite summary" in result.output
    assert not (tmp_path / "o").exists(), "bad input must be reported before anything runs"


def test_an_empty_baseline_is_bad_input_not_a_suite_without_one(tmp_path: Path) -> None:
    """``--baseline "$PREV"`` with PREV unset or empty: the empty name was taken for no
    baseline at all, so the suite ran, compared nothing and exited 0 with no word that the
    regression check the caller asked for had not been made."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "broken.yaml").write_text("[1]\n")  # an entry of its own: nothing runs
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--baseline", "",
                                       "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith("error: --baseline: empty"), result.output
    assert not out.exists(), "bad input must be reported before anything runs"

def test_cli_out_folder_that_cannot_be_made_and_bad_floors_are_bad_input(
        tmp_path: Path) -> None:
    """``--out`` below a file was a NotADirectoryError traceback (exit 1); a NaN noise floor
    silently turned every regression check off (``diff > nan`` is never true)."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "broken.yaml").write_text("[1]\n")  # an entry of its own: nothing runs
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(blocker / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip() == (f"error: --out {blocker / 'o'}: cannot create the folder: "
                                     "Not a directory")
    for option, value in (("--recovery-floor-s", "nan"), ("--stall-floor-s", "-1.0"),
                          ("--stall-floor-s", "inf")):
        out = tmp_path / "o"
        result = CliRunner().invoke(main, ["suite", str(scenarios), option, value,
                                           "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert f"{option} {value}: must be a finite number >= 0 seconds" in result.output
        assert not out.exists(), "bad input must be reported before anything runs"


def test_no_reference_with_a_bitwise_expectation_is_bad_input(tmp_path: Path) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, "a", [])
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--no-reference",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert "expect.bitwise_equal_to_reference is true, but --no-reference" in result.output
    assert str(scenarios / "a.yaml") in result.output
    assert not (tmp_path / "o").exists(), "bad input must be reported before anything runs"


def test_invalid_files_and_a_crashing_runner_are_failed_entries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither stops the suite: every scenario gets an entry, the exit code is 1."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "broken.yaml").write_text("name: broken\nfaults:\n  - {kind: meteor}\n")
    _write(scenarios, "runs", [{"kind": "kill_rank", "rank": 1, "at_step": 10}])
    # The reference cache path is a file: the runner fails for real on the file system.
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 1, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["counts"] == {"pass": 0, "fail": 2, "skipped": 0}
    broken, runs = summary["scenarios"]
    assert broken["name"] == "broken" and broken["file"].endswith("broken.yaml")
    assert "unknown fault kind 'meteor'" in broken["reasons"][0]
    assert runs["reasons"][0].startswith("the runner crashed: ")
    assert runs["error"] == "runs/error.txt" and (out / "runs" / "error.txt").is_file()
    assert "href='runs/error.txt'" in (out / "summary.html").read_text()
    assert "Traceback" not in result.output


def test_a_refused_checkpoint_storage_is_a_failed_entry_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage refused before the run (``chaos run`` says so in one line, exit 2) fails the
    scenario with that reason: it read "the runner crashed: StorageSetupError: ..." and left a
    traceback in error.txt, as for a bug."""
    from antifragile.chaos.run import pipeline

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(pipeline, "run_scenario", must_not_run)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    url = tmp_path / "a-file"
    url.write_text("not a folder")
    (scenarios / "s.yaml").write_text(f"name: s\ncheckpoint: {{url: {url}}}\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 1, result.output
    (entry,) = json.loads((out / "summary.json").read_text())["scenarios"]
    assert entry["reasons"] == [f"checkpoint.url {url}: {url} is a file, not a checkpoint "
                                "folder"], entry["reasons"]
    assert entry.get("error") is None and not (out / "s" / "error.txt").exists()


def _three_scenarios_and_an_ok_summary(tmp_path: Path) -> tuple[Path, Path]:
    """Scenarios a, b and c, and an --out that an earlier suite of them left an ok
    summary.json in: (the scenarios' folder, --out)."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    for name in ("a", "b", "c"):
        _write(scenarios, name, [])
    out = tmp_path / "out"
    out.mkdir()
    suite.write_json(out, suite.build([_entry(n, [1.0]) for n in ("a", "b", "c")], suite="s",
                                      wall_s=1.0))
    return scenarios, out


@pytest.mark.parametrize(("stop", "code"), [(KeyboardInterrupt, 130), (SystemExit(143), 143)],
                         ids=["ctrl-c", "sigterm"])
def test_an_interrupted_suite_writes_a_summary_of_what_ran_that_is_not_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException, code: int) -> None:
    """Ctrl-C (or a CI timeout's SIGTERM) in the middle of a suite wrote no summary: the
    figures of the scenarios that had run were lost, and a summary.json that an earlier suite
    left in the same --out (run folders are replaced, so --out is reused) stayed, saying ok
    for a suite that did not end."""
    from antifragile.chaos.run import pipeline

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        if s.name == "b":
            raise stop
        return _passed(folder, report_file=True)

    monkeypatch.setattr(pipeline, "run", fake_run)
    scenarios, out = _three_scenarios_and_an_ok_summary(tmp_path)
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == code, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["counts"] == {"pass": 1, "fail": 2, "skipped": 0}
    a, b, c = summary["scenarios"]
    assert (a["name"], a["verdict"], a["recovery_max_s"]) == ("a", "pass", 1.0)
    assert b["verdict"] == "fail" and b["reasons"] == ["interrupted: the suite was stopped "
                                                       "while it ran"]
    assert c["verdict"] == "fail" and c["reasons"] == ["not run: the suite was stopped before it"]
    assert (out / "summary.html").is_file()
    assert "1 passed, 2 failed" in result.output


@pytest.mark.parametrize(("stop", "code"), [(KeyboardInterrupt, 130), (SystemExit(143), 143)],
                         ids=["ctrl-c", "sigterm"])
def test_a_suite_interrupted_between_runs_still_writes_its_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException, code: int) -> None:
    """Only the run itself was guarded: Ctrl-C or SIGTERM while the previous run's folder of
    the next scenario was being deleted (its checkpoints: the longest wait outside a run)
    ended the suite with no summary, and an earlier suite's summary.json in the reused --out
    stayed, saying ok."""
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.suite import runner

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        return _passed(folder, report_file=True)

    real_fresh = runner._fresh

    def fresh(folder: Path) -> None:
        if folder.name == "b":
            raise stop
        real_fresh(folder)

    monkeypatch.setattr(pipeline, "run", fake_run)
    monkeypatch.setattr(runner, "_fresh", fresh)
    scenarios, out = _three_scenarios_and_an_ok_summary(tmp_path)
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == code, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["counts"] == {"pass": 1, "fail": 2, "skipped": 0}
    assert [e["reasons"] for e in summary["scenarios"]] == [
        [], ["interrupted: the suite was stopped while it ran"],
        ["not run: the suite was stopped before it"]]


def test_no_earlier_summary_stands_in_out_while_the_suite_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--out is reused; an earlier suite's summary.json (ok) stayed there until this suite's
    replaced it at the end, so a suite killed outright (SIGKILL, a CI runner lost) left it
    beside this suite's run folders, passing for this suite's."""
    from antifragile.chaos.run import pipeline

    out = tmp_path / "out"
    seen: list[bool] = []

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        seen.append(any((out / f).exists() for f in ("summary.json", "summary.html")))
        return _passed(folder, report_file=True)

    monkeypatch.setattr(pipeline, "run", fake_run)
    out.mkdir()
    earlier = suite.build([_entry("a", [1.0])], suite="s", wall_s=1.0)
    suite.write_json(out, earlier)
    suite.write_html(out, earlier)
    _suite_of_a_and_b(tmp_path, out)
    assert seen == [False, False]


@pytest.mark.parametrize("name", ["summary.json", "summary.html"])
def test_a_summary_file_the_suite_did_not_write_is_not_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Before it runs, a suite removes the summary an earlier suite left in a reused --out.
    It removed any file of that name: ``chaos suite scenarios --out .`` in a project with a
    summary.json (or summary.html) of its own deleted it. A summary file in OUT that is not
    one chaos suite wrote is refused, as a folder where a scenario's goes is, before anything
    runs; an earlier suite's is still replaced."""
    from antifragile.chaos.run import pipeline

    ran: list[str] = []

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        ran.append(s.name)
        return _passed(folder, report_file=True)

    monkeypatch.setattr(pipeline, "run", fake_run)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, "a", [])
    out = tmp_path / "project"
    out.mkdir()
    (out / name).write_text('{"mine": true}\n')
    with pytest.raises(suite.SuiteError, match=rf"project/{name}: exists and is not a summary "
                                               r"chaos suite wrote; not replacing it"):
        suite.plan(suite.discover(scenarios), out)
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 2 and "not replacing it" in result.output, result.output
    assert (out / name).read_text() == '{"mine": true}\n' and ran == []

    (out / name).unlink()  # an earlier suite's own summary: replaced by this one's
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert ran == ["a", "a"] and json.loads((out / "summary.json").read_text())["ok"]


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_figure_that_is_not_finite_is_written_as_null_and_the_summary_stays_a_baseline(
        tmp_path: Path) -> None:
    """json.dumps wrote NaN and Infinity bare: jq and browsers refuse such a summary.json, and
    the next night's ``--baseline`` refused it as garbled."""
    entry = {**_entry("a", [1.0]), "goodput": float("nan"), "stall_mean_s": float("inf")}
    suite.write_json(tmp_path, suite.build([entry], suite="s", wall_s=1.0))
    (written,) = _strict((tmp_path / "summary.json").read_text())["scenarios"]
    assert written["goodput"] is None and written["stall_mean_s"] is None
    assert written["recovery_max_s"] == 1.0
    suite.load_baseline(tmp_path / "summary.json")


def _suite_of_a_and_b(tmp_path: Path, out: Path) -> list[dict[str, Any]]:
    """The entries of a suite of two fault-free scenarios, ``a`` and ``b``."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    for name in ("a", "b"):
        _write(scenarios, name, [])
    return suite.run_suite(suite.plan(suite.discover(scenarios), out), out,
                           progress=lambda _: None)


def test_a_runner_crash_whose_traceback_cannot_be_written_is_still_one_failed_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner that failed on the file system (a full disk) often cannot have its traceback
    written either: writing error.txt raised out of run_suite, so one scenario's failure
    stopped the suite, the scenarios after it never ran and no summary was written."""
    from antifragile.chaos.run import pipeline

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        if s.name == "a":
            (folder / "error.txt").mkdir(parents=True)  # error.txt cannot be written
            raise OSError(28, "No space left on device")
        return _passed(folder)

    monkeypatch.setattr(pipeline, "run", fake_run)
    out = tmp_path / "out"
    entries = _suite_of_a_and_b(tmp_path, out)
    assert [(e["name"], e["verdict"]) for e in entries] == [("a", "fail"), ("b", "pass")]
    assert entries[0]["error"] is None
    assert entries[0]["reasons"][0].startswith(
        "the runner crashed: OSError: [Errno 28] No space left on device (its traceback could "
        "not be written: ")


def test_a_run_that_could_not_be_made_is_a_failed_entry_with_its_reason_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ChaosRunError (a failed fault-free reference run, a run past its time limit: what
    ``chaos run`` reports as no verdict, exit 5, its message as is) was reported as "the
    runner crashed", with a traceback in error.txt claiming a crash."""
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.run.runner import RunTimeout

    why = "the run went past its time limit of 600 s (killed)"

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        folder.mkdir(parents=True, exist_ok=True)
        if s.name == "a":
            raise RunTimeout(why)
        return _passed(folder)

    monkeypatch.setattr(pipeline, "run", fake_run)
    out = tmp_path / "out"
    entries = _suite_of_a_and_b(tmp_path, out)
    assert [(e["name"], e["verdict"]) for e in entries] == [("a", "fail"), ("b", "pass")]
    assert entries[0]["reasons"] == [why]
    assert entries[0]["error"] is None
    assert not (out / "a" / "error.txt").exists()


@pytest.mark.parametrize("unwritable", ["summary.json", "summary.html"])
def test_a_summary_that_cannot_be_written_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unwritable: str) -> None:
    """A full disk (or a folder made read-only meanwhile) when the summary is written at the
    end of a suite: a traceback, and a summary.json cut short (or an earlier suite's, saying
    ok) left for CI to read."""
    import errno

    from antifragile.chaos.run import pipeline

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        return _passed(folder)

    writer = {"summary.json": "write_json", "summary.html": "write_html"}[unwritable]
    real = getattr(suite, writer)

    def full_disk(out: Path, summary: dict[str, Any]) -> Path:
        (out / unwritable).write_text("{cut sho")  # what a write stopped midway leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "run", fake_run)
    monkeypatch.setattr(suite, writer, full_disk)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, "a", [])
    out = tmp_path / "out"
    out.mkdir()
    real(out, suite.build([_entry("a", [1.0])], suite="s", wall_s=1.0))  # an earlier suite's
    result = CliRunner().invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: {out / unwritable}: cannot be written: No space left on device")
    assert not (out / unwritable).exists()  # neither cut short nor an earlier suite's


# --- shipped files -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(ROOT / "scenarios")))
def test_every_shipped_scenario_validates(path: Path) -> None:
    load_scenario(path)


def test_shipped_scenario_names_are_unique() -> None:
    """So ``chaos suite scenarios`` runs everything shipped, nightly included."""
    suite.plan(suite.discover(ROOT / "scenarios"), Path("/nonexistent"))


def test_nightly_suite_covers_kinds_layouts_storage_and_engines() -> None:
    planned = suite.plan(suite.discover(ROOT / "scenarios" / "nightly"), Path("/nonexistent"))
    scenarios = [p.scenario for p in planned if p.scenario is not None]
    assert len(scenarios) == len(planned), [p.error for p in planned if p.error]
    kinds = {f.kind for s in scenarios for f in s.faults}
    assert kinds >= {"kill_rank", "hang_rank", "crash_during_save", "corrupt_shard",
                     "storage_outage", "drop_link"}
    layouts = {(s.trainer.parallel.dp, s.trainer.parallel.tp, s.trainer.parallel.pp)
               for s in scenarios if not s.is_command}
    assert len(layouts) >= 2
    assert {s.trainer.recovery for s in scenarios if not s.is_command} == {"restart",
                                                                          "in_process"}
    assert any(s.is_command for s in scenarios)  # a user's own script, nightly too
    assert any((s.checkpoint.url or "").startswith("s3://") for s in scenarios)
    assert any(s.checkpoint.url is None for s in scenarios)
    assert {s.checkpoint.engine for s in scenarios} == {"antifragile", "dcp", "torchsnapshot"}
    assert any(getattr(f, "mtbf_s", None) for s in scenarios for f in s.faults)


def test_nightly_workflow_runs_the_suite_against_the_last_summary() -> None:
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers["schedule"][0]["cron"] and "workflow_dispatch" in triggers
    (job,) = wf["jobs"].values()
    steps = job["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "download.pytorch.org/whl/cpu" in runs and "-c constraints-cpu.txt" in runs
    assert "chaos suite scenarios/nightly --out reports/nightly" in runs
    assert "--baseline" in runs and "pytest -m slow" in runs
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and "reports/" in upload["with"]["path"]


@pytest.mark.timeout(30)
def test_nightly_shows_the_suite_table_in_the_job_summary_when_the_suite_fails(
        tmp_path: Path) -> None:
    """The step runs under ``bash -eo pipefail``: a failing ``chaos suite | tee`` ended it
    before the table was appended to the job summary, so the table was shown only on the
    nights that passed; the step must still fail with the suite's exit code."""
    import os
    import subprocess

    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    (job,) = wf["jobs"].values()
    step = next(s for s in job["steps"] if "chaos suite scenarios/nightly" in s.get("run", ""))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # sudo -E CMD...
    (bin_dir / "chaos").write_text("#!/bin/sh\necho 'FAIL kill-rank-dp2: bad'\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    job_summary = tmp_path / "step-summary.md"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "BASELINE": "",
           "GITHUB_STEP_SUMMARY": str(job_summary)}
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                           step["run"]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 1, done
    assert "FAIL kill-rank-dp2: bad" in job_summary.read_text()


def test_nightly_crashcheck_runs_every_engine_and_shows_every_table_when_one_fails(
        tmp_path: Path) -> None:
    """Under ``bash -eo pipefail`` antifragile's failing crashcheck at 1 rank ended the step:
    the 2-rank check and the peers' never ran, and no table reached the job summary. Every
    check runs, every table is shown, and the step fails."""
    import os
    import subprocess

    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    (job,) = wf["jobs"].values()
    step = next(s for s in job["steps"] if "chaos crashcheck" in s.get("run", ""))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    chaos = bin_dir / "chaos"  # writes its table; antifragile at 1 rank fails (exit 1)
    chaos.write_text('#!/bin/sh\nout=""; engine=""; ranks=""\n'
                     'while [ $# -gt 0 ]; do case "$1" in --out) out=$2;; --engine) engine=$2;;'
                     ' --ranks) ranks=$2;; esac; shift; done\n'
                     'mkdir -p "$out"; echo "table $engine $ranks" > "$out/crashcheck.md"\n'
                     '[ "$engine-$ranks" = antifragile-1 ] && exit 1\n'
                     '[ "$engine" = dcp ] && exit 1\nexit 0\n')
    chaos.chmod(0o755)
    job_summary = tmp_path / "step-summary.md"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GITHUB_STEP_SUMMARY": str(job_summary)}
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                           step["run"]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 1, done
    shown = job_summary.read_text()
    for engine in ("antifragile", "dcp", "torchsnapshot"):
        for ranks in (1, 2):
            assert f"table {engine} {ranks}" in shown, shown



def test_nightly_runs_the_suite_without_a_baseline_when_fetching_one_fails(
        tmp_path: Path) -> None:
    """``run_id=$(gh run list ...)`` under ``bash -e``: a failing ``gh`` (an API outage, a
    rate limit) ended the baseline step, and the suite step after it (no ``if:``) was skipped:
    no nightly ran at all. A baseline that cannot be fetched is a night without one."""
    import os
    import subprocess

    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    (job,) = wf["jobs"].values()
    step = next(s for s in job["steps"] if s.get("id") == "baseline")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gh").write_text("#!/bin/sh\necho 'HTTP 502: Bad Gateway' >&2\nexit 1\n")
    (bin_dir / "gh").chmod(0o755)
    output = tmp_path / "output"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GITHUB_OUTPUT":
           str(output), "GITHUB_REPOSITORY": "o/r", "GITHUB_REF_NAME": "main"}
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                           step["run"]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 0, done
    assert not output.exists() or "summary=" not in output.read_text()
    assert "no previous successful nightly summary" in done.stdout


@pytest.mark.timeout(30)
def test_nightly_compares_with_each_of_the_last_summaries_that_could_be_fetched(
        tmp_path: Path) -> None:
    """The last 5 successful runs' summaries, each download on its own: one that fails (an
    expired artifact) leaves the others, and the suite gets a --baseline for each."""
    import os
    import subprocess

    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly.yml").read_text())
    (job,) = wf["jobs"].values()
    fetch = next(s for s in job["steps"] if s.get("id") == "baseline")
    suite_step = next(s for s in job["steps"]
                      if "chaos suite scenarios/nightly" in s.get("run", ""))
    assert "--limit 5" in fetch["run"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gh").write_text(  # three runs; 22's artifact is gone
        '#!/bin/sh\ncase "$1 $2" in\n"run list") printf "33\\n22\\n11\\n";;\n'
        '"run download") [ "$3" = 22 ] && exit 1\n'
        '  while [ $# -gt 0 ]; do [ "$1" = --dir ] && d=$2; shift; done\n'
        '  mkdir -p "$d/nightly" && echo {} > "$d/nightly/summary.json";;\nesac\n')
    (bin_dir / "sudo").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # sudo -E CMD...
    (bin_dir / "chaos").write_text('#!/bin/sh\necho "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    output = tmp_path / "output"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GITHUB_OUTPUT":
           str(output), "GITHUB_REPOSITORY": "o/r", "GITHUB_REF_NAME": "main",
           "GITHUB_STEP_SUMMARY": str(tmp_path / "step-summary.md")}
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                           fetch["run"]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 0, done
    (line,) = output.read_text().splitlines()
    assert line == ("summaries=previous/33/nightly/summary.json "
                    "previous/11/nightly/summary.json"), line
    assert "run 22: no summary fetched" in done.stdout
    ran = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                          suite_step["run"]], cwd=tmp_path,
                         env={**env, "BASELINES": line.split("=", 1)[1]},
                         capture_output=True, text=True, timeout=20)
    assert ran.returncode == 0, ran
    assert ("--baseline previous/33/nightly/summary.json --baseline "
            "previous/11/nightly/summary.json") in ran.stdout, ran.stdout

# --- a real suite --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_real_suite_one_pass_one_fail_then_a_regression(tmp_path: Path) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, "kill", [{"kind": "kill_rank", "rank": 1, "at_step": 10}],
           max_recovery_s=120, max_lost_steps=4)
    # Killed 3 steps after the checkpoint of step 12: losing 0 steps is impossible.
    _write(scenarios, "too-strict", [{"kind": "kill_rank", "rank": 0, "at_step": 15}],
           max_lost_steps=0)
    out = tmp_path / "out"
    env = {"ANTIFRAGILE_CACHE": str(tmp_path / "cache")}
    result = CliRunner(env=env).invoke(main, ["suite", str(scenarios), "--out", str(out)])
    assert result.exit_code == 1, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {"pass": 1, "fail": 1, "skipped": 0}
    assert summary["failed"] == ["too-strict"]
    kill, strict = summary["scenarios"]
    assert kill["verdict"] == "pass" and kill["bitwise_equal"] is True
    assert 0 < kill["recovery_max_s"] < 120 and kill["lost_steps"] <= 4
    assert 0 < kill["goodput"] < 1 and kill["stall_mean_s"] > 0
    assert kill["report"] == "kill/report.json" and (out / "kill" / "report.json").is_file()
    assert strict["lost_steps"] >= 3
    assert any("steps lost > max_lost_steps 0" in r for r in strict["reasons"])
    assert "kill" in result.output and "FAIL too-strict:" in result.output
    page = (out / "summary.html").read_text()
    assert "href='kill/report.md'" in page and "<tr class='fail'>" in page

    # The same passing scenario against a baseline that recovered far faster than any restart
    # can (new processes, `import torch`: over 1 s anywhere): a regression whatever this
    # run's recovery. (Half the first run's figure was not enough: the first run's restart
    # pays for cold caches, so the second one can be twice as fast.)
    # Only the recovery is the point here: noise of the loaded 2-core machine (the second
    # run's stall mean was once 0.06 s over the first's) cannot beat this baseline's stall
    # or goodput.
    faster = {**kill, "recovery_max_s": 0.01, "stall_mean_s": 1e3, "goodput": 0.0}
    (tmp_path / "prev.json").write_text(json.dumps({**summary, "scenarios": [faster, strict]}))
    again = CliRunner(env=env).invoke(main, [
        "suite", str(scenarios), "--pattern", "kill", "--out", str(out),
        "--baseline", str(tmp_path / "prev.json")])
    assert again.exit_code == 1, again.output
    second = json.loads((out / "summary.json").read_text())
    # too-strict is in the baseline, but --pattern left it out of this run: not missing
    assert second["failed"] == [] and second["baseline"]["missing"] == []
    assert [r["metric"] for r in second["baseline"]["regressions"]] == ["recovery (max)"]
    assert "REGRESSION kill: recovery (max)" in again.output


def test_a_figure_the_baseline_measured_and_this_run_did_not_is_noted() -> None:
    """A passing run whose recovery, stall or goodput went unmeasured had nothing to compare
    with the baseline's figure: the comparison said neither regression nor anything else, so
    a figure that stopped being measured read as one that held."""
    base = _baseline(_entry("s", [10.0]))
    now = [_entry("s", [])]
    now[0]["stall_mean_s"] = None
    got = suite.compare(now, base, file="b.json")
    assert got["regressions"] == []
    assert [n["reason"] for n in got["not_compared"]] == [
        "recovery (max): measured in the baseline (10.00 s), not in this run",
        "stall (mean): measured in the baseline (0.02 s), not in this run"]


#: a locale whose encoding is ASCII (Python's UTF-8 mode and C-locale coercion turned off), as
#: a machine set to a Latin-1 or plain C locale has it
ASCII_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def test_the_summary_page_is_utf_8_whatever_the_locale(tmp_path: Path) -> None:
    """Scenario files are read as UTF-8 whatever the locale, and summary.html says it is
    UTF-8, but it was written in the locale's encoding: under an ASCII locale an invalid
    scenario's reason naming a key "tränier" raised UnicodeEncodeError once the suite was
    over, a traceback and an empty summary.html left behind."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "a.yaml").write_text("name: a\ntränier: {}\n", encoding="utf-8")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", "from antifragile.chaos.cli import main; main()", "suite",
         str(scenarios), "--out", str(out)],
        capture_output=True, env={**os.environ, **ASCII_LOCALE}, timeout=120)
    stderr = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 1 and "Traceback" not in stderr, stderr
    page = (out / "summary.html").read_bytes().decode("utf-8")
    assert "tränier: unknown key" in page


def test_a_runner_crash_with_a_non_ascii_message_is_one_failed_entry_whatever_the_locale(
        tmp_path: Path) -> None:
    """error.txt was written in the locale's encoding: under an ASCII locale a runner crash
    whose message held a non-ASCII character (a path, a library's message) raised
    UnicodeEncodeError out of run_suite, so the suite stopped with a traceback and no
    summary."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, "a", [])
    code = """if True:
        import sys
        from pathlib import Path
        from antifragile.chaos import suite
        from antifragile.chaos.run import pipeline

        def crash(s, folder, **kw):
            raise RuntimeError("no such file: /data/caf\\u00e9/x")  # ASCII argv

        pipeline.run = crash
        out = Path(sys.argv[2])
        planned = suite.plan(suite.discover(Path(sys.argv[1])), out)
        entries = suite.run_suite(planned, out, progress=lambda _: None)
        print(entries[0]["verdict"], entries[0]["error"])
    """
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", code, str(scenarios), str(out)],
                          capture_output=True, env={**os.environ, **ASCII_LOCALE}, timeout=120)
    assert done.returncode == 0, done.stderr.decode("utf-8", "replace")
    assert done.stdout.decode().split() == ["fail", "a/error.txt"]
    assert "no such file: /data/café/x" in (out / "a" / "error.txt").read_bytes().decode("utf-8")


def test_two_suites_started_in_the_same_second_get_folders_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``chaos suite`` side by side started within one second were given the same
    default ``reports/suite-<UTC time>``, and each cleared the other's run folders."""
    import importlib
    import time as real_time

    from antifragile.chaos.run import pipeline

    suite_cli = importlib.import_module("antifragile.chaos.cli.suite")  # the module, not the
    # command the package exports under that name

    folders: list[Path] = []

    def fake_run(s: Any, folder: Path, **kw: Any) -> Any:
        folders.append(folder.parent)
        return _passed(folder, report_file=True)

    monkeypatch.setattr(pipeline, "run", fake_run)
    frozen = real_time.gmtime(1_765_000_000)
    monkeypatch.setattr(suite_cli.time, "gmtime", lambda *_: frozen)
    monkeypatch.chdir(tmp_path)
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    _write(scenarios, "a", [])
    for _ in range(2):
        r = CliRunner().invoke(main, ["suite", str(scenarios)])
        assert r.exit_code == 0, r.output
    assert len(folders) == 2 and folders[0] != folders[1], folders
    assert all(f.name.startswith("suite-20251206T") for f in folders), folders


def test_a_baseline_from_another_machine_is_said_to_be_one(tmp_path: Path) -> None:
    """Every figure compared is a time on the machine that ran it: a baseline from a runner
    with other cores, another torch or Python was compared with no word of it, so a slower
    machine read as a regression (and a faster one hid one). The figures are compared all
    the same; the table, summary.json and summary.html say what differs."""
    here = {"python": "3.11.9", "torch": "2.13.0+cpu", "platform": "Linux-6.8-x86_64",
            "cpus": 2, "cuda": False}
    base = _baseline(_entry("s", [10.0]))
    base["environment"] = {**here, "cpus": 4, "torch": "2.12.0+cpu"}
    got = suite.compare([_entry("s", [10.0])], base, file="prev/summary.json",
                        environment=here)
    assert got["environment"] == ["cpus: 4 -> 2", "torch: 2.12.0+cpu -> 2.13.0+cpu"]
    summary = suite.build([_entry("s", [10.0])], suite="d", wall_s=1.0, baseline=got)
    table = suite.format_table(summary)
    assert ("the baseline ran on another machine (cpus: 4 -> 2; torch: 2.12.0+cpu -> "
            "2.13.0+cpu)") in table, table
    assert "another machine" in suite.write_html(tmp_path, summary).read_text()
    # the same machine, or a baseline that did not record one: nothing to say
    base["environment"] = dict(here)
    same = suite.compare([_entry("s", [10.0])], base, file="b.json", environment=here)
    assert same["environment"] == []
    del base["environment"]
    unknown = suite.compare([_entry("s", [10.0])], base, file="b.json", environment=here)
    assert unknown["environment"] == []
    assert "another machine" not in suite.format_table(
        suite.build([_entry("s", [10.0])], suite="d", wall_s=1.0, baseline=unknown))
