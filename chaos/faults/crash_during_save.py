"""``crash_during_save``: SIGKILL a rank while checkpoint n is staged but not yet committed.

The runner fires it when the target rank reports ``ckpt_staged`` for that checkpoint. A small
checkpoint may commit before the signal lands; the injection records whether COMMIT already
existed, so a report never claims a mid-save crash that did not happen.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Literal

from antifragile.chaos.faults.base import FaultBase, Injection, RankTarget, Target


class CrashDuringSave(FaultBase):
    kind: Literal["crash_during_save"]
    rank: RankTarget = 0

    def check(self, dims: tuple[int, int, int], steps: int, checkpoints: int
              ) -> tuple[str, str] | None:
        if self.at_checkpoint is None:
            return "at_checkpoint", "crash_during_save needs at_checkpoint"
        return super().check(dims, steps, checkpoints)

    def inject(self, target: Target, step: int | None) -> Injection:
        from antifragile.engine._paths import COMMIT, step_dir
        from antifragile.engine.storage import open_storage

        rank = target.resolve(self.rank)
        pid = target.pids[rank]
        os.kill(pid, signal.SIGKILL)
        committed = step is not None and open_storage(target.ckpt_url).exists(
            f"{step_dir(step)}/{COMMIT}")
        return Injection(self.kind, time.time(), step=step, rank=rank,
                         detail={"pid": pid, "checkpoint_step": step,
                                 "committed_before_kill": committed})
