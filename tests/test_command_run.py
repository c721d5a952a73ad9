"""``chaos run`` on a user's own script (tests/_user_script.py) under torchrun: faults from
outside, recovery measured from the probe's and the engine's events, the verdict on the newest
committed checkpoints, and the verdicts a misbehaving script earns."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.run.pipeline import run
from antifragile.chaos.scenario import parse_scenario
from tests._reports import check_restored

pytestmark = pytest.mark.multiproc

SCRIPT = str(Path(__file__).with_name("_user_script.py"))


@pytest.fixture
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("reference-cache")
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(folder))
    return folder


def _scenario(name: str, args: list[str], faults: list[dict[str, Any]], *, probe: bool = True,
              **expect: Any) -> dict[str, Any]:
    return {"name": name, "seed": 3,
            "trainer": {"command": ["python", SCRIPT, *args], "nproc_per_node": 2,
                        "probe": probe},
            "faults": faults, "expect": {"bitwise_equal_to_reference": True, **expect}}


def test_a_killed_script_resumes_and_ends_bitwise_equal(tmp_path: Path, cache: Path) -> None:
    doc = _scenario("mine-kill", ["--steps", "20", "--every", "4"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 10}], max_lost_steps=6)
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    report = outcome.report
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    (fault,) = report["faults"]
    # held at the end of step 10 by the probe's pause point, killed there
    assert fault["injected_step"] == 10 and fault["unmeasured"] is None
    check_restored(report, fault, saved=(4, 8))  # 8 unless its async save was in flight
    assert fault["recovery_s"] == pytest.approx(sum(fault[k] for k in (
        "detect_s", "restart_s", "restore_s", "recompute_s")))
    assert report["run"]["final_step"] == report["run"]["expected_step"] == 20
    assert report["not_measured"] == [] and 0 < report["run"]["goodput"] < 1
    assert {c["step"] for c in report["checkpoints"] if c["committed"]} >= {4, 8, 20}
    events = [json.loads(line) for path in (tmp_path / "out" / "run" / "events").glob("*.jsonl")
              for line in path.read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert {(e["attempt"], e["rank"]) for e in starts} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_a_script_that_forgets_its_optimizer_fails_naming_what_differs(
        tmp_path: Path, cache: Path) -> None:
    doc = _scenario("mine-forgets", ["--steps", "16", "--every", "4", "--forget-optimizer"],
                    [{"kind": "kill_rank", "rank": 0, "at_step": 10}])
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    v = outcome.report["verdict"]
    assert v["verdict"] == "fail" and v["bitwise_equal"] is False
    differing = outcome.report["differing_entries"]
    assert "model/weight" in differing
    assert any(k.startswith("optim/state.weight.momentum_buffer") for k in differing)
    (reason,) = [r for r in v["reasons"] if "final state differs from the reference" in r]
    # where to look: what a resumed script commonly fails to carry over
    assert "random generators" in reason and "--check-determinism" in reason, reason
    assert "model/weight" in (tmp_path / "out" / "report.md").read_text()


def test_a_script_that_stops_short_after_its_newest_checkpoint_fails(
        tmp_path: Path, cache: Path) -> None:
    """The resumed script exits 0 at step 13, before its last step 14; it checkpoints every 4
    steps, not its last, so its newest checkpoint (12) is the reference's and equal to it. That
    was a pass: the steps the run never trained were not looked at."""
    doc = _scenario("mine-stops-short", ["--steps", "14", "--every", "4", "--stop-short"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 10}])
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    report = outcome.report
    assert report["run"]["final_step"] == report["run"]["expected_step"] == 12
    v = report["verdict"]
    assert v["verdict"] == "fail" and v["bitwise_equal"] is True, v
    assert any("last step reported was 13, the reference run's 14" in r
               for r in v["reasons"]), v


def test_a_script_that_starts_over_instead_of_resuming_fails(
        tmp_path: Path, cache: Path) -> None:
    """Killed at step 10 with step 8 committed, the script ignored its checkpoints and
    trained from step 0 again. Deterministic, it ended bit-identical to the reference (its
    saves of steps already committed wrote nothing), and passed: "recovery 3 s, lost steps
    10". The check that a restore took the newest committed step ran only when the script
    reported a restore; one that restored nothing was taken for a job with nothing to
    restore."""
    doc = _scenario("mine-never-resumes", ["--steps", "16", "--every", "4", "--never-resume"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 10}])
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    v = outcome.report["verdict"]
    assert v["verdict"] == "fail" and v["bitwise_equal"] is True, v
    (fault,) = outcome.report["faults"]
    assert fault["restored_step"] == 0 and fault["restorable_step"] in (4, 8), fault
    assert (f"kill_rank at step 10: resumed from step 0 (it started over), although step "
            f"{fault['restorable_step']} had committed before the fault and no restore skipped "
            "it (work lost for no reason: a script must resume from its newest checkpoint on "
            "start)") in v["reasons"], v


def test_a_script_that_reports_the_step_within_its_epoch_fails_saying_so(
        tmp_path: Path, cache: Path) -> None:
    """The script reports 1..6 each epoch of 6 steps (its loop's index, not the global step).
    Its recovery is real and its checkpoints equal the reference's, and its last reported
    step (6) is the reference's: that was a pass, with the fault's step, its lost steps and
    where the run ended all taken from numbers that restart each epoch."""
    doc = _scenario("mine-epoch-steps", ["--steps", "12", "--every", "4", "--epoch-steps", "6"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 5}])
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    v = outcome.report["verdict"]
    assert v["verdict"] == "fail" and v["bitwise_equal"] is True, v
    assert any(" reported step 1 after step 6 (attempt 1): " in r
               and "probe.step_end takes the global step" in r for r in v["reasons"]), v


def test_a_script_that_stops_short_after_a_kill_at_its_last_step_is_told_where_it_ended(
        tmp_path: Path, cache: Path) -> None:
    """Killed at the end of step 14, its last, the script resumed and exited 0 at step 13.
    The verdict said the job "restored step 12, but reported no step after it", and sent the
    reader looking for a resume that never trained, where it had trained step 13 and stopped
    one short of the step the fault hit."""
    doc = _scenario("mine-stops-short-late", ["--steps", "14", "--every", "4", "--stop-short"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 14}])
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    v = outcome.report["verdict"]
    (fault,) = outcome.report["faults"]
    assert v["verdict"] == "fail" and fault["retrained_to_step"] == 13, (v, fault)
    assert (f"kill_rank at step 14: no recovery was observed (the job came back after attempt "
            f"0, restored step {fault['restored_step']} and trained up to step 13, but never "
            "back to step 14, where the fault hit it)") in v["reasons"], v


@pytest.mark.slow
def test_a_script_without_the_probe_takes_time_based_faults_and_says_what_it_cannot_measure(
        tmp_path: Path, cache: Path) -> None:
    doc = _scenario("mine-no-probe", ["--steps", "40", "--step-s", "0.3", "--no-probe"],
                    [{"kind": "kill_rank", "rank": 1, "at_s": 15}], probe=False)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["verdict"]["verdict"] == "pass" and report["verdict"]["bitwise_equal"]
    (fault,) = report["faults"]
    assert fault["effect_observed"] and fault["ended_attempt"] == 0
    assert fault["detect_s"] is not None and fault["restart_s"] is not None
    assert fault["recovery_s"] is None and fault["lost_steps"] is None  # not made up
    assert fault["unmeasured"]
    assert report["run"]["goodput"] is None
    said = report["not_measured"]
    assert any(s.startswith("step times, losses and goodput") for s in said)
    assert any(s.startswith("kill_rank: ") for s in said)
    assert "not measured: step times" in result.output
    assert "## Not measured" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.slow
def test_check_determinism_calls_a_nondeterministic_script_so(tmp_path: Path,
                                                              cache: Path) -> None:
    doc = _scenario("mine-noisy", ["--steps", "8", "--every", "4", "--noise"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 5}])
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out"),
                                       "--check-determinism"])
    assert result.exit_code == 4, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["verdict"]["verdict"] == "nondeterministic"
    assert "not deterministic" in report["verdict"]["reasons"][0]
    assert report["determinism"]["deterministic"] is False
    # the noise differs between ranks too: the engine kept each rank's bias (model/bias/rank_r)
    assert any(k.startswith("model/bias") for k in report["determinism"]["differing_entries"])


_LEAVES_CHILDREN = """
import os, subprocess, sys
run = os.environ["ANTIFRAGILE_RUN_DIR"]
kept = subprocess.Popen(["sleep", "120"])                       # in the rank's group
away = subprocess.Popen(["sleep", "120"], start_new_session=True)  # in a session of its own
with open(os.path.join(run, "left pids"), "w") as f:
    f.write(f"{kept.pid} {away.pid}")
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_what_a_script_started_does_not_outlive_the_run(tmp_path: Path, code: int) -> None:
    """torchrun ends a rank's process group only while the rank runs: what a script left
    behind when it exited (a helper, an uploader, a child of a rank that crashed) ran on after
    chaos had ended ("nothing chaos starts outlives it")."""
    from antifragile.chaos.faults.base import alive
    from antifragile.chaos.run.runner import run_scenario

    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES_CHILDREN)
    s = parse_scenario({"name": "leaves", "trainer": {
        "command": ["python", str(script)], "probe": False, "env": {"EXIT": code}},
        "faults": [], "expect": {"bitwise_equal_to_reference": False}})
    run_dir = tmp_path / "run"
    record = run_scenario(s.model_copy(update={"time_limit_s": 60.0}),
                          run_dir, str(tmp_path / "ckpt"), faults=False)
    assert (record.returncode == 0) == (code == 0)
    pids = [int(p) for p in (run_dir / "left pids").read_text().split()]
    try:
        assert not [p for p in pids if alive(p)]
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


