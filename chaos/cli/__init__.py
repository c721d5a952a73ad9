"""The ``chaos`` command line. Exit codes: 0 pass / ok, 1 fail / damage, 2 bad input, 130
interrupted (Ctrl-C).

Each command lives in its own module here and imports what it needs (torch, the runner, the
engine) only when it runs, so ``chaos --help``, ``chaos list`` and ``chaos validate`` answer at
once.
"""

from __future__ import annotations

import sys

try:  # the ``chaos`` script imports this before click can catch Ctrl-C (yaml, pydantic: ~0.2 s)
    import click

    from antifragile.chaos.cli.ckpt import ckpt
    from antifragile.chaos.cli.crashcheck import crashcheck_cmd
    from antifragile.chaos.cli.run import list_scenarios, run_cmd, validate
    from antifragile.chaos.cli.suite import suite
    from antifragile.chaos.cli.tune import tune
    from antifragile.chaos.infra.lifetime import stop_once
except KeyboardInterrupt:
    sys.stderr.write("\nAborted!\n")  # as _Chaos says it; nothing was started yet
    raise SystemExit(130) from None


class _Chaos(click.Group):
    """Ctrl-C exits 130 (128 + SIGINT, as SIGTERM exits 143): click's own exit 1 is what the
    commands answer for a failed run or a damaged checkpoint."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nAborted!", err=True)
            raise SystemExit(130) from None


@click.group(cls=_Chaos, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Make large-model training survive failure, and prove it."""


for command in (run_cmd, validate, list_scenarios, suite, tune, ckpt, crashcheck_cmd):
    main.add_command(command)


def entry() -> None:
    """The ``chaos`` program: SIGTERM and SIGHUP stop what it started (``infra.lifetime``),
    as Ctrl-C does. Tests call ``main`` through click's runner, which must not take over the test
    process's SIGTERM."""
    stop_once()
    main()


if __name__ == "__main__":  # pragma: no cover
    entry()
