"""The engine's reusable daemon workers: a closed engine leaves no worker thread behind, and an
idle worker holds nothing of the job it ran.

A daemon thread still running when the interpreter finalizes is ended inside ``take_gil`` by
``pthread_exit``; if it is freeing a tensor view at that moment, the forced unwind crosses a
``noexcept`` C++ destructor and the process aborts ("terminate called without an active
exception", SIGABRT after a successful run: seen in 1 of ~50 runs of a 2-rank script)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures import wait
from pathlib import Path

import pytest
import torch

from antifragile.engine import CheckpointEngine
from antifragile.engine._threads import DaemonWorkers


class _Payload:
    pass


def _alive(workers: DaemonWorkers) -> list[str]:
    return [t.name for t in workers._threads if t.is_alive()]


def test_close_ends_every_worker_before_it_returns() -> None:
    workers = DaemonWorkers()
    release = threading.Event()
    done = [threading.Event() for _ in range(3)]
    for i in range(3):  # three at once: three threads
        workers.run(f"ckpt-test-{i}", lambda e=done[i]: (release.wait(), e.set()))
    release.set()
    for event in done:
        event.wait(5)
    assert len(workers._threads) == 3
    workers.close()
    assert _alive(workers) == []


def test_an_idle_worker_keeps_no_reference_to_its_last_job() -> None:
    workers = DaemonWorkers()
    payload = _Payload()
    ref = weakref.ref(payload)
    finished = threading.Event()
    workers.run("ckpt-test", lambda _p: finished.set(), payload)
    finished.wait(5)
    del payload
    for _ in range(50):  # the worker parks itself once the job has returned
        gc.collect()
        if ref() is None:
            break
        threading.Event().wait(0.01)
    try:
        assert ref() is None, "the idle worker still holds the arguments of its last job"
    finally:
        workers.close()


def test_an_engine_closed_after_saves_leaves_no_worker(tmp_path: Path) -> None:
    with CheckpointEngine(str(tmp_path / "ck"), keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.randn(16, 8)[::2]})
            ckpt.wait()
    assert ckpt._workers._threads and _alive(ckpt._workers) == []


def test_close_waits_for_the_listing_of_step_folders(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 lists the step folders an earlier process left on a thread of its own from the
    engine's start; close() returned while it still listed (a slow storage, or an engine
    closed at once), leaving a thread of the closed engine making requests to its storage."""
    from antifragile.engine import engine as engine_module

    listing, release = threading.Event(), threading.Event()
    real = engine_module._commit.step_dirs

    def slow_listing(storage: object) -> object:
        listing.set()
        release.wait(10)
        return real(storage)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module._commit, "step_dirs", slow_listing)
    ckpt = CheckpointEngine(str(tmp_path / "ck"))
    assert listing.wait(10)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    try:
        ckpt.close()
        assert not [t.name for t in threading.enumerate() if t.name == "ckpt-list-steps"]
    finally:
        release.set()
        timer.cancel()


def test_a_close_interrupted_is_finished_by_the_next(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while close() waited for the save in flight left the engine marked closed with
    its threads running: the next close() (a ``finally``, a context manager's exit) returned
    at once, and the threads ran on into the interpreter's exit (the abort above)."""
    from antifragile.engine._handle import SaveHandle

    ckpt = CheckpointEngine(str(tmp_path / "ck"))
    ckpt.save(1, {"w": torch.randn(16, 8)})
    real_wait, interrupted = SaveHandle.wait, []

    def wait_interrupted(self: SaveHandle, timeout: float | None = None) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        real_wait(self, timeout)

    monkeypatch.setattr(SaveHandle, "wait", wait_interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.close()
    with pytest.raises(Exception, match="closed"):  # closed for new work all the same
        ckpt.save(2, {"w": torch.randn(16, 8)})
    ckpt.close()
    assert _alive(ckpt._workers) == []
    assert (tmp_path / "ck" / "step_000000001" / "COMMIT").exists()

def test_a_script_that_exits_right_after_saves_exits_cleanly(tmp_path: Path) -> None:
    """Saves whose last tensors are views (freeing them takes the GIL in C++), an engine
    dropped without close(): the interpreter exits with 0. A smoke check: the race it guards
    against hit ~1 in 50 runs, so three runs rarely catch it; the tests above pin the
    mechanism (a closed engine's threads have ended, an idle one holds no job)."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from antifragile.engine import CheckpointEngine
        ckpt = CheckpointEngine(sys.argv[1], keep_last=2)
        base = torch.randn(64, 64, requires_grad=True)
        for step in range(1, 4):
            ckpt.save(step, {"w": base[::2] * 1, "v": base.detach()[1::2]})
            ckpt.wait()
    """))
    for i in range(3):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"ck{i}")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]


