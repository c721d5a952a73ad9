"""Measuring C, R and the step time on a scenario's own configuration, and the confirming sweep.

One real run through :func:`antifragile.chaos.run.runner.run_scenario` gives the costs the
model needs; the sweep runs short real jobs around the recommended interval and reports how far
they sit from the model.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from antifragile.chaos.tune.model import Costs, MeasureError, TuneError, expected_goodput
from antifragile.chaos.tune.simulate import SPREAD_COVERAGE, run_spread

if TYPE_CHECKING:  # the tuning model stays importable without torch
    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.scenario import Scenario


STOPPING_KINDS = frozenset({"kill_rank", "hang_rank", "crash_during_save", "drop_link",
                            "host_down"})
"""Fault kinds that stop the job (the launcher restarts it): the failures M counts. A
corrupted shard or a storage outage costs a checkpoint, not the job."""


@dataclass(kw_only=True, slots=True)
class Measured:
    """Costs read from one real run's events (slowest rank per step; first step of each
    attempt left out as warm-up)."""

    ckpt_s: float  # stall_s + step_effect_s: the C the model gets
    stall_s: float  # mean staging stall per checkpoint
    # per checkpoint, the extra time of the steps that ran while it persisted (its threads
    # take the cores and the GIL) over the steps with none persisting, clipped at 0; where
    # that cannot be told (no commit timed, no step without a save persisting): the step
    # after a checkpoint against the others
    step_effect_s: float
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
    # mean time from a periodic save's stall to its commit (slowest rank; None: none
    # committed with a known time). Not in the model: a failure before the commit rolls back
    # one checkpoint further, and a save asked for while one persists is refused
    persist_s: float | None = None
    # the part of ``restart_s`` with the job down (detect + restart: no rank to fail), where
    # ``chaos run`` draws a failure's arrival again: a swept run can fail only in the rest
    down_s: float = 0.0


def scenario_mtbf_s(s: Scenario) -> float | None:
    """The job MTBF implied by the scenario's random failures: rates of independent
    ``mtbf_s`` faults that stop the job add up."""
    rates = [1 / f.mtbf_s for f in s.faults if f.mtbf_s and f.kind in STOPPING_KINDS]
    return 1 / sum(rates) if rates else None


def _edit(s: Scenario, **changes: Any) -> Scenario:
    from antifragile.chaos.scenario import parse_scenario

    data = s.model_dump(by_alias=True, mode="json", exclude_none=True)
    for path, value in changes.items():
        node = data
        *parents, last = path.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    return parse_scenario(data, path=f"<{s.name}, edited by chaos tune>")


def with_kill(s: Scenario) -> Scenario:
    """A copy of ``s`` with a kill of the last rank at the middle step, to time a restart;
    later where the first checkpoint is later, so that the restart has one to restore (the
    step after it: at its own step, an asynchronous save may not have committed)."""
    steps, every = s.trainer.steps, s.checkpoint.every_steps
    if steps < 2:
        raise TuneError(f"scenario {s.name}: {s.trainer.steps} step(s) is too short to time "
                        "a restart; give it at least 2 steps")
    if every + 1 >= steps:
        raise TuneError(f"scenario {s.name}: with checkpoint.every_steps {every} of {steps} "
                        "steps no step after a checkpoint comes before the last one, where a "
                        "kill would leave its restart a checkpoint to restore, so a restart "
                        f"cannot be timed; give it more than {every + 1} steps, or a shorter "
                        "checkpoint.every_steps")
    kill = {"kind": "kill_rank", "rank": s.trainer.parallel.world_size - 1,
            "at_step": max(steps // 2, every + 1)}
    faults = [f.model_dump(mode="json", exclude_none=True) for f in s.faults]
    return _edit(s, faults=[*faults, kill])


def _steps(record: RunRecord) -> dict[int, dict[int, tuple[float, float]]]:
    """attempt -> step -> (end time, seconds), slowest rank."""
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for e in record.events:
        if e["event"] == "step_end":
            t, sec = out.setdefault(e["attempt"], {}).get(e["step"], (0.0, 0.0))
            out[e["attempt"]][e["step"]] = (max(t, e["t"]), max(sec, e["seconds"] or 0.0))
    return out


def _model_goodput(record: RunRecord) -> float:
    """A run's goodput as the model counts it: the steps that count, each at the run's own
    median step time (a restart's warm-up step left out, as ``costs_from_record`` times a
    step), over the wall time. The slower steps beside a persist and the warm-ups are costs
    in the model (C, R), where the report's goodput counts their whole time as useful: swept
    runs measured above every range the model gave. The run's own pace, not the measuring
    run's: a run checkpointing less often is slowed less by its persists."""
    by_attempt = _steps(record)
    times = [steps[step][1] for steps in by_attempt.values() for step in sorted(steps)[1:]]
    counted = len({step for steps in by_attempt.values() for step in steps})
    wall = record.wall_s - record.paused_s
    return counted * float(np.median(times)) / wall if times and wall > 0 else 0.0


