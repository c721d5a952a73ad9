"""What every command shares: one-line errors (exit 2) and loading a scenario file."""

from __future__ import annotations

from typing import NoReturn

import click

from antifragile.chaos.scenario import Scenario, ScenarioError, load_scenario


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit (2: bad input)."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def load(file: str, seed: int | None = None) -> Scenario:
    """The validated scenario, or exit 2 naming the file, the key path and the reason."""
    try:
        return load_scenario(file, seed=seed)
    except ScenarioError as exc:
        fail(str(exc))


def needs_reference(file: str) -> str:
    """Why ``--no-reference`` cannot run the scenario of ``file`` (it expects bitwise equality)."""
    return (f"{file}: expect.bitwise_equal_to_reference is true, but --no-reference skips the "
            f"reference run it is checked against (set it to false, or drop --no-reference)")
