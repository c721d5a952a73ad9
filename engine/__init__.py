"""antifragile's checkpoint engine: sharded, asynchronous, two-phase-committed, on zarr v3.

    from antifragile import CheckpointEngine
    ckpt = CheckpointEngine("s3://bucket/run1", keep_last=3)
    handle = ckpt.save(step, {"model": model, "optim": optimizer, "train": train_state})
    ...
    ckpt.load(state)  # newest intact step, any layout; restores into the same objects

What a load restores, exactly (objects, emptier targets, bytes, per-rank tensors, more ranks
than saved): ``_state`` (semantics), ``_objects``, ``_ranks`` and ``_restore``.
"""

from ._handle import SaveHandle
from .engine import CheckpointEngine
from .errors import (
                           CheckpointBusyError,
                           CheckpointCorruptError,
                           CheckpointError,
                           CheckpointFormatError,
                           CheckpointMismatchError,
                           CheckpointNotFoundError,
                           CommitTimeoutError,
                           StepSkippedWarning,
                           StorageError,
)
from .plan import PlanOptions
from .verify import Problem, VerifyReport

__all__ = [
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointEngine",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CommitTimeoutError",
    "PlanOptions",
    "Problem",
    "SaveHandle",
    "StepSkippedWarning",
    "StorageError",
    "VerifyReport",
]
