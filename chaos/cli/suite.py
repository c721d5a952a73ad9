"""``chaos suite DIR``: every scenario of a folder, a table, ``summary.json``/``summary.html``.

Exit codes as for ``chaos run``: 0 every scenario passed and nothing regressed against the
baseline, 1 a scenario failed or a figure regressed, 3 nothing failed but a scenario was skipped
(a fault could not be made here; also when every scenario was), 2 bad input (no folder, no
scenarios, duplicate names, an unreadable baseline or one given twice, ``--no-reference``
with a scenario that expects bitwise equality), reported before anything runs, and a summary
that cannot be written (a full disk), after the table; 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP, once
the summary is written (the scenario stopped and those never run are failed entries).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import click

from antifragile.chaos import suite as suite_lib
from antifragile.chaos.cli.common import (
    drop_if_empty,
    fail,
    fresh_folder,
    needs_reference,
    out_folder,
    out_path,
    seconds_at_least_zero,
)


@click.command("suite")
@click.argument("folder", metavar="DIR")
@click.option("--out", type=click.Path(file_okay=False), help="Output folder: summary.json, "
              "summary.html and one report folder per scenario (default reports/suite-<UTC "
              "time>).")
@click.option("--baseline", "baselines", type=click.Path(dir_okay=False), multiple=True,
              metavar="PREV_SUMMARY",
              help="A previous summary.json: flag recovery or stall worse by more than 20% "
              "(and 1 s / 0.05 s), goodput lower by more than 5 points. Repeatable (the "
              "last nights' summaries): a figure regresses only when worse than every one.")
@click.option("--pattern", "patterns", multiple=True, metavar="GLOB",
              help="Only scenario files whose name or stem matches this glob (repeatable).")
@click.option("--recovery-floor-s", type=float, default=suite_lib.Tolerances().recovery_floor_s,
              show_default=True, help="Recovery differences smaller than this are noise.")
@click.option("--stall-floor-s", type=float, default=suite_lib.Tolerances().stall_floor_s,
              show_default=True, help="Stall differences smaller than this are noise.")
@click.option("--no-reference", is_flag=True, help="Skip the fault-free reference runs "
              "(refused, exit 2, if a scenario expects bitwise equality).")
def suite(folder: str, out: str | None, baselines: tuple[str, ...], patterns: tuple[str, ...],
          recovery_floor_s: float, stall_floor_s: float, no_reference: bool) -> None:
    """Run every scenario in DIR; exit 1 on a failure or a regression, 3 on a skipped
    scenario (and no failure)."""
    from antifragile.chaos.cli.progress import Progress

    seconds_at_least_zero("--recovery-floor-s", recovery_floor_s)
    seconds_at_least_zero("--stall-floor-s", stall_floor_s)
    if "" in baselines:  # an unset variable, --baseline "$PREV": not a suite without one
        fail("--baseline: empty; give a previous summary.json, or leave the option out to "
             "compare with none")
    try:
        previous = suite_lib.matching_baselines(suite_lib.load_baselines(baselines), patterns)
        files = suite_lib.discover(Path(folder), patterns)
    except suite_lib.SuiteError as exc:
        fail(str(exc))
    # the default folder is made now, of its own (two suites started in one second)
    out_dir = out_path(out) if out is not None else fresh_folder(
        str(Path("reports") / f"suite-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"))
    try:
        try:
            planned = suite_lib.plan(files, out_dir)
        except suite_lib.SuiteError as exc:
            fail(str(exc))
        if no_reference:
            for p in planned:
                if p.scenario is not None and p.scenario.expect.bitwise_equal_to_reference:
                    fail(needs_reference(str(p.file)))
    except SystemExit:
        if out is None:
            drop_if_empty(out_dir)  # refused before the suite ran: no folder claiming one
        raise
    out_folder(str(out_dir))
    started = time.monotonic()
    stopped: BaseException | None = None  # Ctrl-C, SIGTERM: raised once the summary is written
    try:
        with Progress() as progress:
            entries = suite_lib.run_suite(planned, out_dir, reference=not no_reference,
                                          progress=progress, status=progress.status)
    except suite_lib.SuiteInterrupted as exc:
        entries, stopped = exc.entries, exc.__cause__
    tol = suite_lib.Tolerances(recovery_floor_s=recovery_floor_s, stall_floor_s=stall_floor_s)
    compared = suite_lib.compare_many(entries, previous, tol=tol) if previous else None
    summary = suite_lib.build(entries, suite=folder, wall_s=time.monotonic() - started,
                              baseline=compared)
    _write_summary(out_dir, summary)
    click.echo(suite_lib.format_table(summary))
    click.echo(f"summary: {out_dir / 'summary.json'}  {out_dir / 'summary.html'}")
    if stopped is not None:
        raise stopped
    raise SystemExit(suite_lib.exit_code(summary))


def _write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    """summary.json, then summary.html; one that cannot be written (a full disk, a folder
    made read-only) is exit 2 naming it, after the table. It and those not yet written are
    removed: a file cut short, or an earlier suite's left in the reused ``--out`` (saying ok),
    must not pass for this suite's."""
    writers = [("summary.json", suite_lib.write_json), ("summary.html", suite_lib.write_html)]
    for i, (name, write) in enumerate(writers):
        try:
            write(out_dir, summary)
        except OSError as exc:
            for left, _ in writers[i:]:
                with contextlib.suppress(OSError):
                    (out_dir / left).unlink()
            click.echo(suite_lib.format_table(summary))
            fail(f"{out_dir / name}: cannot be written: {exc.strerror or exc}")
