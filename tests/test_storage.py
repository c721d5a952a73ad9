"""Storage failures: transient S3 errors are retried with backoff, an outage beyond the retry
budget fails the save (not the training), and the retry wrapper's own rules.

S3 faults come from a TCP proxy between the engine's S3 client and the S3 server
(chaos/infra/proxy.py), so the engine's real client stack sees real resets and real 503
responses.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.engine import CheckpointEngine, StorageError
from antifragile.engine.storage import RetryingStorage, open_storage
from antifragile.engine.storage import _base as storage_base

# the client never retries: every retry seen below is the engine's (RetryingStorage)
SHORT_TIMEOUTS = {"connect_timeout": 2, "read_timeout": 5}


@pytest.fixture
def proxy(s3_server: dict[str, Any]) -> Iterator[FaultProxy]:
    upstream = urlparse(s3_server["endpoint_url"])
    assert upstream.hostname and upstream.port
    fault_proxy = FaultProxy((upstream.hostname, upstream.port))
    yield fault_proxy
    fault_proxy.close()


def through(proxy: FaultProxy, bucket: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    url, options = bucket
    return url, {**options, "endpoint_url": proxy.endpoint_url, "config_kwargs": SHORT_TIMEOUTS}


def state_of(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(32, 8, generator=gen), "b": torch.randn(8, generator=gen)},
        "step": step,
    }


def assert_loads(engine: CheckpointEngine, step: int) -> None:
    target = state_of(-1)
    assert engine.load(target) == step
    expected = state_of(step)
    assert torch.equal(target["model"]["w"], expected["model"]["w"])
    assert torch.equal(target["model"]["b"], expected["model"]["b"])
    assert target["step"] == step


@pytest.mark.s3
def test_connection_resets_are_retried(
    proxy: FaultProxy, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    url, options = through(proxy, s3_bucket)
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.save(1, state_of(1), blocking=True)
        proxy.fault("reset", count=3)
        engine.save(2, state_of(2), blocking=True)
        assert proxy.stats.faulted == 3
        assert engine.steps() == [1, 2] and engine.verify(2).ok
        assert_loads(engine, 2)


@pytest.mark.s3
def test_service_unavailable_is_retried_by_the_engine_with_backoff(
    proxy: FaultProxy, s3_bucket: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The client never retries: RetryingStorage is what rides a 503 out."""
    url, options = through(proxy, s3_bucket)
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.save(1, state_of(1), blocking=True)
        proxy.fault("http503", count=4)
        with caplog.at_level(logging.WARNING, logger="antifragile.engine.storage"):
            engine.save(2, state_of(2), blocking=True)
        assert proxy.stats.faulted == 4
        retries = [r.getMessage() for r in caplog.records if r.name == "antifragile.engine.storage"]
        assert retries and all("retry" in m for m in retries), retries
        assert engine.steps() == [1, 2] and engine.verify(2).ok
        assert_loads(engine, 2)


