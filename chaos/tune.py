"""Checkpoint-interval tuning (DESIGN 4.5): model, seeded simulation, recommendation, plot.

The model is Daly's (2006) for exponential failures: a job alternates ``tau`` seconds of work
and a checkpoint costing ``C``; a failure anywhere in ``tau + C`` loses that segment, then a
restart costing ``R`` (itself interruptible) precedes the redo. Its expected goodput is exact
for that process::

    goodput(tau) = tau / (M * exp(R / M) * (exp((tau + C) / M) - 1))

The simulator plays the same process on many seeded failure schedules (exponential, or
Weibull with shape ``k`` as reported for HPC failures), so it checks the formula where the
formula is exact and answers where it is not. Not modelled: a failure during an asynchronous
checkpoint's background persist (it rolls back one checkpoint further) and job start-up.

The second half measures C, R and the step time on a scenario's own configuration (one real
run through ``chaos.runner``) and runs the confirming sweep of short real runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:  # the model half stays importable without torch
    from chaos.runner import RunRecord
    from chaos.scenario import Scenario

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


@dataclass(kw_only=True, slots=True)
class Costs:
    """What the model needs, in seconds: checkpoint cost C, restart + restore cost R, MTBF M,
    and optionally the step time (to express intervals as ``every_steps``)."""

    ckpt_s: float
    restart_s: float
    mtbf_s: float
    step_s: float | None = None

    def __post_init__(self) -> None:
        checks = [("checkpoint cost", self.ckpt_s, True), ("restart cost", self.restart_s, False),
                  ("MTBF", self.mtbf_s, True)]
        if self.step_s is not None:
            checks.append(("step time", self.step_s, True))
        for what, value, strict in checks:
            if not math.isfinite(value) or value < 0 or (strict and value == 0):
                need = "> 0" if strict else ">= 0"
                raise TuneError(f"{what} must be a finite number {need} seconds, got {value}")


def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)``, first order in C/M."""
    return math.sqrt(2 * ckpt_s * mtbf_s)


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37: the higher-order estimate; ``M`` once ``C >= 2M``."""
    if ckpt_s >= 2 * mtbf_s:
        return mtbf_s
    x = ckpt_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - ckpt_s


def expected_goodput(interval_s: float, ckpt_s: float, restart_s: float, mtbf_s: float
                     ) -> float:
    """Useful work / expected wall time under Daly's model (exponential failures)."""
    wall_per_segment = (mtbf_s * math.exp(restart_s / mtbf_s)
                        * math.expm1((interval_s + ckpt_s) / mtbf_s))
    return interval_s / wall_per_segment


def optimal_interval(ckpt_s: float, mtbf_s: float) -> float:
    """The exact maximiser of :func:`expected_goodput` (R only scales it).

    Setting the derivative to zero gives ``(1 - u) exp(u) = exp(-C/M)`` for ``u = tau/M``, whose
    left side falls from 1 to 0 on (0, 1): bisection finds the one root.
    """
    target = math.exp(-ckpt_s / mtbf_s)
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if (1 - mid) * math.exp(mid) > target:
            lo = mid
        else:
            hi = mid
    return mtbf_s * (lo + hi) / 2


def every_steps(interval_s: float, step_s: float) -> int:
    return max(1, round(interval_s / step_s))


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
    return sorted({every_steps(g, costs.step_s) * costs.step_s for g in grid})


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
        while self.times.shape[1] <= column:
            last = self.times[:, -1:] if self.times.shape[1] else np.zeros((self.n, 1))
            self.times = np.hstack([self.times, last + np.cumsum(self._gaps(), axis=1)])
        return self.times


def _wall_times(interval_s: float, segments: int, ckpt_s: float, restart_s: float,
                failures: _FailureTimes) -> np.ndarray:
    """Wall time of each schedule to finish ``segments`` x (work + checkpoint).

    One pass per failure: work resumes ``pause`` seconds after ``t`` (R after a failure,
    0 at the start); a failure before that restarts the restart.
    """
    n = failures.n
    period = interval_s + ckpt_s
    t = np.zeros(n)
    pause = np.zeros(n)
    done = np.zeros(n)  # segments committed
    nxt = np.zeros(n, dtype=np.int64)  # index of the next failure
    wall = np.zeros(n)
    active = np.arange(n)
    while active.size:
        times = failures.upto(int(nxt[active].max()))
        f = times[active, nxt[active]]
        start = t[active] + pause[active]
        finish = start + (segments - done[active]) * period
        ok = finish <= f
        wall[active[ok]] = finish[ok]
        keep = ~ok
        active, f, start = active[keep], f[keep], start[keep]
        done[active] += np.floor(np.maximum(f - start, 0.0) / period)
        t[active] = f
        pause[active] = restart_s
        nxt[active] += 1
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


