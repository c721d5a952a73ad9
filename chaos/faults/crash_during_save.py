"""``crash_during_save``: SIGKILL a rank while checkpoint n is being saved, at a named phase.

The trainer learns only where to hold: its save of that step pauses at ``phase`` on the target
rank (a pause point on the save's own thread; ``engine`` phase hooks, which the peer engines,
``dcp`` and ``torchsnapshot``, lack: with them only ``staged`` is a phase): ``persisting``
(staged, nothing written), ``written`` (its objects durable, no record), ``recorded`` (its
record written), ``committing`` (the coordinator has every record, COMMIT not written; use
rank 0). The runner kills the rank there, so the crash lands mid-save by construction.
``staged`` holds the training thread right after staging instead: the save's thread runs on,
so a small checkpoint may commit first. The injection records whether the step had committed
(COMMIT, or a peer engine's marker), so a report never claims a mid-save crash that did not
happen.
"""

from __future__ import annotations

import signal
import time
from typing import Literal

from antifragile.chaos.faults.base import (
    Coordinates,
    FaultBase,
    Injection,
    RankTarget,
    Target,
)


class CrashDuringSave(FaultBase):
    kind: Literal["crash_during_save"]
    rank: RankTarget = 0
    phase: Literal["staged", "persisting", "written", "recorded", "committing"] = "persisting"

    def check(self, dims: tuple[int, int, int], steps: int, checkpoints: int
              ) -> tuple[str, str] | None:
        if self.at_checkpoint is None:
            return "at_checkpoint", "crash_during_save needs at_checkpoint"
        if self.phase == "committing" and self.rank not in (0, Coordinates()):
            return "phase", ("only the coordinator (rank 0) commits: phase committing needs "
                             "rank: 0")
        return super().check(dims, steps, checkpoints)

    def check_checkpoints(self, every_steps: int, steps: int) -> tuple[str, str] | None:
        """The last step's save may be crashed while it is made (the job restores the
        checkpoint before it and trains the last steps again), but not at ``staged``: the
        loop holds there after that blocking save committed."""
        problem = super().check_checkpoints(every_steps, steps)
        if problem is not None and self.phase == "staged":
            return problem[0], f"{problem[1]} (or a save phase before staged)"
        return None

    def check_engine(self, engine: str) -> tuple[str, str] | None:
        if engine != "antifragile" and self.phase != "staged":
            return "phase", (f"{self.phase} is a save phase of engine antifragile (its phase "
                             f"hooks); engine {engine} has none, so the save never pauses "
                             "there: use phase staged, or engine antifragile")
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        rank = target.resolve(self.rank)
        pid = target.pids[rank]
        sent_t = time.time()
        missed = target.signal(rank, signal.SIGKILL)
        done_t = time.time()
        if missed:
            return Injection(self.kind, time.time(), step=step, rank=rank, missed=missed,
                             detail={"pid": pid, "checkpoint_step": step, "phase": self.phase})
        committed = step is not None and _committed(target.ckpt_engine, target.ckpt_url, step)
        return Injection(self.kind, sent_t, step=step, rank=rank,
                         detail={"pid": pid, "checkpoint_step": step, "phase": self.phase,
                                 "committed_before_kill": committed, "done_t": done_t})


def _committed(engine: str, url: str, step: int) -> bool:
    """Whether ``engine``'s save of ``step`` had committed: our COMMIT (one lookup), or the
    peer's commit marker."""
    if engine != "antifragile":
        from antifragile.trainer.ckpt_backends import committed_steps

        return step in committed_steps(engine, url)
    from antifragile.engine._paths import COMMIT, step_dir
    from antifragile.engine.storage import open_storage

    return open_storage(url).exists(f"{step_dir(step)}/{COMMIT}")
