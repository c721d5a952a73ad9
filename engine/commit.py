"""Phase 2 of a save, and what is visible: COMMIT markers, waiting, retention (quarantine, the
hiding of a damaged step, is in ``quarantine``).

A checkpoint is visible exactly when ``step_N/COMMIT`` exists and parses. The coordinator
(rank 0) writes it after every rank's record exists, carries this save's nonce and lists exactly
the objects the plan assigns to that rank; the marker carries the merged manifest (every object
with its size, part CRCs and a digest bound to its key and this save's nonce: see ``_format``),
so loading and verifying never list storage. Records and the marker are sealed JSON (a crc32c
of their own bytes), checked before use. No rename is involved, which is what makes the
protocol correct on S3. The marker is written with an atomic create (``storage.create``: a local
hard link, S3's conditional PUT), so of two saves of one step (two jobs at one URL, a generation
that did not learn that its predecessor committed) one commits and the other fails: a COMMIT is
never replaced. Storage without such a write (fsspec, an S3 server refusing conditional PUTs)
looks first and then writes, which narrows the race but does not close it.

Who writes what: every rank writes the shard objects the plan assigns it, and a share of the
zarr metadata documents (``metadata_owners``: spread so that no rank writes many more objects
than another; on S3 a save costs one request per object, and a coordinator that wrote all the
metadata was the slowest rank of every save). The coordinator checks each record against
exactly its rank's share, so the share changes nothing of what a COMMIT guarantees.

Records are found by polling the records folder with backoff (the coordinator reads its own
back too: a record must be durable and intact on storage before COMMIT), and waiting ranks poll
the step folder for the COMMIT (storage is the only channel: a stuck save never blocks a
collective of the training job).
"""

from __future__ import annotations

import heapq
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from . import _format
from ._format import Manifest
from ._paths import (
    ABORT,
    COMMIT,
    FORMAT_VERSION,
    QUARANTINE,
    READABLE_FORMATS,
    RECORDS_DIR,
    check_object_keys,
    is_index,
    parse_step_dir,
    record_key,
    step_dir,
)
from ._state import TYPES_PATH, same_value
from ._threads import DaemonPool
from .errors import (
    CheckpointCommittedError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CommitTimeoutError,
    ObjectExistsError,
    StorageError,
)
from .persist import parse_record, record_manifest
from .plan import GlobalPlan
from .storage import Storage
from .storage._base import create

_T = TypeVar("_T")


def metadata_owners(plan: GlobalPlan, keys: Iterable[str]) -> dict[str, int]:
    """Which rank writes each metadata document: in sorted key order, the rank with the fewest
    objects so far (shards the plan gives it plus documents; ties to the lowest rank). A pure
    function of the plan and the keys, so every rank computes the same shares."""
    heap = [(plan.count_of(rank), rank) for rank in range(plan.world_size)]
    heapq.heapify(heap)
    owners: dict[str, int] = {}
    for key in sorted(keys):
        count, rank = heapq.heappop(heap)
        owners[key] = rank
        heapq.heappush(heap, (count + 1, rank))
    return owners


def metadata_share(owners: dict[str, int], docs: dict[str, bytes], rank: int
                   ) -> dict[str, bytes]:
    """The metadata documents ``rank`` writes; ``owners``: ``metadata_owners`` of the plan and
    ``docs`` (~57 ms at 4,096 ranks: the engine computes it once per plan, not per save)."""
    return {key: data for key, data in docs.items() if owners[key] == rank}


_POLL_START_RATE = 2000  # the whole job's polls of one prefix per second, at their first
_POLL_RATE = 500  # the same once backed off


