"""``drop_link``: cut the network between two emulated hosts, restore it after ``duration_s``.

The hosts are network namespaces (``chaos/infra/netns.py``); the cut is made on the emulated
network, outside every process of the job. Nothing in the trainer knows about it: collectives
across the link stall, each rank's watchdog (no progress for 3 x ``hang_timeout_s``) or the
collective timeout ends the ranks, and the agents rendezvous again once the link is back.
Where namespaces cannot be made, the run goes on one host and the fault is reported skipped
with the reason.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Literal

from pydantic import Field, StrictInt

from antifragile.chaos.faults.base import FaultBase, Injection, Seconds, Target

log = logging.getLogger(__name__)


class DropLink(FaultBase):
    kind: Literal["drop_link"]
    between: Annotated[tuple[Annotated[StrictInt, Field(ge=0)],
                             Annotated[StrictInt, Field(ge=0)]],
                       Field(description="the two node indices whose link goes down")] = (0, 1)
    duration_s: Annotated[Seconds, Field(gt=0)] = 15.0

    def check_nodes(self, nodes: int) -> tuple[str, str] | None:
        if nodes < 2:
            return "between", ("drop_link needs trainer.nodes >= 2 (ranks on emulated hosts); "
                               f"the scenario has {nodes} node")
        a, b = self.between
        if a == b:
            return "between", f"a link joins two different nodes, not {a} and {b}"
        if max(a, b) >= nodes:
            return "between", f"node {max(a, b)} is outside the {nodes} nodes (0..{nodes - 1})"
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        network = target.network
        a, b = self.between
        if network is None:
            reason = target.network_error or "the run has no emulated network"
            return Injection(self.kind, time.time(), step=step, skipped=reason,
                             detail={"between": [a, b]})
        if dead := [n for n in (a, b) if network.is_host_down(n)]:
            return Injection(self.kind, time.time(), step=step, detail={"between": [a, b]},
                             missed=f"node {dead[0]} was down for good (host_down) when this "
                                    f"fault was due: the link between nodes {a} and {b} "
                                    "carried nothing left to cut")
        if network.is_down(a, b):  # another fault's cut, not ended yet
            return Injection(self.kind, time.time(), step=step, detail={"between": [a, b]},
                             missed=f"the link between nodes {a} and {b} was already down "
                                    "(another fault's cut) when this fault was due")
        how = network.link_down(a, b)
        injection = Injection(self.kind, time.time(), step=step,
                              detail={"between": [a, b], "duration_s": self.duration_s,
                                      "mechanism": how})

        def restore(on_time: bool) -> None:
            try:
                network.link_up(a, b)
            except Exception as exc:  # the link stays down: the job cannot heal, say why
                if on_time:
                    injection.detail["error"] = f"{type(exc).__name__}: {exc}"
                log.warning("drop_link: the link between nodes %s and %s was not restored: "
                            "%s: %s", a, b, type(exc).__name__, exc)

        target.endings.after(self.duration_s, restore)
        return injection
