"""Process-group start-up that survives in-place restarts, and a heartbeat that finds hangs.

torchrun's in-place restart (``--max-restarts``) re-runs the workers against the same
rendezvous store; gloo then reads the previous attempt's keys and fails with "connectFullMesh
failed ... Connection refused" or hangs. Every attempt therefore initialises its process group
on its own ``PrefixStore`` (``attempt<n>/``), and ``n`` is also the attempt in the event log.

With one agent, ``n`` is ``TORCHELASTIC_RESTART_COUNT``. With several agents (one per host)
that count is not agreed: torch's elastic agent (``SimpleElasticAgent._invoke_run``) takes a
restart off its budget only when its own workers failed; an agent whose workers were still
healthy restarts them because another agent is waiting in the rendezvous ("membership
changes do not count as retries") and keeps its count. After a kill on host 1, host 1's
workers get count 1 and host 0's may get 0 - the two halves would wait on different prefixes.
The multi-host launcher therefore sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each
rendezvous round gets a fresh store, hosted by worker rank 0 on a new port, so no keys are
stale) and ``ANTIFRAGILE_ATTEMPT_STORE=<host>:<port>`` (the c10d rendezvous store, which lives
as long as the job): rank 0 takes the next number from a counter there and publishes it in
the fresh store, where every other rank reads it. Numbers are consecutive, one per attempt
whose rank 0 got that far.

Hangs: a stopped rank (SIGSTOP, a wedged driver) blocks its peers inside a collective until the
backend's timeout. The heartbeat thread of every rank bumps a counter in the store; each rank
watches its peers' counters, and if one stops moving for ``hang_timeout_s`` it logs the silent
rank(s) and exits the process, so the launcher tears the group down and restarts it in seconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HANG_EXIT_CODE = 43


@dataclass(slots=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    attempt: int
    device: torch.device
    store: dist.Store


def init_distributed(*, device_type: str, collective_timeout_s: float) -> DistContext:
    """Initialise the default process group for this attempt (also without torchrun)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    timeout = timedelta(seconds=collective_timeout_s)
    if "MASTER_ADDR" in os.environ:
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        base: dist.Store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
            is_master=rank == 0 and not agent_hosts_store, timeout=timeout,
            wait_for_workers=False)
        if os.environ.get("ANTIFRAGILE_ATTEMPT_STORE"):
            if agent_hosts_store:
                raise RuntimeError("ANTIFRAGILE_ATTEMPT_STORE needs a fresh store per attempt: "
                                   "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun")
            attempt = _agreed_attempt(base, rank, os.environ["ANTIFRAGILE_ATTEMPT_STORE"],
                                      timeout)
    else:
        base = dist.HashStore()
    store = dist.PrefixStore(f"antifragile/attempt{attempt}", base)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return DistContext(rank, world_size, local_rank, attempt, device, store)


def _agreed_attempt(fresh: dist.Store, rank: int, counter_at: str, timeout: timedelta) -> int:
    """The attempt number every rank of this attempt agrees on (see the module docstring).

    ``fresh`` must be this attempt's own store (nothing from an earlier attempt in it)."""
    key = "antifragile/attempt_number"
    if rank == 0:
        host, _, port = counter_at.rpartition(":")
        counter = dist.TCPStore(host, int(port), is_master=False, timeout=timeout,
                                wait_for_workers=False)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        number = counter.add(f"antifragile/{run_id}/attempts", 1) - 1
        fresh.set(key, str(number))
        return number
    return int(fresh.get(key))


class Heartbeat:
    """Bumps this rank's counter every ``interval_s``; fires ``on_hang(silent_ranks)`` when a
    watched peer's counter has not moved for ``hang_timeout_s``.

    Counters, not timestamps: staleness is judged on the watcher's own monotonic clock, so
    clock skew between hosts does not matter. Up to 64 ranks every rank watches all peers;
    beyond that, its two ring neighbours (the teardown then takes the rest down).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, interval_s: float,
                 hang_timeout_s: float, on_hang: Callable[[list[int]], None]) -> None:
        self._store = dist.PrefixStore("heartbeat", store)
        self.rank = rank
        self.interval_s = interval_s
        self.hang_timeout_s = hang_timeout_s
        self.on_hang = on_hang
        if world_size <= 64:
            self.peers = [r for r in range(world_size) if r != rank]
        else:
            self.peers = sorted({(rank - 1) % world_size, (rank + 1) % world_size})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._store.add(str(self.rank), 1)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last: dict[int, tuple[int, float]] = {}
        started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._store.add(str(self.rank), 1)
                silent = []
                for peer in self.peers:
                    count = self._store.add(str(peer), 0)
                    seen = last.get(peer)
                    if seen is None or seen[0] != count:
                        last[peer] = (count, now)
                    elif now - seen[1] > self.hang_timeout_s:
                        silent.append(peer)
                    if count == 0 and now - started > self.hang_timeout_s:
                        silent.append(peer)  # never started beating
            except Exception as exc:  # the store went away: the launcher is tearing down
                print(f"[rank {self.rank}] heartbeat store unavailable: {exc}", file=sys.stderr)
                return
            if silent:
                self.on_hang(sorted(set(silent)))
                return
