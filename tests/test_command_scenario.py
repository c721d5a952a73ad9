"""``trainer.command``: the user's own script as a scenario's trainer, without running it.

Validation (file, key, reason), the command line and environment chaos gives it, finding its
ranks in /proc, and what measurements and the verdict say when the script reports little.
Runs of real scripts are in test_command_run.py and test_examples.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.faults import Injection
from antifragile.chaos.infra.launch import command_args, command_env
from antifragile.chaos.observe import checker, figures, measure
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.run.pipeline import _reference_key
from antifragile.chaos.run.workers import WorkerWatch, children
from antifragile.chaos.scenario import (
    SCENARIOS,
    CommandSpec,
    ScenarioError,
    load_scenario,
    parse_scenario,
)

SCRIPT = str(Path(__file__).with_name("_user_script.py"))


def _doc(**changes: Any) -> dict[str, Any]:
    trainer = {"command": ["python", SCRIPT], "nproc_per_node": 2, **changes.pop("trainer", {})}
    return {"name": "mine", "trainer": trainer, **changes}


@pytest.mark.parametrize(("doc", "message"), [
    (_doc(trainer={"command": ["python", "no_such_train.py"]}),
     "s.yaml: trainer.command.1: script 'no_such_train.py' not found"),
    # a name too long for the file system was an OSError traceback (ENAMETOOLONG)
    (_doc(trainer={"command": ["python", "t" * 300 + ".py"]}),
     f"s.yaml: trainer.command.1: script '{'t' * 300}.py' not found"),
    (_doc(trainer={"command": ["./" + "t" * 300]}),
     f"s.yaml: trainer.command.0: './{'t' * 300}' not found"),
    # a folder there was "not found (looked relative to ...)": the user looks and finds it
    (_doc(trainer={"command": ["python", str(Path(SCRIPT).parent)]}),
     f"s.yaml: trainer.command.1: script '{Path(SCRIPT).parent}' is a folder, not a "
     "file"),
    (_doc(trainer={"command": [str(Path(SCRIPT).parent)]}),
     f"s.yaml: trainer.command.0: '{Path(SCRIPT).parent}' is a folder, not a file"),
    # accepted, then a ValueError traceback when chaos run started the reference run
    (_doc(trainer={"env": {"OMP_NUM_THREADS=1": ""}}),
     "s.yaml: trainer.env: 'OMP_NUM_THREADS=1' is not an environment variable name"),
    (_doc(trainer={"env": {"": "1"}}), "s.yaml: trainer.env: '' is not an environment variable"),
    (_doc(trainer={"env": {"A": "x\0y"}}), "s.yaml: trainer.env: A: a value cannot hold a NUL"),
    # YAML's false became "0" (a script reading "false" saw "0"); null and a list were three
    # lines each naming pydantic's union members (.str, .int, .float)
    (_doc(trainer={"env": {"TOKENIZERS_PARALLELISM": False}}),
     "s.yaml: trainer.env: TOKENIZERS_PARALLELISM: False is a YAML boolean (true/false/yes/no/"
     "on/off); quote the text the variable should hold, e.g. 'false'"),
    # set for every rank by torchrun or chaos, over the scenario's: the value was dropped
    (_doc(trainer={"env": {"WORLD_SIZE": 4}}),
     "s.yaml: trainer.env: WORLD_SIZE: torchrun sets it for every rank (from nproc_per_node "
     "and nodes); a value here would be replaced"),
    (_doc(trainer={"env": {"ANTIFRAGILE_CKPT_URL": "/data/ckpt"}}),
     "s.yaml: trainer.env: ANTIFRAGILE_CKPT_URL: chaos sets it for every rank (from "
     "checkpoint.url); a value here would be replaced"),
    # torchrun reads an option its command line does not give from PET_<OPTION>: accepted,
    # PET_NNODES=2 had the one-host job wait for a second host until the run's time limit
    (_doc(trainer={"env": {"PET_NNODES": "2"}}),
     "s.yaml: trainer.env: PET_NNODES: torchrun reads it as its option --nnodes; chaos "
     "launches torchrun itself"),
    (_doc(trainer={"env": {"X": None}}),
     "s.yaml: trainer.env: X: no value (null); give a text or a number, '' for empty"),
    (_doc(trainer={"env": {"Y": [1]}}),
     "s.yaml: trainer.env: Y: a list is not a text or a number"),
    (_doc(trainer={"command": ["python", SCRIPT, "--tag", "a\0b"]}),
     "s.yaml: trainer.command.3: 'a\\x00b' holds a NUL byte"),
    (_doc(trainer={"command": ["no-such-launcher", "x"]}),
     "s.yaml: trainer.command.0: 'no-such-launcher' is not an executable on PATH"),
    # accepted: each rank's interpreter then read its program from chaos's standard input
    # (a terminal: the run waited there until its time limit)
    (_doc(trainer={"command": ["python"]}),
     "s.yaml: trainer.command: command: python runs nothing (give a script, -m module or -c"),
    (_doc(trainer={"command": ["python3", "-u"]}),
     "s.yaml: trainer.command: command: python3 -u runs nothing (give a script, -m module"),
    (_doc(trainer={"command": ["python", "-m"]}),
     "s.yaml: trainer.command.1: -m needs its module after it"),
    (_doc(trainer={"command": []}), "s.yaml: trainer.command: List should have at least 1 item"),
    (_doc(trainer={"nproc_per_node": 0}),
     "s.yaml: trainer.nproc_per_node: Input should be greater than or equal to 1"),
    # accepted: torchrun then started 100000 processes on this machine
    (_doc(trainer={"nproc_per_node": 100000}),
     "s.yaml: trainer.nproc_per_node: 100000 processes; this machine holds at most"),
    (_doc(trainer={"gpus": 2}), "s.yaml: trainer.gpus: unknown key"),
    (_doc(trainer={"parallel": {"dp": 2}}),
     "s.yaml: trainer.parallel: a setting of the built-in trainer; with trainer.command"),
    (_doc(trainer={"steps": 10}), "s.yaml: trainer.steps: a setting of the built-in trainer"),
    (_doc(trainer={"nodes": 2}), "s.yaml: trainer.nodes: 2 nodes: a command trainer runs on one"),
    (_doc(checkpoint={"every_steps": 5}),
     "s.yaml: checkpoint.every_steps: with trainer.command your script decides"),
    (_doc(faults=[{"kind": "kill_rank", "rank": 2, "at_s": 5}]),
     "s.yaml: faults.0.rank: rank 2 is outside the world of 2 ranks"),
    (_doc(faults=[{"kind": "kill_rank", "rank": {"dp": 1}, "at_s": 5}]),
     "s.yaml: faults.0.rank: coordinates need the built-in trainer's mesh"),
    (_doc(faults=[{"kind": "crash_during_save", "at_checkpoint": 1}]),
     "s.yaml: faults.0.kind: crash_during_save needs the built-in trainer's save-phase"),
    (_doc(faults=[{"kind": "hang_rank", "rank": 0, "at_s": 5, "mode": "thread"}]),
     "s.yaml: faults.0.mode: hang_rank mode thread"),
    (_doc(faults=[{"kind": "kill_rank", "rank": 0, "at_checkpoint": 2}]),
     "s.yaml: faults.0.at_checkpoint: a command trainer's checkpoints are its own"),
    (_doc(trainer={"probe": False}, faults=[{"kind": "kill_rank", "rank": 0, "at_step": 5}]),
     "s.yaml: faults.0.at_step: at_step needs the script to report its steps through "
     "antifragile.probe"),
    (_doc(trainer={"probe": False}, expect={"max_lost_steps": 3}),
     "s.yaml: expect.max_lost_steps: cannot be measured without the probe"),
    (_doc(faults=[{"kind": "kill_rank", "rank": 0, "at_s": 5, "at_step": 4}]),
     "give exactly one trigger: at_step, at_checkpoint, mtbf_s or at_s"),
])
def test_bad_command_scenarios_name_file_key_and_reason(doc: Any, message: str) -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(doc, path="s.yaml")
    assert message in str(exc.value)


@pytest.mark.parametrize("command", [["python", "-mjson.tool"], ["python", "-c", "pass"],
                                     ["python", "-cpass"], ["python", "-u", "-m", "json.tool"]])
def test_python_running_a_module_or_code_is_accepted(command: list[str]) -> None:
    s = parse_scenario(_doc(trainer={"command": command}))
    assert s.trainer.command == command  # type: ignore[union-attr]


def test_a_command_scenario_resolves_its_script_next_to_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "mine", "trainer": {"command": ["python", "-u", "train.py", "--steps", "3"],
                                    "env": {"OMP_NUM_THREADS": 1}},
        "faults": [{"kind": "kill_rank", "rank": 0, "at_s": 0}]}))
    monkeypatch.chdir("/")
    s = load_scenario(path)
    assert isinstance(s.trainer, CommandSpec) and s.is_command
    assert s.trainer.command == ["python", "-u", str(tmp_path / "train.py"), "--steps", "3"]
    assert s.trainer.env == {"OMP_NUM_THREADS": "1"} and s.trainer.world_size == 1
    assert s.faults[0].at_s == 0
    ok = CliRunner().invoke(main, ["validate", str(path)])
    assert ok.exit_code == 0 and "1 ranks, command python -u" in ok.output


def test_shipped_example_scenarios_load_from_any_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    shipped = sorted(SCENARIOS.glob("examples/*.yaml")) + [
        SCENARIOS / "nightly" / "hf-gpt2-kill-corrupt.yaml"]
    assert len(shipped) == 3
    for path in shipped:
        s = load_scenario(path)
        assert s.is_command and Path(s.trainer.command[1]).is_file()  # type: ignore[union-attr]


def test_a_bad_command_scenario_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_doc(trainer={"command": ["python", "gone.py"]})))
    for command in (["validate", str(path)], ["run", str(path)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2
        assert result.output.count("\n") == 1 and "trainer.command" in result.output
        assert "Traceback" not in result.output


def test_a_configuration_mistake_of_the_built_in_trainer_as_a_command_fails_before_a_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``command: [python, -m, antifragile.trainer, --steps, "0"]`` launched torchrun, whose
    every worker exited 2 (a usage error, the same in any process) and was restarted
    ``max_restarts`` times: with one mtbf fault, 52 restarts, minutes of the one message. The
    trainer's own checks of its options now run as the scenario is validated: bad input,
    exit 2, one line naming the option, and nothing launched."""
    from antifragile.chaos.run import runner

    launched: list[str] = []
    monkeypatch.setattr(runner, "launch", lambda s, *a, **kw: launched.append(s.name))
    doc = _doc(trainer={"command": ["python", "-m", "antifragile.trainer", "--steps", "0"],
                        "nproc_per_node": 1, "probe": False},
               checkpoint={"url": None}, expect={"bitwise_equal_to_reference": False},
               faults=[{"kind": "kill_rank", "rank": 0, "mtbf_s": 30}])
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ScenarioError, match=r"s\.yaml: trainer: command: python -m "
                                            r"antifragile\.trainer --steps 0: steps must be "
                                            r">= 1, got 0$"):
        load_scenario(tmp_path / "s.yaml")
    for bad, why in ((["--no-such-option"], "unrecognized arguments: --no-such-option"),
                     (["--heads", "3"], "d_model 64 is not divisible by heads 3")):
        with pytest.raises(ScenarioError, match=why):
            parse_scenario(_doc(trainer={"command": ["python", "-m", "antifragile.trainer",
                                                     *bad]}))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "s.yaml"), "--no-reference",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "steps must be >= 1, got 0" in result.output, result.output
    assert launched == [] and len(result.output.strip().splitlines()) == 1, result.output
    parse_scenario(_doc(trainer={"command": ["python", "-m", "antifragile.trainer", "--steps",
                                             "4", "--heads", "2"]}))  # a good one still loads


