"""The fast paths of a local save and load: staged object images, O_DIRECT writes with their
buffered fallback and unaligned tails, scatter reads straight into the target.

Correctness only: performance claims live in ``python -m bench.engine``.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from antifragile.engine import CheckpointEngine, _format
from antifragile.engine._ranks import inventory
from antifragile.engine._state import flatten
from antifragile.engine.plan import CellWrite, PlanOptions, build_plan
from antifragile.engine.stage import StagingArea
from antifragile.engine.storage import LocalStorage
from antifragile.engine.storage import _local as local_storage
from antifragile.engine.storage._base import read_into

SMALL = PlanOptions(max_object_bytes=4096, inner_chunk_bytes=1000, min_split_bytes=512)


def _states() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"f32": torch.randn(37, 11, generator=g),
         "bf16": torch.randn(50, 7, generator=g).bfloat16(),
         "f64": torch.randn(41, 3, generator=g).double(),  # 8-byte dtype: shifted chunks
         "i64": torch.arange(301), "flag": torch.tensor([True, False, True]),
         "scalar": torch.tensor(3.5), "half_cols": torch.randn(9, 100, generator=g)[:, ::2],
         "step": 7},
    ]


def _legacy_encode(write: CellWrite, tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[int]]:
    """The object as the engine encoded it before staging into object images: the cell copied
    into a zeroed buffer of whole inner chunks, then ``_format.encode_cell``."""
    spec = write.array
    src = tensors[spec.tensor]
    if spec.shape:
        rows = math.ceil(write.valid_shape[0] / spec.inner_rows) * spec.inner_rows
        buf = torch.zeros((rows, *spec.shard_shape[1:]), dtype=src.dtype)
    else:
        buf = torch.zeros((), dtype=src.dtype)
    region = tuple(slice(o, o + n) for o, n in zip(write.local_offset, write.valid_shape))
    buf[tuple(slice(0, n) for n in write.valid_shape)].copy_(src[region])
    view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    parts, nbytes, crcs = _format.encode_cell(
        spec, write.valid_shape[0] if write.valid_shape else 1, view)
    data = b"".join(bytes(p) for p in parts)
    assert len(data) == nbytes
    return data, crcs


@pytest.mark.parametrize("options", [PlanOptions(), SMALL])
def test_staged_images_are_the_encoded_objects(options: PlanOptions) -> None:
    """Every staged object is byte for byte what encode_cell writes, with the same part CRCs,
    for every dtype (8-byte ones included), edge cells, scalars and non-contiguous sources;
    and a second save into the same area stages the new values."""
    for state in _states():
        flat = flatten(state)
        plan = build_plan([inventory(flat.tensors, flat.values)], options)
        area = StagingArea(plan.writes[0], flat.tensors)
        for round_ in range(2):
            if round_:
                for t in flat.tensors.values():
                    t.copy_(t + 1 if t.dtype != torch.bool else ~t)
            area.begin()
            area.stage(flat.tensors)
            for i, write in enumerate(area.writes):
                image, crcs = area.finish(i)
                expected, expected_crcs = _legacy_encode(write, flat.tensors)
                assert bytes(image) == expected, write.key
                assert crcs == expected_crcs == area.chunk_crcs(i)
                assert _format.crc(image) == _format.crc(expected)
        assert area.arena.data_ptr() % local_storage.ALIGN_BYTES == 0
        assert all(c.offset % local_storage.ALIGN_BYTES == 0 for c in area.cells)


def test_staging_failure_reaches_the_writers() -> None:
    """A writer waiting for a cell raises when staging fails, instead of waiting forever."""
    state = {"w": torch.randn(8, 4)}
    flat = flatten(state)
    plan = build_plan([inventory(flat.tensors, flat.values)], PlanOptions())
    area = StagingArea(plan.writes[0], flat.tensors)
    area.begin()
    with pytest.raises(KeyError):
        area.stage({})
    with pytest.raises(Exception, match="staging failed"):
        area.wait_staged(0)


def _aligned(nbytes: int) -> memoryview:
    region = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    view = memoryview(region)[:nbytes]
    view[:] = bytes((i * 7) % 251 for i in range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    return view


def test_direct_write_with_an_unaligned_tail(tmp_path: Path) -> None:
    """An aligned buffer whose size is not a block multiple: the aligned prefix goes with
    O_DIRECT (on a file system that takes it), the tail and further parts buffered."""
    storage = LocalStorage(str(tmp_path))
    view = _aligned((1 << 20) + 4096 * 3 + 123)
    storage.write("a/obj", [view, b"tail part"])
    data = (tmp_path / "a" / "obj").read_bytes()
    assert data == bytes(view) + b"tail part"
    if storage.direct_io:  # ext4, xfs: O_DIRECT taken
        assert storage.direct_bytes == (1 << 20) + 4096 * 3
        assert storage.buffered_bytes == 123 + 9
    buf = bytearray(len(data))
    assert read_into(storage, "a/obj", 0, [buf]) == len(data) and buf == data


def _write_with_late_bytes(tmp_path: Path, direct: bool,
                           on_late: Callable[[], None] = lambda: None) -> LocalStorage:
    """Write ``obj`` (an aligned first part of 1 MiB and 3 pages and 123 bytes, then b"more")
    whose ``late`` ranges (in the first page, across a page boundary, in the buffered tail)
    are filled after the first part was written; check the file holds them."""
    storage = LocalStorage(str(tmp_path))
    if not direct:
        storage.direct_io = False
    view = _aligned((1 << 20) + 4096 * 3 + 123)
    ranges = [(10, 14), (4096 * 100 - 2, 4096 * 100 + 2), (len(view) - 5, len(view) - 1)]

    def late() -> list[tuple[int, int]]:
        on_late()
        for start, end in ranges:
            view[start:end] = b"\xa5" * (end - start)
        return ranges

    expected = bytearray(view)
    for start, end in ranges:
        expected[start:end] = b"\xa5" * (end - start)
    storage.write("obj", [view, b"more"], late=late)
    assert (tmp_path / "obj").read_bytes() == bytes(expected) + b"more"
    return storage


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_late_bytes_are_written_in_place_before_the_object_is_visible(
        tmp_path: Path, direct: bool) -> None:
    """``late`` fills bytes of the first part after it was written (a page rewritten with
    O_DIRECT where the file system takes it, a range across a page boundary, the buffered
    tail); the object then holds them, and nobody saw it under its key before."""
    seen: list[bool] = []
    storage = _write_with_late_bytes(tmp_path, direct, lambda: seen.append(
        (tmp_path / "obj").exists()))
    assert seen == [False]
    assert storage.direct_bytes == (0 if not direct or not storage.direct_io else
                                    (1 << 20) + 4096 * 3)


def test_an_object_store_fills_late_bytes_before_it_sends_the_object() -> None:
    from antifragile.engine.storage._fsspec import FsspecStorage

    storage = FsspecStorage(f"memory://late-{os.getpid()}")
    data = bytearray(b"0123456789")

    def late() -> list[tuple[int, int]]:
        data[2:4] = b"ab"
        return [(2, 4)]

    storage.write("obj", [data], late=late)
    assert storage.read("obj") == b"01ab456789"


def test_writers_that_start_before_the_copy_ends_store_the_right_checksums(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first cell is written while the last is still being copied, its CRC slots filled
    in place afterwards: the step verifies and loads bit for bit."""
    from antifragile.engine import engine as engine_module
    from antifragile.engine import stage

    monkeypatch.setattr(engine_module, "OVERLAP_MIN_BYTES", 0)  # writers start with the copy
    state = {"a": torch.randn(1024, 512), "b": torch.randn(64, 64)}
    real = stage._copy_cell
    late_writes: list[str] = []

    def slow_last(cell: Any, *args: Any, **kwargs: Any) -> None:
        if cell.write.array.tensor == "b":
            time.sleep(0.5)  # the writer of "a" (staged, released) runs meanwhile
        real(cell, *args, **kwargs)

    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        inner = engine.storage.inner
        write = inner.write

        def recording(key: str, parts: Any, **kwargs: Any) -> None:
            if kwargs.get("late") is not None:
                late_writes.append(key)
            write(key, parts, **kwargs)

        monkeypatch.setattr(inner, "write", recording)
        monkeypatch.setattr(stage, "_copy_cell", slow_last)
        engine.save(1, state, blocking=True)
        assert any("/a/" in key for key in late_writes), late_writes
        report = engine.verify(1)
        assert report.ok, report.problems
        target = {"a": torch.zeros(1024, 512), "b": torch.zeros(64, 64)}
        engine.load(target)
        assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])


