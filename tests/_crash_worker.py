"""A training-loop stand-in that the crash tests SIGKILL from outside.

Run as a script (``python tests/_crash_worker.py ROOT PROGRESS --steps 3,4``): it saves
``make_state(step)`` for each step with a blocking save, appending ``saving N`` before each
save and ``saved N`` after it to the PROGRESS file (one unbuffered write per line, so a test
that has stopped this process reads exactly how far it got). A failed save appends
``error {"type": ..., "message": ...}`` and exits with status 3. With ``--world 2`` it is one
of two gloo ranks that rendezvous through the ``--rendezvous`` file. ``--commit-timeout-s``
applies from ``--timeout-from-step`` on (earlier saves keep the default).

The state is a pure function of the step so that a test can recompute what was saved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from antifragile.engine import CheckpointEngine, CheckpointError, PlanOptions

ELEMENTS = 256 * 1024  # float32: 1 MiB
MAX_OBJECT_BYTES = 8192  # 128 shard objects per save: phases last long enough to hit
KEEP_LAST = 2
EXIT_SAVE_FAILED = 3


def make_state(step: int) -> dict[str, Any]:
    """What the worker saves at ``step`` (the tests recompute it to compare loads)."""
    return {
        "model": {
            "w": torch.arange(ELEMENTS, dtype=torch.float32) + step,
            "b": torch.full((16,), step, dtype=torch.int64),
        },
        "step": step,
    }


def expected_shards() -> int:
    """Shard objects of ``model/w`` per save."""
    return ELEMENTS * 4 // MAX_OBJECT_BYTES


def open_engine(root: str) -> CheckpointEngine:
    """The engine as the worker configures it (a restarted trainer opens the same)."""
    return CheckpointEngine(
        root, keep_last=KEEP_LAST, plan_options=PlanOptions(max_object_bytes=MAX_OBJECT_BYTES)
    )


def _progress(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _init_group(rank: int, world: int, rendezvous: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("progress", type=Path)
    parser.add_argument("--steps", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rendezvous", type=Path)
    parser.add_argument("--commit-timeout-s", type=float, default=600.0)
    parser.add_argument("--timeout-from-step", type=int, default=0)
    args = parser.parse_args(argv)
    if args.world > 1:
        _init_group(args.rank, args.world, args.rendezvous)
    engine = open_engine(args.root)
    for step in (int(s) for s in args.steps.split(",")):
        if step >= args.timeout_from_step:  # earlier saves must not time out on a busy machine
            engine.commit_timeout_s = args.commit_timeout_s
        state = make_state(step)
        _progress(args.progress, f"saving {step}")
        try:
            engine.save(step, state, blocking=True)
        except CheckpointError as exc:
            _progress(
                args.progress,
                "error " + json.dumps({"type": type(exc).__name__, "message": str(exc)}),
            )
            sys.stdout.flush()
            os._exit(EXIT_SAVE_FAILED)  # a peer may be dead: skip collective teardown
        _progress(args.progress, f"saved {step}")
    engine.close()
    if args.world > 1:
        dist.destroy_process_group()
    os._exit(0)  # everything is committed; skip the interpreter's slow teardown of torch


if __name__ == "__main__":
    main(sys.argv[1:])
