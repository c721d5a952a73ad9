"""Process groups that survive restarts: one per generation, on its own store prefix.

torchrun's in-place restart re-runs the workers against the same rendezvous store, and
in-process recovery re-forms the group inside running processes; either way gloo would read
the previous group's keys ("connectFullMesh failed ... Connection refused", or a hang). Every
generation therefore initialises its process group on its own ``PrefixStore``
(``antifragile/g<n>/``), where ``n`` is a job-wide generation number (``trainer.recovery``) that
is also the ``attempt`` of every event.

With several agents (one per host) torch does not agree on ``TORCHELASTIC_RESTART_COUNT``:
an agent restarts its healthy workers when another agent waits in the rendezvous ("membership
changes do not count as retries") and keeps its count. The multi-host launcher therefore sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per rendezvous round, hosted by worker
rank 0) and ``ANTIFRAGILE_ATTEMPT_STORE=<host>:<port>`` (the c10d rendezvous store, which lives
as long as the job): generation numbers come from a counter there. Worker rank 0 is a
supervisor (``trainer.supervisor``); in in-process mode it serves that store itself
(:func:`serve_store`), so that the store outlives every training process of the round.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from antifragile.trainer.abort import GlooSockets, store_link
from antifragile.trainer.recovery import Formation, JobStore


class LaunchError(ValueError):
    """The launch does not fit the configuration: a user's mistake, reported without a
    traceback (``python -m antifragile.trainer`` exits 2)."""


ATTEMPT_STORE_ENV = "ANTIFRAGILE_ATTEMPT_STORE"


def attempt_store() -> str | None:
    """``ANTIFRAGILE_ATTEMPT_STORE`` (``<host>:<port>`` of the job-wide generation counter),
    checked here, where it is read first: it was split only when a training process first
    connected, so a malformed value, or one set where torchrun's agent hosts the store, died
    there with a traceback, which torchrun restarts into the same death."""
    value = os.environ.get(ATTEMPT_STORE_ENV) or None
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise LaunchError(f"{ATTEMPT_STORE_ENV}={value!r}: expected <host>:<port>, a port in "
                          "1..65535 (the store of the job-wide generation counter, which the "
                          "multi-host launcher sets)")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "")
    if "MASTER_ADDR" in os.environ and agent.lower() == "true":
        raise LaunchError(f"{ATTEMPT_STORE_ENV}={value!r} needs a fresh store per attempt, but "
                          f"TORCHELASTIC_USE_AGENT_STORE={agent!r} (torchrun's agent hosts "
                          "one store for every attempt): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                          f"for torchrun, or unset {ATTEMPT_STORE_ENV}")
    return value


@dataclass(slots=True)
class Launch:
    """This worker's place in the torchrun job, and the stores it talks through."""

    slot: int  # torchrun's RANK: which worker process this is
    slots: int  # torchrun's WORLD_SIZE: trainer ranks + spares
    local_rank: int
    local_slots: int  # torchrun's LOCAL_WORLD_SIZE: the slots on this host
    base: Any  # the launcher's store (without torchrun: an in-process HashStore)
    attempt_key: str  # the key namespace of this torchrun attempt
    counter_at: str | None  # host:port of the job-wide generation counter, if not ``base``
    timeout: timedelta
    hosts_store: bool = False  # this process serves ``base`` (slot 0 of a fresh-store round)
    link: dict[int, int] = field(default_factory=dict)  # ``base``'s connection (store_link)
    link_cut: bool = False  # an abort shut that connection down: ``relink`` before its use
    # the process's own hook, before any generation's process group wrapped it (``join``)
    excepthook: Any = field(default_factory=lambda: sys.excepthook)

    def relink(self) -> None:
        """A fresh client of the launcher's store, for the groups to rendezvous through."""
        self.base, self.link = store_link(self.connect, self.store_ports())
        self.link_cut = False

    def job_store(self) -> JobStore:
        """A new client of the launcher's store (one per thread)."""
        return JobStore(self.connect(), self.attempt_key, counter=self._counter())

    def connect(self) -> Any:
        if "MASTER_ADDR" not in os.environ:  # one process without torchrun: its own store
            return self.base
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=self.timeout, wait_for_workers=False)

    def _counter(self) -> Any:
        if self.counter_at is None:
            return None
        host, _, port = self.counter_at.rpartition(":")
        return dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout,
                             wait_for_workers=False)

    def store_ports(self) -> set[int]:
        ports = {int(os.environ["MASTER_PORT"])} if "MASTER_PORT" in os.environ else set()
        if self.counter_at:
            ports.add(int(self.counter_at.rpartition(":")[2]))
        return ports


