"""``kill_rank``: SIGKILL to one rank's worker process (a crashed host, an OOM kill)."""

from __future__ import annotations

import os
import signal
import time
from typing import Literal

from antifragile.chaos.faults.base import FaultBase, Injection, RankTarget, Target


class KillRank(FaultBase):
    kind: Literal["kill_rank"]
    rank: RankTarget = "random"

    def inject(self, target: Target, step: int | None) -> Injection:
        rank = target.resolve(self.rank)
        pid = target.pids[rank]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # a random arrival can land as the attempt ends or dies
            return Injection(self.kind, time.time(), step=step, rank=rank,
                             missed=f"rank {rank} (pid {pid}) had already exited",
                             detail={"pid": pid})
        return Injection(self.kind, time.time(), step=step, rank=rank, detail={"pid": pid})
