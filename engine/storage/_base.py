"""The storage interface the engine writes through, and retries with backoff."""

from __future__ import annotations

import collections
import errno
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import (
    CheckpointError,
    ObjectExistsError,
    StorageAccessError,
    StorageError,
    StorageUnansweredError,
)

log = logging.getLogger("antifragile.engine.storage")
T = TypeVar("T")
Late = Callable[[], Sequence[tuple[int, int]]]  # see Storage.write

# Errors that retrying cannot fix. Everything else (connection resets, timeouts, 5xx, throttling,
# which the S3 backend raises as OSError; a request not answered in time as TimeoutError) is
# retried with backoff.
# FileNotFoundError passes through as it is (callers ask "is it there?" with it; a write's is
# retried); every other error leaves this layer as a StorageError (a CheckpointError) naming the
# operation and key.
PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
    ValueError, TypeError, KeyError, CheckpointError, NotImplementedError,
)
# No retry changes them; a full disk or quota neither, in the 1.5 s a retry waits, and a save
# that waits for space holds every later save back as busy (``disk_full``). EINVAL, EPERM,
# ENOSYS, EOPNOTSUPP and EMSGSIZE are also how an fsspec backend reports a request the server
# refused as such (s3fs.errors: a 400 such as InvalidBucketName, a 405, a 501, a 413); its
# throttling and 5xx are EBUSY and EREMOTEIO, retried.
PERMANENT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                              errno.EINVAL, errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP,
                              errno.EMSGSIZE})


class Storage(Protocol):
    """A flat key/value view of one checkpoint root (``str`` keys, ``/``-separated).

    Implementations are thread-safe. ``write`` is durable when it returns (fsync locally; a
    completed PUT on S3) and atomic enough for the protocol: a torn object is never referenced
    by a record, because records are written only after every object they list.

    Optional, like ``read_into``: ``create(key, parts)`` stores ``parts`` as one new object,
    durably (as ``write(durable=True)``), only if ``key`` holds none, else raises
    ObjectExistsError and leaves the object there unchanged; atomic: of two creates of one
    key, one fails. Call it through :func:`create`, which looks first and then writes where a
    storage has none.
    """

    url: str

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        """Store ``parts`` as one object. ``durable``: its bytes are on stable storage before
        it becomes visible under ``key`` (markers); otherwise ``sync()`` makes them durable.
        ``late``: fills in bytes of ``parts[0]`` that were not ready when the write began
        (a staged object's checksums) and returns their ``(start, end)`` ranges. A storage
        that can write part of an object again (a file) calls it once the parts are written
        and writes those ranges again before the object becomes visible; one that cannot (an
        object store) calls it before it writes."""
        ...

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray: ...

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def list_dir(self, prefix: str) -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def delete_tree(self, prefix: str) -> bool:
        """Delete every object under ``prefix``; whether there was any."""
        ...

    def sync(self) -> None:
        """Make every completed write's directory entry durable (a no-op on object stores)."""
        ...


def create(storage: Any, key: str, parts: Sequence[Any]) -> None:
    """``storage.create(key, parts)`` where its class defines ``create`` (a local hard link, an
    S3 conditional PUT: atomic). Else, check-then-write: ObjectExistsError if ``key`` exists,
    then a durable ``write``; two writers that both look before either writes both write, and
    the later object replaces the earlier. Only a method the class defines counts (as for
    :func:`read_into`): a wrapper that forwards other attributes but defines ``write`` (a
    test's fault, a user's instrumentation) sees the write."""
    if getattr(type(storage), "create", None) is not None:
        storage.create(key, parts)
    else:
        look_then_write(storage, key, parts)


def look_then_write(storage: Any, key: str, parts: Sequence[Any]) -> None:
    """A create where storage has no atomic one: ObjectExistsError if ``key`` exists, else a
    durable ``write`` (two writers that both look before either writes both write)."""
    if storage.exists(key):
        raise exists_error(storage, key)
    storage.write(key, parts, durable=True)


