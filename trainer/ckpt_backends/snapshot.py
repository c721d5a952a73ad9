"""``checkpoint.engine: torchsnapshot``: torchsnapshot 0.1.0 ``Snapshot.async_take``/``take``.

torchsnapshot 0.1.0 predates DTensor: given one it fails (``.numpy() is not supported for
tensor subclasses``). So each rank saves what a torchsnapshot user would have to: its *local*
shards as plain tensors. torchsnapshot keeps non-replicated entries per rank
(``<rank>/state/model/<fqn>``), and rank r restores its own entries. It therefore cannot
reshard: a checkpoint loads only into the world size and layout that wrote it, and loading
into another one is refused with that reason.

``<url>/step_<n>/`` holds the per-rank tensor files and ``.snapshot_metadata``, which rank 0
writes only after every rank's writes are done (a barrier in ``take``; a store barrier in
``async_take``'s background thread): ``.snapshot_metadata`` present means committed.
torchsnapshot keeps no checksums: a flip inside tensor bytes loads silently. Its reads run
unbatched (:func:`_unbatched_reads`): a batched read drops its tensors' errors. Its async saves
get copies of the tensors it would otherwise write from the trainer's own, after the next step
(:func:`_copies_torchsnapshot_skips`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

with warnings.catch_warnings():  # torchsnapshot 0.1.0 calls torch.jit.script at import time
    warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated",
                            DeprecationWarning)
    import torchsnapshot
    from torchsnapshot import knobs
    from torchsnapshot.manifest import PrimitiveEntry

from antifragile.engine import CheckpointError
from antifragile.trainer.ckpt_backends.base import (
    MARKERS,
    CheckpointGroup,
    PeerBackend,
    PeerHandle,
    committed,
    done_future,
    failed_future,
    folder_nbytes,
    load_newest,
    local_root,
    prune,
    step_name,
)

MARKER = MARKERS["torchsnapshot"]


class _NoInPlaceNote(logging.Filter):
    """Drops torchsnapshot's note on every ``read_object`` without a target ("`obj_out` is of
    type <class 'NoneType'>, which does not support in-place load. Its state won't be changed
    after load"): a resume read its step counts and train state so, and the user read dozens
    of times that the state was not restored, though the value read is what loads. Its other
    warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support in-place load" not in record.getMessage()


logging.getLogger("torchsnapshot.snapshot").addFilter(_NoInPlaceNote())
_CONTAINERS = {"dict", "list", "OrderedDict"}
_NO_BATCHING = "TORCHSNAPSHOT_DISABLE_BATCHING"  # torchsnapshot.knobs


@contextlib.contextmanager
def _unbatched_reads() -> Iterator[None]:
    """torchsnapshot's reads, one request at a time, while inside. A rank's tensors all sit
    in one batched file, and torchsnapshot 0.1.0 reads a batch through tasks whose errors it
    never collects (``BatchedBufferConsumer.consume_buffer``: ``asyncio.wait``, results
    unread): a truncated file "loaded" with its tensors left as they were (or uninitialised,
    read without ``obj_out``). Unbatched, the error ends the read. Its own
    ``knobs.override_is_batching_disabled`` leaves the setting behind when the read raises."""
    before = os.environ.get(_NO_BATCHING)
    os.environ[_NO_BATCHING] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_NO_BATCHING, None)
        else:
            os.environ[_NO_BATCHING] = before


def _local(state: Any) -> Any:
    """The same nesting with every DTensor replaced by this rank's shard (shares storage)."""
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return state.to_local()
    return state


