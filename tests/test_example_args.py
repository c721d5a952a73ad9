"""The shipped examples refuse arguments they cannot train with before they start, naming the
argument (argparse's usage error, exit code 2), not with a traceback steps into the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("example", ["fsdp2_dcp", "hf_gpt2"])
@pytest.mark.parametrize(("flag", "value"), [("--ckpt-every", "0"), ("--batch-size", "0"),
                                             ("--steps", "-1")])
def test_an_example_refuses_a_value_it_cannot_train_with(example: str, flag: str, value: str,
                                                         tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / example / "train.py"), flag, value,
                           "--ckpt-url", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}" in done.stderr and "Traceback" not in done.stderr, done.stderr
