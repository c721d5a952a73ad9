"""CheckpointEngine: the public entry point (see DESIGN section 2.1).

Thread model: ``save``/``load``/``wait``/``close`` are called from the training thread; each is
collective when a process group is in use (every rank calls it, in the same order), exactly
like the training collectives around it. A save stages on the calling thread (or on a
background thread with ``defer_staging=True``) while one background thread per engine already
persists each object as soon as it is staged, then commits. The background threads never
touch a process group: ranks coordinate through storage records, so a stuck save cannot
deadlock training.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import commit as _commit
from ._events import EngineEvents
from ._memory import MemoryCopy
from ._paths import COMMIT, step_dir
from ._ranks import PerRank
from ._ranks import inventory as rank_inventory
from ._restore import Sources
from ._state import FlatState, finish_load, flatten, iter_local, same_value, state_signature
from ._threads import DaemonWorkers
from .errors import (
    CheckpointBusyError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    StorageError,
)
from .load import StepReader
from .persist import (
    metadata_objects,
    rank_record,
    write_objects,
    write_record,
)
from .plan import (
    ArraySpec,
    GlobalPlan,
    HeldBox,
    PlanOptions,
    build_plan,
    check_tensor,
    local_boxes,
)
from .stage import StagingArea
from .storage import CountingStorage, Storage, open_storage
from .verify import VerifyReport, verify_step

log = logging.getLogger("antifragile.engine")

# staging areas at least this large overlap their copy with the writes (see save)
OVERLAP_MIN_BYTES = 64 * 2**20
_MISSING = object()

# load outcomes, ordered so that an all-reduce MAX gives the worst one across ranks:
# mismatch (the target wants what the step lacks) and unreadable (storage would not hand it
# over) skip the step; corrupt skips and quarantines it; fatal raises at once
_OK, _MISMATCH, _UNREADABLE, _CORRUPT, _FATAL = 0, 1, 2, 3, 4
_ERRORS: dict[str, type[CheckpointError]] = {cls.__name__: cls for cls in (
    CheckpointError, CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError,
    StorageError)}


def _classify(step: int, exc: Exception) -> tuple[int, CheckpointError]:
    """The outcome of a failed load of ``step`` and the CheckpointError to report for it."""
    if isinstance(exc, CheckpointMismatchError):
        return _MISMATCH, exc
    if isinstance(exc, CheckpointCorruptError):
        return _CORRUPT, exc
    if isinstance(exc, (StorageError, CheckpointNotFoundError)):
        named = exc if f"step {step}" in str(exc) else type(exc)(f"step {step}: {exc}")
        return _UNREADABLE, named
    if isinstance(exc, CheckpointError):
        return _FATAL, exc
    log.error("loading step %d failed unexpectedly", step, exc_info=exc)
    return _UNREADABLE, CheckpointError(f"step {step}: {type(exc).__name__}: {exc}")


def _refuse_together(outcome: str, call: str, mistake: CheckpointError | None,
                     any_mistake: int, high: int, negated_low: int) -> None:
    """Raise on every rank when any rank's call was refused by its own checks, or when the
    ranks passed different steps (all-reduced MAX of ``step`` and ``-step``; None and a
    refused step are -1): every rank sees the same reduced values, so all raise or none."""
    if any_mistake:
        raise mistake or CheckpointError(
            f"{outcome}: another rank's call of {call}() was refused (its error names the step "
            "or state path)")
    if high != -negated_low:
        raise CheckpointError(f"{outcome}: the ranks called {call}() with different steps "
                              f"({-negated_low} to {high}; None is -1)")


def _refusal(outcome: str, exc: Exception) -> CheckpointError:
    """``exc`` as the CheckpointError that every rank raises (see ``_refuse_together``): a
    CheckpointError as it is, any other error of the caller's state (a ``state_dict()`` or
    ``load_state_dict()`` that raised) named and chained."""
    if isinstance(exc, CheckpointError):
        return exc
    error = CheckpointError(f"{outcome}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _metadata_copy(metadata: dict[str, Any] | None) -> dict[str, Any]:
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

    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata: a dict, not {type(metadata).__name__}")
    check(metadata, "metadata")
    copied: dict[str, Any] = json.loads(json.dumps(metadata, allow_nan=True))
    return copied


def _layout(spec: ArraySpec) -> dict[str, Any]:
    """An array's layout as the group's index records it (``StepReader.array`` reads it)."""
    return {"offset": list(spec.offset), "shape": list(spec.shape),
            "chunk_shape": list(spec.shard_shape), "inner_rows": spec.inner_rows}


def _same_document(stored: bytes | bytearray, staged: bytes) -> bool:
    try:
        return bool(json.loads(stored) == json.loads(staged))
    except ValueError:
        return False


def _raise_first(futures: list[Future[None]]) -> None:
    wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error


class SaveHandle:
    """One save in flight. ``staged`` is set once the state may be mutated again.

    ``done()`` is True once the save committed (or failed); on the coordinator the retention
    that follows a commit runs after that, and ``wait()`` waits for it too.

    Figures for this rank: ``stall_s`` (what the caller waited for staging), ``persist_s``
    (background write + commit, up to the COMMIT visible), ``nbytes`` (bytes this rank wrote),
    ``committed_nbytes`` (the whole checkpoint, on the coordinator), ``requests`` (storage
    requests this rank's save made, by kind, and their ``total``: see
    ``storage.CountingStorage``; set when done, updated with retention's on the coordinator).
    ``retention_error``: on the coordinator, why retention after the commit failed (the save is
    committed all the same), else None; final once ``wait()`` returned.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.staged = threading.Event()
        self.stall_s = 0.0
        self.persist_s = 0.0
        self.nbytes = 0
        self.committed_nbytes = 0
        self.retention_error: str | None = None
        self.requests: dict[str, int] = {}
        self._future: Future[None] = Future()
        self._observed = False
        # set once the coordinator's retention after the commit is over (at once elsewhere):
        # the save is done (committed) before, so the next one need not wait for retention
        self._retained = threading.Event()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed, and on the coordinator until the retention that follows the
        commit is over (``retention_error`` is final then; ``done()`` is True from the commit
        on); raise the save's CheckpointError if it failed."""
        self._observed = True
        self._future.result(timeout)
        if not self._retained.wait(timeout):
            raise TimeoutError(f"step {self.step}: committed; retention still running")

    def retention_done(self) -> bool:
        """True once the save is over, the coordinator's retention after the commit included
        (``retention_error`` is final then)."""
        return self._retained.is_set()

    def exception(self) -> BaseException | None:
        """The failure, once done (None while in flight or on success)."""
        if not self.done():
            return None
        self._observed = True
        return self._future.exception()

    def _unobserved_failure(self) -> BaseException | None:
        if self.done() and not self._observed:
            return self._future.exception()
        return None


class CheckpointEngine:
    """Sharded, asynchronous checkpoints of (3D-)sharded training state on zarr v3.

    ``url`` is a local path, ``s3://bucket/prefix`` or another fsspec URL. ``keep_last`` committed
    steps are retained (``None`` keeps all). ``commit_timeout_s`` bounds how long a save may take
    to commit before its handle fails naming the missing ranks.

    ``keep_in_memory``: the staging buffers also hold the replicas this rank does not write, so
    the last committed save is this rank's whole state in host memory (``memory_copy()``), for
    ``load(..., memory=...)`` after a failure; two sets of buffers, used in turn, so that the
    copy survives a save in flight (an async save persists for a good part of the interval
    between saves: a failure then would otherwise find no copy in memory).
    ``on_phase(step, phase)`` is called as a save passes ``persisting``, ``written`` (objects
    durable), ``recorded`` (rank record written) and, on the coordinator, ``committing``
    (every record in, COMMIT not yet written), on the save's background thread: chaos holds
    a save there to crash it at a named phase. Under ``chaos run`` the engine reports its
    saves and restores as events (``_events.py``); ``chaos_events=False`` is for a trainer
    that reports them itself.
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = 3,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        commit_timeout_s: float = 600.0,
        io_threads: int = 8,
        plan_options: PlanOptions | None = None,
        keep_in_memory: bool = False,
        on_phase: Callable[[int, str], None] | None = None,
        chaos_events: bool = True,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.url = url
        self.keep_last = keep_last
        self.commit_timeout_s = commit_timeout_s
        self.storage: Storage = open_storage(url, storage_options)
        self._plan_options = plan_options or PlanOptions()
        self._pg = process_group
        if self._pg is None and dist.is_available() and dist.is_initialized():
            self._pg = dist.group.WORLD
        self.rank = dist.get_rank(self._pg) if self._pg is not None else 0
        self.world_size = dist.get_world_size(self._pg) if self._pg is not None else 1
        self._group = self._agreement_group()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-io")
        self._workers = DaemonWorkers()  # the save and deferred-staging threads
        self._fingerprint = ""
        self._inventory_cache: tuple[tuple[Any, ...], dict[str, Any], str] | None = None
        self._attrs_cache: tuple[GlobalPlan, tuple[Any, ...], dict[str, Any]] | None = None
        # the plan's zarr.json documents (the same for every save under one plan; built by the
        # save thread: ~10 ms of Python for a hundred arrays)
        self._docs_cache: tuple[GlobalPlan, dict[str, bytes]] | None = None
        self._plan: GlobalPlan | None = None
        self._ghosts: set[int] = set()  # step folders listed, but empty: ``commit.retain``
        # rank 0: folders without a COMMIT that a save failed to commit, a load quarantined or
        # a listing found (a crashed save's): cleared before the step is saved again
        self._unfinished: set[int] = set()
        self._per_rank = PerRank([], 0)
        self._staging: StagingArea | None = None
        # keep_in_memory: a second set of buffers, so that a save stages beside the last
        # committed one (the memory copy) instead of over it; the two are used in turn
        self._other_staging: StagingArea | None = None
        self._last: SaveHandle | None = None
        self._draining: list[SaveHandle] = []  # committed saves whose retention still runs
        self._closed = False
        self.keep_in_memory = keep_in_memory
        self._on_phase = on_phase
        self._memory: MemoryCopy | None = None
        self._cancel = threading.Event()
        # where the last load() on this rank got its tensors' bytes
        self.last_load_sources: dict[str, int] = {}
        # storage requests of the last load() on this rank, by kind, and their "total"
        self.last_load_requests: dict[str, int] = {}
        self._events = EngineEvents(chaos_events)

    # -- collectives (training thread only) ----------------------------------------------------

    def _agreement_group(self) -> Any:
        if self._pg is None or self.world_size == 1:
            return None
        if "gloo" in str(dist.get_backend(self._pg)):
            return self._pg
        return dist.new_group(dist.get_process_group_ranks(self._pg), backend="gloo")

    def _all_max(self, values: list[int]) -> list[int]:
        if self._group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return [int(x) for x in t]

    def _gather(self, obj: Any) -> list[Any]:
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # -- save ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, blocking: bool = False,
             metadata: dict[str, Any] | None = None, defer_staging: bool = False) -> SaveHandle:
        """Checkpoint ``state`` as ``step``. Returns once the state is safe to mutate (or, with
        ``defer_staging``, at once: wait for ``handle.staged`` before the optimizer step).

        Collective. A previous save that failed without anybody calling its ``wait()`` makes
        this call raise that failure (nothing is started). A previous save still in flight makes
        this one a no-op whose handle fails with CheckpointBusyError: training does not wait
        for storage; a ``blocking`` save (a run's last) waits for it, then saves. A committed
        ``step`` is never overwritten: see ``_same_as_committed``. ``metadata`` (JSON, str
        keys) is copied by the call and recorded in the step's group attributes.
        """
        self._check_open()
        if blocking and self._last is not None:
            wait([self._last._future])  # done, not observed: a failure still refuses this save
        # The caller's mistakes (a bad step, a value that cannot be stored) are found on one
        # rank but raised on all, after the first collective: a rank that raised alone would
        # leave the others waiting in it, or pair them with its next training collective.
        mistake: CheckpointError | None = None
        try:
            step_dir(step)
            metadata_json = _metadata_copy(metadata)
            flat = flatten(state)
            inv, fingerprint = self._inventory(flat)
        except Exception as exc:  # a Stateful's state_dict() too: refused on every rank
            mistake, fingerprint = _refusal(f"step {step} not saved", exc), self._fingerprint
        numeric = step if mistake is None else -1
        last = self._last
        failure = last._unobserved_failure() if last else None
        busy = last is not None and not last.done()
        if self.rank == 0 and mistake is None and not busy and step in self._unfinished:
            self._clear_unfinished(step)
        # one all-reduce: the flags, the nonce, the step, and the digests of the replicated
        # plain tensors under the current plan (``PerRank.agree``). A rank that already knows
        # they will not be used (it is busy, or its layout changed: the plan is rebuilt and
        # agrees its own) sends placeholders: a DDP model's every parameter is such a tensor
        usable = mistake is None and not busy and fingerprint == self._fingerprint \
            and self._plan is not None
        digests = self._per_rank.local_digests(flat.tensors if usable else None)
        agreed = self._all_max([
            int(fingerprint != self._fingerprint), int(busy), int(failure is not None),
            secrets.randbits(62) if self.rank == 0 else 0, numeric, -numeric,
            int(mistake is not None), *digests])
        replan, any_busy, any_failed, nonce, high, negated_low, any_mistake = agreed[:7]
        _refuse_together(f"step {step} not saved", "save", mistake, any_mistake, high,
                         negated_low)
        if any_failed:
            assert last is not None
            last._observed = True
            refused = CheckpointError(
                f"step {step} not saved: the save of step {last.step} failed "
                + (f"on this rank: {failure}" if failure else "on another rank"))
            self._events.failed(step, refused)
            raise refused
        handle = SaveHandle(step)
        if any_busy:
            busy_step = last.step if last else "?"
            handle._observed = True
            handle._future.set_exception(CheckpointBusyError(
                f"step {step} skipped: the save of step {busy_step} is still persisting"))
            handle.staged.set()
            warnings.warn(f"checkpoint of step {step} skipped: step {busy_step} still persisting",
                          RuntimeWarning, stacklevel=2)
            self._events.failed(step, handle._future.exception() or "")
            return handle
        if replan or self._plan is None:
            self._gather_inventories(inv, fingerprint)
            differ = self._group is not None and self._per_rank.agree(flat.tensors,
                                                                       self._all_max)
        else:
            differ = self._group is not None and self._per_rank.settle(agreed[7:])
        if differ:
            self._plan = None  # a plain tensor differs between ranks: now saved per rank
        flat.tensors = self._per_rank.rename(flat.tensors)
        if self._plan is None:
            self._replan(flat)
        assert self._plan is not None and self._staging is not None
        values = json.loads(json.dumps({p: s.value for p, s in flat.values.items()},
                                       allow_nan=True))
        attrs = self._group_attrs(step, flat, metadata_json)
        if last is not None and not last.retention_done():
            self._draining.append(last)
        self._draining = [h for h in self._draining if not h.retention_done()]
        if self._memory is not None and self._memory.staging is self._staging:
            self._staging, self._other_staging = (
                self._other_staging or self._new_staging(flat), self._staging)
        staging = self._staging
        staging.begin()
        self._last = handle
        persist = (f"ckpt-save-{step}", self._persist, handle, self._plan, staging, nonce,
                   values, attrs)
        # A large state's writers start first and write each object as soon as its cell is
        # staged. A small state is staged first: its copy takes milliseconds, and a writer
        # thread running Python beside it would make the loop wait for the GIL instead.
        overlap = defer_staging or staging.nbytes >= OVERLAP_MIN_BYTES
        if overlap:
            self._workers.run(*persist)
        if defer_staging:
            self._workers.run(f"ckpt-stage-{step}", self._stage, handle, staging, flat, True)
        else:
            try:
                self._stage(handle, staging, flat)
            except BaseException:
                handle._observed = True  # raised here; the save it started fails with it
                raise
            finally:
                if not overlap:  # after a staging error it fails the save with that error
                    self._workers.run(*persist)
        if blocking:
            waited = time.perf_counter()
            handle.wait()
            self._events.blocked(step, waited)
        return handle

    def _clear_unfinished(self, step: int) -> None:
        """Rank 0, before the first collective of a save of ``step``, so before any rank writes
        into it: remove what an earlier attempt left in its folder (arrays of another layout
        that a zarr reader of the committed step would list, records, ABORT). Only for a step
        known to need it, so that a save makes no storage request on the training thread
        otherwise; a committed step is never touched."""
        base = step_dir(step)
        try:
            if self.storage.exists(f"{base}/{COMMIT}"):
                self._unfinished.discard(step)  # committed since: it is never touched
            else:
                self.storage.delete_tree(base)  # kept in the set until a save commits it
        except CheckpointError as exc:
            log.warning("step %d: removing what an earlier attempt left failed (the save "
                        "writes over it): %s", step, exc)

    def _inventory(self, flat: FlatState) -> tuple[dict[str, Any], str]:
        """This rank's inventory and its fingerprint; reused while the state's layout (paths,
        dtypes, shapes, tensor layouts, meshes, placements, local shapes, value paths; see
        ``state_signature``) is the same as at the last save: building it maps every
        DTensor's placements to boxes (~0.1 ms a tensor)."""
        signature = state_signature(flat)
        cached = self._inventory_cache
        if cached is not None and cached[0] == signature:
            return cached[1], cached[2]
        inv = rank_inventory(flat.tensors, flat.values)
        fingerprint = hashlib.sha256(json.dumps(inv, sort_keys=True).encode()).hexdigest()
        self._inventory_cache = (signature, inv, fingerprint)
        return inv, fingerprint

    def _gather_inventories(self, inv: dict[str, Any], fingerprint: str) -> None:
        inventories = [json.loads(s) for s in self._gather(json.dumps(inv))]
        self._per_rank = PerRank(inventories, self.rank, sticky=self._per_rank.paths)
        self._plan = None
        self._fingerprint = fingerprint

    def _replan(self, flat: FlatState) -> None:
        self._plan = build_plan(self._per_rank.plan_inventories(), self._plan_options)
        self._staging, self._other_staging = self._new_staging(flat), None

    def _new_staging(self, flat: FlatState) -> StagingArea:
        assert self._plan is not None
        return StagingArea(self._plan.writes[self.rank], flat.tensors,
                           keep_in_memory=self.keep_in_memory)

    def _stage(self, handle: SaveHandle, staging: StagingArea, flat: FlatState,
               deferred: bool = False) -> None:
        """Stage on this thread. A failure reaches the save's writers (it fails); deferred,
        it is not raised again here."""
        try:
            handle.stall_s = staging.stage(flat.tensors)
        except BaseException:
            if deferred:
                return
            raise
        handle.staged.set()
        self._events.staged(handle.step, handle.stall_s)

    def _group_attrs(self, step: int, flat: FlatState, metadata: dict[str, Any]
                     ) -> dict[str, Any]:
        """The group's attributes: the layout part is built once per plan and state layout
        (it lists every array of the plan) and shared by the saves that follow."""
        assert self._plan is not None and self._inventory_cache is not None
        signature = self._inventory_cache[0]
        cached = self._attrs_cache
        if cached is None or cached[0] is not self._plan or cached[1] is not signature:
            cached = (self._plan, signature, self._layout_attrs(flat))
            self._attrs_cache = cached
        layout = cached[2]
        return {"step": step, "layout": layout["layout"], "metadata": metadata,
                "tensors": layout["tensors"], "per_rank": layout["per_rank"]}

    def _layout_attrs(self, flat: FlatState) -> dict[str, Any]:
        assert self._plan is not None
        meshes = []
        for tensor in flat.tensors.values():
            if isinstance(tensor, DTensor):
                mesh = tensor.device_mesh
                entry = {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())}
                if entry not in meshes:
                    meshes.append(entry)
        tensors = {path: {"dtype": spec.dtype, "shape": list(spec.shape),
                          "arrays": [a.name for a in spec.arrays],
                          # a load reads the layout here: no request per array document
                          "array_layout": {a.name: _layout(a) for a in spec.arrays}}
                   for path, spec in self._plan.tensors.items()}
        layout = {"world_size": self.world_size, "meshes": meshes}
        return {"layout": layout, "tensors": tensors, "per_rank": self._per_rank.index()}

    def _metadata_docs(self, plan: GlobalPlan) -> dict[str, bytes]:
        cached = self._docs_cache
        if cached is None or cached[0] is not plan:
            cached = (plan, metadata_objects(plan))
            self._docs_cache = cached
        return cached[1]

    def _persist(self, handle: SaveHandle, plan: GlobalPlan, staging: StagingArea, nonce: int,
                 values: dict[str, Any], attrs: dict[str, Any]) -> None:
        step, start = handle.step, time.monotonic()
        deadline = start + self.commit_timeout_s
        self._ghosts.discard(step)  # saved again (after a restart from an older step)
        storage = CountingStorage(self.storage)  # this save's requests: handle.requests
        recorded = False
        try:
            for previous in list(self._draining):  # its retention might delete this step
                if previous.step >= step:
                    with contextlib.suppress(Exception):
                        previous.wait()
            if storage.exists(f"{step_dir(step)}/{COMMIT}"):
                recorded = True  # write nothing into a committed step, not even an error record
                nonce, handle.committed_nbytes, handle.nbytes = self._same_as_committed(
                    storage, plan, staging, step, values)
            else:
                all_docs = self._metadata_docs(plan)
                docs = _commit.metadata_share(plan, all_docs, self.rank)
                self._phase(step, "persisting")
                manifest = write_objects(storage, step, nonce, staging, docs, self._pool)
                handle.nbytes = manifest.nbytes
                self._phase(step, "written")
                write_record(storage, step, self.rank, rank_record(
                    step=step, rank=self.rank, plan_id=plan.plan_id, nonce=nonce,
                    manifest=manifest, values=values, requests=storage.requests["total"] + 1))
                recorded = True
                self._phase(step, "recorded")
                if self.rank == 0:
                    result = _commit.coordinate(
                        storage, plan=plan, step=step, nonce=nonce, deadline=deadline,
                        group_attrs=attrs, metadata_keys=set(all_docs), cancel=self._cancel,
                        before_commit=lambda: self._phase(step, "committing"))
                    handle.committed_nbytes = result.nbytes
                else:
                    handle.committed_nbytes = _commit.wait_for_commit(
                        storage, step=step, nonce=nonce, world_size=plan.world_size,
                        deadline=deadline + min(30.0, self.commit_timeout_s / 2),
                        cancel=self._cancel)
            self._unfinished.discard(step)
            if self.keep_in_memory:
                self._memory = MemoryCopy.of(step, nonce, staging)
            handle.persist_s = time.monotonic() - start
            handle.requests = storage.requests
            self._events.committed(step, handle.committed_nbytes, handle.nbytes, handle.persist_s)
            # committed: done, so the next save may start (it is not "busy") while the
            # coordinator's retention runs here; wait() also waits for that retention
            handle._future.set_result(None)
            if self.rank == 0:
                self._retain(handle, storage)
                handle.requests = storage.requests
        except BaseException as exc:
            if not isinstance(exc, CheckpointError):
                error = CheckpointError(
                    f"step {step}, rank {self.rank}: {type(exc).__name__}: {exc}")
            elif f"step {step}" not in str(exc):  # a StorageError names the key, not the step
                error = type(exc)(f"step {step}, rank {self.rank}: {exc}")
            else:
                error = exc
            if not recorded:
                # best effort: if storage is down, the coordinator times out naming this rank
                with contextlib.suppress(Exception):
                    write_record(storage, step, self.rank, rank_record(
                        step=step, rank=self.rank, plan_id=plan.plan_id, nonce=nonce,
                        manifest=None, values={}, error=str(error)))
            if self.rank == 0:
                _commit.abort(storage, step, nonce, str(error))
                self._unfinished.add(step)
            with contextlib.suppress(Exception):
                staging.wait_staged()  # no save may stage into the buffers while this one does
            handle.persist_s = time.monotonic() - start
            handle.requests = storage.requests
            log.warning("checkpoint of step %s failed: %s", step, error)
            self._events.failed(step, error)
            handle._future.set_exception(error)
        finally:
            handle.staged.set()
            handle._retained.set()

    def _same_as_committed(self, storage: Storage, plan: GlobalPlan, staging: StagingArea,
                           step: int, values: dict[str, Any]) -> tuple[int, int, int]:
        """The nonce, size and this rank's bytes of committed step ``step`` when it holds,
        intact, exactly what this rank's save would write: the same plan and JSON values, and
        each of this rank's objects read back equal to what this save staged (with the part
        CRCs the manifest records). Then a save that finds its step committed succeeds without
        writing: the retry of a save whose COMMIT landed but whose answer was lost (every rank
        judges its own share). Otherwise the refusal: a committed step is never overwritten."""
        def refuse(why: str) -> CheckpointError:
            return CheckpointError(f"step {step} is already committed; it is not overwritten "
                                   f"({why})")
        try:
            reader = StepReader(storage, step)
        except CheckpointError as exc:
            raise refuse(f"it is unreadable: {exc}") from exc
        if reader.commit.get("plan_id") != plan.plan_id:
            raise refuse("it was saved under another plan")
        for path, value in values.items():
            saved = reader.values_by_rank.get(path, {}).get(str(self.rank), _MISSING)
            if saved is _MISSING:
                saved = reader.values.get(path, _MISSING)
            if saved is _MISSING or not same_value(saved, value):
                raise refuse(f"{path!r} holds another value")
        docs = _commit.metadata_share(plan, self._metadata_docs(plan), self.rank)

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
        problems = [p for p in self._pool.map(differs, jobs) if p is not None]
        staging.wait_staged()
        if problems:
            raise refuse(problems[0])
        mine = sum(reader.entry(key)[0] for key, _ in jobs)
        return int(reader.commit["nonce"]), int(reader.commit.get("nbytes", 0)), mine

    def _phase(self, step: int, phase: str) -> None:
        if self._on_phase is not None:
            self._on_phase(step, phase)
        if self._cancel.is_set():
            raise CheckpointError(f"step {step}: the save was abandoned (its process group "
                                  "failed)")

    def _retain(self, handle: SaveHandle, storage: Storage) -> None:
        """Retention after a commit. The save is committed whatever happens here: a failure is
        a warning and ``handle.retention_error``, and the next save's retention retries it."""
        try:
            deleted = _commit.retain(storage, self.keep_last, self._ghosts, saved=handle.step)
        except Exception as exc:
            handle.retention_error = (f"step {handle.step} committed, but retention failed (it "
                                      f"runs again at the next save): {exc}")
            log.warning("%s", handle.retention_error)
            return
        if deleted:
            log.info("retention removed steps %s", deleted)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and its retention done; raise if
        it failed."""
        for handle in self._draining:
            with contextlib.suppress(CheckpointError):
                handle.wait()  # committed already: only its retention may still run
        if self._last is not None:
            self._last.wait()

    # -- what is stored ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return _commit.committed_steps(self.storage, set(self._ghosts))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def agreed_steps(self) -> list[int]:
        """Committed steps, newest first, as rank 0 lists them. Collective: every rank gets
        the same list (``steps()`` lists on each rank, and a COMMIT landing in between makes
        ranks disagree about whether there is anything to load at all)."""
        return self._listed(self.storage)

    def _listed(self, storage: Storage) -> list[int]:
        """``_candidates(None, ...)``, with nothing committed as an empty list (on every rank
        alike: the listing is rank 0's)."""
        try:
            return self._candidates(None, storage)
        except CheckpointNotFoundError:
            return []

    def verify(self, step: int) -> VerifyReport:
        """Read every object of ``step`` back; check crc32c, sizes and coverage. A step neither
        committed nor quarantined raises CheckpointNotFoundError."""
        return verify_step(self.storage, step, self._pool)

    # -- load ----------------------------------------------------------------------------------

    def load(self, state: Any, step: int | None = None, *,
             memory: MemoryCopy | None = None) -> int:
        """Fill ``state`` in place from ``step`` (default: the newest step that loads intact) and
        return the step loaded. Collective. Reads only what this rank's tensors hold, in
        whatever layout they are (resharding). Every failure is a CheckpointError that all
        ranks agree on. With ``step=None`` a step that does not load is skipped with a warning
        naming it; a damaged one is also quarantined once a second rank's re-read confirms the
        damage (its COMMIT moves into a QUARANTINE note, so it can be saved again and
        ``verify`` still explains it); an unreadable one (storage refused) is only skipped.
        With an explicit step, failure raises. On failure the target may be partly
        overwritten: do not use it.

        ``memory``: another engine's ``memory_copy()`` (same rank, same layout, e.g. from
        before the process group was re-formed): tensors of the step it holds are filled from
        host memory, checked against the COMMIT manifest's CRCs, instead of read from storage.
        ``last_load_sources`` says how many bytes came from each.
        """
        self._check_open()
        mistake: CheckpointError | None = None  # raised on every rank, as in save()
        try:
            if step is not None:
                step_dir(step)
            flat = flatten(state, loading=True)
            for path, tensor in flat.tensors.items():
                check_tensor(tensor, path=path, target=True)
        except Exception as exc:
            mistake = _refusal("nothing loaded", exc)
        numeric = -1 if step is None or mistake is not None else step
        high, negated_low, any_mistake = self._all_max([numeric, -numeric,
                                                        int(mistake is not None)])
        _refuse_together("nothing loaded", "load", mistake, any_mistake, high, negated_low)
        storage = CountingStorage(self.storage)
        self.last_load_sources = {"memory_bytes": 0, "storage_bytes": 0}
        try:
            return self._load(flat, step, storage, memory)
        finally:
            self.last_load_requests = storage.requests

    def _load(self, flat: FlatState, step: int | None, storage: Storage,
              memory: MemoryCopy | None) -> int:
        candidates = self._candidates(step, storage)
        began = self._events.restore_begin()
        newest_error: CheckpointError | None = None
        pending = list(candidates)
        relisted = step is not None  # an explicit step is tried alone
        while pending:
            candidate = pending.pop(0)
            outcome, nonce = _OK, 0
            values: dict[str, Any] = {}
            error: CheckpointError | None = None
            try:
                values, nonce = self._load_step(candidate, flat, storage, memory)
            except Exception as exc:  # every failure is classified, then agreed by all ranks
                outcome, error = _classify(candidate, exc)
            worst, high, negated_low = self._all_max([outcome, nonce, -nonce])
            if worst == _OK and high != -negated_low:
                outcome = worst = _FATAL  # every rank sees it: they all compared the same values
                error = CheckpointError(
                    f"step {candidate}: the ranks see different saves of it (node-local storage "
                    "at one path, or two jobs writing one URL?); refusing to mix them")
            if worst == _OK:
                refused: CheckpointError | None = None
                try:  # the state's objects take what was loaded (load_state_dict)
                    finish_load(flat, values)
                except Exception as exc:
                    refused = CheckpointError(f"step {candidate} loaded, but not taken: {exc}")
                    refused.__cause__ = exc
                (any_refused,) = self._all_max([int(refused is not None)])
                if any_refused:  # the same objects would refuse an older step: no fallback
                    raise refused or CheckpointError(
                        f"step {candidate} loaded, but another rank's state refused it (its "
                        "error names the object)")
                self._events.restore_end(candidate, began)
                return candidate
            reports = self._gather((outcome, type(error).__name__, str(error),
                                    getattr(error, "key", None)))
            error = self._agreed_error(reports, worst)
            if worst == _FATAL or step is not None:
                raise error
            note = ""
            if worst == _CORRUPT:
                note = self._quarantine(candidate, error, reports, storage)
            newest_error = newest_error or error
            self._events.restore_skipped(candidate, error)
            if not pending and not relisted:
                # a save that committed since the listing may have had its retention delete
                # the steps listed (a reader beside a training job, a load beside a save):
                # what committed since is tried too, once, after them
                relisted = True
                pending = [s for s in self._listed(storage) if s > candidates[0]]
                candidates = [*candidates, *pending]
            if pending:
                warnings.warn(f"checkpoint step {candidate} skipped, trying step "
                              f"{pending[0]}: {error}{note}", RuntimeWarning, stacklevel=2)
        assert newest_error is not None
        raise type(newest_error)(f"{newest_error} (no older step loads either; tried "
                                 f"{candidates})")

    def _candidates(self, step: int | None, storage: Storage) -> list[int]:
        """The steps to try, newest first: ``step``, or rank 0's view of what is committed
        (so that every rank tries the same steps; a failure to list is raised on every rank)."""
        if step is not None:
            return [step]
        listing: list[int] = []
        failure: tuple[str, str] | None = None
        if self.rank == 0:
            try:
                every, committed = _commit.step_dirs(storage, set(self._ghosts))
                listing = list(reversed(committed))
                self._unfinished.update(set(every) - set(committed))
            except CheckpointError as exc:
                failure = (type(exc).__name__, str(exc))
        listing, failure = self._gather((listing, failure))[0]
        if failure is not None:
            raise _ERRORS.get(failure[0], CheckpointError)(f"listing {self.url}: {failure[1]}")
        if not listing:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.url}")
        return listing

    def _agreed_error(self, reports: list[tuple[int, str, str, str | None]], worst: int
                      ) -> CheckpointError:
        """The same error on every rank: the first rank whose outcome is the worst one, its
        error class and message, and which ranks reported that outcome."""
        culprits = [r for r, (o, _, _, _) in enumerate(reports) if o == worst]
        _, name, message, _ = reports[culprits[0]]
        if self.world_size > 1:
            who = ", ".join(map(str, culprits))
            plural = "s" if len(culprits) > 1 else ""
            message = f"{message} (rank{plural} {who} of {self.world_size})"
        return _ERRORS.get(name, CheckpointError)(message)

    def _quarantine(self, step: int, error: CheckpointError,
                    reports: list[tuple[int, str, str, str | None]], storage: Storage) -> str:
        """Collective. Quarantine ``step`` once its damage is agreed: the first rank that saw it
        names the object, and another rank (the next one; the same one when alone) reads it
        again, whole. Damage that was not on storage (a bad link or DRAM on one node) is not
        confirmed: the step is skipped for this load but stays visible. Returns a note for
        the warning."""
        reporter, key = next((r, k) for r, (o, _, _, k) in enumerate(reports) if o == _CORRUPT)
        confirmer = (reporter + 1) % self.world_size
        seen = 0
        if self.rank == confirmer:
            if key is None:  # inconsistent metadata: every reader of it sees the same documents
                seen = 1
            else:
                try:
                    StepReader(storage, step).recheck(key)
                except CheckpointCorruptError:
                    seen = 1
                except Exception as exc:  # cannot tell: do not act on one rank's view
                    log.warning("step %d: re-reading %s to confirm damage failed: %s",
                                step, key, exc)
        if not self._all_max([seen])[0]:
            return (f"; rank {confirmer} re-read {key} intact, so the damage is not confirmed "
                    "and the step is not quarantined")
        if self.rank == 0:
            try:
                _commit.quarantine(storage, step, str(error), confirmed_by=confirmer,
                                   reports={r: m for r, (o, _, m, _) in enumerate(reports) if o})
                self._unfinished.add(step)  # saved again, it holds only the new save
            except CheckpointError as exc:
                log.warning("step %d: quarantine failed (it stays visible): %s", step, exc)
        return f" (quarantined; confirmed by rank {confirmer})"

    def _load_step(self, step: int, flat: FlatState, storage: Storage,
                   memory: MemoryCopy | None = None) -> tuple[dict[str, Any], int]:
        """Check the step against the target, read every array's metadata (concurrently), plan
        every read (coverage checked), then run the reads and wait for all of them: no read of
        a step that failed can still be running when the next step is tried. Returns the JSON
        values and the nonce of the save read (the ranks check they all read the same one)."""
        reader = StepReader(storage, step)
        sources = Sources(reader, flat, self.rank)
        targets = []
        for path, tensor in flat.tensors.items():
            if path not in sources.fill:
                continue  # bytes, or state the checkpoint rightly lacks: see Sources
            stored = reader.tensors[sources.fill[path]]
            if stored.dtype != tensor.dtype:
                raise CheckpointMismatchError(
                    f"step {step}, tensor {path!r}: stored dtype {stored.dtype}, target "
                    f"dtype {tensor.dtype} (load into a matching tensor, then convert)")
            if stored.shape != tuple(tensor.shape):
                raise CheckpointMismatchError(
                    f"step {step}, tensor {path!r}: stored shape {list(stored.shape)}, "
                    f"target shape {list(tensor.shape)}")
            targets.append((path, tensor, stored))
        in_memory = self._from_memory(memory, reader, targets)
        targets = [t for t in targets if t[2].path not in in_memory]
        reader.load_arrays([stored for _, _, stored in targets]
                           + [reader.tensors[name] for name in sorted(sources.whole)], self._pool)
        reads = []
        whole: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for path, tensor, stored in targets:
                local = iter_local(tensor)
                for box in local_boxes(tensor, path=path):
                    region = local[tuple(slice(o, o + n)
                                         for o, n in zip(box.local_offset, box.shape))]
                    reads += reader.read_box(stored, box, region)
            for name in sorted(sources.whole):
                stored = reader.tensors[name]
                whole[name] = torch.empty(stored.shape, dtype=stored.dtype)
                box = HeldBox((0,) * len(stored.shape), stored.shape, (0,) * len(stored.shape))
                reads += reader.read_box(stored, box, whole[name])
        _raise_first([self._pool.submit(read) for read in reads])
        self.last_load_sources["storage_bytes"] += sum(
            math.prod(iter_local(t).shape) * t.element_size() for _, t, _ in targets)
        assert memory is not None or not in_memory
        for path, tensor in in_memory.items():
            self.last_load_sources["memory_bytes"] += memory.fill(path, tensor)  # type: ignore[union-attr]
        return sources.values(whole), int(reader.commit["nonce"])

    def _from_memory(self, memory: MemoryCopy | None, reader: StepReader,
                     targets: list[tuple[str, torch.Tensor, Any]]) -> dict[str, torch.Tensor]:
        """The targets ``memory`` fills (stored path -> target tensor): all of them when it
        holds this very save of the step and its bytes match the manifest, else none."""
        if memory is None or memory.step != reader.step or \
                memory.nonce != int(reader.commit["nonce"]):
            return {}
        covered = {stored.path: tensor for _, tensor, stored in targets
                   if memory.covers(stored.path, tensor)}
        if len(covered) != len(targets):
            return {}  # another layout: read everything (one source keeps the load simple)
        unusable = memory.check(reader.commit.get("crcs") or {}, set(covered))
        if unusable is not None:
            log.warning("step %d: the copy in memory is not used: %s; reading the step from "
                        "storage", reader.step, unusable)
            return {}
        return covered

    def memory_copy(self) -> MemoryCopy | None:
        """This rank's part of the last committed save, in host memory (``keep_in_memory``),
        or None (not kept, or nothing committed yet). A save in flight stages into the other
        of two sets of buffers, so the copy stays whole until that save has committed (and
        is replaced by it); a copy handed out earlier is refused by a load once the save
        after next has staged over its buffers."""
        return self._memory

    def abandon(self) -> None:
        """Give this engine up without waiting, after its process group failed: a save in
        flight fails its handle at its next poll or phase (it cannot commit: a rank is gone),
        nothing more is started. ``memory_copy()`` stays readable."""
        self._closed = True
        self._cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def read(self, step: int) -> dict[str, Any]:
        """Every tensor of ``step`` as a whole plain CPU tensor, and every JSON value, keyed by
        state path (``model/layers.0.attn.wq.weight``). For inspection and comparison in one
        process: not collective, and it holds the whole checkpoint in memory."""
        self._check_open()
        reader = StepReader(self.storage, step)
        reader.load_arrays(list(reader.tensors.values()), self._pool)
        out: dict[str, Any] = {}
        reads = []
        for path, stored in reader.tensors.items():
            tensor = torch.empty(stored.shape, dtype=stored.dtype)
            box = HeldBox((0,) * tensor.dim(), stored.shape, (0,) * tensor.dim())
            reads += reader.read_box(stored, box, tensor)
            out[path] = tensor
        _raise_first([self._pool.submit(read) for read in reads])
        values = {p: v for p, v in reader.values.items() if not p.startswith(".")}
        return {**values, **out}

    # -- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the engine is closed")

    def close(self) -> None:
        """Wait for the save in flight (its failure is logged, not raised) and for the threads
        that ran it to end."""
        if self._closed:
            return
        self._closed = True
        for handle in [*self._draining, self._last]:
            if handle is not None and not handle.retention_done():
                try:
                    handle.wait()
                except CheckpointError as exc:
                    log.warning("save in flight at close failed: %s", exc)
        self._pool.shutdown(wait=True)
        stuck = self._workers.close()
        if stuck:
            log.warning("closed with checkpoint threads still running: %s", ", ".join(stuck))

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