def _restore_local(snapshot: Any, rank: int, target: dict[str, Any], where: str) -> None:
    """Fill ``target`` in place with this rank's entries of ``snapshot``.

    Only reads this rank's own files: no collective, so a rank that fails here cannot leave
    another one waiting inside torchsnapshot's ``restore`` barriers. The caller agrees on the
    outcome afterwards."""
    manifest = snapshot.get_manifest()
    for key, want in target.items():
        path = f"{where}/{key}"
        if isinstance(want, dict):
            _restore_local(snapshot, rank, want, path)
            continue
        entry = manifest.get(f"{rank}/{path}")
        if entry is None:
            raise CheckpointError(f"{path} of rank {rank} is not in the snapshot")
        if isinstance(want, torch.Tensor):
            local = want.to_local() if isinstance(want, DTensor) else want
            saved = tuple(getattr(entry, "shape", ()) or ())
            if saved != tuple(local.shape):
                raise CheckpointError(
                    f"{path}: saved shard {saved} does not fit rank {rank}'s "
                    f"{tuple(local.shape)}; torchsnapshot cannot reshard (same layout only)")
            snapshot.read_object(f"{rank}/{path}", obj_out=local)
        elif isinstance(entry, PrimitiveEntry):
            target[key] = entry.get_value()
        else:
            target[key] = snapshot.read_object(f"{rank}/{path}")


