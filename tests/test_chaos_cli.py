"""``chaos validate``/``list``/``run`` on bad files, and the progress display's two modes."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from antifragile.chaos import scenario as scenario_module
from antifragile.chaos.cli import main
from antifragile.chaos.cli.progress import Progress
from antifragile.chaos.run.status import RunStatus, StatusTracker


def _one_line_error(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_files_are_one_line_errors(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "missing.yaml"
    _one_line_error([command, str(missing)], f"{missing}: cannot read: No such file")
    _one_line_error([command, str(tmp_path)], f"{tmp_path}: cannot read: Is a directory")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\x00")
    _one_line_error([command, str(binary)], f"{binary}: not UTF-8 text (byte 8")
    empty = tmp_path / "empty.yaml"
    empty.write_text("  \n")
    _one_line_error([command, str(empty)], f"{empty}: the file is empty")


def test_unreadable_file_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """As root a mode-000 file still reads, so the refusal is made by ``open`` itself."""
    path = tmp_path / "locked.yaml"
    path.write_text("name: x\n")

    def refuse(*_: object, **__: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(scenario_module, "open", refuse, raising=False)
    _one_line_error(["validate", str(path)], f"{path}: cannot read: Permission denied")


def test_validate_and_list_answer(tmp_path: Path) -> None:
    ok = CliRunner().invoke(main, ["validate", "scenarios/quickstart.yaml"])
    assert ok.exit_code == 0 and ": ok (quickstart" in ok.output
    listed = CliRunner().invoke(main, ["list"])
    assert listed.exit_code == 0 and "scenarios/quickstart.yaml" in listed.output
    assert "INVALID" not in listed.output


def _status(step: int, attempt: int = 0, faults: int = 0) -> RunStatus:
    return RunStatus(name="s", step=step, total_steps=1000, attempt=attempt,
                     faults_injected=faults, recoveries=0, eta_s=12.0)


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_status_counts_a_restart_that_started_over_as_a_recovery() -> None:
    """A kill before the first commit: the restarted attempt finds no checkpoint and trains
    from step 1. It came back from the failure, but only restores were counted, so the live
    line said "attempt 1 · recoveries 0" for the rest of the run."""
    tracker = StatusTracker("s", expected_step=20)

    def event(attempt: int, kind: str, rank: int = 0, **kw: Any) -> RunStatus | None:
        return tracker.status({"t": 100.0 * attempt + kw.get("step", 0), "rank": rank,
                               "attempt": attempt, "event": kind, **kw}, 1)

    assert event(0, "start") is None
    first = event(0, "step_end", step=3)
    assert first is not None and first.recoveries == 0 and first.attempt == 0
    assert event(0, "step_end", rank=1, step=4) is None  # only rank 0's steps are reported
    event(1, "start")
    again = event(1, "step_end", step=1)  # nothing restored: started over
    assert again is not None and again.attempt == 1 and again.recoveries == 1
    event(2, "restore_end", step=10)  # a later generation that restored
    last = event(2, "step_end", step=11)
    assert last is not None and last.recoveries == 2 and last.total_steps == 20


def test_plain_progress_never_prints_a_line_per_step() -> None:
    stream = _Pipe()
    with Progress(stream=stream, plain_interval_s=3600) as progress:
        for step in range(1, 500):
            progress.status(_status(step))
        progress("attempt 1: restored step 480 in 0.20 s")
        progress.status(_status(481, attempt=1, faults=1))  # attempt changed: a line
        for step in range(482, 1001):
            progress.status(_status(step, attempt=1, faults=1))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 5, lines  # first status, where it stood at the note, the note, the
    assert "step 1/1000" in lines[0] and "step 499/1000" in lines[1]  # new attempt, the last
    assert "restored step 480" in lines[2]
    assert "attempt 1" in lines[3] and "step 1000/1000" in lines[4]


def test_plain_progress_never_prints_a_stale_status_after_the_notes_that_followed_it() -> None:
    """A script that crashed on every resume: the last status (attempt 0, step 25, no fault
    yet) was held back by the interval and printed when the display closed, after the notes
    of attempts 1 and 2, so the log ended saying "attempt 0 · faults 0 · recoveries 0". The
    status a note follows is printed before the note, in time order."""
    stream = _Pipe()
    with Progress(stream=stream, plain_interval_s=3600) as progress:
        for step in range(1, 26):
            progress.status(_status(step))
        progress("attempt 1: restored step 20 in 0.01 s")
        progress("attempt 2: restored step 20 in 0.02 s")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert "step 25/1000" in lines[1] and "attempt 2: restored" in lines[-1]


def test_plain_progress_of_a_run_of_unknown_length_is_not_a_line_per_step() -> None:
    """A command trainer run without a reference run has no known last step: its status
    says the total is the step reached, so every step looked like the last one and printed a
    line (a CI log flooded). It prints like any other, and its final state when it ends."""
    stream = _Pipe()
    with Progress(stream=stream, plain_interval_s=3600) as progress:
        for step in range(1, 501):
            progress.status(RunStatus(name="s", step=step, total_steps=step, attempt=0,
                                      faults_injected=0, recoveries=0, eta_s=None))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines[:5]  # the first status, and where it ended
    assert "step 1/1" in lines[0] and "step 500/500" in lines[1]


def test_terminal_progress_updates_in_place() -> None:
    stream = _Terminal()
    with Progress(stream=stream) as progress:
        for step in range(1, 50):
            progress.status(_status(step))
        progress("a note")
    out = stream.getvalue()
    assert "a note" in out and "49/1000" in out and "ETA 0:12" in out


def test_terminal_progress_shows_notes_as_they_are() -> None:
    """A note is text, not rich markup: a scenario file in ``scenarios/[wip]/`` lost its
    folder's name on a terminal (``[wip]`` taken for a style), and a ``[/`` in a path or an
    error ended the run with a MarkupError traceback."""
    stream = _Terminal()
    with Progress(stream=stream) as progress:
        progress("[1/2] s (scenarios/[wip]/s.yaml)")
        progress("reference: cached (/data/v2[/old]/reference/abc)")
    out = stream.getvalue()
    assert "scenarios/[wip]/s.yaml" in out and "/data/v2[/old]/reference/abc" in out, out


def test_no_reference_with_a_bitwise_expectation_is_bad_input(tmp_path: Path) -> None:
    """Bitwise equality to a reference that is not run cannot be claimed: refused before
    anything runs, naming the option and the expect key."""
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntrainer: {parallel: {dp: 2}, steps: 2}\n"
                    "checkpoint: {every_steps: 1}\n")
    out = tmp_path / "out"
    _one_line_error(["run", str(path), "--no-reference", "--out", str(out)],
                    f"{path}: expect.bitwise_equal_to_reference is true, but --no-reference")
    assert not out.exists(), "nothing may run"


def _nothing_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run started after this fails the test: bad input must be refused before it."""
    from antifragile.chaos.run import pipeline

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(pipeline, "run_scenario", must_not_run)


