"""``disk_full``: the checkpoints' file system runs out of space under a running job.

Layers: the engine on a real full file system (a tmpfs filled from outside: root only); the
scenario rules; the fault's fill against a real tmpfs; what the report makes of it (from
events); then the shipped scenario as a whole ``chaos run`` (slow): the saves during the fault
fail for want of space, training goes on, the next save commits, a later kill restores from it
and the run ends bit-identical.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.faults import Injection, Target
from antifragile.chaos.faults.disk_full import DiskFull
from antifragile.chaos.infra.volume import Fill, Volume, checkpoint_volume
from antifragile.chaos.infra.weed import start_time
from antifragile.chaos.observe.measure import fault_timings
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.scenario import ScenarioError, load_scenario, parse_scenario
from antifragile.engine import CheckpointEngine, CheckpointError

ROOT = Path(__file__).resolve().parent.parent
FULL = {"kind": "disk_full", "at_step": 5, "duration_s": 2}


def _doc(url: str | None, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "full", "trainer": {"parallel": {"dp": 2}, "steps": 16},
            "checkpoint": {"url": url, "every_steps": 4}, "faults": faults}


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Volume]:
    with checkpoint_volume(tmp_path / "volume", 32) as v:
        if not isinstance(v, Volume):
            pytest.skip(v)
        yield v


# -- the engine on a full disk -----------------------------------------------------------------


class CountingWrites:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.writes = 0

    def write(self, key: str, parts: Any, **kwargs: Any) -> None:
        self.writes += 1
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_save_on_a_full_disk_fails_at_once_and_the_next_one_commits(volume: Volume) -> None:
    """A write refused for want of space is not retried (space does not come back in the 1.5 s
    a retry waits) and the save's writes not yet begun are not made: the save fails at once
    instead of holding every later save back as busy while each of its objects fails six
    times. The committed step stays intact; once there is space the next save commits."""
    state = {f"w{i}": torch.randn(256) for i in range(40)}
    with CheckpointEngine(str(volume.path / "ckpt"), keep_last=None, io_threads=2) as engine:
        engine.save(4, state, blocking=True)
        counting = CountingWrites(engine.storage.inner)
        engine.storage.inner = counting
        fill = Fill(volume)
        with pytest.raises(CheckpointError, match="No space left on device"):
            engine.save(8, state, blocking=True)
        fill.stop()
        # 80 objects (40 cells, 40 zarr.json), 2 writer threads: the few begun before the first
        # failure was seen, then the failure record and ABORT, each tried once
        assert counting.writes < 10, f"{counting.writes} writes tried on a full disk"
        assert engine.agreed_steps() == [4]
        engine.save(12, state, blocking=True)
        assert engine.agreed_steps() == [12, 4]
        loaded = {k: torch.empty(256) for k in state}
        assert engine.load(loaded) == 12
        assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.fixture
def thin_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An ext4 on a loop device whose backing file lives on a 40 MiB tmpfs: a thin-provisioned
    disk. Yields the ext4's mount point and the tmpfs's (fill it, or remount it larger)."""
    backing, mounted = tmp_path / "backing", tmp_path / "ext4"
    backing.mkdir()
    mounted.mkdir()
    undo: list[list[str]] = []

    def run(*cmd: str, then: list[str] | None = None) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"{cmd[0]}: {exc}")
        if done.returncode != 0:
            pytest.skip(f"{' '.join(cmd)}: {done.stderr.strip()}")
        if then:
            undo.append(then)
        return done.stdout.strip()

    if os.geteuid() != 0:
        pytest.skip("a loop device and mounts need root")
    try:
        run("mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(backing),
            then=["umount", "-l", str(backing)])
        image = backing / "disk.img"
        with open(image, "wb") as f:
            f.truncate(256 << 20)
        device = run("losetup", "-f", "--show", str(image))
        undo.append(["losetup", "-d", device])
        # metadata and journal written out now, so that only data needs the backing's space
        run("mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", device)
        run("mount", device, str(mounted), then=["umount", "-l", str(mounted)])
        yield mounted, backing
    finally:
        for cmd in reversed(undo):
            subprocess.run(cmd, capture_output=True, check=False)