def _copies_torchsnapshot_skips(state: Any) -> Any:
    """The same nesting with each CPU tensor that ``async_take`` would write from the tensor
    itself replaced by a copy. torchsnapshot 0.1.0 means to copy every CPU tensor it stages
    for an async snapshot, but its check compares the entry's serializer (a str) with the enum
    and never holds: only a tensor packed into a batch (below the slab threshold, batching
    on) is copied, into the batch. The others were read by its background writes after the
    loop's next optimizer step had changed them: step N's checkpoint held step N+1's values."""
    if isinstance(state, dict):
        return {k: _copies_torchsnapshot_skips(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor) and state.device.type == "cpu" and (
            knobs.is_batching_disabled()
            or state.numel() * state.element_size() >= knobs.get_slab_size_threshold_bytes()):
        return state.clone()
    return state


class _LocalShards:
    """The ``Stateful`` torchsnapshot takes: this rank's part of the trainer state. Restored
    by :func:`_restore_local`, not through torchsnapshot's collective ``restore``.
    ``async_``: for ``async_take``, which must not write from the trainer's own tensors."""

    def __init__(self, state: dict[str, Any], *, async_: bool = False) -> None:
        self.state = state
        self.async_ = async_

    def state_dict(self) -> dict[str, Any]:
        local = _local(self.state)
        return dict(_copies_torchsnapshot_skips(local) if self.async_ else local)

    def load_state_dict(self, loaded: dict[str, Any]) -> None:
        raise NotImplementedError("restored by _restore_local")


def _local_nbytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(_local_nbytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return local.numel() * local.element_size()
    return 0


class SnapshotBackend(PeerBackend):
    name = "torchsnapshot"
    marker = MARKER
    # ``async_take``'s commit barrier waits for every rank in the default store
    # (``get_or_create_store``), in torchsnapshot's own thread
    saves_wait_on_default_store = True

    def save(self, step: int, state: dict[str, Any]) -> PeerHandle:
        path = self.root / step_name(step)
        app = {"state": _LocalShards(state, async_=self.async_)}
        mine = _local_nbytes(state)

        def sizes(_: object) -> tuple[int, int]:
            if self.group.rank == 0:
                prune(self.root, MARKER, self.keep_last)
            total = folder_nbytes(path) - ((path / MARKER).stat().st_size
                                          if (path / MARKER).exists() else 0)
            return mine, total

        t0 = time.perf_counter()
        future: Future[Any]
        if self.async_:  # stages a copy, then writes and commits in its own thread
            _clear_commit_barrier(str(path), self.group)
            try:
                pending = torchsnapshot.Snapshot.async_take(str(path), app, pg=self.group.pg)
            except Exception as exc:  # reported as ckpt_failed
                _fail_commit_barrier(str(path), self.group, exc)
                return PeerHandle(step, failed_future(exc), stall_s=time.perf_counter() - t0,
                                  sizes=sizes)
            future = Future()
            threading.Thread(target=_resolve, args=(pending, future), daemon=True,
                             name=f"torchsnapshot-step-{step}").start()
            return PeerHandle(step, future, stall_s=time.perf_counter() - t0, sizes=sizes)
        try:
            future = done_future(torchsnapshot.Snapshot.take(str(path), app, pg=self.group.pg))
        except Exception as exc:  # reported as ckpt_failed
            future = failed_future(exc)
        return PeerHandle(step, future, stall_s=time.perf_counter() - t0, sizes=sizes,
                          started_t=t0)

    def load(self, state: dict[str, Any], memory: Any = None) -> tuple[int, list[str]]:
        def load_one(step: int) -> None:
            snapshot = torchsnapshot.Snapshot(str(self.root / step_name(step)))
            saved_world = snapshot.metadata.world_size
            if saved_world != self.group.world_size:
                raise CheckpointError(
                    f"saved by {saved_world} ranks, this job has {self.group.world_size}; "
                    "torchsnapshot cannot reshard")
            with _unbatched_reads():
                _restore_local(snapshot, self.group.rank, state, "state")

        return load_newest("torchsnapshot", self.root, self.candidates(), self.group, load_one)

    def close(self) -> None:
        """Nothing to release: the trainer waits for the save in flight before closing."""


def _barrier_store(group: CheckpointGroup) -> Any:
    from torchsnapshot.dist_store import get_or_create_store
    from torchsnapshot.pg_wrapper import PGWrapper

    return get_or_create_store(PGWrapper(group.pg))


def _clear_commit_barrier(path: str, group: CheckpointGroup) -> None:
    """Rank 0, before ``async_take``: torchsnapshot names its commit barrier's store keys
    after the folder, so a step saved again (the last step's retry, a restart's save of the
    same step) meets what the try before it left there: a rank's old arrival lets rank 0
    commit before that rank has written, an old error fails the others. No rank can arrive
    before rank 0 has joined ``async_take``'s collectives, so the keys go first."""
    if group.pg is None or group.world_size == 1 or group.rank != 0:
        return
    store = _barrier_store(group)
    for rank in range(group.world_size):
        store.delete_key(f"torchsnapshot_{path}_{rank}")


def _fail_commit_barrier(path: str, group: CheckpointGroup, exc: BaseException) -> None:
    """``async_take`` failed on this rank after its collectives (it writes what fits its
    staging budget before it returns): the other ranks' background threads wait for this one
    in torchsnapshot's commit barrier (30 min). Report the error there, as torchsnapshot's
    own thread does when a background write fails, so that their saves fail now too."""
    if group.pg is None or group.world_size == 1:
        return
    from torchsnapshot.dist_store import LinearBarrier

    LinearBarrier(prefix=f"torchsnapshot_{path}", store=_barrier_store(group), rank=group.rank,
                  world_size=group.world_size, leader_rank=0).report_error(
        f"{type(exc).__name__}: {exc}")


def _resolve(pending: Any, future: Future[Any]) -> None:
    try:
        future.set_result(pending.wait())
    except BaseException as exc:  # handed to the trainer through the future
        future.set_exception(exc)


def steps(url: str) -> list[int]:
    return committed(local_root(url), MARKER)


def read(url: str, step: int) -> dict[str, Any]:
    """Every entry of a committed snapshot, keyed by its manifest path (``<rank>/state/...``:
    per-rank local shards), in one process without a process group: each leaf's value, and
    each container's kind and keys (``("dict", [1, "a"])``, ``("list", [])``): torchsnapshot
    keeps those in entries of their own (a key's type, an empty container), and a comparison
    without them sees ``{1: x}`` and ``{"1": x}``, or ``{}`` and ``[]``, as the same."""
    path = local_root(url) / step_name(step)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: no committed torchsnapshot checkpoint (no {MARKER})")
    snapshot = torchsnapshot.Snapshot(str(path))
    out: dict[str, Any] = {}
    with _unbatched_reads():
        for key, entry in snapshot.get_manifest().items():
            if isinstance(entry, PrimitiveEntry):  # inline; read_object would leak a loop
                out[key] = entry.get_value()
            elif entry.type in _CONTAINERS:
                out[key] = (entry.type, list(getattr(entry, "keys", [])))
            else:
                out[key] = snapshot.read_object(key)
    return out


def data_files(url: str, step: int) -> list[Path]:
    """The files holding a committed step's tensor bytes (every file but the marker)."""
    folder = local_root(url) / step_name(step)
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)
