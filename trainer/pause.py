"""Pause points: chaos holds the trainer at a chosen place, so that a fault lands exactly there.

The trainer learns *where* to hold, never *what* will happen there: ``chaos`` writes
``<run_dir>/control/plan.json`` before the launch, a list of points::

    {"points": [{"id": "f0", "step": 12},
                {"id": "f1", "checkpoint_step": 15, "phase": "persisting", "ranks": [2]}]}

A ``step`` point holds every listed rank (default: all) at the end of that step, after its
checkpoint (if any) is staged; a ``checkpoint_step`` point holds the save of that step at a
phase (see ``antifragile.engine`` phase hooks). Holding emits a ``paused`` event, then waits
until ``control/release/<id>`` exists. A point is passed once: after its release (also by a
later attempt that reaches the same step again) it no longer holds. A point with ``"pass": n``
holds the n-th time the job gets there: each time, only the points of the lowest pass not
released in an earlier generation hold, so a later pass waits for the job to come back
(after a recovery that resumed from an earlier step). A generation makes one pass: a rank
whose save gets to a phase after another rank's point of that pass there was released is on
that pass still (the release file names the generation it released, ``attempt``). A hold
also ends, unreleased, when its generation fails (``interrupted``: in-process recovery): held
survivors must re-form with a spare, and the next generation, back at that step, is held
there again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.002


class HoldInterrupted(Exception):
    """A hold ended by the failure of its generation, not by chaos's release."""


class PausePoints:
    def __init__(self, run_dir: str | None, rank: int,
                 emit: Callable[..., None], on_hold: Callable[[bool], None] | None = None,
                 interrupted: Callable[[], bool] | None = None,
                 generation: int | None = None) -> None:
        self.rank = rank
        self.generation = generation  # the ``attempt`` of this rank's events
        self._emit = emit
        self._on_hold = on_hold
        self._interrupted = interrupted  # the generation failed: a hold ends (HoldInterrupted)
        self._control = os.path.join(run_dir, "control") if run_dir else None
        self.points: list[dict[str, Any]] = []
        plan = os.path.join(self._control, "plan.json") if self._control else None
        if plan and os.path.exists(plan):
            with open(plan, encoding="utf-8") as f:
                self.points = list(json.load(f).get("points", []))

    def _mine(self, point: dict[str, Any]) -> bool:
        ranks = point.get("ranks")
        return ranks is None or self.rank in ranks

    def _released(self, point_id: str) -> bool:
        assert self._control is not None
        return os.path.exists(os.path.join(self._control, "release", point_id))

    def _released_before(self, point_id: str) -> bool:
        """Released by chaos in an earlier generation than this rank's. The release file
        names the generation held there (empty: not known, taken as earlier)."""
        assert self._control is not None
        try:
            with open(os.path.join(self._control, "release", point_id), encoding="utf-8") as f:
                text = f.read().strip()
        except FileNotFoundError:
            return False
        return self.generation is None or not text.isdigit() or int(text) != self.generation

    def _hold(self, point: dict[str, Any], **where: Any) -> None:
        if self._released(point["id"]):
            return
        self._emit("paused", point=point["id"], **where)
        if self._on_hold:
            self._on_hold(True)
        started = time.monotonic()
        interrupted = False
        while not self._released(point["id"]):
            if self._interrupted is not None and self._interrupted():
                interrupted = True
                break
            time.sleep(POLL_S)
        if self._on_hold:
            self._on_hold(False)
        self._emit("resumed", point=point["id"], held_s=time.monotonic() - started,
                   **({"interrupted": True} if interrupted else {}))
        if interrupted:
            raise HoldInterrupted(f"held at pause point {point['id']} when the generation "
                                  "failed")

    def _due(self, here: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Of this rank's points at one place, those to hold this time: those of the lowest
        pass not released there in an earlier generation, whichever ranks that pass holds (a
        save phase holds one rank: another rank's point of an earlier pass there, unreleased
        or released in this generation, means the job is on that pass), and not released yet."""
        waiting = [p for p in here if not self._released_before(p["id"])]
        first = min((p.get("pass", 1) for p in waiting), default=None)
        return [p for p in waiting if p.get("pass", 1) == first and self._mine(p)
                and not self._released(p["id"])]

    def step_end(self, step: int) -> None:
        for point in self._due([p for p in self.points if p.get("step") == step]):
            self._hold(point, step=step)

    def save_phase(self, step: int, phase: str) -> None:
        for point in self._due([p for p in self.points if p.get("checkpoint_step") == step
                                and p.get("phase") == phase]):
            self._hold(point, step=step, phase=phase)
