"""antifragile.probe and the engine's own checkpoint events, as a user's script sees them.

Under chaos (``ANTIFRAGILE_RUN_DIR`` set) they write the rank's event lines; otherwise they do
nothing at all: no file, no thread, no torch import.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from antifragile import probe
from antifragile.engine import CheckpointEngine, _events


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a fresh process as far as the probe and the engine's channel know."""
    for name in ("ANTIFRAGILE_RUN_DIR", "RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(_events.OWNER_ENV, "")  # restored (unset) after the test that sets it
    monkeypatch.delenv(_events.OWNER_ENV)
    monkeypatch.setattr(_events, "_channel", None)
    monkeypatch.setattr(probe, "_probe", None)
    monkeypatch.setattr(probe, "_off", False, raising=False)
    monkeypatch.setattr(_events, "_unusable", False, raising=False)


def _under_chaos(monkeypatch: pytest.MonkeyPatch, run_dir: Path, *, rank: int = 0,
                 attempt: int = 0) -> None:
    monkeypatch.setenv("ANTIFRAGILE_RUN_DIR", str(run_dir))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))


def _events_of(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run_dir / "events" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_not_under_chaos_every_call_touches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the probe touched the filesystem outside chaos")

    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "makedirs"),
                         (os, "mkdir"), (os, "stat"), (os, "listdir"), (os.path, "exists")):
        monkeypatch.setattr(module, name, refuse)
    threads = threading.active_count()
    for step in range(1, 1001):
        probe.step_end(step, loss=0.5)
        probe.restored(step)
    assert threading.active_count() == threads
    assert probe._probe is None and _events._channel is None


