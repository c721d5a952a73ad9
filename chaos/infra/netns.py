"""Emulated hosts for multi-node scenarios: Linux network namespaces joined by a switch.

Topology: one namespace per host (``<prefix>-h<i>``) and one "switch" namespace
(``<prefix>-sw``) holding a bridge. Each host has one veth, ``eth0``, with the private address
``10.213.0.<10+i>/24``; its other end is port ``h<i>`` of the bridge. Nothing is created in
the caller's namespace, so the emulated network can reach nothing but itself, and since every
run gets its own namespaces, fixed addresses and ports never clash between runs.

A host that fails for good (``host_down``): its switch port goes down, then everything in its
namespace is SIGKILLed (:meth:`Network.host_down`).

Cutting the link between hosts ``a`` and ``b`` (``drop_link``):

- with two hosts, the literal reading: both hosts' switch ports are set down (a pulled cable).
  The hosts keep their addresses and routes (the kernel marks them ``linkdown``), so packets
  are silently lost, as on a real cut: TCP peers stall and retransmit rather than get an error.
  Setting the ports up again lets the retransmissions through.
- with more hosts a port down would cut a host off from everyone, not only from its peer, so
  the a<->b path alone is cut with ``blackhole`` routes to each other's address in both
  namespaces (new connections between them fail, established ones stall) and removed again.

Services of the run (the S3 endpoint) reach the hosts on the bridge: the bridge has the address
``10.213.0.1`` in the switch namespace, and :meth:`Network.listen` opens a listening socket
there from this process (a helper thread enters the switch namespace just to create it; sockets
stay in the namespace they were made in). What a host sends to that address crosses its own
link, so cutting a host's link cuts its storage too, as on a real network.

Addresses are ordered so that host 0 sorts first (``10.213.0.10`` < ``.11`` < ... ``.99``):
torch's c10d rendezvous ranks agents by address, so host ``i`` runs agent group rank ``i``.

Cleanup: namespace names carry the creating process's id, start time and pid namespace
(``afnet-<pid>-<start>-p<pidns>-<n>``: pids are recycled, start times are not, and both name
a process only within its pid namespace); closing the :class:`Network` kills what still runs
inside its hosts and deletes the namespaces (veths go with them). :func:`reap_leftovers`
deletes namespaces left by a process that no longer exists (a run killed with SIGKILL), also
one whose pid a later process was given; every new network calls it first. Only names made in
this pid namespace are judged: a container sharing ``/var/run/netns`` cannot see the owner of
a live network outside it, nor the other way round.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from types import TracebackType

from antifragile.chaos.infra.weed import pid_namespace, start_time

IFNAME = "eth0"
SUBNET = "10.213.0"
BRIDGE_ADDRESS = f"{SUBNET}.1"  # the switch's own address: services of the run listen there
MAX_HOSTS = 90  # host i has SUBNET.<10 + i>: two digits each, so that host 0 sorts first
_CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 30
KILL_INSIDE_S = 5.0  # how long a namespace's processes are killed until none is left
_PREFIX = "afnet"
# owner pid, its start time, its pid namespace's inode (each absent from names made before
# it was part of them)
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-(?:(\d+)-)?(?:p(\d+)-)?\d+-(?:sw|h\d+)$")
_counter = itertools.count()


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here (no ``ip``, no CAP_NET_ADMIN); the message says why."""


