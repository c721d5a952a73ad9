"""CheckpointEngine: the public entry point (see DESIGN section 2.1).

Thread model: ``save``/``load``/``wait``/``close`` are called from the training thread; each is
collective when a process group is in use (every rank calls it, in the same order), exactly
like the training collectives around it. A save stages on the calling thread (or on a
background thread with ``defer_staging=True``) while one background thread per engine already
persists each object as soon as it is staged, then commits. The background threads never
touch a process group: ranks coordinate through storage records, so a stuck save cannot
deadlock training.

This module holds the calls and their order; the parts live beside it: ``_agree`` (the
collectives and the verdicts every rank shares), ``stage``, ``persist`` and ``commit`` (the
two phases of a save), ``_resave`` (a save of a step already committed), ``_loader`` (the
steps a load tries, agreed by every rank, and quarantine), ``_fill`` (reading one step into a
load target), ``verify``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

from . import commit as _commit
from ._agree import Ranks, refusal, refuse_together
from ._events import EngineEvents
from ._fill import read_whole
from ._gate import GatedStorage, WriteGate
from ._handle import SaveHandle
from ._loader import Loader
from ._memory import MemoryCopy
from ._paths import COMMIT, step_dir
from ._ranks import PerRank
from ._ranks import inventory as rank_inventory
from ._resave import same_as_committed
from ._state import FlatState, flatten, state_signature, stored_values, undo_load
from ._threads import CLOSE_WAIT_S, DaemonPool, DaemonWorkers
from .errors import CheckpointBusyError, CheckpointError, StorageUnansweredError
from .persist import (
    BoundedRequests,
    WriteTimeoutError,
    group_layout,
    metadata_copy,
    metadata_objects,
    rank_record,
    write_objects,
    write_record,
)
from .plan import GlobalPlan, PlanOptions, build_plan, check_tensor
from .quarantine import supersede
from .stage import StagingArea
from .storage import CountingStorage, RetryingStorage, Storage, open_storage
from .verify import VerifyReport, verify_step

log = logging.getLogger("antifragile.engine")

# staging areas at least this large overlap their copy with the writes (see save)
OVERLAP_MIN_BYTES = 64 * 2**20
# the longest a first save waits for the listing of the step folders begun at the engine's start
LISTING_WAIT_S = 1.0
# the longest commit_timeout_s (about 31 years): a save waits on locks with it, which refuse a
# timeout past threading.TIMEOUT_MAX (9.2e9 s)
MAX_COMMIT_TIMEOUT_S = 1e9
# the longest ``abandon`` waits for the writes its engine already has in storage
ABANDON_WAIT_S = 10.0


class CheckpointEngine:
    """Sharded, asynchronous checkpoints of (3D-)sharded training state on zarr v3.

    ``url`` is a local path, ``s3://bucket/prefix`` or another fsspec URL. ``keep_last`` committed
    steps are retained (``None`` keeps all). ``commit_timeout_s`` bounds how long a save may take
    to commit before its handle fails naming the missing ranks. ``storage_options``: for
    ``s3://``, s3fs's option names (an option the S3 client cannot honour is refused by name;
    see ``storage._s3``); for another fsspec URL, that filesystem's; a local path refuses them.
    ``io_threads``: the threads that read and write this rank's objects.

    ``process_group``: the ranks that save and load together (None: the default group when
    one is initialized, else this process alone). The engine's few collectives run on gloo:
    for a group of another backend (NCCL) it makes a gloo group over the same ranks here, so
    constructing the engine is then collective too (every process of the job when the group
    is the whole job, as ``new_group`` asks).

    ``keep_in_memory``: the staging buffers also hold the replicas this rank does not write, so
    the last committed save is this rank's whole state in host memory (``memory_copy()``), for
    ``load(..., memory=...)`` after a failure; two sets of buffers, used in turn, so that the
    copy survives a save in flight (an async save persists for a good part of the interval
    between saves: a failure then would otherwise find no copy in memory); both are allocated
    when a save plans, so that an allocation failure fails that save on every rank at once.
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
        # refused here: a keep_last of 2.5 failed every retention (nothing was ever deleted),
        # a commit_timeout_s of nan never expired
        if keep_last is not None and (not isinstance(keep_last, int)
                                      or isinstance(keep_last, bool) or keep_last < 1):
            raise CheckpointError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        # io_threads=0 started no I/O thread: a load waited forever, every save timed out
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1:
            raise CheckpointError(f"io_threads must be an int >= 1, got {io_threads!r}")
        if (not isinstance(commit_timeout_s, (int, float)) or isinstance(commit_timeout_s, bool)
                or not 0 < commit_timeout_s <= MAX_COMMIT_TIMEOUT_S):
            raise CheckpointError("commit_timeout_s must be a positive number of seconds, at "
                                  f"most {MAX_COMMIT_TIMEOUT_S:g}, got {commit_timeout_s!r}")
        # taken before, then every save failed (an AttributeError from the planner, or a
        # TypeError naming no option)
        if plan_options is not None and not isinstance(plan_options, PlanOptions):
            raise CheckpointError("plan_options must be a PlanOptions or None, got "
                                  f"{type(plan_options).__name__}")
        if on_phase is not None and not callable(on_phase):
            raise CheckpointError("on_phase must be a callable (step, phase) or None, got "
                                  f"{type(on_phase).__name__}")
        misplaced = isinstance(url, str) and _commit.step_folder_by_name(url)
        if misplaced:
            raise CheckpointError(misplaced)
        self.url = url
        self.keep_last = keep_last
        self.commit_timeout_s = commit_timeout_s
        self.storage: Storage = open_storage(url, storage_options)
        self._plan_options = plan_options or PlanOptions()
        self._ranks = Ranks(process_group)
        self.rank, self.world_size = self._ranks.rank, self._ranks.world_size
        self._pool = DaemonPool(io_threads, "ckpt-io")
        self._workers = DaemonWorkers()  # the save and deferred-staging threads
        self._fingerprint = ""
        self._inventory_cache: tuple[tuple[Any, ...], dict[str, Any], str] | None = None
        self._attrs_cache: tuple[GlobalPlan, tuple[Any, ...], dict[str, Any]] | None = None
        # the plan's zarr.json documents and which rank writes each (the same for every save
        # under one plan; built by the save thread: ~10 ms of Python for a hundred arrays, and
        # the owners ~57 ms at 4,096 ranks)
        self._docs_cache: tuple[GlobalPlan, dict[str, bytes], dict[str, int]] | None = None
        self._plan: GlobalPlan | None = None
        self._ghosts: set[int] = set()  # step folders listed, but empty: ``commit.retain``
        self._kept: set[int] = set()  # steps retention found committed (keep_last=None)
        # rank 0: folders without a COMMIT that a save failed to commit, a load quarantined or
        # a listing found (a crashed save's): cleared before the step is saved again
        self._unfinished: set[int] = set()
        # rank 0: why the root is no checkpoint root, where its listing found it inside a
        # checkpoint (``commit.step_folder_as_root``): every save is refused, on every rank
        self._not_a_root: str | None = None
        # rank 0: steps known committed (its listing, its commits): a save of one is a resave
        # on every rank (agreed in the save's all-reduce), not judged by each rank's own look
        self._committed: set[int] = set()
        # rank 0: the step the last load() returned, until the next save supersedes the
        # committed steps newer than it (``_supersede_abandoned``)
        self._went_back_to: int | None = None
        self._per_rank = PerRank([], 0)
        self._staging: StagingArea | None = None
        # keep_in_memory: a second set of buffers, so that a save stages beside the last
        # committed one (the memory copy) instead of over it; the two are used in turn
        self._other_staging: StagingArea | None = None
        self._last: SaveHandle | None = None
        self._draining: list[SaveHandle] = []  # committed saves whose retention still runs
        self._closed = False  # no new work
        self._close_done = False  # close() has returned: its threads ended or were left
        self.keep_in_memory = keep_in_memory
        self._on_phase = on_phase
        self._memory: MemoryCopy | None = None
        self._cancel = threading.Event()
        self._gate = WriteGate()  # every write and deletion of a save: closed by ``abandon``
        # where the last load() on this rank got its tensors' bytes
        self.last_load_sources: dict[str, int] = {}
        # storage requests of the last load() on this rank, by kind, and their "total"
        self.last_load_requests: dict[str, int] = {}
        self._events = EngineEvents(chaos_events)
        self._loader = Loader(self._ranks, url, self._pool, self._events, self._ghosts,
                              self._unfinished)
        # rank 0: the step folders an earlier process left, listed beside the caller (a save
        # makes no storage request on the training thread); the first save waits for it briefly
        self._lister: threading.Thread | None = None
        if self.rank == 0:
            self._lister = threading.Thread(target=self._note_step_folders, daemon=True,
                                            name="ckpt-list-steps")
            self._lister.start()
        self._listing = self._lister  # kept for close(): the first save forgets ``_lister``

    # -- save ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, blocking: bool = False,
             metadata: dict[str, Any] | None = None, defer_staging: bool = False) -> SaveHandle:
        """Checkpoint ``state`` as ``step``. Returns once the state is safe to mutate (or, with
        ``defer_staging``, at once: wait for ``handle.staged`` before the optimizer step).

        Collective. A previous save that failed without anybody calling its ``wait()`` makes
        this call raise that failure (nothing is started). A previous save still in flight makes
        this one a no-op whose handle fails with CheckpointBusyError: training does not wait
        for storage; a ``blocking`` save (a run's last) waits for it, then saves. A committed
        ``step`` is never overwritten: see ``_resave``. ``metadata`` (JSON, str
        keys) is copied by the call and recorded in the step's group attributes.
        """
        self._check_open()
        if blocking and self._last is not None:
            wait([self._last._future])  # done, not observed: a failure still refuses this save
        # the stall chaos is told of counts from here: the state dicts, the plan and the
        # agreeing all-reduce (which waits for the slowest rank) are the loop's wait too, as
        # the built-in trainer counts them (the previous save's wait above is not, as there)
        called = time.perf_counter()
        # The caller's mistakes (a bad step, a value that cannot be stored) are found on one
        # rank but raised on all, after the first collective: a rank that raised alone would
        # leave the others waiting in it, or pair them with its next training collective.
        mistake: CheckpointError | None = None
        try:
            step_dir(step)
            metadata_json = metadata_copy(metadata)
            flat = flatten(state)
            inv, fingerprint = self._inventory(flat)
        except Exception as exc:  # a Stateful's state_dict() too: refused on every rank
            mistake, fingerprint = refusal(f"step {step} not saved", exc), self._fingerprint
        numeric = step if mistake is None else -1
        last = self._last
        if self.rank == 0 and mistake is None:
            # the retention after a commit of this step or a newer one deletes uncommitted
            # folders older than that step: this one's among them (a save after a rollback).
            # It ends before the first collective, so before any rank writes into the folder
            for previous in [*self._draining, last]:
                if previous is not None and previous.step >= step and previous.done():
                    previous._retained.wait()
        # in this order: a save that ends in between is busy, not a success whose failure
        # nobody raises (it is raised at the next save)
        busy = last is not None and not last.done()
        failure = last._unobserved_failure() if last else None
        if self._lister is not None:  # done long before, unless storage is slow from the start
            self._lister.join(LISTING_WAIT_S)
            self._lister = None
        if mistake is None and self._not_a_root is not None:  # rank 0's listing found it
            mistake = CheckpointError(f"step {step} not saved: {self._not_a_root}")
        if self.rank == 0 and mistake is None and not busy and self._went_back_to is not None:
            self._supersede_abandoned(step)
        # a step a load quarantined since it committed is unfinished again: saved anew
        known = (self.rank == 0 and mistake is None and step in self._committed
                 and step not in self._unfinished)
        if known and not busy and not self._still_committed(step):
            self._committed.discard(step)  # deleted since by another process: saved anew,
            self._unfinished.add(step)  # what is left of its folder cleared first
            known = False
        unfinished = self.rank == 0 and mistake is None and step in self._unfinished
        # one all-reduce: the flags, the nonce, the step, and the digests of the replicated
        # plain tensors under the current plan (``PerRank.agree``). A rank that already knows
        # they will not be used (it is busy, or its layout changed: the plan is rebuilt and
        # agrees its own) sends placeholders: a DDP model's every parameter is such a tensor
        usable = mistake is None and not busy and fingerprint == self._fingerprint \
            and self._plan is not None
        digests = self._per_rank.local_digests(flat.tensors if usable else None)
        agreed = self._ranks.all_max([
            int(fingerprint != self._fingerprint or self._plan is None), int(busy),
            int(failure is not None), secrets.randbits(62) if self.rank == 0 else 0, numeric,
            -numeric,
            int(mistake is not None), int(unfinished), int(known),
            int(last is not None and last._failed()), *digests])
        (replan, any_busy, any_failed, nonce, high, negated_low, any_mistake, clear,
         resave, part_failed) = agreed[:10]
        if part_failed and busy and self.rank == 0:
            # a rank's part of the save in flight failed (its storage down for it, its error
            # record may never arrive): the coordinator gives the step up now, rather than
            # wait for that record to the deadline with every save meanwhile skipped as busy
            assert last is not None
            last._given_up = f"a rank told the save of step {step} that its part failed"
        refuse_together(f"step {step} not saved", "save", mistake, any_mistake, high,
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
            skipped = CheckpointBusyError(
                f"step {step} skipped: the save of step {busy_step} is still persisting")
            handle._fail(skipped)
            warnings.warn(f"checkpoint of step {step} skipped: step {busy_step} still persisting",
                          RuntimeWarning, stacklevel=2)
            self._events.failed(step, skipped)
            return handle
        if clear:
            # no rank is busy, so none still waits for the earlier attempt's COMMIT or ABORT
            # (removed with its folder); the all-reduce after it holds every rank back from
            # writing into the folder until it is cleared
            if self.rank == 0:
                self._clear_unfinished(step)
            self._ranks.all_max([0])
        if replan or self._plan is None:
            self._gather_inventories(inv, fingerprint)
            differ = not self._ranks.alone and self._per_rank.agree(flat.tensors,
                                                                     self._ranks.all_max)
        else:
            differ = not self._ranks.alone and self._per_rank.settle(agreed[10:])
        if differ:
            self._plan = None  # a plain tensor differs between ranks: now saved per rank
        flat.tensors = self._per_rank.rename(flat.tensors)
        if self._plan is None:
            self._replan(flat, step)
        assert self._plan is not None and self._staging is not None
        values = stored_values({p: s.value for p, s in flat.values.items()})
        attrs = self._group_attrs(step, flat, metadata_json)
        if last is not None and not last.retention_done():
            self._draining.append(last)
        self._draining = [h for h in self._draining if not h.retention_done()]
        if self._memory is not None and self._memory.staging is self._staging:
            assert self._other_staging is not None  # allocated with the plan
            self._staging, self._other_staging = self._other_staging, self._staging
        staging = self._staging
        staging.begin()
        self._last = handle
        persist = (f"ckpt-save-{step}", self._persist, handle, self._plan, staging, nonce,
                   values, attrs, bool(resave))
        # A large state's writers start first and write each object as soon as its cell is
        # staged. A small state is staged first: its copy takes milliseconds, and a writer
        # thread running Python beside it would make the loop wait for the GIL instead.
        overlap = defer_staging or staging.nbytes >= OVERLAP_MIN_BYTES
        persisting = False  # the save thread runs: it fails the save with any error here

        def start(name: str, *job: Any) -> None:
            try:
                self._workers.run(name, *job)
            except Exception as exc:  # "can't start new thread": at the thread limit. An
                # interrupt is raised as it is (the save fails below): as a CheckpointError a
                # loop that trains on through failed saves swallowed the user's Ctrl-C
                raise CheckpointError(f"step {step} not saved, rank {self.rank}: its thread "
                                      f"{name} did not start: {type(exc).__name__}: {exc}"
                                      ) from exc

        try:
            if overlap:
                start(*persist)
                persisting = True
            if defer_staging:
                start(f"ckpt-stage-{step}", self._stage, handle, staging, flat, True)
            else:
                try:
                    self._stage(handle, staging, flat, called=called)
                finally:
                    if not overlap:  # after a staging error it fails the save with that error
                        start(*persist)
                        persisting = True
        except BaseException as exc:
            handle._observed = True  # raised here; the save it started fails with it
            if not staging.copied:  # the save's writers wait for the copy no more
                staging.fail(exc)
            if not persisting:  # nothing else will end the handle: every later save would
                self._not_started(handle, exc)  # be skipped as busy, close() wait forever
            raise
        if blocking:
            waited = time.perf_counter()
            handle.wait()
            self._events.blocked(step, waited)
        return handle

    def _not_started(self, handle: SaveHandle, exc: BaseException) -> None:
        """The save's thread did not start: its handle fails here, naming the step."""
        error = exc if isinstance(exc, CheckpointError) else CheckpointError(
            f"step {handle.step} not saved, rank {self.rank}: {type(exc).__name__}: {exc}")
        handle._fail(error)
        self._events.failed(handle.step, error)  # best effort: it raises nothing

    def _note_step_folders(self) -> None:
        """Rank 0, on a thread of its own from the engine's start: the step folders without a
        COMMIT (``commit.step_dirs``, as a load lists them) are what an earlier attempt may
        have left (a process that crashed mid-save, then restarted and saved without loading
        first), so that a save of such a step clears it. Once in the engine's life; a first
        save that comes before it is done writes over what it did not find (as a save did
        before it)."""
        try:
            every, committed = _commit.step_dirs(self.storage)
        except _commit.NotARootError as exc:
            self._not_a_root = str(exc)
            return
        except CheckpointError as exc:
            log.warning("listing the step folders failed: a save of a step an earlier process "
                        "left unfinished writes over its leftovers instead of clearing them "
                        "first: %s", exc)
            return
        self._unfinished.update(set(every) - set(committed))
        self._committed.update(committed)

    def _still_committed(self, step: int) -> bool:
        """Rank 0, before a save of a step it knows committed (a resave, which compares and
        writes nothing): whether its COMMIT is still there. Another process (an operator, a
        tool) may have deleted the step since; compared with what is gone, the save was
        refused as unreadable. One request, for such a save alone; a storage error leaves it
        a resave, whose comparison then says what failed."""
        try:
            return self.storage.exists(f"{step_dir(step)}/{COMMIT}")
        except CheckpointError:
            return True

    def _clear_unfinished(self, step: int) -> None:
        """Rank 0, once every rank agreed to save ``step`` and before any rank writes into
        it: remove what an earlier attempt left in its folder (arrays of another layout
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
        inventories = [json.loads(s) for s in self._ranks.gather(json.dumps(inv))]
        self._per_rank = PerRank(inventories, self.rank, sticky=self._per_rank.paths)
        self._plan = None
        self._fingerprint = fingerprint

    def _replan(self, flat: FlatState, step: int) -> None:
        """A new plan and its buffers, or (the allocation failed on some rank) neither, on
        every rank: the next save plans again, every rank with it (``_plan`` None is part of
        the agreed ``replan``). Collective: a rank whose allocation failed raises with the
        others, which would otherwise wait for its record until the commit deadline."""
        failure: Exception | None = None
        try:
            plan = build_plan(self._per_rank.plan_inventories(), self._plan_options)
            staging = self._new_staging(flat, plan)
            # with keep_in_memory the next save stages into a second set while the memory
            # copy holds this one: allocated here too, so that its failure is agreed as well
            other = self._new_staging(flat, plan) if self.keep_in_memory else None
        except Exception as exc:
            failure = exc
        if self._ranks.all_max([int(failure is not None)])[0]:
            raise failure or CheckpointError(
                f"step {step} not saved: another rank could not plan it or allocate its "
                "staging buffers (its error names why)")
        self._plan, self._staging, self._other_staging = plan, staging, other

    def _new_staging(self, flat: FlatState, plan: GlobalPlan) -> StagingArea:
        return StagingArea(plan.writes[self.rank], flat.tensors,
                           keep_in_memory=self.keep_in_memory)

    def _stage(self, handle: SaveHandle, staging: StagingArea, flat: FlatState,
               deferred: bool = False, called: float | None = None) -> None:
        """Stage on this thread. A failure reaches the save's writers (it fails); deferred,
        it is not raised again here. ``handle.stall_s`` is the staging copy; the event's stall
        is the caller's whole wait, from ``called`` (its ``save()`` call), when given."""
        try:
            handle.stall_s = staging.stage(flat.tensors)
        except BaseException:
            if deferred:
                return
            raise
        stall_s = handle.stall_s if called is None else time.perf_counter() - called
        self._events.staged(handle.step, stall_s)  # before its commit's, which waits
        handle.staged.set()

    def _group_attrs(self, step: int, flat: FlatState, metadata: dict[str, Any]
                     ) -> dict[str, Any]:
        """The group's attributes: the layout part is built once per plan and state layout
        (it lists every array of the plan) and shared by the saves that follow."""
        assert self._plan is not None and self._inventory_cache is not None
        signature = self._inventory_cache[0]
        cached = self._attrs_cache
        if cached is None or cached[0] is not self._plan or cached[1] is not signature:
            cached = (self._plan, signature, group_layout(
                self._plan, flat, self.world_size, self._per_rank.index()))
            self._attrs_cache = cached
        layout = cached[2]
        return {"step": step, "layout": layout["layout"], "metadata": metadata,
                "tensors": layout["tensors"], "per_rank": layout["per_rank"]}

    def _metadata_docs(self, plan: GlobalPlan) -> tuple[dict[str, bytes], dict[str, int]]:
        """The plan's metadata documents and their owners (``commit.metadata_owners``)."""
        cached = self._docs_cache
        if cached is None or cached[0] is not plan:
            docs = metadata_objects(plan)
            cached = (plan, docs, _commit.metadata_owners(plan, docs))
            self._docs_cache = cached
        return cached[1], cached[2]

    def _persist(self, handle: SaveHandle, plan: GlobalPlan, staging: StagingArea, nonce: int,
                 values: dict[str, Any], attrs: dict[str, Any], resave: bool = False) -> None:
        """``resave``: rank 0 knew ``step`` committed, so every rank checks its share against
        it (``_resave``) and writes nothing, whatever its own look at storage says."""
        step, start = handle.step, time.monotonic()
        deadline = start + self.commit_timeout_s
        self._ghosts.discard(step)  # saved again (after a restart from an older step)
        counted = CountingStorage(self.storage)  # this save's requests: handle.requests
        storage = GatedStorage(counted, self._gate)  # no write begins after ``abandon``
        # each request beside the object writes fails the save once it hangs for
        # commit_timeout_s (write_objects bounds the writes itself)
        bounded = BoundedRequests(storage, self.commit_timeout_s)
        recorded = False
        try:
            all_docs, owners = self._metadata_docs(plan)
            docs = _commit.metadata_share(owners, all_docs, self.rank)  # the ones this rank writes
            if resave or bounded.exists(f"{step_dir(step)}/{COMMIT}"):
                recorded = True  # write nothing into a committed step, not even an error record
                nonce, handle.committed_nbytes, handle.nbytes = same_as_committed(
                    bounded, step, self.rank, plan, staging, docs, values, self._pool)
            else:
                self._phase(step, "persisting")
                manifest = write_objects(storage, step, nonce, staging, docs, self._pool,
                                         stall_s=self.commit_timeout_s)
                handle.nbytes = manifest.nbytes
                self._phase(step, "written")
                write_record(bounded, step, self.rank, rank_record(
                    step=step, rank=self.rank, plan_id=plan.plan_id, nonce=nonce,
                    manifest=manifest, values=values, requests=counted.requests["total"] + 1))
                recorded = True
                self._phase(step, "recorded")
                if self.rank == 0:
                    result = _commit.coordinate(
                        bounded, plan=plan, step=step, nonce=nonce, deadline=deadline,
                        group_attrs=attrs, owners=owners, cancel=self._cancel,
                        given_up=lambda: handle._given_up,
                        before_commit=lambda: self._phase(step, "committing"))
                    handle.committed_nbytes = result.nbytes
                else:
                    handle.committed_nbytes = _commit.wait_for_commit(
                        bounded, step=step, nonce=nonce, world_size=plan.world_size,
                        deadline=deadline + min(30.0, self.commit_timeout_s / 2),
                        cancel=self._cancel)
            self._unfinished.discard(step)
            if self.rank == 0:
                self._committed.add(step)
            if self.keep_in_memory:
                self._memory = MemoryCopy.of(step, nonce, staging)
            handle.persist_s = time.monotonic() - start
            handle.requests = counted.requests
            # the writers go on from the copy's end, the staging thread reports it after: a
            # commit is reported once it did (a small save could otherwise commit before)
            handle.staged.wait()
            self._events.committed(step, handle.committed_nbytes, handle.nbytes, handle.persist_s)
            # committed: done, so the next save may start (it is not "busy") while the
            # coordinator's retention runs here; wait() also waits for that retention
            handle._future.set_result(None)
            if self.rank == 0:
                self._retain(handle, bounded)
                handle.requests = counted.requests
        except BaseException as exc:
            if not isinstance(exc, CheckpointError):
                error = CheckpointError(
                    f"step {step}, rank {self.rank}: {type(exc).__name__}: {exc}")
            elif f"step {step}" not in str(exc):  # a StorageError names the key, not the step
                error = type(exc)(f"step {step}, rank {self.rank}: {exc}")
            else:
                error = exc
            # abandoned (``abandon``): the next generation may be saving this step now, and
            # its record of this rank would be overwritten (an ABORT names its save's nonce).
            # A write that never returned: the storage does not answer, and these would hang
            # too (the others time out naming this rank)
            hung = isinstance(exc, WriteTimeoutError)
            noted = self._failure_storage(counted, exc)
            if not recorded and not self._cancel.is_set() and not hung:
                # best effort: if storage is down, the coordinator times out naming this rank
                gated = GatedStorage(noted, self._gate)
                with contextlib.suppress(Exception):
                    write_record(BoundedRequests(gated, self.commit_timeout_s), step, self.rank,
                                 rank_record(step=step, rank=self.rank, plan_id=plan.plan_id,
                                             nonce=nonce, manifest=None, values={},
                                             error=str(error)))
            if self.rank == 0:
                if not hung:  # written after ``abandon`` too: it tells this generation's
                    # other ranks, and any other save ignores it (it names this save's nonce)
                    _commit.abort(BoundedRequests(noted, self.commit_timeout_s), step, nonce,
                                  str(error))
                self._unfinished.add(step)
            if hung:
                # the hung write still holds a view of these buffers and may send it when the
                # storage answers: the next save plans again (every rank agrees on it) and
                # stages into new ones, not into what would land torn in this step's folder
                self._plan = None
            with contextlib.suppress(Exception):
                staging.wait_staged()  # no save may stage into the buffers while this one does
            handle.persist_s = time.monotonic() - start
            handle.requests = counted.requests
            log.warning("checkpoint of step %s failed: %s", step, error)
            self._events.failed(step, error)
            handle._future.set_exception(error)
        finally:
            if not handle._future.done():  # whatever failed above: wait() must not hang
                handle._future.set_exception(CheckpointError(
                    f"step {step}, rank {self.rank}: the save's thread failed"))
            handle.staged.set()
            handle._retained.set()

    def _failure_storage(self, counted: CountingStorage, exc: BaseException) -> CountingStorage:
        """What a failed save's best-effort writes (its error record, the ABORT note) go
        through: ``counted``, but one try a request where a request of the save went
        unanswered through all its tries (a StorageUnansweredError, or one that caused the
        failure): the storage does not answer now, and each write waited the whole retry
        budget again, so a save failed after three bounds where a load fails after one. A
        storage that answers, if with errors, keeps every try. What these writes cannot tell
        the others, their deadlines do: the coordinator commits nothing without every rank's
        record, and the waiting ranks give up soon after the commit deadline."""
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, StorageUnansweredError):
            cause = cause.__cause__
        if cause is None or not isinstance(self.storage, RetryingStorage):
            return counted
        return counted.through(self.storage.once())

    def _supersede_abandoned(self, step: int) -> None:
        """Rank 0, at the first save after a load: where committed steps newer than the step
        loaded exist and this save's ``step`` is not past them all, training went back (a
        rollback, or a newer step that did not load) and they are of the run it abandoned:
        they are superseded (``quarantine.supersede``) before this save writes anything.
        Left, a restart's load() resumed from them, undoing the rollback; retention kept them
        over the new run's steps; a save of one of their steps was refused as already
        committed. A save past them all (a load of an older step to look at it, then training
        on) supersedes nothing. One listing; a failure is a warning, tried again next save."""
        went_back_to = self._went_back_to
        assert went_back_to is not None
        storage = BoundedRequests(self.storage, self.commit_timeout_s)  # on the caller's thread
        try:
            newer = [s for s in _commit.all_step_dirs(storage) if s > went_back_to
                     and storage.exists(f"{step_dir(s)}/{COMMIT}")]
            if newer and newer[-1] >= step:
                supersede(storage, newer, went_back_to)
                self._committed.difference_update(newer)
                self._unfinished.update(newer)  # a save of one clears its folder first
        except CheckpointError as exc:
            log.warning("the steps after step %s, which the run went back to, could not be "
                        "superseded (tried again at the next save): %s", went_back_to, exc)
            return
        self._went_back_to = None

    def _phase(self, step: int, phase: str) -> None:
        """Report ``phase`` to the hook. An abandoned save stops here, and never calls the hook:
        a pause point at this step and phase is the next generation's save's."""
        self._stop_if_abandoned(step)
        if self._on_phase is not None:
            self._on_phase(step, phase)
            self._stop_if_abandoned(step)  # abandoned while the hook held it

    def _stop_if_abandoned(self, step: int) -> None:
        if self._cancel.is_set():
            raise CheckpointError(f"step {step}: the save was abandoned (its process group "
                                  "failed)")

    def _retain(self, handle: SaveHandle, storage: Storage) -> None:
        """Retention after a commit. The save is committed whatever happens here: a failure is
        a warning and ``handle.retention_error``, and the next save's retention retries it.
        An abandoned engine's commit (its COMMIT was in storage at ``abandon``) retains
        nothing: the next generation's saves are in flight, and one of an older step would be
        deleted as debris (``GatedStorage`` refuses the deletions anyway)."""
        if self._cancel.is_set():
            return
        try:
            deleted = _commit.retain(storage, self.keep_last, self._ghosts, saved=handle.step,
                                     kept=self._kept)
        except Exception as exc:
            handle.retention_error = (f"step {handle.step} committed, but retention failed (it "
                                      f"runs again at the next save): {exc}")
            log.warning("%s", handle.retention_error)
            return
        self._committed.difference_update(deleted or ())
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
        return self._loader.listed(self.storage)

    def verify(self, step: int) -> VerifyReport:
        """Read every object of ``step`` back; check crc32c, sizes and coverage. A step neither
        committed nor quarantined raises CheckpointNotFoundError."""
        self._check_open()
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
        overwritten (a read that failed midway), do not use it; but a target refused before
        any read (a shape, a parameter, an optimizer the step does not fit) is as it was, and
        a freshly built optimizer is given back without the state its initialization made.

        ``memory``: another engine's ``memory_copy()`` (same rank, same layout, e.g. from
        before the process group was re-formed): tensors of the step it holds are filled from
        host memory, checked against the COMMIT manifest's CRCs, instead of read from storage.
        ``last_load_sources`` says how many bytes came from each.
        """
        self._check_open()
        mistake: CheckpointError | None = None  # raised on every rank, as in save()
        flat: FlatState | None = None
        try:
            if step is not None:
                step_dir(step)
            flat = flatten(state, loading=True)
            for path, tensor in flat.tensors.items():
                check_tensor(tensor, path=path, target=True)
        except Exception as exc:
            mistake = refusal("nothing loaded", exc)
        storage = CountingStorage(self.storage)
        try:
            numeric = -1 if step is None or mistake is not None else step
            high, negated_low, any_mistake = self._ranks.all_max([numeric, -numeric,
                                                                  int(mistake is not None)])
            refuse_together("nothing loaded", "load", mistake, any_mistake, high, negated_low)
            assert flat is not None
            self.last_load_sources = {"memory_bytes": 0, "storage_bytes": 0}
            loaded = self._loader.load(flat, step, storage, memory, self.last_load_sources)
        except BaseException:
            if flat is not None:
                undo_load(flat)
            raise
        finally:
            self.last_load_requests = storage.requests
        if self.rank == 0:
            self._went_back_to = loaded
        return loaded

    def memory_copy(self) -> MemoryCopy | None:
        """This rank's part of the last committed save, in host memory (``keep_in_memory``),
        or None (not kept, or nothing committed yet). A save in flight stages into the other
        of two sets of buffers, so the copy stays whole until that save has committed (and
        is replaced by it); a copy handed out earlier is refused by a load once the save
        after next has staged over its buffers."""
        return self._memory

    def abandon(self) -> None:
        """Give this engine up after its process group failed: a save in flight fails its
        handle at its next poll or phase (it cannot commit: a rank is gone), nothing more is
        started or written, and the engine's threads end once idle. ``memory_copy()`` stays
        readable. Returns once the writes and deletions already in storage have returned
        (at most ``ABANDON_WAIT_S``; one still running then is logged): the next generation
        saves the same steps again, and one landing later went over its objects (a shard
        object), or made a step of this engine's visible whose retention deleted the next
        generation's save in flight (a COMMIT)."""
        self._closed = self._close_done = True
        self._cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._workers.close(timeout=0.0)
        running = self._gate.close(min(ABANDON_WAIT_S, self.commit_timeout_s))
        if running:
            log.warning("abandoned with requests still in storage after %g s (they may land "
                        "in a step the next generation saves): %s",
                        min(ABANDON_WAIT_S, self.commit_timeout_s), ", ".join(running))

    def read(self, step: int) -> dict[str, Any]:
        """Every tensor of ``step`` as a whole plain CPU tensor, and every JSON value, keyed by
        state path (``model/layers.0.attn.wq.weight``), and the step's type record under
        ``.types`` (tuples, int keys, bytes: what JSON and uint8 arrays do not say). For
        inspection and comparison in one process: not collective, and it holds the whole
        checkpoint in memory."""
        self._check_open()
        return read_whole(self.storage, step, self._pool)

    # -- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the engine is closed")

    def close(self) -> None:
        """Wait for the save in flight (its failure is logged, not raised) and for the threads
        that ran it to end, and on rank 0 for the listing of the step folders begun at the
        engine's start (each up to ``CLOSE_WAIT_S``, then left, saying so). A close that was
        interrupted (Ctrl-C in its wait) is finished by the next."""
        if self._close_done:
            return
        self._closed = True
        for handle in [*self._draining, self._last]:
            if handle is not None and not handle.retention_done():
                try:
                    handle.wait()
                except CheckpointError as exc:
                    log.warning("save in flight at close failed: %s", exc)
        stuck = self._pool.close() + self._workers.close()
        if self._listing is not None:  # no request of a closed engine's goes on in storage
            self._listing.join(CLOSE_WAIT_S)
            if self._listing.is_alive():
                stuck.append(self._listing.name)
        if stuck:
            log.warning("closed with checkpoint threads still running: %s", ", ".join(stuck))
        self._close_done = True

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
