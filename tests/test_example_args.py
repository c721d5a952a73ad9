"""The shipped examples refuse arguments they cannot train with before they start, naming the
argument (argparse's usage error, exit code 2), not with a traceback steps into the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# each flag once, and the flag that crashed on both examples: the hf_gpt2 example imports
# transformers before it parses (8 s a case)
@pytest.mark.parametrize(("example", "flag", "value"), [
    ("fsdp2_dcp", "--ckpt-every", "0"), ("hf_gpt2", "--ckpt-every", "0"),
    ("fsdp2_dcp", "--batch-size", "0"), ("fsdp2_dcp", "--steps", "-1"),
    ("fsdp2_dcp", "--ckpt-url", "s3://bucket/ckpt")])  # DCP's FileSystemWriter: local only
def test_an_example_refuses_a_value_it_cannot_train_with(example: str, flag: str, value: str,
                                                         tmp_path: Path) -> None:
    url = [] if flag == "--ckpt-url" else ["--ckpt-url", str(tmp_path / "ckpt")]
    done = subprocess.run([sys.executable, str(EXAMPLES / example / "train.py"), flag, value,
                           *url],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}" in done.stderr and "Traceback" not in done.stderr, done.stderr