def _poll_delays(world_size: int) -> Iterator[float]:
    """Seconds between polls: up by 1.5x from ``world_size / 2000`` s (at least 10 ms) to a
    cap of ``world_size / 500`` s (at least 50 ms, at most 30 s), each jittered by +-10% (the
    first by +-50%) so that ranks spread out. So the whole job polls one prefix at most
    ~2,000 times a second when its ranks begin waiting together and ~500 once backed off,
    under S3's 5,500 GET/s per prefix with room for the coordinator's own requests there
    (every rank starting at 10 ms made 16,384 ranks send ~160,000 requests in their first
    second, and a cap of 5 s left them at ~3,300 a second). The cap is how late a rank may see
    a COMMIT: a save counts as in flight until every rank has seen it, and the next save is
    skipped as busy (a 0.5 s cap made a 2-rank save that committed in 0.2 s look busy 5
    steps later)."""
    cap = min(30.0, max(0.05, world_size / _POLL_RATE))
    delay = min(cap, max(0.01, world_size / _POLL_START_RATE))
    yield delay * random.uniform(0.5, 1.5)  # the first spread wider: ranks begin together
    while True:
        delay = min(delay * 1.5, cap)
        yield delay * random.uniform(0.9, 1.1)


def committed_steps(storage: Storage, ghosts: set[int] | None = None) -> list[int]:
    """Committed steps, ascending (a step folder with a COMMIT marker). One listing, then the
    markers are looked up concurrently (one HEAD each on S3: not one round trip per step).
    ``ghosts``: steps known to be listed with nothing in them (see ``retain``), left out."""
    return step_dirs(storage, ghosts)[1]


def step_dirs(storage: Storage, ghosts: set[int] | None = None, known: set[int] | None = None
              ) -> tuple[list[int], list[int]]:
    """Every step folder and the committed ones, ascending; ``ghosts`` are left out (and no
    longer kept once they are no longer listed). ``known``: steps taken for committed without
    a look-up (``retain``)."""
    names = storage.list_dir("")
    misplaced = step_folder_as_root(storage, names)
    if misplaced:
        raise NotARootError(misplaced)
    steps = {}
    for name in names:
        step = parse_step_dir(name)
        if step is not None:
            steps[step] = name
    if ghosts is not None:  # shared with the engine's other threads: taken in one operation
        ghosts.intersection_update(steps)
        for step in set.intersection(ghosts, steps):
            del steps[step]
    every = sorted(steps)
    known = known or set()
    unknown = [step for step in every if step not in known]
    found = dict(zip(unknown, _exist_all(storage, [f"{steps[step]}/{COMMIT}"
                                                   for step in unknown])))
    return every, [step for step in every if step in known or found[step]]


def _concurrently(request: Callable[[str], _T], keys: list[str], at_most: int, name: str
                  ) -> Iterator[_T]:
    """``request`` of every key, results in order, at most ``at_most`` at a time (one key: on
    this thread). A caller that stops early (a record that fails the save) cancels the
    requests not yet begun."""
    if len(keys) < 2:
        yield from map(request, keys)
        return
    pool = DaemonPool(min(at_most, len(keys)), name)
    try:
        yield from pool.map(request, keys)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _exist_all(storage: Storage, keys: list[str]) -> list[bool]:
    """``storage.exists`` of every key, concurrently (at most 16 at a time)."""
    return list(_concurrently(storage.exists, keys, 16, "ckpt-exists"))


# the coordinator's concurrent record reads: one at a time, 16,384 GETs of ~20 ms on S3 took
# over 5 minutes
_RECORD_READERS = 32


class NotARootError(CheckpointError):
    """The storage an engine was opened on is inside a checkpoint (``step_folder_as_root``)."""


def step_folder_as_root(storage: Storage, names: Iterable[str]) -> str | None:
    """Why ``storage`` is no checkpoint root, where its listing ``names`` holds what only a
    step's own folder holds: a step folder given as the root (``ckpt/step_000000120``, to
    resume from that step) listed no step, and was taken for an empty root ("no committed
    checkpoint": a trainer started over beside the step it was pointed at)."""
    names = set(names)
    own = next((name for name in (COMMIT, QUARANTINE, RECORDS_DIR) if name in names), None)
    if own is not None:
        return _not_a_root(storage.url, f"it holds {own}")
    # the engine writes no zarr.json into a root: one there is a step's array or group
    # (a step folder's copy without its COMMIT, a folder of one of its arrays)
    if "zarr.json" in names:
        return (f"{storage.url} is inside a checkpoint (it holds zarr.json: a zarr array or "
                "group), not a checkpoint root")
    return None


