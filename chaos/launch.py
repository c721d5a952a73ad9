"""Launching the trainer under torchrun for a scenario, and reading its events as they come."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from chaos.scenario import Scenario


def trainer_args(s: Scenario, run_dir: Path, ckpt_url: str) -> list[str]:
    t, c = s.trainer, s.checkpoint
    args = ["--dp", t.parallel.dp, "--tp", t.parallel.tp, "--pp", t.parallel.pp,
            "--steps", t.steps, "--seed", s.seed, "--layers", t.model.layers,
            "--d-model", t.model.d_model, "--heads", t.model.heads, "--vocab", t.model.vocab,
            "--seq-len", t.model.seq_len, "--batch-size", t.batch_size,
            "--micro-batches", t.micro_batches, "--schedule", t.schedule,
            "--collective-timeout-s", t.collective_timeout_s,
            "--hang-timeout-s", t.hang_timeout_s, "--ckpt-url", ckpt_url,
            "--ckpt-every", c.every_steps, "--keep-last", c.keep_last, "--run-dir", run_dir]
    if not c.async_:
        args.append("--no-async-ckpt")
    return [str(a) for a in args]


def launch(s: Scenario, run_dir: Path, ckpt_url: str, *, max_restarts: int
           ) -> subprocess.Popen[str]:
    """Start torchrun (one agent; CPU + gloo) with in-place restarts."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={s.trainer.parallel.world_size}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
           "-m", "trainer", *trainer_args(s, run_dir, ckpt_url)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONUNBUFFERED": "1"}
    log = open(run_dir / "torchrun.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


class EventTail:
    """Reads new lines of every ``events/rank*.jsonl`` since the last call."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "events"
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.dir.exists():
            return new
        for path in sorted(self.dir.glob("rank*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, encoding="utf-8") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            self._offsets[path] = offset + len(complete.encode())
            new += [json.loads(line) for line in complete.splitlines() if line.strip()]
        new.sort(key=lambda e: e["t"])
        self.events += new
        return new
