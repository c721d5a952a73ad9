"""A save of a step that is already committed: a retry whose first answer was lost succeeds
without writing; anything else is refused, since a committed step is never overwritten."""

from __future__ import annotations

import json
from concurrent.futures import Executor, wait
from typing import Any

from ._format import NOT_JSON
from ._state import same_value
from .errors import CheckpointCommittedError, CheckpointError
from .load import StepReader
from .plan import GlobalPlan
from .stage import StagingArea
from .storage import Storage

_MISSING = object()


def _same_document(stored: bytes | bytearray, staged: bytes) -> bool:
    try:
        return bool(json.loads(stored) == json.loads(staged))
    except NOT_JSON:
        return False


def same_as_committed(storage: Storage, step: int, rank: int, plan: GlobalPlan,
                      staging: StagingArea, docs: dict[str, bytes], values: dict[str, Any],
                      pool: Executor) -> tuple[int, int, int]:
    """The nonce, size and this rank's bytes of committed step ``step`` when it holds, intact,
    exactly what this rank's save would write: the same plan and JSON values, and each of this
    rank's objects (``staging``'s cells and the documents ``docs``) read back equal to what
    this save staged (with the part CRCs the manifest records). Then a save that finds its
    step committed succeeds without writing: the retry of a save whose COMMIT landed but whose
    answer was lost (every rank judges its own share). Otherwise the refusal."""
    def refuse(why: str) -> CheckpointError:
        return CheckpointCommittedError(f"step {step} is already committed; it is not "
                                        f"overwritten ({why})")
    try:
        reader = StepReader(storage, step)
    except CheckpointError as exc:
        raise refuse(f"it is unreadable: {exc}") from exc
    if reader.commit.get("plan_id") != plan.plan_id:
        raise refuse("it was saved under another plan")
    for path, value in values.items():
        saved = reader.values_by_rank.get(path, {}).get(str(rank), _MISSING)
        if saved is _MISSING:
            saved = reader.values.get(path, _MISSING)
        if saved is _MISSING or not same_value(saved, value):
            raise refuse(f"{path!r} holds another value")

    def differs(job: tuple[str, Any]) -> str | None:
        key, staged = job
        document = not isinstance(staged, int)
        if not document:
            staging.wait_staged(staged)
            staged, crcs = staging.finish(staged)
            if reader.manifest.crcs.get(key) != crcs:
                return f"{key} holds other data"
        try:
            stored = reader.read_object(key)
        except CheckpointError as exc:
            return str(exc)
        # a document the same but for its spacing (an engine that formatted it otherwise)
        if stored == staged or (document and _same_document(stored, staged)):
            return None
        return f"{key} is not what its manifest records"

    jobs = [*((w.key, i) for i, w in enumerate(staging.writes)), *docs.items()]
    # every check ends before the save does (its outcome or error): a check still running
    # would finish its cell in the staging arena after the next save began staging into it
    checks = [pool.submit(differs, job) for job in jobs]
    wait(checks)
    problems = [p for p in (check.result() for check in checks) if p is not None]
    staging.wait_staged()
    if problems:
        raise refuse(problems[0])
    mine = sum(reader.entry(key)[0] for key, _ in jobs)
    return int(reader.commit["nonce"]), int(reader.commit.get("nbytes", 0)), mine
