"""``chaos run``: the reference run, the faulty run, measurements, verdict and report."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from antifragile.chaos.faults import Injection
from antifragile.chaos.infra.s3 import RunStorage, run_storage
from antifragile.chaos.observe import checker, measure
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.report import document as report
from antifragile.chaos.report import plots
from antifragile.chaos.run.runner import run_scenario
from antifragile.chaos.run.status import RunStatus
from antifragile.chaos.scenario import Scenario


@dataclass(slots=True)
class Outcome:
    out: Path
    report: dict[str, Any]

    @property
    def verdict(self) -> str:
        """``pass``, ``fail`` or ``skipped`` (see ``observe.checker``)."""
        return str(self.report["verdict"]["verdict"])

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


def _reference_key(s: Scenario) -> str:
    """Only what determines the final state (faults, expectations, recovery and detection
    settings do not), and the checkpoint format it is stored in (a cached reference of an
    older format could not be read)."""
    from antifragile.engine._paths import FORMAT_VERSION

    trainer = s.trainer.model_dump(exclude={"recovery", "spares", "hang_timeout_s",
                                            "collective_timeout_s"})
    config = {"trainer": trainer, "seed": s.seed, "format": FORMAT_VERSION,
              "checkpoint": {"every_steps": s.checkpoint.every_steps,
                             "engine": s.checkpoint.engine}}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def reference_cache() -> Path:
    root = os.environ.get("ANTIFRAGILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "antifragile")
    return Path(root) / "reference"


def _ensure_reference(s: Scenario, progress: Callable[[str], None]) -> str:
    """The fault-free run's checkpoint folder, from the cache or run now."""
    folder = reference_cache() / _reference_key(s)
    done = folder / "DONE"
    if done.exists():
        progress(f"reference: cached ({folder})")
        return str(folder / "ckpt")
    shutil.rmtree(folder, ignore_errors=True)
    progress("reference: running the fault-free run")
    record = run_scenario(s, folder, str(folder / "ckpt"), faults=False)
    if record.returncode != 0:
        raise RuntimeError(f"the fault-free reference run failed (code {record.returncode}); "
                           f"see {folder / 'torchrun.log'}")
    done.write_text(json.dumps({"scenario": s.name, "finished": time.time()}))
    return str(folder / "ckpt")


def _final_step(record: RunRecord) -> int | None:
    steps = [e["step"] for e in record.events if e["event"] == "step_end"]
    return max(steps) if steps else None


def run(s: Scenario, out: Path, *, reference: bool = True,
        progress: Callable[[str], None] = print,
        status: Callable[[RunStatus], None] | None = None) -> Outcome:
    """The whole ``chaos run``: reference, faulty run, measurements, verdict, report files.
    ``progress`` gets notes (one line each); ``status`` the step-by-step state, if given."""
    out.mkdir(parents=True, exist_ok=True)
    for previous in (out / "run", out / "ckpt"):  # a previous run in this folder: not resumed
        if previous.exists():
            shutil.rmtree(previous)
    with run_storage(s, out, progress) as storage:  # S3 (and its fault proxy) for the whole run
        return _run(s, out, storage, reference=reference, progress=progress, status=status)


def _run(s: Scenario, out: Path, storage: RunStorage, *, reference: bool,
         progress: Callable[[str], None],
         status: Callable[[RunStatus], None] | None) -> Outcome:
    ckpt_url = storage.url
    reference_url = _ensure_reference(s, progress) if reference else None

    recovered: set[int] = set()  # attempts that restored a checkpoint after a failure
    first_step: dict[int, tuple[float, int]] = {}  # attempt -> (time, step) of its first step

    def on_event(e: dict[str, Any], injections: list[Injection]) -> None:
        if e["event"] == "step_end" and e["rank"] == 0:
            t0, step0 = first_step.setdefault(e["attempt"], (e["t"], e["step"]))
            rate = (e["step"] - step0) / (e["t"] - t0) if e["t"] > t0 else 0.0
            if status is not None:
                status(RunStatus(name=s.name, step=e["step"], total_steps=s.trainer.steps,
                                 attempt=e["attempt"], faults_injected=len(injections),
                                 recoveries=len(recovered),
                                 eta_s=(s.trainer.steps - e["step"]) / rate if rate else None))
        elif e["event"] == "restore_end" and e["rank"] == 0:
            recovered.add(e["attempt"])
            progress(f"attempt {e['attempt']}: restored step {e['step']} in "
                     f"{e['seconds']:.2f} s")
        elif e["event"] == "hang_detected":
            progress(f"rank {e['rank']}: hung ({e['how']}, no progress for "
                     f"{e['stall_s']:.1f} s): killed by its supervisor")
        elif e["event"] == "recovery_begin" and e["rank"] == 0:
            progress(f"attempt {e['attempt']}: failed, re-forming in process")

    progress(f"run: {s.name} ({s.trainer.parallel.world_size} ranks, {len(s.faults)} faults)")
    record = run_scenario(s, out / "run", ckpt_url, on_event=on_event, storage=storage)
    window_s = measure.detection_window_s(s)
    timings = [measure.fault_timings(record, i, window_s=window_s) for i in record.injections]
    # After a fault on storage, every committed step left must read back intact (no torn
    # commit); checked now, while the run's S3 (a local cluster) still exists.
    committed = checker.verify_committed(ckpt_url) if any(
        i.kind in measure.STORAGE_FAULTS and not i.skipped for i in record.injections) else None
    verdict = checker.judge(s, returncode=record.returncode, timings=timings,
                            final_step=_final_step(record), faulty_url=ckpt_url,
                            reference_url=reference_url,
                            final_committed=checker.final_committed(
                                s.checkpoint.engine, ckpt_url, s.trainer.steps),
                            committed=committed)
    doc = {
        "scenario": s.model_dump(by_alias=True, mode="json"),
        "environment": report.environment(),
        "run": {"wall_s": record.wall_s, "goodput": measure.goodput(record),
                "attempts": 1 + max((e["attempt"] for e in record.events), default=0),
                "final_step": _final_step(record), "returncode": record.returncode,
                "checkpoint_url": ckpt_url, "reference_url": reference_url},
        "faults": measure.as_dicts(timings),
        "checkpoints": measure.checkpoints(record),
        "committed_verified": None if committed is None
        else {str(step): problems for step, problems in sorted(committed.items())},
        "losses": measure.losses(record),
        "verdict": checker.summary(verdict),
        "timeline": report.timeline(record),
        "reference_losses": report.reference_losses(Path(reference_url).parent)
        if reference_url else [],
    }
    report.write_json(out, doc)
    figures = plots.render_all(doc, out)  # never raises: a failed plot carries its error
    report.write_markdown(out, doc, figures)
    report.write_html(out, doc, figures)
    return Outcome(out, doc)