def simulate(intervals_s: list[float], costs: Costs, *, dist: Distribution = "exponential",
             shape: float = 0.7, schedules: int = 2000, seed: int = 0,
             failures_per_schedule: int = 100) -> Curve:
    """Seeded Monte-Carlo goodput for each interval over ``schedules`` failure schedules.

    Each schedule does a whole number of segments sized to meet about
    ``failures_per_schedule`` failures, so the estimate W / mean(wall) is unbiased for
    Daly's expected goodput (exponential case) and comparable across intervals.
    """
    if schedules < 2:
        raise TuneError(f"schedules must be >= 2, got {schedules}")
    if dist == "weibull" and not shape > 0:
        raise TuneError(f"the Weibull shape must be > 0, got {shape}")
    failures = _FailureTimes(dist, shape, costs.mtbf_s, schedules, seed)
    goodput, low, high = [], [], []
    for tau in intervals_s:
        model = expected_goodput(tau, costs.ckpt_s, costs.restart_s, costs.mtbf_s)
        segments = max(1, math.ceil(failures_per_schedule * costs.mtbf_s * model / tau))
        wall = _wall_times(tau, segments, costs.ckpt_s, costs.restart_s, failures)
        work = segments * tau
        mean, se = float(wall.mean()), float(wall.std(ddof=1)) / math.sqrt(schedules)
        goodput.append(work / mean)
        low.append(work / (mean + 1.96 * se))
        high.append(work / max(mean - 1.96 * se, work))
    return Curve(distribution=dist, shape=shape if dist == "weibull" else None,
                 intervals_s=list(intervals_s), goodput=goodput, ci_low=low, ci_high=high)


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
            "model_optimum_every_steps": self.steps(self.model_optimum_s),
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
    notes = []
    if gap > SIM_TOLERANCE:
        notes.append(f"the exponential simulation sits {gap:.3f} from the analytic model "
                     f"(tolerance {SIM_TOLERANCE}); use more schedules")
    return Tuning(costs=costs, distribution=dist,
                  young_interval_s=young_interval(costs.ckpt_s, costs.mtbf_s),
                  daly_interval_s=daly_interval(costs.ckpt_s, costs.mtbf_s),
                  model_optimum_s=optimal_interval(costs.ckpt_s, costs.mtbf_s),
                  recommended_interval_s=tau, expected_goodput=chosen.goodput[i],
                  expected_goodput_ci=(chosen.ci_low[i], chosen.ci_high[i]),
                  model_goodput=expected_goodput(tau, costs.ckpt_s, costs.restart_s,
                                                 costs.mtbf_s),
                  max_gap_vs_model=gap, curves=curves, seed=seed, schedules=schedules,
                  notes=notes)


def project(costs: Costs, gpu_mtbf_h: float, gpus: int | None = None,
            scales: tuple[int, ...] = PROJECTION_GPUS) -> list[dict[str, Any]]:
    """Goodput and interval at other scales: job MTBF = per-GPU MTBF / GPUs (independent
    failures in series). Uses the analytic optimum, exact for exponential failures."""
    if not (math.isfinite(gpu_mtbf_h) and gpu_mtbf_h > 0):
        raise TuneError(f"--gpu-mtbf-h must be > 0 hours, got {gpu_mtbf_h}")
    if gpus is not None and gpus < 1:
        raise TuneError(f"--gpus must be >= 1, got {gpus}")
    rows = []
    for n in sorted({*scales, *([gpus] if gpus else [])}):
        mtbf_s = gpu_mtbf_h * 3600 / n
        tau = optimal_interval(costs.ckpt_s, mtbf_s)
        rows.append({"gpus": n, "mtbf_s": mtbf_s, "mtbf_h": mtbf_s / 3600,
                     "young_interval_s": young_interval(costs.ckpt_s, mtbf_s),
                     "daly_interval_s": daly_interval(costs.ckpt_s, mtbf_s),
                     "recommended_interval_s": tau,
                     "recommended_every_steps": (every_steps(tau, costs.step_s)
                                                 if costs.step_s else None),
                     "expected_goodput": expected_goodput(tau, costs.ckpt_s, costs.restart_s,
                                                          mtbf_s),
                     "meta_reported_mtbf_h": META_MTTF_H.get(n)})
    return rows


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