def step_folder_by_name(url: str) -> str | None:
    """Why ``url`` is no checkpoint root, where its last name is a step folder's
    (``ckpt/step_000000002``, as a DCP user gives each checkpoint a folder of its own): a
    save there wrote a checkpoint root inside the committed step. Known from the URL alone,
    so the same on every rank and before any request."""
    name = url.rstrip("/").rpartition("/")[2]
    if parse_step_dir(name) is not None:
        return _not_a_root(url, "by its name")
    # a folder inside a step's (one of its arrays, a new one beside them): a save there
    # nested a checkpoint root in the committed step
    parts = url.rstrip("/").split("/")
    for index in range(len(parts) - 2, -1, -1):
        step = parse_step_dir(parts[index])
        if step is not None:
            folder = "/".join(parts[:index + 1])
            root = "/".join(parts[:index]) or ("/" if url.startswith("/") else ".")
            return (f"{url} is inside the step folder {folder} (by its name), not a "
                    f"checkpoint root: give {root} and step={step}")
    return None


def _not_a_root(url: str, why: str) -> str:
    head, slash, name = url.rstrip("/").rpartition("/")
    step = parse_step_dir(name)
    if step is None:  # a copy under a name of its own: the folder above lists no such step
        return (f"{url} is a step folder ({why}) under a name that is no step's, not a "
                "checkpoint root: a root holds each step as a folder step_<step, 9 digits> "
                "(step_000000120); give that root")
    root = head or ("/" if slash else ".")
    return f"{url} is a step folder ({why}), not a checkpoint root: give {root} and step={step}"


def all_step_dirs(storage: Storage) -> list[int]:
    return sorted(s for s in map(parse_step_dir, storage.list_dir("")) if s is not None)


def read_commit(storage: Storage, step: int) -> dict[str, Any]:
    """The COMMIT marker of ``step``, checked (hostile content raises CheckpointCorruptError)."""
    return read_marker(storage, step)[0]


def read_marker(storage: Storage, step: int) -> tuple[dict[str, Any], Manifest]:
    """The COMMIT marker of ``step`` and its manifest, every entry checked against its digest."""
    return parse_marker(read_marker_bytes(storage, step), step)


def read_marker_bytes(storage: Storage, step: int) -> bytes | bytearray:
    """The COMMIT marker of ``step`` as stored (CheckpointNotFoundError: there is none)."""
    try:
        return storage.read(f"{step_dir(step)}/{COMMIT}")
    except FileNotFoundError:
        if storage.exists(f"{step_dir(step)}/{QUARANTINE}"):
            raise CheckpointNotFoundError(
                f"step {step} under {storage.url} is quarantined: "
                f"{_quarantined_why(storage, step)}") from None
        misplaced = step_folder_as_root(storage, storage.list_dir(""))
        raise CheckpointNotFoundError(misplaced or f"step {step} is not committed under "
                                      f"{storage.url}") from None


def _quarantined_why(storage: Storage, step: int) -> str:
    """Why quarantined ``step`` was set aside, as its note says: a rollback's save supersedes
    intact steps (``quarantine.supersede``), which a load did not find damaged."""
    why = ("a load found it damaged and set its COMMIT aside (chaos ckpt verify says what is "
           "damaged)")
    try:
        reason = _format.unseal(storage.read(f"{step_dir(step)}/{QUARANTINE}"),
                                where=f"step {step}: QUARANTINE note").get("reason")
    except (FileNotFoundError, CheckpointError):
        return why
    if isinstance(reason, str) and reason.startswith("superseded"):
        return f"{reason} (its COMMIT set aside; chaos ckpt verify still reads it)"
    return why


def parse_marker(data: bytes | bytearray, step: int, *, lazy: bool = False
                 ) -> tuple[dict[str, Any], Manifest]:
    """A COMMIT's document and manifest (``lazy``: as :func:`_format.parse_manifest`); its seal,
    format, step and object keys checked."""
    where = f"step {step}: COMMIT marker"
    try:
        doc = _format.unseal(data, where=where)
    except CheckpointCorruptError:
        if not _format.is_sealed(data):  # format 1 had no seal; a sealed one is damaged
            _refuse_other_format(data, step)
        raise
    if doc.get("format") not in READABLE_FORMATS or doc.get("step") != step:
        _refuse_other_format(data, step)  # intact: a newer engine's step is not damage
        raise CheckpointCorruptError(f"{where} is malformed (format {doc.get('format')!r}, "
                                     f"step {doc.get('step')!r})")
    nbytes = doc.get("nbytes")  # shown and returned as it is: an int, or damage
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise CheckpointCorruptError(f"{where} is malformed (nbytes {nbytes!r})")
    manifest = _format.parse_manifest(doc, where=where, lazy=lazy)
    check_object_keys(manifest.objects, step=step)
    return doc, manifest