def test_not_under_chaos_a_step_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside chaos the first call decides; later calls look nothing up. Each had read
    ``os.environ`` (a key encoded to bytes, a KeyError raised and caught: allocations on every
    step of a training loop that is not under chaos)."""

    class Refused(dict[str, str]):
        def __getitem__(self, key: str) -> str:
            raise AssertionError(f"the probe read {key} from the environment")

        def get(self, key: str, default: Any = None) -> Any:
            raise AssertionError(f"the probe read {key} from the environment")

        def __contains__(self, key: object) -> bool:
            raise AssertionError(f"the probe looked for {key} in the environment")

    probe.step_end(1, loss=0.5)
    with monkeypatch.context() as m:
        m.setattr(os, "environ", Refused())
        for step in range(2, 1002):
            probe.step_end(step, loss=0.5)
            probe.restored(step)
    assert probe._probe is None and _events._channel is None


def test_importing_the_probe_imports_no_torch() -> None:
    code = ("import sys; from antifragile import probe; probe.step_end(1); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {k: v for k, v in os.environ.items() if k != "ANTIFRAGILE_RUN_DIR"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr


def test_under_chaos_the_probe_imports_neither_torch_nor_the_engine(tmp_path: Path) -> None:
    """The probe writes its events through the engine's channel (``engine._events``, standard
    library only), but importing it ran ``antifragile.engine``'s ``__init__``, which imports
    the whole engine (torch, zarr): the first ``step_end`` under chaos took 3 s without torch
    imported and 0.9 s with it, late ``start`` events included in the restart chaos measures."""
    code = ("import sys; from antifragile import probe; probe.step_end(1); probe.restored(1); "
            "heavy = [m for m in ('torch', 'zarr', 'antifragile.engine.engine') "
            "if m in sys.modules]; assert not heavy, heavy")
    env = {**os.environ, "ANTIFRAGILE_RUN_DIR": str(tmp_path), "RANK": "0", "WORLD_SIZE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [e["event"] for e in _events_of(tmp_path)] == ["start", "step_end", "restore_end"]


def test_under_chaos_start_comes_first_then_steps_and_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path, rank=1, attempt=2)
    probe.restored(10)
    probe.step_end(11, loss=torch.tensor(0.25))
    probe.step_end(12)
    events = _events_of(tmp_path, rank=1)
    assert [e["event"] for e in events] == ["start", "restore_end", "step_end", "step_end"]
    start = events[0]
    assert start["pid"] == os.getpid() and start["world_size"] == 2
    assert all(e["rank"] == 1 and e["attempt"] == 2 for e in events)
    assert events[1]["step"] == 10
    assert events[2]["step"] == 11 and events[2]["loss"] == 0.25
    assert events[3]["loss"] is None and events[3]["seconds"] >= 0


@pytest.mark.parametrize("step", [1.5, 2.0, "3", True, torch.tensor(4.0)])
def test_a_step_that_is_no_integer_is_refused_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: Any) -> None:
    """``step_end(step / 2)`` reported ``int(1.5)``, step 1, twice: the script's mistake
    surfaced, if at all, as a verdict about steps that did not grow, naming steps it never
    passed; ``"3"`` went through ``int()`` too. The step is an integer (an int, a numpy
    integer or a one-element integer tensor); anything else raises a TypeError naming the call
    and the value, before anything is reported."""
    _under_chaos(monkeypatch, tmp_path)
    for call in (probe.step_end, probe.restored):
        with pytest.raises(TypeError) as exc:
            call(step)
        assert str(exc.value).startswith(f"probe.{call.__name__}: step must be an integer (the "
                                         f"global step), not {type(step).__name__} ")
    assert not any(e["event"] in ("step_end", "restore_end") for e in _events_of(tmp_path))


def test_a_numpy_or_tensor_integer_step_is_reported_as_its_int(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    _under_chaos(monkeypatch, tmp_path)
    probe.step_end(np.int64(3))
    probe.step_end(torch.tensor(4))
    assert [e["step"] for e in _events_of(tmp_path) if e["event"] == "step_end"] == [3, 4]


def test_a_restore_reported_first_claims_no_time_it_could_not_measure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``restored`` times the restore from the process's first report. A script restoring its
    own way calls it before any other (its first step comes after the restore), so it timed
    the span from its own call: 0.00 s, whatever the restore took, shown as the restore time.
    Then the time is unknown (None); after an earlier report it is counted from there."""
    _under_chaos(monkeypatch, tmp_path)
    time.sleep(0.05)  # the script's own restore, before it calls the probe
    probe.restored(10)
    (end,) = [e for e in _events_of(tmp_path) if e["event"] == "restore_end"]
    assert end["step"] == 10 and end["seconds"] is None


def test_a_first_step_reported_first_claims_no_time_it_could_not_measure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that reports nothing before its first ``step_end`` (no restore through the
    engine or the DCP helper: a fresh start) had that step timed from the event file the call
    itself opened: ~0 s, whatever the step took, and goodput lost one step per attempt. Its
    time is unknown (None); the next step is timed from it."""
    _under_chaos(monkeypatch, tmp_path)
    time.sleep(0.05)  # the script's first step, before it calls the probe
    probe.step_end(1)
    time.sleep(0.05)
    probe.step_end(2)
    first, second = [e for e in _events_of(tmp_path) if e["event"] == "step_end"]
    assert first["seconds"] is None and second["seconds"] >= 0.05


def test_a_restore_after_an_earlier_report_is_timed_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path)
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:  # its save opens the event file
        ckpt.save(5, {"w": torch.ones(3)}, blocking=True)
    time.sleep(0.05)
    probe.restored(5)
    (end,) = [e for e in _events_of(tmp_path) if e["event"] == "restore_end"]
    assert end["seconds"] >= 0.05


def test_a_loss_that_is_no_single_number_is_reported_as_none_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside chaos ``step_end(step, per_sample_losses)`` does nothing; under chaos it raised
    from ``float()`` into the training loop: the job failed at its first step only because it
    was under chaos, and the step's pause point (where an ``at_step`` fault lands) never
    held. The step is reported, its loss as None."""
    _under_chaos(monkeypatch, tmp_path)
    probe.step_end(1, torch.ones(3))
    probe.step_end(2, [0.5, 0.25])
    probe.step_end(3, "n/a")
    probe.step_end(4, torch.tensor([0.125]))
    steps = [(e["step"], e["loss"]) for e in _events_of(tmp_path) if e["event"] == "step_end"]
    assert steps == [(1, None), (2, None), (3, None), (4, 0.125)]


