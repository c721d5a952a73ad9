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


# The interpreter that PreloadedTrainer forks a launch from: it does what ``python -m
# antifragile.trainer`` does before its first line of work (the entry module's environment
# defaults, then torch and the trainer's modules: 4 s of a launch's 4.5 s on this machine),
# then forks one child per request, which runs the entry's main() with the request's argv and
# its stdout/stderr in files, and exits with main()'s return value (as ``sys.exit(main())``
# does), with an uncaught exception's traceback on stderr and code 1 as an interpreter's.
_PRELOADED = r"""
import json, os, sys, traceback

import antifragile.trainer.__main__ as entry
import torch  # noqa: F401
import antifragile.trainer.train  # noqa: F401

for line in sys.stdin:
    argv, out, err = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = ["antifragile.trainer", *argv]
            try:
                code = entry.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class PreloadedTrainer:
    """Single-process launches of ``python -m antifragile.trainer ARGS`` (no torchrun), each a
    fresh process forked from one interpreter that imported torch and the trainer once: for a
    test of many short launches (a refusal at resume, ...), whose cost is the imports. Each
    launch starts from the state after the imports alone (a fork), not after another launch.
    ``env`` is every launch's environment. Use as a context manager."""

    def __init__(self, env: dict[str, str], out_dir: Path) -> None:
        self._out = out_dir
        self._n = 0
        self._proc = subprocess.Popen([sys.executable, "-c", _PRELOADED], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      start_new_session=True)

    def run(self, args: list[str], *, timeout_s: float = 120
            ) -> subprocess.CompletedProcess[str]:
        import json
        import selectors

        self._n += 1
        out, err = self._out / f"launch{self._n}.out", self._out / f"launch{self._n}.err"
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps([args, str(out), str(err)]) + "\n")
        self._proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                self.close()
                raise subprocess.TimeoutExpired(["antifragile.trainer", *args], timeout_s)
        line = self._proc.stdout.readline()
        if not line:
            raise AssertionError(f"the preloaded interpreter ended ({self._proc.wait()})")
        return subprocess.CompletedProcess(["antifragile.trainer", *args], int(line),
                                           out.read_text(), err.read_text())

    def close(self) -> None:
        if self._proc.poll() is None:
            import signal
            os.killpg(self._proc.pid, signal.SIGKILL)  # its session: it and a launch child
        self._proc.wait()

    def __enter__(self) -> PreloadedTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
