"""A local (POSIX) checkpoint root: vectored writes; ``sync()`` makes them durable at once.

Writes are not fsynced one by one (a checkpoint has hundreds of small objects and an fsync
costs milliseconds each): ``sync()`` flushes the whole file system with one ``syncfs(2)``
(Linux), falling back to fsync of every file and directory written since the last sync. The
protocol calls ``sync()`` before each record and marker, which is what durability needs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
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
        self._dirty_files: set[str] = set()
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

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False) -> None:
        path = self._path(key)
        self._makedirs(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"  # a kill never tears `path`
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            views = [memoryview(p).cast("B") for p in parts]
            views = [v for v in views if len(v)]
            while views:
                batch = views[:_IOV_MAX]
                written = os.writev(fd, batch)
                views = views[len(batch):] if written == sum(map(len, batch)) else (
                    _advance(batch, written) + views[len(batch):])
            if durable:  # a marker: never visible before its bytes are (power loss)
                os.fsync(fd)
            else:
                _start_writeback(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))
            self._dirty_files.add(path)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        with open(self._path(key), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            end = size if end is None else min(end, size)  # never allocate past the end of file
            buf = bytearray(max(end - start, 0))
            view = memoryview(buf)
            got = 0
            while got < len(buf):  # one preadv moves at most ~2 GiB; loop until EOF
                n = os.preadv(f.fileno(), [view[got:]], start + got)
                if n == 0:
                    break
                got += n
            view.release()
            return buf if got == len(buf) else buf[:got]  # no copy: loads read GiBs

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
            files, self._dirty_files = self._dirty_files, set()
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        if (files or dirs) and _syncfs(self.root):
            return
        for path in sorted(files) + sorted(dirs, key=len, reverse=True):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _syncfs(path: str) -> bool:
    """``syncfs(2)`` on the file system holding ``path``; False where unavailable."""
    libc = _libc()
    if libc is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return bool(libc.syncfs(fd) == 0)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages now (``sync_file_range``), without waiting, so the
    disk works while later objects are still being written instead of all at ``sync()``."""
    libc = _libc()
    if libc is not None and hasattr(libc, "sync_file_range"):
        libc.sync_file_range(fd, ctypes.c_longlong(0), ctypes.c_longlong(0),
                             ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc if hasattr(libc, "syncfs") else None
    except OSError:
        return None


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