@pytest.mark.parametrize("asks", [["--help"], ["--hel"], ["--steps", "4", "-h"]])
def test_a_command_that_asks_the_built_in_trainer_for_its_help_is_refused_quietly(
        asks: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The trainer's check of its options printed its help into ``chaos validate``'s output
    and ended the validation with SystemExit 0: a scenario that trains nothing passed."""
    with pytest.raises(ScenarioError, match=r"prints its help and exits: it trains nothing"):
        parse_scenario(_doc(trainer={"command": ["python", "-m", "antifragile.trainer",
                                                 *asks]}))
    assert "usage:" not in capsys.readouterr().out


def test_the_script_gets_this_python_and_the_probe_contract(tmp_path: Path) -> None:
    s = parse_scenario(_doc(trainer={"env": {"HF_HUB_OFFLINE": "1"}}))
    assert isinstance(s.trainer, CommandSpec)
    assert command_args(s.trainer) == [sys.executable, SCRIPT]
    bare = parse_scenario(_doc(trainer={"command": [SCRIPT, "--steps", "3"]}))
    assert command_args(bare.trainer) == [sys.executable, SCRIPT, "--steps", "3"]  # type: ignore[arg-type]
    env = command_env(s.trainer, tmp_path / "run", "/ckpt/here")
    assert env["ANTIFRAGILE_RUN_DIR"] == str(tmp_path / "run")
    assert env["ANTIFRAGILE_CKPT_URL"] == "/ckpt/here" and env["ANTIFRAGILE_CHAOS"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    mine = parse_scenario(_doc(trainer={"env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}}))
    assert command_env(mine.trainer, tmp_path, "u")[  # type: ignore[arg-type]
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_the_script_is_given_absolute_paths_whatever_its_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``chaos run`` puts its run under ``reports/<name>-<time>`` (or a relative ``--out``),
    and a local ``checkpoint.url`` may be relative: the script was given those relative paths,
    so one that changes its working directory (to its own folder, as Hydra does by default)
    wrote its events and checkpoints where chaos never looked, and the run failed with "left
    no committed checkpoint"."""
    monkeypatch.chdir(tmp_path)
    s = parse_scenario(_doc())
    env = command_env(s.trainer, Path("reports/x/run"), "reports/x/ckpt")  # type: ignore[arg-type]
    assert env["ANTIFRAGILE_RUN_DIR"] == str(tmp_path / "reports/x/run")
    assert env["ANTIFRAGILE_CKPT_URL"] == str(tmp_path / "reports/x/ckpt")
    for url in ("s3://bucket/run", "file:///abs/ckpt"):
        assert command_env(s.trainer, tmp_path, url)["ANTIFRAGILE_CKPT_URL"] == url  # type: ignore[arg-type]


def test_the_readme_names_every_variable_chaos_sets_for_a_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's "What chaos gives the script" is the whole list: the variables the script's
    environment gains or sees changed. The launch also set ``PYTHONWARNINGS=ignore`` (for the
    built-in trainer's log), which silenced the script's own warnings, the engine's skipped-save
    and quarantine warnings among them, and ``OMP_NUM_THREADS``/``PYTHONUNBUFFERED``, unnamed."""
    from antifragile.chaos.infra import launch

    for name in ("PYTHONWARNINGS", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
        monkeypatch.delenv(name, raising=False)
    given: dict[str, str] = {}

    def popen(*_: object, env: dict[str, str], **__: object) -> None:
        given.update(env)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    s = parse_scenario(_doc())
    launch.launch(s, tmp_path / "run", "/ckpt/here", max_restarts=0)
    assert "PYTHONWARNINGS" not in given
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("What chaos gives the script", 1)[1].split("- **The probe**", 1)[0]
    changed = sorted(k for k, v in given.items() if os.environ.get(k) != v)
    assert changed and [k for k in changed if k not in section] == []


def test_the_reference_is_keyed_by_the_script_content(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    s = parse_scenario(_doc(trainer={"command": ["python", str(script)]}))
    before = _reference_key(s)
    script.write_text("x = 2\n")
    assert _reference_key(s) != before


def test_the_reference_is_keyed_by_the_engine_and_the_installed_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's final state is also what the libraries it imports compute and store: the
    engine it checkpoints through (a fix to what it writes), transformers, torchdata,
    torchsnapshot. A reference cached before an upgrade of any of them was compared with a
    run of the new ones, and the verdict failed (or passed) on stale bits."""
    import importlib.metadata

    from antifragile.chaos.run import pipeline

    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    for engine in ("antifragile", "torchsnapshot"):
        s = parse_scenario(_doc(trainer={"command": ["python", str(script)]},
                                checkpoint={"engine": engine}))
        key = _reference_key(s)
        real = pipeline.code_digest
        with monkeypatch.context() as m:  # the engine's code edited
            m.setattr(pipeline, "code_digest", lambda folder, real=real: (
                "edited" if folder.name == "engine" else real(folder)))
            pipeline._antifragile_code.cache_clear()
            assert _reference_key(s) != key, engine
        pipeline._antifragile_code.cache_clear()
        assert _reference_key(s) == key
        dists = list(importlib.metadata.distributions())
        upgraded = [type("D", (), {"metadata": {"Name": "transformers"}, "version": "99.0"})()]
        with monkeypatch.context() as m:  # transformers upgraded (found first)
            m.setattr(importlib.metadata, "distributions",
                      lambda dists=dists, upgraded=upgraded: upgraded + dists)
            pipeline._installed.cache_clear()
            assert _reference_key(s) != key, engine
        pipeline._installed.cache_clear()
        assert _reference_key(s) == key

@pytest.mark.parametrize("trainer", ["command", "built-in"])
@pytest.mark.parametrize("module", ["antifragile.probe", "antifragile.chaos.infra.launch"])
def test_the_reference_is_keyed_by_the_code_that_runs_in_and_around_the_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer: str, module: str) -> None:
    """The key held the engine's and the trainer's code only. The probe runs inside the
    script's process: it holds ranks at pause points, writes the events the reference's last
    step and losses are read from, and refuses what it refuses (a step that is no integer);
    after a probe change that made the script fail, the reference cached with the old probe
    was used, and the faulty run was failed against a reference run that the same script
    could no longer make. ``chaos.infra.launch`` gives every rank its environment and its
    torchrun command line (``OMP_NUM_THREADS=1``, a fresh c10d store per attempt): an edit to
    it reused the reference cached before too."""
    import importlib

    from antifragile.chaos.run import pipeline

    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    s = parse_scenario(_doc(trainer={"command": ["python", str(script)]})
                       if trainer == "command" else {"name": "built-in"})
    key = _reference_key(s)
    real = pipeline._file_digest
    edited = Path(importlib.import_module(module).__file__ or "").resolve()
    with monkeypatch.context() as m:  # its code edited
        m.setattr(pipeline, "_file_digest", lambda path, real=real: (
            "edited" if path.resolve() == edited else real(path)))
        pipeline._antifragile_code.cache_clear()
        assert _reference_key(s) != key
    pipeline._antifragile_code.cache_clear()
    assert _reference_key(s) == key


def test_the_reference_key_is_the_same_when_a_distribution_is_seen_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``chaos run`` started in a checkout holding ``antifragile.egg-info`` (a setuptools
    build leaves it there) sees that distribution both there (the working folder is on
    ``sys.path``) and in site-packages: the same libraries, yet the key differed from a run
    started elsewhere, and its cached reference was missed."""
    import importlib.metadata

    from antifragile.chaos.run import pipeline

    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    s = parse_scenario(_doc(trainer={"command": ["python", str(script)]}))
    pipeline._installed.cache_clear()
    key = _reference_key(s)
    checkout = tmp_path / "checkout"
    (checkout / "numpy.egg-info").mkdir(parents=True)
    (checkout / "numpy.egg-info" / "PKG-INFO").write_text(
        f"Metadata-Version: 2.1\nName: numpy\nVersion: {importlib.metadata.version('numpy')}\n")
    monkeypatch.syspath_prepend(str(checkout))
    pipeline._installed.cache_clear()
    try:
        assert _reference_key(s) == key
    finally:
        pipeline._installed.cache_clear()


def test_the_reference_is_keyed_by_the_modules_the_script_can_import_beside_it(
        tmp_path: Path) -> None:
    """``train.py`` imports ``model.py`` and the package ``lib/`` from its own folder: an edit
    to either kept the cached reference of the old code, and the faulty run of the new code
    was compared with it. What the script cannot import from there (another folder, a
    folder that is no package) does not change the key."""
    script = tmp_path / "train.py"
    script.write_text("import model, lib.data\n")
    (tmp_path / "model.py").write_text("width = 1\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "data.py").write_text("seed = 1\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "old.py").write_text("")
    s = parse_scenario(_doc(trainer={"command": ["python", str(script)]}))
    key = _reference_key(s)
    (tmp_path / "notes" / "old.py").write_text("changed = True\n")
    assert _reference_key(s) == key
    (tmp_path / "model.py").write_text("width = 2\n")
    assert _reference_key(s) != key
    key = _reference_key(s)
    (tmp_path / "lib" / "data.py").write_text("seed = 2\n")
    assert _reference_key(s) != key


def test_the_reference_is_keyed_by_a_file_given_as_an_option_value(tmp_path: Path) -> None:
    """``--config=conf.yaml`` names a file as ``--config conf.yaml`` does; only the second
    was in the key, so an edited config kept the old reference."""
    script, conf = tmp_path / "train.py", tmp_path / "conf.yaml"
    script.write_text("x = 1\n")
    conf.write_text("lr: 1\n")
    s = parse_scenario(_doc(trainer={"command": ["python", str(script), f"--config={conf}"]}))
    key = _reference_key(s)
    conf.write_text("lr: 2\n")
    assert _reference_key(s) != key


def test_the_reference_of_a_module_run_with_python_m_is_keyed_by_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m mine.train`` runs ``mine/train.py`` from the working directory (its
    ``sys.path[0]``); no file of the command was in the key, so an edit to the module or to
    one it imports beside it kept the old reference."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "train.py").write_text("x = 1\n")
    (tmp_path / "helpers.py").write_text("y = 1\n")
    monkeypatch.chdir(tmp_path)
    s = parse_scenario(_doc(trainer={"command": ["python", "-m", "mine.train"]}))
    key = _reference_key(s)
    (tmp_path / "mine" / "train.py").write_text("x = 2\n")
    assert _reference_key(s) != key
    key = _reference_key(s)
    (tmp_path / "helpers.py").write_text("y = 2\n")
    assert _reference_key(s) != key


def test_a_file_the_key_cannot_read_is_keyed_by_that_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module beside the script that this user may not read (another user's file in a
    shared folder) raised PermissionError out of the reference key: chaos run ended in a
    traceback before the run began."""
    script, other = tmp_path / "train.py", tmp_path / "theirs.py"
    script.write_text("x = 1\n")
    other.write_text("secret = 1\n")
    s = parse_scenario(_doc(trainer={"command": ["python", str(script)]}))
    key = _reference_key(s)
    real = Path.read_bytes

    def refused(path: Path) -> bytes:
        if path.name == "theirs.py":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", refused)
    assert _reference_key(s) != key


_AGENT = """
import os, subprocess, sys
env = dict(os.environ, RANK="1", TORCHELASTIC_RESTART_COUNT="3")
grandchild = "import time; time.sleep(30)"
worker = subprocess.Popen([sys.executable, "-c",
                           f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                           f"{grandchild!r}])"], env=env)
print(worker.pid, flush=True)
worker.wait()
"""


def test_ranks_are_found_as_the_agents_children_with_torchruns_environment() -> None:
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], stdout=subprocess.PIPE, text=True)
    worker_pid = int(agent.stdout.readline())  # type: ignore[union-attr]
    try:
        watch = WorkerWatch(agent.pid)
        deadline = time.monotonic() + 20
        found: list[dict[str, Any]] = []
        while not found:
            assert time.monotonic() < deadline, "the worker was never found"
            found = watch.poll(force=True)
            time.sleep(0.05)
        time.sleep(0.5)  # the grandchild (same RANK in its environment) is up by now
        assert watch.poll(force=True) == []
        (e,) = found
        assert (e["event"], e["pid"], e["rank"], e["attempt"], e["by"]) == (
            "worker_started", worker_pid, 1, 3, "chaos")
        assert abs(e["t"] - time.time()) < 30
    finally:
        for pid in [*children(worker_pid), worker_pid]:  # the processes this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.kill()
        agent.wait()


