"""``chaos run``: the reference run, the faulty run, measurements, verdict and report."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from antifragile.chaos.faults import Injection
from antifragile.chaos.infra.logs import job_tail
from antifragile.chaos.infra.s3 import RunStorage, run_storage
from antifragile.chaos.observe import checker, figures, measure
from antifragile.chaos.observe.effects import STORAGE_FAULTS
from antifragile.chaos.observe.record import EventTail
from antifragile.chaos.report import document as report
from antifragile.chaos.run.runner import ChaosRunError, run_scenario
from antifragile.chaos.run.status import RunStatus, StatusTracker
from antifragile.chaos.scenario import CommandSpec, Scenario, python_runs
from antifragile.trainer.events import read_events


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
    settings do not): the settings, the torch and the other installed libraries that compute
    and store it, the trainer's, the engine's, the probe's and the launcher's code, the
    processor it runs on (other kernels, other bits) and the checkpoint format it is stored
    in (a cached reference of an older format could not be read). A command trainer's key
    also holds the content of every file its command names and of the modules its script
    can import beside it (an edited script is a new reference); the built-in trainer's,
    what its ``train`` entry holds (a reference saved with fewer entries differs in it)."""
    import torch

    from antifragile.engine._paths import FORMAT_VERSION

    trainer = s.trainer.model_dump(exclude={"recovery", "spares", "hang_timeout_s",
                                            "collective_timeout_s"})
    config: dict[str, Any] = {"trainer": trainer, "seed": s.seed, "format": FORMAT_VERSION,
                              "torch": torch.__version__, "processor": _processor(),
                              "checkpoint": {"every_steps": s.checkpoint.every_steps,
                                             "engine": s.checkpoint.engine}}
    config["code"], config["installed"] = _antifragile_code(), _installed()
    if isinstance(s.trainer, CommandSpec):
        config["files"] = {str(f): _file_digest(f) for f in _command_files(s.trainer.command)}
    else:
        from antifragile.trainer.checkpoint import TRAIN_STATE_VERSION

        config["train_state"] = TRAIN_STATE_VERSION
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _processor() -> list[str]:
    """What picks the CPU kernels: the architecture, the processor's model (MKL chooses its
    code path by it) and the instruction set torch dispatches to. A shared cache (an NFS home,
    a CI cache restored on another runner) must not hand one machine's bits to another."""
    import platform

    import torch

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                            errors="replace") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.split(":", 1)[0].strip() in ("model name", "CPU part")), "")
    return [platform.machine(), model, str(torch.backends.cpu.get_cpu_capability())]


def _command_files(command: list[str]) -> list[Path]:
    """The files a command names (``conf.yaml``, ``--config=conf.yaml``), the module that
    ``python -m a.b`` runs, and the modules each script or module can import beside it."""
    named = [Path(value) for arg in command
             for value in dict.fromkeys([arg, arg.partition("=")[2]]) if os.path.isfile(value)]
    files = named + [m for f in named if f.suffix == ".py" for m in _importable_beside(f)]
    runs = python_runs(command)
    if runs is not None and runs[0] == "-m":  # sys.path[0] is the working directory
        files += _importable_beside(Path.cwd() / "__main__")
    return files


def _file_digest(path: Path) -> str:
    """The file's sha256, or why it cannot be read (a file this user may not read)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        return f"unreadable: {e.strerror}"


def _importable_beside(script: Path) -> list[Path]:
    """The modules a script can import from its own folder (``sys.path[0]``): the ``*.py``
    there and every ``*.py`` of its packages (folders with ``__init__.py``, and theirs), the
    script itself aside. A helper module edited is a new reference, as the script is."""
    folder = script.resolve().parent
    seen: set[Path] = set()  # a package that links to a folder above it is listed once

    def package(path: Path) -> list[Path]:
        seen.add(path.resolve())
        out = sorted(p for p in path.glob("*.py") if p.is_file())
        for sub in sorted(p for p in path.iterdir() if p.is_dir()):
            if (sub / "__init__.py").is_file() and sub.resolve() not in seen:
                out += package(sub)
        return out

    try:
        return [p for p in package(folder) if p != script.resolve()]
    except OSError:  # a folder that cannot be listed: the script's own content still counts
        return []


def code_digest(folder: Path) -> str:
    """A digest of every ``*.py`` under ``folder``: names and contents."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        h.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _antifragile_code() -> str:
    """The code of the built-in trainer and of the engine (a script's checkpoints are the
    engine's bytes), the probe (it runs in the script's process: its pause points, the
    events the reference's last step is read from, the steps it refuses) and the launcher
    (every rank's environment and torchrun command line), as this process imported them (a
    suite asks once)."""
    import antifragile.engine
    import antifragile.probe
    import antifragile.trainer
    from antifragile.chaos.infra import launch

    return "".join([*(code_digest(Path(package.__file__).parent)
                      for package in (antifragile.trainer, antifragile.engine)),
                    _file_digest(Path(antifragile.probe.__file__)),
                    _file_digest(Path(launch.__file__))])