def test_an_out_folder_that_cannot_be_made_is_bad_input(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out`` below a file (or on a read-only file system): one line naming the option and
    the reason, exit 2, before anything runs; it was a NotADirectoryError traceback, exit 1."""
    _nothing_may_run(monkeypatch)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntrainer: {parallel: {dp: 2}, steps: 2}\n"
                    "checkpoint: {every_steps: 1}\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_error(["run", str(path), "--out", str(blocker / "out")],
                    f"--out {blocker / 'out'}: cannot create the folder: Not a directory")


@pytest.mark.parametrize("command", [
    ["run", "{scenario}", "--out", "{long}"],
    ["suite", "{suite}", "--out", "{long}"],
    ["suite", "{long}"],
    ["tune", "--ckpt-cost-s", "1", "--mtbf-s", "100", "--out", "{long}"],
    ["crashcheck", "--engine", "antifragile", "--out", "{long}"],
])
def test_a_path_the_file_system_refuses_is_bad_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    """A folder name past 255 bytes (a name the file system refuses to look up): one line
    naming the option or folder and the reason, exit 2; it was an OSError traceback, exit 1
    (``Path.exists`` raises for it)."""
    _nothing_may_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "suite").mkdir()
    scenario = tmp_path / "suite" / "s.yaml"
    scenario.write_text("name: s\nexpect: {bitwise_equal_to_reference: false}\n")
    long = str(tmp_path / ("o" * 300))
    args = [a.format(scenario=scenario, suite=tmp_path / "suite", long=long) for a in command]
    _one_line_error(args, f"{long}: File name too long")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite"]


def test_an_out_folder_holding_a_ckpt_folder_of_its_own_is_not_cleared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run deletes run/, ckpt/ and determinism/ in its --out first: ``--out .`` in a project
    with checkpoints in ckpt/ deleted them. Only an earlier run's folder is cleared."""
    _nothing_may_run(monkeypatch)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntrainer: {parallel: {dp: 2}, steps: 2}\n"
                    "checkpoint: {every_steps: 1}\n")
    project = tmp_path / "project"
    (project / "ckpt").mkdir(parents=True)
    (project / "ckpt" / "step_000000100.pt").write_text("weeks of training")
    _one_line_error(["run", str(path), "--out", str(project)],
                    f"--out {project}: holds ckpt/, which a run deletes before it starts, and "
                    "is not a chaos run folder (no report.json)")
    assert (project / "ckpt" / "step_000000100.pt").read_text() == "weeks of training"


