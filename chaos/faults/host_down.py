"""``host_down``: an emulated host fails for good, supervisors, spares, torchrun agent and all.

The most common failure of a large job is a whole node (a GPU off the bus, a kernel panic, a
power supply): every process on it goes at once, its torchrun agent too, and it falls silent
rather than closing its connections. Made from outside on the emulated network
(``chaos/infra/netns.py``): the host's switch port goes down, then every process in its
namespace is SIGKILLed. Nobody on it is left to report the deaths; in-process recovery finds
them by their lapsed leases (``trainer/lease.py``) and re-forms on the spares of the other
hosts. The host does not come back during the run.

Refused where it cannot end well: node 0 (it serves the job's stores: torchrun's rendezvous
and the recovery store; its loss ends any torchrun job), restart recovery (torchrun's agents
wait in their rendezvous for the lost host until ``join_timeout``), and too few spares on the
other hosts for the ranks of the lost one.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt

from antifragile.chaos.faults.base import FaultBase, Injection, Target
from antifragile.trainer.placement import first_slots


class HostDown(FaultBase):
    kind: Literal["host_down"]
    node: Annotated[StrictInt, Field(ge=0, description="the emulated host that fails")] = 1

    def check(self, dims: tuple[int, int, int], steps: int, checkpoints: int
              ) -> tuple[str, str] | None:
        if self.mtbf_s is not None:
            return "mtbf_s", ("a host goes down once and does not come back: give at_step, "
                              "at_checkpoint or at_s")
        return super().check(dims, steps, checkpoints)

    def check_nodes(self, nodes: int) -> tuple[str, str] | None:
        if nodes < 2:
            return "node", ("host_down needs trainer.nodes >= 2 (ranks on emulated hosts); "
                            f"the scenario has {nodes} node")
        if self.node == 0:
            return "node", ("node 0 serves the job's stores (torchrun's rendezvous and the "
                            "recovery store): its loss ends any torchrun job; take down "
                            f"node 1..{nodes - 1}")
        if self.node >= nodes:
            return "node", f"node {self.node} is outside the {nodes} nodes (0..{nodes - 1})"
        return None

    def check_trainer(self, trainer: Any) -> tuple[str, str] | None:
        if trainer.recovery != "in_process":
            return "kind", ("host_down needs trainer.recovery: in_process; in restart mode "
                            "torchrun's agents wait in their rendezvous for the lost host to "
                            "come back")
        nodes, world = trainer.nodes, trainer.world_size
        if nodes < 2:
            return None  # check_nodes says why
        per_node = (world + trainer.spare_workers) // nodes
        lost_ranks = sum(1 for slot in first_slots(per_node * nodes, world, per_node)
                         if slot // per_node == self.node)
        spares_elsewhere = trainer.spare_workers // nodes * (nodes - 1)
        if spares_elsewhere < lost_ranks:
            return "node", (f"node {self.node} runs {lost_ranks} rank(s) and the other nodes "
                            f"hold {spares_elsewhere} spare(s): raise trainer.spares to at "
                            f"least {-(-lost_ranks // (nodes - 1)) * nodes}")
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        network = target.network
        if network is None:
            reason = target.network_error or "the run has no emulated network"
            return Injection(self.kind, time.time(), step=step, skipped=reason,
                             detail={"node": self.node})
        if network.is_host_down(self.node):
            return Injection(self.kind, time.time(), step=step, detail={"node": self.node},
                             missed=(f"node {self.node} was already down (an earlier "
                                     "host_down): nothing left on it to fail"))
        down_t = time.time()
        how, killed = network.host_down(self.node)
        ranks = sorted(r for r, pid in target.pids.items() if pid in set(killed))
        detail: dict[str, Any] = {"node": self.node, "mechanism": how, "ranks": ranks,
                                  "processes": len(killed), "lost_node": self.node,
                                  "done_t": time.time()}
        if not ranks:
            return Injection(self.kind, down_t, step=step, detail=detail, missed=(
                f"no rank ran on node {self.node} when it went down (only spares): nothing "
                "to recover"))
        detail["pid"] = target.pids[ranks[0]]
        return Injection(self.kind, down_t, step=step, rank=ranks[0], detail=detail)
