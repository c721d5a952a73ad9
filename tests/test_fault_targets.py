"""Faults made on processes that are not there to take them: a fault that found nothing to act
on is ``missed`` (the verdict fails), never recorded as made."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from antifragile.chaos.faults import FAULT_CONFIGS, Injection, Target


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process that sleeps, in a session of its own (as torchrun starts each rank)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait()


def _target(pid: int) -> Target:
    return Target(pids={0: pid}, coordinates={}, ckpt_url="/nonexistent", rng=random.Random(0))


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_hang_of_the_rank_a_kill_of_the_same_moment_took_is_missed(
        sleeper: subprocess.Popen[bytes], mode: str) -> None:
    """Two faults at one pause point, a kill and then a hang of the same rank: the rank is
    dying (not yet a zombie) when the hang is made. Recorded as made, the hang would be
    credited with ending the attempt the kill ended."""
    if mode == "thread" and os.geteuid() != 0:
        pytest.skip("ptrace of a non-child needs root here")
    target = _target(sleeper.pid)
    kill = FAULT_CONFIGS["kill_rank"](kind="kill_rank", rank=0, at_step=1).inject(target, 1)
    assert kill.missed is None
    began = time.monotonic()
    hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1, duration_s=1.0,
                                      mode=mode).inject(target, 1)
    assert hang.missed is not None and "exited" in hang.missed, hang
    assert hang.skipped is None
    assert time.monotonic() - began < 2.0  # a zombie is not waited on as if it might stop


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_hang_of_a_rank_that_exited_is_missed(sleeper: subprocess.Popen[bytes],
                                                mode: str) -> None:
    sleeper.send_signal(signal.SIGKILL)
    sleeper.wait()
    hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1, duration_s=1.0,
                                      mode=mode).inject(_target(sleeper.pid), 1)
    assert hang.missed is not None and "exited" in hang.missed


def test_a_thread_that_never_stops_is_a_missed_hang_not_a_refused_ptrace(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A training thread that ptrace seized but that never stopped (asleep in uninterruptible
    I/O) was reported skipped, "ptrace of pid N refused: no stop within 10 s": a fault that
    did not happen, told as one this machine cannot make, and ptrace refused nothing."""
    from antifragile.chaos.faults import hang_rank

    def never_stops(hold: hang_rank._ThreadHold) -> None:
        hold._release.wait()  # seized, but no stop ever shows

    monkeypatch.setattr(hang_rank._ThreadHold, "_run", never_stops)
    monkeypatch.setattr(hang_rank, "STOP_WAIT_S", 0.2)
    hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1, duration_s=1.0,
                                      mode="thread").inject(_target(sleeper.pid), 1)
    assert hang.skipped is None, hang
    assert hang.missed == (f"rank 0 (pid {sleeper.pid}): its thread did not stop within "
                           "0.2 s of the ptrace interrupt"), hang


def test_a_signal_that_reaches_the_held_thread_before_its_stop_is_not_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal that reaches the training thread between the seize and the interrupt stops
    it first (a signal-delivery stop, which the hold took for its stop): the detach passed
    no signal, so the tracer discarded it and the rank never got it (a SIGTERM, a timer,
    a worker's SIGCHLD)."""
    if os.geteuid() != 0:
        pytest.skip("ptrace of a non-child needs root here")
    import ctypes

    from antifragile.chaos.faults import hang_rank

    code = ("import signal, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: print('got it', flush=True))\n"
            "print('ready', flush=True)\n"
            "while True: time.sleep(0.01)\n")
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    real = ctypes.CDLL

    class SignalFirst:  # libc whose ptrace interrupt comes after a SIGUSR1 has stopped it
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            libc = real(*args, **kwargs)

            def ptrace(request: int, pid: int, addr: Any, data: Any) -> int:
                if request == hang_rank._PTRACE_INTERRUPT:
                    os.kill(pid, signal.SIGUSR1)
                    time.sleep(0.3)
                result: int = libc.ptrace(request, pid, addr, data)
                return result

            libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                    ctypes.c_void_p]
            self.ptrace = ptrace

    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        monkeypatch.setattr(hang_rank.ctypes, "CDLL", SignalFirst)
        target = _target(rank.pid)
        hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1,
                                          duration_s=300.0, mode="thread").inject(target, 1)
        assert hang.missed is None and hang.skipped is None, hang
        target.endings.end_now()
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(rank.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=5)
        assert got == ["got it\n"], "the signal was lost with the ptrace hold"
    finally:
        rank.kill()
        rank.wait()


