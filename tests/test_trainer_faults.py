"""The trainer under real faults: a SIGKILLed rank restarts the group, a SIGSTOPped one is found.

Faults are done from outside, as in production: signals to the worker processes, whose pids
the trainer reports in its ``start`` events.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

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
            extra: list[str]) -> subprocess.Popen[str]:
    args = [*SMALL_MODEL, "--dp", str(nproc), "--steps", str(steps), "--ckpt-every", "4",
            "--ckpt-url", str(run_dir / "ckpt"), "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(torchrun_cmd(nproc, args, max_restarts=max_restarts), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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


def test_stopped_rank_is_detected_within_the_bound(tmp_path: Path) -> None:
    hang_timeout_s = 3.0
    proc = _launch(tmp_path, 2, 400, max_restarts=0,
                   extra=["--hang-timeout-s", str(hang_timeout_s), "--heartbeat-interval-s",
                          "0.25", "--collective-timeout-s", "120"])
    try:
        pid = _pid(tmp_path, rank=1)
        _wait_for(tmp_path, lambda e: e["event"] == "step_end" and e["step"] >= 3)
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        detected = _wait_for(tmp_path, lambda e: e["event"] == "hang_detected", timeout_s=60)
        os.kill(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert detected["rank"] == 0 and detected["silent_ranks"] == [1]
    assert detected["t"] - stopped_at < hang_timeout_s + 3.0
    assert proc.returncode != 0
    assert "rank(s) [1] silent" in out