def test_a_write_waiting_for_the_copy_to_end_lets_the_next_staged_object_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object written while later cells are still being copied waits for the copy's end
    (its CRC slots); meanwhile the objects staged after it are written. Its writer held its
    I/O thread through that wait: on a 2 GiB save 8 of 8 threads waited ~0.1 s with the disk
    idle (persist 0.80x an O_DIRECT write). Here one I/O thread: both staged objects' writes
    begin before the last cell's copy ends."""
    from antifragile.engine import engine as engine_module
    from antifragile.engine import stage

    monkeypatch.setattr(engine_module, "OVERLAP_MIN_BYTES", 0)  # writers start with the copy
    state = {"a": torch.randn(512, 1024), "b": torch.randn(512, 1024),
             "c": torch.randn(512, 1024)}
    real = stage._copy_cell
    copied = threading.Event()
    begun: dict[str, bool] = {}

    def slow_last(cell: Any, *args: Any, **kwargs: Any) -> None:
        if cell.write.array.tensor == "c":
            time.sleep(1.0)  # the writers of "a" and "b" (staged, released) run meanwhile
            real(cell, *args, **kwargs)
            copied.set()
        else:
            real(cell, *args, **kwargs)

    with CheckpointEngine(str(tmp_path / "ckpt"), io_threads=1) as engine:
        inner = engine.storage.inner
        write = inner.write

        def recording(key: str, parts: Any, **kwargs: Any) -> None:
            begun.setdefault(key.split("/")[1], copied.is_set())
            write(key, parts, **kwargs)

        monkeypatch.setattr(inner, "write", recording)
        monkeypatch.setattr(stage, "_copy_cell", slow_last)
        engine.save(1, state, blocking=True)
        assert begun["a"] is False and begun["b"] is False, begun
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        engine.load(target)
        assert all(torch.equal(target[k], state[k]) for k in state)