_STUCK_AT_EXIT = """
import time
from antifragile import probe
probe.step_end(1, 0.5)
time.sleep(5)  # as a script whose destroy_process_group hangs: done, and not gone
"""


def test_a_run_that_reports_nothing_for_long_is_said_to_wait(tmp_path: Path) -> None:
    """A script that hung after its last step held the fault-free run to its time limit
    (3600 s by default) with nothing said: the user saw one line and then silence."""
    from antifragile.chaos.run.runner import run_scenario

    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_AT_EXIT)
    s = parse_scenario({"name": "stuck", "trainer": {
        "command": ["python", str(script)], "nproc_per_node": 2},
        "faults": [], "expect": {"bitwise_equal_to_reference": False}})
    notes: list[str] = []
    record = run_scenario(s.model_copy(update={"time_limit_s": 60.0}), tmp_path / "run",
                          str(tmp_path / "ckpt"), faults=False, note=notes.append, quiet_s=2.0)
    assert record.returncode == 0
    # after 2 s of silence since step 1, and 4 s (a slow start may earn one before step 1)
    first, second = [n for n in notes if "newest: step 1" in n]
    assert first.startswith("the fault-free run: nothing reported for 2 s "), first
    assert second.startswith("the fault-free run: nothing reported for 4 s "), second
    assert "2 ranks still run" in first and "time_limit_s 60 s" in first, first