_STUCK = """
import sys, threading
import pytest
import torch
from antifragile.engine import CheckpointEngine
ckpt = CheckpointEngine(sys.argv[1], keep_last=2)
writing = threading.Event()
def stuck(self, key, parts, **kw):  # a storage that never answers (a hung NFS server)
    writing.set()
    threading.Event().wait()
type(ckpt.storage).write = stuck
ckpt.save(1, {"w": torch.ones(1000)})
assert writing.wait(30)
print("saved", flush=True)
"""


def test_a_script_whose_save_is_stuck_on_storage_still_exits(tmp_path: Path) -> None:
    """The save's writes ran on a ``ThreadPoolExecutor``, whose threads the interpreter joins
    at exit before any atexit hook: a script that ended with a write stuck on storage (never
    closing its engine) never exited. It exits after ``EXIT_WAIT_S``, saying what was left."""
    proc = subprocess.run([sys.executable, "-c", _STUCK, str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "saved\n"
    assert "exiting with checkpoint threads still running" in proc.stderr, proc.stderr


def test_a_second_shutdown_that_cancels_still_ends_the_pool() -> None:
    """``abandon()`` shuts the I/O pool down with ``cancel_futures`` after ``close()`` (or the
    exit hook) may already have: the cancelling drain also took the end-of-jobs marker the first
    shutdown queued, and no new one was queued, so a thread busy then waited for another job
    forever once its write returned (``shutdown(wait=True)`` hung). ``ThreadPoolExecutor``
    queues the marker at every shutdown."""
    from antifragile.engine._threads import DaemonPool

    pool = DaemonPool(1, "ckpt-test-pool")
    release = threading.Event()
    busy = pool.submit(release.wait)
    queued = pool.submit(lambda: None)
    pool.shutdown(wait=False)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    release.set()
    assert busy.result(timeout=10)
    ender = threading.Thread(target=pool.shutdown, daemon=True)
    ender.start()
    ender.join(10)
    assert not ender.is_alive(), "shutdown(wait=True) never returned"


def test_a_write_cancelled_by_shutdown_is_done_for_its_waiter() -> None:
    """``abandon()`` cancels the writes still queued; ``write_objects`` waits for each with
    ``concurrent.futures.wait``, which counts a future that was only ``cancel()``ed as not
    done: the abandoned save's thread (and the staging buffers it holds) waited
    commit_timeout_s (600 s by default) for a write that would never run."""
    from antifragile.engine._threads import DaemonPool

    pool = DaemonPool(1, "ckpt-test-pool")
    release = threading.Event()
    busy = pool.submit(release.wait, 10)
    queued = pool.submit(lambda: None)
    pool.shutdown(wait=False, cancel_futures=True)
    try:
        assert queued.cancelled()
        assert wait([queued], timeout=5).done == {queued}
    finally:
        release.set()
    assert busy.result(timeout=10)


def test_the_exit_hook_lets_a_save_in_flight_finish_its_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At exit a save thread of an engine never closed still submits its writes to the
    engine's I/O pool: the hook closed the two in the order of a ``WeakSet`` (arbitrary), and
    where the pool came first the save failed with "cannot schedule new futures after
    shutdown" instead of committing within ``EXIT_WAIT_S`` (a 1 KB save held 0.3 s at its
    ``written`` phase: committed in 2 of 4 runs of a script that ended right after it)."""
    from antifragile.engine import _threads
    from antifragile.engine._threads import DaemonPool

    pool = DaemonPool(1, "ckpt-test-pool")
    workers = DaemonWorkers()
    results: list[object] = []

    def save() -> None:  # a save thread: its writes go through the pool after a while
        threading.Event().wait(0.3)
        try:
            results.append(pool.submit(lambda: "written").result(timeout=10))
        except RuntimeError as exc:
            results.append(exc)

    workers.run("ckpt-save-1", save)
    monkeypatch.setattr(_threads, "_LIVE", [pool, workers])  # the order that lost the save
    _threads._close_at_exit()
    assert results == ["written"]


def _refuse_start(monkeypatch: pytest.MonkeyPatch, name: str,
                  error: type[BaseException], *, after_start: bool) -> None:
    """``Thread.start`` of the thread ``name`` raises ``error``: before the thread runs (a
    process at its thread limit: "can't start new thread"), or once it runs (an interrupt
    while ``start()`` waits for the new thread to begin: milliseconds on a busy machine)."""
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name != name:
            real_start(thread)
            return
        if after_start:
            real_start(thread)
        raise error("can't start new thread" if error is RuntimeError else "")

    monkeypatch.setattr(threading.Thread, "start", start)


def test_a_worker_that_did_not_start_does_not_fail_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker thread whose ``start()`` raised stayed in the workers' list while the next
    saves reused an idle worker: ``close()`` joined it and raised "cannot join thread before
    it is started" instead of closing the engine."""
    from antifragile.engine import CheckpointError

    engine = CheckpointEngine(str(tmp_path / "ck"))
    state = {"w": torch.ones(8)}
    engine.save(1, state, blocking=True)  # one worker, idle after
    _refuse_start(monkeypatch, "ckpt-stage-2", RuntimeError, after_start=False)
    with pytest.raises(CheckpointError, match="can't start new thread"):
        engine.save(2, state, defer_staging=True)  # the idle worker, and a new one
    assert engine._last is not None
    with pytest.raises(CheckpointError, match="can't start new thread"):
        engine._last.wait(timeout=10)
    engine.save(3, state, blocking=True)  # the idle worker again
    engine.close()
    assert _alive(engine._workers) == []


def test_an_interrupt_while_a_save_thread_starts_is_raised_as_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while ``save()`` waited for its new thread to begin came out of ``save()`` as a
    CheckpointError ("its thread did not start"), which the loop the README suggests (catch
    CheckpointError around ``save()`` and train on) swallowed; and the thread, started but
    never handed its job, waited for one forever: ``close()`` waited ``CLOSE_WAIT_S`` for it
    and reported it stuck. The interrupt is raised as it is, the save fails, the thread ends,
    and the next save commits."""
    from antifragile.engine import CheckpointError, _threads

    monkeypatch.setattr(_threads, "CLOSE_WAIT_S", 2.0)
    engine = CheckpointEngine(str(tmp_path / "ck"))
    state = {"w": torch.ones(8)}
    _refuse_start(monkeypatch, "ckpt-save-1", KeyboardInterrupt, after_start=True)
    with pytest.raises(KeyboardInterrupt):
        engine.save(1, state)
    assert engine._last is not None
    with pytest.raises(CheckpointError, match="step 1"):
        engine._last.wait(timeout=10)
    engine.save(2, state, blocking=True)
    assert engine.steps() == [2]
    stuck = engine._workers.close()
    engine.close()
    assert stuck == []


def test_the_exit_hook_closes_every_pool_past_one_whose_close_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit hook stopped at the first close that raised: every engine after it in the
    set was left unclosed (its writes cut off by the interpreter's exit)."""
    from antifragile.engine import _threads

    class Broken:
        def close(self, timeout: float | None = None) -> list[str]:
            raise RuntimeError("cannot join thread before it is started")

    pool = _threads.DaemonPool(1, "exit-hook-test")
    done = pool.submit(lambda: 1)
    broken = Broken()
    monkeypatch.setattr(_threads, "_LIVE", [broken, pool])
    _threads._close_at_exit()
    assert done.result() == 1 and pool._shut


def test_a_lent_job_lets_a_queued_one_run_and_counts_again_after() -> None:
    """``lend``: while a job waits for something that is not its own I/O, a queued job runs
    in its place; once the wait is over the job counts as running again, so no more than
    ``threads`` jobs run outside ``lend`` at once."""
    from antifragile.engine._threads import DaemonPool

    pool = DaemonPool(1, "ckpt-test-pool")
    release, other_running, other_release = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def lender() -> None:
        with pool.lend():
            release.wait(10)
        order.append("lender resumed")

    def other() -> None:
        other_running.set()
        other_release.wait(10)
        order.append("other done")

    try:
        first = pool.submit(lender)
        second = pool.submit(other)
        assert other_running.wait(10), "the queued job did not run while the first was lent"
        release.set()
        time.sleep(0.2)  # the lender's wait is over: it waits to count as running again
        assert order == []
        other_release.set()
        first.result(timeout=10)
        second.result(timeout=10)
        assert order == ["other done", "lender resumed"]
    finally:
        release.set()
        other_release.set()
        pool.shutdown()


def test_a_lent_job_whose_extra_thread_does_not_start_still_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``lend`` starts a thread more for the queued jobs; where that start failed (a process
    at its thread limit: "can't start new thread") the error came out of ``lend``, failing
    the write that lent (and with it the save), and the job stayed counted as lent forever:
    with ``threads`` such failures no job was ever lent again. The body runs all the same
    and the pool lends as before once threads start again."""
    from antifragile.engine._threads import DaemonPool

    pool = DaemonPool(1, "ckpt-test-pool")
    release = threading.Event()
    try:
        _refuse_start(monkeypatch, "ckpt-test-pool_1", RuntimeError, after_start=False)

        def lender() -> str:
            with pool.lend():
                return "written"

        assert pool.submit(lender).result(timeout=10) == "written"
        monkeypatch.undo()
        other_running = threading.Event()

        def waiting_lender() -> None:
            with pool.lend():
                release.wait(10)

        first = pool.submit(waiting_lender)
        second = pool.submit(other_running.set)
        assert other_running.wait(10), "no job was lent after a thread failed to start"
        release.set()
        first.result(timeout=10)
        second.result(timeout=10)
    finally:
        release.set()
        pool.shutdown()


def test_a_job_whose_thread_does_not_start_runs_in_turn_or_never(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit`` queued the job, then started a thread for it; where that start failed (a
    process at its thread limit) the error came out of ``submit`` while the job stayed
    queued: a thread of the pool ran it later all the same, a write the caller had been told
    failed. Now a pool with a thread runs it in turn, and ``submit`` does not raise; a pool
    with none raises, and the job never runs."""
    from antifragile.engine._threads import DaemonPool

    ran: list[str] = []
    pool = DaemonPool(2, "ckpt-test-pool")
    release = threading.Event()
    try:
        busy = pool.submit(release.wait, 10)  # thread _0
        _refuse_start(monkeypatch, "ckpt-test-pool_1", RuntimeError, after_start=False)
        queued = pool.submit(ran.append, "queued")
        release.set()
        assert queued.result(timeout=10) is None and ran == ["queued"]
        assert busy.result(timeout=10)
    finally:
        release.set()
        pool.shutdown()

    monkeypatch.undo()
    empty = DaemonPool(1, "ckpt-test-empty")
    try:
        _refuse_start(monkeypatch, "ckpt-test-empty_0", RuntimeError, after_start=False)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            empty.submit(ran.append, "refused")
        monkeypatch.undo()
        assert empty.submit(ran.append, "later").result(timeout=10) is None
        assert ran == ["queued", "later"]
    finally:
        empty.shutdown()
