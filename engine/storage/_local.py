"""A local (POSIX) checkpoint root: direct or vectored writes; ``sync()`` makes them durable.

Writes are not fsynced one by one as they are made: ``sync()`` makes every file written and
every directory changed since the last sync durable, and the protocol calls it before each
record and marker, which is what durability needs. One ``syncfs(2)`` does that in a single
journal commit (150 small arrays: 20 ms, against 65-70 ms for an fsync of each of their 300
files and 450 directories on 8 threads), but it also writes out every other writer's dirty
pages on that file system (a pip install, a data loader's cache, another job): after a 600 MB
write a quickstart save took seconds to commit. So ``syncfs`` is used only while the whole
machine holds little dirty data (``SYNCFS_MAX_DIRTY``, from ``/proc/vmstat``) and the kernel
reports a failed writeback through it (Linux 5.8 on), and each file written is then checked for
a failed writeback that syncfs told another process of (``_lost_write``); otherwise each file
and directory is fsynced, on a few threads at once.

An object whose first part is a page-aligned buffer (a staged shard object, see ``stage``) is
written with O_DIRECT: its aligned prefix goes from that buffer to the device without a copy
into the page cache; the unaligned tail (under 4 KiB) and any further parts are written through
the page cache, on the same file descriptor, after clearing O_DIRECT. Where the file system
refuses O_DIRECT (tmpfs: EINVAL at open or at the first write) every write is buffered from
then on, and ``direct_io`` says so. Durability is unchanged: O_DIRECT bypasses the page cache
but not the device's cache or the file's metadata, which ``sync()`` (or ``durable``) flushes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import logging
import os
import re
import secrets
import shutil
import stat
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import StorageError
from ._base import Late, exists_error, warn_no_atomic_create

log = logging.getLogger("antifragile.engine.storage")

_IOV_MAX = 1024
ALIGN_BYTES = 4096  # O_DIRECT alignment of buffer address, file offset and length
DIRECT_MIN_BYTES = 1 << 20  # smaller objects gain nothing from bypassing the page cache
_MAX_WRITE = 1 << 30  # one write(2) moves at most ~2 GiB; stay well under, aligned
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FSYNC_THREADS = 8
SYNCFS_MAX_DIRTY = 64 << 20  # dirty page cache (whole machine) under which sync() uses syncfs
WRITEBACK_MIN_BYTES = 1 << 20  # buffered bytes of a file worth starting its writeback early
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS})
_FOLDERS_MAX = 1 << 16  # folders remembered as made (a save makes one per array)


def _writer() -> tuple[int, int]:
    """The writing process and thread, in a temporary file's name (beside the storage's own
    token: processes on two hosts may have the same pid and thread id)."""
    return os.getpid(), threading.get_ident()


class LocalStorage:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._dirty_dirs: set[str] = set()
        self._dirty_files: set[str] = set()
        self._folders: set[str] = set()  # made or found since: no lookup per object written
        self._lock = threading.Lock()
        # one sync at a time: the coordinator's retention syncs beside the next save, and a
        # save's sync may return only once the files it wrote are durable, whoever took them
        self._sync_lock = threading.Lock()
        # paths whose fsync failed, put back to be reported by the sync that takes them next
        self._lost: dict[str, str] = {}
        # None until the first direct write was tried; then whether the file system takes it
        self.direct_io: bool | None = None if _O_DIRECT else False
        self.direct_bytes = 0  # bytes written with O_DIRECT
        self.buffered_bytes = 0  # bytes written through the page cache
        # None until the first ``create``; then whether the file system takes hard links
        self.hard_links: bool | None = None
        # in each temporary file's name beside pid and thread: two hosts sharing the folder
        # may run processes numbered alike (containers), and must never share a temporary
        self._token = secrets.token_hex(4)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def _makedirs(self, path: str) -> None:
        """Make folder ``path`` and what it lacks above it: one ``mkdir`` where the parent
        exists (an array's folder in its step's), no lookups; remembered once made or found."""
        if path in self._folders:
            return
        try:
            os.mkdir(path)
            made = True
        except FileExistsError:
            made = False
        except FileNotFoundError:  # the parent is missing (gone, if it was remembered)
            self._forget_folders(os.path.dirname(path))
            self._makedirs(os.path.dirname(path))
            made = True
            try:
                os.mkdir(path)
            except FileExistsError:  # another thread's, since
                made = False
        with self._lock:
            if made:
                self._dirty_dirs.add(os.path.dirname(path))
            if len(self._folders) >= _FOLDERS_MAX:
                self._folders.clear()
            self._folders.add(path)

    def _forget_folders(self, path: str) -> None:
        """Folders at or under ``path`` are no longer known to exist."""
        with self._lock:
            self._folders = {f for f in self._folders
                             if f != path and not f.startswith(path + os.sep)}

    def _create(self, path: str, flags: int) -> int:
        """Open a new file; its folder, removed since it was made (by another process: its
        retention, an operator), is made again."""
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:
            self._forget_folders(os.path.dirname(path))
            self._makedirs(os.path.dirname(path))
            return os.open(path, flags, 0o644)

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        self._put(key, parts, durable=durable, late=late, exclusive=False)

    def create(self, key: str, parts: Sequence[Any]) -> None:
        """Write ``parts`` as a new object, durably, only if ``key`` holds none (else
        ObjectExistsError, the file there untouched): the temporary file is written and
        fsynced as a durable ``write``'s, then published with ``link(2)``, which fails with
        EEXIST where the name is taken (a rename replaces it), and removed. On a file system
        without hard links (EPERM, EOPNOTSUPP: some FUSE, SMB, vfat) it looks, then renames,
        and says so once: two creates racing there may both succeed."""
        self._put(key, parts, durable=True, late=None, exclusive=True)

    def _put(self, key: str, parts: Sequence[Any], *, durable: bool, late: Late | None,
             exclusive: bool) -> None:
        path = self._path(key)
        self._makedirs(os.path.dirname(path))
        # a kill never tears `path`
        pid, thread = _writer()
        tmp = f"{path}.{pid}-{self._token}-{thread}.tmp"
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if len(v)]
        direct = (self.direct_io is not False and not durable and bool(views)
                  and len(views[0]) >= DIRECT_MIN_BYTES and _address(views[0]) % ALIGN_BYTES == 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = -1
        if direct:
            try:
                fd = self._create(tmp, flags | _O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._no_direct(exc)
                direct = False
        if fd < 0:
            fd = self._create(tmp, flags)
        first = views[0] if views else memoryview(b"")
        done = 0
        try:
            try:
                if direct:
                    head = len(views[0]) // ALIGN_BYTES * ALIGN_BYTES
                    done = self._write_direct(fd, views[0][:head])
                    _set_direct(fd, False)
                    views[0] = views[0][done:]
                    views = [v for v in views if len(v)]
                buffered = self._writev(fd, views)
                if late is not None:
                    self._rewrite(fd, first, late(), done)
                if durable:  # a marker: never visible before its bytes are (power loss)
                    os.fsync(fd)
                elif buffered >= WRITEBACK_MIN_BYTES:
                    _start_writeback(fd)
            finally:
                os.close(fd)
            if exclusive:
                self._publish_new(key, tmp, path)
            else:
                os.replace(tmp, path)
        except BaseException:  # a failed write leaves nothing behind (a full disk's space)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))
            self._dirty_files.add(path)

    def _publish_new(self, key: str, tmp: str, path: str) -> None:
        """Give the written ``tmp`` the name ``path`` unless that is taken (``create``)."""
        if self.hard_links is not False:
            try:
                os.link(tmp, path)
                linked = True
            except FileExistsError:
                # NFS: a LINK whose answer was lost is sent again, and the server answers the
                # resend EEXIST although the first made the link (open(2)): then the name
                # is this temporary file, and the create succeeded
                if not _same_file(tmp, path):
                    raise exists_error(self, key) from None
                linked = True
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                with self._lock:
                    if self.hard_links is None:
                        warn_no_atomic_create(self.root, "the file system refuses hard links",
                                              exc)
                    self.hard_links = False
                linked = False
            if linked:
                self.hard_links = True
                os.unlink(tmp)
                return
        if self.exists(key):
            raise exists_error(self, key)
        os.replace(tmp, path)

    def _write_direct(self, fd: int, view: memoryview) -> int:
        """Write the aligned ``view`` with O_DIRECT; returns the bytes written (0 when the file
        system refused the first write: the caller writes everything buffered)."""
        done = 0
        while done < len(view):
            try:
                n = os.write(fd, view[done:done + _MAX_WRITE])
            except OSError as exc:
                if exc.errno != errno.EINVAL or done:
                    raise
                self._no_direct(exc)
                return 0
            done += n
            if n <= 0 or n % ALIGN_BYTES:  # a short write that broke alignment: go buffered
                break
        with self._lock:
            self.direct_io = True
            self.direct_bytes += done
        return done

    def _rewrite(self, fd: int, first: memoryview, ranges: Sequence[tuple[int, int]],
                 direct_end: int) -> None:
        """Write ``ranges`` of the first part again, as they are now, through the page cache
        (``sync()`` flushes them): below ``direct_end`` (what went with O_DIRECT, not in the
        cache) the whole pages around them, since part of a page would be read from the device
        first. Not with O_DIRECT: each such write waited behind the disk's queue of the other
        writers' large requests, a page per chunk one after the other, and held its thread
        for up to 0.8 s of a 1 s save of 2 GiB."""
        direct_end -= direct_end % ALIGN_BYTES
        for start, end in sorted(ranges):
            if start < direct_end:
                start -= start % ALIGN_BYTES
                if end <= direct_end:
                    end = -(-end // ALIGN_BYTES) * ALIGN_BYTES
            _pwrite_all(fd, first[start:end], start)

    def _writev(self, fd: int, views: list[memoryview]) -> int:
        nbytes = sum(map(len, views))
        while views:
            batch = views[:_IOV_MAX]
            written = os.writev(fd, batch)
            if written <= 0 and any(map(len, batch)):
                raise OSError(errno.EIO, f"writev wrote nothing of {sum(map(len, batch))} bytes")
            views = views[len(batch):] if written == sum(map(len, batch)) else (
                _advance(batch, written) + views[len(batch):])
        with self._lock:
            self.buffered_bytes += nbytes
        return nbytes

    def _no_direct(self, exc: OSError) -> None:
        with self._lock:
            if self.direct_io is None:
                log.info("%s: the file system refuses O_DIRECT (%s); writing through the page "
                         "cache", self.root, exc)
            self.direct_io = False

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

    def read_into(self, key: str, start: int, buffers: Sequence[Any]) -> int:
        """Scatter-read from ``start`` into ``buffers`` (``preadv``, looped: one call moves at
        most ~2 GiB and 1024 buffers); returns the bytes read (fewer at the end of file)."""
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
        got = 0
        with open(self._path(key), "rb", buffering=0) as f:
            while views:
                batch = views[:_IOV_MAX]
                n = os.preadv(f.fileno(), batch, start + got)
                if n == 0:
                    break
                got += n
                views = views[len(batch):] if n == sum(map(len, batch)) else (
                    _advance(batch, n) + views[len(batch):])
        return got

    def size(self, key: str) -> int:
        return os.stat(self._path(key)).st_size

    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object. Only "no such file" is "no": ``os.path.isfile`` also
        says False when the look-up fails (EIO, NFS's ESTALE), and retention then took a
        committed step whose COMMIT it could not stat for uncommitted debris and deleted it.
        Any other error is raised (and retried, like an object store's failed HEAD)."""
        try:
            return stat.S_ISREG(os.stat(self._path(key)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

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

    def delete_link(self, prefix: str) -> bool:
        """Remove ``prefix`` if it is a symbolic link (a step an operator moved to another
        disk): the link is the step's entry in this root, what it points to is not this
        root's and is left whole. Whether it was a link (retention's ``retain`` asks)."""
        path = self._path(prefix)
        if not os.path.islink(path):
            return False
        self._forget_folders(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(path))
        return True

    def delete_tree(self, prefix: str) -> bool:
        path = self._path(prefix)
        existed = os.path.lexists(path)
        self._forget_folders(path)
        if existed and (os.path.islink(path) or not os.path.isdir(path)):
            # not a tree (a stray file or link under a step's name): left as it is. A link to
            # a folder too: rmtree refuses it with an errno-less OSError, retried as transient
            return True
        try:  # what is gone already is fine (another deleter); any other failure is raised
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=_raise_unless_gone)
            else:
                shutil.rmtree(path, onerror=lambda fn, p, info: _raise_unless_gone(fn, p, info[1]))
        finally:
            with self._lock:
                self._dirty_dirs.add(os.path.dirname(path))
        return existed

    def sync(self) -> None:
        """Make every write and deletion before this call durable. A path whose fsync failed
        fails the next sync that takes it too (an fsync failure in the retention's sync, which
        took the next save's files, fails that save's sync), and is not flushed again: the
        kernel reports a lost write once, so a second fsync would pass over it. A save whose own
        sync failed reports them again at its error record's sync, which takes them, so the
        next save starts clean (on an ext4 whose thin-provisioned device ran out of space, the
        first save after the space came back committed)."""
        with self._sync_lock:
            with self._lock:
                files, self._dirty_files = self._dirty_files, set()
                dirs, self._dirty_dirs = self._dirty_dirs, set()
                lost = {p: self._lost.pop(p) for p in [*files, *dirs] if p in self._lost}
            lost = {p: e for p, e in lost.items() if os.path.lexists(p)}  # not deleted since
            if lost:  # the other paths it took are still to flush (another save's objects)
                with self._lock:
                    self._dirty_files |= files - lost.keys()
                    self._dirty_dirs |= dirs - lost.keys()
                path, error = next(iter(lost.items()))
                raise StorageError(f"{len(lost)} path(s) written before this sync failed an "
                                   f"earlier fsync, {path} among them: {error}")
            paths = [*files, *dirs]
            try:
                if len(paths) <= 2:  # a marker and its folder: fsync them, no journal flush
                    for path in paths:
                        _fsync(path)
                elif _dirty_bytes() <= SYNCFS_MAX_DIRTY and _syncfs(self.root):
                    for path in files:  # syncfs told only the first to look (see _lost_write)
                        _lost_write(path)
                else:
                    list(_fsync_pool().map(_fsync, paths))  # raises the first failure
            except BaseException as exc:  # a retry flushes them again, not an empty set
                with self._lock:
                    self._dirty_files |= files
                    self._dirty_dirs |= dirs
                    if isinstance(exc, StorageError):  # an fsync failed: reported, not retried
                        self._lost.update(dict.fromkeys(paths, str(exc)))
                raise


def _raise_unless_gone(func: Any, path: str, exc: BaseException) -> None:
    """``shutil.rmtree``'s error handler: a path deleted meanwhile is fine, else raise."""
    if not isinstance(exc, FileNotFoundError):
        raise exc


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (False where either is gone)."""
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return False


def _address(view: memoryview) -> int:
    """The address of a buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _set_direct(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))


