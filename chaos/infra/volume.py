"""A small file system of the run's own for its checkpoints, which ``disk_full`` fills.

``disk_full`` must fill the file system the checkpoints are on, and only that one: never the
machine's disk. So with such a fault ``chaos run`` mounts a tmpfs of the fault's ``volume_mib``
at ``<out>/volume`` (root only: mount(2) needs CAP_SYS_ADMIN), the checkpoints go to
``<out>/volume/ckpt``, and the tmpfs is unmounted when the run ends. A tmpfs takes no
O_DIRECT: the engine writes through the page cache there.

Its source names its owner (``antifragile-disk-full-<pid>-<start time>``): one left mounted by
a chaos that was SIGKILLed is unmounted by the next ``disk_full`` run, whatever its ``--out``
(:func:`reap_leftovers`; the owner's pid and start time no longer match). Only such a tmpfs is
ever unmounted: a file system mounted at ``<out>/volume`` by anyone else is left alone and the
fault is skipped.

The fill is done from outside the trainer, like another job filling a shared disk: a thread of
chaos grows one file (``fallocate``) over the free space and keeps taking what is freed (the
engine's retention deleting old steps) until the fault ends, then deletes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from antifragile.chaos.infra.weed import start_time

FILL_PERIOD_S = 0.05  # how soon the fill takes space that was freed


@dataclass(slots=True)
class Volume:
    path: Path  # the mount point; the checkpoints are in its ``ckpt`` folder
    size_bytes: int

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


_SOURCE = re.compile(r"^antifragile-disk-full-(\d+)-(\d+)$")  # owner pid, its start time


def _mounts() -> list[tuple[str, str]]:
    """(mount point, source) of every file system mounted here, in mount order."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        fields = [line.split() for line in f]
    return [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4]),
             f[f.index("-") + 2]) for f in fields]


def reap_leftovers() -> list[str]:
    """Unmount the volumes of chaos processes that are gone; returns their mount points."""
    reaped = []
    for point, source in _mounts():
        owner = _SOURCE.match(source)
        if owner and start_time(int(owner.group(1))) != int(owner.group(2)):
            _umount(Path(point))
            reaped.append(point)
    return reaped


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def checkpoint_volume(path: Path, size_mib: int) -> Iterator[Volume | str]:
    """A tmpfs of ``size_mib`` at ``path`` for the whole block, or why there can be none."""
    if os.geteuid() != 0:
        yield "disk_full mounts a small file system for the checkpoints, which needs root"
        return
    reap_leftovers()
    if os.path.ismount(path):  # --out is any folder: what is mounted there is not this run's
        yield (f"{path} is a mount point not made by this chaos run: give disk_full a fresh "
               "--out folder")
        return
    me = os.getpid()
    source = f"antifragile-disk-full-{me}-{start_time(me)}"
    try:
        try:
            path.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", source,
                                   str(path)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:  # a file in the way, no mount(8)
            yield f"cannot mount a tmpfs at {path}: {exc}"
            return
        if done.returncode != 0:
            yield f"mount -t tmpfs failed: {(done.stderr or done.stdout).strip()}"
            return
        yield Volume(path, size_mib << 20)
    finally:  # also when interrupted as mount(8) ran, or after it timed out: if it was made
        if (os.path.realpath(path), source) in _mounts():
            _umount(path)


class Fill:
    """One file that takes a volume's free space until :meth:`stop`; ``filled_bytes``: its
    size, ``error``: why it could not grow, if it never could; ``full_t``: when its first
    take ended (the disk full, unless ``error``), seconds a large volume after it began."""

    def __init__(self, volume: Volume) -> None:
        self.volume = volume
        # a file of its own: two fills at once (overlapping faults) must not share one
        self._fd, name = tempfile.mkstemp(prefix="disk_full.", suffix=".fill", dir=volume.path)
        self.file = Path(name)
        self.filled_bytes = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._take()
        self.full_t = time.time()
        self._thread = threading.Thread(target=self._keep, name="disk-full", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        free = self.volume.free_bytes()
        while free > 0:
            try:
                os.posix_fallocate(self._fd, self.filled_bytes, free)
                self.filled_bytes += free
                self.error = None
                return
            except OSError as exc:  # a writer took some meanwhile: take less
                self.error = None if self.filled_bytes else f"fallocate: {exc}"
                free //= 2

    def _keep(self) -> None:
        while not self._stop.wait(FILL_PERIOD_S):
            self._take()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file)