@pytest.mark.parametrize("second", ["kill_rank", "crash_during_save"])
def test_a_second_kill_of_the_same_rank_at_the_same_moment_is_missed(
        sleeper: subprocess.Popen[bytes], second: str) -> None:
    """The first SIGKILL is delivered a moment after kill(2) returns: the second fault must
    find the rank dead, not be recorded as made (and credited with the first one's death)."""
    target = _target(sleeper.pid)
    first = FAULT_CONFIGS["kill_rank"](kind="kill_rank", rank=0, at_step=1).inject(target, 1)
    assert first.missed is None
    again = FAULT_CONFIGS[second](kind=second, rank=0, at_checkpoint=1).inject(target, 1)
    assert again.missed is not None and "exited" in again.missed, again


def test_a_fault_whose_injection_fails_is_missed_naming_why(tmp_path: Path) -> None:
    """A fault that raised while it was made (here ``corrupt_shard`` on a checkpoint whose
    COMMIT is damaged: an earlier fault's work, or storage failing under a storage fault)
    ended ``chaos run`` with a traceback; it did not happen as the scenario says, so it is
    missed (the verdict fails), naming the fault and the error, and the run goes on."""
    from antifragile.chaos.run.runner import _inject
    from antifragile.engine._paths import step_dir

    (tmp_path / step_dir(5)).mkdir()
    (tmp_path / step_dir(5) / "COMMIT").write_bytes(b"not a marker")
    fault = FAULT_CONFIGS["corrupt_shard"](kind="corrupt_shard", at_step=6)
    target = Target(pids={0: os.getpid()}, coordinates={}, ckpt_url=str(tmp_path),
                    rng=random.Random(0))
    injection = _inject(fault, target, 6)
    assert injection.kind == "corrupt_shard" and injection.step == 6
    assert injection.missed is not None and "corrupt_shard failed" in injection.missed
    assert "COMMIT" in injection.missed


