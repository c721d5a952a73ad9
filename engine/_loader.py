"""The load side of a :class:`CheckpointEngine`: which steps to try, newest first, as every rank
agrees; one step read into the target (``_fill``); the outcome of each try agreed by all
ranks, so that they fall back to the same older step or raise the same error together; a
damaged step quarantined once a second rank's re-read confirms the damage.

The engine checks the caller's arguments and counts the requests; this module holds the
loop of one ``load()``.
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Executor
from typing import Any

from . import commit as _commit
from ._agree import CORRUPT, ERRORS, FATAL, OK, Ranks, Report, classify
from ._events import EngineEvents
from ._fill import fill_step
from ._memory import MemoryCopy
from ._state import FlatState, finish_load
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StepSkippedWarning,
)
from .load import StepReader, read_documents
from .quarantine import quarantine as quarantine_step
from .quarantine import quarantined_steps
from .storage import Storage

log = logging.getLogger("antifragile.engine")


# what the confirming rank's re-read of a damaged object found (``Loader.quarantine``); the
# other ranks hold _INTACT, so an all-reduced max is the confirmer's
_INTACT, _UNREAD, _CONFIRMED = 0, 1, 2


class Loader:
    """Loads for one engine. ``ghosts`` and ``unfinished`` are the engine's own sets (shared,
    not copied): step folders listed but empty, and folders without a COMMIT that rank 0
    clears before the step is saved again (a quarantined step becomes one)."""

    def __init__(self, ranks: Ranks, url: str, pool: Executor, events: EngineEvents,
                 ghosts: set[int], unfinished: set[int]) -> None:
        self._ranks = ranks
        self._url = url
        self._pool = pool
        self._events = events
        self._ghosts = ghosts
        self._unfinished = unfinished

    def load(self, flat: FlatState, step: int | None, storage: Storage,
             memory: MemoryCopy | None, sources: dict[str, int]) -> int:
        """Collective: ``step`` (or the newest step that loads intact) into ``flat``; returns
        the step loaded. ``sources``: the bytes of the step loaded that came from memory and
        from storage (a step tried before it that failed on some rank counts for nothing)."""
        candidates = self.candidates(step, storage)
        began = self._events.restore_begin()
        newest_error: CheckpointError | None = None
        pending = list(candidates)
        relisted = step is not None  # an explicit step is tried alone
        while pending:
            candidate = pending.pop(0)
            outcome, nonce = OK, 0
            values: dict[str, Any] = {}
            error: CheckpointError | None = None
            try:
                values, nonce = self._load_step(candidate, flat, storage, memory, sources)
            except Exception as exc:  # every failure is classified, then agreed by all ranks
                outcome, error = classify(candidate, exc)
            worst, high, negated_low = self._ranks.all_max([outcome, nonce, -nonce])
            if worst == OK and high != -negated_low:
                outcome = worst = FATAL  # every rank sees it: they all compared the same values
                error = _different_saves(candidate)
            if worst == OK:
                self._take(candidate, flat, values)
                self._events.restore_end(candidate, began)
                return candidate
            reports: list[Report] = self._ranks.gather(
                (outcome, type(error).__name__, str(error), getattr(error, "key", None)))
            error = self._ranks.agreed_error(reports, worst)
            if worst == FATAL or step is not None:
                raise error
            note = ""
            if worst == CORRUPT:
                note = self.quarantine(candidate, error, reports, storage)
            newest_error = newest_error or error
            self._events.restore_skipped(candidate, error)
            if not pending and not relisted:
                # a save that committed since the listing may have had its retention delete
                # the steps listed (a reader beside a training job, a load beside a save):
                # what committed since is tried too, once, after them
                relisted = True
                pending = [s for s in self.listed(storage, quarantined_ok=True)
                           if s > candidates[0]]
                candidates = [*candidates, *pending]
            if pending:
                warnings.warn(f"checkpoint step {candidate} skipped, trying step "
                              f"{pending[0]}: {error}{note}", StepSkippedWarning, stacklevel=3)
        assert newest_error is not None
        raise type(newest_error)(f"{newest_error} (no older step loads either; tried "
                                 f"{candidates})")

    def _take(self, step: int, flat: FlatState, values: dict[str, Any]) -> None:
        """The state's objects take what was loaded (``load_state_dict``), on every rank or
        on none: the same objects would refuse an older step, so there is no fallback."""
        refused: CheckpointError | None = None
        try:
            finish_load(flat, values)
        except Exception as exc:
            refused = CheckpointError(f"step {step} loaded, but not taken: {exc}")
            refused.__cause__ = exc
        (any_refused,) = self._ranks.all_max([int(refused is not None)])
        if any_refused:
            raise refused or CheckpointError(
                f"step {step} loaded, but another rank's state refused it (its error names "
                "the object)")

    def listed(self, storage: Storage, *, quarantined_ok: bool = False) -> list[int]:
        """``candidates(None, ...)``, with nothing committed as an empty list (on every rank
        alike: the listing is rank 0's). A root whose every step was quarantined raises
        CheckpointCorruptError unless ``quarantined_ok``: it is not an empty one."""
        try:
            return self.candidates(None, storage, quarantined_ok=quarantined_ok)
        except CheckpointNotFoundError:
            return []

    def candidates(self, step: int | None, storage: Storage, *,
                   quarantined_ok: bool = False) -> list[int]:
        """The steps to try, newest first: ``step``, or rank 0's view of what is committed
        (so that every rank tries the same steps; a failure to list is raised on every rank).
        Nothing committed: CheckpointNotFoundError, or (unless ``quarantined_ok``)
        CheckpointCorruptError where steps were quarantined: a caller that starts over when
        nothing is committed would otherwise lose them without a word."""
        if step is not None:
            return [step]
        listing: list[int] = []
        hidden: list[int] = []
        failure: tuple[str, str] | None = None
        if self._ranks.rank == 0:
            try:
                every, committed = _commit.step_dirs(storage, set(self._ghosts))
                listing = list(reversed(committed))
                self._unfinished.update(set(every) - set(committed))
                if not committed and not quarantined_ok:
                    hidden = quarantined_steps(storage)
            except CheckpointError as exc:
                failure = (type(exc).__name__, str(exc))
        listing, hidden, failure = self._ranks.gather((listing, hidden, failure))[0]
        if failure is not None:
            raise ERRORS.get(failure[0], CheckpointError)(f"listing {self._url}: {failure[1]}")
        if hidden:
            raise CheckpointCorruptError(
                f"no intact checkpoint under {self._url}: none is committed and steps {hidden} "
                f"were quarantined as damaged (`chaos ckpt ls {self._url}` says why); delete "
                "their step folders to start over")
        if not listing:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self._url}")
        return listing

    def quarantine(self, step: int, error: CheckpointError, reports: list[Report],
                   storage: Storage) -> str:
        """Collective. Quarantine ``step`` once its damage is agreed: the first rank that saw it
        names the object, and another rank (the next one; the same one when alone) reads it
        again, whole. Damage that was not on storage (a bad link or DRAM on one node) is not
        confirmed: the step is skipped for this load but stays visible. Returns a note for
        the warning."""
        reporter, key = next((r, k) for r, (o, _, _, k) in enumerate(reports) if o == CORRUPT)
        confirmer = (reporter + 1) % self._ranks.world_size
        seen, nonce = _INTACT, 0  # nonce: of the save whose damage is confirmed (0: unknown)
        if self._ranks.rank == confirmer:
            if key is None:  # inconsistent metadata: every reader of it sees the same documents
                seen = _CONFIRMED
            else:
                try:
                    reader = StepReader(storage, step)
                    read = int(reader.commit["nonce"])
                    nonce = read if 0 < read < 2**63 else 0  # what all_max can carry
                    reader.recheck(key)
                except CheckpointCorruptError:
                    seen = _CONFIRMED
                except Exception as exc:  # cannot tell: do not act on one rank's view
                    seen = _UNREAD
                    log.warning("step %d: re-reading %s to confirm damage failed: %s",
                                step, key, exc)
        # the confirmer's: the others hold _INTACT and 0
        seen, nonce = self._ranks.all_max([seen, nonce])
        if seen == _UNREAD:
            return (f"; rank {confirmer} could not re-read {key} (its log says why), so the "
                    "damage is not confirmed and the step is not quarantined")
        if seen == _INTACT:
            return (f"; rank {confirmer} re-read {key} intact, so the damage is not confirmed "
                    "and the step is not quarantined")
        failed, gone = 0, 0
        if self._ranks.rank == 0:
            try:
                hid = quarantine_step(storage, step, str(error), confirmed_by=confirmer,
                                      reports={r: m for r, (o, _, m, _) in enumerate(reports)
                                               if o}, nonce=nonce or None)
                gone = int(not hid)
                self._unfinished.add(step)  # saved again, it holds only the new save
            except CheckpointError as exc:
                failed = 1
                log.warning("step %d: quarantine failed (it stays visible): %s", step, exc)
        failed, gone = self._ranks.all_max([failed, gone])  # every rank says what rank 0 did
        if failed:
            return (f"; rank {confirmer} confirmed the damage, but quarantining it failed (it "
                    "stays visible; rank 0's log says why)")
        if gone:
            return (f"; rank {confirmer} confirmed the damage, but the step was deleted, "
                    "quarantined or saved again by another process meanwhile, so this load "
                    "quarantined nothing")
        return f" (quarantined; confirmed by rank {confirmer})"

    def _load_step(self, step: int, flat: FlatState, storage: Storage,
                   memory: MemoryCopy | None, sources: dict[str, int]
                   ) -> tuple[dict[str, Any], int]:
        """``step`` into ``flat`` (see ``_fill.fill_step``): its JSON values and the nonce of
        the save read (the ranks check they all read the same one)."""
        reader = self._open(step, storage)
        with reader.unless_gone():  # a step deleted meanwhile is not damaged
            filled = fill_step(storage, step, flat, self._ranks.rank, self._pool, memory, reader)
        sources["storage_bytes"] = filled.storage_bytes
        sources["memory_bytes"] = filled.memory_bytes
        return filled.values, filled.nonce

    def _open(self, step: int, storage: Storage) -> StepReader:
        """Collective: ``step`` opened on every rank. Rank 0 reads the COMMIT and the group
        document and hands their bytes to the others; every rank checks and parses them (at
        once: as if each had read them): a COMMIT lists every object of the step (~100 bytes
        each: ~30 MB at 4,096 ranks of 50 objects, ~160 MB of 300), and every rank reading it
        whole read W times that from one object. Each other rank reads only the COMMIT's
        head from its own storage, for the nonce: a rank whose storage holds another save of
        the step (node-local storage at one path) refuses before it reads any data of it."""
        if self._ranks.alone:
            return StepReader(storage, step)
        if self._ranks.rank == 0:
            try:
                documents = read_documents(storage, step)
            except Exception as exc:  # every rank fails with it
                self._ranks.broadcast((type(exc).__name__, str(exc), getattr(exc, "key", None)))
                raise
            self._ranks.broadcast(documents)
            return StepReader(storage, step, *documents)
        got = self._ranks.broadcast(None)
        if isinstance(got[0], str):  # rank 0's error, as rank 0 raised it
            name, message, key = got
            if name == CheckpointCorruptError.__name__:
                raise CheckpointCorruptError(message, key=key)
            raise ERRORS.get(name, CheckpointError)(message)
        try:
            head = _commit.marker_head(storage, step)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {storage.url} as rank "
                f"{self._ranks.rank} sees it (rank 0 read its COMMIT: node-local storage at "
                "one path?)") from None
        reader = StepReader(storage, step, *got)
        if head is not None and head[0] != reader.commit["nonce"]:  # before reading its data
            raise _different_saves(step)
        return reader


def _different_saves(step: int) -> CheckpointError:
    return CheckpointError(f"step {step}: the ranks see different saves of it (node-local "
                           "storage at one path, or two jobs writing one URL?); refusing to mix "
                           "them")
