"""Errors raised by the checkpoint engine.

Every failure the engine reports is a :class:`CheckpointError`; messages name the step, the array
and the rank involved so that an operator can act on a log line alone.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error the engine raises."""


class StepSkippedWarning(RuntimeWarning):
    """A load passed over a step that does not load for an older one; the message names both
    steps and the reason (``checkpoint step N skipped, trying step M: ...``). Its own class, so
    that a caller can tell a skipped step from the engine's other warnings."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists (at all, or at the requested step)."""


class CheckpointCorruptError(CheckpointError):
    """Stored data fails its checksum, is truncated, missing, or its metadata is invalid.

    ``key``: the object found damaged (relative to the step folder), when one object is to
    blame, so that another reader can confirm the damage before anything acts on it.
    """

    def __init__(self, *args: object, key: str | None = None) -> None:
        super().__init__(*args)
        self.key = key


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not cover the target state (missing array, other shape or dtype)."""


class CheckpointCommittedError(CheckpointError):
    """A save of a step that is already committed with other content, or that another save
    committed while this one ran: the committed step is left as it is (never overwritten)."""


class CommitTimeoutError(CheckpointError):
    """A save did not commit before its deadline; the message names the missing ranks."""


class CheckpointBusyError(CheckpointError):
    """A save was refused because the previous one is still persisting."""


class CheckpointFormatError(CheckpointError):
    """A step written in a checkpoint format this engine does not read (an older one, or a
    newer engine's): intact, as far as anyone here can tell, and not damage."""


class ObjectExistsError(CheckpointError):
    """``Storage.create`` found its key taken: the object there (another writer's) is left as
    it is. What a second COMMIT of one step meets."""


class StorageError(CheckpointError):
    """Storage failed permanently, or transiently beyond the retry budget."""


class StorageUnansweredError(StorageError):
    """Storage did not answer a request through all its tries (each timed out: an endpoint
    that accepts connections and never replies, a network path that drops them). A failed
    save's best-effort writes after it get one try each, not the whole retry budget."""


class StorageAccessError(StorageError):
    """Storage refused this configuration: a bucket that does not exist, credentials the
    endpoint refuses (a 403), a folder without permission. No retry or restart changes it;
    the URL or the credentials must."""
