"""Launch the trainer under torchrun in a subprocess and read what it left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from antifragile.engine import CheckpointEngine
from antifragile.trainer.events import read_events

SMALL_MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--vocab", "64",
               "--seq-len", "16", "--batch-size", "8", "--micro-batches", "2"]


def torchrun_cmd(nproc: int, args: list[str], *, max_restarts: int = 0) -> list[str]:
    """torchrun's per-worker folders go under the trainer's --run-dir, where there is one (by
    default torchrun leaves a torchelastic_* folder in the temporary folder for good)."""
    log_dir = [f"--log-dir={Path(args[args.index('--run-dir') + 1]) / 'torchelastic'}"] \
        if "--run-dir" in args else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", *log_dir,
            "-m", "antifragile.trainer", *args]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore"}


def run_trainer(run_dir: Path, *, dp: int = 1, tp: int = 1, pp: int = 1, steps: int,
                ckpt_every: int, extra: list[str] | None = None, timeout_s: float = 240,
                ckpt_url: str | None = None) -> subprocess.CompletedProcess[str]:
    args = [*SMALL_MODEL, "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
            "--steps", str(steps), "--ckpt-every", str(ckpt_every),
            "--ckpt-url", ckpt_url or str(run_dir / "ckpt"), "--run-dir", str(run_dir),
            *(extra or [])]
    proc = subprocess.run(torchrun_cmd(dp * tp * pp, args), env=env(), capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_events(run_dir)


def losses(run_dir: Path, *, attempt: int | None = None) -> dict[int, float]:
    """Loss per step from the ranks that report it (last pipeline stage); the newest wins."""
    out: dict[int, float] = {}
    for e in events(run_dir):
        if e["event"] == "step_end" and e["loss"] is not None and (
                attempt is None or e["attempt"] == attempt):
            out[e["step"]] = e["loss"]
    return out


def checkpoint_arrays(url: str, step: int) -> dict[str, Any]:
    with CheckpointEngine(url) as ckpt:
        return ckpt.read(step)


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