def test_restored_adds_nothing_after_the_engine_reported_the_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path)
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(5, {"w": torch.ones(3)}, blocking=True)
        ckpt.load({"w": torch.zeros(3)})
    probe.restored(5)
    assert [e["event"] for e in _events_of(tmp_path)].count("restore_end") == 1


def test_a_pause_point_holds_step_end_until_released(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path)
    (tmp_path / "control" / "release").mkdir(parents=True)
    (tmp_path / "control" / "plan.json").write_text(json.dumps(
        {"points": [{"id": "p0", "step": 3}]}))
    probe.step_end(2)  # first use: reads the plan
    holder = threading.Thread(target=probe.step_end, args=(3,))
    holder.start()
    deadline = time.monotonic() + 10
    while "paused" not in [e["event"] for e in _events_of(tmp_path)]:
        assert time.monotonic() < deadline, "never paused"
        time.sleep(0.01)
    time.sleep(0.1)
    assert holder.is_alive(), "step_end returned before its release"
    (tmp_path / "control" / "release" / "p0").touch()
    holder.join(10)
    assert not holder.is_alive()
    events = _events_of(tmp_path)
    paused = next(e for e in events if e["event"] == "paused")
    assert paused["point"] == "p0" and paused["step"] == 3
    assert events[-1]["event"] == "resumed"


def test_the_engine_reports_its_saves_and_restores_under_chaos(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path)
    state = {"w": torch.arange(64.0), "step": 0}
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(4, state, blocking=True)
        ckpt.save(8, state).wait()
        assert ckpt.load({"w": torch.zeros(64), "step": 0}) == 8
    events = _events_of(tmp_path)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start"
    assert [(e["event"], e["step"]) for e in events if e["event"].startswith("ckpt_")] == [
        ("ckpt_staged", 4), ("ckpt_committed", 4), ("ckpt_blocked", 4),
        ("ckpt_staged", 8), ("ckpt_committed", 8)]
    committed = next(e for e in events if e["event"] == "ckpt_committed")
    assert committed["bytes"] >= 64 * 4 and committed["persist_s"] > 0
    assert kinds[-2:] == ["restore_begin", "restore_end"] and events[-1]["step"] == 8


def test_a_damaged_step_is_reported_skipped(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path)
    url = tmp_path / "ckpt"
    with CheckpointEngine(str(url)) as ckpt:
        ckpt.save(1, {"w": torch.ones(16)}, blocking=True)
        ckpt.save(2, {"w": torch.ones(16) * 2}, blocking=True)
        (chunk,) = [p for p in (url / "step_000000002").rglob("*")
                    if p.is_file() and "/c." in str(p)]
        data = bytearray(chunk.read_bytes())
        data[0] ^= 1
        chunk.write_bytes(bytes(data))
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert ckpt.load({"w": torch.zeros(16)}) == 1
    events = _events_of(tmp_path)
    skipped = [e for e in events if e["event"] == "restore_skipped"]
    assert [e["step"] for e in skipped] == [2] and "crc32c" in skipped[0]["reason"]
    assert (events[-1]["event"], events[-1]["step"]) == ("restore_end", 1)