def exists_error(storage: Any, key: str) -> ObjectExistsError:
    return ObjectExistsError(f"{storage.url}/{key} exists already; not overwritten")


def warn_no_atomic_create(where: str, refuses: str, exc: BaseException) -> None:
    """Said once per storage whose atomic create (a hard link, a conditional PUT) turned out
    to be refused: from then on it looks first, then writes."""
    log.warning("%s: %s (%s); a COMMIT is written by looking first, then writing: two saves "
                "of one step racing may both commit, the later replacing the earlier",
                where, refuses, exc)


def read_into(storage: Any, key: str, start: int, buffers: Sequence[Any]) -> int:
    """Read the object's bytes from ``start`` on into ``buffers`` in order (a scatter read),
    up to their total size or the end of the object; returns the bytes read. Uses the
    storage's own ``read_into`` where it has one (a local file: one ``preadv`` into the
    buffers, no intermediate copy), else one ``read`` copied into them. Only a method its
    class defines counts: a wrapper that forwards other attributes to an inner storage but
    defines ``read`` (a test's fault, a user's instrumentation) sees every read."""
    if getattr(type(storage), "read_into", None) is not None:
        return int(storage.read_into(key, start, buffers))
    views = byte_views(buffers)
    return scatter(storage.read(key, start, start + sum(map(len, views))), views)


def byte_views(buffers: Sequence[Any]) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers]


def scatter(data: Any, views: Sequence[memoryview]) -> int:
    """Copy ``data`` into ``views`` in order, as far as either goes; returns the bytes copied."""
    data = memoryview(data)
    pos = 0
    for view in views:
        n = min(len(view), len(data) - pos)
        view[:n] = data[pos:pos + n]
        pos += n
    return pos