def test_an_out_folder_holding_a_report_file_of_its_own_is_not_overwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run writes report.md, report.html and its plots at the top of --out: ``--out .`` in
    a project with a report.md of its own overwrote it. Only an earlier run's folder (with its
    report.json) is written over."""
    _nothing_may_run(monkeypatch)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntrainer: {parallel: {dp: 2}, steps: 2}\n"
                    "checkpoint: {every_steps: 1}\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "report.md").write_text("the quarter's results")
    _one_line_error(["run", str(path), "--out", str(project)],
                    f"--out {project}: holds report.md, which a run writes over, and is not a "
                    "chaos run folder (no report.json)")
    assert (project / "report.md").read_text() == "the quarter's results"


def test_a_name_too_long_for_its_report_folder_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The name names the report folder (``reports/<name>-<UTC time>``, ``chaos suite``'s
    ``OUT/<name>``): a name past a folder name's 255 bytes was valid, and ``chaos run`` and
    ``chaos suite`` ended in an OSError traceback (File name too long). Refused: exit 2, and
    in a suite an invalid scenario's failed entry."""
    _nothing_may_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "suite").mkdir()
    path = tmp_path / "suite" / "s.yaml"
    path.write_text(f"name: {'a' * 300}\nexpect: {{bitwise_equal_to_reference: false}}\n")
    expected = f"{path}: name: 300 characters; a name is at most 200"
    for args in (["validate", str(path)], ["run", str(path)]):
        _one_line_error(args, expected)
    assert not (tmp_path / "reports").exists()
    suite = CliRunner().invoke(main, ["suite", str(tmp_path / "suite"), "--out",
                                      str(tmp_path / "out")])  # an invalid scenario: failed
    assert suite.exit_code == 1 and expected in suite.output, suite.output
    assert "Traceback" not in suite.output
    path.write_text(f"name: {'a' * 200}\n")
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0


def test_a_seed_option_out_of_range_names_the_option(tmp_path: Path) -> None:
    """``--seed -1`` was reported as the file's ``seed:`` key, which the user never wrote."""
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nseed: 3\n")
    result = CliRunner().invoke(main, ["run", str(path), "--seed", "-1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "'--seed'" in result.output and "s.yaml: seed:" not in result.output, result.output


def _command_scenario_file(tmp_path: Path) -> Path:
    script = tmp_path / "noop.py"
    script.write_text("print('never checkpoints')\n")
    path = tmp_path / "noop.yaml"
    path.write_text("name: noop\ntrainer: {command: [python, noop.py]}\n"
                    "faults:\n  - {kind: kill_rank, rank: 0, at_s: 1000}\n")
    return path


@pytest.mark.parametrize("returncode", [1, 0])
def test_a_failed_reference_run_is_a_clear_error_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, returncode: int) -> None:
    """The fault-free reference run fails (code 1), or exits 0 without checkpointing: no
    verdict can be reached, and the user must fix the script: ``error: FILE: reason``, exit 5
    (README), no traceback."""
    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.run import pipeline

    def reference_run(s: object, run_dir: Path, ckpt_url: str, **_: object) -> RunRecord:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "torchrun.log").write_text("the script's last words\n")
        return RunRecord(returncode, 0.0, 1.0, [], [])

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_scenario", reference_run)
    path = _command_scenario_file(tmp_path)
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    why = ("failed (code 1)" if returncode else "left no committed antifragile checkpoint")
    assert errors[0].startswith(f"error: {path}: the fault-free reference run ")
    assert why in errors[0]