@pytest.mark.parametrize("kind", ["kill_rank", "crash_during_save", "hang_rank"])
def test_a_signal_fault_is_timed_when_it_was_sent_not_when_it_took_effect(
        sleeper: subprocess.Popen[bytes], kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Detection is timed from the fault: a kill was timed after the wait for the rank's death
    (and a stop after the wait for it to show stopped), up to 2 s later, so a job that noticed
    at once had a detection of ~0 s (34 us was seen), or a negative one clamped to 0. The
    fault's time is now taken before the signal; when it took effect is ``done_t`` (what the
    rank wrote after that was not written by a dead or stopped process)."""
    from antifragile.chaos.faults import base

    slow_from = [0.0]
    real_alive = base.alive

    def slow_alive(pid: int) -> bool:  # the kernel takes 0.3 s to finish the process
        return time.time() < slow_from[0] + 0.3 or real_alive(pid)

    monkeypatch.setattr(base, "alive", slow_alive)
    sent: list[float] = []
    real_send = base.send

    def timed_send(pid: int, sig: int) -> None:  # when the signal left, whatever the load
        sent.append(time.time())
        real_send(pid, sig)

    monkeypatch.setattr(base, "send", timed_send)
    if kind == "hang_rank":  # a stop shows after 0.3 s
        from antifragile.chaos.faults import hang_rank

        real_wait = hang_rank.wait_stopped

        def slow_wait(pid: int) -> bool:
            time.sleep(max(slow_from[0] + 0.3 - time.time(), 0.0))
            return real_wait(pid)

        monkeypatch.setattr(hang_rank, "wait_stopped", slow_wait)
    options = {"at_checkpoint": 1} if kind == "crash_during_save" else {"at_step": 1}
    if kind == "hang_rank":
        options["duration_s"] = 0.5
    fault = FAULT_CONFIGS[kind](kind=kind, rank=0, **options)
    slow_from[0] = before = time.time()
    injection = fault.inject(_target(sleeper.pid), 1)
    after = time.time()
    assert injection.missed is None and injection.skipped is None, injection
    assert before <= injection.t <= sent[0], (injection.t - before, sent[0] - before)
    assert before + 0.3 <= injection.detail["done_t"] <= after


def test_the_latest_checkpoint_is_taken_once_the_save_in_flight_has_committed(
        tmp_path: Path) -> None:
    """``checkpoint: latest`` at a pause point where the previous save still persists (its
    folder there, no COMMIT yet): the fault damaged the step before it, which the restore
    after a kill at the same point never reads (the save commits meanwhile), so the fault had
    no effect and the nightly scenario failed on a loaded machine. It waits for the save."""
    import shutil
    import threading

    import torch

    from antifragile.engine import CheckpointEngine

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url) as engine:
        for step in (8, 12):
            engine.save(step, {"w": torch.arange(64.0)}, blocking=True)
    commit = tmp_path / "ckpt" / "step_000000012" / "COMMIT"
    aside = tmp_path / "COMMIT.12"
    shutil.move(commit, aside)  # step 12 still persisting
    threading.Timer(1.0, shutil.move, (aside, commit)).start()
    target = Target(pids={}, coordinates={}, ckpt_url=url, rng=random.Random(0))
    fault = FAULT_CONFIGS["corrupt_shard"](kind="corrupt_shard", at_step=14)
    injection = fault.inject(target, 14)
    assert injection.missed is None, injection.missed
    assert injection.detail["checkpoint_step"] == 12


def _state(pid: int) -> str | None:
    from antifragile.chaos.infra.weed import process_state
    return process_state(pid)


def _state_once(pid: int, settled: Callable[[str | None], bool], within_s: float = 5.0
                ) -> str | None:
    """``pid``'s state once ``settled`` by it, or as it is after ``within_s``: a signal to a
    process group reaches its members a moment after ``kill`` returns (a loaded machine
    read a member still running, 'R', right after the group's SIGSTOP)."""
    deadline = time.monotonic() + within_s
    state = _state(pid)
    while not settled(state) and time.monotonic() < deadline:
        time.sleep(0.01)
        state = _state(pid)
    return state


def test_a_hang_that_outlasts_its_run_is_ended_with_the_run(
        sleeper: subprocess.Popen[bytes]) -> None:
    """A hang of 300 s in a run that ends sooner: its rank is continued when the run ends, not
    300 s later, when ``chaos suite`` or ``chaos tune`` is running the next scenario and the
    pid may be another process's. Before, the end was a timer nothing cancelled."""
    target = _target(sleeper.pid)
    hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1, duration_s=300.0,
                                      mode="process").inject(target, 1)
    assert hang.missed is None and _state(sleeper.pid) == "T"
    target.endings.end_now()
    assert _state(sleeper.pid) != "T"


def test_a_fault_ends_once_at_its_time_or_with_the_run() -> None:
    """An end comes at its time (``on_time``) or with the run, once; one due after the run
    has ended is made at once."""
    from antifragile.chaos.faults.base import Endings

    ended: list[tuple[str, bool]] = []
    endings = Endings()
    endings.after(0.05, lambda on_time: ended.append(("short", on_time)))
    endings.after(300.0, lambda on_time: ended.append(("long", on_time)))
    deadline = time.monotonic() + 10
    while not ended:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    endings.end_now()
    assert ended == [("short", True), ("long", False)]
    endings.after(300.0, lambda on_time: ended.append(("after the run", on_time)))
    endings.end_now()
    assert ended[2:] == [("after the run", False)]


def test_an_end_interrupted_by_ctrl_c_does_not_leave_the_later_ends_unmade() -> None:
    """Ctrl-C (or SIGTERM, raised once by ``lifetime.stop_once``) that lands in one end as
    the run ends (a volume server's restart waits up to 30 s): the ends after it were never
    made, a stopped rank left stopped when its job was killed, their timers still due."""
    from antifragile.chaos.faults.base import Endings

    ended: list[str] = []

    def interrupted(on_time: bool) -> None:
        ended.append("interrupted")
        raise KeyboardInterrupt

    endings = Endings()
    endings.after(300.0, interrupted)
    endings.after(300.0, lambda on_time: ended.append("resume"))
    with pytest.raises(KeyboardInterrupt):
        endings.end_now()
    assert ended == ["interrupted", "resume"]


