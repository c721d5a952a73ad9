"""``chaos crashcheck`` end to end: per case, record a save, enumerate its crash states, check
each one, classify. The report is written by ``report.py``.

Cases (step k committed before the recorded save of step k+1):

- ``save``: step 1 committed, then step 2 is saved.
- ``retention``: steps 1 and 2 committed (``keep_last=2``), then step 3 is saved with
  ``keep_last=2``: its commit is followed by retention deleting step 1.
- ``overwrite``: step 1 committed, and an earlier attempt at step 2 (other data) wrote
  everything but its marker (a save that crashed just before committing: made by a complete
  save whose marker is then deleted); then step 2 is saved again into the same prefix.
- ``overwrite-committed``: steps 1 and 2 committed, step 2 by an attempt whose success the
  trainer never learnt (it crashed after the marker landed) or that it resumed before; then
  step 2 is saved again, with other data, into the same prefix. "old" is the committed
  step 2 of the first attempt; an engine may also refuse the second save outright.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from antifragile.chaos.crashcheck.check import (
    BAD,
    OUTCOMES,
    CheckerPool,
    Expected,
    classify,
    holds_intact,
    kill_process,
    read_lines,
)
from antifragile.chaos.crashcheck.enumerate import CrashState, Enumeration, enumerate_states
from antifragile.chaos.crashcheck.record import (
    Mutation,
    Recording,
    RecordingIncomplete,
    RecordingProxy,
)
from antifragile.chaos.infra.lifetime import die_with_parent

ENGINES = ("antifragile", "dcp", "torchsnapshot")
CASES = ("save", "retention", "overwrite", "overwrite-committed")
#: the load rules checked by default; ``newest-folder`` for antifragile (its arrays read by a
#: plain zarr reader, COMMIT ignored) is a deliberately broken rule, on request only
RULES = {"antifragile": ("engine",), "dcp": ("marker", "newest-folder"),
         "torchsnapshot": ("marker", "newest-folder")}
#: cases where an engine may refuse the recorded save (its state after the save is step k's)
MAY_REFUSE = ("overwrite-committed",)
#: rules a user of the engine is told to use; the others are reported, not targeted
DOCUMENTED = {"antifragile": "engine", "dcp": "marker", "torchsnapshot": "marker"}


@dataclass(slots=True, frozen=True)
class Case:
    name: str
    base: list[tuple[int, int, int | None, bool]]  # (step, attempt, keep_last, drop marker)
    record: tuple[int, int, int | None]  # (step, attempt, keep_last)
    old: tuple[int, int]  # (step, attempt) a correct load may return besides the new save


def case(name: str) -> Case:
    if name == "save":
        return Case(name, [(1, 0, None, False)], (2, 0, None), (1, 0))
    if name == "retention":
        return Case(name, [(1, 0, 2, False), (2, 0, 2, False)], (3, 0, 2), (2, 0))
    if name == "overwrite":
        return Case(name, [(1, 0, None, False), (2, 1, None, True)], (2, 0, None), (1, 0))
    if name == "overwrite-committed":
        return Case(name, [(1, 0, None, False), (2, 1, None, False)], (2, 0, None), (2, 1))
    raise ValueError(f"unknown case {name!r} (known: {', '.join(CASES)})")


@dataclass(slots=True, kw_only=True)
class Settings:
    engine: str
    ranks: int
    cases: tuple[str, ...]
    max_states: int | None = None
    max_inflight_exhaustive: int = 12
    latency_s: float = 0.02
    checkers: int = 2
    seed: int = 0
    rules: tuple[str, ...] | None = None  # default: every rule of the engine


@dataclass(slots=True)
class CaseResult:
    """One case of one engine: the recording, the states and each rule's outcomes."""

    case: str
    recording: Recording
    base: dict[str, str]
    expected: Expected
    enumeration: Enumeration
    outcomes: dict[str, dict[int, str]] = field(default_factory=dict)  # rule -> state -> ...
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    save_error: str | None = None  # the recorded save raised (on some rank)
    save_refused: bool = False  # that error is the engine's refusal of a committed step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _s3_client(endpoint_url: str, env: dict[str, str]) -> Any:
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint_url, region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"))