def test_a_disk_that_loses_writes_fails_the_save_at_fsync_and_the_next_commits(
        thin_disk: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A real lost write, no fake: the thin-provisioned disk runs out of backing space, so
    the page cache's writeback of a save's files fails and fsync reports it (ENOSPC, on a
    file system that still shows free space). The save fails naming the file, nothing is
    committed, the older step loads; once the device has space again the next save commits
    (the failed fsync is not reported again to it)."""
    from antifragile.engine.storage import _local as local_storage

    mounted, backing = thin_disk
    monkeypatch.setattr(local_storage, "SYNCFS_MAX_DIRTY", 0)  # fsync each file
    state = {f"w{i}": torch.randn(1 << 14) for i in range(200)}  # 200 buffered 64 KiB files
    with CheckpointEngine(str(mounted / "ckpt"), keep_last=3) as engine:
        engine.save(1, state, blocking=True)
        with open(backing / "fill", "wb") as f, pytest.raises(OSError, match="No space"):
            while True:
                f.write(bytes(1 << 20))
        with pytest.raises(CheckpointError, match=r"step 2, rank 0: fsync .*step_000000002/"
                           r".*No space left on device; what was written there may not be"):
            engine.save(2, state, blocking=True)
        assert engine.agreed_steps() == [1]
        subprocess.run(["mount", "-o", "remount,size=400m", str(backing)], check=True)
        engine.save(3, state, blocking=True)
        assert engine.agreed_steps() == [3, 1]
        loaded = {k: torch.empty(1 << 14) for k in state}
        assert engine.load(loaded) == 3
        assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_lost_write_another_rank_flushed_first_still_fails_this_ranks_sync(
        thin_disk: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on one node share the checkpoints' file system. ``syncfs`` flushes every
    file on it, so rank 0's sync writes out rank 1's files too, and their failed writeback is
    reported to rank 0's ``syncfs`` only (the file system's error is reported once, to the
    first look after it). Rank 1's ``syncfs`` then returned 0: its sync passed, its record
    followed, and a step whose shard never reached the disk could commit. Each file's own
    error is still there for a wait on it, which rank 1's sync must make."""
    from antifragile.engine.storage import LocalStorage
    from antifragile.engine.storage import _local as local_storage

    mounted, backing = thin_disk
    monkeypatch.setattr(local_storage, "SYNCFS_MAX_DIRTY", 1 << 62)  # syncfs, as on an idle node
    rank0, rank1 = LocalStorage(str(mounted / "ckpt")), LocalStorage(str(mounted / "ckpt"))
    for i in range(8):  # buffered, under WRITEBACK_MIN_BYTES: dirty until a sync
        rank0.write(f"step_000000002/a{i}/c", [os.urandom(256 << 10)])
        rank1.write(f"step_000000002/b{i}/c", [os.urandom(256 << 10)])
    with open(backing / "fill", "wb") as f, pytest.raises(OSError, match="No space"):
        while True:
            f.write(bytes(1 << 20))
    with pytest.raises(CheckpointError, match="step_000000002/a"):
        rank0.sync()
    with pytest.raises(CheckpointError, match="step_000000002/b"):
        rank1.sync()


# -- scenario rules ----------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["/tmp/ckpt", "s3://b/p"])
def test_it_fills_only_a_file_system_chaos_mounted(url: str) -> None:
    with pytest.raises(ScenarioError, match=r"^x.yaml: faults.0.kind: disk_full fills a file "
                       r"system that chaos mounts for the run's checkpoints, never one it does "
                       r"not own, but checkpoint.url is .*: leave it unset"):
        parse_scenario(_doc(url, [FULL]), path="x.yaml")


def test_fields_are_validated() -> None:
    for bad, key in (({"duration_s": 0}, "duration_s"), ({"volume_mib": 8}, "volume_mib"),
                     ({"volume_mib": 1.5}, "volume_mib"), ({"size": 3}, "size")):
        with pytest.raises(ScenarioError, match=rf"faults\.0\.{key}"):
            parse_scenario(_doc(None, [{**FULL, **bad}]))
    fault = parse_scenario(_doc(None, [FULL])).faults[0]
    assert isinstance(fault, DiskFull) and (fault.duration_s, fault.volume_mib) == (2, 256)
    s = load_scenario(ROOT / "scenarios" / "disk-full.yaml")
    assert s.faults[0].kind == "disk_full" and s.checkpoint.url is None


def test_a_volume_the_machine_could_not_hold_in_memory_is_refused() -> None:
    """A full tmpfs is RAM: a typo (1048576 for 1024) would take the machine's memory."""
    from antifragile.chaos.faults.base import memory_mib

    too_big = memory_mib() // 2 + 1
    with pytest.raises(ScenarioError, match=rf"^x.yaml: faults.0.volume_mib: {too_big} MiB: "
                       r"the tmpfs is held in memory once filled, and this machine has \d+ MiB"):
        parse_scenario(_doc(None, [{**FULL, "volume_mib": too_big}]), path="x.yaml")


def test_without_a_volume_it_is_reported_skipped() -> None:
    target = Target(pids={}, coordinates={}, ckpt_url="/x/ckpt", rng=random.Random(0),
                    volume_unavailable="disk_full mounts a small file system for the "
                    "checkpoints, which needs root")
    injection = DiskFull(kind="disk_full", at_step=3).inject(target, 3)
    assert injection.skipped == target.volume_unavailable


# -- the fill, on a real tmpfs -----------------------------------------------------------------


def test_the_fill_takes_the_free_space_and_what_is_freed_until_it_ends(volume: Volume) -> None:
    (volume.path / "old").write_bytes(os.urandom(4 << 20))
    target = Target(pids={}, coordinates={}, ckpt_url=str(volume.path / "ckpt"),
                    rng=random.Random(0), volume=volume)
    injection = DiskFull(kind="disk_full", at_step=1, duration_s=0.5).inject(target, 1)
    assert injection.skipped is None and volume.free_bytes() == 0
    with pytest.raises(OSError, match="No space left"):
        (volume.path / "new").write_bytes(bytes(1 << 20))
    (volume.path / "old").unlink()  # retention deleting a step: the fill takes it back
    deadline = time.monotonic() + 10
    while volume.free_bytes() != 0:
        assert time.monotonic() < deadline, "the fill did not take the freed space back"
        time.sleep(0.02)
    while injection.detail["ended_t"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert injection.detail["error"] is None and injection.detail["filled_bytes"] >= 28 << 20
    assert volume.free_bytes() > 30 << 20
    (volume.path / "new").write_bytes(bytes(1 << 20))


def test_the_fault_is_timed_when_the_disk_is_full_not_when_the_fill_began(
        volume: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """Filling a large volume takes a while (about 0.25 s a GiB of tmpfs, seconds for the
    largest one allowed): the report's window of the full disk begins at the injection's
    time, and saves that committed before the disk was full were counted as saves made
    during it."""
    from antifragile.chaos.infra import volume as volumes

    allocate = os.posix_fallocate
    full_t: list[float] = []

    def slow(fd: int, offset: int, length: int) -> None:
        time.sleep(0.3)
        allocate(fd, offset, length)
        full_t.append(time.time())

    monkeypatch.setattr(volumes.os, "posix_fallocate", slow)
    target = Target(pids={}, coordinates={}, ckpt_url=str(volume.path / "ckpt"),
                    rng=random.Random(0), volume=volume)
    injection = DiskFull(kind="disk_full", at_step=1, duration_s=300.0).inject(target, 1)
    try:
        assert injection.skipped is None and injection.missed is None
        assert full_t and injection.t >= full_t[0], (injection.t, full_t[0])
    finally:
        target.endings.end_now()


def test_an_interrupt_as_the_fault_is_recorded_leaves_no_fill_going(
        volume: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C or SIGTERM landing after the fill started and before its end was registered
    (here as the injection is recorded) left it holding the volume full, its thread taking
    what is freed, until chaos exited: the run's end (``end_now``) knew of no fill to stop."""
    from antifragile.chaos.faults import disk_full
    from antifragile.chaos.infra import volume as volumes

    made: list[Fill] = []

    class Recorded(Fill):
        def __init__(self, v: Volume) -> None:
            super().__init__(v)
            made.append(self)

    def interrupted(*args: Any, **kwargs: Any) -> Injection:
        raise KeyboardInterrupt

    monkeypatch.setattr(volumes, "Fill", Recorded)
    monkeypatch.setattr(disk_full, "Injection", interrupted)
    target = Target(pids={}, coordinates={}, ckpt_url=str(volume.path / "ckpt"),
                    rng=random.Random(0), volume=volume)
    try:
        with pytest.raises(KeyboardInterrupt):
            DiskFull(kind="disk_full", at_step=1, duration_s=300.0).inject(target, 1)
        target.endings.end_now()  # the run's end
        assert not any(fill._thread.is_alive() for fill in made), "a fill still runs"
        assert not list(volume.path.glob("disk_full.*")) and volume.free_bytes() > 0
    finally:
        for fill in made:
            if fill._thread.is_alive():
                fill.stop()


def test_a_fill_that_lost_a_race_to_a_writer_still_fills(volume: Volume,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A save in flight takes space between the fill's look at the free space and its
    fallocate: the fill takes less, then the rest, and the disk is full. That is no error:
    an error reads in the report as "the disk was never filled" and fails the verdict."""
    looked = Volume.free_bytes

    def writer_in_between(v: Volume) -> int:
        free = looked(v)
        if not (v.path / "save").exists():
            (v.path / "save").write_bytes(bytes(4 << 20))
        return free

    monkeypatch.setattr(Volume, "free_bytes", writer_in_between)
    fill = Fill(volume)
    try:
        deadline = time.monotonic() + 5
        while looked(volume) > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert fill.filled_bytes >= 24 << 20 and fill.error is None, fill.error
    finally:
        fill.stop()


def test_two_fills_of_one_volume_keep_files_of_their_own(volume: Volume) -> None:
    """Two disk_full faults whose times overlap: the second truncated the first's file (one
    name for both) and the first one's end unlinked the second's, so the first reported
    nothing filled and the disk came back while the second was meant to hold it."""
    first = Fill(volume)
    second = Fill(volume)
    try:
        assert first.file != second.file and first.filled_bytes > 0
        first.stop()
        deadline = time.monotonic() + 5
        while volume.free_bytes() != 0:  # what the first gave back, the second takes
            assert time.monotonic() < deadline, "the second fill let the disk go"
            time.sleep(0.02)
        assert second.file.stat().st_size == second.filled_bytes > 0
    finally:
        second.stop()
    assert not list(volume.path.glob("*.fill"))


def test_a_file_in_the_volumes_place_makes_the_fault_skipped_with_the_reason(
        tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("without root no volume is tried")
    (tmp_path / "volume").write_text("mine")
    with checkpoint_volume(tmp_path / "volume", 16) as v:
        assert isinstance(v, str) and v.startswith(f"cannot mount a tmpfs at {tmp_path}/volume")
    assert (tmp_path / "volume").read_text() == "mine"


def test_the_volume_is_unmounted_after_the_run_and_a_leftover_one_too(tmp_path: Path) -> None:
    """A volume left by a chaos that was SIGKILLed is unmounted by the next disk_full run,
    into the same folder or not (CI gives every run a fresh --out)."""
    path = tmp_path / "volume"
    with checkpoint_volume(path, 16) as v:
        if not isinstance(v, Volume):
            pytest.skip(v)
        assert os.path.ismount(path)
    assert not os.path.ismount(path)
    killed = subprocess.Popen(["sleep", "60"])
    left = {path: f"antifragile-disk-full-{killed.pid}-{start_time(killed.pid)}",
            tmp_path / "other": f"antifragile-disk-full-{killed.pid}-{start_time(killed.pid)}"}
    live = tmp_path / "live"
    left[live] = f"antifragile-disk-full-{os.getpid()}-{start_time(os.getpid())}"
    try:
        for where, source in left.items():
            where.mkdir(exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", source, str(where)],
                           check=True)
        killed.kill()
        killed.wait()
        with checkpoint_volume(path, 16) as v:  # the mount of a killed chaos is not stacked on
            assert isinstance(v, Volume)
            assert not os.path.ismount(tmp_path / "other")
            assert os.path.ismount(live), "the volume of a chaos still running is its own"
        assert not os.path.ismount(path)
    finally:
        for where in left:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def test_a_volume_mounted_as_chaos_is_interrupted_is_unmounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM) that lands while mount(8) runs: the tmpfs is made, but the
    interrupt comes before the block that unmounts it, and it stayed mounted after the run
    (until a disk_full run of another chaos process)."""
    if os.geteuid() != 0:
        pytest.skip("mounts need root")
    real = subprocess.run

    def interrupted(argv: list[str], **kwargs: Any) -> Any:
        done = real(argv, **kwargs)
        if argv[0] == "mount":
            raise KeyboardInterrupt  # the command has run, its caller is interrupted
        return done

    path = tmp_path / "volume"
    monkeypatch.setattr(subprocess, "run", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt), checkpoint_volume(path, 16):
            pass
        assert not os.path.ismount(path)
    finally:
        monkeypatch.undo()
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_a_mount_chaos_did_not_make_is_left_alone(tmp_path: Path) -> None:
    """``--out`` may be any folder: a file system already mounted at its ``volume`` is
    someone's, never unmounted nor hidden; the fault is then skipped, saying why."""
    if os.geteuid() != 0:
        pytest.skip("mounts need root")
    path = tmp_path / "volume"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], check=True)
    try:
        (path / "theirs").write_text("data")
        with checkpoint_volume(path, 16) as v:
            assert isinstance(v, str) and "not made by this chaos run" in v, v
        assert os.path.ismount(path) and (path / "theirs").read_text() == "data"
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# -- the report --------------------------------------------------------------------------------


def _ev(t: float, event: str, rank: int = 0, attempt: int = 0, **kw: Any) -> dict[str, Any]:
    return {"t": t, "event": event, "rank": rank, "attempt": attempt, **kw}


def _timings(during: list[dict[str, Any]], ended_t: float | None = 10.0) -> Any:
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 21)]
    events += [_ev(2.0, "ckpt_staged", step=2, stall_s=0.01),
               _ev(2.5, "ckpt_committed", step=2, persist_s=0.5, bytes=10), *during,
               _ev(14.0, "ckpt_staged", step=14, stall_s=0.01),
               _ev(14.5, "ckpt_committed", step=14, persist_s=0.5, bytes=10)]
    events.sort(key=lambda e: e["t"])
    injection = Injection("disk_full", 5.0, step=5, detail={
        "duration_s": 5.0, "volume_mib": 64, "ended_t": ended_t, "filled_bytes": 60 << 20,
        "error": None})
    return fault_timings(RunRecord(0, 0.0, 21.0, events, [injection]), injection)


