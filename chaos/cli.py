"""The ``chaos`` command line. Exit codes: 0 ok, 1 damage or failed verdict, 2 bad input."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from chaos import ckpt_cli


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Make large-model training survive failure, and prove it."""


main.add_command(ckpt_cli.ckpt)


def run() -> None:  # pragma: no cover
    sys.exit(main())


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)


if __name__ == "__main__":  # pragma: no cover
    run()
