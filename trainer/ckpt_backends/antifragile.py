"""``checkpoint.engine: antifragile``: our own engine, exactly as the trainer always used it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from antifragile.engine import CheckpointEngine, SaveHandle, StepSkippedWarning
from antifragile.engine._memory import MemoryCopy
from antifragile.engine.commit import committed_steps
from antifragile.engine.storage import open_storage


class AntifragileBackend:
    name = "antifragile"
    overlaps_saves = True  # the engine refuses (fails) a save while the previous one persists
    saves_wait_on_default_store = False  # its collectives run on a gloo group of its own

    def __init__(self, url: str, *, keep_last: int, timeout_s: float, async_: bool,
                 keep_in_memory: bool = False,
                 on_phase: Callable[[int, str], None] | None = None) -> None:
        # the trainer reports checkpoint events itself (trainer.checkpoint): none from the engine
        self.engine = CheckpointEngine(url, keep_last=keep_last, commit_timeout_s=timeout_s,
                                       keep_in_memory=keep_in_memory, on_phase=on_phase,
                                       chaos_events=False)

    def candidates(self) -> list[int]:
        return self.engine.agreed_steps()[:1]

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle:
        return self.engine.save(step, state, blocking=False)

    def load(self, state: dict[str, Any], memory: MemoryCopy | None = None
             ) -> tuple[int, list[str]]:
        """The engine falls back past damaged steps itself and says so in warnings
        (``StepSkippedWarning``); its other warnings (a copy of per-rank values loaded from
        another rank: no step skipped) are passed on as they came."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StepSkippedWarning)
            step = self.engine.load(state, memory=memory)
        for w in caught:
            if not issubclass(w.category, StepSkippedWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return step, [str(w.message) for w in caught if issubclass(w.category, StepSkippedWarning)]

    def load_sources(self) -> dict[str, int]:
        return dict(self.engine.last_load_sources)

    def memory_copy(self) -> MemoryCopy | None:
        return self.engine.memory_copy()

    def abandon(self) -> None:
        self.engine.abandon()

    def close(self) -> None:
        self.engine.close()


def steps(url: str) -> list[int]:
    return committed_steps(open_storage(url))


def read(url: str, step: int) -> dict[str, Any]:
    with CheckpointEngine(url) as ckpt:
        return ckpt.read(step)