def test_the_runner_ends_the_faults_of_a_run_that_stops(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """However the run stops (here its launch fails), the ends of its faults are made."""
    from antifragile.chaos.faults import base
    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import load_scenario

    ended: list[bool] = []

    class Recorded(base.Endings):
        def end_now(self) -> None:
            ended.append(True)
            super().end_now()

    def broken_launch(*args: object, **kwargs: object) -> None:
        raise OSError("no torchrun")

    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\ntrainer: {steps: 4}\ncheckpoint: {every_steps: 2}\n"
                        "faults: [{kind: hang_rank, rank: 0, at_step: 2, duration_s: 300}]\n")
    monkeypatch.setattr(runner, "Endings", Recorded)
    monkeypatch.setattr(runner, "launch", broken_launch)
    with pytest.raises(OSError, match="no torchrun"):
        runner.run_scenario(load_scenario(scenario), tmp_path, str(tmp_path / "ckpt"))
    assert ended == [True]


def _step_10_still_persisting(tmp_path: Path) -> tuple[str, Path, Path]:
    """Steps 5 and 10 committed under ``tmp_path/ckpt``, then step 10's COMMIT moved aside:
    step 10 is still persisting, as far as a reader can tell. (url, COMMIT, where it is)."""
    import shutil

    import torch

    from antifragile.engine import CheckpointEngine
    from antifragile.engine._paths import COMMIT, step_dir

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_last=None) as engine:
        for step in (5, 10):
            engine.save(step, {"w": torch.arange(64.0).reshape(8, 8)}).wait()
    commit = tmp_path / "ckpt" / step_dir(10) / COMMIT
    aside = tmp_path / "COMMIT.aside"
    shutil.move(commit, aside)
    return url, commit, aside


def _corrupt_latest_at_12(target: Target, later: threading.Timer) -> Injection:
    """``corrupt_shard`` (``checkpoint: latest``) injected at step 12 while the timer
    ``later`` changes what storage holds."""
    later.start()
    try:
        fault = FAULT_CONFIGS["corrupt_shard"](kind="corrupt_shard", at_step=12,
                                               mode="truncate")
        return fault.inject(target, 12)
    finally:
        later.join()


@pytest.mark.parametrize("then", ["commits", "aborts", "commits-having-written-nothing-yet"])
def test_latest_waits_for_a_save_in_flight_and_not_for_an_aborted_one(
        tmp_path: Path, then: str) -> None:
    """``corrupt_shard`` with ``checkpoint: latest`` damages the checkpoint the job has once
    a save still persisting at the pause point has committed (damaging the one before it is a
    fault no restore reads); a newer folder that was aborted is not waited for. A save staged
    before the pause point whose writers had written nothing yet (a busy machine) left no
    folder to wait for, and the one before it was damaged: the steps the job's events say were
    staged are waited for too."""
    import shutil
    import threading

    from antifragile.engine._paths import ABORT, step_dir

    url, commit, aside = _step_10_still_persisting(tmp_path)
    folder = tmp_path / "ckpt" / step_dir(10)
    if then == "commits":
        later = threading.Timer(0.5, lambda: shutil.move(aside, commit))
    elif then == "aborts":
        (folder / ABORT).write_text("{}")
        later = threading.Timer(0.0, lambda: None)
    else:
        shutil.move(aside, commit)
        shutil.move(folder, tmp_path / "folder.aside")
        later = threading.Timer(0.5, lambda: shutil.move(tmp_path / "folder.aside", folder))
    began = time.monotonic()
    injection = _corrupt_latest_at_12(
        Target(pids={}, coordinates={}, ckpt_url=url, rng=random.Random(0),
               staged=frozenset({5, 10})), later)
    assert injection.missed is None, injection
    assert injection.detail["checkpoint_step"] == (5 if then == "aborts" else 10)
    if then == "aborts":
        assert time.monotonic() - began < 10  # not SETTLE_S (30 s)


