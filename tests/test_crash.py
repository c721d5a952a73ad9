"""Crash safety of the save protocol under a real SIGKILL, delivered from outside the process.

A worker process (``_crash_worker.py``) saves ``make_state(step)`` for steps 1, 2, 3, ... The
test hits each phase of a save deterministically without hooks in the engine: it stops the
worker (SIGSTOP, waiting until every thread is stopped), looks at the storage folder, and
either SIGKILLs the stopped worker, if what it sees is the targeted phase, or lets it run on
(SIGCONT). What the test saw is therefore exactly what the crash left. A save has 128 shard
objects, so the write and retention phases last long enough to be caught.

After each crash a fresh engine must see the old committed steps, or the old ones plus the new
one, each verifying and loading to exactly what was saved; a restarted trainer (a new engine
in the test process, or two new worker ranks) must save the interrupted step again, and the
next commit must remove the debris. In the two-rank test one rank is killed mid-save: the
survivor's save must fail with CommitTimeoutError naming the dead rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _crash_worker import EXIT_SAVE_FAILED, KEEP_LAST, expected_shards, make_state, open_engine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

WORKER = Path(__file__).with_name("_crash_worker.py")
FIRST_TARGET = 3  # from step 3 on, a save also runs retention (keep_last=2)
PHASE_WAIT_S = 60.0
Predicate = Callable[[Path, int], bool]


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def committed(root: Path, step: int) -> bool:
    return (step_path(root, step) / "COMMIT").exists()


def record(root: Path, step: int, rank: int) -> Path:
    return step_path(root, step) / ".ranks" / f"{rank}.json"


def step_dirs(root: Path) -> set[int]:
    return {int(p.name[5:]) for p in root.glob("step_*")}


def shard_count(root: Path, step: int) -> int:
    """Complete shard objects of ``model/w`` (a write in progress has a temporary name)."""
    folder = step_path(root, step) / "model" / "w"
    names = os.listdir(folder) if folder.is_dir() else []
    return sum(name.startswith("c.") and not name.endswith(".tmp") for name in names)


def assert_committed_are_complete(root: Path) -> None:
    """Whatever the moment: a step with a COMMIT marker has every one of its shard objects."""
    for step in step_dirs(root):
        if committed(root, step):
            assert shard_count(root, step) == expected_shards(), f"step {step} torn"


# -- phases: what the storage folder shows while save ``n`` is in that phase -------------------


def in_staging(root: Path, n: int) -> bool:
    """The save was called, nothing of it is on storage yet."""
    return not step_path(root, n).exists()


def in_object_writes(root: Path, n: int) -> bool:
    """Some, not all, shard objects written; no phase-1 record."""
    return not record(root, n, 0).exists() and 0 < shard_count(root, n) < expected_shards()


def before_commit(root: Path, n: int) -> bool:
    """The phase-1 record exists, the COMMIT marker does not."""
    return record(root, n, 0).exists() and not committed(root, n)


def before_retention(root: Path, n: int) -> bool:
    """Committed; retention has not yet hidden the step it will delete."""
    return committed(root, n) and committed(root, n - KEEP_LAST)


def in_retention(root: Path, n: int) -> bool:
    """Committed; retention has removed the old step's COMMIT, not yet all of its files."""
    old = step_path(root, n - KEEP_LAST)
    return committed(root, n) and old.exists() and not committed(root, n - KEEP_LAST)


# -- the worker, and stopping it -----------------------------------------------------------------


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    progress: Path

    def lines(self) -> list[str]:
        return self.progress.read_text().splitlines() if self.progress.exists() else []

    def saving(self) -> int | None:
        """The step whose save is in progress, if any."""
        lines = self.lines()
        if lines and lines[-1].startswith("saving "):
            return int(lines[-1].split()[1])
        return None

    def output(self) -> str:
        """The tail of what the worker printed (for failure messages)."""
        return self.progress.with_suffix(".log").read_text(errors="replace")[-3000:]

    def error(self) -> dict[str, str] | None:
        errors = [line for line in self.lines() if line.startswith("error ")]
        return json.loads(errors[-1][6:]) if errors else None


