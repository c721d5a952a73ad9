"""The seeded simulation behind ``chaos tune``: many failure schedules over candidate intervals.

It plays Daly's process (see :mod:`.model`) on seeded schedules, exponential or Weibull with
shape ``k`` as reported for HPC failures, so it checks the formula where the formula is exact
and answers where it is not. Not modelled: a failure during an asynchronous checkpoint's
background persist (it rolls back one checkpoint further) and job start-up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from antifragile.chaos.faults.base import memory_mib
from antifragile.chaos.tune.model import (
    DISTRIBUTIONS,
    SIM_TOLERANCE,
    Costs,
    Distribution,
    TuneError,
    candidate_intervals,
    daly_interval,
    every_steps,
    expected_goodput,
    optimal_every_steps,
    optimal_interval,
    young_interval,
)


class _FailureTimes:
    """Absolute failure times for ``n`` seeded schedules (a renewal process from t = 0),
    drawn in fixed blocks so column j is the same whichever interval asks for it first: every
    candidate interval meets the same failures (common random numbers)."""

    BLOCK = 128

    def __init__(self, dist: Distribution, shape: float, mtbf_s: float, n: int, seed: int
                 ) -> None:
        self.dist, self.shape, self.mtbf_s, self.n = dist, shape, mtbf_s, n
        self.rng = np.random.default_rng([seed, DISTRIBUTIONS.index(dist)])
        self.times = np.zeros((n, 0))

    def _gaps(self) -> np.ndarray:
        size = (self.n, self.BLOCK)
        if self.dist == "exponential":
            return self.rng.exponential(self.mtbf_s, size)
        scale = self.mtbf_s / math.gamma(1 + 1 / self.shape)  # mean inter-arrival = MTBF
        return scale * self.rng.weibull(self.shape, size)

    def upto(self, column: int) -> np.ndarray:
        """The failure times with at least ``column + 1`` columns, drawn block by block so
        the numbers never depend on how far a caller asked; one copy per call."""
        have = self.times.shape[1]
        if have > column:
            return self.times
        blocks = -(-(column + 1 - have) // self.BLOCK)
        last = self.times[:, -1:] if have else np.zeros((self.n, 1))
        gaps = np.hstack([self._gaps() for _ in range(blocks)])
        self.times = np.hstack([self.times, last + np.cumsum(gaps, axis=1)])
        return self.times


#: a schedule that meets this many failures before it finishes is given up (its interval
#: almost never completes a segment: nearly periodic Weibull failures, k >> 1, against an
#: interval longer than M); without a bound the simulation never ended
MAX_FAILURES = 10_000


def _wall_times(interval_s: float, segments: int, ckpt_s: float, restart_s: float,
                failures: _FailureTimes, down_s: float = 0.0) -> np.ndarray | None:
    """Wall time of each schedule to finish ``segments`` x (work + checkpoint); None once a
    schedule is given up after :data:`MAX_FAILURES` failures (the interval then does no
    useful work to speak of, so the schedules not yet played are not).

    Work resumes R after each failure (at 0 at the start), so the segments committed before
    failure j depend only on the failure times: each gap F[j] - (F[j-1] + R) commits
    floor(gap / period) of them (none when a failure comes within the restart). A schedule
    finishes in the first gap long enough for the segments it still owes, which makes it a
    few array operations over a stretch of failures at a time, 256 schedules at once.

    ``down_s``: seconds after each failure, before the ``restart_s``, in which no failure
    comes (failure times are then up time; each failure before the finish adds them).
    """
    period = interval_s + ckpt_s
    wall = np.zeros(failures.n)
    for rows in np.array_split(np.arange(failures.n), -(-failures.n // 256)):
        done = np.zeros(rows.size)  # segments committed before the stretch
        first = 0  # the stretch's first failure
        width = _FailureTimes.BLOCK
        while rows.size:
            if first == MAX_FAILURES:
                return None
            last = min(first + width, MAX_FAILURES)
            times = failures.upto(last - 1)
            f = times[rows, first:last]
            if first:
                start = times[rows, first - 1:last - 1] + restart_s
            else:
                start = np.hstack([np.zeros((rows.size, 1)), f[:, :-1] + restart_s])
            committed = np.floor(np.maximum(f - start, 0.0) / period)
            before = done[:, None] + np.cumsum(committed, axis=1) - committed
            finish = start + (segments - before) * period
            ok = finish <= f
            hit = ok.any(axis=1)
            gap = ok.argmax(axis=1)[hit]  # the failures before the finish: first + gap
            wall[rows[hit]] = finish[hit, gap] + down_s * (first + gap)
            done = (before[:, -1] + committed[:, -1])[~hit]
            rows = rows[~hit]
            first, width = last, 2 * width
    return wall


@dataclass(kw_only=True, slots=True)
class Curve:
    """Simulated goodput per candidate interval: W / mean wall time, with a 95% interval."""

    distribution: Distribution
    shape: float | None
    intervals_s: list[float]
    goodput: list[float]
    ci_low: list[float]
    ci_high: list[float]

    def best(self) -> int:
        return int(np.argmax(self.goodput))


def check_simulation(schedules: int, shape: float) -> None:
    """Raise TuneError for settings the simulation cannot take (every tuning simulates the
    Weibull law too, so its shape is always used). Both only ever come from ``chaos tune``'s
    ``--schedules`` and ``--weibull-shape``, so the messages name those."""
    if schedules < 2:
        raise TuneError(f"--schedules must be >= 2, got {schedules}")
    # a schedule may meet MAX_FAILURES failures: the table grows to that many columns
    columns = -(-MAX_FAILURES // _FailureTimes.BLOCK) * _FailureTimes.BLOCK
    table_gib = schedules * columns * 8 / 2**30
    if 2 * table_gib > memory_mib() / 1024:
        raise TuneError(f"--schedules {schedules}: the failure times can grow to {schedules} x "
                        f"{columns} floats ({table_gib:.3g} GiB, twice while they grow); this "
                        f"machine has {memory_mib() / 1024:.0f} GiB")
    if not (math.isfinite(shape) and shape > 0):
        raise TuneError(f"--weibull-shape must be a finite number > 0, got {shape:g}")
    try:
        math.gamma(1 + 1 / shape)  # the gaps' scale for a mean of M (``_FailureTimes``)
    except OverflowError:
        raise TuneError(f"--weibull-shape {shape:g} is too small to simulate (the scale "
                        "that gives its gaps a mean of M overflows a float); give k >= 0.006"
                        ) from None


#: below this model goodput at the best interval the job makes almost no progress: a
#: failure-free stretch of C + tau takes ~1/goodput failures, so a simulated schedule needs
#: that many and the simulation would not end (C/M = 5: 60 s and 2 GB; C/M = 10: never)
MIN_GOODPUT = 0.01


def simulate(intervals_s: list[float], costs: Costs, *, dist: Distribution = "exponential",
             shape: float = 0.7, schedules: int = 2000, seed: int = 0,
             failures_per_schedule: int = 100) -> Curve:
    """Seeded Monte-Carlo goodput for each interval over ``schedules`` failure schedules.

    Each schedule does a whole number of segments sized to meet about
    ``failures_per_schedule`` failures, so the estimate W / mean(wall) is unbiased for
    Daly's expected goodput (exponential case) and comparable across intervals.
    """
    check_simulation(schedules, shape if dist == "weibull" else 1.0)
    failures = _FailureTimes(dist, shape, costs.mtbf_s, schedules, seed)
    goodput, low, high = [], [], []
    for tau in intervals_s:
        model = expected_goodput(tau, costs.ckpt_s, costs.restart_s, costs.mtbf_s)
        segments = max(1, math.ceil(failures_per_schedule * costs.mtbf_s * model / tau))
        wall = _wall_times(tau, segments, costs.ckpt_s, costs.restart_s, failures)
        work = segments * tau
        if wall is None:  # a schedule was given up: no useful work to speak of
            goodput.append(0.0)
            low.append(0.0)
            high.append(0.0)
            continue
        mean, se = float(wall.mean()), float(wall.std(ddof=1)) / math.sqrt(schedules)
        goodput.append(work / mean)
        low.append(work / (mean + 1.96 * se))
        high.append(work / max(mean - 1.96 * se, work))
    return Curve(distribution=dist, shape=shape if dist == "weibull" else None,
                 intervals_s=list(intervals_s), goodput=goodput, ci_low=low, ci_high=high)


#: the share of single runs whose wall time ``run_spread`` brackets
SPREAD_COVERAGE = 0.9


def run_spread(work_s: float, interval_s: float, costs: Costs, *, down_s: float = 0.0,
               schedules: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """Where the wall time of ONE run of ``work_s`` seconds of work, checkpointed every
    ``interval_s``, falls under exponential failures at the MTBF: the central
    :data:`SPREAD_COVERAGE` of it over seeded schedules. A short run meets a few failures, so
    one run's goodput scatters widely around the expected one: a sweep's gap inside this is
    noise, not the model's error. None when a schedule was given up (no useful work).
    ``down_s``: the part of the restart cost in which no failure comes, as
    :func:`~.model.expected_goodput` takes it."""
    segments = max(1, math.ceil(work_s / interval_s))  # whole segments, the same work in all
    failures = _FailureTimes("exponential", 1.0, costs.mtbf_s, schedules, seed)
    wall = _wall_times(work_s / segments, segments, costs.ckpt_s, costs.restart_s - down_s,
                       failures, down_s)
    if wall is None:
        return None
    tail = (1 - SPREAD_COVERAGE) / 2
    low, high = np.quantile(wall, [tail, 1 - tail])
    return float(low), float(high)

@dataclass(kw_only=True, slots=True)
class Tuning:
    """The answer: analytic intervals, simulated curves and the recommended interval."""

    costs: Costs
    distribution: Distribution
    young_interval_s: float
    daly_interval_s: float
    model_optimum_s: float
    recommended_interval_s: float
    expected_goodput: float
    expected_goodput_ci: tuple[float, float]
    model_goodput: float
    max_gap_vs_model: float
    curves: dict[str, Curve]
    seed: int
    schedules: int
    notes: list[str] = field(default_factory=list)

    def steps(self, interval_s: float) -> int | None:
        return None if self.costs.step_s is None else every_steps(interval_s, self.costs.step_s)

    def as_dict(self) -> dict[str, Any]:
        c = self.costs
        curves = {name: asdict(curve) for name, curve in self.curves.items()}
        model = [expected_goodput(tau, c.ckpt_s, c.restart_s, c.mtbf_s)
                 for tau in self.curves[self.distribution].intervals_s]
        return {
            "ckpt_cost_s": c.ckpt_s, "restart_s": c.restart_s, "mtbf_s": c.mtbf_s,
            "step_s": c.step_s,
            "young_interval_s": self.young_interval_s,
            "daly_interval_s": self.daly_interval_s,
            "model_optimum_s": self.model_optimum_s,
            "recommended_interval_s": self.recommended_interval_s,
            "recommended_every_steps": self.steps(self.recommended_interval_s),
            "young_every_steps": self.steps(self.young_interval_s),
            "daly_every_steps": self.steps(self.daly_interval_s),
            "model_optimum_every_steps": (
                None if c.step_s is None else optimal_every_steps(c.ckpt_s, c.mtbf_s, c.step_s)),
            "expected_goodput": self.expected_goodput,
            "expected_goodput_ci": list(self.expected_goodput_ci),
            "model_goodput": self.model_goodput,
            "simulation": {"distribution": self.distribution, "schedules": self.schedules,
                           "seed": self.seed, "max_gap_vs_model": self.max_gap_vs_model,
                           "tolerance": SIM_TOLERANCE, "model_goodput": model,
                           "curves": curves},
            "notes": self.notes,
        }


def tune(costs: Costs, *, dist: Distribution = "exponential", shape: float = 0.7,
         schedules: int = 2000, seed: int = 0) -> Tuning:
    """Recommend the candidate interval with the best simulated goodput under ``dist``."""
    best = optimal_interval(costs.ckpt_s, costs.mtbf_s)
    at_best = expected_goodput(best, costs.ckpt_s, costs.restart_s, costs.mtbf_s)
    if at_best < MIN_GOODPUT:
        raise TuneError(f"with checkpoint cost C = {costs.ckpt_s:g} s, restart + restore R = "
                        f"{costs.restart_s:g} s and MTBF M = {costs.mtbf_s:g} s the job "
                        f"makes almost no progress at any interval: goodput {at_best:.2g} at "
                        f"best (interval {best:.3g} s), below {MIN_GOODPUT:g}; failures come "
                        "faster than a checkpoint or restart completes, so there is nothing "
                        "to tune (make C and R smaller than M)")
    intervals = candidate_intervals(costs)
    curves: dict[str, Curve] = {
        d: simulate(intervals, costs, dist=d, shape=shape, schedules=schedules, seed=seed)
        for d in DISTRIBUTIONS}
    exp_curve = curves["exponential"]
    gap = max(abs(g - expected_goodput(tau, costs.ckpt_s, costs.restart_s, costs.mtbf_s))
              for tau, g in zip(exp_curve.intervals_s, exp_curve.goodput))
    chosen = curves[dist]
    i = chosen.best()
    tau = chosen.intervals_s[i]
    if chosen.goodput[i] == 0:
        shape_note = f" k={shape:g}" if dist == "weibull" else ""
        raise TuneError(f"under {dist}{shape_note} failures with MTBF M = {costs.mtbf_s:g} s "
                        f"no interval completes: for every candidate interval "
                        f"({intervals[0]:.3g}-{intervals[-1]:.3g} s, plus checkpoint cost "
                        f"C = {costs.ckpt_s:g} s) a simulated schedule met {MAX_FAILURES} "
                        "failures before finishing, so the job makes almost no progress at "
                        "any interval")
    gave_up = [d for d, c in curves.items() if 0.0 in c.goodput]
    notes = []
    if gave_up:
        notes.append(f"some intervals never completed in the {' and '.join(gave_up)} "
                     f"simulation (a schedule met {MAX_FAILURES} failures first): goodput 0 "
                     "there")
    if costs.step_s is not None and best < costs.step_s:
        notes.append(f"the model's optimum interval, {best:.3g} s, is shorter than one step "
                     f"({costs.step_s:.3g} s): a checkpoint every step is the most often there "
                     "is, and the goodput of the analytic intervals cannot be had")
    if gap > SIM_TOLERANCE:
        notes.append(f"the exponential simulation sits {gap:.3f} from the analytic model "
                     f"(tolerance {SIM_TOLERANCE}); use more schedules")
    return Tuning(costs=costs, distribution=dist,
                  young_interval_s=young_interval(costs.ckpt_s, costs.mtbf_s),
                  daly_interval_s=daly_interval(costs.ckpt_s, costs.mtbf_s),
                  model_optimum_s=best,
                  recommended_interval_s=tau, expected_goodput=chosen.goodput[i],
                  expected_goodput_ci=(chosen.ci_low[i], chosen.ci_high[i]),
                  model_goodput=expected_goodput(tau, costs.ckpt_s, costs.restart_s,
                                                 costs.mtbf_s),
                  max_gap_vs_model=gap, curves=curves, seed=seed, schedules=schedules,
                  notes=notes)


def plot(tuning: Tuning, path: Path, sweep: list[dict[str, Any]] | None = None) -> Path:
    """``goodput.png``: model curve, simulated curves with 95% bands, marked intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = tuning.costs
    fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = np.array(tuning.curves["exponential"].intervals_s)
    fine = np.geomspace(xs.min(), xs.max(), 200)
    ax.plot(fine, [expected_goodput(x, c.ckpt_s, c.restart_s, c.mtbf_s) for x in fine],
            color="black", lw=1.2, label="model (Daly, exponential)")
    for name, colour in (("exponential", "tab:blue"), ("weibull", "tab:orange")):
        curve = tuning.curves[name]
        label = name if curve.shape is None else f"{name} k={curve.shape:g}"
        ax.plot(curve.intervals_s, curve.goodput, "o", ms=3, color=colour,
                label=f"simulated, {label}")
        ax.fill_between(curve.intervals_s, curve.ci_low, curve.ci_high, color=colour, alpha=0.2)
    for x, name, style in ((tuning.young_interval_s, "Young", ":"),
                           (tuning.daly_interval_s, "Daly", "--"),
                           (tuning.recommended_interval_s, "recommended", "-")):
        ax.axvline(x, color="grey", ls=style, lw=1, label=f"{name} {x:.3g} s")
    if sweep:
        ax.plot([r["interval_s"] for r in sweep], [r["measured_goodput"] for r in sweep], "s",
                color="tab:red", label="real runs (measured)")
        ax.plot([r["interval_s"] for r in sweep], [r["predicted_goodput"] for r in sweep], "x",
                color="tab:red", label="real runs (model, with start-up)")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of work)" + (
        f"; 1 step = {c.step_s:.3g} s" if c.step_s else ""))
    ax.set_ylabel("goodput")
    ax.set_title(f"C = {c.ckpt_s:.3g} s, R = {c.restart_s:.3g} s, MTBF = {c.mtbf_s:.4g} s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