def _dirty_bytes() -> int:
    """Dirty and under-writeback page cache of the whole machine (``/proc/vmstat``); a huge
    number where it cannot be read (then nothing relies on ``syncfs`` being cheap)."""
    try:
        with open("/proc/vmstat", "rb") as f:
            pages = sum(int(line.split()[1]) for line in f
                        if line.startswith((b"nr_dirty ", b"nr_writeback ")))
    except (OSError, ValueError, IndexError):
        return 1 << 62
    return pages * os.sysconf("SC_PAGE_SIZE")


def _syncfs(path: str) -> bool:
    """``syncfs(2)`` on the file system holding ``path``; False where unavailable, and before
    Linux 5.8, where it returned 0 although a file's writeback had failed (an fsync of each
    file reports that on every kernel)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "syncfs") or _kernel_release() < (5, 8):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return bool(libc.syncfs(fd) == 0)
    finally:
        os.close(fd)


def _kernel_release() -> tuple[int, int]:
    """The running Linux kernel's major and minor version; (0, 0) where it cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _fsync(path: str) -> None:
    """fsync a file or directory; one deleted since it was written needs nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # the kernel reports a lost write once: a second fsync passes
        if exc.errno == errno.EINVAL and stat.S_ISDIR(os.fstat(fd).st_mode):
            return  # a file system without fsync for folders: nothing makes them durable
        raise StorageError(f"fsync {path}: {exc}; what was written there may not be on "
                           "disk") from exc
    finally:
        os.close(fd)


def _lost_write(path: str) -> None:
    """Raise where the writeback of file ``path`` failed and no one has been told yet. A
    ``syncfs`` that returned 0 does not say that: it reports a failed writeback on its file
    system once, to the first look after it, and ranks on one node share that file system, so
    another rank's ``syncfs``, which also wrote out this rank's files, may have taken it. Each
    file keeps its own error until a wait on it reports it: ``sync_file_range`` waiting on the
    file, which (unlike an fsync) commits no journal and flushes no device cache, as syncfs
    left nothing to write."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # deleted since it was written
        return
    try:
        libc = _libc()
        flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
        if libc is not None and libc.sync_file_range(fd, ctypes.c_longlong(0),
                                                     ctypes.c_longlong(0), ctypes.c_uint(flags)):
            code = ctypes.get_errno()
            raise StorageError(f"writeback of {path} failed: {OSError(code, os.strerror(code))}"
                               "; what was written there may not be on disk")
    finally:
        os.close(fd)


_pools: dict[int, ThreadPoolExecutor] = {}


def _fsync_pool() -> ThreadPoolExecutor:
    """This process's fsync threads (a forked child has none of its parent's threads)."""
    pool = _pools.get(os.getpid())
    if pool is None:  # setdefault is atomic: two first callers share one pool (no lock to fork)
        pool = _pools.setdefault(os.getpid(), ThreadPoolExecutor(
            _FSYNC_THREADS, thread_name_prefix="antifragile-fsync"))
    return pool


_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages now (``sync_file_range``), without waiting, so the
    disk works while later objects are still being written instead of all at ``sync()``. Only
    for a file with ``WRITEBACK_MIN_BYTES`` in the page cache: for the hundreds of small
    objects of a small state the call was 13% of the writer threads' time, and one ``sync()``
    flushes them together anyway."""
    libc = _libc()
    if libc is not None:
        libc.sync_file_range(fd, ctypes.c_longlong(0), ctypes.c_longlong(0),
                             ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc if hasattr(libc, "sync_file_range") else None
    except OSError:
        return None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset``: one call may write less than asked."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
        done += n


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
