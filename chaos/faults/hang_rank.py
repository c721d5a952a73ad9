"""``hang_rank``: SIGSTOP a rank, SIGCONT it after ``duration_s`` if it is still alive."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Annotated, Literal

from pydantic import Field

from antifragile.chaos.faults.base import FaultBase, Injection, RankTarget, Target


class HangRank(FaultBase):
    kind: Literal["hang_rank"]
    rank: RankTarget = "random"
    duration_s: Annotated[float, Field(gt=0)] = 30.0

    def inject(self, target: Target, step: int | None) -> Injection:
        rank = target.resolve(self.rank)
        pid = target.pids[rank]
        os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        timer = threading.Timer(self.duration_s, resume)
        timer.daemon = True
        timer.start()
        return Injection(self.kind, time.time(), step=step, rank=rank,
                         detail={"pid": pid, "duration_s": self.duration_s})