def test_the_end_of_a_long_log_is_read_from_its_end_not_whole(tmp_path: Path) -> None:
    """A failed run's message shows the end of its torchrun.log, which a chatty script fills
    for the run's hour: the log was read whole into memory to show its last lines."""
    import tracemalloc

    from antifragile.chaos.infra.logs import tail

    log = tmp_path / "torchrun.log"
    with open(log, "wb") as f:
        f.truncate(256 << 20)  # a long run's output (sparse: it takes no disk)
        f.seek(0, 2)
        f.write(b"\n" + "".join(f"line {i}\n" for i in range(20)).encode())
    tracemalloc.start()
    try:
        shown = tail(log, 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert shown == "line 17\n    line 18\n    line 19"
    assert peak < 4 << 20, f"{peak >> 20} MiB held to show 3 lines"
    short = tmp_path / "short.log"
    short.write_text("only\n")
    assert tail(short) == "only"
    short.write_text("  \n")
    assert tail(short) == "(empty log)"
    assert tail(tmp_path / "missing.log") == "(no log)"


def test_a_reference_script_that_checkpointed_with_another_engine_is_told_which(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DCP script whose scenario leaves ``checkpoint.engine`` at its default (antifragile)
    did checkpoint to $ANTIFRAGILE_CKPT_URL: the error said it must, which it had, instead of
    naming the engine that wrote the folders there and the setting to change."""
    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.run import pipeline

    def reference_run(s: object, run_dir: Path, ckpt_url: str, **_: object) -> RunRecord:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "torchrun.log").write_text("done\n")
        step = Path(ckpt_url) / "step_000000010"
        step.mkdir(parents=True)
        (step / ".metadata").write_bytes(b"dcp")
        return RunRecord(0, 0.0, 1.0, [], [])

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_scenario", reference_run)
    path = _command_scenario_file(tmp_path)
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "left no committed antifragile checkpoint" in result.output
    assert "it holds committed dcp checkpoints (step 10): set checkpoint.engine: dcp" \
        in result.output, result.output


def _tiny_file(tmp_path: Path) -> Path:
    """A 4-step scenario of the built-in trainer, killed at step 3."""
    path = tmp_path / "tiny.yaml"
    path.write_text("name: tiny\ntrainer: {parallel: {dp: 2}, steps: 4}\n"
                    "checkpoint: {every_steps: 2}\nfaults:\n  - {kind: kill_rank, at_step: 3}\n")
    return path


def test_a_reference_run_without_its_final_checkpoint_is_no_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in trainer's reference run exits 0 (its final save's failure is not an exit
    code) without a committed checkpoint of the last step: nothing to compare with, so no
    verdict (exit 5), and nothing cached that every later run would be failed against."""
    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.run import pipeline

    def reference_run(s: object, run_dir: Path, ckpt_url: str, **_: object) -> RunRecord:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "torchrun.log").write_text("the trainer's last words\n")
        return RunRecord(0, 0.0, 1.0, [], [])

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_scenario", reference_run)
    path = _tiny_file(tmp_path)
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output
    assert (f"error: {path}: the fault-free reference run left no committed antifragile "
            "checkpoint of its final step 4") in result.output, result.output
    assert not list((tmp_path / "cache").rglob("DONE"))


def test_a_script_reference_whose_last_save_did_not_commit_is_no_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's non-blocking save of its last step, skipped while the one before persisted:
    the reference run exits 0 with step 10 committed, not 20. It was cached, and every faulty
    run that did commit step 20 failed 'the newest committed checkpoint is step 20, the
    reference run's is step 10', blaming the run that was right, by timing."""
    import torch

    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.run import pipeline
    from antifragile.engine import CheckpointEngine

    def reference_run(s: object, run_dir: Path, ckpt_url: str, **_: object) -> RunRecord:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "torchrun.log").write_text("done\n")
        with CheckpointEngine(ckpt_url) as ckpt:
            ckpt.save(10, {"w": torch.ones(4)}, blocking=True)
        events = [{"t": 0.5, "rank": 0, "attempt": 0, "event": "step_end", "step": 20,
                   "seconds": 0.1, "loss": 1.0},
                  {"t": 0.6, "rank": 0, "attempt": 0, "event": "ckpt_failed", "step": 20,
                   "error": "step 20 skipped: the save of step 10 is still persisting"}]
        return RunRecord(0, 0.0, 1.0, events, [])

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_scenario", reference_run)
    path = _command_scenario_file(tmp_path)
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output
    assert (f"error: {path}: the fault-free reference run's save of step 20 did not commit "
            "(step 20 skipped: the save of step 10 is still persisting)") in result.output, \
        result.output
    assert not list((tmp_path / "cache").rglob("DONE"))


def _cached_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A command scenario's file and its reference's cache folder, marked DONE with an empty
    ``events/`` and no ``ckpt``, for a test to fill; no run may be made."""
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.scenario import load_scenario

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("a run was made")

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_scenario", must_not_run)
    path = _command_scenario_file(tmp_path)
    folder = pipeline.reference_cache() / pipeline._reference_key(load_scenario(path))
    (folder / "events").mkdir(parents=True)
    (folder / "DONE").write_text("{}")
    return path, folder


def test_a_cached_reference_that_later_checks_refuse_is_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key covers what makes the reference, not chaos's checks of it: a reference
    cached before a check existed (the script reference above, whose last save did not
    commit) was used as is by every later run. A cached one is checked as a new one is."""
    import json

    import torch

    from antifragile.engine import CheckpointEngine

    path, folder = _cached_reference(tmp_path, monkeypatch)
    with CheckpointEngine(str(folder / "ckpt")) as ckpt:
        ckpt.save(10, {"w": torch.ones(4)}, blocking=True)
    events = [{"t": 0.5, "rank": 0, "attempt": 0, "event": "step_end", "step": 20,
               "seconds": 0.1, "loss": 1.0},
              {"t": 0.6, "rank": 0, "attempt": 0, "event": "ckpt_failed", "step": 20,
               "error": "step 20 skipped: the save of step 10 is still persisting"}]
    (folder / "events" / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n"
                                                           for e in events))
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output
    assert (f"the cached fault-free reference run ({folder}) cannot be used: the fault-free "
            "reference run's save of step 20 did not commit") in result.output, result.output
    assert f"delete {folder} to run it again" in result.output, result.output


def test_a_cached_reference_whose_checkpoint_is_gone_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache entry whose ckpt folder was removed (a cleanup of big folders) was refused
    with a new reference's explanation: 'the script must checkpoint to $ANTIFRAGILE_CKPT_URL',
    sending the user to a script that did."""
    path, folder = _cached_reference(tmp_path, monkeypatch)
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output and "ANTIFRAGILE_CKPT_URL" not in result.output
    assert (f"the cached fault-free reference run ({folder}) cannot be used: its checkpoint "
            f"folder {folder / 'ckpt'} is gone") in result.output, result.output
    assert f"delete {folder} to run it again" in result.output, result.output
    # its events garbled as JSON that is not an event: named, not a KeyError traceback
    (folder / "ckpt").mkdir()
    (folder / "events" / "rank0.jsonl").write_text('{"event": "step_end"}\n')
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output
    assert f"{folder / 'events' / 'rank0.jsonl'}:1: not an event" in result.output, \
        result.output


def test_a_run_past_its_time_limit_is_a_clear_error(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's time limit kills the job and says which run and where its log is; the
    CLI reports it like any run that could not be made (exit 5)."""
    import subprocess

    from antifragile.chaos.run import pipeline, runner
    from antifragile.chaos.scenario import load_scenario

    def never_ends(*_: object, **__: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["sleep", "60"], start_new_session=True, text=True)

    monkeypatch.setattr(runner, "launch", never_ends)
    s = load_scenario(_command_scenario_file(tmp_path))
    with pytest.raises(runner.ChaosRunError, match=r"the faulty run of noop went past its "
                       r"time limit of 0\.3 s"):
        runner.run_scenario(s.model_copy(update={"time_limit_s": 0.3}),
                            tmp_path / "run", str(tmp_path / "ckpt"))

    def times_out(*_: object, **__: object) -> None:
        raise runner.ChaosRunError("the fault-free run of noop went past its time limit")

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_scenario", times_out)
    path = tmp_path / "noop.yaml"
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output
    assert f"error: {path}: the fault-free run of noop went past its time limit" in \
        result.output


def test_the_scenario_sets_its_runs_time_limit(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that deadlocks after a fault (gloo's 30-minute default timeout, a peer it
    never notices) was waited on for the runner's fixed hour, which no scenario key could
    shorten: a nightly suite lost an hour to it. ``time_limit_s`` bounds each of its runs."""
    import subprocess

    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import ScenarioError, parse_scenario

    def never_ends(*_: object, **__: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["sleep", "60"], start_new_session=True, text=True)

    monkeypatch.setattr(runner, "launch", never_ends)
    doc = {"name": "noop", "time_limit_s": 0.3,
           "trainer": {"command": ["python", "-c", "pass"], "probe": False}}
    s = parse_scenario(doc)
    with pytest.raises(runner.ChaosRunError, match=r"the faulty run of noop went past its "
                       r"time limit of 0\.3 s \(time_limit_s\)"):
        runner.run_scenario(s, tmp_path / "run", str(tmp_path / "ckpt"))
    assert parse_scenario({"name": "n"}).time_limit_s == 3600
    assert parse_scenario({**doc, "time_limit_s": 90}).time_limit_s == 90
    for bad in (0, -1, "1h", float("inf")):
        with pytest.raises(ScenarioError, match="time_limit_s"):
            parse_scenario({**doc, "time_limit_s": bad})


@pytest.mark.parametrize("engine", ["antifragile", "dcp"])
def test_a_local_url_holding_committed_checkpoints_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """A fixed local ``checkpoint.url`` used by an earlier run: the trainer would resume from
    that run's checkpoints and the verdict fail for reasons that have nothing to do with the
    faults. Refused before anything runs (exit 2), as a used S3 prefix is."""
    import warnings

    import torch

    url = tmp_path / "fixed"
    state = {"model": {"w": torch.ones(3)}}
    if engine == "antifragile":
        from antifragile.engine import CheckpointEngine

        with CheckpointEngine(str(url), keep_last=None) as ckpt:
            ckpt.save(10, state).wait()
    else:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(url / "step_000000010"))

    _nothing_may_run(monkeypatch)
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\ntrainer: {{parallel: {{dp: 2}}, steps: 20}}\n"
                    f"checkpoint: {{every_steps: 5, url: {url}, engine: {engine}}}\n"
                    "expect: {bitwise_equal_to_reference: false}\n")
    _one_line_error(["run", str(path), "--out", str(tmp_path / "out")],
                    f"{path}: checkpoint.url {url} already holds committed {engine} "
                    "checkpoints (step 10); the trainer would resume from them")
    url_file = tmp_path / "a-file"
    url_file.write_text("not a folder")
    path.write_text(f"name: s\ntrainer: {{parallel: {{dp: 2}}, steps: 20}}\n"
                    f"checkpoint: {{every_steps: 5, url: {url_file}}}\n"
                    "expect: {bitwise_equal_to_reference: false}\n")
    _one_line_error(["run", str(path), "--out", str(tmp_path / "out")],
                    f"{path}: checkpoint.url {url_file}: ")