def costs_from_record(record: RunRecord, *, injected_kill: bool = False, run_dir: str = "",
                      window_s: float = 90.0) -> Measured:
    """C, R, step time, start-up and tail from a finished run (DESIGN 4.3 measurements).
    ``window_s``: ``detection_window_s`` of the scenario, within which a failure must have
    ended its attempt to count (as ``chaos run`` judges it)."""
    from antifragile.chaos.observe import figures, measure

    ckpts = figures.checkpoints(record)
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
    if not other and after:  # ``every_steps: 1``: no step shows the step time without one
        raise MeasureError("every step followed a checkpoint, so no step shows the step time "
                           "without one and the checkpoint's cost cannot be measured")
    if not other:
        raise MeasureError("the run has too few steps to time one (need > 1 per attempt)")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # the run's final blocking save waits for its whole persist: the job's shutdown (in
    # ``tail_s``), not a stall the loop pays every interval
    stalls = [c["stall_s"] for c in ckpts if c["stall_s"] is not None and not c.get("final")]
    if not stalls:
        raise MeasureError("the run staged only its final checkpoint, so the cost of one "
                           "taken every interval cannot be measured; give the scenario a "
                           "checkpoint.every_steps below its trainer.steps")
    stall = mean(stalls)
    persists = [c["persist_s"] for c in ckpts
                if c["committed"] and c["persist_s"] is not None and not c.get("final")]
    effect = _persist_slowdown(figures.persist_windows(record), ckpts, by_attempt, staged)
    if effect is None:
        effect = max(mean(after) - mean(other), 0.0) if after else 0.0
    cycle = (max(mean(cycle_after) - mean(cycle_other), 0.0)
             if cycle_after and cycle_other else None)
    timed = [t for t in (measure.fault_timings(record, i, window_s=window_s)
                         for i in record.injections)
             if t.kind in STOPPING_KINDS and t.restore_s is not None]
    if not timed:
        raise MeasureError(f"no failure of the run was followed by a restart and restore, so R "
                           f"cannot be measured; see {run_dir or 'the run folder'}/torchrun.log")
    restart_s = mean([t.detect_s + t.restart_s + t.restore_s for t in timed])
    first = by_attempt[min(by_attempt)]
    t1, sec1 = first[min(first)]
    last_attempt = by_attempt[max(by_attempt)]
    return Measured(
        ckpt_s=stall + effect, stall_s=stall, step_effect_s=effect, ckpt_cycle_s=cycle,
        restart_s=restart_s,
        step_s=float(np.median(after + other)), startup_s=max(t1 - sec1 - record.started_t, 0.0),
        tail_s=max(record.ended_t - last_attempt[max(last_attempt)][0], 0.0),
        failures=len(timed), checkpoints=len(ckpts), injected_kill=injected_kill,
        wall_s=record.wall_s, goodput=figures.goodput(record), run_dir=run_dir,
        persist_s=mean(persists) if persists else None,
        down_s=min(mean([t.detect_s + t.restart_s for t in timed]), restart_s))


def _persist_slowdown(persisting: dict[tuple[int, int], tuple[float, float]],
                      ckpts: list[dict[str, Any]],
                      by_attempt: dict[int, dict[int, tuple[float, float]]],
                      staged: set[tuple[int, int]]) -> float | None:
    """What each periodic save's persist cost the steps that ran meanwhile: their time over
    the mean of the steps during which no save persisted (nor right after one), summed and
    shared among the saves; None when no commit was timed or every step ran beside a save.
    ``persisting``: each save's window (``figures.persist_windows``, as the report's
    ``slowdown_s`` takes it)."""
    windows: dict[int, list[tuple[float, float]]] = {}
    for c in ckpts:
        key = (c["attempt"], c["step"])
        if c["committed"] and c["persist_s"] is not None and not c.get("final") \
                and key in persisting:
            windows.setdefault(c["attempt"], []).append(persisting[key])
    during: list[float] = []
    clean: list[float] = []
    for attempt, steps in by_attempt.items():
        spans = windows.get(attempt, [])
        for step in sorted(steps)[1:]:  # the first step of an attempt is warm-up
            t, sec = steps[step]
            if any(t > start and t - sec < end for start, end in spans):
                during.append(sec)
            elif (attempt, step - 1) not in staged:
                clean.append(sec)
    saves = sum(len(w) for w in windows.values())
    if not saves or not clean:
        return None
    return max((sum(during) - len(during) * sum(clean) / len(clean)) / saves, 0.0)


