"""The trainer under real faults: a SIGKILLed rank restarts the group, a SIGSTOPped one is found.

Faults are done from outside, as in production: signals to the worker processes, whose pids
the trainer reports in its ``start`` events.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from antifragile.chaos.faults.hang_rank import _ThreadHold
from antifragile.chaos.infra.weed import start_time
from tests._trainer import (
    SMALL_MODEL,
    assert_bitwise_equal,
    checkpoint_arrays,
    env,
    events,
    losses,
    run_trainer,
    torchrun_cmd,
)

pytestmark = pytest.mark.multiproc


def _launch(run_dir: Path, nproc: int, steps: int, *, max_restarts: int,
            extra: list[str], spares: int = 0) -> subprocess.Popen[str]:
    """The trainer at dp ``nproc``, under torchrun with ``spares`` processes more."""
    args = [*SMALL_MODEL, "--dp", str(nproc), "--steps", str(steps), "--ckpt-every", "4",
            "--ckpt-url", str(run_dir / "ckpt"), "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(torchrun_cmd(nproc + spares, args, max_restarts=max_restarts),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait_for(run_dir: Path, predicate, timeout_s: float = 120.0) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "events").exists():
            for event in events(run_dir):
                if predicate(event):
                    return event
        time.sleep(0.1)
    raise AssertionError("the trainer never reached the expected event")


def _pid(run_dir: Path, rank: int, attempt: int = 0) -> int:
    start = _wait_for(run_dir, lambda e: e["event"] == "start" and e["rank"] == rank
                      and e["attempt"] == attempt)
    return int(start["pid"])


def test_killed_rank_restarts_the_group_and_ends_bitwise_equal(tmp_path: Path) -> None:
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    run_trainer(reference, dp=2, steps=12, ckpt_every=4)

    proc = _launch(faulty, 2, 12, max_restarts=2, extra=[])
    try:
        pid = _pid(faulty, rank=1)
        _wait_for(faulty, lambda e: e["event"] == "ckpt_committed" and e["step"] == 4)
        _wait_for(faulty, lambda e: e["event"] == "step_end" and e["step"] >= 6)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    log = events(faulty)
    restarted = {e["rank"] for e in log if e["event"] == "start" and e["attempt"] == 1}
    assert restarted == {0, 1}
    restores = [e for e in log if e["event"] == "restore_end" and e["attempt"] == 1]
    assert {e["step"] for e in restores} == {4} or {e["step"] for e in restores} == {8}
    assert losses(faulty) == losses(reference)
    assert_bitwise_equal(checkpoint_arrays(str(reference / "ckpt"), 12),
                         checkpoint_arrays(str(faulty / "ckpt"), 12))


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_hung_rank_is_killed_by_its_supervisor_within_the_bound(tmp_path: Path, mode: str) -> None:
    """SIGSTOP stops the whole process; a ptrace stop holds only the training thread while
    its other threads run on. Both are found from the progress counter within the timeout
    (+1 s), and the hung process is SIGKILLed at once (no 30 s SIGTERM grace)."""
    hang_timeout_s = 2.0
    proc = _launch(tmp_path, 2, 400, max_restarts=0,
                   extra=["--hang-timeout-s", str(hang_timeout_s), "--collective-timeout-s", "120"])
    try:
        pid = _pid(tmp_path, rank=1)
        _wait_for(tmp_path, lambda e: e["event"] == "step_end" and e["step"] >= 3)
        if mode == "process":
            os.kill(pid, signal.SIGSTOP)
        else:
            assert _ThreadHold(pid, start_time(pid)).start() is None
        stopped_at = time.time()
        detected = _wait_for(tmp_path, lambda e: e["event"] == "hang_detected", timeout_s=60)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert detected["rank"] == 1 and detected["how"] == "stopped"
    assert detected["thread_state"] == ("T" if mode == "process" else "t")
    assert detected["t"] - stopped_at < hang_timeout_s + 1.0
    died = _wait_for(tmp_path, lambda e: e["event"] == "rank_died" and e["rank"] == 1)
    assert died["hung"] and died["how"] == "signal 9" and died["t"] - detected["t"] < 1.0
    assert proc.returncode != 0
    assert "rank 1 hung (stopped" in out


def test_in_process_recovery_replaces_a_killed_rank_with_the_spare(tmp_path: Path) -> None:
    """The survivor keeps its process; the warm spare takes the dead rank; the run ends
    bitwise equal to a fault-free one, with no torchrun restart."""
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    run_trainer(reference, dp=2, steps=12, ckpt_every=4)
    proc = _launch(faulty, 2, 12, max_restarts=0, extra=["--recovery", "in_process"],
                   spares=1)
    try:
        survivor, victim = _pid(faulty, rank=0), _pid(faulty, rank=1)
        _wait_for(faulty, lambda e: e["event"] == "spare_ready")
        _wait_for(faulty, lambda e: e["event"] == "step_end" and e["step"] >= 6)
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    log = events(faulty)
    second = {e["rank"]: e for e in log if e["event"] == "start" and e["attempt"] == 1}
    assert second[0]["pid"] == survivor and second[0]["cause"] == "in_process"
    assert second[1]["worker"] == "2.0" and second[1]["pid"] != victim
    assert not [e for e in log if e["event"] == "start" and e["attempt"] == 2]
    assert losses(faulty) == losses(reference)
    assert_bitwise_equal(checkpoint_arrays(str(reference / "ckpt"), 12),
                         checkpoint_arrays(str(faulty / "ckpt"), 12))


def test_in_process_recovery_is_not_held_up_by_a_torchsnapshot_save_of_the_failed_generation(
        tmp_path: Path) -> None:
    """torchsnapshot's async save commits through a barrier in the default store: rank 0's
    save thread waits there for the other ranks. Rank 1 dies before it arrives (its write of
    step 8 is held here by a file lease) while rank 0 waits for that save (the last step's
    save first waits for the one in flight). The abort cuts gloo connections, not that wait:
    the survivor never left it, and the job fell back to a torchrun restart after twice the
    collective timeout (exit 1 here, no restarts allowed). Let out, it still rendezvoused
    through the client its save thread waited on (a TCPStore client serves one request at a
    time) for the collective timeout, the spare's rendezvous timed out meanwhile, and the
    new generation failed before it met: a second re-formation. Now the wait ends when the
    generation fails, and the survivor rendezvouses through a fresh client."""
    timeout_s = 30
    ckpt = tmp_path / "ckpt"
    # one of rank 1's files of step 8 (a small object: written on its own, not batched)
    held = ckpt / "step_000000008" / "1" / "state" / "optim" / "param_groups.norm.bias.betas"
    held.parent.mkdir(parents=True)
    held.touch()
    sigio = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease break's notice to us
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # an open to write it waits (45 s)
        args = [*SMALL_MODEL, "--dp", "2", "--steps", "12", "--ckpt-every", "4",
                "--ckpt-engine", "torchsnapshot", "--ckpt-url", str(ckpt),
                "--run-dir", str(tmp_path), "--recovery", "in_process",
                "--collective-timeout-s", str(timeout_s)]
        proc = subprocess.Popen(torchrun_cmd(3, args, max_restarts=0), env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            victim = _pid(tmp_path, rank=1)
            _wait_for(tmp_path, lambda e: e["event"] == "spare_ready")
            _wait_for(tmp_path, lambda e: e["event"] == "ckpt_staged" and e["rank"] == 0
                      and e["step"] == 8)
            time.sleep(1.0)  # rank 0's save thread waits in the commit barrier
            os.kill(victim, signal.SIGKILL)
            killed = time.time()
            out, _ = proc.communicate(timeout=6 * timeout_s)
        finally:
            proc.kill()
    finally:
        os.close(fd)
        signal.signal(signal.SIGIO, sigio)
    assert proc.returncode == 0, out[-3000:]
    log = events(tmp_path)
    assert not [e for e in log if e["event"] == "start" and e["attempt"] >= 2], out[-3000:]
    second = {e["rank"]: e for e in log if e["event"] == "start" and e["attempt"] == 1}
    assert second[1]["worker"] == "2.0"
    assert second[0]["t"] - killed < timeout_s / 3


def _gloo_device_loops(pid: int) -> int:
    """The gloo transport threads of a process: one per gloo context (process group) alive."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
            count += f.read().strip() == "gloo_tcp_loop"
    return count