def test_unaligned_or_small_buffers_are_written_buffered(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    big = _aligned((1 << 20) + 8192)
    storage.write("x", [big[1:]])  # misaligned address
    storage.write("y", [bytes(100)])  # small
    assert (tmp_path / "x").read_bytes() == bytes(big[1:])
    assert (tmp_path / "y").read_bytes() == bytes(100)
    assert storage.direct_bytes == 0


def test_sync_flushes_what_the_storage_wrote_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With much dirty data on the machine, ``sync()`` fsyncs the files this storage wrote and
    the directories it changed, not the whole file system: a ``syncfs`` also waited for every
    other writer's dirty pages on that disk (after a 600 MB pip install, a quickstart save took
    longer than 7 steps to commit)."""
    libc = local_storage._libc()

    class NoSyncfs:
        def __getattr__(self, name: str) -> Any:
            if name == "syncfs":
                raise AssertionError("sync() flushed the whole file system (syncfs)")
            return getattr(libc, name)

    monkeypatch.setattr(local_storage, "_libc", lambda: NoSyncfs())
    monkeypatch.setattr(local_storage, "_dirty_bytes", lambda: 600 << 20)
    fsynced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    (tmp_path / "old").mkdir()
    storage = LocalStorage(str(tmp_path / "old"))
    storage.write("step_1/w/c/0", [bytes(100)])
    storage.write("step_1/b/c/0", [bytes(10)])
    storage.delete("step_1/b/c/0")
    storage.sync()
    root = tmp_path / "old"
    want = {root / "step_1/w/c/0", root / "step_1/w/c", root / "step_1/w", root / "step_1/b/c",
            root / "step_1/b", root / "step_1", root}
    assert {Path(p) for p in fsynced} == want and len(fsynced) == len(want)
    fsynced.clear()
    storage.sync()  # nothing written since: nothing to flush
    assert fsynced == []


@pytest.mark.parametrize(("release", "syncfs"), [("5.4.0-150-generic", False), ("5.7.19", False),
                                                 ("5.8.0", True), ("6.18.44-fc-v1272", True)])
def test_syncfs_only_where_it_reports_lost_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str, syncfs: bool) -> None:
    """Before Linux 5.8 ``syncfs`` returned 0 even when the writeback of a file failed: a disk
    that lost a save's pages would have passed ``sync()`` and the step been committed. There
    each file is fsynced (which reports a lost write on every kernel), whatever the dirty
    page cache."""
    libc = local_storage._libc()
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            if name == "syncfs":
                return lambda fd: calls.append(name) or libc.syncfs(fd)
            return getattr(libc, name)

    real = os.uname()
    monkeypatch.setattr(os, "uname", lambda: os.uname_result(
        (real.sysname, real.nodename, release, real.version, real.machine)))
    monkeypatch.setattr(local_storage, "_libc", lambda: Counting())
    monkeypatch.setattr(local_storage, "_dirty_bytes", lambda: 0)
    storage = LocalStorage(str(tmp_path))
    for i in range(3):
        storage.write(f"step_1/w/c.{i}", [bytes(100)])
    storage.sync()
    assert calls == (["syncfs"] if syncfs else [])


def test_folders_are_made_once_and_again_when_removed_behind_the_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save writes hundreds of objects into a few folders: the storage remembers the folders
    it made instead of looking each one up again per object (a stat walk up the tree: 28% of
    the writer threads' time in a small save). One removed since by someone else (another
    process's retention, an operator) is made again, not a failed write; one it removed
    itself (``delete_tree``) too."""
    looked_up: list[str] = []
    made: list[str] = []
    real_isdir, real_mkdir = os.path.isdir, os.mkdir
    monkeypatch.setattr(os.path, "isdir", lambda p: looked_up.append(p) or real_isdir(p))
    monkeypatch.setattr(os, "mkdir", lambda p, *a: made.append(p) or real_mkdir(p, *a))
    storage = LocalStorage(str(tmp_path))
    for i in range(50):
        storage.write(f"step_1/w/c.{i}", [b"w"])
    assert len(looked_up) <= 4, looked_up  # the folders' first write only
    assert len(made) <= 4, made
    shutil.rmtree(tmp_path / "step_1")
    storage.write("step_1/w/c.50", [b"again"])
    assert (tmp_path / "step_1/w/c.50").read_bytes() == b"again"
    storage.delete_tree("step_1")
    storage.write("step_1/w/c.0", [b"after delete_tree"])
    assert sorted(p.name for p in (tmp_path / "step_1/w").iterdir()) == ["c.0"]