def _refuse_other_format(data: bytes | bytearray, step: int) -> None:
    """A marker of another format (older, or a newer engine's) is not damage: say which."""
    try:
        doc = json.loads(data)
    except _format.NOT_JSON:
        return
    version = doc.get("format") if isinstance(doc, dict) else None
    if isinstance(version, int) and version not in READABLE_FORMATS:
        raise CheckpointFormatError(
            f"step {step} was written in checkpoint format {version}; this engine reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))} (load it with the antifragile version "
            "that wrote it)")


def _claims_nonce(data: bytes | bytearray, nonce: int) -> bool:
    """Whether a document that failed its seal still says it belongs to save ``nonce``."""
    try:
        doc = json.loads(data)
    except _format.NOT_JSON:
        return False
    return isinstance(doc, dict) and doc.get("nonce") == nonce


@dataclass(slots=True)
class CommitResult:
    nbytes: int
    objects: int


def _pause(delay_s: float, cancel: threading.Event | None, step: int) -> None:
    """Sleep between polls; an abandoned save (``CheckpointEngine.abandon``) stops here."""
    if cancel is None:
        time.sleep(delay_s)
    elif cancel.wait(delay_s):
        raise CheckpointError(f"step {step}: the save was abandoned (its process group failed)")


def coordinate(storage: Storage, *, plan: GlobalPlan, step: int, nonce: int, deadline: float,
               group_attrs: dict[str, Any], owners: dict[str, int],
               cancel: threading.Event | None = None,
               given_up: Callable[[], str | None] | None = None,
               before_commit: Callable[[], None] | None = None) -> CommitResult:
    """Rank 0: wait for every record, check it against the plan, write group metadata + COMMIT.
    ``owners``: every metadata document of the plan and the rank that writes it
    (``metadata_owners``; each rank's share is checked in its record). Every record, the
    coordinator's own included, is read back from storage and its seal checked.
    ``before_commit`` runs once every record is in, just before the COMMIT is written (a phase
    hook: chaos can hold a save there). With other ranks, nothing is committed after
    ``deadline``: they stop waiting for the COMMIT soon after it. ``given_up``: why to stop
    waiting for the records before then (None: wait on), asked at each poll."""
    base = step_dir(step)
    shares: dict[int, set[str]] = {}
    for key, owner in owners.items():
        shares.setdefault(owner, set()).add(key)
    # of each checked record, only what the commit needs: its manifest merged into the step's,
    # its values and requests (every record and every rank's manifest, kept until the COMMIT
    # beside the merged manifest, were 28 MB of the 139 MB held at 4,096 ranks)
    manifest = Manifest(nonce)
    records: dict[int, dict[str, Any]] = {}
    damaged: dict[int, str] = {}

    def accept(rank: int, record: dict[str, Any], where: str) -> None:
        rank_manifest = record_manifest(record, where=where)
        _check_record(plan, step, rank, record, rank_manifest, shares.get(rank, set()))
        manifest.update(rank_manifest)
        records[rank] = {k: record[k] for k in ("values", "requests") if k in record}
        damaged.pop(rank, None)

    delays = _poll_delays(plan.world_size)
    while len(records) < plan.world_size:
        listed = (name.removesuffix(".json")
                  for name in storage.list_dir(f"{base}/{RECORDS_DIR}"))
        new = [int(r) for r in listed if is_index(r) and int(r) not in records]
        reads = _concurrently(storage.read, [record_key(step, r) for r in new],
                              _RECORD_READERS, "ckpt-records")
        for rank, data in zip(new, reads):
            where = f"step {step}: rank {rank}'s record"
            try:
                record = parse_record(data, where=where)
            except CheckpointCorruptError as exc:
                if _claims_nonce(data, nonce):
                    raise  # this save's record, damaged: never commit what it says
                damaged[rank] = str(exc)  # debris of another save, or this one's to come
                continue
            if record.get("nonce") != nonce:
                continue  # left by an earlier attempt at this step
            if not record.get("ok"):
                raise CheckpointError(f"step {step}: rank {rank} failed to persist: "
                                      f"{record.get('error')}")
            accept(rank, record, where)
        if len(records) < plan.world_size:
            missing = sorted(set(range(plan.world_size)) - set(records))
            if time.monotonic() > deadline:
                notes = "".join(f"; rank {r}: {damaged[r]}" for r in missing if r in damaged)
                raise CommitTimeoutError(
                    f"step {step}: no record from rank(s) {missing} before the commit deadline; "
                    f"the previous checkpoint stays the newest{notes}")
            if given_up is not None and (why := given_up()):
                raise CheckpointError(f"step {step}: no record from rank(s) {missing}, and {why}; "
                                      "not committed, the previous checkpoint stays the newest")
            _pause(next(delays), cancel, step)

    attrs = {**group_attrs, **_merge_values(plan, records)}
    group_doc = _format.dumps(_format.group_metadata(attrs))
    storage.write(f"{base}/zarr.json", [group_doc])
    manifest.add_document("zarr.json", group_doc)
    marker = {"format": FORMAT_VERSION, "step": step, "nonce": nonce, "plan_id": plan.plan_id,
              "world_size": plan.world_size, "nbytes": manifest.nbytes,
              "requests": {str(r): rec.get("requests") for r, rec in sorted(records.items())},
              "manifest": manifest.columns()}
    storage.sync()
    if before_commit is not None:
        before_commit()
    if cancel is not None and cancel.is_set():
        raise CheckpointError(f"step {step}: the save was abandoned (its process group failed)")
    if plan.world_size > 1 and time.monotonic() > deadline:
        # the waiting ranks give up soon after the deadline (``wait_for_commit``): a COMMIT
        # written later would make visible a step that they reported failed
        raise CommitTimeoutError(
            f"step {step}: every record was in only after the commit deadline, when the other "
            "ranks stop waiting for the COMMIT; not committed, the previous checkpoint stays "
            "the newest")
    try:  # an atomic create: a look-up then a write let two saves of the step both commit
        create(storage, f"{base}/{COMMIT}", [_format.seal(marker)])
    except ObjectExistsError:  # another save committed this step meanwhile
        raise _committed_by_another(step) from None
    storage.sync()
    return CommitResult(nbytes=manifest.nbytes, objects=len(manifest.objects))


