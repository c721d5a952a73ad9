"""Persist: what a save writes. This rank's shard objects with bounded concurrency, then its
phase-1 record; the documents the coordinator adds (every array's zarr.json, the group's
layout index); the check of the ``metadata`` a caller passes.

Writes run on the engine's background thread. The record (``.ranks/<rank>.json``, sealed
JSON) lists every object the rank wrote with its size, part CRCs and digest (see ``_format``);
it is written only after all of them are durable, so a record never refers to a torn object.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, wait
from typing import Any, TypeVar, cast

from torch.distributed.tensor import DTensor

from . import _format
from ._format import Manifest
from ._paths import record_key, step_dir
from ._state import FlatState
from ._threads import DaemonPool
from .errors import CheckpointCorruptError, CheckpointError, CommitTimeoutError
from .plan import ArraySpec, GlobalPlan
from .stage import StagingArea
from .storage import Storage
from .storage._base import create, read_into

_T = TypeVar("_T")


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


def metadata_copy(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """A JSON copy of ``save``'s ``metadata``: the coordinator writes it when it commits, in the
    background, and the caller may reuse its dict once ``save`` returns. What JSON would not
    store as given (another type, a key that is not a str) is refused, naming where."""
    def check(value: object, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise CheckpointError(f"{where}: key {key!r} ({type(key).__name__}) is not a "
                                          "str; JSON would store it as another key")
                check(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                check(item, f"{where}[{index}]")
        elif value is not None and not isinstance(value, (str, int, float)):
            raise CheckpointError(f"{where}: {type(value).__name__} is not JSON (metadata holds "
                                  "str, int, float, bool, None, lists and str-keyed dicts)")
        elif isinstance(value, float) and not math.isfinite(value):
            # no type record says what a str would stand for: a state value keeps it exactly
            raise CheckpointError(f"{where}: {value!r} is not JSON (zarr metadata is strict "
                                  "JSON, which has no NaN or infinity); keep it in the state")

    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata: a dict, not {type(metadata).__name__}")
    check(metadata, "metadata")
    copied: dict[str, Any] = json.loads(json.dumps(metadata, allow_nan=False))
    return copied


def group_layout(plan: GlobalPlan, flat: FlatState, world_size: int,
                 per_rank: dict[str, Any]) -> dict[str, Any]:
    """The layout part of the group's attributes, the index a load reads instead of every
    array's document: the world size and device meshes, each tensor's dtype, shape and arrays
    with their layouts, and the index of what was saved per rank."""
    meshes = []
    for tensor in flat.tensors.values():
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            entry = {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())}
            if entry not in meshes:
                meshes.append(entry)
    tensors = {path: {"dtype": spec.dtype, "shape": list(spec.shape),
                      "arrays": [a.name for a in spec.arrays],
                      "array_layout": {a.name: _layout(a) for a in spec.arrays}}
               for path, spec in plan.tensors.items()}
    layout = {"world_size": world_size, "meshes": meshes}
    return {"layout": layout, "tensors": tensors, "per_rank": per_rank}


def _layout(spec: ArraySpec) -> dict[str, Any]:
    """An array's layout as the group's index records it (``StepReader.array`` reads it)."""
    return {"offset": list(spec.offset), "shape": list(spec.shape),
            "chunk_shape": list(spec.shard_shape), "inner_rows": spec.inner_rows}


class WriteTimeoutError(CommitTimeoutError):
    """A write of this rank's did not return before the save's deadline: the storage does
    not answer (a hung NFS server, an endpoint that never replies). Nothing more is written
    for that save (it would hang too); the write is left to its (daemon) thread."""


class BoundedRequests:
    """``inner`` (a Storage) with every request bounded: one that has not returned after
    ``stall_s`` (commit_timeout_s) raises WriteTimeoutError naming it and is left to its
    daemon thread. For a save's requests beside its object writes (its look-ups, record,
    listings, group documents, COMMIT, retention), which hung with it on storage that has no
    timeouts of its own (a hard NFS mount whose server is gone); ``write_objects`` bounds
    the object writes itself, by the last one that returned. A thread a request: one that
    hangs takes no later request with it once the storage answers again."""

    def __init__(self, inner: Storage, stall_s: float) -> None:
        self.inner, self.url, self.stall_s = inner, inner.url, stall_s

    def _bounded(self, request: str, call: Callable[[], _T]) -> _T:
        done = threading.Event()
        outcome: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as exc:  # raised on the caller's thread below
                outcome.append((False, exc))
            finally:
                done.set()

        threading.Thread(target=run, name="ckpt-request", daemon=True).start()
        if not done.wait(self.stall_s):
            raise WriteTimeoutError(f"{self.url}: {request} did not return for {self.stall_s:g} "
                                    "s (commit_timeout_s), the storage does not answer")
        ok, value = outcome[0]
        if not ok:
            raise value
        return cast(_T, value)

    def write(self, key: str, parts: Any, *, durable: bool = False, late: Any = None) -> None:
        self._bounded(f"write {key}",
                      lambda: self.inner.write(key, parts, durable=durable, late=late))

    def create(self, key: str, parts: Any) -> None:
        self._bounded(f"write {key}", lambda: create(self.inner, key, parts))

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        return self._bounded(f"read {key}", lambda: self.inner.read(key, start, end))

    def read_into(self, key: str, start: int, buffers: Any) -> int:
        return self._bounded(f"read {key}", lambda: read_into(self.inner, key, start, buffers))

    def size(self, key: str) -> int:
        return self._bounded(f"size {key}", lambda: self.inner.size(key))

    def exists(self, key: str) -> bool:
        return self._bounded(f"exists {key}", lambda: self.inner.exists(key))

    def list_dir(self, prefix: str) -> list[str]:
        return self._bounded(f"list_dir {prefix}", lambda: self.inner.list_dir(prefix))

    def delete(self, key: str) -> None:
        self._bounded(f"delete {key}", lambda: self.inner.delete(key))

    def delete_tree(self, prefix: str) -> bool:
        return self._bounded(f"delete_tree {prefix}", lambda: self.inner.delete_tree(prefix))

    def delete_link(self, prefix: str) -> bool:  # retention's, of a step moved elsewhere
        inner = getattr(self.inner, "delete_link", None)
        return inner is not None and self._bounded(f"delete_link {prefix}",
                                                   lambda: bool(inner(prefix)))

    def sync(self) -> None:
        self._bounded("sync", self.inner.sync)


def write_objects(storage: Storage, step: int, nonce: int, staging: StagingArea,
                  extra: dict[str, bytes], pool: DaemonPool, *, stall_s: float) -> Manifest:
    """Write the staged cells and ``extra`` objects; return what was written. When no write
    has returned for ``stall_s`` once staging is over (counted from the last write that
    returned, or from the end of staging, known within ``stall_s``), the storage does not
    answer: WriteTimeoutError names a write still waited for. A slow storage that answers
    fails no save here, however long the writes take (one rank commits late; with more, the
    coordinator's deadline decides).

    May be called while ``staging`` is still being filled (after ``staging.begin()``): each
    object is written as soon as its cell is staged, and this returns only after staging
    completed and every object is durable.

    An object's chunk crc32c values are computed on its writer's thread, never during the
    copy the training loop waits for: on 2 cores, computing them for the objects written
    while later cells were still being copied made ``save()`` stall 1.5x a memcpy of the
    state, against 1.1x without (``bench.engine``, 2 GiB). An object whose cell is staged
    before the copy ends is written at once with its CRC slots unfilled, and they are filled
    once the copy has ended and written again in place (``Storage.write``'s ``late``: a
    page per chunk into the file; an object store sends the object only then). While such a
    writer waits for the copy's end, its I/O thread is lent (``DaemonPool.lend``) and the
    next staged object is written: held, 8 of 8 threads waited with the disk idle."""
    base = step_dir(step)

    def put_cell(index: int) -> tuple[str, int, list[int]]:
        key = staging.writes[index].key
        staging.wait_staged(index)
        if staging.copied:
            image, crcs = staging.finish(index)
            storage.write(f"{base}/{key}", [image])
            return key, len(image), crcs
        late_crcs: list[int] = []

        def fill_crcs() -> list[tuple[int, int]]:
            if not staging.copied:  # another write may run meanwhile: the disk stays busy
                with pool.lend():
                    staging.wait_staged()
            late_crcs[:] = staging.finish(index)[1]
            return staging.crc_slots(index)

        image = staging.image(index)
        storage.write(f"{base}/{key}", [image], late=fill_crcs)
        return key, len(image), late_crcs

    def put_doc(key: str, data: bytes) -> tuple[str, int, list[int]]:
        storage.write(f"{base}/{key}", [data])
        return key, len(data), [_format.crc(data)]

    failed = threading.Event()  # after a failure the writes not yet begun are not made
    returned = [time.monotonic()]  # when a write last returned (or staging was seen going on)

    def unless_failed(put: Callable[..., tuple[str, int, list[int]]], *args: Any
                      ) -> tuple[str, int, list[int]]:
        if failed.is_set():
            raise CancelledError
        try:
            result = put(*args)
        except BaseException:
            failed.set()
            raise
        returned[0] = time.monotonic()
        return result

    futures = [(w.key, pool.submit(unless_failed, put_cell, i))
               for i, w in enumerate(staging.writes)]
    futures += [(k, pool.submit(unless_failed, put_doc, k, v)) for k, v in extra.items()]
    manifest = Manifest(nonce)
    errors = []
    for key, fut in futures:
        while not wait([fut], max(0.0, returned[0] + stall_s - time.monotonic())).done:
            if not staging.copied:  # the writes may be waiting for the copy, not the storage
                returned[0] = max(returned[0], time.monotonic())
            elif time.monotonic() - returned[0] >= stall_s:
                failed.set()
                raise WriteTimeoutError(f"{base}/{key} not written: no write returned for "
                                        f"{stall_s:g} s (commit_timeout_s), the storage does "
                                        "not answer")
        try:
            manifest.add(*fut.result())
        except CancelledError:
            pass
        except Exception as exc:  # report the first
            errors.append(exc)
    if errors:
        raise errors[0]
    staging.wait_staged()  # the shadows too: the memory copy is taken after the commit
    # on a hung NFS server the writes return (into the page cache) and their fsync does not
    try:
        synced = pool.submit(storage.sync)
    except RuntimeError:  # the pool is shut down (abandoned): the save stops at its next phase
        storage.sync()
        return manifest
    if not wait([synced], stall_s).done:
        raise WriteTimeoutError(f"{base}: the sync of its writes did not return for "
                                f"{stall_s:g} s (commit_timeout_s), the storage does not answer")
    synced.result()
    return manifest


def write_record(storage: Storage, step: int, rank: int, record: dict[str, Any]) -> None:
    storage.write(record_key(step, rank), [_format.seal(record)])
    storage.sync()


def parse_record(data: bytes | bytearray, *, where: str) -> dict[str, Any]:
    """A sealed record (or ABORT note); CheckpointCorruptError when its bytes are damaged.
    Writes are atomic (a rename locally, one PUT on S3): a record is never seen half-written."""
    return _format.unseal(data, where=where)


def record_manifest(record: dict[str, Any], *, where: str) -> Manifest:
    return _format.parse_manifest(record, where=where)


def rank_record(*, step: int, rank: int, plan_id: str, nonce: int, manifest: Manifest | None,
                values: dict[str, Any], error: str | None = None, requests: int = 0
                ) -> dict[str, Any]:
    """A rank's phase-1 record. ``requests``: storage requests this rank's save made, this
    record's write included (COMMIT lists them per rank)."""
    if manifest is not None and manifest.nonce != nonce:
        raise CheckpointCorruptError(f"step {step}, rank {rank}: manifest of another save")
    return {"step": step, "rank": rank, "plan_id": plan_id, "nonce": nonce,
            "ok": error is None, "error": error,
            "objects": manifest.objects if manifest else {},
            "crcs": manifest.crcs if manifest else {}, "values": values,
            "requests": requests}