@pytest.mark.parametrize("where", ["open", "write"])
def test_o_direct_refused_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 where: str) -> None:
    """A file system that refuses O_DIRECT (tmpfs: EINVAL at open; some others at the first
    write): the object is written buffered, ``direct_io`` says so, and later writes do not
    try again."""
    if not local_storage._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open, real_write = os.open, os.write
    tries = []

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & local_storage._O_DIRECT and where == "open":
            tries.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    def refusing_write(fd: int, data: Any) -> int:
        if where == "write" and local_storage.fcntl.fcntl(fd, local_storage.fcntl.F_GETFL) & \
                local_storage._O_DIRECT:
            tries.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "write", refusing_write)
    storage = LocalStorage(str(tmp_path))
    view = _aligned((1 << 20) + 77)
    storage.write("a", [view])
    storage.write("b", [view])
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == bytes(view)
    assert storage.direct_io is False and storage.direct_bytes == 0 and len(tries) == 1


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_engine_on_tmpfs_saves_and_loads() -> None:
    """On tmpfs the engine saves and loads whether the kernel refuses O_DIRECT there (before
    Linux 6.6: written buffered, ``direct_io`` False) or takes it."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        state = {"w": torch.randn(1024, 512), "b": torch.randn(7)}
        with CheckpointEngine(root) as engine:
            engine.save(1, state, blocking=True)
            local = engine.storage.inner
            assert isinstance(local, LocalStorage) and local.direct_io in (True, False)
            target = {"w": torch.empty(1024, 512), "b": torch.empty(7)}
            engine.load(target)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])


def test_engine_save_and_load_through_direct_io(tmp_path: Path) -> None:
    """Objects above the direct-write threshold go through O_DIRECT (where the disk takes it)
    and load back exactly, into the same layout and resharded by rows and by columns."""
    state = {"w": torch.randn(2048, 300), "v": torch.randn(4096).double(), "n": 3}
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        engine.save(1, state, blocking=True)
        local = engine.storage.inner
        assert isinstance(local, LocalStorage)
        if local.direct_io:
            assert local.direct_bytes >= 2048 * 300 * 4 // 2
        target = {"w": torch.zeros(2048, 300), "v": torch.zeros(4096).double(), "n": 0}
        engine.load(target)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["v"], state["v"])
        whole = engine.read(1)
        assert torch.equal(whole["w"], state["w"])


@pytest.mark.slow
def test_an_object_over_2_gib_round_trips(tmp_path: Path) -> None:
    """One shard object of 2 GiB + 4 KiB + 12 bytes: written (O_DIRECT or buffered) and read
    back whole past the ~2 GiB limit of one write/preadv."""
    rows = (2**31 + 4096 + 12) // 4 // 1
    state = {"w": torch.arange(rows, dtype=torch.int32)}
    options = PlanOptions(max_object_bytes=2**32, inner_chunk_bytes=2**32)
    with CheckpointEngine(str(tmp_path / "ckpt"), plan_options=options) as engine:
        engine.save(1, state, blocking=True)
        assert engine.verify(1).ok
        del state["w"]
        target = {"w": torch.empty(rows, dtype=torch.int32)}
        engine.load(target)
    assert torch.equal(target["w"], torch.arange(rows, dtype=torch.int32))


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_late_bytes_survive_short_pwrites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          direct: bool) -> None:
    """pwrite may write less than asked (a signal, a nearly full disk): the rest of each late
    range is written too, not silently dropped (the object then held stale checksum slots
    while its record listed the right ones: a committed step that fails its crc32c)."""
    real_pwrite = os.pwrite

    def short_pwrite(fd: int, data: Any, offset: int) -> int:
        view = memoryview(data).cast("B")
        is_direct = local_storage.fcntl.fcntl(fd, local_storage.fcntl.F_GETFL) & \
            local_storage._O_DIRECT
        return real_pwrite(fd, view[:local_storage.ALIGN_BYTES if is_direct else 1], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    _write_with_late_bytes(tmp_path, direct)


def test_late_bytes_after_an_unaligned_short_direct_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An O_DIRECT write may return a count that is not a page multiple (a file system of
    1 KiB blocks that ran out of space mid-write): the rest goes buffered, and a late range in
    the page that short write ended in is rewritten through the page cache, not with an
    O_DIRECT pwrite of part of a page (EINVAL: the object, and the save, failed)."""
    if not local_storage._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_write = os.write
    short = 4096 * 100 + 7
    counts: list[int] = []

    def short_direct_write(fd: int, data: Any) -> int:
        if not local_storage.fcntl.fcntl(fd, local_storage.fcntl.F_GETFL) & \
                local_storage._O_DIRECT or counts:
            return real_write(fd, data)
        local_storage._set_direct(fd, False)  # the kernel wrote `short` bytes of it
        counts.append(real_write(fd, memoryview(data)[:short]))
        local_storage._set_direct(fd, True)
        return counts[-1]

    monkeypatch.setattr(os, "write", short_direct_write)
    storage = _write_with_late_bytes(tmp_path, direct=True)
    assert counts == [short] or not storage.direct_io