def test_the_saves_a_fault_waits_for_are_the_newest_generations_up_to_where_it_is() -> None:
    """A save an earlier attempt staged past where the restart went back to, or one that
    failed, is not in flight: waiting for it would hold ``latest`` for ``SETTLE_S``."""
    from antifragile.chaos.run.runner import _Job

    job = _Job(1)

    def see(attempt: int, event: str, step: int) -> None:
        job.see({"event": event, "attempt": attempt, "rank": 0, "step": step, "t": 0.0})

    job.see({"event": "start", "attempt": 0, "rank": 0, "pid": os.getpid(), "t": 0.0})
    for step in (8, 12):
        see(0, "step_end", step)
        see(0, "ckpt_staged", step)
    see(0, "step_end", 13)
    assert job.staged_saves() == {8, 12}
    job.see({"event": "start", "attempt": 1, "rank": 0, "pid": os.getpid(), "t": 0.0})
    see(1, "restore_end", 8)
    see(1, "step_end", 10)
    assert job.staged_saves() == set()  # attempt 0's 12 is not this attempt's
    see(1, "step_end", 12)
    see(1, "ckpt_staged", 12)
    assert job.staged_saves() == {12}
    see(1, "ckpt_failed", 12)
    assert job.staged_saves() == set()


def test_the_runner_gives_latest_the_saves_its_job_staged(tmp_path: Path) -> None:
    """The job's ``ckpt_staged`` events reach the fault through the runner's target: a save
    staged at step 10 whose writers have written nothing yet (no folder) is waited for, and
    ``latest`` damages step 10 once it commits, not step 5 before it. The tests above give
    ``Target(staged=...)`` by hand or read ``staged_saves()`` alone: with the runner's
    ``_target`` not passing them on, both passed while a real run waited for no staged save."""
    import shutil
    import threading

    from antifragile.chaos.run.runner import _Job, _target
    from antifragile.chaos.scenario import parse_scenario
    from antifragile.engine._paths import step_dir

    s = parse_scenario({"name": "tiny", "trainer": {"command": ["python", "-c", "pass"],
                                                    "probe": False},
                        "expect": {"bitwise_equal_to_reference": False}})
    job = _Job(1)
    job.see({"event": "start", "attempt": 0, "rank": 0, "pid": os.getpid(), "t": 0.0})
    for event, step in (("step_end", 5), ("ckpt_staged", 5), ("step_end", 10),
                        ("ckpt_staged", 10), ("step_end", 12)):
        job.see({"event": event, "attempt": 0, "rank": 0, "step": step, "t": 0.0})
    url, commit, aside = _step_10_still_persisting(tmp_path)
    folder = tmp_path / "ckpt" / step_dir(10)
    shutil.move(aside, commit)
    shutil.move(folder, tmp_path / "folder.aside")  # step 10 staged, nothing written yet
    later = threading.Timer(0.5, lambda: shutil.move(tmp_path / "folder.aside", folder))
    injection = _corrupt_latest_at_12(_target(s, job, url, random.Random(0)), later)
    assert injection.missed is None, injection
    assert injection.detail["checkpoint_step"] == 10


_REUSED_PID_AGENT = """\
import json, sys, time
from pathlib import Path

events = Path(sys.argv[1])
events.mkdir(parents=True, exist_ok=True)
# rank 0 of attempt 0 started a minute ago as pid P and has died since; P is now another
# process's (pids are recycled: pid_max is 32768 on many machines)
with open(events / "rank0.jsonl", "a") as f:
    f.write(json.dumps({"t": time.time() - 60, "rank": 0, "attempt": 0, "event": "start",
                        "pid": int(sys.argv[2])}) + "\\n")
time.sleep(3)
"""