def _scenario_with_a_file_url(tmp_path: Path) -> tuple[Path, Path]:
    """A scenario file whose ``checkpoint.url`` is a file (storage refused before any run),
    and that file."""
    url_file = tmp_path / "a-file"
    url_file.write_text("not a folder")
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\ntrainer: {{parallel: {{dp: 2}}, steps: 20}}\n"
                    f"checkpoint: {{every_steps: 5, url: {url_file}}}\n"
                    "expect: {bitwise_equal_to_reference: false}\n")
    return path, url_file


def test_a_refused_checkpoint_url_leaves_no_report_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage refused before anything runs (here a ``checkpoint.url`` that is a file) is bad
    input: the report folder made for the run, ``--out`` or the default
    ``reports/<name>-<time>/``, must not stay behind, empty, as if a run had been made."""
    _nothing_may_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    path, url_file = _scenario_with_a_file_url(tmp_path)
    _one_line_error(["run", str(path), "--out", str(tmp_path / "out")],
                    f"{path}: checkpoint.url {url_file}: ")
    assert not (tmp_path / "out").exists()
    _one_line_error(["run", str(path)], f"{path}: checkpoint.url {url_file}: ")
    assert not list((tmp_path / "reports").glob("s-*"))


def test_a_refused_checkpoint_url_keeps_an_earlier_runs_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out`` an earlier run's folder, and storage refused before anything runs: bad input
    (exit 2) must leave that run's report, run/ and ckpt/ as they were. They were deleted
    first, then the checkpoint.url refused: the earlier run lost, and nothing in its place."""
    _nothing_may_run(monkeypatch)
    out = tmp_path / "out"
    for name, text in (("report.json", "{}"), ("report.md", "earlier"),
                       ("run/torchrun.log", "log"), ("ckpt/COMMIT", "c")):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    path, url_file = _scenario_with_a_file_url(tmp_path)
    _one_line_error(["run", str(path), "--out", str(out)],
                    f"{path}: checkpoint.url {url_file}: ")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "ckpt", "ckpt/COMMIT", "report.json", "report.md", "run", "run/torchrun.log"]


