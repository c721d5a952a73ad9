"""``kill_rank``: SIGKILL to one rank's worker process (a crashed host, an OOM kill)."""

from __future__ import annotations

import signal
import time
from typing import Literal

from antifragile.chaos.faults.base import FaultBase, Injection, RankTarget, Target


class KillRank(FaultBase):
    kind: Literal["kill_rank"]
    rank: RankTarget = "random"

    def inject(self, target: Target, step: int | None) -> Injection:
        rank = target.resolve(self.rank)
        # a random arrival can land as the attempt ends, or another fault killed the rank
        sent_t = time.time()
        missed = target.signal(rank, signal.SIGKILL)
        return Injection(self.kind, sent_t, step=step, rank=rank, missed=missed,
                         detail={"pid": target.pids[rank], "done_t": time.time()})