def test_a_time_based_fault_never_signals_a_process_that_took_a_dead_ranks_pid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sleeper: subprocess.Popen[bytes]) -> None:
    """A rank's pid, once it has died, may belong to another process (a rank of the next
    attempt, a thread, anything on the machine). The runner took a live pid for a live rank
    and its at_s kill SIGKILLed that process, which was not the job's."""
    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import parse_scenario

    agent_script = tmp_path / "agent.py"
    agent_script.write_text(_REUSED_PID_AGENT)

    def agent(s: object, run_dir: Path, *_: object, **__: object) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(agent_script), str(run_dir / "events"),
                                 str(sleeper.pid)], start_new_session=True, text=True)

    monkeypatch.setattr(runner, "launch", agent)
    s = parse_scenario({"name": "reused", "trainer": {"steps": 20},
                        "checkpoint": {"every_steps": 5},
                        "faults": [{"kind": "kill_rank", "rank": 0, "at_s": 0.2}]})
    record = runner.run_scenario(s.model_copy(update={"time_limit_s": 60.0}),
                                 tmp_path / "run", str(tmp_path / "ckpt"))
    assert sleeper.poll() is None, "the runner killed a process that was not the job's"
    assert record.injections == []


def test_a_thread_hang_that_outlasts_its_run_is_ended_with_the_run(
        sleeper: subprocess.Popen[bytes]) -> None:
    """``mode: thread`` too: its training thread is let go when the run ends, not
    ``duration_s`` later (its ptrace hold was a deadline that ``Endings`` never saw, so the
    rank stayed stopped into the next scenario of ``chaos suite``)."""
    if os.geteuid() != 0:
        pytest.skip("ptrace of a non-child needs root here")
    target = _target(sleeper.pid)
    hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1, duration_s=300.0,
                                      mode="thread").inject(target, 1)
    assert hang.missed is None and hang.skipped is None, hang
    assert _state(sleeper.pid) == "t"
    target.endings.end_now()
    assert _state(sleeper.pid) not in ("t", "T")


def test_a_hang_continues_the_group_it_stopped_after_its_leader_is_gone() -> None:
    """A rank that leads its process group is stopped with everything it started (a
    wrapper script and its training process, a data loader's workers). The hung leader is
    then SIGKILLed (its supervisor found the hang) and reaped: the resume looked its group up
    by the leader's pid, found no process and gave up, so the rest of the group stayed
    stopped for good, orphans that never exit."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
         "print(p.pid, flush=True); time.sleep(120)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    try:
        target = _target(leader.pid)
        hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1,
                                          duration_s=300.0, mode="process").inject(target, 1)
        assert hang.missed is None and _state_once(child, lambda st: st == "T") == "T"
        leader.kill()
        leader.wait()
        target.endings.end_now()
        assert _state_once(child, lambda st: st not in ("T", "t")) not in ("T", "t")
    finally:
        leader.kill()
        leader.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


#: the tests that hand a dead rank's pid to another process choose the next pid
needs_pid_choice = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
    reason="choosing the next pid needs root")


def _process_at(pid: int) -> subprocess.Popen[bytes] | None:
    """A new process (in a session of its own) given ``pid``, that of a process now gone, as
    the kernel recycles pids; None if another process on the machine kept taking it first."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # root: the next pid is ours
            f.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@needs_pid_choice
def test_a_hang_never_continues_a_process_that_took_its_ranks_pid(
        sleeper: subprocess.Popen[bytes]) -> None:
    """The hung rank is SIGKILLed (its supervisor found the hang) and reaped, and its pid
    goes to another process, stopped by someone else. The hang's end sent SIGCONT to the
    pid (to its group: it led one) without checking it was still the rank's, and so
    continued a process that was not the job's."""
    target = _target(sleeper.pid)
    hang = FAULT_CONFIGS["hang_rank"](kind="hang_rank", rank=0, at_step=1, duration_s=300.0,
                                      mode="process").inject(target, 1)
    assert hang.missed is None and _state(sleeper.pid) == "T"
    sleeper.kill()
    sleeper.wait()
    other = _process_at(sleeper.pid)
    if other is None:
        target.endings.end_now()
        pytest.skip(f"pid {sleeper.pid} kept being taken by other processes")
    try:
        from antifragile.chaos.infra.weed import wait_stopped

        other.send_signal(signal.SIGSTOP)
        assert wait_stopped(other.pid)
        target.endings.end_now()
        assert _state(other.pid) == "T", "the hang's end continued a process not the job's"
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("modes", [["delete", "delete"], ["delete", "bitflip"],
                                   ["delete", "truncate"], ["truncate"] * 12])