def test_a_process_start_time_is_on_the_wall_clock_of_the_events() -> None:
    """Start times are compared with fault injection times (``time.time()``): one off by the
    boot-time rounding or the wall clock's drift since boot (seconds) puts a restart's new
    process before the kill that caused it."""
    for _ in range(3):
        before = time.time()
        child = subprocess.Popen(["sleep", "5"])
        after = time.time()
        try:
            started = children(os.getpid())[child.pid]
        finally:
            child.kill()
            child.wait()
        tick = 1 / os.sysconf("SC_CLK_TCK")
        assert before - 2 * tick <= started <= after + 2 * tick, (before, started, after)


def test_a_later_attempts_rank_given_a_pid_an_earlier_one_had_is_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pids are recycled: a rank of a later attempt may get the pid a rank of an earlier
    attempt had. The watch took it for the process it had already reported and never reported
    it, so the runner never knew that rank of the attempt (and time-based faults found the job
    never up)."""
    from antifragile.chaos.run import workers

    proc: dict[int, float] = {}  # the agent's children: pid -> start time
    environ: dict[int, dict[str, str]] = {}
    monkeypatch.setattr(workers, "children", lambda pid: dict(proc))
    monkeypatch.setattr(workers, "_environ", lambda pid: environ[pid])
    watch = WorkerWatch(1)
    proc[500] = T0
    environ[500] = {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert [(e["attempt"], e["pid"]) for e in watch.poll(force=True)] == [(0, 500)]
    assert watch.poll(force=True) == []
    proc[500] = T0 + 60  # attempt 0's rank died; attempt 1's rank 0 got its pid
    environ[500] = {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert [(e["attempt"], e["pid"], e["t"]) for e in watch.poll(force=True)] == [
        (1, 500, T0 + 60)]
    assert watch.poll(force=True) == []


# --- measurements and verdict when the script reports little --------------------------------

T0 = 1_000.0


def _no_probe_record(*, engine_events: bool) -> tuple[RunRecord, Injection]:
    """Two ranks killed/restarted: rank 1 killed at T0+20, the attempt torn down at +20.5, the
    new processes up at +22; with ``engine_events`` the engine reported the restore (step 8)."""
    events = [{"t": T0 + 1 + r, "rank": r, "attempt": 0, "event": "worker_started",
               "pid": 100 + r, "by": "chaos"} for r in (0, 1)]
    events += [{"t": T0 + 22, "rank": r, "attempt": 1, "event": "worker_started",
                "pid": 200 + r, "by": "chaos"} for r in (0, 1)]
    if engine_events:
        events += [{"t": T0 + 25, "rank": r, "attempt": 1, "event": e, "step": 8,
                    "seconds": 0.5, **({"pid": 200 + r, "world_size": 2} if e == "start" else {})}
                   for r in (0, 1) for e in ("start", "restore_end")]
    kill = Injection("kill_rank", T0 + 20, step=None, rank=1, fault_index=0, detail={"pid": 101})
    record = RunRecord(0, T0, T0 + 60, sorted(events, key=lambda e: e["t"]), [kill],
                       {0: T0 + 20.5, 1: T0 + 60})
    return record, kill


def _command_scenario(*, faults: bool = True, **expect: Any) -> Any:
    return parse_scenario(_doc(faults=[{"kind": "kill_rank", "rank": 1, "at_s": 20}] if faults
                               else [], expect={"bitwise_equal_to_reference": False, **expect}))


def test_without_the_probe_detect_and_restart_are_measured_the_rest_is_said() -> None:
    record, kill = _no_probe_record(engine_events=False)
    t = measure.fault_timings(record, kill)
    assert t.effect_observed and t.ended_attempt == 0 and t.injected_step is None
    assert t.detect_s == pytest.approx(0.5) and t.restart_s == pytest.approx(1.5)
    assert (t.restore_s, t.recompute_s, t.recovery_s, t.lost_steps) == (None,) * 4
    assert t.unmeasured and "does not call antifragile.probe" in t.unmeasured
    assert figures.goodput(record) is None
    said = measure.not_measured(record, [t])
    assert any(s.startswith("step times, losses and goodput") for s in said)
    assert any("processes torchrun started" in s for s in said)
    assert any(s.startswith("checkpoint stall") for s in said)
    v = checker.judge(_command_scenario(), returncode=0, timings=[t], final_step=20,
                      faulty_url="u", reference_url=None, final_committed=True)
    assert v.verdict == "pass", v.reasons


def test_a_restore_of_unknown_duration_is_not_given_one() -> None:
    """``probe.restored`` as the process's first report (a script restoring its own way)
    reports no restore time: recovery is measured end to end (restore and recompute not apart),
    not with a restore of 0 s made up from the two events written in one call."""
    record, kill = _no_probe_record(engine_events=True)
    for e in record.events:
        if e["event"] == "restore_end":
            e["seconds"] = None
    record.events += [{"t": T0 + 26 + i, "rank": r, "attempt": 1, "event": "step_end",
                       "step": 9 + i, "loss": None, "seconds": 1.0}
                      for i in range(4) for r in (0, 1)]
    record.events.sort(key=lambda e: e["t"])
    kill.step = 11
    t = measure.fault_timings(record, kill)
    assert t.restored_step == 8 and t.lost_steps == 3
    assert t.restore_s is None and t.recompute_s is None
    assert t.recovery_s == pytest.approx(T0 + 28 - kill.t)  # to step 11 again
    assert t.unmeasured and "probe.restored" in t.unmeasured


def test_a_hang_the_job_never_noticed_is_no_effect_not_a_missing_recovery() -> None:
    """A script without the probe writes no event of its own, and no script writes ``exit``:
    a stop that the job rode out (it resumed and the run finished, exit 0, no restart) left
    no trace of "went on". It was taken as the cause of the attempt's end, and the verdict
    said "no recovery was observed (the job did not come back)", not that the stop had no
    effect (shorter than the script's detection timeout)."""
    record, _ = _no_probe_record(engine_events=False)
    record.events = [e for e in record.events if e["attempt"] == 0]
    record.attempt_ends = {0: T0 + 30}
    hang = Injection("hang_rank", T0 + 20, step=None, rank=1, fault_index=0,
                     detail={"pid": 101, "duration_s": 5.0, "mode": "process"})
    record.injections = [hang]
    t = measure.fault_timings(record, hang)
    assert not t.effect_observed and t.ended_attempt is None, t.effect
    assert t.effect and "finished normally" in t.effect
    scenario = parse_scenario(_doc(faults=[{"kind": "hang_rank", "rank": 1, "at_s": 20}],
                                   expect={"bitwise_equal_to_reference": False}))
    v = checker.judge(scenario, returncode=0, timings=[t], final_step=20, faulty_url="u",
                      reference_url=None, final_committed=True)
    assert v.verdict == "fail"
    assert v.reasons == [f"hang_rank at step None: no observable effect: {t.effect}"]


def test_a_full_disk_a_script_without_the_probe_rode_out_passes() -> None:
    """Without the probe a script reports no step, so "steps during the fill" is always 0:
    every disk_full or storage_outage of a probe-less script failed as "training did not go
    on during the outage (0 steps, or a restart)", though the job saved again after it, was
    never restarted and exited 0. Without steps, only a restart says it did not go on."""
    events = [{"t": T0 + 1 + r, "rank": r, "attempt": 0, "event": "worker_started",
               "pid": 100 + r, "by": "chaos"} for r in (0, 1)]
    for r in (0, 1):
        events.append({"t": T0 + 3, "rank": r, "attempt": 0, "event": "start",
                       "pid": 100 + r, "world_size": 2})
        for step, t in ((10, 10.0), (20, 21.0), (30, 30.0)):
            events.append({"t": T0 + t, "rank": r, "attempt": 0, "event": "ckpt_staged",
                           "step": step, "stall_s": 0.01})
            events.append(
                {"t": T0 + t + 0.5, "rank": r, "attempt": 0, "event": "ckpt_failed",
                 "step": step, "error": "[Errno 28] No space left on device"} if step == 20
                else {"t": T0 + t + 0.5, "rank": r, "attempt": 0, "event": "ckpt_committed",
                      "step": step, "bytes": 10, "persist_s": 0.5})
    full = Injection("disk_full", T0 + 20, fault_index=0, detail={
        "duration_s": 5.0, "volume_mib": 64, "ended_t": T0 + 25, "filled_bytes": 60 << 20,
        "error": None})
    record = RunRecord(0, T0, T0 + 40, sorted(events, key=lambda e: e["t"]), [full],
                       {0: T0 + 40})
    t = measure.fault_timings(record, full)
    assert t.effect_observed, t.effect
    assert t.outage is not None and t.outage["training_continued"]
    scenario = parse_scenario(_doc(trainer={"probe": False},
                                   faults=[{"kind": "disk_full", "at_s": 20, "duration_s": 5}],
                                   expect={"bitwise_equal_to_reference": False}))
    v = checker.judge(scenario, returncode=0, timings=[t], final_step=30, faulty_url="u",
                      reference_url=None, final_committed=True)
    assert v.verdict == "pass", v.reasons
    # the fill crashed it instead: no save after it, and torchrun started attempt 1
    record.events = [e for e in record.events if e.get("step") != 30] + [
        {"t": T0 + 27, "rank": r, "attempt": 1, "event": "worker_started", "pid": 200 + r,
         "by": "chaos"} for r in (0, 1)]
    t = measure.fault_timings(record, full)
    assert t.outage is not None and not t.outage["training_continued"]
    v = checker.judge(scenario, returncode=0, timings=[t], final_step=10, faulty_url="u",
                      reference_url=None, final_committed=True)
    assert "disk_full at step None: training did not go on during the outage (a restart " \
        "followed it)" in v.reasons


def test_a_kill_belongs_to_the_attempt_of_the_process_it_hit_whatever_the_clocks_say() -> None:
    """A restarted process whose start time reads a little before the kill (clocks of two
    sources) must not make the kill look like it struck the new attempt."""
    record, kill = _no_probe_record(engine_events=False)
    for e in record.events:
        if e["attempt"] == 1:
            e["t"] = T0 + 19.9
    t = measure.fault_timings(record, kill)
    assert t.effect_observed and t.ended_attempt == 0, t.effect


def test_a_kill_before_the_next_attempt_s_first_report_interrupts_the_recovery() -> None:
    """A script that calls the probe; rank 1 is killed at step 10, and the restarted job's
    rank 0 is killed 0.5 s after it started, while it still imports torch (an ``mtbf_s``
    arrival): attempt 1 never reported. The first recovery was cut short by the second fault,
    whose recovery covers both. It was reported as "the script reported nothing (it does not
    call antifragile.probe)", and an ``expect.max_lost_steps`` failed the verdict as one that
    "cannot be checked"."""
    events: list[dict[str, Any]] = []
    for attempt, up in ((0, T0 + 1), (1, T0 + 16), (2, T0 + 19)):
        events += [{"t": up, "rank": r, "attempt": attempt, "event": "worker_started",
                    "pid": 100 * (attempt + 1) + r, "by": "chaos"} for r in (0, 1)]
    for attempt, up, first, last, restored in ((0, T0 + 3, 1, 10, None),
                                               (2, T0 + 21, 9, 20, 8)):
        for r in (0, 1):
            events.append({"t": up, "rank": r, "attempt": attempt, "event": "start",
                           "pid": 100 * (attempt + 1) + r, "world_size": 2})
            if restored is not None:
                events.append({"t": up + 0.1, "rank": r, "attempt": attempt,
                               "event": "restore_begin"})
                events.append({"t": up + 0.5, "rank": r, "attempt": attempt,
                               "event": "restore_end", "step": restored, "seconds": 0.4})
            events += [{"t": up + 1 + i, "rank": r, "attempt": attempt, "event": "step_end",
                        "step": step, "loss": None, "seconds": 1.0}
                       for i, step in enumerate(range(first, last + 1))]
            events += [{"t": up + 1.2 + step - first, "rank": r, "attempt": attempt,
                        "event": "ckpt_committed", "step": step, "bytes": 10, "persist_s": 0.1}
                       for step in range(first, last + 1) if step % 4 == 0]
    kills = [Injection("kill_rank", T0 + 13.5, step=10, rank=1, fault_index=0,
                       detail={"pid": 101}),
             Injection("kill_rank", T0 + 16.5, step=None, rank=0, fault_index=0,
                       detail={"pid": 200})]
    record = RunRecord(0, T0, T0 + 40, sorted(events, key=lambda e: e["t"]), kills,
                       {0: T0 + 14, 1: T0 + 17, 2: T0 + 40})
    scenario = parse_scenario(_doc(faults=[{"kind": "kill_rank", "rank": "random", "mtbf_s": 5}],
                                   expect={"bitwise_equal_to_reference": False,
                                           "max_lost_steps": 4}))
    first, second = (measure.fault_timings(record, k, window_s=30.0) for k in kills)
    assert first.ended_attempt == 0 and second.ended_attempt == 1, (first.effect, second.effect)
    assert first.unmeasured is None, first.unmeasured
    assert first.interrupted_by_t == pytest.approx(T0 + 16.5)
    assert second.restored_step == 8 and second.lost_steps == 2
    v = checker.judge(scenario, returncode=0, timings=[first, second], final_step=20,
                      faulty_url="u", reference_url=None, final_committed=True)
    assert v.verdict == "pass", v.reasons
    assert not measure.not_measured(record, [first, second])


def test_with_the_engines_events_only_the_restore_is_measured_too() -> None:
    record, kill = _no_probe_record(engine_events=True)
    t = measure.fault_timings(record, kill)
    assert t.restart_s == pytest.approx(1.5 + 3)  # to the script's first report
    assert t.restored_step == 8 and t.restore_s == pytest.approx(0.0)
    assert (t.recompute_s, t.recovery_s, t.lost_steps) == (None,) * 3
    assert t.unmeasured and "reported no step" in t.unmeasured


def test_a_bound_that_cannot_be_measured_fails_rather_than_passes() -> None:
    record, kill = _no_probe_record(engine_events=True)
    t = measure.fault_timings(record, kill)
    v = checker.judge(_command_scenario(max_recovery_s=100), returncode=0, timings=[t],
                      final_step=20, faulty_url="u", reference_url=None, final_committed=True)
    assert v.verdict == "fail"
    assert "expect.max_recovery_s cannot be checked" in v.reasons[0]


def test_a_job_that_never_came_back_fails_even_without_the_probe() -> None:
    record, kill = _no_probe_record(engine_events=False)
    record.events = [e for e in record.events if e["attempt"] == 0]
    t = measure.fault_timings(record, kill)
    assert t.restart_s is None
    v = checker.judge(_command_scenario(), returncode=1, timings=[t], final_step=None,
                      faulty_url="u", reference_url=None, final_committed=False)
    assert v.verdict == "fail"
    assert any("no recovery was observed" in r for r in v.reasons)
    assert any("left no committed antifragile checkpoint" in r for r in v.reasons)


def test_a_script_that_checkpointed_with_another_engine_is_told_which(tmp_path: Path) -> None:
    """Without a reference run (--no-reference) the verdict is where a DCP script left at the
    default engine learns why none of its checkpoints counted: it was told it must checkpoint
    to $ANTIFRAGILE_CKPT_URL, which it had."""
    step = tmp_path / "ckpt" / "step_000000010"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"dcp")
    v = checker.judge(_command_scenario(faults=False), returncode=0, timings=[],
                      final_step=None, faulty_url=str(tmp_path / "ckpt"), reference_url=None,
                      final_committed=False)
    assert any("it holds committed dcp checkpoints (step 10): set checkpoint.engine: dcp" in r
               for r in v.reasons), v.reasons