@functools.cache
def _installed() -> str:
    """A digest of the installed distributions' names and versions: the libraries a script
    computes and stores its state with (transformers, torchdata, torchsnapshot, numpy). A
    distribution found twice on ``sys.path`` (an ``.egg-info`` in the working folder beside
    the installed one) counts once, at its first: the one ``importlib.metadata.version``
    answers, and the key does not depend on the folder ``chaos`` was started in."""
    import importlib.metadata

    found: dict[str, str] = {}
    for d in importlib.metadata.distributions():  # in sys.path's order
        found.setdefault(re.sub(r"[-_.]+", "-", str(d.metadata["Name"])).lower(), d.version)
    listed = "\n".join(f"{name}=={version}" for name, version in sorted(found.items()))
    return hashlib.sha256(listed.encode()).hexdigest()


def _run_failed(what: str, code: int, folder: Path) -> str:
    """Why a run failed: its exit code and the end of its torchrun log (all a CI log shows)."""
    log = folder / "torchrun.log"
    return f"{what} failed (code {code}); the end of {log}:\n    {job_tail(log)}"


def reference_cache() -> Path:
    root = os.environ.get("ANTIFRAGILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "antifragile")
    return Path(root) / "reference"


@contextlib.contextmanager
def _locked(folder: Path, progress: Callable[[str], None]) -> Iterator[None]:
    """Hold the cache entry ``folder`` alone (an exclusive flock on ``<folder>.lock``, which
    ends with its process): another chaos run that needs it waits for it to be made."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"reference: waiting for another chaos run making it ({folder})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _ensure_reference(s: Scenario, progress: Callable[[str], None]) -> str:
    """The fault-free run's checkpoint folder, from the cache or run now (by one chaos run at
    a time: see ``_locked``); ChaosRunError when that run fails or leaves no checkpoint
    (nothing to compare with: no verdict)."""
    folder = reference_cache() / _reference_key(s)
    if (folder / "DONE").exists():
        return _cached(s, folder, progress)
    with _locked(folder, progress):
        return _make_reference(s, folder, progress)


def _cached(s: Scenario, folder: Path, progress: Callable[[str], None]) -> str:
    """The cached reference's checkpoint folder, once it passes the checks a new one passes:
    the key covers what makes a reference, not chaos's checks of it (one cached before a
    check existed would be compared with for ever)."""
    progress(f"reference: cached ({folder})")
    ckpt = str(folder / "ckpt")
    try:
        if not os.path.isdir(ckpt):  # removed since: not the reference run's doing
            raise ChaosRunError(f"its checkpoint folder {ckpt} is gone")
        # the runner's reader: a line that is not an event is an EventLogError naming it
        _check_reference(s, EventTail(folder).poll(), ckpt, folder)
    except (ChaosRunError, OSError, ValueError) as exc:  # ValueError: a garbled event file
        raise ChaosRunError(f"the cached fault-free reference run ({folder}) cannot be used: "
                            f"{exc}; delete {folder} to run it again") from None
    return ckpt


def _make_reference(s: Scenario, folder: Path, progress: Callable[[str], None]) -> str:
    done = folder / "DONE"
    if done.exists():  # made by the chaos run this one waited for
        return _cached(s, folder, progress)
    shutil.rmtree(folder, ignore_errors=True)
    progress("reference: running the fault-free run")
    ckpt = str(folder / "ckpt")
    record = run_scenario(s, folder, ckpt, faults=False, note=progress)
    if record.returncode != 0:
        raise ChaosRunError(_run_failed("the fault-free reference run", record.returncode,
                                        folder))
    _check_reference(s, record.events, ckpt, folder)
    done.write_text(json.dumps({"scenario": s.name, "finished": time.time(),
                                "wall_s": record.wall_s, "goodput": figures.goodput(record)}))
    return ckpt


def _check_reference(s: Scenario, events: list[dict[str, Any]], ckpt: str,
                     folder: Path) -> None:
    """ChaosRunError unless the reference run that exited 0 with ``events`` left what a
    faulty run is compared with."""
    if s.is_command:
        _check_script_reference(s, events, ckpt, folder)
    # exit 0 with the final step's checkpoint missing: say so rather than compare with less
    elif not checker.final_committed(s.checkpoint.engine, ckpt, s.trainer.steps):
        raise ChaosRunError(f"the fault-free reference run left no committed "
                           f"{s.checkpoint.engine} checkpoint of its final step "
                           f"{s.trainer.steps} at {ckpt}; see {folder / 'torchrun.log'}")


def _check_script_reference(s: Scenario, events: list[dict[str, Any]], ckpt: str,
                            folder: Path) -> None:
    """ChaosRunError unless the script's reference run left a committed checkpoint, and no
    newer save of it failed: a final save skipped while the one before persisted leaves the
    step a run ends on to timing, and every faulty run failed against the one cached."""
    newest = checker.newest_committed(s.checkpoint.engine, ckpt)
    log = folder / "torchrun.log"
    if newest is None:
        raise ChaosRunError(f"the fault-free reference run left no committed "
                           f"{s.checkpoint.engine} checkpoint at {ckpt} ("
                           f"{checker.why_no_checkpoint(s.checkpoint.engine, ckpt)}); see {log}")
    lost = [e for e in events if e["event"] == "ckpt_failed" and e["step"] > newest]
    if lost:
        last = max(lost, key=lambda e: e["step"])
        raise ChaosRunError(f"the fault-free reference run's save of step {last['step']} did "
                           f"not commit ({last.get('error')}), so its newest committed "
                           f"checkpoint is step {newest}: the faulty run would be compared "
                           "with a step that timing chose; save the last step with "
                           f"blocking=True and let it commit before the script exits; see {log}")


def _reference_goodput(reference_url: str | None) -> float | None:
    """The fault-free run's goodput, as its cache entry recorded it (None: an older entry)."""
    if reference_url is None:
        return None
    try:
        value = json.loads((Path(reference_url).parent / "DONE").read_text()).get("goodput")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, float) else None