# --- measuring C, R and the step time on the scenario itself, and the confirming sweep ---

STOPPING_KINDS = frozenset({"kill_rank", "hang_rank", "crash_during_save", "drop_link"})
"""Fault kinds that stop the job (the launcher restarts it): the failures M counts. A
corrupted shard or a storage outage costs a checkpoint, not the job."""


@dataclass(kw_only=True, slots=True)
class Measured:
    """Costs read from one real run's events (slowest rank per step; first step of each
    attempt left out as warm-up)."""

    ckpt_s: float  # stall_s + step_effect_s: the C the model gets
    stall_s: float  # mean staging stall per checkpoint
    step_effect_s: float  # mean step time after a checkpoint minus otherwise, clipped at 0
    ckpt_cycle_s: float | None  # cross-check: step-to-step wall time after a checkpoint - else
    restart_s: float  # mean detect + restart + restore per failure: the R the model gets
    step_s: float  # median step time
    startup_s: float  # launch -> first step began (a fixed cost of every real run)
    tail_s: float  # last step -> job ended (final blocking checkpoint, exit)
    failures: int
    checkpoints: int
    injected_kill: bool  # the scenario had no failure to time, so tune added one
    wall_s: float
    goodput: float
    run_dir: str


def scenario_mtbf_s(s: Scenario) -> float | None:
    """The job MTBF implied by the scenario's random failures: rates of independent
    ``mtbf_s`` faults that stop the job add up."""
    rates = [1 / f.mtbf_s for f in s.faults if f.mtbf_s and f.kind in STOPPING_KINDS]
    return 1 / sum(rates) if rates else None


def _edit(s: Scenario, **changes: Any) -> Scenario:
    from chaos.scenario import parse_scenario

    data = s.model_dump(by_alias=True, mode="json", exclude_none=True)
    for path, value in changes.items():
        node = data
        *parents, last = path.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    return parse_scenario(data, path=f"<{s.name}, edited by chaos tune>")


