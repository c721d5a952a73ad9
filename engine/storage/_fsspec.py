"""Any fsspec URL other than S3 (``memory://``, ``gcs://``...): objects, no rename, no
directories. S3 has its own backend (``_s3.py``); this one adds no timeouts of its own.

fsspec has no portable write-only-if-absent, so this class defines no ``create``: a COMMIT is
written by ``_base.create``'s look-then-write. Two saves of one step racing on such storage may
both commit, the later COMMIT replacing the earlier; a save that looks after the other's COMMIT
landed fails."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Sequence
from typing import Any

import fsspec

from ._base import Late


class FsspecStorage:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        # from the whole URL, as fsspec opens one: the protocol alone dropped the host, port
        # and user that an sftp://, ftp:// or webhdfs:// URL names (such a root did not open)
        self.fs, root = fsspec.core.url_to_fs(url, **{"skip_instance_cache": True,
                                                      **(storage_options or {})})
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        if late is not None:  # an object is written once, whole
            late()
        self.fs.pipe_file(self._path(key), b"".join(memoryview(p).cast("B") for p in parts))

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        try:
            return bytes(self.fs.cat_file(self._path(key), start=start, end=end))
        except OSError as exc:  # a range past the end (or any range of an empty object)
            if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                return b""
            raise

    def size(self, key: str) -> int:
        return int(self.fs.info(self._path(key))["size"])

    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object: ``info``, not ``fs.exists``, which on a synchronous
        file system answers False for any error (retention then took a committed step whose
        COMMIT it could not look up for debris and deleted it). Only FileNotFoundError is "no";
        a folder is not an object."""
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            return self.fs.info(path).get("type") != "directory"
        except FileNotFoundError:
            return False

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

    def delete_tree(self, prefix: str) -> bool:
        try:
            self.fs.rm(self._path(prefix), recursive=True)
        except FileNotFoundError:
            return False
        finally:
            self.fs.invalidate_cache()
        return True

    def sync(self) -> None:
        return None
