"""How the ranks agree: the engine's few collectives and the verdicts they carry.

Every ``save``/``load`` decision that could differ between ranks (a caller's mistake found on
one rank, a step one rank could not read, the step to load) is reduced across ranks first, so
that all ranks act alike: a rank that raised alone would leave the others waiting in the next
collective, or pair them with its next training collective. The collectives run on a gloo
group (the caller's own when it is gloo, else one made for the engine over the same ranks),
always on the training thread.
"""

from __future__ import annotations

import contextlib
import logging
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import (
    CheckpointBusyError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CommitTimeoutError,
    StorageAccessError,
    StorageError,
    StorageUnansweredError,
)

log = logging.getLogger("antifragile.engine")

# load outcomes, ordered so that an all-reduce MAX gives the worst one across ranks:
# mismatch (the target wants what the step lacks) and unreadable (storage would not hand it
# over) skip the step; corrupt skips and quarantines it; fatal raises at once
OK, MISMATCH, UNREADABLE, CORRUPT, FATAL = 0, 1, 2, 3, 4
# every class a rank may report: an agreed error keeps its class on every rank
ERRORS: dict[str, type[CheckpointError]] = {cls.__name__: cls for cls in (
    CheckpointError, CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError,
    CheckpointFormatError, CommitTimeoutError, CheckpointBusyError, StorageError,
    StorageAccessError, StorageUnansweredError)}

# one rank's report of a failed load: (outcome, error class name, message, damaged key)
Report = tuple[int, str, str, "str | None"]


def _timeout(pg: Any) -> timedelta | None:
    """The timeout ``pg`` was made with (None: torch does not show it, its default then):
    the engine's own gloo group waits as long as the caller's group would, not torch's 30
    minutes."""
    for device in ("cuda", "cpu"):
        with contextlib.suppress(Exception):  # no backend for that device, or no options
            return pg._get_backend(torch.device(device)).options._timeout
    return None


def _side_group(pg: Any) -> Any:
    """A gloo group over the ranks of ``pg`` (a group of another backend). Made by its members
    alone when ``pg`` is part of the job: the processes outside it open no engine on it. Made
    by every process when it is the whole job, as ``new_group`` asks: a group its members
    make alone is named by how many groups each holds, which differs where some ranks are in
    groups that others are not (a pipeline's first and last stages, for tied embeddings)."""
    members = dist.get_process_group_ranks(pg)
    return dist.new_group(members, backend="gloo", timeout=_timeout(pg),
                          use_local_synchronization=len(members) < dist.get_world_size())


class Ranks:
    """The ranks of ``process_group`` (None: the default group if one is initialized, else
    this process alone), with the two collectives the engine uses."""

    def __init__(self, process_group: Any = None) -> None:
        pg = process_group
        if pg is None and dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        self.rank = dist.get_rank(pg) if pg is not None else 0
        if self.rank < 0:  # torch's rank for a process outside the group
            raise CheckpointError(f"this process (global rank {dist.get_rank()}) is not a "
                                  "member of process_group; pass a group that holds it")
        self.world_size = dist.get_world_size(pg) if pg is not None else 1
        self._gloo: Any = None
        if pg is not None and self.world_size > 1:
            self._gloo = pg if "gloo" in str(dist.get_backend(pg)) else _side_group(pg)

    @property
    def alone(self) -> bool:
        return self._gloo is None

    def all_max(self, values: list[int]) -> list[int]:
        if self._gloo is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._gloo)
        return [int(x) for x in t]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if self._gloo is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._gloo, group_src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if self._gloo is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._gloo)
        return out

    def agreed_error(self, reports: list[Report], worst: int) -> CheckpointError:
        """The same error on every rank: the first rank whose outcome is the worst one, its
        error class and message, and which ranks reported that outcome."""
        culprits = [r for r, (o, _, _, _) in enumerate(reports) if o == worst]
        _, name, message, _ = reports[culprits[0]]
        if self.world_size > 1:
            who = ", ".join(map(str, culprits))
            plural = "s" if len(culprits) > 1 else ""
            message = f"{message} (rank{plural} {who} of {self.world_size})"
        return ERRORS.get(name, CheckpointError)(message)


def classify(step: int, exc: Exception) -> tuple[int, CheckpointError]:
    """The outcome of a failed load of ``step`` and the CheckpointError to report for it."""
    if isinstance(exc, CheckpointMismatchError):
        return MISMATCH, exc
    if isinstance(exc, CheckpointCorruptError):
        return CORRUPT, exc
    if isinstance(exc, (StorageError, CheckpointNotFoundError)):
        # named already: "step 12", not "step 123" for step 12
        named = exc if re.search(rf"\bstep {step}\b", str(exc)) else type(exc)(
            f"step {step}: {exc}")
        return UNREADABLE, named
    if isinstance(exc, CheckpointError):
        return FATAL, exc
    log.error("loading step %d failed unexpectedly", step, exc_info=exc)
    return UNREADABLE, CheckpointError(f"step {step}: {type(exc).__name__}: {exc}")


def refuse_together(outcome: str, call: str, mistake: CheckpointError | None,
                    any_mistake: int, high: int, negated_low: int) -> None:
    """Raise on every rank when any rank's call was refused by its own checks, or when the
    ranks passed different steps (all-reduced MAX of ``step`` and ``-step``; None and a
    refused step are -1): every rank sees the same reduced values, so all raise or none."""
    if any_mistake:
        raise mistake or CheckpointError(
            f"{outcome}: another rank's call of {call}() was refused (its error names the step "
            "or state path)")
    if high != -negated_low:
        newest = "; None is -1" if call == "load" else ""  # load's step=None: save has none
        raise CheckpointError(f"{outcome}: the ranks called {call}() with different steps "
                              f"({-negated_low} to {high}{newest})")


def refusal(outcome: str, exc: Exception) -> CheckpointError:
    """``exc`` as the CheckpointError that every rank raises (see ``refuse_together``): a
    CheckpointError as it is, any other error of the caller's state (a ``state_dict()`` or
    ``load_state_dict()`` that raised) named and chained."""
    if isinstance(exc, CheckpointError):
        return exc
    error = CheckpointError(f"{outcome}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