def with_kill(s: Scenario) -> Scenario:
    """A copy of ``s`` with a kill of the last rank at the middle step, to time a restart."""
    if s.trainer.steps < 2:
        raise TuneError(f"scenario {s.name}: {s.trainer.steps} step(s) is too short to time "
                        "a restart; give it at least 2 steps")
    kill = {"kind": "kill_rank", "rank": s.trainer.parallel.world_size - 1,
            "at_step": s.trainer.steps // 2}
    faults = [f.model_dump(mode="json", exclude_none=True) for f in s.faults]
    return _edit(s, faults=[*faults, kill])


def _steps(record: RunRecord) -> dict[int, dict[int, tuple[float, float]]]:
    """attempt -> step -> (end time, seconds), slowest rank."""
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for e in record.events:
        if e["event"] == "step_end":
            t, sec = out.setdefault(e["attempt"], {}).get(e["step"], (0.0, 0.0))
            out[e["attempt"]][e["step"]] = (max(t, e["t"]), max(sec, e["seconds"]))
    return out


def costs_from_record(record: RunRecord, *, injected_kill: bool = False, run_dir: str = ""
                      ) -> Measured:
    """C, R, step time, start-up and tail from a finished run (DESIGN 4.3 measurements)."""
    from chaos import measure

    ckpts = measure.checkpoints(record)
    if not ckpts:
        raise MeasureError("the run took no checkpoint, so its cost cannot be measured")
    staged = {(c["attempt"], c["step"]) for c in ckpts if c["stall_s"] is not None}
    by_attempt = _steps(record)
    after: list[float] = []
    other: list[float] = []
    cycle_after: list[float] = []
    cycle_other: list[float] = []
    for attempt, steps in by_attempt.items():
        for step in sorted(steps)[1:]:  # the first step of an attempt is warm-up
            t, sec = steps[step]
            is_after = (attempt, step - 1) in staged
            (after if is_after else other).append(sec)
            if step - 1 in steps:
                (cycle_after if is_after else cycle_other).append(t - steps[step - 1][0])
    if not other:
        raise MeasureError("the run has too few steps to time one (need > 1 per attempt)")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    stall = mean([c["stall_s"] for c in ckpts if c["stall_s"] is not None] or [0.0])
    effect = max(mean(after) - mean(other), 0.0) if after else 0.0
    cycle = (max(mean(cycle_after) - mean(cycle_other), 0.0)
             if cycle_after and cycle_other else None)
    timed = [t for t in (measure.fault_timings(record, i) for i in record.injections)
             if t.kind in STOPPING_KINDS and t.restore_s is not None]
    if not timed:
        raise MeasureError(f"no failure of the run was followed by a restart and restore, so R "
                           f"cannot be measured; see {run_dir or 'the run folder'}/torchrun.log")
    first = by_attempt[min(by_attempt)]
    t1, sec1 = first[min(first)]
    last_attempt = by_attempt[max(by_attempt)]
    return Measured(
        ckpt_s=stall + effect, stall_s=stall, step_effect_s=effect, ckpt_cycle_s=cycle,
        restart_s=mean([t.detect_s + t.restart_s + t.restore_s for t in timed]),  # type: ignore[operator]
        step_s=float(np.median(after + other)), startup_s=max(t1 - sec1 - record.started_t, 0.0),
        tail_s=max(record.ended_t - last_attempt[max(last_attempt)][0], 0.0),
        failures=len(timed), checkpoints=len(ckpts), injected_kill=injected_kill,
        wall_s=record.wall_s, goodput=measure.goodput(record), run_dir=run_dir)


def _run(s: Scenario, folder: Path) -> RunRecord:
    from chaos.runner import run_scenario

    record = run_scenario(s, folder / "run", s.checkpoint.url or str(folder / "ckpt"))
    if record.returncode != 0:
        raise MeasureError(f"scenario {s.name}: the run failed (code {record.returncode}); "
                           f"see {folder / 'run' / 'torchrun.log'}")
    return record


def measure_costs(s: Scenario, folder: Path, progress: Callable[[str], None] = print
                  ) -> Measured:
    """Run the scenario once and measure. Random arrivals may all miss a short run, so
    unless a failure is certain (a step- or checkpoint-triggered one), a kill is added."""
    injected = not any(f.kind in STOPPING_KINDS and not f.mtbf_s for f in s.faults)
    if injected:
        s = with_kill(s)
        kill = s.faults[-1]
        progress(f"measure: no certain failure in the scenario to time R; added kill_rank of "
                 f"rank {getattr(kill, 'rank', None)} at step {kill.at_step}")
    progress(f"measure: running {s.name} ({s.trainer.steps} steps, every "
             f"{s.checkpoint.every_steps}) in {folder}")
    record = _run(s, folder)
    return costs_from_record(record, injected_kill=injected, run_dir=str(folder / "run"))


def sweep_every(recommended: int, steps: int) -> list[int]:
    """Three intervals around the recommendation (half, it, double) that fit in the run."""
    return sorted({min(max(1, e), max(steps - 1, 1))
                   for e in (recommended // 2, recommended, recommended * 2)})


def sweep(s: Scenario, costs: Costs, measured: Measured, folder: Path, *, every: list[int],
          steps: int, mtbf_from_scenario: bool,
          progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Short real runs at each ``every_steps``, failures at the MTBF; measured goodput vs the
    model's prediction for that run (its start-up and tail included: the runs are short)."""
    from chaos import measure

    if mtbf_from_scenario:
        faults = [f.model_dump(mode="json", exclude_none=True) for f in s.faults
                  if f.mtbf_s and f.kind in STOPPING_KINDS]
    else:
        faults = [{"kind": "kill_rank", "rank": "random", "mtbf_s": costs.mtbf_s}]
    assert costs.step_s is not None
    rows = []
    for e in every:
        run_s = _edit(s, trainer__steps=steps, checkpoint__every_steps=e, faults=faults,
                      checkpoint__url=None)
        progress(f"sweep: every {e} steps, {steps} steps, MTBF {costs.mtbf_s:.4g} s")
        record = _run(run_s, folder / f"every_{e}")
        tau = e * costs.step_s
        model = expected_goodput(tau, costs.ckpt_s, costs.restart_s, costs.mtbf_s)
        work = steps * costs.step_s
        predicted = work / (measured.startup_s + measured.tail_s + work / model)
        got = measure.goodput(record)
        rows.append({"every_steps": e, "interval_s": tau, "steps": steps,
                     "wall_s": record.wall_s, "failures": sum(
                         1 for i in record.injections
                         if i.kind in STOPPING_KINDS and not i.skipped),
                     "measured_goodput": got, "predicted_goodput": predicted,
                     "model_goodput": model, "gap": got - predicted})
    return rows