def test_no_duplicates_our_trainer_reports_itself(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in trainer writes its own checkpoint events: its engine writes none."""
    from antifragile.trainer.ckpt_backends.antifragile import AntifragileBackend

    _under_chaos(monkeypatch, tmp_path)
    backend = AntifragileBackend(str(tmp_path / "ckpt"), keep_last=2, timeout_s=30,
                                 async_=False)
    backend.save(3, {"w": torch.ones(4)}).wait()
    backend.load({"w": torch.zeros(4)})
    backend.close()
    with CheckpointEngine(str(tmp_path / "ckpt2"), chaos_events=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}, blocking=True)
    assert not (tmp_path / "events").exists()


_SINGLE_PROCESS_DCP = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")


@_SINGLE_PROCESS_DCP
def test_dcp_helpers_report_a_save_a_restore_and_a_failed_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _under_chaos(monkeypatch, tmp_path)
    saved = {"model": {"w": torch.arange(32.0)}, "train": {"step": 5}}
    probe.dcp_save(saved, checkpoint_id=tmp_path / "step_000000005", step=5)
    target = {"model": {"w": torch.zeros(32)}, "train": {"step": 0}}
    probe.dcp_load(target, checkpoint_id=tmp_path / "step_000000005", step=5)
    assert torch.equal(target["model"]["w"], saved["model"]["w"])
    with pytest.raises(BaseException):  # noqa: B017 - DCP raises its own BaseException types
        probe.dcp_load(target, checkpoint_id=tmp_path / "step_000000009", step=9)
    events = _events_of(tmp_path)
    committed = next(e for e in events if e["event"] == "ckpt_committed")
    assert committed["step"] == 5 and committed["bytes"] >= 32 * 4
    assert [e["step"] for e in events if e["event"] == "restore_end"] == [5]
    assert [e["step"] for e in events if e["event"] == "restore_skipped"] == [9]


@_SINGLE_PROCESS_DCP
def test_a_dcp_restore_past_a_damaged_step_is_one_restore_as_the_engines_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script falling back from a step that does not load to an older one (as the FSDP2
    example does) reports one restore: a restore_begin, the skipped step, and a restore_end
    whose seconds count the whole restore, as the engine and the trainer report theirs. Each
    dcp_load began a restore of its own, so the report's restore span started at the last
    try and the time lost on the damaged step went unseen."""
    _under_chaos(monkeypatch, tmp_path)
    saved = {"model": {"w": torch.arange(32.0)}, "train": {"step": 5}}
    probe.dcp_save(saved, checkpoint_id=tmp_path / "step_000000005", step=5)
    (tmp_path / "step_000000009").mkdir()
    (tmp_path / "step_000000009" / ".metadata").write_bytes(b"\x80")  # a truncated pickle
    target = {"model": {"w": torch.zeros(32)}, "train": {"step": 0}}
    started = time.perf_counter()
    with pytest.raises(BaseException):  # noqa: B017 - DCP raises its own BaseException types
        probe.dcp_load(target, checkpoint_id=tmp_path / "step_000000009", step=9)
    time.sleep(0.3)  # the script's own work between its tries
    probe.dcp_load(target, checkpoint_id=tmp_path / "step_000000005", step=5)
    took = time.perf_counter() - started
    events = [e for e in _events_of(tmp_path) if e["event"].startswith("restore_")]
    assert [(e["event"], e.get("step")) for e in events] == [
        ("restore_begin", None), ("restore_skipped", 9), ("restore_end", 5)]
    assert 0.3 <= events[-1]["seconds"] <= took


@_SINGLE_PROCESS_DCP
@pytest.mark.parametrize("chaos", [True, False])
def test_dcp_helpers_take_a_storage_writer_and_reader_as_dcp_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chaos: bool) -> None:
    """README: "same arguments plus the step". ``dcp.save(state, storage_writer=...)`` is the
    other way DCP users name where a checkpoint goes; the helpers required a checkpoint_id,
    so that call, with the step added, raised a TypeError."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if chaos:
        _under_chaos(monkeypatch, tmp_path / "run")
    folder = str(tmp_path / "step_000000003")
    probe.dcp_save({"w": torch.arange(4.0)}, storage_writer=FileSystemWriter(folder), step=3)
    target = {"w": torch.zeros(4)}
    probe.dcp_load(target, storage_reader=FileSystemReader(folder), step=3)
    assert torch.equal(target["w"], torch.arange(4.0))
    if chaos:
        events = _events_of(tmp_path / "run")
        assert [e["step"] for e in events if e["event"] in ("ckpt_committed", "restore_end")] \
            == [3, 3]


@_SINGLE_PROCESS_DCP
def test_dcp_helpers_just_save_and_load_outside_chaos(tmp_path: Path) -> None:
    probe.dcp_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "s", step=1)
    target = {"w": torch.zeros(4)}
    probe.dcp_load(target, checkpoint_id=tmp_path / "s", step=1)
    assert torch.equal(target["w"], torch.ones(4))
    assert not (tmp_path / "events").exists() and _events.channel() is None


def test_a_later_pass_of_a_step_holds_only_the_next_time_the_job_gets_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two points at step 3, the second for the job's second pass there (``on_pass: 2``): the
    first time step 3 ends only p0 holds, even once p0 is released; the next time (a process
    that resumed before step 3), p1 holds."""
    _under_chaos(monkeypatch, tmp_path)
    release = tmp_path / "control" / "release"
    release.mkdir(parents=True)
    (tmp_path / "control" / "plan.json").write_text(json.dumps(
        {"points": [{"id": "p0", "step": 3}, {"id": "p1", "step": 3, "pass": 2}]}))
    probe.step_end(2)  # first use: reads the plan

    def pass_through_step_3(point: str) -> None:
        holder = threading.Thread(target=probe.step_end, args=(3,), daemon=True)
        holder.start()
        deadline = time.monotonic() + 10
        while [e.get("point") for e in _events_of(tmp_path) if e["event"] == "paused"][-1:] \
                != [point]:
            assert time.monotonic() < deadline, f"never paused at {point}"
            time.sleep(0.01)
        (release / point).touch()
        holder.join(10)
        assert not holder.is_alive(), f"still held after {point}'s release"

    pass_through_step_3("p0")
    assert [e.get("point") for e in _events_of(tmp_path) if e["event"] == "paused"] == ["p0"]
    pass_through_step_3("p1")
    probe.step_end(3)  # a third pass: nothing left to hold
    assert [e.get("point") for e in _events_of(tmp_path) if e["event"] == "paused"] == [
        "p0", "p1"]