class NetnsError(Exception):
    """An ``ip`` command failed on a network that exists."""


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True,
                              timeout=IP_TIMEOUT_S)
    except FileNotFoundError:
        raise NetnsUnavailable("the 'ip' command (iproute2) is not installed") from None
    except PermissionError as exc:  # found on PATH, not executable: as good as missing
        raise NetnsUnavailable(f"the 'ip' command (iproute2) cannot be run: {exc}") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"ip {' '.join(args)}: no answer in {IP_TIMEOUT_S} s") from None
    if done.returncode:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they (probably) can."""
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    return None


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str) -> list[int]:
    """SIGKILL every process still in ``namespace`` (all of them were started by this run),
    listing them again until none is left (one may fork as it is killed: a torchrun agent
    starting a worker), for at most ``KILL_INSIDE_S``; returns their pids."""
    killed: list[int] = []
    deadline = time.monotonic() + KILL_INSIDE_S
    while True:
        try:
            pids = [int(p) for p in _ip("netns", "pids", namespace).split()]
        except (NetnsError, NetnsUnavailable):
            return killed
        if not pids or time.monotonic() > deadline:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.02)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    with contextlib.suppress(NetnsError):  # already gone
        _ip("netns", "delete", namespace)


def _pid_namespace_inode() -> str | None:
    """This process's pid namespace's inode (digits), or None where it cannot be read."""
    found = re.fullmatch(r"pid:\[(\d+)\]", pid_namespace() or "")
    return found.group(1) if found else None


def reap_leftovers() -> list[str]:
    """Delete namespaces of ours whose creating process is gone; returns their names. One
    made in another pid namespace is left alone: its owner's pid names nothing here."""
    if unavailable_reason():
        return []
    here = _pid_namespace_inode()
    reaped = []
    for name in _namespaces():
        m = _NAME.match(name)
        if m is None or m.group(3) not in (None, here):
            continue
        pid, started = int(m.group(1)), m.group(2)
        gone = not _pid_alive(pid) if started is None else start_time(pid) != int(started)
        if gone:
            _delete(name)
            reaped.append(name)
    return reaped


