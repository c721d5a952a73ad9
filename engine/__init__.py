"""antifragile's checkpoint engine: sharded, asynchronous, two-phase-committed, on zarr v3.

    from antifragile import CheckpointEngine
    ckpt = CheckpointEngine("s3://bucket/run1", keep_last=3)
    handle = ckpt.save(step, {"model": model, "optim": optimizer, "train": train_state})
    ...
    ckpt.load(state)  # newest intact step, any layout; restores into the same objects

What a load restores, exactly (objects, emptier targets, bytes, per-rank tensors, more ranks
than saved): ``_state`` (semantics), ``_objects``, ``_ranks`` and ``_restore``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._handle import SaveHandle
    from .engine import CheckpointEngine
    from .errors import (
        CheckpointBusyError,
        CheckpointCommittedError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointFormatError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CommitTimeoutError,
        ObjectExistsError,
        StepSkippedWarning,
        StorageAccessError,
        StorageError,
        StorageUnansweredError,
    )
    from .plan import PlanOptions
    from .verify import Problem, VerifyReport

__all__ = [
    "CheckpointBusyError",
    "CheckpointCommittedError",
    "CheckpointCorruptError",
    "CheckpointEngine",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CommitTimeoutError",
    "ObjectExistsError",
    "PlanOptions",
    "Problem",
    "SaveHandle",
    "StepSkippedWarning",
    "StorageAccessError",
    "StorageError",
    "StorageUnansweredError",
    "VerifyReport",
]

# Imported on first use (PEP 562), so that a module of the package that needs no torch (the
# chaos event channel ``_events``, which ``antifragile.probe`` writes through in a user's
# script) does not import the whole engine with this ``__init__``.
_HOMES = {"SaveHandle": "_handle", "CheckpointEngine": "engine", "PlanOptions": "plan",
          "Problem": "verify", "VerifyReport": "verify"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES.get(name, 'errors')}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