def start_worker(
    root: Path,
    progress: Path,
    steps: list[int],
    *,
    rank: int = 0,
    world: int = 1,
    rendezvous: Path | None = None,
    commit_timeout_s: float = 600.0,
) -> Worker:
    args = [
        sys.executable,
        str(WORKER),
        str(root),
        str(progress),
        "--steps",
        ",".join(map(str, steps)),
        "--rank",
        str(rank),
        "--world",
        str(world),
        "--commit-timeout-s",
        str(commit_timeout_s),
        "--timeout-from-step",
        str(FIRST_TARGET),
    ]
    if rendezvous is not None:
        args += ["--rendezvous", str(rendezvous)]
    with progress.with_suffix(".log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return Worker(proc, progress)


def finish(worker: Worker, timeout_s: float = 120.0) -> None:
    worker.proc.wait(timeout=timeout_s)
    assert worker.proc.returncode == 0, worker.output()


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in "TtZX":
            return False
    return True


@contextmanager
def stopped(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """Every thread of ``proc`` is stopped inside the block (nothing it does is half-seen)."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not _all_threads_stopped(proc.pid):
            assert time.monotonic() < deadline, "worker did not stop"
            time.sleep(0.0005)
        yield
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


def kill_in_phase(worker: Worker, root: Path, phase: Predicate) -> int:
    """SIGKILL ``worker`` while its save of some step >= FIRST_TARGET is in ``phase`` (as seen
    with the worker stopped); return that step."""
    deadline = time.monotonic() + PHASE_WAIT_S
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            pytest.fail(f"worker ended before {phase.__name__} was seen: {worker.output()}")
        n = worker.saving()
        if n is not None and n >= FIRST_TARGET:
            with stopped(worker.proc):
                assert_committed_are_complete(root)
                n = worker.saving()
                if n is not None and n >= FIRST_TARGET and phase(root, n):
                    worker.proc.kill()
                    worker.proc.wait()
                    return n
        time.sleep(0.001)
    worker.proc.kill()
    worker.proc.wait()
    pytest.fail(f"{phase.__name__} not seen within {PHASE_WAIT_S} s")


# -- what a fresh engine must see ---------------------------------------------------------------


def assert_equal_state(loaded: dict, step: int) -> None:
    want = make_state(step)
    for name in ("w", "b"):
        assert torch.equal(loaded["model"][name], want["model"][name]), (step, name)
    assert loaded["step"] == step


def blank_state() -> dict:
    state = make_state(0)
    for tensor in state["model"].values():
        tensor.fill_(-7)
    state["step"] = None
    return state


def assert_visible(root: Path, steps: set[int]) -> None:
    """Exactly ``steps`` are committed; each verifies and loads to what was saved there; the
    default load picks the newest without falling back (a warning would fail the test)."""
    with open_engine(str(root)) as engine:
        assert engine.steps() == sorted(steps)
        for step in steps:
            report = engine.verify(step)
            assert report.ok, report.summary()
            target = blank_state()
            assert engine.load(target, step=step) == step
            assert_equal_state(target, step)
        target = blank_state()
        assert engine.load(target) == max(steps)
        assert_equal_state(target, max(steps))


def retained(steps: set[int]) -> set[int]:
    return set(sorted(steps)[-KEEP_LAST:])


# -- single process -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    phase: Predicate
    commits: bool  # whether the interrupted save is committed when killed in this phase
    resave: bool = True  # re-run the interrupted step (else skip it: its debris must be gc'd)


CASES = {
    "staging": Case(in_staging, commits=False),
    "object-writes": Case(in_object_writes, commits=False),
    "object-writes-then-skip": Case(in_object_writes, commits=False, resave=False),
    "record-before-commit": Case(before_commit, commits=False),
    "commit-before-retention": Case(before_retention, commits=True),
    "retention": Case(in_retention, commits=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sigkill_in_each_phase_leaves_old_or_new_set(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    root = tmp_path / "ckpt"
    worker = start_worker(root, tmp_path / "progress-a", list(range(1, 40)))
    n = kill_in_phase(worker, root, case.phase)
    old = {s for s in range(n - KEEP_LAST, n) if s >= 1}
    if case.phase is in_retention:
        expected = retained(old | {n})
    elif case.commits:
        expected = old | {n}
    else:
        expected = old
    assert_visible(root, expected)
    if case.phase in (in_object_writes, before_commit):
        assert step_path(root, n).is_dir(), "the crash should have left debris to collect"

    again = [n + 1] if case.commits or not case.resave else [n, n + 1]
    with open_engine(str(root)) as restarted:
        for step in again:
            restarted.save(step, make_state(step), blocking=True)
    final = retained(expected | set(again))
    assert_visible(root, final)
    assert step_dirs(root) == final, "debris of the crash survived the next commit"
    assert shard_count(root, max(final)) == expected_shards()


# -- two gloo ranks: one dies, the other must fail its save, naming it --------------------------


def _victim_mid_save(victim: int) -> Predicate:
    def mid_save(root: Path, n: int) -> bool:
        return (
            step_path(root, n).is_dir()
            and not record(root, n, victim).exists()
            and not committed(root, n)
        )

    mid_save.__name__ = f"rank_{victim}_mid_save"
    return mid_save


@pytest.mark.multiproc
@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_mid_save_fails_survivor_and_hides_the_step(
    tmp_path: Path, victim: int
) -> None:
    """The survivor's save fails naming the dead rank; the step stays invisible. The job then
    restarts on two ranks (victim 0) or on one rank in the test process (victim 1, as after
    losing a node): either way it saves the step again over the debris."""
    root = tmp_path / "ckpt"
    steps = list(range(1, 40))
    workers = [
        start_worker(
            root,
            tmp_path / f"progress-a{r}",
            steps,
            rank=r,
            world=2,
            rendezvous=tmp_path / "rdv-a",
            commit_timeout_s=3.0,
        )
        for r in range(2)
    ]
    survivor = workers[1 - victim]
    try:
        n = kill_in_phase(workers[victim], root, _victim_mid_save(victim))
        survivor.proc.wait(timeout=60)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    assert survivor.proc.returncode == EXIT_SAVE_FAILED, survivor.output()
    error = survivor.error()
    assert error is not None and error["type"] == "CommitTimeoutError", error
    assert error["message"].startswith(f"step {n}:"), error["message"]
    named = "rank(s) [1]" if victim == 1 else "(rank 0)"
    assert named in error["message"], error["message"]
    assert record(root, n, 1 - victim).exists() and not record(root, n, victim).exists()

    old = {s for s in range(n - KEEP_LAST, n) if s >= 1}
    assert_visible(root, old)

    again = [n, n + 1]
    if victim == 0:
        rerun = [
            start_worker(
                root,
                tmp_path / f"progress-b{r}",
                again,
                rank=r,
                world=2,
                rendezvous=tmp_path / "rdv-b",
            )
            for r in range(2)
        ]
        for w in rerun:
            finish(w)
    else:
        with open_engine(str(root)) as restarted:
            for step in again:
                restarted.save(step, make_state(step), blocking=True)
    final = retained(old | set(again))
    assert_visible(root, final)
    assert step_dirs(root) == final
