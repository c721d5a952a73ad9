"""Persist: write this rank's shard objects with bounded concurrency, then its phase-1 record.

Runs on the engine's background thread. The record (``.ranks/<rank>.json``) lists every object
the rank wrote with its size and crc32c; it is written only after all of them are durable, so a
record never refers to a torn object.
"""

from __future__ import annotations

import json
from concurrent.futures import Executor
from typing import Any

from . import _format
from ._paths import record_key, step_dir
from .plan import GlobalPlan
from .stage import StagingArea
from .storage import Storage

Manifest = dict[str, list[int]]  # key relative to the step folder -> [nbytes, crc32c]


def metadata_objects(plan: GlobalPlan) -> dict[str, bytes]:
    """The zarr.json of every array and intermediate group (the coordinator writes these)."""
    docs: dict[str, bytes] = {}
    for spec in plan.arrays():
        docs[f"{spec.name}/zarr.json"] = _format.dumps(_format.array_metadata(spec))
        parts = spec.name.split("/")
        for i in range(1, len(parts)):
            docs.setdefault("/".join(parts[:i]) + "/zarr.json",
                            _format.dumps(_format.group_metadata()))
    return docs


def write_objects(storage: Storage, step: int, staging: StagingArea,
                  extra: dict[str, bytes], pool: Executor) -> Manifest:
    """Write the staged cells and ``extra`` objects; return what was written."""
    base = step_dir(step)

    def put_cell(index: int, view: memoryview) -> tuple[str, int, int]:
        write = staging.writes[index]
        parts, nbytes, whole_crc = _format.encode_cell(write.array, write.valid_shape[0]
                                                       if write.valid_shape else 1, view)
        storage.write(f"{base}/{write.key}", parts)
        return write.key, nbytes, whole_crc

    def put_doc(key: str, data: bytes) -> tuple[str, int, int]:
        storage.write(f"{base}/{key}", [data])
        return key, len(data), _format.crc(data)

    futures = [pool.submit(put_doc, k, v) for k, v in extra.items()]
    futures += [pool.submit(put_cell, i, v) for i, v in enumerate(staging.views())]
    manifest: Manifest = {}
    errors = []
    for fut in futures:
        try:
            key, nbytes, crc = fut.result()
            manifest[key] = [nbytes, crc]
        except Exception as exc:  # collect all; report the first
            errors.append(exc)
    if errors:
        raise errors[0]
    storage.sync()
    return manifest


def write_record(storage: Storage, step: int, rank: int, record: dict[str, Any]) -> None:
    storage.write(record_key(step, rank), [json.dumps(record, allow_nan=True).encode()])
    storage.sync()


def parse_record(data: bytes | bytearray) -> dict[str, Any] | None:
    """A record, or None while it is incomplete or unreadable (the coordinator polls again)."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def rank_record(*, step: int, rank: int, plan_id: str, nonce: int, manifest: Manifest | None,
                values: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    return {"step": step, "rank": rank, "plan_id": plan_id, "nonce": nonce,
            "ok": error is None, "error": error, "objects": manifest or {}, "values": values}


def total_bytes(manifest: Manifest) -> int:
    return sum(n for n, _ in manifest.values())
