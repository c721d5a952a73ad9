"""Pause points: where ``chaos run`` holds the trainer so that a fault lands where the
scenario says (DESIGN, "faults land where the scenario says").

The runner turns each step- or checkpoint-triggered fault into a pause point of a plan it
writes to ``<run_dir>/control/plan.json`` before the job starts; a rank that reaches a point
(the end of step N, or a named phase of the save of step N) waits there until the runner
touches ``control/release/<id>``, after it has made the fault. Time-triggered faults
(``mtbf_s``, ``at_s``) stay pending and are made by the runner's clock.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from antifragile.chaos.faults import FaultBase
from antifragile.chaos.run.draws import Draws
from antifragile.chaos.scenario import Scenario


@dataclass(slots=True)
class Pending:
    """A fault of the scenario not made yet."""

    fault: FaultBase
    index: int  # in the scenario's faults: what each injection is recorded as
    next_t: float | None = None  # for mtbf arrivals and at_s


def mesh_coordinates(s: Scenario) -> dict[int, tuple[int, int, int]]:
    """Each rank's (dp, pp, tp) coordinates in the built-in trainer's mesh."""
    if s.is_command:  # a script's ranks have no mesh chaos knows of
        return {}
    p = s.trainer.parallel
    return {r: (r // (p.pp * p.tp), (r // p.tp) % p.pp, r % p.tp)
            for r in range(p.world_size)}


@dataclass(slots=True)
class Point:
    """A pause point of the plan and the faults due there."""

    id: str
    step: int
    ranks: list[int] | None  # None: every rank
    phase: str | None = None  # a save phase (checkpoint faults), else the end of the step
    on_pass: int = 1  # the n-th time the job gets there
    faults: list[tuple[int, FaultBase]] = field(default_factory=list)  # (index, fault) due here
    paused: set[tuple[int, int]] = field(default_factory=set)  # (generation, rank)
    first_paused_t: float = 0.0
    last_paused_t: float = 0.0
    released: bool = False

    def missing(self, world_size: int) -> list[int]:
        """The ranks not (yet) held here in the newest generation that reached it."""
        generation = max((g for g, _ in self.paused), default=0)
        wanted = self.ranks if self.ranks is not None else range(world_size)
        return [r for r in wanted if (generation, r) not in self.paused]

    def describe(self) -> str:
        """Where it holds, in words (a reason's part)."""
        where = (f"the end of step {self.step}" if self.phase is None
                 else f"the save of step {self.step} at its phase {self.phase!r}")
        return where + (f" (pass {self.on_pass})" if self.on_pass != 1 else "")

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id}
        if self.phase is None:
            doc["step"] = self.step
        else:
            doc.update(checkpoint_step=self.step, phase=self.phase)
        if self.ranks is not None:
            doc["ranks"] = self.ranks
        if self.on_pass != 1:
            doc["pass"] = self.on_pass
        return doc


def pause_plan(s: Scenario, pending: list[Pending], draws: Draws) -> dict[str, Point]:
    """One pause point per moment a step- or checkpoint-triggered fault is due; those faults
    leave ``pending``. A checkpoint's moment is its step (the n-th save is at n x every), and
    a moment is also its pass (``on_pass``). A save-phase fault's ``rank: random`` is picked
    here, from the fault's own generator (``Draws.targets``)."""
    points: dict[tuple[int, str | None, tuple[int, ...] | None, int], Point] = {}
    coordinates = mesh_coordinates(s)
    for p in list(pending):
        f = p.fault
        if f.at_step is None and f.at_checkpoint is None:
            continue
        pending.remove(p)
        phase = getattr(f, "phase", None)
        if f.at_checkpoint is not None:
            step = f.at_checkpoint * s.checkpoint.every_steps
        else:
            step = f.at_step
            phase = None
        ranks: tuple[int, ...] | None = None
        if phase is not None:  # a save phase holds only the rank the fault hits
            rank = getattr(f, "rank", 0)
            if rank == "random":
                rank = draws.targets(p.index).randrange(s.trainer.world_size)
            elif not isinstance(rank, int):
                rank = next(r for r, c in coordinates.items()
                            if c == (rank.dp, rank.pp, rank.tp))
            ranks = (int(rank),)
            f = f.model_copy(update={"rank": int(rank)})
        key = (step, phase, ranks, f.on_pass)
        if key not in points:
            points[key] = Point(f"p{len(points)}", step, list(ranks) if ranks else None, phase,
                                 f.on_pass)
        points[key].faults.append((p.index, f))
    # The trainer holds, where it is, the lowest pass not yet released there: a pass with no
    # fault due needs a point too (released at once), or a later pass's holds the first time.
    for step, phase, ranks, on_pass in list(points):
        passes = {k[3] for k in points if k[:2] == (step, phase)}
        for earlier in sorted(set(range(1, on_pass)) - passes):
            points[(step, phase, ranks, earlier)] = Point(
                f"p{len(points)}", step, list(ranks) if ranks else None, phase, earlier)
    return {point.id: point for point in points.values()}


def write_plan(run_dir: Path, points: dict[str, Point]) -> None:
    """A run's events and control files start empty (a previous run in the same folder would
    otherwise be read as this one)."""
    control = run_dir / "control"
    for folder in (control, run_dir / "events"):
        if folder.exists():
            shutil.rmtree(folder)
    (control / "release").mkdir(parents=True)
    (control / "plan.json").write_text(json.dumps(
        {"points": [p.as_json() for p in points.values()]}, indent=1))


def release(run_dir: Path, point: Point) -> None:
    """Let the ranks held at ``point`` go on. The file names the newest generation held there
    (the trainer tells its own pass from an earlier one's by it), written whole before it
    appears under its name: a rank reads it as soon as it exists."""
    generation = max((g for g, _ in point.paused), default=0)
    folder = run_dir / "control" / "release"
    partial = folder / f".{point.id}.partial"
    partial.write_text(f"{generation}\n")
    os.replace(partial, folder / point.id)
    point.released = True
