"""CUDA checks: skipped cleanly where no GPU is present (CI), run where one is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from antifragile.engine import CheckpointEngine
from tests._trainer import checkpoint_arrays, events, run_trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_engine_round_trip_of_cuda_tensors(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 256, device="cuda"),
             "b": torch.randn(256, device="cuda", dtype=torch.bfloat16)}
    with CheckpointEngine(str(tmp_path)) as ckpt:
        handle = ckpt.save(1, state)
        assert handle.staged.is_set()
        handle.wait()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.load(target) == 1
    assert all(torch.equal(target[k], state[k]) for k in state)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_staging_waits_for_the_copies_of_every_device_not_the_current_one(
        tmp_path: Path) -> None:
    """Staging once waited for the current device's copies alone: a tensor on another
    device could be persisted before its non-blocking copy landed."""
    state = {f"w{d}": torch.randn(4096, 1024, device=f"cuda:{d}") for d in (0, 1)}
    with torch.cuda.device(0), CheckpointEngine(str(tmp_path)) as ckpt:
        ckpt.save(1, state).wait()
        target = {k: torch.zeros_like(v, device="cpu") for k, v in state.items()}
        assert ckpt.load(target) == 1
    assert all(torch.equal(target[k], state[k].cpu()) for k in state)


def test_trainer_runs_on_cuda_with_async_checkpoints(tmp_path: Path) -> None:
    run_trainer(tmp_path, steps=6, ckpt_every=3, extra=["--device", "cuda"])
    assert {e["step"] for e in events(tmp_path) if e["event"] == "ckpt_committed"} == {3, 6}
    assert checkpoint_arrays(str(tmp_path / "ckpt"), 6)


def test_bench_gpu_prints_the_staging_share_of_the_link(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--gib", "0.25", "--reps", "1",
                           "--trainer-pairs", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "x the link (target >= 0.8x)" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["engine"]["bitwise_equal"] and figures["link_s"] > 0
