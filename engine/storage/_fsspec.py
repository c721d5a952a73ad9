"""Any fsspec URL (``s3://bucket/prefix`` through s3fs): objects, no rename, no directories.

On S3 every request is bounded and tried once by the client: botocore gets a connect timeout
and a read timeout (``CLIENT_DEFAULTS``: 5 s and 10 s) and no retries of its own, s3fs's own
retry loop is off, and each request also runs under a wall-clock bound (connect + read timeout
+ its bytes at 1 MiB/s: botocore's timeouts alone do not bound a PUT to an endpoint that
accepts connections and never answers; aiohttp waits for its "100 Continue" without one). The
only retries are ``RetryingStorage``'s (6 attempts, jittered backoff of at most ~2.3 s in all).
So one storage operation against an endpoint that does not answer fails within ~62 s (a read,
listing or HEAD: 6 x 10 s + backoff; a small write: 6 x 15 s + backoff ~ 92 s), a refused
connection within ~3 s, a host that drops packets within ~33 s, as a StorageError naming the
URL, the key and the cause, never a hang. ``steps()`` and ``load()`` stop at the first failed
operation; a failed save also tries, best effort, its error record and the ABORT note (up to
four operations). ``storage_options['config_kwargs']`` overrides the defaults key by key.

A missing bucket is not a missing object: every operation that meets ``NoSuchBucket`` raises
a StorageError saying which bucket does not exist at which endpoint, so that a listing is not
mistaken for "nothing committed" and a save does not fail with a bare FileNotFoundError.

Objects of at least ``MULTIPART_MIN_BYTES`` go up as a multipart upload whose parts
(``PART_BYTES`` each) are sent concurrently (s3fs's ``max_concurrency``, default 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import sync

from ..errors import StorageError

T = TypeVar("T")

# botocore.config.Config keys for every S3 request the engine makes
CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 10,
    "retries": {"total_max_attempts": 1, "mode": "standard"},  # RetryingStorage retries
}
# the wall-clock bound of one request (a PUT to an endpoint that never answers is not bounded
# by botocore's timeouts: aiohttp waits for the "100 Continue" without one), plus time for the
# bytes at no less than this rate
MIN_TRANSFER_BYTES_PER_S = 2**20
PART_BYTES = 8 * 2**20  # S3's minimum part is 5 MiB
MULTIPART_MIN_BYTES = 2 * PART_BYTES


class RequestTimeout(OSError):
    """A request outlived its wall-clock bound (transient: RetryingStorage retries it). Not a
    TimeoutError: fsspec turns those into an FSTimeoutError without a message."""


def client_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with the engine's client defaults under the caller's ``config_kwargs``."""
    config = {**CLIENT_DEFAULTS, **(storage_options.get("config_kwargs") or {})}
    return {**storage_options, "config_kwargs": config}


def _missing_bucket(exc: BaseException) -> bool:
    """Whether an s3fs FileNotFoundError means the bucket (not the key) does not exist."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        seen = seen.__cause__ or seen.__context__
    return "bucket does not exist" in str(exc).lower()


class FsspecStorage:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        protocol, _, root = url.partition("://")
        options = {"skip_instance_cache": True, **(storage_options or {})}
        self.s3 = protocol in ("s3", "s3a")
        if self.s3:
            options.setdefault("use_listings_cache", False)
            options = client_options(options)
        self.fs = fsspec.filesystem(protocol, **options)
        if self.s3:
            self.fs.retries = 1  # s3fs's own retry loop: off (see the module docstring)
            config = options["config_kwargs"]
            self._request_s = float(config.get("connect_timeout") or 60) + float(
                config.get("read_timeout") or 60)
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0]
        self.endpoint = str(options.get("endpoint_url") or getattr(self.fs, "endpoint_url", "")
                            or "the default endpoint")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FileNotFoundError as exc:
            if self.s3 and _missing_bucket(exc):
                raise StorageError(f"{op} {self.url}/{key}: bucket {self.bucket!r} does not "
                                   f"exist at {self.endpoint} (NoSuchBucket)") from exc
            raise

    def _bounded(self, make: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """Run one s3fs coroutine on its loop, cancelled (TimeoutError, which RetryingStorage
        retries) when it outlives the request bound."""
        timeout_s = self._request_s + nbytes / MIN_TRANSFER_BYTES_PER_S

        async def run() -> T:
            try:
                return await asyncio.wait_for(make(), timeout_s)
            except TimeoutError:
                raise RequestTimeout(f"timed out: no answer from {self.endpoint} within "
                                   f"{timeout_s:.0f} s") from None

        return sync(self.fs.loop, run)

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False) -> None:
        data = b"".join(memoryview(p).cast("B") for p in parts)
        path = self._path(key)
        if not self.s3:
            self._call("write", key, lambda: self.fs.pipe_file(path, data))
            return
        chunk = PART_BYTES if len(data) >= MULTIPART_MIN_BYTES else 2 * len(data) + 1
        self._call("write", key, lambda: self._bounded(
            lambda: self.fs._pipe_file(path, data, chunksize=chunk), len(data)))

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        # always a ranged read: without a range s3fs first asks for the size (HEAD + GET)
        path = self._path(key)
        try:
            if self.s3:
                nbytes = (end - start) if end is not None else 0
                return bytes(self._call("read", key, lambda: self._bounded(
                    lambda: self.fs._cat_file(path, start=start, end=end), nbytes)))
            return bytes(self._call("read", key, lambda: self.fs.cat_file(
                path, start=start, end=end)))
        except OSError as exc:  # a range past the end (or any range of an empty object): 416
            if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                return b""
            raise

    def _run(self, op: str, key: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(*args)``: on S3 its coroutine under the request bound."""
        if self.s3:
            method = getattr(self.fs, f"_{name}")
            return self._call(op, key, lambda: self._bounded(lambda: method(*args, **kwargs)))
        return self._call(op, key, lambda: getattr(self.fs, name)(*args, **kwargs))

    def size(self, key: str) -> int:
        return int(self._run("size", key, "info", self._path(key))["size"])

    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists: on S3 one HEAD (s3fs's ``exists`` follows a 404
        with a listing, to find a "directory"; the engine only asks about objects)."""
        path = self._path(key)
        self.fs.invalidate_cache(path)
        if not self.s3:
            return bool(self._call("exists", key, lambda: self.fs.exists(path)))
        bucket, object_key, _ = self.fs.split_path(path)

        async def head() -> bool:
            try:
                await self.fs._call_s3("head_object", Bucket=bucket, Key=object_key)
            except FileNotFoundError:
                return False
            return True

        return self._call("exists", key, lambda: self._bounded(head))

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix).rstrip("/")
        self.fs.invalidate_cache(path)
        try:
            entries = self._run("list", prefix, "ls", path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries
                       if e.rstrip("/") != path})

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._run("delete", key, "rm_file", self._path(key))

    def delete_tree(self, prefix: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._run("delete", prefix, "rm", self._path(prefix), recursive=True)
        self.fs.invalidate_cache()

    def sync(self) -> None:
        return None