def test_a_corruption_that_finds_nothing_left_to_damage_is_missed(tmp_path: Path,
                                                                  modes: list[str]) -> None:
    """Faults that damage the same checkpoint again (two entries, ``mtbf_s`` arrivals with
    no save between them): a delete of the object an earlier fault deleted, or a truncate
    of one already cut to nothing, changed nothing and was recorded as made; a bitflip of a
    deleted object failed with a bare FileNotFoundError. With one shard, the last fault has
    nothing left to act on: it is missed, saying so. With two, it damages the other one."""
    import torch

    from antifragile.chaos.run.runner import _inject
    from antifragile.engine import CheckpointEngine

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url) as engine:
        engine.save(5, {"w": torch.arange(64.0).reshape(8, 8)}, blocking=True)
        engine.save(10, {"w": torch.arange(64.0).reshape(8, 8),
                         "v": torch.arange(64.0).reshape(8, 8)}, blocking=True)
    injections = []
    for mode in modes:  # step 5: one shard, damaged until nothing is left
        fault = FAULT_CONFIGS["corrupt_shard"](kind="corrupt_shard", at_step=11, checkpoint=5,
                                               mode=mode)
        injections.append(_inject(fault, Target(pids={}, coordinates={}, ckpt_url=url,
                                                rng=random.Random(0)), 11))
    made = [i.missed is None for i in injections]  # made until nothing is left, then missed
    assert made[0] and made == sorted(made, reverse=True), injections
    assert injections[-1].missed is not None and "FileNotFoundError" not in injections[-1].missed
    assert "no shard" in injections[-1].missed, injections[-1].missed
    objects = []
    for mode in modes[:2]:  # step 10: the same pick first (same seed), then the other shard
        fault = FAULT_CONFIGS["corrupt_shard"](kind="corrupt_shard", at_step=11, checkpoint=10,
                                               mode=mode)
        injection = _inject(fault, Target(pids={}, coordinates={}, ckpt_url=url,
                                          rng=random.Random(0)), 11)
        assert injection.missed is None, injection
        objects.append(injection.detail["object"])
    assert len(set(objects)) == (1 if modes[0] == "truncate" else 2), objects


def test_a_checkpoint_named_by_its_step_is_waited_for_while_it_is_saved(tmp_path: Path) -> None:
    """``checkpoint: 10`` at the end of step 10 (``at_step: 10``, or ``at_checkpoint: 2`` with
    ``every_steps: 5``), which validation accepts: the save of step 10 is still persisting at
    that pause point, and the fault looked only at the commits already there, so it was
    missed on a run where the checkpoint committed a moment later. It waits for the save, as
    ``latest`` does."""
    import shutil
    import threading

    url, commit, aside = _step_10_still_persisting(tmp_path)
    later = threading.Timer(0.5, lambda: shutil.move(aside, commit))
    later.start()
    fault = FAULT_CONFIGS["corrupt_shard"](kind="corrupt_shard", at_step=10, checkpoint=10)
    assert fault.check_checkpoints(5, 20) is None  # a scenario chaos validate accepts
    try:
        target = Target(pids={}, coordinates={}, ckpt_url=url, rng=random.Random(0))
        injection = fault.inject(target, 10)
    finally:
        later.join()
    assert injection.missed is None, injection
    assert injection.detail["checkpoint_step"] == 10


@needs_pid_choice
@pytest.mark.parametrize(("kind", "mode"), [("kill_rank", None), ("crash_during_save", None),
                                            ("hang_rank", "process"), ("hang_rank", "thread")])
