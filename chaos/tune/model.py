"""Checkpoint-interval tuning (DESIGN 4.5), the analytic half: Young, Daly, the exact optimum.

The model is Daly's (2006) for exponential failures: a job alternates ``tau`` seconds of work
and a checkpoint costing ``C``; a failure anywhere in ``tau + C`` loses that segment, then a
restart costing ``R`` (itself interruptible) precedes the redo. Its expected goodput is exact
for that process::

    goodput(tau) = tau / (M * exp(R / M) * (exp((tau + C) / M) - 1))

``simulate`` plays the same process on seeded failure schedules; ``measure`` times C, R and the
step on a scenario's own configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Distribution = Literal["exponential", "weibull"]
DISTRIBUTIONS: tuple[Distribution, ...] = ("exponential", "weibull")

SIM_TOLERANCE = 0.01
"""Largest |simulated - analytic| goodput accepted for exponential failures (the tests hold
the simulator to it; ``tune`` reports the gap it found)."""

META_MTTF_H = {1024: 7.9, 16384: 1.8}
"""Job MTTF by GPU count reported by Meta (Kokolis et al. 2024, "Revisiting Reliability in
Large-Scale Machine Learning Research Clusters")."""

PROJECTION_GPUS = (1024, 16384, 100_000)


class TuneError(ValueError):
    """Bad tuning input; the message is for the user as is (exit 2)."""


class MeasureError(RuntimeError):
    """A real run failed or could not be measured; the message names the run folder (exit 1)."""


MIN_SECONDS = 1e-6  # a microsecond: the shortest cost, step or MTBF the model takes
MAX_SECONDS = 1e120  # the longest: squared wall times still fit a float


@dataclass(kw_only=True, slots=True)
class Costs:
    """What the model needs, in seconds: checkpoint cost C, restart + restore cost R, MTBF M,
    and optionally the step time (to express intervals as ``every_steps``)."""

    ckpt_s: float
    restart_s: float
    mtbf_s: float
    step_s: float | None = None

    def __post_init__(self) -> None:
        check_seconds("checkpoint cost", self.ckpt_s, strict=True)
        check_seconds("restart cost", self.restart_s, strict=False)
        check_seconds("MTBF", self.mtbf_s, strict=True)
        if self.step_s is not None:
            check_seconds("step time", self.step_s, strict=True)


def check_seconds(what: str, value: float, *, strict: bool, option: str | None = None) -> None:
    """Raise TuneError when the model cannot take ``value`` seconds of ``what`` (``strict``:
    0 neither). ``option``: the command-line option it was given as, which the message names
    (``Costs`` also takes measured values, so its own messages name what they are)."""
    if not math.isfinite(value) or value < 0 or (strict and value == 0):
        raise TuneError(f"{option or what} must be a finite number {'> 0' if strict else '>= 0'} "
                        f"seconds, got {value:g}")
    # beyond these the model's floats overflow or underflow (C/M rounds to 0)
    if value > MAX_SECONDS or (strict and value < MIN_SECONDS):
        raise TuneError(f"{f'{option}: the ' if option else ''}{what} must be between "
                        f"{MIN_SECONDS:g} and {MAX_SECONDS:g} seconds, got {value:g}")


def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)``, first order in C/M."""
    return math.sqrt(2 * ckpt_s * mtbf_s)


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37: the higher-order estimate; ``M`` once ``C >= 2M``."""
    if ckpt_s >= 2 * mtbf_s:
        return mtbf_s
    x = ckpt_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - ckpt_s


def expected_goodput(interval_s: float, ckpt_s: float, restart_s: float, mtbf_s: float,
                     *, down_s: float = 0.0) -> float:
    """Useful work / expected wall time under Daly's model (exponential failures); 0 where
    the expected wall time overflows a float (C + tau or R hundreds of times M).

    ``down_s``: the first seconds of R in which no failure can come (``chaos run`` draws again
    an arrival while the job is down), the rest of R as interruptible as in Daly's model:
    ``(M + D) exp((R - D) / M)`` in place of ``M exp(R / M)`` (D = 0: Daly's)."""
    try:
        wall_per_segment = ((mtbf_s + down_s) * math.exp((restart_s - down_s) / mtbf_s)
                            * math.expm1((interval_s + ckpt_s) / mtbf_s))
    except OverflowError:
        return 0.0
    return interval_s / wall_per_segment


def optimal_interval(ckpt_s: float, mtbf_s: float) -> float:
    """The exact maximiser of :func:`expected_goodput` (R only scales it).

    Setting the derivative to zero gives ``(1 - u) exp(u) = exp(-C/M)`` for ``u = tau/M``, or
    ``-ln(1 - u) - u = C/M``, whose left side rises from 0 to infinity on (0, 1): bisection
    finds the one root. Solved in that form (both sides of the first round to 1 once C/M is
    below ~1e-16), below ``sqrt(2 C/M)`` since the left side is at least ``u^2 / 2``.
    """
    ratio = ckpt_s / mtbf_s
    lo, hi = 0.0, min(1.0, math.sqrt(2 * ratio))
    for _ in range(200):
        mid = (lo + hi) / 2
        if _restart_loss(mid) < ratio:
            lo = mid
        else:
            hi = mid
    return mtbf_s * (lo + hi) / 2


