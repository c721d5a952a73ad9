"""The ``chaos`` command line. Exit codes: 0 pass / ok, 1 fail / damage, 2 bad input."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import click

from chaos import ckpt_cli
from chaos.scenario import ScenarioError, load_scenario
from chaos.suite_cli import suite
from chaos.tune_cli import tune

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Make large-model training survive failure, and prove it."""


main.add_command(ckpt_cli.ckpt)

main.add_command(tune)
main.add_command(suite)


class Progress:
    """One updating line on a terminal; plain lines otherwise (CI logs, pipes)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._open = False

    def __call__(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        if self.tty and line.startswith("step "):
            sys.stderr.write(f"\r\x1b[2K{stamp} {line}")
            self._open = True
        else:
            if self._open:
                sys.stderr.write("\n")
                self._open = False
            sys.stderr.write(f"{stamp} {line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._open:
            sys.stderr.write("\n")


def _load(file: str, seed: int | None = None):  # type: ignore[no-untyped-def]
    try:
        return load_scenario(file, seed=seed)
    except ScenarioError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None


@main.command("validate")
@click.argument("file")
def validate(file: str) -> None:
    """Check a scenario file without running it."""
    s = _load(file)
    faults = f"{len(s.faults)} fault{'' if len(s.faults) == 1 else 's'}"
    click.echo(f"{file}: ok ({s.name}: {s.trainer.parallel.world_size} ranks, "
               f"{s.trainer.steps} steps, {faults})")


@main.command("list")
def list_scenarios() -> None:
    """The shipped scenarios, one line each."""
    for path in sorted(SCENARIOS.rglob("*.yaml")):
        try:
            s = load_scenario(path)
            line = s.description.strip().splitlines()[0] if s.description.strip() else ""
        except ScenarioError as exc:
            line = f"INVALID: {exc}"
        click.echo(f"{path.relative_to(SCENARIOS.parent)}  {line}")


@main.command("run")
@click.argument("file")
@click.option("--out", type=click.Path(file_okay=False), help="Report folder "
              "(default reports/<name>-<UTC time>).")
@click.option("--no-reference", is_flag=True, help="Skip the fault-free reference run.")
@click.option("--seed", type=int, help="Override the scenario's seed.")
def run_cmd(file: str, out: str | None, no_reference: bool, seed: int | None) -> None:
    """Run a scenario: inject its faults, measure recovery, check nothing was lost."""
    from chaos.run import run
    from chaos.s3 import S3SetupError

    s = _load(file, seed)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(out) if out else Path("reports") / f"{s.name}-{stamp}"
    progress = Progress()
    try:
        outcome = run(s, folder, reference=not no_reference, progress=progress)
    except S3SetupError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    finally:
        progress.close()
    v = outcome.report["verdict"]
    click.echo(f"{s.name}: {v['verdict'].upper()}  report: {folder / 'report.md'}")
    for reason in v["reasons"]:
        click.echo(f"  - {reason}")
    for f in outcome.report["faults"]:
        if f["skipped"]:
            click.echo(f"  {f['kind']}: skipped ({f['skipped']})")
        elif f.get("outage"):
            o = f["outage"]
            stall = "-" if o["extra_stall_s"] is None else f"{o['extra_stall_s']:.2f} s"
            click.echo(f"  {f['kind']} ({o['mode']}, {o['duration_s']:g} s) at step "
                       f"{f['injected_step']}: training went on: {o['training_continued']}; "
                       f"checkpoints delayed {o['checkpoints_delayed']}, failed "
                       f"{o['checkpoints_failed']}, skipped {o['checkpoints_skipped']}; "
                       f"extra stall {stall}")
        else:
            recovery = "not observed" if f["recovery_s"] is None else f"{f['recovery_s']:.2f} s"
            click.echo(f"  {f['kind']} at step {f['injected_step']}: recovery {recovery}, "
                       f"lost steps {f['lost_steps']}")
    raise SystemExit(0 if outcome.passed else 1)


if __name__ == "__main__":  # pragma: no cover
    main()