def test_a_script_whose_only_steps_were_quarantined_is_told_so(tmp_path: Path) -> None:
    """A corrupt_shard on the only committed step: the restart's load quarantines it, and the
    next start's ``agreed_steps`` raises rather than start over. The script did save through
    the engine; it was told to."""
    import torch

    from antifragile.engine import CheckpointEngine
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url) as ckpt:
        ckpt.save(10, {"w": torch.ones(4)}, blocking=True)
    quarantine(open_storage(url), 10, "bitflip", reports={0: "bitflip"}, confirmed_by=0)
    v = checker.judge(_command_scenario(faults=False), returncode=1, timings=[],
                      final_step=None, faulty_url=url, reference_url=None,
                      final_committed=False)
    reason = next(r for r in v.reasons if "left no committed" in r)
    assert "save through CheckpointEngine" not in reason, reason
    assert f"step 10 was quarantined as damaged (`chaos ckpt ls {url}` says why)" in reason


def test_a_fault_due_after_the_scripts_last_step_is_said_to_be() -> None:
    """``chaos validate`` cannot know a script's steps; the reference run told: a kill at step
    100 of a 60-step script was 'never injected (its trigger was never reached)', no why."""
    s = parse_scenario(_doc(faults=[{"kind": "kill_rank", "rank": 1, "at_step": 100}],
                            expect={"bitwise_equal_to_reference": False}))
    v = checker.judge(s, returncode=0, timings=[], final_step=60, faulty_url="u",
                      reference_url=None, final_committed=True, last_step=60,
                      reference_last_step=60)
    assert ("faults.0 (kill_rank): never injected: its at_step 100 is after step 60, the "
            "last the fault-free run reported") in v.reasons, v.reasons


