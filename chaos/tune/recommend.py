"""``chaos tune`` end to end: costs (given, or measured on a scenario), the simulated
recommendation, the projection to other scales and the confirming sweep, as one document."""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from antifragile.chaos.report import strict_json
from antifragile.chaos.scenario import load_scenario
from antifragile.chaos.tune.measure import (
    Measured,
    measure_costs,
    scenario_mtbf_s,
    sweep,
    sweep_every,
)
from antifragile.chaos.tune.model import (
    MIN_SECONDS,
    Costs,
    Distribution,
    MeasureError,
    TuneError,
    check_seconds,
    project,
    scale_mtbfs,
)
from antifragile.chaos.tune.simulate import check_simulation, plot, tune


def recommend(scenario: str | None, mtbf_s: float | None, ckpt_cost_s: float | None,
              restart_s: float | None, step_s: float | None, gpus: int | None,
              gpu_mtbf_h: float | None, dist: Distribution, shape: float, schedules: int,
              seed: int, do_sweep: bool, every: list[int] | None, sweep_steps: int | None,
              out: Path | None, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``tune.json`` document: measured or given costs, the recommendation, the
    projection and the sweep. Raises TuneError (bad input) or MeasureError (a run failed)."""
    if gpus is not None and gpu_mtbf_h is None:
        raise TuneError("--gpus needs --gpu-mtbf-h (the MTBF of one GPU, in hours)")
    if gpu_mtbf_h is not None and not (math.isfinite(gpu_mtbf_h) and gpu_mtbf_h > 0):
        raise TuneError(f"--gpu-mtbf-h must be a finite number > 0 hours, got {gpu_mtbf_h}")
    if gpus is not None and gpus < 1:
        raise TuneError(f"--gpus must be >= 1, got {gpus}")
    if gpu_mtbf_h is not None:
        scale_mtbfs(gpu_mtbf_h, gpus)
    if mtbf_s is not None:  # checked before a scenario is run to measure the costs (minutes)
        check_seconds("MTBF", mtbf_s, strict=True, option="--mtbf-s")
    if sweep_steps is not None and sweep_steps < 2:
        raise TuneError(f"--sweep-steps must be >= 2, got {sweep_steps}")
    for option, value in (("--sweep-every", every), ("--sweep-steps", sweep_steps)):
        if value is not None and not do_sweep:
            raise TuneError(f"{option}: only with --sweep (it chooses the sweep's runs)")
    check_simulation(schedules, shape)  # before a scenario is run to measure the costs
    doc: dict[str, Any] = {}
    measured = s = None
    from_scenario = False
    clamped = ""
    if scenario is None:
        if do_sweep:
            raise TuneError("--sweep runs a scenario: give SCENARIO.yaml")
        if ckpt_cost_s is None:
            raise TuneError("give a scenario to measure, or --ckpt-cost-s and --mtbf-s "
                                  "for the model alone")
        source = "--mtbf-s"
        if mtbf_s is None and gpus is not None and gpu_mtbf_h is not None:
            mtbf_s, source = gpu_mtbf_h * 3600 / gpus, f"{gpu_mtbf_h:g} h / {gpus} GPUs"
        if mtbf_s is None:
            raise TuneError("model-only mode needs --mtbf-s (or --gpus and --gpu-mtbf-h)")
        for flag, what, seconds, strict in (
                ("--ckpt-cost-s", "checkpoint cost", ckpt_cost_s, True),
                ("--restart-s", "restart cost", restart_s, False),
                ("--step-s", "step time", step_s, True)):
            if seconds is not None:
                check_seconds(what, seconds, strict=strict, option=flag)
        costs = Costs(ckpt_s=ckpt_cost_s, restart_s=restart_s or 0.0, mtbf_s=mtbf_s,
                            step_s=step_s)
        doc["mode"] = "model only"
    else:
        given = [f for f, v in (("--ckpt-cost-s", ckpt_cost_s), ("--restart-s", restart_s),
                                ("--step-s", step_s)) if v is not None]
        if given:
            raise TuneError(f"{', '.join(given)}: these are measured when a scenario is "
                                  "given; drop them, or drop the scenario for model-only mode")
        s = load_scenario(scenario)
        if s.is_command:
            raise TuneError(f"{scenario}: chaos tune varies the built-in trainer's steps and "
                            "checkpoint interval; a command trainer decides its own (measure "
                            "it with chaos run, then tune with --ckpt-cost-s and --mtbf-s)")
        source = "--mtbf-s"
        from_scenario = mtbf_s is None and scenario_mtbf_s(s) is not None
        if from_scenario:
            mtbf_s, source = scenario_mtbf_s(s), f"{scenario}: faults' mtbf_s"
        if mtbf_s is None and gpus is not None and gpu_mtbf_h is not None:
            mtbf_s, source = gpu_mtbf_h * 3600 / gpus, f"{gpu_mtbf_h:g} h / {gpus} GPUs"
        if mtbf_s is None:
            raise TuneError(f"{scenario}: no fault with mtbf_s that stops the job, so "
                                  "there is no failure rate to tune for; give --mtbf-s")
        if sweep_steps is not None:  # before the measuring run (minutes), not after it
            _check_sweep_steps(sweep_steps, s.time_limit_s)
        with _folder(out, "measure") as folder:
            measured = measure_costs(s, folder, progress)
        ckpt_s = measured.ckpt_s
        if 0 <= ckpt_s < MIN_SECONDS:  # a stall that rounds to nothing: tune at the bound
            ckpt_s = MIN_SECONDS
            clamped = (f"the measured checkpoint cost {measured.ckpt_s:g} s is below the "
                       f"model's smallest, {MIN_SECONDS:g} s, and was tuned as that: "
                       "checkpoints cost next to nothing here")
        try:
            costs = Costs(ckpt_s=ckpt_s, restart_s=measured.restart_s,
                          mtbf_s=mtbf_s, step_s=measured.step_s)
        except TuneError as exc:  # nothing the user gave: the run measured it
            raise MeasureError(f"{measured.run_dir}: the run measured a value the model "
                               f"cannot take: {exc}") from None
        doc["mode"] = f"measured on {scenario}"
    progress(f"simulating {schedules} failure schedules per interval (seed {seed})")
    tuning = tune(costs, dist=dist, shape=shape, schedules=schedules, seed=seed)
    doc.update(tuning.as_dict())
    doc["mtbf_source"] = source
    if clamped:
        doc["notes"].append(clamped)
    persist_s = measured.persist_s if measured else None
    if persist_s is not None and persist_s >= doc["recommended_interval_s"]:
        doc["notes"].append(
            f"a save took {persist_s:.3g} s on average to commit after its stall, not less "
            f"than the recommended interval ({doc['recommended_interval_s']:.3g} s): the "
            "engine would refuse a save while the previous one persists, so checkpoints "
            "would be taken less often than recommended, and a failure before a commit loses "
            "one interval more than the model counts (C is the stall alone); take an "
            "interval longer than the commit time, or make the persist faster")
    rec = doc["recommended_every_steps"]
    if s is not None and rec is not None and rec >= s.trainer.steps:
        doc["notes"].append(f"every_steps {rec} is not shorter than the scenario's "
                            f"{s.trainer.steps} steps: this run would checkpoint only at its end")
    doc["measurement"] = asdict(measured) if measured else None
    doc["gpu_mtbf_h"] = gpu_mtbf_h
    doc["projection"] = project(costs, gpu_mtbf_h, gpus) if gpu_mtbf_h else None
    doc["sweep"] = None
    if do_sweep:
        assert s is not None and measured is not None and costs.step_s is not None
        steps = sweep_steps or max(s.trainer.steps, round(3 * costs.mtbf_s / costs.step_s))
        _check_sweep_length(steps, costs.step_s, measured, explicit=sweep_steps is not None,
                            limit_s=s.time_limit_s)
        with _folder(out, "sweep") as folder:
            doc["sweep"] = sweep(
                s, costs, measured, folder, every=every or sweep_every(rec, steps),
                steps=steps, mtbf_from_scenario=from_scenario, seed=seed, progress=progress)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        doc["out"] = str(out)
        path = out / "tune.json"
        try:
            path.write_text(strict_json(doc, indent=2))
            path = out / "goodput.png"
            plot(tuning, path, doc["sweep"])
        except OSError as exc:  # a full disk, a folder where the file goes
            for name in ("tune.json", "goodput.png"):  # none cut short, none without the other
                with contextlib.suppress(OSError):
                    (out / name).unlink(missing_ok=True)
            raise TuneError(f"{path}: cannot be written: {exc.strerror or exc}") from None
    return doc


def _check_sweep_steps(steps: int, limit_s: float) -> None:
    """Refuse a ``--sweep-steps`` that no step time could fit in a run's time limit (the
    scenario's ``time_limit_s``): even at the model's shortest step (:data:`MIN_SECONDS`) its
    training alone would pass it. Known before the measuring run; :func:`_check_sweep_length`
    checks with the measured step."""
    most = int(limit_s / MIN_SECONDS)
    if steps > most:
        raise TuneError(f"--sweep-steps {steps}: a sweep run of that many steps would pass "
                        f"a run's time limit of {limit_s:.0f} s (time_limit_s) even at "
                        f"{MIN_SECONDS:g} s a step; give --sweep-steps {most} or fewer (the "
                        "bound for the measured step time is given once it is measured)")


def _check_sweep_length(steps: int, step_s: float, measured: Measured, *,
                        explicit: bool, limit_s: float) -> None:
    """Refuse a sweep whose runs' training alone would pass a run's time limit (the
    scenario's ``time_limit_s``): each would be killed there, and the first only after the
    runs before it (the default length is about three MTBFs: a long MTBF asks for hours).
    Checked once the step time is measured."""
    run_s = measured.startup_s + steps * step_s + measured.tail_s
    if run_s <= limit_s:
        return
    fixed_s = measured.startup_s + measured.tail_s
    fitting = int((limit_s - fixed_s) / step_s)
    given = (f"--sweep-steps {steps}" if explicit else
             f"{steps} steps (about three MTBFs, the default)")
    said = (f"--sweep: each run of {given} at the measured {step_s:.3g} s a step would last at "
            f"least {run_s:.0f} s, past a run's time limit of {limit_s:.0f} s (time_limit_s)")
    if fitting < 2:  # --sweep-steps takes 2 at least
        raise TuneError(f"{said}; no sweep run fits: the measured start-up "
                        f"({measured.startup_s:.0f} s) and tail ({measured.tail_s:.0f} s) with "
                        f"2 steps already take {fixed_s + 2 * step_s:.0f} s; tune without "
                        "--sweep, or make the scenario start and finish faster")
    raise TuneError(f"{said}; give --sweep-steps {fitting} or fewer (or a shorter --mtbf-s)")


class _folder:
    """``out/<name>`` when an output folder is given, else a temporary one, removed after
    unless a run failed (its log is there); one left empty (input refused before any run)
    is removed whatever happened."""

    def __init__(self, out: Path | None, name: str) -> None:
        self.temporary = out is None
        self.name = name
        self.path = out / name if out is not None else None

    def __enter__(self) -> Path:
        """The folder, made now; one that cannot be (a file there in a reused ``--out``, a
        temporary folder that cannot be made) is bad input naming it, before any run."""
        try:
            if self.path is None:
                self.path = Path(tempfile.mkdtemp(prefix=f"chaos-tune-{self.name}-"))
            else:
                self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            where = self.path or exc.filename or "a temporary folder"
            raise TuneError(f"{where}: the folder for the {self.name} run(s) cannot be made: "
                            f"{exc.strerror or exc}") from None
        return self.path

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if not self.temporary or self.path is None:
            return
        if kind is None:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # not empty: what the failed run left
                self.path.rmdir()
