"""Where a run stands, as ``chaos run`` reports it to a progress display while it goes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunStatus:
    name: str  # the scenario (or "reference")
    step: int  # newest step finished by rank 0 of the current attempt
    total_steps: int
    attempt: int
    faults_injected: int
    recoveries: int  # attempts that restored a checkpoint after a failure
    eta_s: float | None  # from the current attempt's step rate; None until it has one
