"""Run a scenario: launch the trainer, inject its faults from outside, record what happened.

The runner only watches the trainer's event files and the worker processes; faults are
signals and storage operations done to the job, never code inside it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from antifragile.chaos.faults import FaultBase, Injection, Target
from antifragile.chaos.infra.launch import launch, launch_hosts
from antifragile.chaos.infra.netns import NetnsUnavailable, Network
from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.chaos.infra.s3 import ENDPOINT_VARS, RunStorage
from antifragile.chaos.observe.record import EventTail, RunRecord
from antifragile.chaos.scenario import Scenario


@dataclass(slots=True)
class _Pending:
    fault: FaultBase
    next_t: float | None = None  # for mtbf arrivals


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by torchrun) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _coordinates(s: Scenario) -> dict[int, tuple[int, int, int]]:
    p = s.trainer.parallel
    return {r: (r // (p.pp * p.tp), (r // p.tp) % p.pp, r % p.tp)
            for r in range(p.world_size)}


def run_scenario(s: Scenario, run_dir: Path, ckpt_url: str, *, faults: bool = True,
                 timeout_s: float = 3600.0, storage: RunStorage | None = None,
                 on_event: Callable[[dict[str, Any], list[Injection]], None] | None = None
                 ) -> RunRecord:
    """Run the trainer for ``s`` (with its faults unless ``faults=False``) to the end.
    ``storage``: S3 set up for the run (the trainer's endpoint, the fault proxy). On emulated
    hosts the trainer reaches that endpoint through a relay on the network's bridge."""
    rng = random.Random(s.seed)
    pending = [_Pending(f) for f in (s.faults if faults else [])]
    started = time.time()
    for p in pending:
        if p.fault.mtbf_s:
            p.next_t = started + rng.expovariate(1 / p.fault.mtbf_s)
    max_restarts = 2 * len(pending) + (50 if any(p.next_t for p in pending) else 0)
    hosts = _Hosts.open(s.trainer.nodes)
    relay: FaultProxy | None = None
    agents = _Agents([])
    tail = EventTail(run_dir)
    injections: list[Injection] = []
    pids: dict[int, dict[int, int]] = {}  # attempt -> rank -> pid
    attempt_ends: dict[int, float] = {}
    step = 0
    checkpoints_seen: dict[int, int] = {}  # checkpoint step -> ordinal
    try:
        env = storage.trainer_env if storage else None
        if hosts.network is not None and env and storage and storage.endpoint:
            # emulated hosts reach only the emulated network: S3 is relayed from the bridge
            relay = FaultProxy.in_front_of(env["AWS_ENDPOINT_URL"],
                                           listener=hosts.network.listen())
            env = {**env, **{var: relay.endpoint_url for var in ENDPOINT_VARS}}
        agents.procs = (launch_hosts(s, run_dir, ckpt_url, max_restarts=max_restarts,
                                     network=hosts.network, env=env) if hosts.network
                        else [launch(s, run_dir, ckpt_url, max_restarts=max_restarts, env=env)])
        while agents.running():
            if time.time() - started > timeout_s:
                raise TimeoutError(f"scenario {s.name} ran past {timeout_s:.0f} s")
            for e in tail.poll():
                if e["event"] == "start":
                    pids.setdefault(e["attempt"], {})[e["rank"]] = e["pid"]
                elif e["event"] == "step_end":
                    step = max(step, e["step"]) if e["attempt"] == max(pids, default=0) \
                        else step
                elif e["event"] == "ckpt_staged":
                    checkpoints_seen.setdefault(e["step"], len(checkpoints_seen) + 1)
                if on_event:
                    on_event(e, injections)
                _fire(pending, injections, e, s, pids, ckpt_url, rng, checkpoints_seen,
                      storage, hosts)
            now = time.time()
            for p in pending:
                if p.next_t is not None and now >= p.next_t and pids:
                    current = max(pids)
                    # An arrival while the job is down (restarting) or after its last step
                    # has nothing to hit: it is drawn again rather than fired at dead pids.
                    if (len(pids[current]) == s.trainer.parallel.world_size
                            and step < s.trainer.steps
                            and all(_alive(pid) for pid in pids[current].values())):
                        injections.append(p.fault.inject(_target(s, pids[current], ckpt_url,
                                                                 rng, storage, hosts), step))  # type: ignore[attr-defined]
                    p.next_t = now + rng.expovariate(1 / p.fault.mtbf_s)  # type: ignore[operator]
            for attempt, ranks in pids.items():
                if attempt not in attempt_ends and not any(_alive(pid) for pid in ranks.values()):
                    attempt_ends[attempt] = time.time()
            time.sleep(0.05)
    finally:
        agents.kill()
        if relay is not None:
            relay.close()
        if hosts.network is not None:
            hosts.network.close()
    tail.poll()
    ended = time.time()
    for attempt in pids:
        attempt_ends.setdefault(attempt, ended)
    return RunRecord(agents.returncode, started, ended, tail.events, injections, attempt_ends)


@dataclass(slots=True)
class _Hosts:
    """Where the ranks run: emulated hosts when ``trainer.nodes > 1`` and namespaces can be
    made here; otherwise this machine, with ``error`` saying why not emulated hosts."""

    network: Network | None = None
    error: str | None = None

    @classmethod
    def open(cls, nodes: int) -> _Hosts:
        if nodes < 2:
            return cls()
        network = Network(nodes)
        try:
            network.open()
        except NetnsUnavailable as exc:
            return cls(error=f"network namespaces unavailable: {exc}")
        return cls(network)


class _Agents:
    """The run's torchrun agents (one per host). The run ends when all have exited; one that
    failed leaves the others waiting in the rendezvous, so they get ``grace_s`` to follow."""

    def __init__(self, procs: list[subprocess.Popen[str]], *, grace_s: float = 60.0) -> None:
        self.procs = procs
        self.grace_s = grace_s
        self._failed_t: float | None = None

    def running(self) -> bool:
        codes = [p.poll() for p in self.procs]
        if all(c is not None for c in codes):
            return False
        if any(codes) and self._failed_t is None:
            self._failed_t = time.time()
        if self._failed_t is not None and time.time() - self._failed_t > self.grace_s:
            self.kill()
            return False
        return True

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    @property
    def returncode(self) -> int:
        """0 only if every agent succeeded, else the first failing agent's code."""
        codes = [p.returncode if p.returncode is not None else -9 for p in self.procs]
        return next((c for c in codes if c), 0)


def _target(s: Scenario, pids: dict[int, int], ckpt_url: str, rng: random.Random,
            storage: RunStorage | None = None, hosts: _Hosts | None = None) -> Target:
    return Target(pids=dict(pids), coordinates=_coordinates(s), ckpt_url=ckpt_url, rng=rng,
                  network=hosts.network if hosts else None,
                  network_error=hosts.error if hosts else None,
                  storage_proxy=storage.proxy if storage else None,
                  storage_proxy_unavailable=storage.proxy_unavailable if storage else None,
                  storage_cluster=storage.cluster if storage else None,
                  storage_cluster_unavailable=storage.cluster_unavailable if storage else None)


def _fire(pending: list[_Pending], injections: list[Injection], e: dict[str, Any],
          s: Scenario, pids: dict[int, dict[int, int]], ckpt_url: str, rng: random.Random,
          checkpoints_seen: dict[int, int], storage: RunStorage | None = None,
          hosts: _Hosts | None = None) -> None:
    """Inject every step- or checkpoint-triggered fault whose moment ``e`` marks."""
    attempt = e["attempt"]
    ranks = pids.get(attempt, {})
    if attempt != max(pids, default=0) or len(ranks) < s.trainer.parallel.world_size:
        return
    for p in list(pending):
        f = p.fault
        due = (f.at_step is not None and e["event"] == "step_end" and e["step"] >= f.at_step) \
            or (f.at_checkpoint is not None and e["event"] == "ckpt_staged"
                and checkpoints_seen.get(e["step"]) == f.at_checkpoint)
        if due:
            pending.remove(p)
            injections.append(f.inject(_target(s, ranks, ckpt_url, rng, storage, hosts),  # type: ignore[attr-defined]
                                       e["step"]))