def test_a_training_loop_in_another_thread_gets_its_own_step_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script whose training loop runs in a thread of its own (a launcher's worker thread,
    a main thread left to a watchdog): each step is timed from the previous one, as on the
    main thread. Only the main thread's reports moved the start of the next step, so every
    step_end's ``seconds`` counted from the process's first report and kept growing."""
    _under_chaos(monkeypatch, tmp_path)

    def loop() -> None:
        for step in range(1, 5):
            time.sleep(0.2)
            probe.step_end(step, 0.5)

    worker = threading.Thread(target=loop)
    worker.start()
    worker.join(30)
    seconds = [e["seconds"] for e in _events_of(tmp_path) if e["event"] == "step_end"]
    assert len(seconds) == 4 and all(s < 0.35 for s in seconds[1:]), seconds


def test_an_event_folder_that_cannot_be_made_fails_neither_the_loop_nor_a_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ANTIFRAGILE_RUN_DIR`` where no folder can be made (under a file, read-only, gone
    with its disk): events are best effort, so the script trains and saves on without them.
    The first probe call raised NotADirectoryError into the training loop, and the engine's
    save thread raised it reporting the commit and again reporting that as a failure: the
    save was said to have failed though committed, and its handle never resolved (close()
    hung for good)."""
    (tmp_path / "file").write_text("")
    _under_chaos(monkeypatch, tmp_path / "file" / "run")
    probe.step_end(1, 0.5)
    probe.restored(1)
    ckpt = CheckpointEngine(str(tmp_path / "ckpt"))
    handle = ckpt.save(2, {"w": torch.ones(4)})
    handle.wait(timeout=30)
    ckpt.close()
    with CheckpointEngine(str(tmp_path / "ckpt")) as again:
        assert again.agreed_steps() == [2]


