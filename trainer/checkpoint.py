"""The trainer's side of checkpointing: what goes into a checkpoint, and events about it.

A checkpoint holds ``model/<fqn>`` and ``optim/state.<fqn>.<exp_avg|...>`` (FQN-keyed through
torch's distributed state-dict helpers, so every pipeline stage and layout names a parameter
the same way) plus ``train``: the step and the data cursor.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from engine import CheckpointEngine, CheckpointError, SaveHandle
from trainer.events import EventLog

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainCheckpointer:
    def __init__(self, engine: CheckpointEngine, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, events: EventLog) -> None:
        self.engine = engine
        self.model = model
        self.optimizer = optimizer
        self.events = events
        self._pending: SaveHandle | None = None

    def _state(self, step: int, cursor: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {"model": model_sd, "optim": optim_sd,
                "train": {"step": step, "data_cursor": cursor}}

    def restore(self) -> tuple[int, int] | None:
        """Load the newest intact checkpoint: (step, data cursor), or None to start fresh."""
        if self.engine.latest_step() is None:
            return None
        self.events.emit("restore_begin")
        t0 = time.perf_counter()
        state = self._state(0, 0)
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always", RuntimeWarning)
            step = self.engine.load(state)
        for warning in skipped:
            self.events.emit("restore_skipped", reason=str(warning.message))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_OPTIONS)
        self.events.emit("restore_end", step=step, seconds=time.perf_counter() - t0)
        return int(state["train"]["step"]), int(state["train"]["data_cursor"])

    def save(self, step: int, cursor: int, *, blocking: bool) -> None:
        """Checkpoint; ``blocking`` (the final step) first waits for the save in flight."""
        if blocking:
            self.finish()
        self.poll()
        try:
            handle = self.engine.save(step, self._state(step, cursor), blocking=False)
        except CheckpointError as exc:
            self.events.emit("ckpt_failed", step=step, error=str(exc))
            return
        if handle.done() and handle.exception() is not None:  # skipped: previous one busy
            self.events.emit("ckpt_failed", step=step, error=str(handle.exception()))
            return
        self.events.emit("ckpt_staged", step=step, stall_s=handle.stall_s)
        self._pending = handle
        if blocking:
            self.finish()

    def poll(self) -> None:
        """Report a finished background save (committed or failed) once."""
        handle = self._pending
        if handle is None or not handle.done():
            return
        self._pending = None
        error = handle.exception()
        if error is None:
            self.events.emit("ckpt_committed", step=handle.step, bytes=handle.committed_nbytes
                             or handle.nbytes, rank_bytes=handle.nbytes,
                             persist_s=handle.persist_s)
        else:
            self.events.emit("ckpt_failed", step=handle.step, error=str(error))

    def finish(self) -> None:
        """Wait for the save in flight and report it."""
        if self._pending is not None:
            with contextlib.suppress(CheckpointError):
                self._pending.wait()
            self.poll()