def _check_record(plan: GlobalPlan, step: int, rank: int, record: dict[str, Any],
                  manifest: Manifest, metadata_keys: set[str]) -> None:
    if record.get("plan_id") != plan.plan_id or record.get("rank") != rank:
        raise CheckpointError(f"step {step}: rank {rank} saved under another plan")
    written = set(manifest.objects)
    expected = plan.keys_of(rank) | metadata_keys
    if written != expected:
        missing, extra = sorted(expected - written)[:3], sorted(written - expected)[:3]
        raise CheckpointError(f"step {step}: rank {rank}'s record does not match the plan "
                              f"(missing {missing}, unexpected {extra})")


def _merge_values(plan: GlobalPlan, records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One JSON value per path; values that differ between ranks are also kept per rank, as
    are values stored alike but described otherwise by the ranks' type records (a NaN on one
    rank, the str "NaN" on another): a load takes the description of a value that a rank did
    not save from another rank's record."""
    def described(rank: int, path: str) -> Any:
        types = records[rank]["values"].get(TYPES_PATH)
        descs = types.get("values") if isinstance(types, dict) else None
        return descs.get(path) if isinstance(descs, dict) else None

    values: dict[str, Any] = {}
    by_rank: dict[str, dict[str, Any]] = {}
    for path, holders in sorted(plan.values.items()):
        seen = {r: records[r]["values"][path] for r in holders if path in records[r]["values"]}
        if not seen:
            continue
        first = seen[min(seen)]
        values[path] = first
        if any(not same_value(v, first) or described(r, path) != described(min(seen), path)
               for r, v in seen.items()):
            by_rank[path] = {str(r): v for r, v in seen.items()}
    return {"values": values, "values_by_rank": by_rank}


