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
- ``torn``: something loaded that equals neither, or step k loaded after the rule skipped a
  step it took for a checkpoint (committed, or marked) that did not load: the state holds a
  torn committed checkpoint, which the fallback hid (correctness);
- ``lost``: step k, committed before the save began, cannot be loaded any more: the rule
  found no checkpoint, or failed, with neither step intact, or loaded an older step; or
  step k+1, committed and whole in the state (its folder as the save left it), was passed
  over for step k;
- ``unchecked``: the checker process died or hung (``STATE_TIMEOUT_S``) on the state: nothing
  is known of it (the reason is in its answer); the checker is replaced and the run goes on.
"""

from __future__ import annotations

import contextlib
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

OUTCOMES = ("old", "new", "refused", "torn", "lost", "unchecked")
BAD = ("refused", "torn", "lost")
#: how long one state (its rebuild and a load per rule) may take before its checker is taken
#: for hung, and how long a checker may take to start (import torch, an engine)
STATE_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0


@dataclass(slots=True, kw_only=True)
class Expected:
    """What a correct load may return: step k with its digest, step k+1 with its digest."""

    old_step: int
    old_digest: str
    new_step: int
    new_digest: str
    older: dict[int, str] = field(default_factory=dict)  # older committed steps' digests


def classify(result: dict[str, Any], expected: Expected, *, intact: bool,
             new_intact: bool = False) -> str:
    """The outcome of one load. ``intact``: the state holds step k's or step k+1's folder
    exactly as its save left it (``holds_intact``); a load that ended with nothing then
    refused a checkpoint it could have had, else step k was lost. ``new_intact``: it holds
    step k+1's folder as the save left it, committed: a load of step k loses step k+1."""
    if "unchecked" in result:
        return "unchecked"
    if "nothing" in result or "error" in result:
        return "refused" if intact else "lost"
    step, loaded = result["step"], result["digest"]
    if step == expected.old_step and loaded == expected.old_digest:
        # a committed step that did not load was passed over: torn, whatever loaded after it
        if result.get("skipped"):
            return "torn"
        return "lost" if new_intact and step < expected.new_step else "old"
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
    """A checker process died, hung or said something unexpected."""