def test_steps_that_do_not_grow_are_named_unless_a_restore_came_between() -> None:
    """A rank's steps within one attempt must grow; a new attempt starts afresh, and so does a
    restore the rank reported (a script that rolls back in process after a loss spike)."""
    def ev(event: str, step: int, rank: int = 0, attempt: int = 0) -> dict[str, Any]:
        return {"event": event, "step": step, "rank": rank, "attempt": attempt}

    grew = [ev("step_end", 1), ev("step_end", 1, rank=1), ev("step_end", 2),
            ev("step_end", 1, attempt=1), ev("step_end", 3), ev("restore_end", 2),
            ev("step_end", 3)]
    assert checker.steps_out_of_order(grew) is None
    again = checker.steps_out_of_order([*grew, ev("step_end", 3)])
    assert again is not None and again.startswith(
        "rank 0 reported step 3 after step 3 (attempt 0): probe.step_end takes the global step")


@pytest.mark.parametrize(("engine", "marker"), [("dcp", ".metadata"),
                                                ("torchsnapshot", ".snapshot_metadata")])
def test_a_script_whose_step_folders_are_named_otherwise_is_told_the_name(
        tmp_path: Path, engine: str, marker: str) -> None:
    """A DCP script that wrote ``f"{url}/step_{step}"`` (``step_10``, not ``step_000000010``)
    had checkpointed to $ANTIFRAGILE_CKPT_URL, and was told it "must checkpoint to
    $ANTIFRAGILE_CKPT_URL": the reason sent it looking at the URL, not at the folder name."""
    url = tmp_path / "ckpt"
    for name in ("step_10", "step_20"):
        (url / name).mkdir(parents=True)
        (url / name / marker).write_bytes(b"x")
    assert checker.why_no_checkpoint(engine, str(url)) == (
        f"it holds step_10, step_20, but no folder step_<9 digits> with {marker} in it: "
        f"write the checkpoint of step N to f\"{{url}}/step_{{N:09d}}\"")
    assert checker.why_no_checkpoint(engine, str(tmp_path / "empty")) == (
        "the script must checkpoint to $ANTIFRAGILE_CKPT_URL")