def test_a_fault_never_acts_on_a_process_that_took_its_ranks_pid(
        sleeper: subprocess.Popen[bytes], kind: str, mode: str | None) -> None:
    """The rank dies and is reaped between the moment the job was seen and the fault (its
    supervisor killed it, a kill of the same pause point), and its pid goes to another
    process. The fault checked only that the pid was alive, and so SIGKILLed, SIGSTOPped or
    ptrace-stopped a process that was not the job's. It is missed: the rank had exited."""
    target = _target(sleeper.pid)  # made while the rank runs: it is this process
    sleeper.kill()
    sleeper.wait()
    other = _process_at(sleeper.pid)
    if other is None:
        pytest.skip(f"pid {sleeper.pid} kept being taken by other processes")
    try:
        extra = {"at_checkpoint": 1} if kind == "crash_during_save" else {"at_step": 1}
        if mode is not None:
            extra.update(mode=mode, duration_s=300.0)
        injection = FAULT_CONFIGS[kind](kind=kind, rank=0, **extra).inject(target, 1)
        target.endings.end_now()
        assert injection.missed is not None and "exited" in injection.missed, injection
        assert other.poll() is None, "the fault killed a process not the job's"
        assert _state(other.pid) not in ("T", "t"), "the fault stopped a process not the job's"
    finally:
        target.endings.end_now()
        other.kill()
        other.wait()


@needs_pid_choice
def test_the_runner_names_each_rank_by_the_process_its_start_event_named(
        sleeper: subprocess.Popen[bytes]) -> None:
    """A pause point's faults are made on the ranks the job's events named: a rank that died
    and was reaped before the point's faults were made (another rank paused later) left a
    pid the target took as the rank's, whoever had it by then."""
    from antifragile.chaos.run.runner import _Job, _target
    from antifragile.chaos.scenario import parse_scenario

    s = parse_scenario({"name": "tiny", "trainer": {"command": ["python", "-c", "pass"],
                                                    "probe": False},
                        "expect": {"bitwise_equal_to_reference": False}})
    job = _Job(1)
    job.see({"event": "start", "attempt": 0, "rank": 0, "pid": sleeper.pid, "t": time.time()})
    sleeper.kill()
    sleeper.wait()
    other = _process_at(sleeper.pid)
    if other is None:
        pytest.skip(f"pid {sleeper.pid} kept being taken by other processes")
    try:
        target = _target(s, job, "/nonexistent", random.Random(0))
        kill = FAULT_CONFIGS["kill_rank"](kind="kill_rank", rank=0, at_step=1).inject(target, 1)
        assert kill.missed is not None and "exited" in kill.missed, kill
        assert other.poll() is None, "the fault killed a process not the job's"
    finally:
        other.kill()
        other.wait()


@needs_pid_choice
def test_ending_the_job_never_kills_a_process_that_took_a_workers_pid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's end lists each agent's workers, kills the agent, then each worker (its
    group): a worker that died meanwhile (here as its agent is killed) and was reaped left a
    pid that the kill sent SIGKILL to, whoever had it by then."""
    from antifragile.chaos.infra.weed import start_time
    from antifragile.chaos.run import runner

    agent = subprocess.Popen(  # a torchrun agent: each worker in a session of its own
        [sys.executable, "-c", "import os, subprocess, time; "
         "p = subprocess.Popen(['sleep', '120'], start_new_session=True); "
         "print(p.pid, flush=True); os.wait(); time.sleep(120)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    worker_started = start_time(worker)
    taken: list[subprocess.Popen[bytes]] = []
    real_killpg = os.killpg

    def worker_dies_as_its_agent_is_killed(pgid: int, sig: int) -> None:
        if pgid != agent.pid:
            return real_killpg(pgid, sig)
        os.kill(worker, signal.SIGKILL)  # the agent reaps it
        while _state(worker) is not None:
            time.sleep(0.01)
        real_killpg(pgid, sig)
        other = _process_at(worker)
        if other is not None:
            taken.append(other)

    monkeypatch.setattr(runner.os, "killpg", worker_dies_as_its_agent_is_killed)
    try:
        runner._Agents([agent]).kill()
        if not taken:
            pytest.skip(f"pid {worker} kept being taken by other processes")
        assert taken[0].poll() is None, "the job's end killed a process not the job's"
    finally:
        agent.kill()
        agent.wait()
        if start_time(worker) == worker_started:  # still ours
            os.kill(worker, signal.SIGKILL)
        for other in taken:
            other.kill()
            other.wait()