SERVED_ENV = "ANTIFRAGILE_STORE_SERVED"  # set by slot 0's supervisor: it serves the store


def serve_store(*, recovery: str, collective_timeout_s: float) -> Any:
    """Slot 0's supervisor, before it forks: where the launcher's store is worker 0's to serve
    (no agent store: a multi-host launch) and recovery is in process, serve it here, in the
    process that lives as long as the torchrun round, instead of in slot 0's training process,
    whose death would take the store and with it the re-formation. Returns the server (keep
    it referenced) or None where there is nothing to serve."""
    if (recovery != "in_process" or os.environ.get("RANK") != "0"
            or "MASTER_ADDR" not in os.environ
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"):
        return None
    server = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=True,
                           timeout=timedelta(seconds=collective_timeout_s),
                           wait_for_workers=False)
    os.environ[SERVED_ENV] = "1"  # the training processes it forks connect as clients
    return server


def launch_info(*, collective_timeout_s: float) -> Launch:
    """Read torchrun's environment (also works without torchrun: one slot, a HashStore).
    :class:`LaunchError` where ``ANTIFRAGILE_ATTEMPT_STORE`` does not fit (``attempt_store``)."""
    slot = int(os.environ.get("RANK", 0))
    slots = int(os.environ.get("WORLD_SIZE", 1))
    timeout = timedelta(seconds=collective_timeout_s)
    counter_at = attempt_store()
    base: Any = None
    hosts_store = False
    link: dict[int, int] = {}
    if "MASTER_ADDR" in os.environ:
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        hosts_store = slot == 0 and not agent_hosts_store and SERVED_ENV not in os.environ
        base, link = store_link(lambda: dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), slots,
            is_master=hosts_store, timeout=timeout, wait_for_workers=False),
            {int(os.environ["MASTER_PORT"])})
    else:
        base = dist.HashStore()
    # a fresh store per rendezvous round needs no namespace; the agent's store does
    attempt_key = "fresh" if counter_at else f"a{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    return Launch(slot, slots, int(os.environ.get("LOCAL_RANK", 0)),
                  int(os.environ.get("LOCAL_WORLD_SIZE", slots)), base, attempt_key,
                  counter_at, timeout, hosts_store, link)


@dataclass(slots=True)
class DistContext:
    rank: int  # the trainer rank this process plays in this generation
    world_size: int
    worker: str  # its worker id (trainer.recovery.worker_id)
    generation: int
    device: torch.device
    store: Any  # this generation's store prefix
    sockets: GlooSockets  # the generation's connections, for an abort


def join(launch: Launch, me: str, formation: Formation, sockets: GlooSockets, *,
         device_type: str) -> DistContext:
    """Initialise the default process group of ``formation`` as its member ``me`` (a worker
    id); ``sockets`` (made with ``launch.link``) can abort it, and its rendezvous. Call
    :meth:`GlooSockets.end` once every subgroup (mesh) is built."""
    rank = formation.members.index(me)
    world_size = len(formation.members)
    sockets.begin()
    store = dist.PrefixStore(f"antifragile/g{formation.generation}", launch.base)
    if device_type == "cuda":
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # torch wraps the hook it finds in one that prefixes the rank: the process's own, not the
    # last generation's wrapper, else a survivor's hooks chain one deeper per re-formation
    sys.excepthook = launch.excepthook
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=launch.timeout)
    return DistContext(rank, world_size, me, formation.generation, device, store, sockets)


def leave() -> None:
    """Destroy the default process group and its subgroups (after a failure: their
    connections are already shut down)."""
    if dist.is_initialized():
        dist.destroy_process_group()