def test_a_silent_restart_is_not_said_to_be_at_step_0() -> None:
    """A restarted attempt that hangs before its first step (in its restore, a stuck rank) is
    what the note is for: it said 'newest: step 0', as if the job had made no progress."""
    import time

    from antifragile.chaos.run.runner import _Job, _silence

    s = parse_scenario({"name": "hung", "trainer": {"command": ["python", "-c", "pass"]},
                        "faults": [], "expect": {"bitwise_equal_to_reference": False}})
    job = _Job(1)
    job.see({"event": "start", "attempt": 0, "rank": 0, "pid": os.getpid(), "t": time.time()})
    job.see({"event": "step_end", "attempt": 0, "rank": 0, "step": 40, "t": time.time()})
    job.see({"event": "start", "attempt": 1, "rank": 0, "pid": os.getpid(), "t": time.time()})
    note = _silence(s, job, faults=True, silent_s=60.0, elapsed_s=90.0)
    assert "step 0" not in note, note
    assert "newest: no step of attempt 1 yet; 1 rank still runs" in note, note


@pytest.mark.slow
def test_a_script_that_fails_in_the_faulty_run_is_shown_with_its_log(
        tmp_path: Path, cache: Path) -> None:
    """The reference run's failure came with the end of its log; the faulty run's (a resume
    that raises: the bug chaos is for) said only "the trainer exited with code 1"."""
    doc = _scenario("mine-crashes", ["--steps", "8", "--every", "4", "--crash-on-resume"],
                    [{"kind": "kill_rank", "rank": 1, "at_step": 5}])
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(out)])
    assert result.exit_code == 1, result.output
    log = out / "run" / "torchrun.log"
    assert f"the trainer exited with code 1 (its log: {log})" in result.output
    assert "RuntimeError: my resume code is broken (step 4)" in result.output
