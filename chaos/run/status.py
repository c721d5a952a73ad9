"""Where a run stands, as ``chaos run`` reports it to a progress display while it goes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RunStatus:
    name: str  # the scenario (or "reference")
    step: int  # newest step finished by rank 0 of the current attempt
    total_steps: int
    attempt: int
    faults_injected: int
    recoveries: int  # attempts that trained again after a failure (restored, or started over)
    eta_s: float | None  # from the current attempt's step rate; None until it has one


class StatusTracker:
    """Follows a run's events and says where it stands at each of rank 0's steps.

    An attempt (a torchrun restart or an in-process generation) counts as a recovery once it
    trains: one that restored a checkpoint, and one that found none committed yet and started
    over (counting restores only showed "recoveries 0" beside a restarted attempt). Every run
    starts at attempt 0 (torchrun's first, the job's first generation), whether or not that
    attempt lived to report anything."""

    def __init__(self, name: str, expected_step: int | None) -> None:
        self.name = name
        self.expected_step = expected_step  # the step the run ends at; None: not known
        self.first_step: dict[int, tuple[float, int]] = {}  # attempt -> (t, step) it began at

    def status(self, e: dict[str, Any], faults_injected: int) -> RunStatus | None:
        """The status after event ``e``: None unless it is a step rank 0 finished. An idle
        spare's events (rank -1, attempt -1) are of no attempt."""
        attempt = int(e["attempt"])
        if e["rank"] < 0 or attempt < 0:
            return None
        if e["event"] != "step_end" or e["rank"] != 0:
            return None
        t0, step0 = self.first_step.setdefault(attempt, (e["t"], e["step"]))
        rate = (e["step"] - step0) / (e["t"] - t0) if e["t"] > t0 else 0.0
        total = max(self.expected_step or 0, e["step"])
        return RunStatus(name=self.name, step=e["step"], total_steps=total, attempt=attempt,
                         faults_injected=faults_injected,
                         recoveries=sum(a > 0 for a in self.first_step),
                         eta_s=(total - e["step"]) / rate if rate else None)
