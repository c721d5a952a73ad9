"""Any fsspec URL (``s3://bucket/prefix`` through s3fs): objects, no rename, no directories."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Sequence
from typing import Any

import fsspec


class FsspecStorage:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        protocol, _, root = url.partition("://")
        options = {"skip_instance_cache": True, **(storage_options or {})}
        if protocol == "s3":
            options.setdefault("use_listings_cache", False)
        self.fs = fsspec.filesystem(protocol, **options)
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False) -> None:
        data = b"".join(memoryview(p).cast("B") for p in parts)
        self.fs.pipe_file(self._path(key), data)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        # always a ranged read: without a range s3fs first asks for the size (HEAD + GET)
        try:
            return bytes(self.fs.cat_file(self._path(key), start=start, end=end))
        except OSError as exc:  # a range past the end (or any range of an empty object): 416
            if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                return b""
            raise

    def size(self, key: str) -> int:
        return int(self.fs.info(self._path(key))["size"])

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache(self._path(key))
        return bool(self.fs.exists(self._path(key)))

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix).rstrip("/")
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries
                       if e.rstrip("/") != path})

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(key))

    def delete_tree(self, prefix: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(prefix), recursive=True)
        self.fs.invalidate_cache()

    def sync(self) -> None:
        return None
