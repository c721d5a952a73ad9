"""Phase 2 of a save, and what is visible: COMMIT markers, waiting, retention, quarantine.

A checkpoint is visible exactly when ``step_N/COMMIT`` exists and parses. The coordinator
(rank 0) writes it after every rank's record exists, carries this save's nonce and lists exactly
the objects the plan assigns to that rank; the marker carries the merged manifest (every object
with its size and crc32c), so loading and verifying never list storage. No rename is involved,
which is what makes the protocol correct on S3.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from . import _format
from ._paths import (
    ABORT,
    COMMIT,
    FORMAT_VERSION,
    RECORDS_DIR,
    check_object_key,
    parse_step_dir,
    record_key,
    step_dir,
)
from ._state import same_value
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitTimeoutError,
)
from .persist import Manifest, parse_record, total_bytes
from .plan import GlobalPlan
from .storage import Storage


def _poll_delays() -> Any:
    delay = 0.01
    while True:
        yield delay
        delay = min(delay * 1.5, 0.5)


def committed_steps(storage: Storage) -> list[int]:
    """Committed steps, ascending (a step folder with a COMMIT marker)."""
    steps = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{COMMIT}"):
            steps.append(step)
    return sorted(steps)


def all_step_dirs(storage: Storage) -> list[int]:
    return sorted(s for s in map(parse_step_dir, storage.list_dir("")) if s is not None)


def read_commit(storage: Storage, step: int) -> dict[str, Any]:
    """The COMMIT marker of ``step``, validated (hostile content raises CheckpointCorruptError)."""
    try:
        data = storage.read(f"{step_dir(step)}/{COMMIT}")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} is not committed") from None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"step {step}: COMMIT marker is not JSON ({exc})") from None
    objects = doc.get("objects") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION
            or doc.get("step") != step or not isinstance(objects, dict)):
        raise CheckpointCorruptError(f"step {step}: COMMIT marker is malformed")
    for key, entry in objects.items():
        check_object_key(key, step=step)
        if (not isinstance(entry, list) or len(entry) != 2
                or not all(isinstance(x, int) and 0 <= x < 2**63 for x in entry)):
            raise CheckpointCorruptError(f"step {step}: bad manifest entry for {key!r}")
    return doc


@dataclass(slots=True)
class CommitResult:
    nbytes: int
    objects: int


def coordinate(storage: Storage, *, plan: GlobalPlan, step: int, nonce: int, deadline: float,
               group_attrs: dict[str, Any], metadata_keys: set[str]) -> CommitResult:
    """Rank 0: wait for every record, check it against the plan, write group metadata + COMMIT."""
    base = step_dir(step)
    records: dict[int, dict[str, Any]] = {}
    delays = _poll_delays()
    while len(records) < plan.world_size:
        for name in storage.list_dir(f"{base}/{RECORDS_DIR}"):
            rank_str = name.removesuffix(".json")
            if not rank_str.isdigit() or int(rank_str) in records:
                continue
            rank = int(rank_str)
            record = parse_record(storage.read(record_key(step, rank)))
            if record is None or record.get("nonce") != nonce:
                continue  # still being written, or left by an earlier attempt at this step
            if not record.get("ok"):
                raise CheckpointError(f"step {step}: rank {rank} failed to persist: "
                                      f"{record.get('error')}")
            _check_record(plan, step, rank, record, metadata_keys if rank == 0 else set())
            records[rank] = record
        if len(records) < plan.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(plan.world_size)) - set(records))
                raise CommitTimeoutError(
                    f"step {step}: no record from rank(s) {missing} before the commit deadline; "
                    "the previous checkpoint stays the newest")
            time.sleep(next(delays))

    manifest: Manifest = {}
    for record in records.values():
        manifest.update(record["objects"])
    attrs = {**group_attrs, **_merge_values(plan, records)}
    group_doc = _format.dumps(_format.group_metadata(attrs))
    storage.write(f"{base}/zarr.json", [group_doc])
    manifest["zarr.json"] = [len(group_doc), _format.crc(group_doc)]
    marker = {"format": FORMAT_VERSION, "step": step, "nonce": nonce, "plan_id": plan.plan_id,
              "world_size": plan.world_size, "nbytes": total_bytes(manifest), "objects": manifest}
    storage.sync()
    storage.write(f"{base}/{COMMIT}", [json.dumps(marker).encode()], durable=True)
    storage.sync()
    return CommitResult(nbytes=total_bytes(manifest), objects=len(manifest))


def _check_record(plan: GlobalPlan, step: int, rank: int, record: dict[str, Any],
                  metadata_keys: set[str]) -> None:
    if record.get("plan_id") != plan.plan_id:
        raise CheckpointError(f"step {step}: rank {rank} saved under another plan")
    written = set(record.get("objects", {}))
    expected = plan.keys_of(rank) | metadata_keys
    if written != expected:
        missing, extra = sorted(expected - written)[:3], sorted(written - expected)[:3]
        raise CheckpointError(f"step {step}: rank {rank}'s record does not match the plan "
                              f"(missing {missing}, unexpected {extra})")


def _merge_values(plan: GlobalPlan, records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One JSON value per path; values that differ between ranks are also kept per rank."""
    values: dict[str, Any] = {}
    by_rank: dict[str, dict[str, Any]] = {}
    for path, holders in sorted(plan.values.items()):
        seen = {r: records[r]["values"][path] for r in holders if path in records[r]["values"]}
        if not seen:
            continue
        first = seen[min(seen)]
        values[path] = first
        if any(not same_value(v, first) for v in seen.values()):
            by_rank[path] = {str(r): v for r, v in seen.items()}
    return {"values": values, "values_by_rank": by_rank}


