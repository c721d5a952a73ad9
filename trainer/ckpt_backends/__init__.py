"""The checkpoint engine under test, chosen by ``--ckpt-engine`` (``checkpoint.engine``).

``antifragile`` is our engine; ``dcp`` (torch.distributed.checkpoint) and ``torchsnapshot`` are
the peers it is measured against. Every backend is driven the same way by
``trainer.checkpoint.TrainCheckpointer``, so the trainer's events (stall, persist, bytes,
restore, skipped steps) mean the same thing for all three. Each module also offers, for tools
outside the training job (the chaos checker, ``corrupt_shard``), ``steps(url)``,
``read(url, step)`` (flat ``{key: tensor | value}``, no process group) and, for the peers,
``data_files(url, step)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from antifragile.trainer.ckpt_backends.base import MARKERS, Backend, PendingSave, committed

ENGINES = ("antifragile", "dcp", "torchsnapshot")


def _module(engine: str) -> ModuleType:
    """Imported on demand: torchsnapshot is needed only when it is the engine under test."""
    if engine == "antifragile":
        from antifragile.trainer.ckpt_backends import antifragile as module
    elif engine == "dcp":
        from antifragile.trainer.ckpt_backends import dcp as module
    elif engine == "torchsnapshot":
        from antifragile.trainer.ckpt_backends import snapshot as module
    else:
        raise ValueError(f"unknown checkpoint engine {engine!r} (known: {', '.join(ENGINES)})")
    return module


def open_backend(engine: str, url: str, *, keep_last: int, timeout_s: float,
                 async_: bool, keep_in_memory: bool = False,
                 on_phase: Callable[[int, str], None] | None = None) -> Backend:
    """Collective for the peers (they create a checkpoint process group). ``keep_in_memory``
    and ``on_phase`` (save phase hooks) are our engine's; the peers have neither."""
    module = _module(engine)
    if engine == "antifragile":
        return module.AntifragileBackend(url, keep_last=keep_last, timeout_s=timeout_s,
                                         async_=async_, keep_in_memory=keep_in_memory,
                                         on_phase=on_phase)
    cls = {"dcp": "DcpBackend", "torchsnapshot": "SnapshotBackend"}[engine]
    backend: Backend = getattr(module, cls)(url, keep_last=keep_last, timeout_s=timeout_s,
                                            async_=async_)
    return backend


def foreign_steps(engine: str, url: str) -> dict[str, list[int]]:
    """The committed steps of the engines other than ``engine`` under a local ``url`` (the
    peers run on local storage only: none under a remote one). All engines name their step
    folders alike: a run started with another engine than the one that saved would see none
    of them, train from step 0 and remove them with its own saves and retention."""
    if "://" in url and not url.startswith("file://"):
        return {}
    root = Path(url.removeprefix("file://"))
    found = {other: committed(root, marker) for other, marker in MARKERS.items()
             if other != engine}
    return {other: steps for other, steps in found.items() if steps}


def committed_steps(engine: str, url: str) -> list[int]:
    return list(_module(engine).steps(url))


def read_checkpoint(engine: str, url: str, step: int) -> dict[str, Any]:
    return dict(_module(engine).read(url, step))


def data_files(engine: str, url: str, step: int) -> list[Path]:
    """A peer engine's data files of a committed step (ours is addressed by chunk objects)."""
    if engine == "antifragile":
        raise ValueError("the antifragile engine's objects are listed in its commit manifest")
    return list(_module(engine).data_files(url, step))


__all__ = ["ENGINES", "Backend", "PendingSave", "committed_steps", "data_files",
           "foreign_steps", "open_backend", "read_checkpoint"]
