"""antifragile: make large-model training survive failure, and prove it.

One import namespace for the three parts of the distribution:

- ``antifragile.engine``: the sharded, asynchronous checkpoint engine (zarr v3, two-phase commit)
- ``antifragile.trainer``: the 3D-parallel GPT trainer (``torchrun -m antifragile.trainer``)
- ``antifragile.chaos``: the chaos testbed and the ``chaos`` command line

The engine's public names are re-exported here and imported on first use, so that importing
``antifragile`` (as the ``chaos`` command does before it parses its arguments) does not import
torch::

    from antifragile import CheckpointEngine, CheckpointError
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from antifragile.engine import (
        CheckpointBusyError,
        CheckpointCommittedError,
        CheckpointCorruptError,
        CheckpointEngine,
        CheckpointError,
        CheckpointFormatError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CommitTimeoutError,
        ObjectExistsError,
        PlanOptions,
        Problem,
        SaveHandle,
        StepSkippedWarning,
        StorageAccessError,
        StorageError,
        StorageUnansweredError,
        VerifyReport,
    )

__version__ = "0.2.0"

__all__ = [
    "CheckpointBusyError", "CheckpointCommittedError", "CheckpointCorruptError",
    "CheckpointEngine", "CheckpointError", "CheckpointFormatError", "CheckpointMismatchError",
    "CheckpointNotFoundError", "CommitTimeoutError", "ObjectExistsError", "PlanOptions",
    "Problem", "SaveHandle", "StepSkippedWarning", "StorageAccessError", "StorageError",
    "StorageUnansweredError", "VerifyReport",
]
_ENGINE_EXPORTS = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _ENGINE_EXPORTS:
        value = getattr(importlib.import_module("antifragile.engine"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'antifragile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENGINE_EXPORTS})
