"""Load every crash state in processes that never saw the save, and classify what they load.

A pool of checker processes (``worker.py check``; each imports torch once) takes states one at
a time: each state is rebuilt under a fresh prefix and loaded by a brand-new engine instance
per load rule. Starting a new Python + torch process per state would cost seconds each; the
checkers share nothing with the saving job but the bucket, and no two states share a prefix.

Outcomes, against the digests of what was saved:

- ``old``: step k, bitwise equal to what step k saved;
- ``new``: step k+1, bitwise equal to what the recorded save saved;
- ``refused``: an error or nothing loaded, although step k or step k+1 was intact in the state
  (every object of its folder as its save left it): a liveness failure;
- ``torn``: something loaded that equals neither (correctness);
- ``lost``: step k, committed before the save began, cannot be loaded any more: the rule
  found no checkpoint, or failed, with neither step intact, or loaded an older step.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from antifragile.chaos.infra.lifetime import die_with_parent

OUTCOMES = ("old", "new", "refused", "torn", "lost")
BAD = ("refused", "torn", "lost")


@dataclass(slots=True, kw_only=True)
class Expected:
    """What a correct load may return: step k with its digest, step k+1 with its digest."""

    old_step: int
    old_digest: str
    new_step: int
    new_digest: str
    older: dict[int, str] = field(default_factory=dict)  # older committed steps' digests


def classify(result: dict[str, Any], expected: Expected, *, intact: bool) -> str:
    """The outcome of one load. ``intact``: the state holds step k's or step k+1's folder
    exactly as its save left it (``holds_intact``); a load that ended with nothing then
    refused a checkpoint it could have had, else step k was lost."""
    if "nothing" in result or "error" in result:
        return "refused" if intact else "lost"
    step, loaded = result["step"], result["digest"]
    if step == expected.old_step and loaded == expected.old_digest:
        return "old"
    if step == expected.new_step and loaded == expected.new_digest:
        return "new"
    if expected.older.get(step) == loaded:
        return "lost"  # an older step, intact: step k was lost
    return "torn"


#: a step's folder, as every engine here names it (``engines.step_name``, the engine's own)
STEP_RE = re.compile(r"^step_(\d{9,})$")


def holds_intact(objects: dict[str, str], reference: dict[str, str], step: int) -> bool:
    """Whether ``step``'s folder in ``objects`` (key -> body digest) is exactly what it is in
    ``reference`` (the bucket when that step's save had ended), and not empty there."""
    def folder(of: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in of.items()
                if (m := STEP_RE.match(k.split("/", 1)[0])) and int(m[1]) == step}

    wanted = folder(reference)
    return bool(wanted) and folder(objects) == wanted


class CheckerError(RuntimeError):
    """A checker process died or said something unexpected."""


class CheckerPool:
    """``workers`` checker processes for one engine; ``check`` spreads states over them."""

    def __init__(self, *, engine: str, bucket: str, bodies: Path, env: dict[str, str],
                 workers: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        # a checker's stderr goes to a file: a pipe nobody reads fills up (64 KiB of, say,
        # asyncio's errors about a reader's unclosed sessions) and blocks the checker for good
        self._stderr: dict[int, Any] = {}
        child_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        for _ in range(workers):
            err = tempfile.TemporaryFile(mode="w+", prefix="crashcheck-checker-")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", "antifragile.chaos.crashcheck.worker", "check",
                 "--engine", engine, "--bucket", bucket, "--bodies", str(bodies)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True, env=child_env, preexec_fn=die_with_parent(os.getpid()))
            self.procs.append(proc)
            self._stderr[proc.pid] = err
        for proc in self.procs:
            self._expect(proc, "ready")

    def _expect(self, proc: subprocess.Popen[str], field: str) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            stderr = self._stderr[proc.pid]
            stderr.seek(0)
            err = stderr.read()
            raise CheckerError(f"a checker process exited ({code}): "
                               f"{err.strip().splitlines()[-1:] or ''}")
        doc: dict[str, Any] = json.loads(line)
        if field not in doc:
            raise CheckerError(f"a checker said {line.strip()[:200]}")
        return doc

    def check(self, tasks: list[dict[str, Any]],
              progress: Callable[[int], None] | None = None) -> dict[int, dict[str, Any]]:
        """Each task: ``{"id", "prefix", "objects": {key: body file}, "rules"}``; returns
        the checker's answer per id."""
        todo: queue.Queue[dict[str, Any] | None] = queue.Queue()
        for task in tasks:
            todo.put(task)
        answers: dict[int, dict[str, Any]] = {}
        errors: list[BaseException] = []
        lock = threading.Lock()

        def drive(proc: subprocess.Popen[str]) -> None:
            assert proc.stdin is not None
            try:
                while True:
                    try:
                        task = todo.get_nowait()
                    except queue.Empty:
                        return
                    assert task is not None
                    proc.stdin.write(json.dumps(task) + "\n")
                    proc.stdin.flush()
                    doc = self._expect(proc, "results")
                    with lock:
                        answers[doc["id"]] = doc
                        if progress is not None:
                            progress(len(answers))
            except BaseException as exc:  # reported once every driver stopped
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(p,), daemon=True) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return answers

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for err in self._stderr.values():
            err.close()

    def __enter__(self) -> CheckerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