def _last_step(events: list[dict[str, Any]]) -> int | None:
    """The newest step the run reported (``step_end``); None when it reported none."""
    steps = [e["step"] for e in events if e["event"] == "step_end"]
    return max(steps) if steps else None


def _reference_last_step(reference_url: str | None) -> int | None:
    """The newest step the fault-free run reported, from its event files in the cache (None:
    no reference, or it reported no step)."""
    if reference_url is None:
        return None
    try:
        return _last_step(read_events(Path(reference_url).parent))
    except (OSError, ValueError):
        return None


def run(s: Scenario, out: Path, *, reference: bool = True, check_determinism: bool = False,
        progress: Callable[[str], None] = print,
        status: Callable[[RunStatus], None] | None = None) -> Outcome:
    """The whole ``chaos run``: reference, faulty run, measurements, verdict, report files.
    ``progress`` gets notes (one line each); ``status`` the step-by-step state, if given.
    ``check_determinism``: a second fault-free run is compared with the reference first."""
    if check_determinism and not reference:
        raise ValueError("check_determinism compares a second fault-free run with the "
                         "reference run: it needs reference=True")
    out.mkdir(parents=True, exist_ok=True)
    with run_storage(s, out, progress) as storage:  # S3 (and its fault proxy) for the whole run
        # an earlier run's, cleared once the storage is accepted: a refused one keeps it
        for previous in (out / "run", out / "ckpt", out / "determinism"):  # not resumed
            if previous.exists():
                shutil.rmtree(previous)
        report.remove_report(out)
        return _run(s, out, storage, reference=reference, check_determinism=check_determinism,
                    progress=progress, status=status)


def _determinism(s: Scenario, out: Path, reference_url: str,
                 progress: Callable[[str], None]) -> checker.Comparison:
    """A second fault-free run, compared with the reference bit for bit. One that fails is
    no evidence either way: ChaosRunError, as for the reference run."""
    progress("determinism: a second fault-free run")
    folder = out / "determinism"
    record = run_scenario(s, folder, str(folder / "ckpt"), faults=False, note=progress)
    if record.returncode != 0:
        raise ChaosRunError(_run_failed("the second fault-free run", record.returncode, folder))
    step = None if s.is_command else s.trainer.steps
    comparison = checker.determinism(s.checkpoint.engine, reference_url, str(folder / "ckpt"),
                                     step)
    found = comparison.error or (f"{len(comparison.differs)} entries differ, e.g. "
                                 f"{comparison.differs[:3]}")
    progress("determinism: " + ("the two fault-free runs are bitwise equal" if comparison.equal
                                else f"NOT deterministic: {found}"))
    return comparison


