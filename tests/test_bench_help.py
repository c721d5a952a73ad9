"""Every benchmark's ``--help`` names the command README gives for it (``python -m bench.<x>``),
not the file argparse guesses from ``sys.argv[0]``."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["engine", "save_cost", "s3", "trainer", "recovery", "gpu",
                                  "load_metadata", "plan"])
def test_bench_help_names_the_module_command(name: str, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench.{name} ")


def _refuses(module_name: str, argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str], *, heavy: tuple[str, ...]) -> None:
    """``python -m bench.<module_name> argv`` exits 2 with an argparse error that says
    ``says``, before any of ``heavy`` (what would start measuring) is called."""
    module = importlib.import_module(f"bench.{module_name}")

    def measuring(*_: object, **__: object) -> None:
        raise AssertionError(f"bench.{module_name} {argv} started measuring")

    for name in heavy:
        monkeypatch.setattr(module, name, measuring)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: {says}" in err, err


@pytest.mark.parametrize(("argv", "says"), [
    (["--only", "bogus"], "--only: unknown case 'bogus'"),
    # an unknown name after a known one: refused before the known one's runs (minutes)
    (["--only", "quickstart,bogus"], "--only: unknown case 'bogus'"),
    (["--only", ""], "--only: unknown case ''"),
])
def test_recovery_bench_refuses_an_unknown_case(argv: list[str], says: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("recovery", argv, says, monkeypatch, capsys, heavy=("_run",))


@pytest.mark.parametrize(("argv", "says"), [
    (["--reps", "0"], "argument --reps: must be >= 1, got 0"),
    (["--size-gib", "0"], "argument --size-gib: must be a finite number > 0, got 0"),
    (["--size-gib", "-1"], "argument --size-gib: must be a finite number > 0, got -1"),
    (["--size-gib", "nan"], "argument --size-gib: must be a finite number > 0, got nan"),
    # every peer skipped for its budget: rows without a sample
    (["--peer-budget-s", "-1"], "argument --peer-budget-s: must be a finite number >= 0, got -1"),
    (["--sweep", "1,a"], "--sweep: give sizes in GiB > 0 separated by commas, got '1,a'"),
    (["--sweep", "0"], "--sweep: give sizes in GiB > 0 separated by commas, got '0'"),
    (["--sweep", "1", "--reps", "0"], "argument --reps: must be >= 1, got 0"),
])
def test_engine_bench_refuses_nonsense_arguments(argv: list[str], says: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("engine", argv, says, monkeypatch, capsys, heavy=("run", "scale_point"))


@pytest.mark.parametrize(("argv", "says"), [
    (["--reps", "0"], "argument --reps: must be >= 1, got 0"),
    (["--io-threads", "0"], "argument --io-threads: must be >= 1, got 0"),
    (["--volumes", "0"], "argument --volumes: must be >= 1, got 0"),
    (["--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    # nothing left to measure, after a cluster start, and exit 0
    (["--only-ranks"], "--only-ranks: give --ranks N with N > 1"),
    (["--mesh", "2,2"], "argument --mesh: give DP,TP,PP (e.g. 2,2,2), got '2,2'"),
    (["--mesh", "2,0,2"], "argument --mesh: must be >= 1, got 0"),
    (["--mesh", "2,x,2"], "argument --mesh: give a whole number >= 1, got 'x'"),
])
def test_s3_bench_refuses_nonsense_arguments(argv: list[str], says: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("s3", argv, says, monkeypatch, capsys, heavy=("SeaweedCluster",))


@pytest.mark.parametrize(("argv", "says"), [
    (["--gib", "0"], "argument --gib: must be a finite number > 0, got 0"),
    (["--gib", "nan"], "argument --gib: must be a finite number > 0, got nan"),
    (["--reps", "0"], "argument --reps: must be >= 1, got 0"),
    (["--trainer-pairs", "-1"], "argument --trainer-pairs: must be >= 0, got -1"),
])
def test_gpu_bench_refuses_nonsense_arguments(argv: list[str], says: str,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("gpu", argv, says, monkeypatch, capsys, heavy=("_state", "trainer"))


@pytest.mark.parametrize(("argv", "says"), [
    (["--dp", "0"], "argument --dp: must be >= 1, got 0"),
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--every", "0"], "argument --every: must be >= 1, got 0"),
    (["--pairs", "0"], "argument --pairs: must be >= 1, got 0"),
    (["--layers", "-1"], "argument --layers: must be >= 1, got -1"),
    (["--warmup", "-1"], "argument --warmup: must be >= 1, got -1"),
    # step 1 has no step_end before it to be timed from, and a save "after step 0" (never
    # made) was counted as due in the timed steps: every run a MISS, "4 of 5 saves made"
    (["--warmup", "0"], "argument --warmup: must be >= 1, got 0"),
    # no step left to time: a statistics traceback after every run had been made
    (["--steps", "20", "--every", "10"],
     "--steps 20 leaves no timed steps after --warmup 11: give --steps > 21"),
    # the trainer refused them in its first run: a CalledProcessError traceback
    (["--tp", "3"], "the trainer refuses these settings: heads 4 not divisible by tp 3"),
    (["--dp", "3"], "the trainer refuses these settings: batch size 16 is not divisible by dp 3"),
    (["--pp", "5"], "the trainer refuses these settings: 4 micro-batches cannot fill 5"),
])
def test_trainer_bench_refuses_nonsense_arguments(argv: list[str], says: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("trainer", argv, says, monkeypatch, capsys, heavy=("_run", "gpu_stall"))


@pytest.mark.parametrize(("argv", "says"), [
    (["--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    (["--saves", "0"], "argument --saves: must be >= 1, got 0"),
])
def test_save_cost_bench_refuses_nonsense_arguments(argv: list[str], says: str,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("save_cost", argv, says, monkeypatch, capsys, heavy=("run",))


@pytest.mark.parametrize(("argv", "says"), [
    (["--worlds", "8,a"],
     "argument --worlds: give whole numbers >= 1 separated by commas, got '8,a'"),
    (["--worlds", "10"], "argument --worlds: 10 ranks are no multiple of tp x pp = 4"),
    (["--objects", "0"],
     "argument --objects: give whole numbers >= 1 separated by commas, got '0'"),
    (["--reps", "0"], "argument --reps: must be >= 1, got 0"),
])
def test_load_metadata_bench_refuses_a_world_it_cannot_lay_out(
        argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _refuses("load_metadata", argv, says, monkeypatch, capsys, heavy=("run",))
