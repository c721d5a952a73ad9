"""In-process recovery: survivors re-form the process group with a warm spare, no new processes.

Who plays which trainer rank is a *generation*: ``members[r]`` is the torchrun slot (its RANK)
playing trainer rank ``r``. Generations are numbered job-wide by a counter in the launcher's
store (the torchrun agent's TCPStore, which outlives every worker), so event logs and process
group prefixes never collide, also across torchrun restarts. Every key of one torchrun attempt
lives under ``antifragile/a<restart count>/`` (or ``antifragile/fresh/`` where each
rendezvous round gets a fresh store).

A failure of generation ``g`` (a rank died, its supervisor says so; or a collective failed)
sets ``g<g>/fail``. Every survivor's watcher thread is blocked on that key: it shuts down the
sockets of the generation's gloo process groups (gloo's own ``abort`` does not interrupt a
collective in flight; a closed connection does, on both ends), so a training thread blocked in
any collective gets an error at once. The survivors then register (``g<g>/alive/<slot>``),
wait until every member is either alive or reported dead (``dead/<slot>``), and the lowest
surviving slot coordinates: each dead rank gets a live spare (``spare/<slot>/assign``), and the
new generation is published in ``g<g>/next``. With too few spares it publishes a restart
instead: the survivors exit with ``RESTART_EXIT_CODE`` and torchrun restarts the whole group.

torchrun stays the launcher and its store the rendezvous; nothing here starts processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "antifragile"


@dataclass(frozen=True, slots=True)
class Formation:
    """One generation: its job-wide number and ``members[rank] = slot``."""

    generation: int
    members: tuple[int, ...]


class JobStore:
    """The keys of one torchrun attempt in the launcher's store (not thread-safe: one client
    per thread, as TCPStore clients block each other)."""

    def __init__(self, store: Any, attempt_key: str, *, counter: Any = None) -> None:
        self.raw = store
        self.attempt = dist.PrefixStore(f"{PREFIX}/{attempt_key}", store)
        self.counter = counter if counter is not None else store

    def new_generation(self) -> int:
        """A job-wide, never reused generation number."""
        return int(self.counter.add(f"{PREFIX}/generations", 1)) - 1

    def set(self, key: str, value: Any) -> None:
        self.attempt.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        return json.loads(self.attempt.get(key))

    def has(self, key: str) -> bool:
        return bool(self.attempt.check([key]))

    def wait(self, key: str, timeout_s: float) -> bool:
        """True once ``key`` exists; False after ``timeout_s`` (the store logs a warning on
        every timed-out wait, so callers wait long, and wake each other by setting keys)."""
        try:
            self.attempt.wait([key], timedelta(seconds=timeout_s))
        except (dist.DistStoreError, RuntimeError):
            return self.has(key)
        return True


def first_formation(js: JobStore, slot: int, world_size: int) -> Formation:
    """Generation of a fresh start: slots 0..world-1 play ranks 0..world-1 (slot 0 numbers
    it). Called by every active slot; spares wait for an assignment instead."""
    if slot == 0:
        js.set("first", {"generation": js.new_generation(), "members": list(range(world_size))})
    doc = js.get("first")
    return Formation(int(doc["generation"]), tuple(doc["members"]))


class GlooSockets:
    """The TCP connections a process group formation opened, so that they can be shut down.

    Captured as the difference of this process's connected sockets before and after the
    formation; connections to the stores are never touched (their peer port is excluded).
    """

    def __init__(self, keep_ports: set[int]) -> None:
        self.keep_ports = keep_ports
        self._before: set[int] = set()
        self.fds: set[int] = set()

    @staticmethod
    def _socket_fds() -> set[int]:
        fds = set()
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    fds.add(int(name))
        return fds

    def begin(self) -> None:
        self._before = self._socket_fds()

    def end(self) -> None:
        self.fds = self._socket_fds() - self._before

    def shutdown(self) -> int:
        """Shut down every captured connection (not listeners, not store links); returns how
        many. Thread-safe with respect to the collectives it interrupts."""
        closed = 0
        for fd in sorted(self.fds):
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                peer = sock.getpeername()
                if isinstance(peer, tuple) and peer[1] in self.keep_ports:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
            except OSError:
                pass  # a listener, or already closed
            finally:
                sock.close()
        return closed


class FailureWatch:
    """A thread blocked on ``g<g>/fail``; when it appears, ``on_failure`` runs (it aborts the
    generation's connections). ``fired`` tells the training thread an error was a failure of
    the generation, not a bug of its own."""

    def __init__(self, make_store: Callable[[], JobStore], generation: int,
                 on_failure: Callable[[], None]) -> None:
        self.generation = generation
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._make_store = make_store
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name=f"failure-watch-{generation}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Disarm: a thread still blocked on the key fires nothing when it wakes."""
        self._stop.set()

    def _run(self) -> None:
        js = self._make_store()
        key = f"g{self.generation}/fail"
        while not js.wait(key, 24 * 3600.0):
            pass
        if not self._stop.is_set():
            self.fired.set()
            self._on_failure()


def signal_failure(js: JobStore, generation: int, reason: str) -> None:
    """Tell every member that generation ``generation`` failed."""
    if not js.has(f"g{generation}/fail"):
        js.set(f"g{generation}/fail", {"reason": reason, "t": time.time()})


def recover(js: JobStore, slot: int, failed: Formation, spares: list[int], *,
            timeout_s: float) -> Formation | str:
    """A survivor's part of re-forming: the next formation, or why the job must restart."""
    g = failed.generation
    signal_failure(js, g, f"slot {slot} saw the failure")
    js.set(f"g{g}/alive/{slot}", time.time())
    deadline = time.monotonic() + timeout_s
    alive: list[int] = []
    dead: list[int] = []
    while True:
        alive = [m for m in failed.members if js.has(f"g{g}/alive/{m}")]
        dead = [m for m in failed.members if m not in alive and js.has(f"dead/{m}")]
        if len(alive) + len(dead) == len(failed.members):
            break
        if time.monotonic() > deadline:  # neither alive nor reported dead: treat as lost
            dead = [m for m in failed.members if m not in alive]
            break
        time.sleep(0.002)
    if slot == min(alive):
        _coordinate(js, failed, dead, spares)
    if not js.wait(f"g{g}/next", timeout_s):
        return f"no new generation was published within {timeout_s:.0f} s"
    nxt = js.get(f"g{g}/next")
    if "restart" in nxt:
        return str(nxt["restart"])
    return Formation(int(nxt["generation"]), tuple(nxt["members"]))


def _coordinate(js: JobStore, failed: Formation, dead: list[int], spares: list[int]) -> None:
    """The lowest surviving slot: give each dead rank a live spare, publish the generation."""
    g = failed.generation
    lost = [r for r, m in enumerate(failed.members) if m in dead]
    free = [s for s in spares if not js.has(f"dead/{s}") and not js.has(f"spare/{s}/assign")]
    free.sort(key=lambda s: (not js.has(f"spare/{s}/ready"), s))  # warm ones first
    if len(free) < len(lost):
        js.set(f"g{g}/next", {"restart": f"{len(lost)} rank(s) lost and {len(free)} spare(s) "
                                         "left: torchrun restarts the group"})
        return
    members = list(failed.members)
    for rank, spare in zip(lost, free):
        members[rank] = spare
    nxt = {"generation": js.new_generation(), "members": members,
           "replaced": {str(r): s for r, s in zip(lost, free)}}
    for rank, spare in zip(lost, free):
        js.set(f"spare/{spare}/assign", {**nxt, "rank": rank})
    js.set(f"g{g}/next", nxt)


def wait_for_assignment(js: JobStore, slot: int) -> Formation | None:
    """A warm spare: the generation it joins, or None once the job is done (see
    :func:`finish`)."""
    js.set(f"spare/{slot}/ready", time.time())
    while not js.wait(f"spare/{slot}/assign", 24 * 3600.0):
        pass
    doc = js.get(f"spare/{slot}/assign")
    if doc.get("done"):
        return None
    return Formation(int(doc["generation"]), tuple(doc["members"]))


def finish(js: JobStore, spares: list[int]) -> None:
    """Trainer rank 0 at the end of a successful run: release idle spares and the workers
    of dead slots."""
    for spare in spares:
        if not js.has(f"spare/{spare}/assign"):
            js.set(f"spare/{spare}/assign", {"done": True})
    js.set("done", time.time())


def report_death(js: JobStore, *, slot: int, generation: int, how: str, spare: bool,
                 reform_timeout_s: float, on_restart: int) -> int:
    """The supervisor of a dead child (in-process mode): say so, then wait for the job's fate.
    Returns this worker's exit code: 0 once the job is done without it; ``on_restart`` when
    no new generation forms (torchrun then restarts the group)."""
    js.set(f"dead/{slot}", {"how": how, "generation": generation, "t": time.time()})
    if not spare and generation >= 0:
        signal_failure(js, generation, f"slot {slot} died ({how})")
        if not js.wait(f"g{generation}/next", reform_timeout_s):
            return on_restart
        if "restart" in js.get(f"g{generation}/next"):
            return on_restart
    while not js.wait("done", 24 * 3600.0):
        pass
    return 0