@pytest.mark.parametrize("variable", ["RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"])
def test_a_launcher_variable_that_is_no_number_fails_neither_the_loop_nor_a_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """A launcher that exports ``RANK=`` (a wrapper's ``RANK=$SLURM_PROCID`` with the
    variable unset; the script passes its rank to ``init_process_group`` itself): the event
    file cannot be named, so events are off, as when it cannot be opened. The ValueError from
    ``int("")`` was raised into the training loop by every probe call, and the engine logged it
    at every event."""
    _under_chaos(monkeypatch, tmp_path / "run")
    monkeypatch.setenv(variable, "")
    probe.step_end(1, 0.5)
    probe.restored(1)
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(2, {"w": torch.ones(4)}, blocking=True)
    probe.step_end(3, 0.5)
    assert not (tmp_path / "run" / "events").exists()
    assert probe._probe is None and _events._channel is None and _events._unusable


def test_a_report_that_fails_never_fails_a_save_or_leaves_its_handle_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever reporting an event raises (here: the channel's write, with an error it does
    not expect), the save goes on: reporting is best effort. Raised on the save's thread, it
    failed a committed save, then again while reporting that failure, and the handle never
    resolved: wait() and close() waited for good."""
    _under_chaos(monkeypatch, tmp_path / "run")

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("the report is broken")

    monkeypatch.setattr(_events.Channel, "emit", broken)
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(2, {"w": torch.ones(4)}, blocking=True).wait(timeout=30)
        assert ckpt.agreed_steps() == [2]
        state = {"w": torch.zeros(4)}
        assert ckpt.load(state) == 2 and torch.equal(state["w"], torch.ones(4))


def test_a_save_whose_failure_cannot_be_handled_still_resolves_its_handle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last guard of a save's thread: whatever fails while it handles a failure, the
    handle resolves (with a CheckpointError) instead of leaving wait() and close() waiting."""
    from antifragile.engine import CheckpointError
    from antifragile.engine import engine as engine_module

    def refused(*_: object, **__: object) -> None:
        raise OSError(5, "Input/output error")

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("the failure's handling is broken")

    monkeypatch.setattr(engine_module, "write_objects", refused)
    monkeypatch.setattr(_events.EngineEvents, "failed", broken)
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        handle = ckpt.save(2, {"w": torch.ones(4)})
        with pytest.raises(CheckpointError, match="step 2, rank 0: the save's thread failed"):
            handle.wait(timeout=30)


def test_a_loss_that_float_cannot_read_for_any_reason_is_reported_as_none_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``float()`` raises more than TypeError and ValueError: RuntimeError for a meta tensor
    (a dry run on the meta device), OverflowError for an int past a float's range. Caught only
    under chaos's probe, they failed the step there and nowhere else."""
    _under_chaos(monkeypatch, tmp_path)
    probe.step_end(1, torch.ones((), device="meta"))
    probe.step_end(2, 10**400)
    probe.step_end(3, 0.5)
    steps = [(e["step"], e["loss"]) for e in _events_of(tmp_path) if e["event"] == "step_end"]
    assert steps == [(1, None), (2, None), (3, 0.5)]