def test_a_fresh_local_url_is_used_as_given(tmp_path: Path) -> None:
    from antifragile.chaos.infra.s3 import run_storage
    from antifragile.chaos.scenario import parse_scenario

    url = tmp_path / "fresh"
    url.mkdir()
    s = parse_scenario({"name": "s", "checkpoint": {"url": str(url)}})
    with run_storage(s, tmp_path / "out") as storage:
        assert storage.url == str(url)


def test_a_pause_point_a_rank_never_reaches_is_given_up(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that calls the probe on rank 0 only: rank 0 is held at step 3's pause point
    for a rank that never comes, and the run waited there until its time limit (an hour).
    Once the others have waited the detection window, the fault is missed, saying why, and
    the held rank goes on."""
    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import load_scenario

    (tmp_path / "rank0only.py").write_text(
        "import os, time\nfrom antifragile import probe\n"
        "for step in range(1, 6):\n    time.sleep(0.1)\n"
        "    if os.environ['RANK'] == '0':\n        probe.step_end(step)\n")
    path = tmp_path / "rank0only.yaml"
    path.write_text("name: rank0only\ntrainer: {command: [python, rank0only.py], "
                    "nproc_per_node: 2}\nfaults:\n  - {kind: kill_rank, rank: 1, at_step: 3}\n"
                    "expect: {bitwise_equal_to_reference: false}\n")
    monkeypatch.setattr(runner, "detection_window_s", lambda s: 2.0)
    monkeypatch.chdir(tmp_path)
    record = runner.run_scenario(load_scenario(path).model_copy(update={"time_limit_s": 120.0}),
                                 tmp_path / "run", str(tmp_path / "ckpt"))
    (injection,) = record.injections
    assert injection.fault_index == 0 and injection.rank is None
    assert (injection.missed or "").startswith(
        "rank 1 never reached the end of step 3 in 2 s after the others (a script must call "
        "antifragile.probe.step_end on every rank)"), injection
    assert record.returncode == 0  # rank 0 was released and finished


_RESTARTED_AGENT = """\
import json, subprocess, sys, time
from pathlib import Path

events = Path(sys.argv[1])
events.mkdir(parents=True, exist_ok=True)
lines = []

def event(attempt, name, **fields):
    lines.append(json.dumps({"t": time.time(), "rank": 0, "attempt": attempt, "event": name,
                             **fields}) + "\\n")

first = subprocess.Popen(["sleep", "60"])
event(0, "start", pid=first.pid)
for step in range(1, 21):
    event(0, "step_end", step=step, seconds=0.0, loss=1.0)
first.kill()  # attempt 0 dies in the save of its final step, 20
first.wait()
second = subprocess.Popen(["sleep", "60"])
event(1, "start", pid=second.pid)
event(1, "restore_end", step=15, seconds=0.0)
event(1, "step_end", step=16, seconds=0.0, loss=1.0)
with open(events / "rank0.jsonl", "a") as f:
    f.write("".join(lines))
deadline = time.time() + 8
while second.poll() is None and time.time() < deadline:
    time.sleep(0.05)
second.kill()
"""


def test_a_time_based_fault_lands_on_an_attempt_that_redoes_the_final_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0 finished step 20 of 20 and died saving it (a crash_during_save of the final
    checkpoint); attempt 1 resumed from step 15 and trains again. The runner kept the highest
    step any attempt had reported, so it took the job for past its last step and held back
    every mtbf_s and at_s fault for the rest of the run: this at_s fault was reported "never
    injected"."""
    import subprocess
    import sys

    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import parse_scenario

    agent_script = tmp_path / "agent.py"
    agent_script.write_text(_RESTARTED_AGENT)

    def agent(s: object, run_dir: Path, *_: object, **__: object) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(agent_script), str(run_dir / "events")],
                                start_new_session=True, text=True)

    monkeypatch.setattr(runner, "launch", agent)
    s = parse_scenario({"name": "redo", "trainer": {"steps": 20},
                        "checkpoint": {"every_steps": 5},
                        "faults": [{"kind": "kill_rank", "rank": 0, "at_s": 1.0}]})
    record = runner.run_scenario(s.model_copy(update={"time_limit_s": 60.0}),
                                 tmp_path / "run", str(tmp_path / "ckpt"))
    assert [(i.fault_index, i.rank, i.step, i.missed) for i in record.injections] == \
        [(0, 0, 16, None)]