@pytest.mark.s3
def test_outage_beyond_the_retry_budget_fails_the_save_not_the_training(
    proxy: FaultProxy, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    url, options = through(proxy, s3_bucket)
    with CheckpointEngine(url, storage_options=options) as engine:
        assert isinstance(engine.storage, RetryingStorage)
        engine.storage.attempts = 3  # a short budget keeps the test fast
        engine.save(1, state_of(1), blocking=True)
        proxy.fault("http503")

        start = time.monotonic()
        handle = engine.save(2, state_of(2))
        assert time.monotonic() - start < 2.0, "save() waited for storage"
        assert handle.staged.is_set() and not handle.done()
        model = torch.nn.Linear(8, 8)
        for _ in range(3):  # training goes on while the save is failing
            model(state_of(2)["model"]["w"]).sum().backward()
        with pytest.raises(StorageError, match=r"step_000000002.*failed 3 times"):
            handle.wait()

        proxy.heal()
        assert engine.steps() == [1] and engine.latest_step() == 1
        assert engine.verify(1).ok
        assert_loads(engine, 1)
        engine.save(3, state_of(3), blocking=True)
        assert_loads(engine, 3)


# -- RetryingStorage on its own, around a flaky fake --------------------------------------------


class FlakyStorage:
    """Fails the first ``failures`` calls of every operation with ``error``, then works."""

    url = "fake://root"

    def __init__(self, error: Callable[[], BaseException], failures: int) -> None:
        self.error, self.failures = error, failures
        self.calls: dict[str, int] = {}
        self.objects: dict[str, bytes] = {"a/b": b"data"}

    def _call(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.calls[op] <= self.failures:
            raise self.error()

    def write(self, key: str, parts: Any, *, durable: bool = False, late: Any = None) -> None:
        self._call("write")
        if late is not None:
            late()
        self.objects[key] = b"".join(parts)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self._call("read")
        return self.objects[key][start:end]

    def size(self, key: str) -> int:
        self._call("size")
        return len(self.objects[key])

    def exists(self, key: str) -> bool:
        self._call("exists")
        return key in self.objects

    def list_dir(self, prefix: str) -> list[str]:
        self._call("list_dir")
        return sorted({k.removeprefix(prefix + "/").split("/")[0] for k in self.objects})

    def delete(self, key: str) -> None:
        self._call("delete")
        self.objects.pop(key, None)

    def delete_tree(self, prefix: str) -> bool:
        self._call("delete_tree")
        found = [k for k in self.objects if k.startswith(prefix + "/")]
        for key in found:
            del self.objects[key]
        return bool(found)

    def sync(self) -> None:
        self._call("sync")


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The backoff delays RetryingStorage sleeps, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(storage_base, "time", SimpleNamespace(sleep=slept.append))
    return slept


OPERATIONS: dict[str, Callable[[RetryingStorage], Any]] = {
    "write": lambda s: s.write("a/c", [b"x", b"y"]),
    "read": lambda s: s.read("a/b", 1, 3),
    "size": lambda s: s.size("a/b"),
    "exists": lambda s: s.exists("a/b"),
    "list_dir": lambda s: s.list_dir("a"),
    "delete": lambda s: s.delete("a/b"),
    "delete_tree": lambda s: s.delete_tree("a"),
    "sync": lambda s: s.sync(),
}
EXPECTED = {"read": b"at", "size": 4, "exists": True, "list_dir": ["b"], "delete_tree": True}


@pytest.mark.parametrize("op", list(OPERATIONS))
@pytest.mark.parametrize(
    "error",
    [ConnectionResetError, TimeoutError, lambda: OSError(16, "Service Unavailable")],
    ids=["reset", "timeout", "oserror-503"],
)
def test_transient_errors_are_retried_until_success(
    sleeps: list[float], op: str, error: Callable[[], BaseException]
) -> None:
    inner = FlakyStorage(error, failures=3)
    storage = RetryingStorage(inner, attempts=6, base_delay_s=0.1, max_delay_s=0.3)
    assert OPERATIONS[op](storage) == EXPECTED.get(op)
    assert inner.calls[op] == 4
    assert len(sleeps) == 3
    for delay, nominal in zip(sleeps, [0.1, 0.2, 0.3]):
        assert 0.5 * nominal <= delay <= 1.5 * nominal, sleeps


@pytest.mark.parametrize("error", [FileNotFoundError, PermissionError, IsADirectoryError])
def test_permanent_errors_are_not_retried(sleeps: list[float], error: type[BaseException]) -> None:
    """Not retried; FileNotFoundError passes as it is, anything else becomes a StorageError
    naming the operation, the key and the cause."""
    inner = FlakyStorage(error, failures=1)
    storage = RetryingStorage(inner, attempts=6)
    expected = error if error is FileNotFoundError else StorageError
    with pytest.raises(expected) as caught:
        storage.read("a/b")
    if expected is StorageError:
        assert f"read fake://root/a/b: {error.__name__}" in str(caught.value)
        assert isinstance(caught.value.__cause__, error)
    assert inner.calls["read"] == 1 and sleeps == []


def test_gives_up_after_the_budget_naming_the_key(sleeps: list[float]) -> None:
    inner = FlakyStorage(ConnectionResetError, failures=100)
    storage = RetryingStorage(inner, attempts=4, base_delay_s=0.01)
    with pytest.raises(
        StorageError,
        match=r"write fake://root/step_000000007/w/c/0 failed 4 "
        r"times: ConnectionResetError",
    ) as caught:
        storage.write("step_000000007/w/c/0", [b"x"])
    assert isinstance(caught.value.__cause__, ConnectionResetError)
    assert inner.calls["write"] == 4 and len(sleeps) == 3


# -- local storage: the kernel may transfer less than asked (preadv/writev cap at ~2 GiB) ------


def test_local_reads_and_writes_loop_over_short_transfers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short preadv/writev (what Linux does past 0x7ffff000 bytes) is continued, not taken
    for the end of the object: without the loop an object >= 2 GiB reads back truncated."""
    import os

    from antifragile.engine.storage import LocalStorage

    real_preadv, real_writev = os.preadv, os.writev

    def short_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        view = memoryview(buffers[0]).cast("B")
        return real_preadv(fd, [view[:7]], offset)

    def short_writev(fd: int, buffers: list[Any]) -> int:
        return real_writev(fd, [memoryview(buffers[0]).cast("B")[:5]])

    monkeypatch.setattr(os, "preadv", short_preadv)
    monkeypatch.setattr(os, "writev", short_writev)
    storage = LocalStorage(str(tmp_path))
    data = bytes(range(256)) * 3
    storage.write("a/b", [data[:100], data[100:]])
    assert (tmp_path / "a" / "b").read_bytes() == data
    assert storage.read("a/b") == data
    assert storage.read("a/b", 250, 700) == data[250:700]
    assert storage.read("a/b", 700, 10_000) == data[700:]


def test_a_local_write_that_writes_nothing_fails_instead_of_looping(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffered ``writev`` that wrote 0 of a non-empty batch went round the loop forever
    (the save hung); it is an I/O error now, as a ``pwrite`` that writes nothing already was,
    and no file is left under the key."""
    from antifragile.engine.storage import LocalStorage

    calls = [0]

    def stuck_writev(fd: int, buffers: list[Any]) -> int:
        calls[0] += 1
        if calls[0] > 100:
            raise RuntimeError("writev called again and again")
        return 0

    monkeypatch.setattr(os, "writev", stuck_writev)
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(OSError, match="wrote nothing"):
        storage.write("a/b", [b"x" * 100])
    assert not (tmp_path / "a" / "b").exists()

def test_every_backend_keeps_the_storage_contract(storage: tuple[str, Any]) -> None:
    """The Storage interface on each real backend: ranged and scatter reads (also past the end
    and of an empty object), sizes, listings, and a tree delete that leaves a sibling whose
    name merely starts the same."""
    url, options = storage
    s = open_storage(url, options)
    for key in ("step_5/a", "step_5/b/c", "step_50/a", "step_5x", "empty"):
        s.write(key, [key.encode(), b"|", b"tail"] if key != "empty" else [])
    assert s.read("step_5/a") == b"step_5/a|tail"
    assert s.read("step_5/a", 2, 6) == b"ep_5"
    assert s.read("step_5/a", 9) == b"tail"
    assert s.read("step_5/a", 13) == b"" and s.read("step_5/a", 20, 30) == b""
    assert s.read("empty") == b"" and s.read("empty", 0, 8) == b""
    head, rest = bytearray(4), bytearray(20)
    assert s.read_into("step_5/a", 1, [head, rest]) == 12
    assert head == b"tep_" and rest[:8] == b"5/a|tail"
    assert s.size("step_5/b/c") == len(b"step_5/b/c|tail") and s.size("empty") == 0
    assert s.exists("step_5/a") and not s.exists("step_5/nope") and not s.exists("step_5")
    with pytest.raises(FileNotFoundError):
        s.read("step_5/nope")
    assert s.list_dir("") == ["empty", "step_5", "step_50", "step_5x"]
    assert s.list_dir("step_5") == ["a", "b"] and s.list_dir("missing") == []
    s.delete_tree("step_5")
    assert not s.exists("step_5/a") and not s.exists("step_5/b/c")
    assert s.read("step_50/a") == b"step_50/a|tail" and s.read("step_5x") == b"step_5x|tail"
    # SeaweedFS may list an emptied prefix as a folder for a while (it removes them lazily)
    assert set(s.list_dir("")) - {"step_5"} == {"empty", "step_50", "step_5x"}
    s.delete("step_5x")
    s.delete("step_5x")  # deleting what is gone is fine
    assert not s.exists("step_5x")


def test_a_listing_never_names_the_folder_listed(storage: tuple[str, Any]) -> None:
    """``list_dir(prefix)`` names what is inside ``prefix``, never ``prefix`` itself: on
    SeaweedFS a folder emptied by ``delete_tree`` stays behind for a while as a folder entry,
    and S3's listing of it named it (``['big']`` for ``list_dir('big')``) where the local and
    fsspec backends list nothing."""
    url, options = storage
    s = open_storage(url, options)
    for key in ("big/a", "flat/a", "deep/a", "deep/b/c", "bigger/a"):
        s.write(key, [b"x"])
    assert s.list_dir("deep") == ["a", "b"] and s.list_dir("deep/b") == ["c"]
    for prefix in ("big", "flat", "deep"):
        assert s.delete_tree(prefix)
    assert s.list_dir("big") == [] and s.list_dir("flat/") == [] and s.list_dir("deep/b") == []
    # SeaweedFS may list the emptied subfolder for a while (it removes them lazily), as a
    # local folder would be listed; never the folder listed
    assert set(s.list_dir("deep")) <= {"b"}
    assert s.list_dir("bigger") == ["a"]


@pytest.mark.s3
def test_s3_listings_and_tree_deletes_go_past_one_page(s3_bucket: tuple[str, Any]) -> None:
    """S3 answers a listing 1,000 keys at a time and deletes at most 1,000 keys a request: a
    root with more steps, a records folder of more ranks, a step of more objects is listed
    and deleted whole, not cut at the first page."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    from antifragile.engine.storage._s3 import S3Storage

    url, options = s3_bucket
    s = S3Storage(url, options)
    names = [f"step_{i:09d}" for i in range(1001)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda name: s.write(f"many/{name}/COMMIT", [b"x"]), names))
    assert s.list_dir("many") == names
    assert s.delete_tree("many")
    assert [o for batch in obstore.list(s.store, "many") for o in batch] == []


@pytest.mark.s3
def test_a_process_forked_after_s3_requests_is_refused_not_hung(
        s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """obstore's runtime does not survive fork: a child that used it would hang on its first
    request. It gets a StorageError saying why instead."""
    url, options = s3_bucket
    s = open_storage(url, options)
    s.write("k", [b"v"])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what reading did, then leave without cleanup
        try:
            os.close(read_end)
            try:
                s.read("k")
                message = "read worked"
            except StorageError as exc:
                message = f"StorageError: {exc}"
            os.write(write_end, message.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0:
        time.sleep(0.05)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as reader:
        said = reader.read().decode()
    assert said.startswith("StorageError:") and "forked" in said and "spawn" in said, said
    assert s.read("k") == b"v"  # the parent carries on


def test_a_name_too_long_for_the_file_system_is_refused_at_the_call(tmp_path: Path) -> None:
    # 200 characters, 400 bytes: passed the check (255 characters), then failed in the
    # background, retried 6 times as if transient (ENAMETOOLONG)
    from antifragile.engine import CheckpointError

    key = "\u00e9" * 200
    with CheckpointEngine(str(tmp_path)) as engine, \
            pytest.raises(CheckpointError, match="cannot be a name on storage"):
        engine.save(1, {key: torch.ones(2)})


@pytest.mark.parametrize(("key", "why"), [("a/b", "holds '/'"), (".hidden", "starts with '.'"),
                                         ("COMMIT", "reserved"), ("tab\there", "control"),
                                         ("del\x7fhere", "control"),
                                         ("lone\ud800", "lone surrogate")])
def test_a_key_that_cannot_be_a_name_is_named_with_the_reason(tmp_path: Path, key: str,
                                                               why: str) -> None:
    # it said "state path '': 'a/b' cannot be a name on storage": the empty path of the
    # state's root where the key's place belonged, and no reason
    from antifragile.engine import CheckpointError

    with CheckpointEngine(str(tmp_path)) as engine, pytest.raises(CheckpointError) as raised:
        engine.save(1, {"model": {key: torch.ones(2)}})
    message = str(raised.value)
    assert f"under state path 'model': {key!r} cannot be a name" in message, message
    assert why in message, message


@pytest.mark.parametrize("code", [errno.ENAMETOOLONG, errno.EROFS, errno.ENOSPC, errno.EDQUOT],
                         ids=errno.errorcode.get)
def test_errors_no_retry_can_change_are_not_retried(code: int) -> None:
    """A full disk included: space does not come back in the 1.5 s the retries wait, and
    the save that waits holds every later save back as busy."""

    class Refusing:
        url = "mem://"
        calls = 0

        def write(self, key: str, parts: Any, *, durable: bool = False,
                  late: Any = None) -> None:
            Refusing.calls += 1
            raise OSError(code, os.strerror(code))

    storage = RetryingStorage(Refusing(), attempts=6, base_delay_s=0.01)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match=os.strerror(code)):
        storage.write("k", [b"x"])
    assert Refusing.calls == 1


def _three_objects_and_a_failing_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       dirty_bytes: int) -> tuple[RetryingStorage, list[str]]:
    """A retrying local storage holding ``c.0`` to ``c.2`` written, not yet synced, whose fsync
    of ``c.1`` fails once with EIO (whichever thread flushes it); the list gets its path."""
    import errno

    from antifragile.engine.storage import LocalStorage
    from antifragile.engine.storage import _local as local_storage

    monkeypatch.setattr(local_storage, "_dirty_bytes", lambda: dirty_bytes)  # > 64 MiB: fsync each
    storage = RetryingStorage(LocalStorage(str(tmp_path)), attempts=6)
    for i in range(3):
        storage.write(f"step_000000001/w/c.{i}", [bytes(100)])
    real_fsync, failed = os.fsync, []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("/c.1") and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return storage, failed


@pytest.mark.parametrize("dirty_bytes", [0, 1 << 40], ids=["syncfs-refused", "fsync-each"])
def test_a_failed_fsync_fails_the_sync_and_no_retry_hides_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeps: list[float],
        dirty_bytes: int) -> None:
    """An fsync that fails (EIO: the disk lost the written pages) means the objects may not be
    on disk. The retry of ``sync()`` found nothing left to flush and returned: the save went on
    to write its record and COMMIT over data that was never made durable."""
    from antifragile.engine.storage import _local as local_storage

    monkeypatch.setattr(local_storage, "_syncfs", lambda path: False)  # syncfs failed too
    storage, failed = _three_objects_and_a_failing_fsync(tmp_path, monkeypatch, dirty_bytes)
    with pytest.raises(StorageError, match="Input/output error") as raised:
        storage.sync()
    assert failed and failed[0] in str(raised.value), str(raised.value)


def test_a_file_system_that_cannot_fsync_a_folder_still_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync(2) of a folder is EINVAL where the file system has no fsync for folders (older
    SMB clients among them): no call makes its entries durable there, so nothing more is to
    be had (PostgreSQL ignores it likewise). It was a StorageError "what was written there
    may not be on disk", and as a COMMIT's sync fsyncs its folder, no save on such a mount
    ever committed."""
    import stat

    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with CheckpointEngine(str(tmp_path / "ckpt"), keep_last=None) as engine:
        engine.save(1, state_of(1), blocking=True)
        assert engine.steps() == [1]

def test_a_sync_retried_after_a_transient_error_flushes_what_the_first_try_did_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    """A transient failure before anything was flushed (EMFILE opening a file to fsync it) is
    retried; the retry must fsync every file and folder written, not find the set already
    taken and return."""
    import errno

    from antifragile.engine.storage import LocalStorage
    from antifragile.engine.storage import _local as local_storage

    monkeypatch.setattr(local_storage, "_dirty_bytes", lambda: 1 << 40)  # fsync each
    storage = RetryingStorage(LocalStorage(str(tmp_path)), attempts=6)
    for i in range(3):
        storage.write(f"step_000000001/w/c.{i}", [bytes(100)])
    real_open, real_fsync = os.open, os.fsync
    refused: list[str] = []
    fsynced: set[str] = set()

    def open_(path: str, flags: int, mode: int = 0o777) -> int:
        if flags == os.O_RDONLY and not refused:
            refused.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, mode)

    def fsync(fd: int) -> None:
        fsynced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    storage.sync()
    assert refused and len(sleeps) == 1
    assert {str(tmp_path / f"step_000000001/w/c.{i}") for i in range(3)} <= fsynced, fsynced
    assert str(tmp_path / "step_000000001/w") in fsynced, fsynced


def test_a_sync_returns_only_once_what_another_sync_took_is_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's retention syncs the same storage while the next save writes and syncs
    its objects: a sync that took the save's files must not let the save's own sync return
    (and its COMMIT follow) while those files are still being flushed."""
    from antifragile.engine.storage import LocalStorage
    from antifragile.engine.storage import _local as local_storage

    monkeypatch.setattr(local_storage, "_dirty_bytes", lambda: 1 << 40)  # fsync each
    storage = LocalStorage(str(tmp_path))
    for i in range(3):
        storage.write(f"step_000000002/w/c.{i}", [bytes(100)])
    real_fsync, flushing, release = os.fsync, threading.Event(), threading.Event()

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/c.1"):
            flushing.set()
            release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    retention = threading.Thread(target=storage.sync)
    retention.start()
    assert flushing.wait(30)  # the retention's sync holds c.1, not yet durable
    save = threading.Thread(target=storage.sync)
    save.start()
    save.join(0.5)
    returned_early = not save.is_alive()
    release.set()
    retention.join(30)
    save.join(30)
    assert not returned_early, "the save's sync returned while its file was being flushed"


def test_an_fsync_failure_in_another_sync_fails_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    """The retention's sync took the next save's files and an fsync failed (its error only a
    retention warning): the save's own sync must fail too, not fsync the file again (the kernel
    reports a lost write once: a second fsync passes) and let the save commit."""
    storage, _ = _three_objects_and_a_failing_fsync(tmp_path, monkeypatch, 1 << 40)
    with pytest.raises(StorageError):
        storage.sync()  # the retention's
    with pytest.raises(StorageError, match=r"c\.1") as raised:
        storage.sync()  # the save's
    assert "failed" in str(raised.value)
    storage.sync()  # reported once: the saves after it go on


def test_a_sync_failed_for_an_earlier_fsync_keeps_what_it_took_to_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    """A sync that fails because it took a path whose earlier fsync failed (the retention's,
    while the next save writes) also took the save's new objects: it must leave them to be
    flushed, or the save's own sync finds nothing to do, returns, and the save commits over
    objects that were never made durable."""
    storage, _ = _three_objects_and_a_failing_fsync(tmp_path, monkeypatch, 1 << 40)
    with pytest.raises(StorageError):
        storage.sync()  # an fsync failed: c.0 to c.2 reported by the next sync that takes them
    storage.write("step_000000002/w/c.0", [bytes(100)])  # the next save's object
    with pytest.raises(StorageError, match=r"c\.1"):
        storage.sync()  # the retention's: reports the earlier failure
    real_fsync, fsynced = os.fsync, set()

    def fsync(fd: int) -> None:
        fsynced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    storage.sync()  # the save's
    assert str(tmp_path / "step_000000002/w/c.0") in fsynced, fsynced
    assert str(tmp_path / "step_000000002/w") in fsynced, fsynced


@pytest.mark.parametrize("durable", [False, True], ids=["object", "marker"])
def test_a_failed_local_write_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    """A write that fails (a full disk) leaves neither the object nor its temporary file: the
    temporary held the disk space a retry or the next save needed, and a zarr reader of the
    folder listed it."""
    import errno

    from antifragile.engine.storage import LocalStorage

    def full(fd: int, buffers: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(OSError, match="No space left"):
        storage.write("step_000000001/w/c.0", [b"x" * 100], durable=durable)
    assert os.listdir(tmp_path / "step_000000001" / "w") == []


def test_a_local_tree_delete_that_fails_is_reported_not_taken_for_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    """Retention deletes a retired step's COMMIT, then its folder. A folder the file system
    does not let go (EIO, EACCES, NFS's busy .nfs files) stays: retention must say it failed
    (``retention_error``, retried at the next save), not report the step as removed while its
    bytes still fill the disk; and the other retired steps are deleted all the same."""
    import errno

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_last=None) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
    stuck_dir = str(tmp_path / "ckpt" / "step_000000001")
    real_rmdir = os.rmdir

    def rmdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == stuck_dir:
            raise OSError(errno.EIO, "Input/output error", path)
        real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir)
    with CheckpointEngine(url, keep_last=1) as engine:
        handle = engine.save(3, state_of(3), blocking=True)
        assert os.path.isdir(stuck_dir)
        assert not (tmp_path / "ckpt" / "step_000000002").exists()
        assert handle.retention_error is not None
        assert "step_000000001" in handle.retention_error, handle.retention_error
        assert engine.steps() == [3]


def test_a_link_under_a_step_name_is_left_as_it_is_not_retried(
        tmp_path: Path, sleeps: list[float]) -> None:
    """A step folder that is a symbolic link (an operator moved the step to another disk) is
    not a tree to delete: it is left as it is, like a stray file, and neither it nor what it
    points to is touched. It was taken for a folder (``os.path.isdir`` follows the link),
    ``shutil.rmtree`` refused it with an OSError without an errno, and that was retried as
    transient 6 times and then failed retention at every save."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_bytes(b"kept")
    (tmp_path / "ckpt").mkdir()
    os.symlink(elsewhere, tmp_path / "ckpt" / "step_000000001")
    storage = open_storage(str(tmp_path / "ckpt"))
    assert storage.delete_tree("step_000000001")
    assert sleeps == []
    assert (tmp_path / "ckpt" / "step_000000001").is_symlink()
    assert (elsewhere / "data").read_bytes() == b"kept"


def test_retention_of_a_step_moved_elsewhere_removes_the_link_not_what_it_points_to(
        tmp_path: Path) -> None:
    """An operator moved a committed step to another disk and left a link under its name.
    Retention deleted the step's COMMIT through the link (on the other disk: that copy no
    longer loads) and then left the link, so the root went on listing a step that was gone.
    The link is the step's entry in this root: retention removes it, and leaves the copy it
    points to whole, COMMIT and all."""
    url = str(tmp_path / "ckpt")
    elsewhere = tmp_path / "other-disk" / "step_000000001"
    with CheckpointEngine(url, keep_last=1) as engine:
        engine.save(1, state_of(1), blocking=True)
        elsewhere.parent.mkdir()
        os.rename(tmp_path / "ckpt" / "step_000000001", elsewhere)
        os.symlink(elsewhere, tmp_path / "ckpt" / "step_000000001")
        assert engine.steps() == [1]
        handle = engine.save(2, state_of(2), blocking=True)
        assert handle.retention_error is None
        assert engine.steps() == [2]
    assert not os.path.lexists(tmp_path / "ckpt" / "step_000000001")
    assert (elsewhere / "COMMIT").is_file()
    os.symlink(elsewhere, tmp_path / "ckpt" / "step_000000001")  # linked again: it loads
    with CheckpointEngine(url, keep_last=None) as engine:
        assert engine.steps() == [1, 2]
        target = state_of(-1)
        assert engine.load(target, step=1) == 1
        assert torch.equal(target["model"]["w"], state_of(1)["model"]["w"])


def test_a_local_marker_that_cannot_be_looked_up_is_not_taken_for_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    """``exists`` answers "is it there?"; a look-up that failed (EIO, an NFS server's ESTALE)
    is not "no". It was (``os.path.isfile`` says False for any error): one failed stat of a
    kept step's COMMIT made retention take that committed step for uncommitted debris and
    delete it, and keep the step it should have deleted."""
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_last=2) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
    marker = str(tmp_path / "ckpt" / "step_000000002" / "COMMIT")
    real_stat = os.stat
    failed: list[str] = []

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path) == marker and not failed:
            failed.append(marker)
            raise OSError(errno.EIO, "Input/output error", path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with CheckpointEngine(url, keep_last=2) as engine:
        engine.save(3, state_of(3), blocking=True)
        assert failed and engine.steps() == [2, 3]
        assert_loads(engine, 3)
    assert len(sleeps) == 1  # the failed look-up was retried


def test_an_fsspec_marker_that_cannot_be_looked_up_is_not_taken_for_missing(
        monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    """The same through fsspec: a synchronous file system's ``exists`` (memory, sftp, hdfs,
    webdav...) answers False for any error, so one failed look-up of a kept step's COMMIT made
    retention delete that committed step. Only "no such file" is "no" (and a folder is not an
    object, as on the other backends)."""
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    url = f"memory://exists-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(url, keep_last=2) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
    real_info = MemoryFileSystem.info
    failed: list[str] = []

    def info(self: MemoryFileSystem, path: str, **kwargs: Any) -> dict[str, Any]:
        if path.endswith("step_000000002/COMMIT") and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", path)
        return dict(real_info(self, path, **kwargs))

    monkeypatch.setattr(MemoryFileSystem, "info", info)
    with CheckpointEngine(url, keep_last=2) as engine:
        engine.save(3, state_of(3), blocking=True)
        assert failed and engine.steps() == [2, 3]
        assert_loads(engine, 3)
        assert not engine.storage.exists("step_000000003")  # a folder
    assert len(sleeps) == 1  # the failed look-up was retried


@pytest.mark.parametrize("error", [
    lambda: OSError(errno.EINVAL, "InvalidBucketName: The specified bucket is not valid."),
    lambda: OSError(errno.EINVAL, "InvalidRequest"),
    lambda: OSError(errno.EPERM, "MethodNotAllowed"),
    lambda: OSError(errno.ENOSYS, "NotImplemented"),
    lambda: OSError(errno.EOPNOTSUPP, "Operation not supported"),
    lambda: OSError(errno.EMSGSIZE, "EntityTooLarge"),
    NotADirectoryError, ValueError, TypeError,
], ids=["400-bucket-name", "400-request", "405", "501", "unsupported", "413", "not-a-dir",
        "value", "type"])
def test_a_refused_request_is_not_retried(sleeps: list[float],
                                          error: Callable[[], BaseException]) -> None:
    """The errnos an fsspec backend answers a refused request with (s3fs's mapping of S3's
    codes: a 400 is EINVAL, a 405 EPERM, a 501 ENOSYS, a 413 EMSGSIZE) fail at once: they were
    retried 6 times (~2.3 s of backoff) as if they might heal."""
    inner = FlakyStorage(error, failures=100)
    storage = RetryingStorage(inner, attempts=6)
    with pytest.raises(StorageError, match=r"^write fake://root/a/c: \w+") as caught:
        storage.write("a/c", [b"x"])
    assert "failed" not in str(caught.value)
    assert inner.calls["write"] == 1 and sleeps == []


def test_a_transient_answer_with_an_errno_is_still_retried(sleeps: list[float]) -> None:
    """What s3fs maps throttling and 5xx to (EBUSY, EREMOTEIO), and an unknown OSError."""
    for error in (lambda: OSError(errno.EBUSY, "SlowDown"),
                  lambda: OSError(errno.EREMOTEIO, "InternalError"), lambda: OSError("?")):
        inner = FlakyStorage(error, failures=2)
        RetryingStorage(inner, attempts=6).write("a/c", [b"x"])
        assert inner.calls["write"] == 3


@pytest.mark.s3
def test_a_save_whose_writes_hang_on_s3_fails_at_its_deadline_and_the_next_one_commits(
    proxy: FaultProxy, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """An endpoint that takes the request and never answers (the client's read timeout is
    longer than the save's budget) held the save's handle, so every later save was skipped as
    busy. The save fails once no write has returned for commit_timeout_s; once the endpoint
    answers again, the next save commits and close() does not wait for the hung request."""
    from antifragile.engine import CommitTimeoutError

    url, options = through(proxy, s3_bucket)
    options["config_kwargs"] = {"connect_timeout": 5, "read_timeout": 120}
    faults: list[object] = []

    def on_phase(step: int, phase: str) -> None:
        if step == 1 and phase == "persisting":  # past the save's first request (exists)
            faults.append(proxy.fault("blackhole"))

    engine = CheckpointEngine(url, storage_options=options, commit_timeout_s=3.0,
                              on_phase=on_phase)
    try:
        began = time.monotonic()
        handle = engine.save(1, state_of(1))
        with pytest.raises(CommitTimeoutError, match=r"step 1, rank 0: .*not written: no write "
                                                     r"returned for 3 s"):
            handle.wait(timeout=60)
        assert time.monotonic() - began < 30
        assert proxy.snapshot().faulted >= 1  # the writes were black-holed, not refused
        proxy.heal(faults[0])
        engine.save(2, state_of(2), blocking=True)
        assert engine.steps() == [2] and engine.verify(2).ok
        assert_loads(engine, 2)
    finally:
        began = time.monotonic()
        engine.close()
        assert time.monotonic() - began < 40


def test_two_hosts_whose_processes_share_pid_and_thread_id_never_share_a_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hosts writing one key of a shared folder (NFS: two jobs at one URL, a note both
    write) may run processes with the same pid and thread id (containers number their
    processes alike): a temporary file named by those alone was one file for both, the second
    writer truncated the first's bytes and renamed them away, and the first's rename failed
    (or its late rewrite went into the second's object)."""
    from antifragile.engine.storage import LocalStorage, _local

    # the names the engine takes them from, not os.getpid and threading.get_ident for every
    # thread of the process: a thread of another test that ended meanwhile failed to remove
    # itself from threading's table (KeyError: 1234)
    monkeypatch.setattr(_local, "_writer", lambda: (7, 1234))
    first, second = LocalStorage(str(tmp_path)), LocalStorage(str(tmp_path))  # two hosts
    key = "step_000000001/w/c.0"

    def meanwhile() -> list[tuple[int, int]]:
        second.write(key, [b"b" * 4096])
        return [(0, 4)]  # the first writer writes its head again (a late field)

    first.write(key, [b"a" * 4096], late=meanwhile)
    assert (tmp_path / key).read_bytes() == b"a" * 4096  # the later rename's, whole
    assert os.listdir(tmp_path / "step_000000001" / "w") == ["c.0"]


@pytest.mark.parametrize(("url", "why"), [
    ("file:/tmp/ckpt", "not a file URL (give file:///abs/path or a plain path)"),
    ("file:", "not a file URL (give file:///abs/path or a plain path)"),
    ("FILE:ckpt", "not a file URL (give file:///abs/path or a plain path)"),
    ("s3:/bucket/prefix", "not an S3 URL (give s3://bucket/prefix)"),
    ("s3:bucket", "not an S3 URL (give s3://bucket/prefix)"),
])
def test_a_schemes_short_form_is_refused_not_a_folder_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, why: str) -> None:
    """``CheckpointEngine("file:/abs")`` (RFC 8089's short form) or ``"s3:/bucket/p"`` (a
    typo of s3://) saved into a relative folder ``file:`` or ``s3:`` under the working
    directory, where nobody looks; chaos and the trainer refused them, each with its own copy
    of the check. Now the engine refuses them as it opens, naming the URL, and
    ``no_storage_for`` (the check chaos and the trainer make) gives the same reason."""
    from antifragile.engine import CheckpointError
    from antifragile.engine.storage import no_storage_for

    monkeypatch.chdir(tmp_path)
    assert no_storage_for(url) == why
    with pytest.raises(CheckpointError) as exc:
        open_storage(url)
    assert str(exc.value) == f"cannot open {url}: {why}"
    with pytest.raises(CheckpointError, match="not a"):
        CheckpointEngine(url)
    assert list(tmp_path.iterdir()) == []
    assert no_storage_for("file:///tmp/ckpt") is None and no_storage_for("s3://b/p") is None
    assert no_storage_for("ckpt") is None and no_storage_for("files:/x") is None


def test_an_fsspec_url_gives_its_file_system_the_host_and_options_it_names() -> None:
    """The URL's protocol alone picked the file system: the host, port and user an
    ``sftp://``, ``ftp://``, ``smb://`` or ``webhdfs://`` URL names were dropped, so such a
    root could not be opened at all ("FTPFileSystem.__init__() missing 1 required positional
    argument: 'host'", for a URL that names one). The file system is made from the whole URL,
    as fsspec makes it, so a save and a load go to the host named."""
    import uuid

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    made: list[dict[str, Any]] = []

    class HostMemory(MemoryFileSystem):  # type: ignore[misc]
        protocol = "hostmemory"

        def __init__(self, host: str, **options: Any) -> None:
            made.append({"host": host, **options})
            super().__init__()

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            stripped = path.split("://", 1)[-1]
            return MemoryFileSystem._strip_protocol(stripped.split("/", 1)[-1])

        @staticmethod
        def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
            return {"host": urlparse(path).hostname}

    fsspec.register_implementation("hostmemory", HostMemory, clobber=True)
    url = f"hostmemory://node7/ckpt-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(url, storage_options={"timeout": 5}) as engine:
        engine.save(1, state_of(1), blocking=True)
        assert engine.steps() == [1]
        assert_loads(engine, 1)
    assert made and all(m == {"host": "node7", "timeout": 5} for m in made)