def abort(storage: Storage, step: int, nonce: int, reason: str) -> None:
    """Tell waiting ranks this save failed (best effort: they also time out on their own)."""
    try:
        if not storage.exists(f"{step_dir(step)}/{COMMIT}"):
            body = _format.seal({"nonce": nonce, "reason": reason})
            storage.write(f"{step_dir(step)}/{ABORT}", [body])
    except Exception:  # storage may be what failed; waiters time out instead
        pass


def wait_for_commit(storage: Storage, *, step: int, nonce: int, deadline: float,
                    world_size: int = 1, cancel: threading.Event | None = None) -> int:
    """Non-coordinator ranks: block until this save's COMMIT (returns its bytes) or ABORT.
    One request per round (a listing of the step folder), backing off; the marker is read
    once it is listed. Storage that fails a round is asked again until the deadline: the
    coordinator may commit meanwhile, and this rank must not report that step lost."""
    base = step_dir(step)
    delays = _poll_delays(world_size)
    trouble: StorageError | None = None
    while True:
        # a pause first: the COMMIT needs this rank's record, just written, so a look at once
        # never found it (and every rank made it together, as their writes ended together)
        _pause(min(next(delays), max(0.01, deadline - time.monotonic())), cancel, step)
        try:
            names, trouble = set(storage.list_dir(base)), None
        except StorageError as exc:  # retries spent: look again next round
            names, trouble = set(), exc
        if COMMIT in names:
            nbytes = _committed_nbytes(storage, step, nonce)
            if nbytes is not None:
                return nbytes
        if ABORT in names:
            try:
                doc = parse_record(storage.read(f"{base}/{ABORT}"), where=f"step {step}: ABORT")
            except (CheckpointCorruptError, StorageError, FileNotFoundError):
                doc = {}
            if doc.get("nonce") == nonce:
                raise CheckpointError(f"step {step}: commit aborted by rank 0: {doc.get('reason')}")
        if time.monotonic() > deadline:
            # storage that did not answer the last look may have taken the COMMIT meanwhile
            # (the endpoint failing right after it): this rank cannot say the step failed
            failed = ("; the last look failed, so whether it committed is not known here "
                      "(agreed_steps() or load() says, once the storage answers): "
                      f"{trouble}") if trouble is not None else ""
            raise CommitTimeoutError(f"step {step}: no COMMIT from the coordinator (rank 0) "
                                     f"seen before the deadline{failed}") from trouble


MARKER_HEAD = 1 << 16  # what a waiting or loading rank (not rank 0) reads of a COMMIT marker
# how ``coordinate`` begins every marker: its members up to ``nbytes``, in this order
_MARKER_START = re.compile(rb'\{"format": (\d{1,9}), "step": (\d{1,18}), "nonce": (\d{1,19}), '
                           rb'"plan_id": "[0-9a-f]{0,64}", "world_size": \d{1,9}, '
                           rb'"nbytes": (\d{1,19}), "requests": ')


def _committed_nbytes(storage: Storage, step: int, nonce: int) -> int | None:
    """The bytes of the COMMIT of save ``nonce`` of ``step``; None while there is none (it is
    damaged or gone again: keep waiting until the deadline); CheckpointCommittedError when it
    is another save's (the coordinator's own create then fails the same way). At most
    ``MARKER_HEAD`` bytes are read: a marker lists every object of the step (~100 bytes
    each: 6 MB at 1,024 ranks, ~100 MB at 16,384), and every waiting rank read and checked it
    all, at every save. One that fits is checked whole, seal and manifest; of a longer one, its
    head must begin as ``coordinate`` writes it, with this step and nonce (a load checks the
    whole marker before it uses any of it)."""
    try:
        head = marker_head(storage, step)
    except (CheckpointError, FileNotFoundError):
        return None
    if head is None:
        return None
    if head[0] != nonce:  # the coordinator's create is refused: it writes no ABORT here
        raise _committed_by_another(step)
    return head[1]