def _run(s: Scenario, folder: Path, progress: Callable[[str], None]) -> RunRecord:
    """One real run into ``folder``, on the scenario's storage as ``chaos run`` sets it up; its
    checkpoints start empty, as there (a run of an earlier tune with the same ``--out``, or
    a ``checkpoint.url`` already used, would be resumed from)."""
    from antifragile.chaos.infra.s3 import StorageSetupError, run_storage
    from antifragile.chaos.run import runner

    shutil.rmtree(folder / "ckpt", ignore_errors=True)
    try:
        with run_storage(s, folder, progress) as storage:
            record = runner.run_scenario(s, folder / "run", storage.url, storage=storage,
                                         note=progress)
    except StorageSetupError as exc:  # a used folder, S3 that cannot be used: bad input
        raise TuneError(f"scenario {s.name}: {exc}") from None
    except runner.ChaosRunError as exc:  # past its time limit: no figures to tune with
        raise MeasureError(f"scenario {s.name}: {exc}") from None
    if record.returncode != 0:
        raise MeasureError(f"scenario {s.name}: the run failed (code {record.returncode}); "
                           f"see {folder / 'run' / 'torchrun.log'}")
    return record


def measure_costs(s: Scenario, folder: Path, progress: Callable[[str], None] = print
                  ) -> Measured:
    """Run the scenario once and measure. Random arrivals may all miss a short run, so
    unless a failure is certain (a step- or checkpoint-triggered one on the first pass: one
    ``on_pass: 2`` or later lands only after another failure), a kill is added."""
    from antifragile.chaos.observe.measure import detection_window_s

    if s.checkpoint.every_steps == 1:  # known before the run: it could not measure C
        raise TuneError(f"scenario {s.name}: with checkpoint.every_steps 1 every step follows "
                        "a checkpoint, so no step shows the step time without one and the "
                        "checkpoint's cost cannot be measured; give it checkpoint.every_steps "
                        "2 or more")
    injected = not any(f.kind in STOPPING_KINDS
                       and f.trigger_step(s.checkpoint.every_steps) is not None
                       and f.on_pass == 1 for f in s.faults)
    if injected:
        s = with_kill(s)
        kill = s.faults[-1]
        progress(f"measure: no certain failure in the scenario to time R; added kill_rank of "
                 f"rank {getattr(kill, 'rank', None)} at step {kill.at_step}")
    progress(f"measure: running {s.name} ({s.trainer.steps} steps, every "
             f"{s.checkpoint.every_steps}) in {folder}")
    record = _run(s, folder, progress)
    return costs_from_record(record, injected_kill=injected, run_dir=str(folder / "run"),
                             window_s=detection_window_s(s))


def sweep_every(recommended: int, steps: int) -> list[int]:
    """Three intervals around the recommendation (half, it, double) that fit in the run."""
    return sorted({min(max(1, e), max(steps - 1, 1))
                   for e in (recommended // 2, recommended, recommended * 2)})


def sweep(s: Scenario, costs: Costs, measured: Measured, folder: Path, *, every: list[int],
          steps: int, mtbf_from_scenario: bool, seed: int = 0,
          progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Short real runs at each ``every_steps``, failures at the MTBF; measured goodput vs the
    model's prediction for that run (its start-up and tail included: the runs are short), and
    the range that :data:`SPREAD_COVERAGE` of such runs fall in: one run meets few failures."""
    from antifragile.chaos.observe import figures

    if mtbf_from_scenario:
        faults = [f.model_dump(mode="json", exclude_none=True) for f in s.faults
                  if f.mtbf_s and f.kind in STOPPING_KINDS]
    else:
        faults = [{"kind": "kill_rank", "rank": "random", "mtbf_s": costs.mtbf_s}]
    assert costs.step_s is not None
    rows = []
    for e in every:
        run_s = _edit(s, trainer__steps=steps, checkpoint__every_steps=e, faults=faults,
                      checkpoint__url=None, checkpoint__storage_options=None)
        progress(f"sweep: every {e} steps, {steps} steps, MTBF {costs.mtbf_s:.4g} s")
        record = _run(run_s, folder / f"every_{e}", progress)
        tau = e * costs.step_s
        # the run as ``chaos run`` makes it: no failure while the job is down
        model = expected_goodput(tau, costs.ckpt_s, costs.restart_s, costs.mtbf_s,
                                 down_s=measured.down_s)
        work = steps * costs.step_s
        # goodput 0: the model's expected wall time overflowed (an interval far longer than
        # the MTBF, from --sweep-every): so does this run's
        overhead = measured.startup_s + measured.tail_s
        predicted = work / (overhead + work / model) if model > 0 else 0.0
        walls = run_spread(work, tau, costs, down_s=measured.down_s, seed=seed)
        spread = ([work / (overhead + walls[1]), work / (overhead + walls[0])]
                  if walls is not None else [0.0, 0.0])
        got = _model_goodput(record)
        rows.append({"every_steps": e, "interval_s": tau, "steps": steps,
                     "wall_s": record.wall_s, "failures": sum(
                         1 for i in record.injections
                         if i.kind in STOPPING_KINDS and not i.skipped and not i.missed),
                     "measured_goodput": got, "report_goodput": figures.goodput(record),
                     "predicted_goodput": predicted,
                     "model_goodput": model, "gap": got - predicted,
                     "spread_goodput": spread, "spread_coverage": SPREAD_COVERAGE,
                     "within_spread": spread[0] <= got <= spread[1]})
    return rows