@dataclass(frozen=True, slots=True)
class EmulatedHost:
    index: int
    namespace: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host (same filesystem, environment and pid space)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Network:
    """``n_hosts`` emulated hosts on one switch; a context manager that always cleans up."""

    def __init__(self, n_hosts: int) -> None:
        if not 2 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"an emulated network has 2..{MAX_HOSTS} hosts, not {n_hosts}")
        me = os.getpid()
        pidns = _pid_namespace_inode()
        self.prefix = (f"{_PREFIX}-{me}-{start_time(me)}-"
                       f"{'' if pidns is None else f'p{pidns}-'}{next(_counter)}")
        self.switch = f"{self.prefix}-sw"
        self.hosts = [EmulatedHost(i, f"{self.prefix}-h{i}", f"{SUBNET}.{10 + i}")
                      for i in range(n_hosts)]
        self._created: list[str] = []
        self._down: set[tuple[int, int]] = set()
        self._dead: set[int] = set()  # hosts down for good (host_down)

    def __enter__(self) -> Network:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        """Create the namespaces, the bridge and one veth per host; raise NetnsUnavailable
        (after removing anything half made) if this machine does not allow it. Interrupted,
        it removes what it made too."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            reap_leftovers()
            for name in [self.switch, *(h.namespace for h in self.hosts)]:
                # noted first: an interrupt during the command may come after it made the
                # namespace (deleting one that was never made is harmless)
                self._created.append(name)
                _ip("netns", "add", name)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", "br0")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                port = f"h{h.index}"
                _ip("link", "add", IFNAME, "netns", h.namespace, "type", "veth",
                    "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", IFNAME)
                _ip("-n", h.namespace, "link", "set", IFNAME, "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
        except NetnsError as exc:
            self.close()
            raise NetnsUnavailable(str(exc)) from None
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): no caller is left to close it
            self.close()
            raise

    def listen(self, port: int = 0) -> socket.socket:
        """A TCP socket listening on the bridge (``BRIDGE_ADDRESS``), reachable from every
        host; this process serves it (accept() from any thread). Raises NetnsError."""
        if self.switch not in self._created:
            raise NetnsError("the network is not open")
        made: list[socket.socket] = []
        failed: list[BaseException] = []

        def inside() -> None:  # a thread of its own: setns() moves only the calling thread
            try:
                fd = os.open(f"/var/run/netns/{self.switch}", os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns into {self.switch}: {os.strerror(err)}")
                finally:
                    os.close(fd)
                made.append(socket.create_server((BRIDGE_ADDRESS, port)))
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=inside, name="netns-listen")
        thread.start()
        thread.join()
        if failed:
            raise NetnsError(f"cannot listen on {BRIDGE_ADDRESS}:{port} in {self.switch}: "
                             f"{failed[0]}")
        return made[0]

    def close(self) -> None:
        for name in reversed(self._created):
            _delete(name)
        self._created.clear()

    def _pair(self, a: int, b: int) -> tuple[EmulatedHost, EmulatedHost]:
        n = len(self.hosts)
        if a == b or not (0 <= a < n and 0 <= b < n):
            raise ValueError(f"no link between hosts {a} and {b} in a network of {n}")
        return self.hosts[a], self.hosts[b]

    def link_down(self, a: int, b: int) -> str:
        """Cut the a<->b path; returns how, for the report. A cut that fails half made (its
        second ``ip`` command refused or timing out) is undone before the error is raised:
        the fault is then missed, with no end due, so a side left cut would stay cut for the
        rest of the run, a fault the report says did not happen."""
        ha, hb = self._pair(a, b)
        cuts: list[tuple[tuple[str, ...], tuple[str, ...]]]  # (cut, its undo)
        if len(self.hosts) == 2:
            cuts = [(("-n", self.switch, "link", "set", f"h{h.index}", "down"),
                     ("-n", self.switch, "link", "set", f"h{h.index}", "up")) for h in (ha, hb)]
            how = f"switch ports h{a} and h{b} down"
        else:
            cuts = [(("-n", src.namespace, "route", "add", "blackhole", f"{dst.address}/32"),
                     ("-n", src.namespace, "route", "del", "blackhole", f"{dst.address}/32"))
                    for src, dst in ((ha, hb), (hb, ha))]
            how = f"blackhole routes {ha.address} <-> {hb.address}"
        made: list[tuple[str, ...]] = []
        try:
            for cut, undo in cuts:
                _ip(*cut)
                made.append(undo)
        except BaseException:
            for undo in reversed(made):
                with contextlib.suppress(NetnsError, NetnsUnavailable):
                    _ip(*undo)
            raise
        self._down.add((min(a, b), max(a, b)))
        return how

    def link_up(self, a: int, b: int) -> None:
        """End a cut. A host that went down for good meanwhile keeps its switch port down:
        set up, its kernel would answer its peers with resets, no longer silent."""
        ha, hb = self._pair(a, b)
        if len(self.hosts) == 2:
            for h in (ha, hb):
                if h.index not in self._dead:
                    _ip("-n", self.switch, "link", "set", f"h{h.index}", "up")
        else:
            for src, dst in ((ha, hb), (hb, ha)):
                _ip("-n", src.namespace, "route", "del", "blackhole", f"{dst.address}/32")
        self._down.discard((min(a, b), max(a, b)))

    def host_down(self, index: int) -> tuple[str, list[int]]:
        """Host ``index`` fails for good: its switch port goes down first, so that it falls
        silent as a host that loses power (its peers get no reset, their connections stall),
        then every process inside it is SIGKILLed. Returns how, and the pids killed."""
        if not 0 <= index < len(self.hosts):
            raise ValueError(f"no host {index} in a network of {len(self.hosts)}")
        _ip("-n", self.switch, "link", "set", f"h{index}", "down")
        self._dead.add(index)
        return (f"switch port h{index} down, then every process in "
                f"{self.hosts[index].namespace} SIGKILLed"), _kill_inside(
                    self.hosts[index].namespace)

    def is_down(self, a: int, b: int) -> bool:
        return (min(a, b), max(a, b)) in self._down

    def is_host_down(self, index: int) -> bool:
        """Whether host ``index`` went down for good (``host_down``)."""
        return index in self._dead
