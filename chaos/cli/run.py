"""``chaos run``, ``chaos validate`` and ``chaos list``: one scenario, checked or run."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from antifragile.chaos.cli.common import (
    drop_if_empty,
    fail,
    fresh_folder,
    load,
    needs_reference,
    out_folder,
    out_path,
)
from antifragile.chaos.scenario import SCENARIOS, CommandSpec, ScenarioError, load_scenario


@click.command("validate")
@click.argument("file")
def validate(file: str) -> None:
    """Check a scenario file without running it."""
    s = load(file)
    faults = f"{len(s.faults)} fault{'' if len(s.faults) == 1 else 's'}"
    what = (f"command {' '.join(s.trainer.command)}" if isinstance(s.trainer, CommandSpec)
            else f"{s.trainer.steps} steps")
    click.echo(f"{file}: ok ({s.name}: {s.trainer.world_size} ranks, {what}, {faults})")


@click.command("list")
def list_scenarios() -> None:
    """The shipped scenarios, one line each."""
    for path in sorted(SCENARIOS.rglob("*.yaml")):
        try:
            s = load_scenario(path)
            line = s.description.strip().splitlines()[0] if s.description.strip() else ""
        except ScenarioError as exc:
            line = f"INVALID: {exc}"
        click.echo(f"{path.relative_to(SCENARIOS.parent)}  {line}")


@click.command("run")
@click.argument("file")
@click.option("--out", type=click.Path(file_okay=False), help="Report folder "
              "(default reports/<name>-<UTC time>); an earlier run's is reused, its run/ and "
              "ckpt/ deleted first.")
@click.option("--no-reference", is_flag=True, help="Skip the fault-free reference run "
              "(refused, exit 2, for a scenario that expects bitwise equality).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1),
              help="Override the scenario's seed.")
@click.option("--check-determinism", is_flag=True, help="First compare a second fault-free "
              "run with the reference: a trainer that is not deterministic gets the verdict "
              "'nondeterministic' (exit 4), not a failed recovery.")
def run_cmd(file: str, out: str | None, no_reference: bool, seed: int | None,
            check_determinism: bool) -> None:
    """Run a scenario: inject its faults, measure recovery, check nothing was lost.

    Exit 0 pass, 1 fail, 2 bad input (or a report that cannot be written: then none is),
    3 skipped (a fault could not be made here), 4 nondeterministic (--check-determinism: two
    fault-free runs differ), 5 no verdict: the run could not be made (the fault-free
    reference run failed or left no checkpoint, or a run went past its time limit)."""
    s = load(file, seed)
    if no_reference and s.expect.bitwise_equal_to_reference:
        fail(needs_reference(file))
    if no_reference and check_determinism:
        fail("--check-determinism compares a second fault-free run with the reference run, "
             "which --no-reference skips")
    from antifragile.chaos.cli.progress import Progress
    from antifragile.chaos.infra.s3 import StorageSetupError
    from antifragile.chaos.report.document import ReportError
    from antifragile.chaos.run.pipeline import run
    from antifragile.chaos.run.runner import ChaosRunError

    if out is not None:
        _check_not_foreign(out_path(out))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = (out_folder(out) if out is not None
              else fresh_folder(str(Path("reports") / f"{s.name}-{stamp}")))
    error: tuple[str, int] | None = None  # said once the display closed: the last line
    with Progress() as progress:
        try:
            outcome = run(s, folder, reference=not no_reference,
                          check_determinism=check_determinism, progress=progress,
                          status=progress.status)
        except StorageSetupError as exc:  # S3 that cannot be used, a folder already used
            drop_if_empty(folder)  # refused before the run: no folder claiming one
            error = f"{file}: {exc}", 2
        except ChaosRunError as exc:
            error = f"{file}: {exc}", RUN_ERROR_EXIT
        except ReportError as exc:  # a full disk: no report, none in part (as chaos suite)
            error = str(exc), 2
    if error is not None:
        fail(*error)
    v = outcome.report["verdict"]
    click.echo(f"{s.name}: {v['verdict'].upper()}  report: {folder / 'report.md'}")
    for reason in v["reasons"]:
        click.echo(f"  - {reason}")
    if outcome.report["run"]["returncode"] != 0:  # what the script said as it failed
        from antifragile.chaos.infra.logs import job_tail

        log = folder / "run" / "torchrun.log"
        click.echo(f"  the end of {log}:\n    {job_tail(log)}")
    for f in outcome.report["faults"]:
        click.echo(f"  {_fault_line(f)}")
    for what in outcome.report.get("not_measured") or []:
        click.echo(f"  not measured: {what}")
    raise SystemExit(EXIT_CODES[outcome.verdict])


#: what a run deletes from its folder before it starts (``pipeline.run``: never resumed)
_CLEARED = ("run", "ckpt", "determinism")


def _check_not_foreign(folder: Path) -> None:
    """Exit 2 if ``--out`` holds a folder a run clears, or a file its report writes over, but
    is no earlier run's folder (no ``report.json``, no ``run/torchrun.log`` of a run cut
    short): ``--out .`` in a project with a ``ckpt/`` or a ``report.md`` of its own would
    delete or overwrite it."""
    from antifragile.chaos.report.document import REPORT_FILES
    from antifragile.chaos.report.plots import NAMES

    if (folder / "report.json").is_file() or (folder / "run" / "torchrun.log").is_file():
        return
    for name in _CLEARED:
        if (folder / name).exists():
            fail(f"--out {folder}: holds {name}/, which a run deletes before it starts, and "
                 "is not a chaos run folder (no report.json); not deleting it (choose another "
                 "--out)")
    for name in (*REPORT_FILES, *NAMES):
        if (folder / name).exists():
            fail(f"--out {folder}: holds {name}, which a run writes over, and is not a chaos "
                 "run folder (no report.json); not overwriting it (choose another --out)")


#: ``chaos run``'s exit code per verdict; 2 is bad input (before anything runs).
EXIT_CODES = {"pass": 0, "fail": 1, "skipped": 3, "nondeterministic": 4}
#: no verdict: the run could not be made (``ChaosRunError``: a failed reference run, a time limit)
RUN_ERROR_EXIT = 5


def _fault_line(f: dict[str, Any]) -> str:
    if f["skipped"]:
        return f"{f['kind']}: skipped ({f['skipped']})"
    if not f.get("effect_observed"):
        return f"{f['kind']} {_at(f)}: NO EFFECT: {f.get('effect')}"
    if f.get("outage"):
        o = f["outage"]
        stall = "-" if o["extra_stall_s"] is None else f"{o['extra_stall_s']:.2f} s"
        server = f"volume server {o['server']}, " if o.get("server") is not None else ""
        mode = f"{o['mode']}, " if o.get("mode") else ""
        return (f"{f['kind']} ({server}{mode}{o['duration_s']:g} s) {_at(f)}"
                f": training went on: {o['training_continued']}; "
                f"checkpoints delayed {o['checkpoints_delayed']}, failed "
                f"{o['checkpoints_failed']}, skipped {o['checkpoints_skipped']}; "
                f"extra stall {stall}")
    if f.get("ended_attempt") is None:  # had its effect without a restart (corrupt_shard...)
        return f"{f['kind']} {_at(f)}: {f['effect']}; recovery: none"
    if f["recovery_s"] is None and f.get("unmeasured"):
        return (f"{f['kind']}: the job restarted in {f['restart_s']:.2f} s after detection "
                f"in {f['detect_s']:.2f} s; recovery not measured")
    if f["recovery_s"] is None and f.get("interrupted_by_t") is not None:
        return f"{f['kind']} {_at(f)}: recovery interrupted by the next fault"
    if f["recovery_s"] is None:
        return f"{f['kind']} {_at(f)}: recovery not observed"
    lost = "not measured" if f["lost_steps"] is None else f["lost_steps"]
    return f"{f['kind']} {_at(f)}: recovery {f['recovery_s']:.2f} s, lost steps {lost}"


def _at(f: dict[str, Any]) -> str:
    """Where the fault hit: its step, or (a time-triggered fault before the first step, a
    script without the probe) that no step was known; report.md shows "-"."""
    step = f.get("injected_step")
    return "(no step reported yet)" if step is None else f"at step {step}"