def test_the_report_says_which_saves_the_full_disk_refused() -> None:
    t = _timings([_ev(6.0, "ckpt_staged", step=6, stall_s=0.01),
                  _ev(6.1, "ckpt_failed", step=6, error="step 6, rank 0: write x/c.0: "
                      "OSError: [Errno 28] No space left on device")])
    assert t.effect_observed, t.effect
    assert t.effect.startswith("1 save(s) refused for want of space (ENOSPC)")
    o = t.outage
    assert o["checkpoints_failed"] == [6] and o["first_commit_after_step"] == 14
    assert o["training_continued"] and (o["volume_mib"], o["filled_bytes"]) == (64, 60 << 20)


@pytest.mark.parametrize(("during", "why"), [
    ([], "no save ran while the disk was full"),
    ([_ev(6.0, "ckpt_staged", step=6, stall_s=0.01),
      _ev(6.2, "ckpt_committed", step=6, persist_s=0.2, bytes=10)],
     "no save failed for want of space while the disk was full (step 6 committed)"),
])
def test_a_full_disk_no_save_ran_into_proves_nothing(during: list[dict[str, Any]],
                                                     why: str) -> None:
    t = _timings(during)
    assert not t.effect_observed and t.effect.startswith(why), t.effect


def test_a_disk_still_full_when_the_run_ended_fails() -> None:
    t = _timings([_ev(6.0, "ckpt_staged", step=6, stall_s=0.01),
                  _ev(6.1, "ckpt_failed", step=6, error="[Errno 28] No space left on device")],
                 ended_t=None)
    assert not t.effect_observed
    assert t.effect == "the disk was still full when the run ended (a 5.0 s fill): it never had "\
        "space again"


