"""A local (POSIX) checkpoint root: vectored writes, fsync of files and of new directories."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Sequence
from typing import Any

_IOV_MAX = 1024


class LocalStorage:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._dirty_dirs: set[str] = set()
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def _makedirs(self, path: str) -> None:
        created = []
        while not os.path.isdir(path):
            created.append(path)
            path = os.path.dirname(path)
        for new in reversed(created):
            os.makedirs(new, exist_ok=True)
        with self._lock:
            self._dirty_dirs.update(os.path.dirname(p) for p in created)

    def write(self, key: str, parts: Sequence[Any]) -> None:
        path = self._path(key)
        self._makedirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            views = [memoryview(p).cast("B") for p in parts]
            views = [v for v in views if len(v)]
            while views:
                batch = views[:_IOV_MAX]
                written = os.writev(fd, batch)
                views = views[len(batch):] if written == sum(map(len, batch)) else (
                    _advance(batch, written) + views[len(batch):])
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with open(self._path(key), "rb", buffering=0) as f:
            if end is None:
                end = os.fstat(f.fileno()).st_size
            buf = bytearray(max(end - start, 0))
            got = os.preadv(f.fileno(), [buf], start) if buf else 0
            return bytes(buf) if got == len(buf) else bytes(buf[:got])

    def size(self, key: str) -> int:
        return os.stat(self._path(key)).st_size

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(self._path(key)))

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(self._path(prefix)))

    def sync(self) -> None:
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for d in sorted(dirs, key=len, reverse=True):
            try:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _advance(views: list[memoryview], written: int) -> list[memoryview]:
    """The views left after a short ``writev`` of ``written`` bytes."""
    out = []
    for v in views:
        if written >= len(v):
            written -= len(v)
        else:
            out.append(v[written:])
            written = 0
    return out