def _run(s: Scenario, out: Path, storage: RunStorage, *, reference: bool,
         check_determinism: bool, progress: Callable[[str], None],
         status: Callable[[RunStatus], None] | None) -> Outcome:
    ckpt_url = storage.url
    engine = s.checkpoint.engine
    reference_url = _ensure_reference(s, progress) if reference else None
    determinism = (_determinism(s, out, reference_url, progress)
                   if check_determinism and reference_url else None)
    # the step the run must end at: the built-in trainer's last, or the reference script's
    # newest committed checkpoint (None: no reference, a command trainer)
    expected_step = (s.trainer.steps if not isinstance(s.trainer, CommandSpec) else
                     checker.newest_committed(engine, reference_url) if reference_url else None)

    tracker = StatusTracker(s.name, expected_step)

    def on_event(e: dict[str, Any], injections: list[Injection]) -> None:
        now = tracker.status(e, len(injections))
        if now is not None:
            if status is not None:
                status(now)
        elif e["event"] == "restore_end" and e["rank"] == 0:
            took = "" if e.get("seconds") is None else f" in {e['seconds']:.2f} s"
            progress(f"attempt {e['attempt']}: restored step {e['step']}{took}")
        elif e["event"] == "hang_detected":
            progress(f"rank {e['rank']}: hung ({e['how']}, no progress for "
                     f"{e['stall_s']:.1f} s): killed by its supervisor")
        elif e["event"] == "recovery_begin" and e["rank"] == 0:
            progress(f"attempt {e['attempt']}: failed, re-forming in process")

    progress(f"run: {s.name} ({s.trainer.world_size} ranks, {len(s.faults)} faults)")
    record = run_scenario(s, out / "run", ckpt_url, on_event=on_event, storage=storage,
                          note=progress)
    window_s = measure.detection_window_s(s)
    timings = [measure.fault_timings(record, i, window_s=window_s) for i in record.injections]
    # After a fault on storage, every committed step left must read back intact (no torn
    # commit); checked now, while the run's S3 (a local cluster) still exists.
    committed = checker.verify_committed(ckpt_url, engine) if any(
        i.kind in STORAGE_FAULTS and not i.skipped for i in record.injections) else None
    last_step = reference_last_step = step_order = None
    if s.is_command:  # the final state is the newest committed checkpoint
        final_step = checker.newest_committed(engine, ckpt_url)
        final_committed = final_step is not None
        last_step, reference_last_step = (_last_step(record.events),
                                          _reference_last_step(reference_url))
        step_order = checker.steps_out_of_order(record.events)
    else:
        final_step = _last_step(record.events)
        final_committed = checker.final_committed(engine, ckpt_url, s.trainer.steps)
    verdict = checker.judge(s, returncode=record.returncode, timings=timings,
                            final_step=final_step, faulty_url=ckpt_url,
                            reference_url=reference_url, final_committed=final_committed,
                            committed=committed, expected_step=expected_step,
                            determinism=determinism, last_step=last_step,
                            reference_last_step=reference_last_step,
                            run_log=str(out / "run" / "torchrun.log"), step_order=step_order)
    goodput, reference_goodput = figures.goodput(record), _reference_goodput(reference_url)
    checkpoints = figures.checkpoints(record)
    doc = {
        "scenario": s.model_dump(by_alias=True, mode="json"),
        "environment": report.environment(),
        "run": {"wall_s": record.wall_s, "goodput": goodput,
                "reference_goodput": reference_goodput,
                # what the faults cost: 1.0 = as productive as the fault-free run
                "goodput_vs_reference": goodput / reference_goodput
                if goodput is not None and reference_goodput else None,
                "attempts": 1 + max((e["attempt"] for e in record.events), default=0),
                "final_step": final_step, "expected_step": expected_step,
                "returncode": record.returncode, "paused_s": record.paused_s,
                "spares": figures.spares(record),
                "checkpoint_cost": figures.checkpoint_cost(record, checkpoints),
                "checkpoint_url": ckpt_url, "reference_url": reference_url},
        "not_measured": measure.not_measured(record, timings),
        "differing_entries": verdict.differs,
        "determinism": None if determinism is None else {
            "deterministic": determinism.equal, "error": determinism.error,
            "differing_entries": determinism.differs},
        "faults": measure.as_dicts(timings),
        "checkpoints": checkpoints,
        "committed_verified": None if committed is None
        else {str(step): problems for step, problems in sorted(committed.items())},
        "losses": figures.losses(record),
        "verdict": checker.summary(verdict),
        "timeline": report.timeline(record),
        "reference_losses": report.reference_losses(Path(reference_url).parent)
        if reference_url else [],
    }
    report.write_report(out, doc)  # all or none; a failed plot carries its error
    return Outcome(out, doc)