def _held(pid: int, samples: int = 5, every_s: float = 0.1) -> tuple[int, ...]:
    """What a process holds, read from outside: its threads, its open descriptors and its
    resident memory in bytes, each the least of ``samples`` looks ``every_s`` apart (a save
    in flight holds a thread and a step's files for a moment: not what the process keeps)."""
    looks = []
    for i in range(samples):
        if i:
            time.sleep(every_s)
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f)
        looks.append((int(status["Threads"]), len(os.listdir(f"/proc/{pid}/fd")),
                      int(status["VmRSS"].split()[0]) * 1024))
    return tuple(min(look[i] for look in looks) for i in range(3))


@pytest.mark.slow
def test_a_survivor_holds_no_more_after_each_recovery(tmp_path: Path) -> None:
    """Rank 1 killed seven times: a month-long run re-forms hundreds of times, so what the
    survivor holds must not grow with the re-formations. Its gloo contexts: no more than two
    generations' (the one it trains in, and the one torch keeps until the next formation), not
    one more per re-formation (FSDP's modules and states refer to each other, so a failed
    generation's model, and its process groups with their threads and sockets, outlived it
    until the interpreter's rare full collection). Its threads, open descriptors and resident
    memory, sampled from outside at the same point of every generation: the last three
    against the first two after the first re-formation (before it the engine has not started
    its threads), none higher at its lowest, and the memory by less than half of what the rank
    checkpoints (a failed generation's engine, model, optimizer or staging buffers kept alive
    would add about that much, or more, each time). Large allocations are mapped on their own
    (``MALLOC_MMAP_THRESHOLD_``), so that a free returns them to the system and the resident
    memory is what is alive, not what the allocator kept (which varies by about the state's
    size from one generation to the next)."""
    args = [*SMALL_MODEL, "--d-model", "256", "--layers", "4", "--vocab", "512",
            "--dp", "2", "--steps", "100000", "--ckpt-every", "4",
            "--ckpt-url", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path),
            "--recovery", "in_process"]
    proc = subprocess.Popen(torchrun_cmd(3, args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**env(), "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
    kills = 7
    try:
        survivor = _pid(tmp_path, rank=0)
        held, contexts, reached = [], [], 0
        for generation in range(kills + 1):
            newcomer = _pid(tmp_path, rank=1, attempt=generation)
            started = _wait_for(tmp_path, lambda e, g=generation: e["event"] == "start"
                                and e["attempt"] == g and e["rank"] == 0)["t"]
            # further than the last generation got: not a crash loop (handed to a restart)
            reached = _wait_for(tmp_path, lambda e, g=generation, t=started, r=reached:
                                e["event"] == "step_end" and e["attempt"] == g
                                and e["rank"] == 0 and e["t"] > t + 0.5
                                and e["step"] % 4 == 2 and e["step"] > r)["step"]
            held.append(_held(survivor))
            contexts.append((_gloo_device_loops(survivor), _gloo_device_loops(newcomer)))
            if generation < kills:
                os.kill(newcomer, signal.SIGKILL)
    finally:
        proc.terminate()  # torchrun tears the workers down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    state_bytes = _wait_for(tmp_path, lambda e: e["event"] == "ckpt_committed"
                            and e["rank"] == 0)["rank_bytes"]
    per_generation = contexts[0][1]
    assert contexts[0][0] == per_generation > 0, contexts
    assert all(survivor <= 2 * per_generation for survivor, _ in contexts), contexts
    early, late = held[1:3], held[-3:]
    threads, fds, rss = (min(x[i] for x in late) - max(x[i] for x in early) for i in range(3))
    assert threads <= 0 and fds <= 0, held
    assert rss < state_bytes / 2, (held, state_bytes)


def test_a_second_failure_before_the_first_save_after_a_recovery_restores_from_memory(
        tmp_path: Path) -> None:
    """Failures come in bursts (a flapping host, a replacement that dies as it joins): rank 1
    killed at step 6, its spare killed again at step 5, after the re-formation restored step
    4 and before the next save. The survivor restored step 4 from its host-memory copy the
    first time; the second time that copy is the last committed save still, and the
    survivor must restore from it again, not read storage (before, the copy was dropped
    once restored, so a second failure before the new generation's first commit read every
    survivor's shards from storage). The run ends bitwise equal to a fault-free one."""
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    run_trainer(reference, dp=2, steps=12, ckpt_every=4)
    control = faulty / "control"
    (control / "release").mkdir(parents=True)
    # step 5's first pass needs a point of its own, released (in generation 0) before the
    # launch, or the second pass's point would hold the first time the job gets there
    (control / "plan.json").write_text(json.dumps({"points": [
        {"id": "first", "step": 6}, {"id": "early", "step": 5},
        {"id": "second", "step": 5, "pass": 2}]}))
    (control / "release" / "early").write_text("0")
    proc = _launch(faulty, 2, 12, max_restarts=0, extra=["--recovery", "in_process"],
                   spares=1)
    try:
        for rank in (0, 1):  # the save of step 4 persists in the background during the hold
            _wait_for(faulty, lambda e, r=rank: e["event"] == "ckpt_committed"
                      and e["attempt"] == 0 and e["rank"] == r and e["step"] == 4)
        for generation, point in enumerate(("first", "second")):
            _wait_for(faulty, lambda e, g=generation, p=point: e["event"] == "paused"
                      and e["attempt"] == g and e["rank"] == 1 and e["point"] == p)
            os.kill(_pid(faulty, rank=1, attempt=generation), signal.SIGKILL)
            (control / "release" / point).write_text(str(generation))
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # torchrun tears the workers down (held at a point, else)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, out[-3000:]
    log = events(faulty)
    restores = {(e["attempt"], e["rank"]): e for e in log if e["event"] == "restore_end"}
    starts = {(e["attempt"], e["rank"]): e for e in log if e["event"] == "start"}
    assert starts[(2, 0)]["worker"] == "0.0"  # the survivor, in both re-formations
    assert restores[(1, 0)]["step"] == restores[(2, 0)]["step"] == 4
    assert restores[(1, 0)]["memory_bytes"] > 0 and restores[(1, 0)]["storage_bytes"] == 0
    assert restores[(2, 0)]["memory_bytes"] > 0 and restores[(2, 0)]["storage_bytes"] == 0, \
        restores[(2, 0)]
    assert losses(faulty) == losses(reference)
    assert_bitwise_equal(checkpoint_arrays(str(reference / "ckpt"), 12),
                         checkpoint_arrays(str(faulty / "ckpt"), 12))
