"""Every benchmark's ``--help`` names the command README gives for it (``python -m bench.<x>``),
not the file argparse guesses from ``sys.argv[0]``."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["engine", "save_cost", "s3", "trainer", "recovery", "gpu"])
def test_bench_help_names_the_module_command(name: str, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench.{name} ")