class RetryingStorage:
    """Retries transient errors with jittered exponential backoff. What it raises is
    FileNotFoundError or a StorageError naming the operation, the key and the cause (a 403 from
    S3 arrives as a PermissionError inside it), so no raw storage error reaches the engine's
    callers; StorageUnansweredError where the last try timed out (a TimeoutError: the storage
    did not answer)."""

    def __init__(self, inner: Storage, *, attempts: int = 6, base_delay_s: float = 0.05,
                 max_delay_s: float = 2.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        delay = self.base_delay_s
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except (FileNotFoundError, CheckpointError):
                raise
            except Exception as exc:  # transient by elimination
                if isinstance(exc, PERMANENT) or getattr(exc, "errno", None) in PERMANENT_ERRNOS:
                    # a 403, a folder without permission: the configuration, not the storage
                    kind = StorageAccessError if isinstance(exc, PermissionError) else StorageError
                    raise kind(f"{op} {self.url}/{key}: {type(exc).__name__}: {exc}") from exc
                if attempt == self.attempts and isinstance(exc, TimeoutError):
                    raise StorageUnansweredError(
                        f"{op} {self.url}/{key} failed {attempt} times, the storage did not "
                        f"answer: {type(exc).__name__}: {exc}") from exc
                if attempt == self.attempts:
                    raise StorageError(
                        f"{op} {self.url}/{key} failed {attempt} times: {type(exc).__name__}: {exc}"
                    ) from exc
                log.warning("%s %s/%s failed (%s), retry %d in %.2fs", op, self.url, key, exc,
                            attempt, delay)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.max_delay_s)
        raise AssertionError("unreachable")

    def once(self) -> RetryingStorage:
        """This storage with one try a request: for best-effort requests after one that went
        unanswered through every try (a failed save's error record and ABORT note), which
        would each wait the whole retry budget again. Errors are sorted and named as here."""
        return RetryingStorage(self.inner, attempts=1, base_delay_s=self.base_delay_s,
                               max_delay_s=self.max_delay_s)

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        def put() -> None:
            try:
                self.inner.write(key, parts, durable=durable, late=late)
            except FileNotFoundError as exc:  # not "is it there?": an upload aborted under it
                raise OSError(str(exc)) from exc  # (S3's NoSuchUpload), a folder removed meanwhile

        self._call("write", key, put)

    def create(self, key: str, parts: Sequence[Any]) -> None:
        """:func:`create`, retried. A try whose request landed but whose answer was lost (a
        reset connection, a timeout) leaves its object behind, and the next try finds the key
        taken: once a try has failed, an object holding exactly ``parts`` is this create's
        own (a COMMIT names its save's nonce: another save's differs) and the create
        succeeded; any other is another writer's, and ObjectExistsError is raised."""
        tries = 0

        def put() -> None:
            nonlocal tries
            tries += 1
            try:
                create(self.inner, key, parts)
            except FileNotFoundError as exc:  # as in ``write``: not "is it there?"
                raise OSError(str(exc)) from exc

        try:
            self._call("write", key, put)
        except ObjectExistsError:
            if tries < 2 or not self._holds(key, parts):
                raise

    def _holds(self, key: str, parts: Sequence[Any]) -> bool:
        """Whether the object under ``key`` is exactly ``parts``."""
        data = b"".join(memoryview(p).cast("B") for p in parts)
        try:
            return self.size(key) == len(data) and bytes(self.read(key)) == data
        except FileNotFoundError:  # deleted since: not this create's to claim
            return False

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        return self._call("read", key, lambda: self.inner.read(key, start, end))

    def read_into(self, key: str, start: int, buffers: Sequence[Any]) -> int:
        return self._call("read", key, lambda: read_into(self.inner, key, start, buffers))

    def size(self, key: str) -> int:
        return self._call("size", key, lambda: self.inner.size(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list_dir(self, prefix: str) -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list_dir(prefix))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def delete_tree(self, prefix: str) -> bool:
        return self._call("delete", prefix, lambda: self.inner.delete_tree(prefix))

    def delete_link(self, prefix: str) -> bool:
        inner = getattr(self.inner, "delete_link", None)
        return inner is not None and self._call("delete", prefix, lambda: inner(prefix))

    def sync(self) -> None:
        self._call("sync", "", self.inner.sync)


class CountingStorage:
    """Counts the requests one operation (a save, a load) makes through ``inner``, by kind.

    A request is one call of the Storage interface: one object written, read (whole or a byte
    range), sized, looked up, listed or deleted; ``sync`` is not one (a no-op on object stores).
    Retries inside RetryingStorage are not counted again. On S3 a ``delete_tree`` is a listing
    plus batched deletes, and a listing of the multipart uploads under it.
    Thread-safe: the engine's pool shares one counter per operation.
    """

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def through(self, inner: Storage) -> CountingStorage:
        """``inner`` (another view of the same storage), its requests counted with these."""
        other = CountingStorage(inner)
        other._counts, other._lock = self._counts, self._lock
        return other

    def _count(self, op: str) -> None:
        with self._lock:
            self._counts[op] += 1

    @property
    def requests(self) -> dict[str, int]:
        """Requests so far by kind, and their ``total``."""
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "total": sum(counts.values())}

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        self._count("write")
        self.inner.write(key, parts, durable=durable, late=late)

    def create(self, key: str, parts: Sequence[Any]) -> None:  # one PUT (or a look-up and one)
        self._count("write")
        create(self.inner, key, parts)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        self._count("read")
        return self.inner.read(key, start, end)

    def read_into(self, key: str, start: int, buffers: Sequence[Any]) -> int:
        self._count("read")
        return read_into(self.inner, key, start, buffers)

    def size(self, key: str) -> int:
        self._count("size")
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self.inner.exists(key)

    def list_dir(self, prefix: str) -> list[str]:
        self._count("list")
        return self.inner.list_dir(prefix)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)

    def delete_tree(self, prefix: str) -> bool:
        self._count("delete")
        return self.inner.delete_tree(prefix)

    def delete_link(self, prefix: str) -> bool:  # a local look-up: not a request
        inner = getattr(self.inner, "delete_link", None)
        return inner is not None and bool(inner(prefix))

    def sync(self) -> None:
        self.inner.sync()