def _list(client: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                 Prefix=f"{prefix}/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def _keep_body(bodies: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = bodies / digest
    if not path.exists():
        path.write_bytes(data)
    return digest


#: how long the saving job's ranks may take to exit once the save is done
SAVE_EXIT_TIMEOUT_S = 300.0
#: how long rank 0 may take to say a line (its base saves done; the recorded save done) before
#: the job is taken for hung: a rank that is stuck, or waits for a rank that never comes
SAVE_LINE_TIMEOUT_S = 600.0


def record_case(settings: Settings, the_case: Case, *, endpoint_url: str, env: dict[str, str],
                bucket: str, bodies: Path, root: str
                ) -> tuple[Recording, dict[str, str], Expected, float, str | None, bool]:
    """Run the base saves and the recorded save (``settings.ranks`` processes, through the
    recording proxy): (recording, base objects {key: digest}, expected digests, save seconds,
    the save's error or None, whether that error is the engine's refusal of a committed
    step)."""
    client = _s3_client(endpoint_url, env)
    with RecordingProxy(endpoint_url, bucket=bucket, root=root,
                        latency_s=settings.latency_s) as proxy:
        plan = json.dumps({"base": the_case.base, "record": the_case.record})
        port = _free_port()
        procs: list[subprocess.Popen[str]] = []
        # each rank's stderr goes to a file: a pipe nobody reads until the end fills up (64 KiB
        # of warnings) and blocks the rank in its write, which then looked hung
        errs = _Stderr()
        # rank 0's lines, read by a thread: a read can then time out (a silent rank 0), and
        # the other ranks are watched meanwhile (one that died leaves rank 0 waiting for it)
        lines: queue.Queue[str] = queue.Queue()
        try:  # the ranks started are killed below whatever happens, a failed start included
            for rank in range(settings.ranks):
                rank_env = {**os.environ, **env, "AWS_ENDPOINT_URL": proxy.endpoint_url,
                            "AWS_ENDPOINT_URL_S3": proxy.endpoint_url, "RANK": str(rank),
                            "WORLD_SIZE": str(settings.ranks), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                            "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo"}
                try:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "antifragile.chaos.crashcheck.worker", "save",
                         "--engine", settings.engine, "--url", f"s3://{bucket}/{root}",
                         "--plan", plan],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs.new(),
                        text=True, env=rank_env, preexec_fn=die_with_parent(os.getpid())))
                except OSError as exc:  # no processes, no file handles left
                    raise SaveError(f"the saving job failed: rank {rank} could not be "
                                    f"started: {exc}") from exc
            threading.Thread(target=read_lines, args=(procs[0], lines), daemon=True).start()
            first = _line(procs, lines, "base", errs)
            base: dict[str, str] = {}
            for key in _list(client, bucket, root):
                data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                base[key.removeprefix(f"{root}/")] = _keep_body(bodies, data)
            proxy.start()
            assert procs[0].stdin is not None
            procs[0].stdin.write("go\n")
            procs[0].stdin.flush()
            saved = _line(procs, lines, "saved", errs)
            for rank, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=SAVE_EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:  # killed below
                    raise SaveError(f"the saving job failed: rank {rank} did not exit "
                                    f"{SAVE_EXIT_TIMEOUT_S:g} s after the save (killed)"
                                    ) from None
                if code != 0:
                    raise SaveError(_failure(proc, errs, rank, name_rank=False))
            try:
                recording = proxy.stop()
            except RecordingIncomplete as exc:
                raise SaveError(f"the recording is incomplete: {exc}") from exc
        finally:
            for proc in procs:
                kill_process(proc)
            errs.close()
    for data in recording.bodies.values():
        _keep_body(bodies, data)
    step, _, _ = the_case.record
    old_step, old_attempt = the_case.old
    expected = Expected(old_step=old_step,
                        old_digest=first["base"][f"{old_step}/{old_attempt}"],
                        new_step=step, new_digest=saved["saved"],
                        older={s: first["base"][f"{s}/0"] for s, a, _, drop in the_case.base
                               if s < old_step and a == 0 and not drop})
    error = saved.get("error")
    return (recording, base, expected, float(saved["save_s"]), error,
            error is not None and saved.get("refused") is True)


class SaveError(RuntimeError):
    """The saving job failed (a rank exited non-zero, or before saying what it saved)."""


#: what rank 0's line with each field says (worker.py ``_save_main``)
_SAYS = {"base": "its base digests", "saved": "what it saved"}