def abort(storage: Storage, step: int, nonce: int, reason: str) -> None:
    """Tell waiting ranks this save failed (best effort: they also time out on their own)."""
    try:
        if not storage.exists(f"{step_dir(step)}/{COMMIT}"):
            body = json.dumps({"nonce": nonce, "reason": reason}).encode()
            storage.write(f"{step_dir(step)}/{ABORT}", [body])
    except Exception:  # storage may be what failed; waiters time out instead
        pass


def wait_for_commit(storage: Storage, *, step: int, nonce: int, deadline: float) -> int:
    """Non-coordinator ranks: block until this save's COMMIT (returns its bytes) or ABORT."""
    base = step_dir(step)
    delays = _poll_delays()
    while True:
        if storage.exists(f"{base}/{COMMIT}"):
            try:
                marker = read_commit(storage, step)
            except CheckpointCorruptError:
                marker = {}
            if marker.get("nonce") == nonce:
                return int(marker.get("nbytes", 0))
        if storage.exists(f"{base}/{ABORT}"):
            doc = parse_record(storage.read(f"{base}/{ABORT}")) or {}
            if doc.get("nonce") == nonce:
                raise CheckpointError(f"step {step}: commit aborted by rank 0: {doc.get('reason')}")
        if time.monotonic() > deadline:
            raise CommitTimeoutError(f"step {step}: no COMMIT from the coordinator (rank 0) "
                                     "before the deadline")
        time.sleep(next(delays))


def retain(storage: Storage, keep_last: int | None) -> list[int]:
    """Delete committed steps beyond the newest ``keep_last`` and uncommitted debris older than
    the newest committed step. Never deletes the newest committed step. Returns deleted steps."""
    committed = committed_steps(storage)
    if not committed:
        return []
    keep = set(committed[-keep_last:]) if keep_last else set(committed)
    keep.add(committed[-1])
    deleted = []
    for step in all_step_dirs(storage):
        if step in keep or step > committed[-1]:
            continue
        storage.delete(f"{step_dir(step)}/{COMMIT}")  # invisible first, then the data
        storage.delete_tree(step_dir(step))
        deleted.append(step)
    storage.sync()
    return deleted


def quarantine(storage: Storage, step: int, reason: str) -> None:
    """Hide a damaged committed step (a CORRUPT note stays for forensics until gc)."""
    base = step_dir(step)
    storage.write(f"{base}/CORRUPT", [json.dumps({"reason": reason}).encode()])
    storage.delete(f"{base}/{COMMIT}")
    storage.sync()