def test_a_folder_that_holds_no_committed_step_of_ours_is_told_what_it_holds(
        tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    url.mkdir()
    (url / "model.pt").write_bytes(b"torch.save")
    assert checker.why_no_checkpoint("antifragile", str(url)) == (
        "it holds model.pt, but no committed step of antifragile.engine.CheckpointEngine: "
        "save through CheckpointEngine($ANTIFRAGILE_CKPT_URL)")


def test_the_newest_committed_steps_must_match_the_reference() -> None:
    v = checker.judge(_command_scenario(faults=False), returncode=0, timings=[], final_step=35,
                      faulty_url="u", reference_url=None, final_committed=True,
                      expected_step=40)
    assert v.verdict == "fail" and v.reasons[0] == (
        "the newest committed checkpoint is step 35, the reference run's is step 40")


def test_a_reference_whose_reported_steps_are_gone_fails_a_run_that_reported_some() -> None:
    """The run reported steps up to 13; the reference's event files (in the cache) are gone or
    unreadable, so nothing says where the reference ended: where the run ended cannot be
    checked (a script that exits 0 early after its newest checkpoint), which passed."""
    judged: dict[str, Any] = dict(returncode=0, timings=[], final_step=12, faulty_url="u",
                                  reference_url="ref", final_committed=True, expected_step=12)
    v = checker.judge(_command_scenario(faults=False), **judged, last_step=13,
                      reference_last_step=None)
    assert v.verdict == "fail"
    assert v.reasons == ["the last step reported was 13, but the reference run's reported "
                         "steps are missing (its event files gone or unreadable): where the run "
                         "ended cannot be checked"]
    assert checker.judge(_command_scenario(faults=False), **judged, last_step=None,
                         reference_last_step=None).verdict == "pass"  # neither reports steps


def test_a_job_that_restarted_and_restored_but_never_trained_is_told_so() -> None:
    """A script that crashed right after its resume: attempts 1 and 2 started and restored
    step 20, then raised. The verdict said "the job did not come back after attempt 0",
    which sent the reader looking for a restart that had not happened."""
    t = measure.FaultTimings(kind="kill_rank", injected_t=T0, injected_step=25, rank=1,
                             fault_index=0, effect_observed=True, effect="rank 1 killed",
                             ended_attempt=0, recovery_mode="restart", detect_s=0.2,
                             restart_s=2.2, restore_s=0.01, restored_step=20, lost_steps=5)
    v = checker.judge(_command_scenario(), returncode=1, timings=[t], final_step=20,
                      faulty_url="u", reference_url=None, final_committed=True)
    assert v.verdict == "fail"
    assert ("kill_rank at step 25: no recovery was observed (the job came back after attempt "
            "0 and restored step 20, but reported no step after it)") in v.reasons, v.reasons


def test_a_script_that_crashed_is_not_told_it_exited_0_early() -> None:
    """A script that crashed on resume (exit 1) was told, besides its exit code, that it
    ended elsewhere "(a script that exits 0 early, or trains on, after its newest
    checkpoint)": a cause it did not have. The hint is for a script that exited 0."""
    judged: dict[str, Any] = dict(timings=[], final_step=20, faulty_url="u",
                                  reference_url="ref", final_committed=True, expected_step=60,
                                  last_step=25, reference_last_step=60)
    crashed = checker.judge(_command_scenario(faults=False), returncode=1, **judged)
    ended = [r for r in crashed.reasons if r.startswith("the last step reported was 25")]
    assert ended == ["the last step reported was 25, the reference run's 60"], crashed.reasons
    early = checker.judge(_command_scenario(faults=False), returncode=0, **judged)
    assert any("a script that exits 0 early" in r for r in early.reasons), early.reasons


def test_a_nondeterministic_trainer_gets_its_own_verdict() -> None:
    differs = checker.Comparison(differs=["model/w"], compared_bytes=64)
    v = checker.judge(_command_scenario(faults=False), returncode=0, timings=[], final_step=20,
                      faulty_url="u", reference_url=None, final_committed=True,
                      determinism=differs)
    assert v.verdict == "nondeterministic"
    assert "not deterministic" in v.reasons[0] and "model/w" in v.reasons[0]
    same = checker.Comparison(compared_bytes=64)
    assert checker.judge(_command_scenario(faults=False), returncode=0, timings=[], final_step=20,
                         faulty_url="u", reference_url=None, final_committed=True,
                         determinism=same).verdict == "pass"


def test_a_second_fault_free_run_that_fails_is_no_verdict_not_nondeterminism(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--check-determinism``: the second fault-free run crashing (a full disk, an OOM, a
    flaky host) says nothing about determinism; it was reported as ``nondeterministic``
    (exit 4), where the reference run failing the same way is a run that could not be made
    (ChaosRunError, exit 5)."""
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.run.runner import ChaosRunError

    def crashed(*_: Any, **__: Any) -> RunRecord:
        return RunRecord(returncode=1, started_t=0.0, ended_t=1.0, events=[], injections=[])

    monkeypatch.setattr(pipeline, "run_scenario", crashed)
    with pytest.raises(ChaosRunError, match=r"the second fault-free run failed \(code 1\)"):
        pipeline._determinism(_command_scenario(faults=False), tmp_path, "ref", print)


@pytest.mark.parametrize(("written", "kind"), [("60", "a number"), ("0.10", "a number"),
                                              ("yes", "a boolean"), ("true", "a boolean")])
def test_an_unquoted_number_in_the_command_is_told_to_quote_it(
        tmp_path: Path, written: str, kind: str) -> None:
    """``command: [python, train.py, --steps, 60]`` was refused with pydantic's "Input should
    be a valid string", which says neither that YAML read a number nor what to write (the
    README quotes "60"; ``env`` takes numbers and says how to quote them)."""
    path = tmp_path / "s.yaml"
    path.write_text("name: mine\ntrainer:\n  command: [python, -c, pass, --n,\n"
                    f"            {written}]\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value) == (f"{path}: line 4: trainer.command.4: {written} is {kind} to "
                              f"YAML, not text: quote it ('{written}'); a command line is text")
    path.write_text(path.read_text().replace(f"{written}]", f"'{written}']"))
    assert load_scenario(path).trainer.command[-1] == written  # type: ignore[union-attr]


@pytest.mark.parametrize(("written", "reaches"), [("3.10", "3.1"), (".5", "0.5"),
                                                  ("0x10", "16"), ("1.0e+3", "1000.0")])
def test_an_env_number_the_script_would_get_as_other_text_is_refused(
        tmp_path: Path, written: str, reaches: str) -> None:
    """``PYTHON_VERSION: 3.10`` reached the script as "3.1": YAML reads a number, and its text
    as written is gone. Refused with the line and key, as a boolean is; ``1`` and ``0.5`` are
    the text they were written as and stay accepted."""
    path = tmp_path / "s.yaml"
    path.write_text("name: mine\ntrainer:\n  command: [python, -c, pass]\n"
                    f"  env:\n    OK: 1\n    HALF: 0.5\n    V: {written}\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value) == (f"{path}: line 7: trainer.env.V: {written} would reach the "
                              f"script as {reaches!r}: quote it ('{written}') for that text")
    path.write_text(path.read_text().replace(f"V: {written}", f"V: '{written}'"))
    assert load_scenario(path).trainer.env == {  # type: ignore[union-attr]
        "OK": "1", "HALF": "0.5", "V": written}


def test_files_of_the_script_beside_the_event_files_do_not_hide_the_reference_steps(
        tmp_path: Path) -> None:
    """The run's folder is the script's too: a file of its own in ``events/`` (notes, a
    folder) made the reference's reported steps "missing" and failed every faulty run, while
    the runner itself reads only ``events/*.jsonl``."""
    from antifragile.chaos.report.document import reference_losses
    from antifragile.chaos.run.pipeline import _reference_last_step

    events = tmp_path / "ref" / "events"
    events.mkdir(parents=True)
    (events / "rank0.jsonl").write_text(
        '{"t": 1.0, "rank": 0, "attempt": 0, "event": "step_end", "step": 7, "loss": 0.5}\n')
    (events / "notes.txt").write_text("my own log, not JSON\n")
    (events / "tb").mkdir()
    ckpt = str(tmp_path / "ref" / "ckpt")
    assert _reference_last_step(ckpt) == 7
    assert reference_losses(tmp_path / "ref") == [{"step": 7, "loss": 0.5}]


@pytest.mark.parametrize("written", ["yes", "Off", "true"])
def test_an_env_boolean_is_refused_with_the_quoting_it_needs(tmp_path: Path,
                                                              written: str) -> None:
    """``DEBUG: yes`` was refused saying "write true, or quote it for text", and ``true`` was
    then refused as a boolean: an environment variable is text, so the hint is the quotes."""
    path = tmp_path / "s.yaml"
    path.write_text("name: mine\ntrainer:\n  command: [python, -c, pass]\n"
                    f"  env:\n    DEBUG: {written}\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value) == (f"{path}: line 5: trainer.env.DEBUG: {written} is a boolean to "
                              f"YAML, not text: quote it ('{written}') for that text")


@pytest.mark.parametrize(("command", "index"), [
    (["torchrun", "--nproc-per-node", "2", SCRIPT], 0),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node=2", SCRIPT], 2),
    (["python", "-u", "-mtorch.distributed.run", SCRIPT], 2),
    (["python3", "-m", "torch.distributed.launch", SCRIPT], 2),
])
def test_a_command_that_is_torchrun_itself_is_refused(command: list[str], index: int) -> None:
    """chaos runs the command under torchrun: a launch line copied in whole (as the examples'
    docstrings show it, ``torchrun --nproc-per-node 2 train.py``) was accepted, and each rank
    started a torchrun of its own (nproc_per_node x 2 processes sharing two event files); the
    run then failed on "no observable effect ... for another reason", naming no mistake."""
    if command[0] == "torchrun" and not shutil.which("torchrun"):
        command = [str(Path(sys.executable).with_name("torchrun")), *command[1:]]
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(_doc(trainer={"command": command}), path="s.yaml")
    message = str(exc.value)
    assert f"s.yaml: trainer.command.{index}:" in message
    assert "chaos runs the command under torchrun itself" in message
    assert "\n" not in message.strip()


def test_a_pause_point_is_described_in_words() -> None:
    """A pause point a rank never reached was named as a Python dict ({'id': 'p0', 'step':
    12}) in the missed fault's reason."""
    from antifragile.chaos.run.pauses import Point

    assert Point("p0", 12, None).describe() == "the end of step 12"
    assert Point("p1", 10, [1], phase="staged", on_pass=2).describe() == (
        "the save of step 10 at its phase 'staged' (pass 2)")


def test_python_m_of_a_module_that_is_nowhere_is_refused_at_validation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m notamodule`` passed ``chaos validate``; the run then failed (exit 5) after
    the reference's start-up, every rank saying "No module named notamodule". The module's
    top-level name is looked for where a rank looks: the working directory, the scenario's
    ``PYTHONPATH`` and the interpreter's own path (stdlib, installed packages)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(_doc(trainer={"command": ["python", "-m", "notamodule_xyz.train"]}),
                       path="s.yaml")
    assert ("s.yaml: trainer.command.2: module 'notamodule_xyz' not found (looked in "
            f"{tmp_path}, the working directory, and on the interpreter's path)") in \
        str(exc.value), exc.value
    with pytest.raises(ScenarioError) as exc:  # the scenario's PYTHONPATH was looked in too
        parse_scenario(_doc(trainer={"command": ["python", "-m", "notamodule_xyz"],
                                     "env": {"PYTHONPATH": "lib"}}), path="s.yaml")
    assert ("not found (looked in "
            f"{tmp_path}, the working directory, in env's PYTHONPATH (lib), and on the "
            "interpreter's path)") in str(exc.value), exc.value
    for name in (".train", "mine/train.py", "mine.", "a b"):
        with pytest.raises(ScenarioError, match=f"trainer\\.command\\.2: "
                           f"{re.escape(repr(name))} is not a module name"):
            parse_scenario(_doc(trainer={"command": ["python", "-m", name]}), path="s.yaml")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.py").write_text("x = 1\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "theirs.py").write_text("y = 1\n")
    for command, env in ((["python", "-m", "mine.train"], {}),  # beside: the working folder
                         (["python", "-mtheirs"], {"PYTHONPATH": str(tmp_path / "lib")}),
                         (["python", "-m", "antifragile.trainer"], {}),  # installed
                         (["python", "-u", "-m", "json.tool"], {})):  # the standard library
        parse_scenario(_doc(trainer={"command": command, "env": env}))


@pytest.mark.parametrize(("key", "shown"), [(True, "true"), (False, "false"), (3, "3"),
                                            (1.5, "1.5"), (None, "null")])
def test_an_env_name_that_yaml_reads_as_no_text_is_told_to_quote_it(key: Any,
                                                                     shown: str) -> None:
    """``env: {true: x}`` was refused as "trainer.env.1.[key]: Input should be a valid
    string": YAML had read the name as a boolean (shown as 1), a number or null."""
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(_doc(trainer={"env": {key: "x"}}), path="s.yaml")
    assert (f"s.yaml: trainer.env: {shown} is a name YAML reads as a "
            f"{'null' if key is None else type(key).__name__}, not text: quote it "
            f"('{shown}')") in str(exc.value), exc.value