def _line(procs: list[subprocess.Popen[str]], lines: queue.Queue[str],
          field: str, errs: _Stderr) -> dict[str, Any]:
    """Rank 0's next line, a JSON object with ``field``; anything else it prints is a
    SaveError quoting it (the job cannot go on without the line). A rank that exits non-zero
    first, or a rank 0 silent for ``SAVE_LINE_TIMEOUT_S``, is a SaveError (every rank
    killed): rank 0 may otherwise wait for the dead rank (in the rendezvous, a collective)
    for good."""
    deadline = time.monotonic() + SAVE_LINE_TIMEOUT_S
    while True:
        try:
            line = lines.get(timeout=min(0.2, SAVE_LINE_TIMEOUT_S))
            break
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs[1:], start=1):
            if proc.poll():  # non-zero
                _kill_all(procs)
                raise SaveError(_failure(proc, errs, rank))
        if time.monotonic() >= deadline:
            _kill_all(procs)
            raise SaveError(f"the saving job failed: rank 0 said nothing in "
                            f"{SAVE_LINE_TIMEOUT_S:g} s (killed)")
    if not line:
        _kill_all(procs)
        raise SaveError(_failure(procs[0], errs, 0, name_rank=False))
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or field not in doc:
        _kill_all(procs)
        raise SaveError(f"the saving job failed: rank 0 printed {line.strip()[:200]!r}, not "
                        f"{_SAYS[field]} (killed)")
    return doc


def _kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        kill_process(proc)


class _Stderr:
    """The saving ranks' stderr files, in the order the ranks were started."""

    def __init__(self) -> None:
        self.files: list[IO[str]] = []

    def new(self) -> IO[str]:
        self.files.append(tempfile.TemporaryFile("w+", prefix="crashcheck-save-"))  # noqa: SIM115
        return self.files[-1]

    def text(self, index: int) -> str:
        f = self.files[index]
        f.seek(0)
        return f.read()

    def close(self) -> None:
        for f in self.files:
            f.close()


def _failure(proc: subprocess.Popen[str], errs: _Stderr, rank: int, *,
             name_rank: bool = True) -> str:
    code = proc.wait()  # its stderr complete
    tail = [line for line in errs.text(rank).strip().splitlines() if line.strip()][-1:]
    who = f"rank {rank}, " if name_rank else ""
    return f"the saving job failed ({who}exit {code}): {' '.join(tail)}"


def run_case(settings: Settings, name: str, *, endpoint_url: str, env: dict[str, str],
             bucket: str, bodies: Path, pool: CheckerPool,
             progress: Callable[[str], None] = print) -> CaseResult:
    the_case = case(name)
    tag = uuid.uuid4().hex[:8]
    root = f"{settings.engine}-r{settings.ranks}-{name}-{tag}/ckpt"
    t0 = time.monotonic()
    recording, base, expected, save_s, save_error, save_refused = record_case(
        settings, the_case, endpoint_url=endpoint_url, env=env, bucket=bucket, bodies=bodies,
        root=root)
    record_s = time.monotonic() - t0
    t1 = time.monotonic()
    enumeration = enumerate_states(base, recording.mutations,
                                   max_inflight_exhaustive=settings.max_inflight_exhaustive,
                                   max_states=settings.max_states, seed=settings.seed)
    enumerate_s = time.monotonic() - t1
    progress(f"{settings.engine} r{settings.ranks} {name}: {len(recording.mutations)} "
             f"mutations, {enumeration.distinct} distinct crash states; checking "
             f"{len(enumeration.states)}")
    rules = settings.rules or RULES[settings.engine]
    tasks = [{"id": s.id, "prefix": f"{root.removesuffix('/ckpt')}-check/s{s.id:05d}",
              "objects": s.objects, "rules": list(rules)} for s in enumeration.states]
    t2 = time.monotonic()
    def checked(n: int) -> None:
        if n % 200 == 0 or n == len(tasks):
            progress(f"  {n}/{len(tasks)} states checked ({time.monotonic() - t2:.0f} s)")

    answers = pool.check(tasks, progress=checked)
    check_s = time.monotonic() - t2
    result = CaseResult(name, recording, base, expected, enumeration, answers=answers,
                        save_error=save_error, save_refused=save_refused)
    final = next(s.objects for s in enumeration.states if s.id == enumeration.final)
    new_intact = {s.id: holds_intact(s.objects, final, expected.new_step)
                  for s in enumeration.states}
    intact = {s.id: holds_intact(s.objects, base, expected.old_step) or new_intact[s.id]
              for s in enumeration.states}
    # step k+1 as the uncrashed save left it counts as committed only if that save committed
    committed = save_error is None
    for rule in rules:
        result.outcomes[rule] = {
            i: classify(a["results"][rule], expected, intact=intact[i],
                        new_intact=committed and new_intact[i])
            for i, a in answers.items()}
    result.timings = {"record_s": round(record_s, 2), "save_s": round(save_s, 3),
                      "enumerate_s": round(enumerate_s, 2), "check_s": round(check_s, 2)}
    return result