def test_a_process_the_rank_starts_writes_nothing_under_its_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A subprocess of the rank (an evaluation loading the newest checkpoint through the
    engine) inherits ANTIFRAGILE_RUN_DIR and RANK: it wrote its own ``start`` (its pid) and
    its steps or restores into the rank's file, and chaos took its pid for the rank's (a
    ``kill_rank`` then killed the evaluation, not the rank)."""
    _under_chaos(monkeypatch, tmp_path)
    probe.step_end(1, 0.5)
    subprocess.run([sys.executable, "-c", "from antifragile import probe; "
                    "probe.step_end(7, 0.25); probe.restored(3)"],
                   env=dict(os.environ), check=True, timeout=60)
    events = _events_of(tmp_path)
    assert [e["event"] for e in events] == ["start", "step_end"]
    assert events[0]["pid"] == os.getpid()


def test_a_forked_child_writes_nothing_under_its_parents_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after the channel opened (a DataLoader worker, a fork-started pool) had
    the rank's open event file: what it reported went in as the rank's own steps."""
    _under_chaos(monkeypatch, tmp_path)
    probe.step_end(1, 0.5)
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's teardown
        code = 0
        try:
            probe.step_end(99, 0.25)
            _events.EngineEvents(True).staged(99, 0.0)
        except BaseException:
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    probe.step_end(2, 0.5)
    assert [(e["event"], e.get("step")) for e in _events_of(tmp_path)] == [
        ("start", None), ("step_end", 1), ("step_end", 2)]


def test_a_child_forked_before_the_rank_reported_anything_may_be_the_one_that_reports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that forks its training into a child before any report (a watchdog parent)
    leaves the reporting to that child: no event file was the parent's."""
    _under_chaos(monkeypatch, tmp_path)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            probe.step_end(5, 0.5)
        except BaseException:
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    events = _events_of(tmp_path)
    assert [(e["event"], e.get("step")) for e in events] == [("start", None), ("step_end", 5)]
    assert events[0]["pid"] == pid


def test_a_save_is_reported_staged_before_committed_however_late_its_staging_thread_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging thread reported ``ckpt_staged`` after the copy ended, and the save's writers
    go on from that end, not from the report: a staging thread descheduled there (a switch
    interval on a busy machine) let a small save commit first, and the report read a commit
    before its staging. Here its report is held 0.5 s (``defer_staging``: staging on a thread
    of its own, the writers on another)."""
    _under_chaos(monkeypatch, tmp_path)
    real = _events.EngineEvents.staged

    def late(self: _events.EngineEvents, step: int, stall_s: float) -> None:
        time.sleep(0.5)
        real(self, step, stall_s)

    monkeypatch.setattr(_events.EngineEvents, "staged", late)
    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(4, {"w": torch.arange(64.0)}, defer_staging=True).wait()
    assert [e["event"] for e in _events_of(tmp_path) if e["event"].startswith("ckpt_")] == [
        "ckpt_staged", "ckpt_committed"]


def test_the_engines_stall_is_the_loops_whole_wait_for_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's checkpoint stall (report ``checkpoints[].stall_s``, and the
    ``checkpoint_cost`` and ``chaos tune`` built on it) is the engine's ``ckpt_staged``: what
    the loop waited for ``save()``, as the built-in trainer reports it. It was the staging copy
    alone: the state dicts, the plan and the save's all-reduce (which waits for the slowest
    rank) came before it, and the probe measures the next step from the event, so that time
    was in neither the stall nor a step. Here ``state_dict()`` takes 0.2 s."""
    _under_chaos(monkeypatch, tmp_path)

    class Slow:
        def __init__(self) -> None:
            self.w = torch.arange(64.0)

        def state_dict(self) -> dict[str, Any]:
            time.sleep(0.2)
            return {"w": self.w}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.w = state["w"]

    with CheckpointEngine(str(tmp_path / "ckpt")) as ckpt:
        called = time.perf_counter()
        handle = ckpt.save(4, {"model": Slow()})
        waited = time.perf_counter() - called
        handle.wait()
    (staged,) = [e for e in _events_of(tmp_path) if e["event"] == "ckpt_staged"]
    assert 0.2 <= staged["stall_s"] <= waited, (staged["stall_s"], waited)
    assert handle.stall_s < 0.2  # the handle's figure stays the staging copy (bench.engine's)