def test_an_aborted_run_leaves_no_worker_behind(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts each worker in a session of its own: killing the agent's process
    group at the time limit left a user's script running."""
    import subprocess

    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import load_scenario

    pid_file = tmp_path / "worker.pid"

    def agent(*_: object, **__: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["bash", "-c", f"setsid sleep 120 & echo $! > {pid_file}; wait"],
                                start_new_session=True, text=True)

    monkeypatch.setattr(runner, "launch", agent)
    with pytest.raises(runner.ChaosRunError):
        s = load_scenario(_command_scenario_file(tmp_path))
        runner.run_scenario(s.model_copy(update={"time_limit_s": 1.0}), tmp_path / "run",
                            str(tmp_path / "ckpt"))
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0  # a SIGKILL takes effect a moment after it is sent
    while runner.alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not runner.alive(worker), f"worker {worker} outlived the run"


def test_a_report_that_cannot_be_written_is_a_clear_error_and_leaves_none_in_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up while the report is written (here: a file size limit, the kernel's
    EFBIG): ``chaos run`` ended with an OSError traceback, exit 1 (the code of a failed
    verdict), report.json cut short, and the report.md and report.html of the run before it
    in the reused ``--out`` left beside it as if they were this run's. Now: one line naming
    the file, exit 2, and no report file at all (run/ and ckpt/ are this run's now)."""
    import resource
    import signal

    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.run import pipeline

    def faulty_run(s: object, run_dir: Path, ckpt_url: str, **_: object) -> RunRecord:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "torchrun.log").write_text("")
        events = [{"t": 1.0 + step, "rank": rank, "attempt": 0, "event": "step_end",
                   "step": step, "loss": 1.0, "seconds": 0.5}
                  for step in (1, 2) for rank in (0, 1)]
        return RunRecord(0, 0.0, 4.0, events, [])

    monkeypatch.setattr(pipeline, "run_scenario", faulty_run)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntrainer: {parallel: {dp: 2}, steps: 2}\n"
                    "checkpoint: {every_steps: 1}\nexpect: {bitwise_equal_to_reference: false}\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("report.json", "report.md", "report.html"):  # an earlier run's report
        (out / name).write_text("PASS")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death, past the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    try:
        result = CliRunner().invoke(main, ["run", str(path), "--no-reference", "--out",
                                           str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, xfsz)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {out / 'report.json'}: cannot "
                                                     "be written: File too large"), result.output
    left = sorted(p.name for p in out.iterdir())
    assert left == ["run"], left  # no report, no part of one, no staged file


def test_live_status_does_not_take_an_idle_spare_for_the_first_attempt() -> None:
    """A warm spare writes ``spare_ready`` as rank -1, attempt -1 (it plays in no generation
    yet). The tracker took that for the run's first attempt, so the first attempt's own steps
    counted as a recovery: "recoveries 1" on a run no fault had struck."""
    tracker = StatusTracker("s", expected_step=20)
    assert tracker.status({"t": 1.0, "rank": -1, "attempt": -1, "event": "spare_ready",
                           "worker": "s2.0"}, 0) is None
    first = tracker.status({"t": 2.0, "rank": 0, "attempt": 0, "event": "step_end",
                            "step": 1}, 0)
    assert first is not None and first.attempt == 0 and first.recoveries == 0
    again = tracker.status({"t": 9.0, "rank": 0, "attempt": 1, "event": "step_end",
                            "step": 3}, 1)
    assert again is not None and again.recoveries == 1


def test_live_status_counts_a_recovery_from_a_first_attempt_that_reported_nothing() -> None:
    """A kill while the ranks still started (an ``at_s`` fault): attempt 0 wrote no event,
    and the tracker took the first attempt it saw, attempt 1, for the run's first, so the
    live line said "attempt 1 · recoveries 0" after a real restart. Every run starts at
    attempt 0 (torchrun's first, the job's first generation)."""
    tracker = StatusTracker("s", expected_step=20)
    again = tracker.status({"t": 9.0, "rank": 0, "attempt": 1, "event": "step_end",
                            "step": 1}, 1)
    assert again is not None and again.attempt == 1 and again.recoveries == 1


def test_two_runs_of_one_scenario_started_in_the_same_second_get_folders_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``chaos run`` of one scenario side by side (a CI matrix over seeds on one machine)
    started within the same second were given the same ``reports/<name>-<UTC time>``: each
    cleared the other's ``run/`` and ``ckpt/`` and trained into the same checkpoints, and a
    ``disk_full``'s tmpfs mount point was the other's (skipped as "not made by this run")."""
    import datetime as real

    from antifragile.chaos.cli import run as run_cli
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.run.runner import ChaosRunError

    class Frozen(real.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Frozen:
            return cls(2026, 12, 6, 12, 0, 0, tzinfo=tz)

    folders: list[Path] = []

    def record(s: Any, folder: Path, **_: object) -> None:
        folders.append(folder)
        raise ChaosRunError("stopped by the test")

    monkeypatch.setattr(run_cli, "datetime", Frozen)
    monkeypatch.setattr(pipeline, "run", record)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nexpect: {bitwise_equal_to_reference: false}\n")
    for _ in range(2):
        assert CliRunner().invoke(main, ["run", str(path)]).exit_code == 5
    assert len(folders) == 2 and folders[0] != folders[1], folders
    assert all(f.parent == Path("reports") and f.name.startswith("s-20261206T120000Z")
               for f in folders), folders


def test_ctrl_c_while_the_command_line_is_imported_exits_130_without_a_traceback(
        tmp_path: Path) -> None:
    """Ctrl-C in the first fraction of a second of ``chaos validate FILE`` (while the ``chaos``
    script imports the command line: yaml, pydantic, the fault modules) came before click's
    handler: a KeyboardInterrupt traceback ending in an import, and death by SIGINT instead
    of exit 130. The interrupt is made to arrive at the import of yaml, as the console script
    runs it."""
    import subprocess
    import sys

    script = tmp_path / "chaos_script.py"
    script.write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'yaml':\n"
        "            raise KeyboardInterrupt\n"
        "        return None\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "from antifragile.chaos.cli import entry\n"
        "sys.exit(entry())\n")
    done = subprocess.run([sys.executable, str(script), "validate",
                           str(scenario_module.SCENARIOS / "quickstart.yaml")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == "Aborted!" and done.stdout == "", done.stderr


def _fault(**changes: Any) -> dict[str, Any]:
    """A made kill_rank that ended attempt 0, with its recovery measured; ``changes`` on top."""
    fault = {"kind": "kill_rank", "injected_step": 12, "rank": 1, "skipped": None,
             "missed": None, "effect_observed": True, "effect": "rank 1 killed",
             "ended_attempt": 0, "outage": None, "unmeasured": None, "interrupted_by_t": None,
             "detect_s": 0.5, "restart_s": 3.0, "restore_s": 0.2, "recompute_s": 0.3,
             "recovery_s": 4.0, "lost_steps": 2}
    return {**fault, **changes}


def test_the_fault_line_of_a_recovery_cut_short_by_the_next_fault_says_so() -> None:
    """A recovery the next fault cut short passes the verdict (it is not a job that never came
    back), yet ``chaos run`` printed "recovery not observed, lost steps None" under PASS, the
    words of a job that did not come back; report.md says "interrupted by the next fault"."""
    from antifragile.chaos.cli.run import _fault_line

    cut = _fault(interrupted_by_t=1e9, recompute_s=None, recovery_s=None, lost_steps=None)
    line = _fault_line(cut)
    assert "interrupted by the next fault" in line, line
    assert "not observed" not in line and "None" not in line, line
    never = _fault(restart_s=None, restore_s=None, recompute_s=None, recovery_s=None,
                   lost_steps=None, detect_s=None)
    assert "recovery not observed" in _fault_line(never)
    assert _fault_line(_fault()) == "kill_rank at step 12: recovery 4.00 s, lost steps 2"


def test_the_fault_line_of_a_fault_before_any_step_names_no_step_none() -> None:
    """An ``at_s`` kill that landed before the first step (or any fault of a script without the
    probe) has no ``injected_step``: ``chaos run`` printed "kill_rank at step None: recovery
    3.90 s" under PASS; report.md shows "-"."""
    from antifragile.chaos.cli.run import _fault_line

    early = _fault(injected_step=None, lost_steps=0)
    assert _fault_line(early) == ("kill_rank (no step reported yet): recovery 4.00 s, "
                                  "lost steps 0")
    for other in (_fault(injected_step=None, effect_observed=False),
                  _fault(injected_step=None, ended_attempt=None),
                  _fault(injected_step=None, recovery_s=None)):
        assert "None" not in _fault_line(other), _fault_line(other)


def test_a_run_that_ends_in_an_error_prints_the_error_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that went past its time limit (exit 5): the plain progress printed the error,
    then, as the display closed, the newest status line it had held back ("step 12/30 ...
    ETA 0:01"), so a CI log ended on a status older than the error, as if the run went on."""
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.run.runner import ChaosRunError
    from antifragile.chaos.run.status import RunStatus

    def run(s: object, out: Path, *, status: Any, **_: object) -> None:
        for step in (1, 2):  # the second within the interval: held back
            status(RunStatus("tiny", step, 4, 0, 0, 0, None))
        raise ChaosRunError("the faulty run of tiny went past its time limit")

    monkeypatch.setattr(pipeline, "run", run)
    path = _tiny_file(tmp_path)
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 5, result.output
    lines = result.output.strip().splitlines()
    assert "tiny: step 2/4" in result.output, result.output
    assert lines[-1] == f"error: {path}: the faulty run of tiny went past its time limit", lines
