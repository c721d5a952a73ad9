"""What the benchmarks ask of the machine: the page cache dropped, the file system under a path,
the CPU others used meanwhile, this process's memory."""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass


def _write_proc(path: str, text: str) -> bool:
    """Write ``text`` to a /proc control file; False when this process may not."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        return False
    return True


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False when this process may not."""
    os.sync()
    return _write_proc("/proc/sys/vm/drop_caches", "3\n")


def filesystem_type(path: str) -> str:
    """The type of the mount holding ``path`` (``ext4``, ``tmpfs``...), from /proc/mounts."""
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind, *_ = line.split()
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                    best
                ):
                    best, fstype = mount, kind
    except OSError:
        pass
    return fstype


def default_parent() -> str:
    """/var/tmp when it is on a real disk (it usually is), else /tmp."""
    return "/var/tmp" if filesystem_type("/var/tmp") != "tmpfs" else "/tmp"


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Machine-wide busy and steal seconds (/proc/stat) and this process tree's CPU seconds."""

    busy_s: float
    steal_s: float
    own_s: float
    wall_s: float

    @staticmethod
    def now() -> CpuTimes:
        hz = os.sysconf("SC_CLK_TCK")
        try:
            with open("/proc/stat") as f:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                    int, f.readline().split()[1:9]
                )
        except (OSError, ValueError):
            user = nice = system = irq = softirq = steal = 0
        own = sum(
            u.ru_utime + u.ru_stime
            for u in (
                resource.getrusage(resource.RUSAGE_SELF),
                resource.getrusage(resource.RUSAGE_CHILDREN),
            )
        )
        busy = (user + nice + system + irq + softirq) / hz
        return CpuTimes(busy, steal / hz, own, time.monotonic())

    def since(self, start: CpuTimes) -> str:
        """What else used the machine between ``start`` and this snapshot."""
        capacity = (self.wall_s - start.wall_s) * (os.cpu_count() or 1)
        foreign = max(0.0, self.busy_s - start.busy_s - (self.own_s - start.own_s))
        steal = self.steal_s - start.steal_s
        line = (
            f"other processes (incl. kernel writeback) used {foreign:.0f} CPU-s of "
            f"{capacity:.0f} ({100 * foreign / capacity:.0f}%); hypervisor steal "
            f"{100 * steal / capacity:.0f}%"
        )
        if foreign > 0.1 * capacity or steal > 0.05 * capacity:
            line += ": the machine was shared, treat the figures with caution"
        return line


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where not possible."""
    return _write_proc("/proc/self/clear_refs", "5\n")


def peak_rss_bytes() -> int:
    return _proc_status_kib("VmHWM") * 1024


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