def _restart_loss(u: float) -> float:
    """``-ln(1 - u) - u`` (= u^2/2 + u^3/3 + ...), by its series where the two terms would
    cancel to nothing."""
    if u < 1e-3:
        return u * u * (1 / 2 + u * (1 / 3 + u * (1 / 4 + u * (1 / 5 + u / 6))))
    return -math.log1p(-u) - u if u < 1 else math.inf


def every_steps(interval_s: float, step_s: float) -> int:
    return max(1, round(interval_s / step_s))


def optimal_every_steps(ckpt_s: float, mtbf_s: float, step_s: float) -> int:
    """The whole step count with the highest :func:`expected_goodput`: the floor or the
    ceiling of the optimum (the goodput has one maximum), not the nearest one, since the
    goodput falls faster below the optimum than above it (1.45 steps: 2 beat 1)."""
    floor = max(1, math.floor(optimal_interval(ckpt_s, mtbf_s) / step_s))
    return max((floor, floor + 1),
               key=lambda k: expected_goodput(k * step_s, ckpt_s, 0.0, mtbf_s))


def candidate_intervals(costs: Costs, n: int = 32) -> list[float]:
    """A geometric grid around Young's interval, in whole steps when the step time is known."""
    young = young_interval(costs.ckpt_s, costs.mtbf_s)
    lo, hi = young / 8, min(young * 8, 4 * costs.mtbf_s)
    hi = max(hi, lo * 4)
    grid = np.geomspace(lo, hi, n).tolist()
    grid += [young, daly_interval(costs.ckpt_s, costs.mtbf_s),
             optimal_interval(costs.ckpt_s, costs.mtbf_s)]
    if costs.step_s is None:
        return sorted(set(grid))
    best = optimal_every_steps(costs.ckpt_s, costs.mtbf_s, costs.step_s)
    return sorted({every_steps(g, costs.step_s) * costs.step_s for g in grid}
                  | {best * costs.step_s})


def scale_mtbfs(gpu_mtbf_h: float, gpus: int | None = None,
                scales: tuple[int, ...] = PROJECTION_GPUS) -> dict[int, float]:
    """The job MTBF in seconds at each scale of the projection, or TuneError: each must lie
    in the bounds ``Costs`` holds M to (past them a finite ``--gpu-mtbf-h`` gave an infinite
    M, so NaN intervals and goodputs, or one that rounds to 0, a division by zero). Checked
    before a scenario is run to measure the costs, not after."""
    if not (math.isfinite(gpu_mtbf_h) and gpu_mtbf_h > 0):
        raise TuneError(f"--gpu-mtbf-h must be > 0 hours, got {gpu_mtbf_h}")
    if gpus is not None and gpus < 1:
        raise TuneError(f"--gpus must be >= 1, got {gpus}")
    out = {}
    for n in sorted({*scales, *([gpus] if gpus else [])}):
        out[n] = gpu_mtbf_h * 3600 / n
        if not MIN_SECONDS <= out[n] <= MAX_SECONDS:
            raise TuneError(f"--gpu-mtbf-h {gpu_mtbf_h:g}: the job MTBF at {n:,} GPUs "
                            f"({out[n]:g} s) must be between {MIN_SECONDS:g} and "
                            f"{MAX_SECONDS:g} seconds")
    return out


def project(costs: Costs, gpu_mtbf_h: float, gpus: int | None = None,
            scales: tuple[int, ...] = PROJECTION_GPUS) -> list[dict[str, Any]]:
    """Goodput and interval at other scales: job MTBF = per-GPU MTBF / GPUs (independent
    failures in series). Uses the analytic optimum, exact for exponential failures, in whole
    steps where the step time is known (its goodput is then that interval's, as a trainer
    checkpointing every that many steps has it)."""
    rows = []
    for n, mtbf_s in scale_mtbfs(gpu_mtbf_h, gpus, scales).items():
        tau = optimal_interval(costs.ckpt_s, mtbf_s)
        steps = None
        if costs.step_s is not None:
            steps = optimal_every_steps(costs.ckpt_s, mtbf_s, costs.step_s)
            tau = steps * costs.step_s
        rows.append({"gpus": n, "mtbf_s": mtbf_s, "mtbf_h": mtbf_s / 3600,
                     "young_interval_s": young_interval(costs.ckpt_s, mtbf_s),
                     "daly_interval_s": daly_interval(costs.ckpt_s, mtbf_s),
                     "recommended_interval_s": tau,
                     "recommended_every_steps": steps,
                     "expected_goodput": expected_goodput(tau, costs.ckpt_s, costs.restart_s,
                                                          mtbf_s),
                     "meta_reported_mtbf_h": META_MTTF_H.get(n)})
    return rows
