"""``chaos validate``/``list``/``run`` on bad files, and the progress display's two modes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from click.testing import CliRunner

from antifragile.chaos import scenario as scenario_module
from antifragile.chaos.cli import main
from antifragile.chaos.cli.progress import Progress
from antifragile.chaos.run.status import RunStatus


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
    assert len(lines) == 4, lines  # first status, the note, the new attempt, the last step
    assert "step 1/1000" in lines[0] and "restored step 480" in lines[1]
    assert "attempt 1" in lines[2] and "step 1000/1000" in lines[3]


def test_terminal_progress_updates_in_place() -> None:
    stream = _Terminal()
    with Progress(stream=stream) as progress:
        for step in range(1, 50):
            progress.status(_status(step))
        progress("a note")
    out = stream.getvalue()
    assert "a note" in out and "49/1000" in out and "ETA 0:12" in out


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