def test_a_restart_another_fault_caused_during_the_full_disk_is_not_its_doing() -> None:
    """Training went on through the full disk even if a kill inside its window restarted the
    job: the restart is the kill's. One with no other fault to explain it is the disk's."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 8)]
    events += [_ev(6.0, "ckpt_staged", step=6, stall_s=0.01),
               _ev(6.1, "ckpt_failed", step=6, error="step 6, rank 0: write x/c.0: OSError: "
                   "[Errno 28] No space left on device"),
               _ev(8.0, "start", attempt=1, pid=2, cause="restart")]
    events += [_ev(8.0 + t, "step_end", attempt=1, step=4 + t, seconds=0.5, loss=1.0)
               for t in range(1, 12)]
    full = Injection("disk_full", 5.0, step=5, detail={
        "duration_s": 5.0, "volume_mib": 64, "ended_t": 10.0, "filled_bytes": 60 << 20,
        "error": None})
    kill = Injection("kill_rank", 7.5, step=7, rank=1)
    alone = fault_timings(RunRecord(0, 0.0, 21.0, events, [full]), full)
    assert not alone.outage["training_continued"]
    both = fault_timings(RunRecord(0, 0.0, 21.0, events, [full, kill]), full)
    assert both.outage["training_continued"] and both.effect_observed


def test_an_attempt_that_died_of_the_full_disk_after_it_did_not_go_on() -> None:
    """A script whose next ``save()`` raised the failed save's error crashed a little after
    the window (its next save came 5 steps later), and torchrun restarted it later still: no
    restart inside the window, yet training did not go on. An attempt the fault struck goes
    on if it commits a save after the fault, runs to the end, or a fault on the job ends it."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 8)]
    events += [_ev(5.4, "ckpt_staged", step=5, stall_s=0.01),
               _ev(5.5, "ckpt_failed", step=5, error="step 5, rank 0: write x/c.0: OSError: "
                   "[Errno 28] No space left on device"),
               _ev(12.0, "start", attempt=1, pid=2, cause="restart")]
    events += [_ev(12.0 + t, "step_end", attempt=1, step=t, seconds=0.5, loss=1.0)
               for t in range(1, 8)]
    full = Injection("disk_full", 5.0, step=5, detail={
        "duration_s": 1.0, "volume_mib": 64, "ended_t": 6.0, "filled_bytes": 60 << 20,
        "error": None})
    t = fault_timings(RunRecord(0, 0.0, 21.0, events, [full]), full)
    assert not t.outage["training_continued"]
    events += [_ev(6.5, "ckpt_staged", step=6, stall_s=0.01),
               _ev(6.7, "ckpt_committed", step=6, persist_s=0.2, bytes=10)]
    events.sort(key=lambda e: e["t"])
    t = fault_timings(RunRecord(0, 0.0, 21.0, events, [full]), full)
    assert t.outage["training_continued"]