class CheckerPool:
    """``workers`` checker processes for one engine; ``check`` spreads states over them."""

    def __init__(self, *, engine: str, bucket: str, bodies: Path, env: dict[str, str],
                 workers: int) -> None:
        self._command = [sys.executable, "-m", "antifragile.chaos.crashcheck.worker", "check",
                         "--engine", engine, "--bucket", bucket, "--bodies", str(bodies)]
        self._env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.procs: list[subprocess.Popen[str]] = []
        # a checker's stderr goes to a file: a pipe nobody reads fills up (64 KiB of, say,
        # asyncio's errors about a reader's unclosed sessions) and blocks the checker for good
        self._stderr: dict[int, Any] = {}
        # its stdout lines, read by a thread of its own: a read can then time out (a hang)
        self._lines: dict[int, queue.Queue[str]] = {}
        # set by close (chaos stopping while states are checked): no checker is started and
        # no state handed out after it; the lock keeps a replacement and close apart
        self._closing = False
        self._lock = threading.Lock()
        try:
            for _ in range(workers):
                self.procs.append(self._start())
            for proc in self.procs:
                self._expect(proc, "ready", START_TIMEOUT_S)
        except BaseException as exc:  # no pool: none of them may outlive this
            for proc in self.procs:
                kill_process(proc)
            for err in self._stderr.values():
                err.close()
            if isinstance(exc, OSError):  # a Popen that failed (no processes, no handles)
                raise CheckerError(str(exc)) from exc
            raise

    def _start(self) -> subprocess.Popen[str]:
        err = tempfile.TemporaryFile(mode="w+", prefix="crashcheck-checker-")  # noqa: SIM115
        try:
            proc = subprocess.Popen(self._command, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=self._env, preexec_fn=die_with_parent(os.getpid()))
        except BaseException:
            err.close()
            raise
        self._stderr[proc.pid] = err
        lines: queue.Queue[str] = queue.Queue()
        self._lines[proc.pid] = lines
        threading.Thread(target=read_lines, args=(proc, lines), daemon=True).start()
        return proc

    def _expect(self, proc: subprocess.Popen[str], field: str,
                timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines[proc.pid].get(timeout=timeout_s)
        except queue.Empty:
            raise CheckerError(f"the checker process answered nothing in {timeout_s:.0f} s "
                               "(hung): killed") from None
        if not line:
            code = proc.wait()
            stderr = self._stderr[proc.pid]
            try:
                stderr.seek(0)
                said = stderr.read()
            except ValueError:  # close closed it (chaos stopping)
                said = ""
            last = [x.strip() for x in said.splitlines() if x.strip()][-1:]
            raise CheckerError(f"the checker process exited ({code})"
                               + (" while checking it" if field == "results" else "")
                               + "".join(f": {x[:300]}" for x in last))
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or field not in doc:  # JSON, but no answer: "42"
            raise CheckerError(f"a checker said {line.strip()[:200]}")
        return doc

    def _ask(self, proc: subprocess.Popen[str], task: dict[str, Any]) -> dict[str, Any]:
        assert proc.stdin is not None
        # it died (a broken pipe), or close shut its stdin: _expect says how it ended
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(json.dumps(task) + "\n")
            proc.stdin.flush()
        doc = self._expect(proc, "results", STATE_TIMEOUT_S)
        if doc.get("id") != task["id"]:  # filed under its own id, it would hide this state
            raise CheckerError(f"a checker answered state {doc.get('id')} for state "
                               f"{task['id']}")
        return doc

    def _replace(self, proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
        """Kill ``proc`` (dead or hung) and start a checker in its place (none once the pool
        is closing: CheckerError)."""
        kill_process(proc)
        with self._lock:
            if self._closing:
                raise CheckerError("chaos is stopping: the checker was not replaced")
            self._stderr.pop(proc.pid).close()
            self._lines.pop(proc.pid, None)
            new = self._start()
            self.procs[self.procs.index(proc)] = new
        self._expect(new, "ready", START_TIMEOUT_S)
        return new

    def check(self, tasks: list[dict[str, Any]],
              progress: Callable[[int], None] | None = None) -> dict[int, dict[str, Any]]:
        """Each task: ``{"id", "prefix", "objects": {key: body file}, "rules"}``; returns
        the checker's answer per id. A state whose checker died or hung on it (or that no
        checker was left to take) is answered ``unchecked`` with the reason, for every rule."""
        todo: queue.Queue[dict[str, Any] | None] = queue.Queue()
        for task in tasks:
            todo.put(task)
        answers: dict[int, dict[str, Any]] = {}
        gone: list[str] = []  # why a checker could not be replaced
        lock = threading.Lock()

        def drive(proc: subprocess.Popen[str]) -> None:
            while not self._closing:
                try:
                    task = todo.get_nowait()
                except queue.Empty:
                    return
                assert task is not None
                stopped = None
                try:
                    doc = self._ask(proc, task)
                except CheckerError as exc:  # it died or hung on this state
                    doc = _unchecked(task, str(exc))
                    try:
                        proc = self._replace(proc)
                    except (CheckerError, OSError) as again:
                        stopped = f"a checker could not be restarted: {again}"
                with lock:
                    answers[doc["id"]] = doc
                    if stopped is not None:
                        gone.append(stopped)
                    if progress is not None:
                        progress(len(answers))
                if stopped is not None:
                    return

        threads = [threading.Thread(target=drive, args=(p,), daemon=True) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        while not todo.empty():  # every checker gone
            left = todo.get_nowait()
            assert left is not None
            answers[left["id"]] = _unchecked(left, gone[0] if gone else "no checker left")
        return answers

    def close(self) -> None:
        """End the checkers; ``check`` may still run in other threads (chaos stopping)."""
        with self._lock:
            self._closing = True
            procs, errs = list(self.procs), list(self._stderr.values())
        for proc in procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):  # one that died: a broken pipe
                    proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for err in errs:
            err.close()

    def __enter__(self) -> CheckerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_lines(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    """Every line ``proc`` prints, then ``""`` at its end."""
    assert proc.stdout is not None
    with contextlib.suppress(OSError, ValueError):
        for line in proc.stdout:
            lines.put(line)
    lines.put("")
    proc.stdout.close()


def kill_process(proc: subprocess.Popen[str]) -> None:
    """``proc`` killed if it runs, reaped, its stdin closed."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _unchecked(task: dict[str, Any], reason: str) -> dict[str, Any]:
    return {"id": task["id"], "unchecked": reason,
            "results": {rule: {"unchecked": reason} for rule in task["rules"]}}