def marker_head(storage: Storage, step: int) -> tuple[int, int] | None:
    """``(nonce, nbytes)`` of the COMMIT marker of ``step`` from at most ``MARKER_HEAD``
    bytes of it (a marker that fits is checked whole; a longer one's head must begin as
    ``coordinate`` writes it); None when it says neither (damaged, another format).
    FileNotFoundError: there is none."""
    data = storage.read(f"{step_dir(step)}/{COMMIT}", 0, MARKER_HEAD)
    if len(data) < MARKER_HEAD:
        try:
            doc = parse_marker(data, step)[0]
        except CheckpointError:
            return None
        nonce = doc.get("nonce")
        return (nonce, doc["nbytes"]) if isinstance(nonce, int) else None
    head = _MARKER_START.match(data)
    if head is None or int(head.group(1)) not in READABLE_FORMATS or int(head.group(2)) != step:
        return None
    return int(head.group(3)), int(head.group(4))


def _committed_by_another(step: int) -> CheckpointCommittedError:
    return CheckpointCommittedError(
        f"step {step} was committed by another save while this one ran (two jobs writing one "
        "URL?); its COMMIT is not overwritten")


def retain(storage: Storage, keep_last: int | None, ghosts: set[int] | None = None, *,
           saved: int | None = None, kept: set[int] | None = None) -> list[int]:
    """Delete committed steps beyond the newest ``keep_last`` and uncommitted debris older than
    the newest committed step. A quarantined step is evidence: it stays as long as a committed
    step of its age would (it is newer than the oldest step kept, or ``keep_last`` is None:
    every committed step is kept, however old). Never deletes the newest
    committed step. Returns deleted steps. One listing of the root (its step folders and,
    concurrently, their markers: ``committed_steps``), then only the deletions.

    ``saved``: the step whose commit this retention follows. It is kept, and so is every
    folder newer than it: after a rollback to an older step, committed steps of the abandoned
    future may be newer, and the folder of this run's next save, in flight while this runs,
    is then "uncommitted and older than the newest committed step" (the engine makes a save
    of an older step wait for this retention).

    ``ghosts``: kept by the caller across calls. An object store may go on listing a deleted
    step's empty folders for minutes (SeaweedFS removes them one level per cleanup cycle); a
    step folder found to hold nothing is added, and is not looked up, deleted and listed again
    at every save, which made a save's requests grow with the length of the run. The caller
    drops a step when it saves that step again.

    ``kept``: kept by the caller across calls. With ``keep_last=None`` no committed step is
    deleted, so a step found committed once is not looked up again (every step's marker was,
    at every save: requests grew by one per step of the run). One quarantined since still
    counts as committed: it is kept, never deleted."""
    known = kept if keep_last is None and kept is not None else None
    every, committed = step_dirs(storage, ghosts, known)
    if known is not None:
        known.intersection_update(every)
        known.update(committed)
    if not committed:
        return []
    keep = set(committed[-keep_last:]) if keep_last else set(committed)
    keep.add(committed[-1])
    newest_debris = committed[-1]
    if saved is not None:
        keep.add(saved)
        newest_debris = min(newest_debris, saved)
    deleted = []
    failure: CheckpointError | None = None
    # a local step folder that is a link (moved to another disk): the link goes, its COMMIT
    # and data stay whole where they are (they are not this root's to delete)
    unlink = getattr(storage, "delete_link", None)
    for step in every:
        if step in keep or step > newest_debris:
            continue
        try:  # a step that cannot be deleted now does not hold back the others
            if (keep_last is None or step > min(keep)) and storage.exists(
                    f"{step_dir(step)}/{QUARANTINE}"):
                continue
            if unlink is not None and unlink(step_dir(step)):
                deleted.append(step)
                continue
            if step in committed:
                storage.delete(f"{step_dir(step)}/{COMMIT}")  # invisible first, then the data
            if storage.delete_tree(step_dir(step)):
                deleted.append(step)
            elif ghosts is not None:
                ghosts.add(step)
        except CheckpointError as exc:
            failure = failure or exc
    storage.sync()
    if failure is not None:
        raise failure
    return deleted