def summarize(settings: Settings, result: CaseResult) -> dict[str, Any]:
    """The JSON of one case: counts per rule, a minimal witness per bad outcome."""
    e = result.enumeration
    by_index = {m.index: m for m in result.recording.mutations}
    rules = {}
    for rule, outcomes in result.outcomes.items():
        counts = {o: sum(1 for v in outcomes.values() if v == o) for o in OUTCOMES}
        witnesses = {}
        for bad in BAD:
            ids = [i for i, v in outcomes.items() if v == bad]
            if ids:
                state = min((s for s in e.states if s.id in ids),
                            key=lambda s: (len(s.in_flight), s.cut_s))
                witnesses[bad] = _witness(state, by_index, result, rule)
        rules[rule] = {"documented": rule == DOCUMENTED[settings.engine], "counts": counts,
                       "witnesses": witnesses, "final": outcomes.get(e.final)}
    return {
        "case": result.case, "engine": settings.engine, "ranks": settings.ranks,
        "states": len(e.states), "distinct_states": e.distinct,
        "exhaustive_bound": settings.max_inflight_exhaustive, "cut_points": e.cut_points,
        "crash_points": e.crash_points,
        "sampled_cuts": e.sampled_cuts, "max_in_flight": e.max_in_flight,
        "capped_at": settings.max_states if e.capped else None,
        "same_key_overlaps": e.same_key_overlaps,
        "mutations": [m.to_json() for m in result.recording.mutations],
        "requests": result.recording.requests,
        "base_objects": len(result.base),
        "expected": {"old_step": result.expected.old_step, "new_step": result.expected.new_step},
        "save_error": result.save_error, "save_refused": result.save_refused,
        # states a checker died or hung on: no outcome, the reason instead
        "unchecked": [{"state": i, "reason": a["unchecked"]}
                      for i, a in sorted(result.answers.items()) if "unchecked" in a],
        "rules": rules, "timings": result.timings,
        "cuts": [{"state": s.id, "cut_s": round(s.cut_s, 6),
                  **{r: result.outcomes[r].get(s.id) for r in result.outcomes}}
                 for s in e.states],
    }


def _witness(state: CrashState, by_index: dict[int, Mutation], result: CaseResult,
             rule: str) -> dict[str, Any]:
    def show(i: int) -> str:
        m = by_index[i]
        return f"#{i} {m.kind.upper()} {m.key}"

    answer = result.answers[state.id]["results"][rule]
    loaded = ({"error": answer["error"]} if "error" in answer
              else {"nothing": answer["nothing"]} if "nothing" in answer
              else {"step": answer["step"], "data": _label(answer["digest"], result.expected),
                    **({"skipped": answer["skipped"]} if answer.get("skipped") else {})})
    changed = sorted(set(state.objects) | set(result.base))
    changed = [k for k in changed if state.objects.get(k) != result.base.get(k)]
    return {"state": state.id, "cut_s": round(state.cut_s, 6),
            "changed_by_the_save": [f"{k}: {'deleted' if k not in state.objects else 'written'}"
                                    for k in changed],
            "acknowledged_before_cut": len(set(state.applied) - set(state.in_flight_applied)),
            "in_flight": [show(i) + (" (applied)" if i in state.in_flight_applied
                                     else " (not applied)") for i in state.in_flight],
            "loaded": loaded}


def _label(digest: str, expected: Expected) -> str:
    if digest == expected.old_digest:
        return f"step {expected.old_step}'s data"
    if digest == expected.new_digest:
        return f"step {expected.new_step}'s data"
    for step, older in expected.older.items():
        if digest == older:
            return f"step {step}'s data (an older step: step {expected.old_step} was lost)"
    return f"data equal to neither (sha256 {digest[:12]})"