# -- the shipped scenario, whole ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(1200)  # 1200 steps twice (reference and faulty run): 270 s alone here
def test_shipped_scenario_refuses_saves_goes_on_and_ends_bitwise_equal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("disk_full mounts a tmpfs: root only")
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(ROOT / "scenarios" / "disk-full.yaml"),
                                       "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    # in the order they came: on a loaded machine the kill (20 s after the ranks are up) may
    # come before step 12's fill. It was 10 s: with its first steps slow (7 s to step 12, a
    # test beside it) and the rest fast (20 a second), the kill fell inside the 3 s fill,
    # every save since step 10 had failed, and 57 steps were lost against a bound of 10
    faults = {f["kind"]: f for f in report["faults"]}
    full, kill = faults["disk_full"], faults["kill_rank"]
    if not full["effect_observed"] and (full["effect"] or "").startswith("no save ran while"):
        # the fill's seconds held no save: steps ran ~10x slower than alone (2 steps in a 1 s
        # fill once, beside another slow test); the run's verdict says so, rightly
        pytest.skip(f"this machine was too slow for the fault's window: {full['effect']}")
    assert result.exit_code == 0, result.output
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    o = full["outage"]
    assert full["effect_observed"] and o["checkpoints_failed"] and o["training_continued"]
    verified = report["committed_verified"]
    assert verified and all(problems == [] for problems in verified.values()), verified
    assert kill["restored_step"] is not None
    if kill["injected_t"] > full["injected_t"] + o["outage_s"]:  # killed after the fill
        assert kill["restored_step"] > full["injected_step"]
    assert not os.path.ismount(out / "volume")
