"""The trainer's side of checkpointing: what goes into a checkpoint, and events about it.

A checkpoint holds ``model/<fqn>`` and ``optim/state.<fqn>.<exp_avg|...>`` (FQN-keyed through
torch's distributed state-dict helpers, so every pipeline stage and layout names a parameter
the same way) plus ``train``: the step, the data cursor, the seed (the data stream is a
function of it, so a resume with another one is refused) and the model's settings
(``--layers``, ``--heads`` ...: fewer layers load a subset of the tensors, other heads the same
tensors into another function; a resume with others is refused too) and where the data comes
from (synthetic, or a ``--data-path`` file: a restart that lost or gained the flag is refused;
one whose ids changed is refused too; the file may move). The engine is a
``trainer.ckpt_backends`` backend (ours, DCP or torchsnapshot); the events are the same for all.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from antifragile.engine import CheckpointError, StorageError
from antifragile.trainer.ckpt_backends import Backend, PendingSave
from antifragile.trainer.config import FINAL_SAVE_PATIENCE_S
from antifragile.trainer.events import EventLog

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

FINAL_SAVE_MAX_DELAY_S = 15.0  # the longest backoff between the last step's retries
# what ``train`` holds, one more with each change (2: the model's settings and the data; 3: a
# token file's digest in the data): part of the chaos reference's cache key, since an older
# reference ends in another one
TRAIN_STATE_VERSION = 3
_INTERRUPT_POLL_S = 0.005  # how often a wait for a save looks whether its generation failed
_DATA = {"synthetic": "synthetic data", "file": "a --data-path token file"}  # train["data"]


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     train: dict[str, Any]) -> dict[str, Any]:
    """What the trainer checkpoints: the model's and the optimizer's state dicts as torch's
    distributed helpers give them (``_OPTIONS``), and the ``train`` record."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd, "train": train}


def _any_rank(device: torch.device, *flags: bool) -> list[bool]:
    """Each flag OR-ed over the ranks of the job (as is, in a single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.cpu()]


def _data_differs(saved: object, data: str | None) -> str | None:
    """What the checkpoint was trained on, against this run's data, where they differ: None
    when they agree or cannot be compared. Each is "synthetic" or "file:<digest of its ids>"
    ("file" alone before digests were stored: its content not checked; None: not recorded,
    not checked)."""
    if saved is None or data is None:
        return None
    saved_kind, _, saved_digest = str(saved).partition(":")
    kind, _, digest = data.partition(":")
    if saved_kind != kind:
        return f"{_DATA.get(saved_kind, saved_kind)}, this run on {_DATA[kind]}"
    if saved_digest and digest and saved_digest != digest:
        return (f"a --data-path token file of other content ({saved_digest}; this run's file: "
                f"{digest})")
    return None


class SaveInterrupted(Exception):
    """A wait for a save in flight ended by the failure of its generation (in-process
    recovery): the save cannot commit, and a peer engine's wait for it may not end on its own
    (torchsnapshot's commit barrier waits in the store, which the abort does not cut)."""


class ResumeError(Exception):
    """The run has checkpoints and none of them loads (every one damaged or quarantined, or
    none fits this state), or the newest was trained with another seed: starting over would
    lose them, and a restart meets the same."""


class TrainCheckpointer:
    def __init__(self, backend: Backend, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, events: EventLog, *, seed: int = 0,
                 shape: dict[str, int] | None = None, data: str | None = None,
                 foreign: Callable[[], dict[str, list[int]]] | None = None,
                 interrupted: Callable[[], bool] | None = None) -> None:
        self.backend = backend
        # whether the generation failed (in-process recovery): ends a wait for a save
        self.interrupted = interrupted
        # where there is nothing to restore: the other engines' committed steps at the URL
        self.foreign = foreign
        self.seed = seed
        self.data = data  # "synthetic" or "file" (None: not recorded)
        self.shape = dict(shape or {})  # the model's settings by option name: {"layers": 4}
        self.model = model
        self.optimizer = optimizer
        self.events = events
        self._pending: PendingSave | None = None  # the save in flight, until a poll saw it end
        # the save whose outcome is not reported yet: its own thread reports it as it ends
        # (chaos waits for a staged save to settle, and measures when it committed), or the
        # loop's poll does first (a wait() may return before that thread reports)
        self._unreported: PendingSave | None = None
        self._lock = threading.Lock()  # the two reporters, and ``_retaining``
        self.committed_step: int | None = None  # the newest save known to have committed
        # committed saves whose retention still runs (our engine's coordinator): a retention
        # failure is reported once it is known
        self._retaining: list[Any] = []

    def _state(self, step: int, cursor: int) -> dict[str, Any]:
        return checkpoint_state(self.model, self.optimizer, self._train(step, cursor))

    def _train(self, step: int, cursor: int) -> dict[str, Any]:
        return {"step": step, "data_cursor": cursor, "seed": self.seed,
                **({"model": dict(self.shape)} if self.shape else {}),
                **({"data": self.data} if self.data is not None else {})}

    def restore(self, memory: Any = None) -> tuple[int, int] | None:
        """Load the newest intact checkpoint: (step, data cursor), or None to start fresh.
        ``memory``: the previous generation's copy of this rank's last committed save (an
        in-process recovery); the engine fills what it can from it instead of storage.
        ResumeError where there are checkpoints and none loads; storage failing raises its
        StorageError (a restart may find it back)."""
        try:
            if not self.backend.candidates():
                found = self.foreign() if self.foreign is not None else {}
                device = next(self.model.parameters()).device
                if _any_rank(device, bool(found))[0]:  # every rank refuses, or none
                    saved = "; ".join(f"checkpoints of --ckpt-engine {engine} (steps {steps})"
                                      for engine, steps in found.items())
                    raise ResumeError(f"no checkpoint of --ckpt-engine {self.backend.name} "
                                      f"but {saved or 'those of another engine'}: "
                                      "starting over would remove them (resume with that "
                                      "engine, or start a run with a fresh --ckpt-url)")
                return None
            self.events.emit("restore_begin")
            t0 = time.perf_counter()
            state = self._state(0, 0)
            t1 = time.perf_counter()
            try:
                step, skipped = self.backend.load(state, memory)
            except CheckpointError:
                self._refuse_another_run_if_it_is(*self._saved_train())
                raise
            t2 = time.perf_counter()
        except StorageError:
            raise
        except CheckpointError as exc:
            raise ResumeError(str(exc)) from exc
        for reason in skipped:
            self.events.emit("restore_skipped", reason=reason)
        self._refuse_another_run_if_it_is(step, state["train"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_OPTIONS)
        t3 = time.perf_counter()
        self.events.emit("restore_end", step=step, seconds=t3 - t0, state_dict_s=t1 - t0,
                         load_s=t2 - t1, set_state_dict_s=t3 - t2,
                         **self.backend.load_sources())
        return int(state["train"]["step"]), int(state["train"]["data_cursor"])

    def _saved_train(self) -> tuple[int, dict[str, Any] | None]:
        """The newest loadable step's ``train`` entry alone (its step and settings), where the
        whole state does not load: a model setting that changes a tensor's shape (--d-model,
        --vocab, --seq-len) or adds one (more --layers) fails the load itself, and the
        refusal should name the option rather than a tensor. (-1, None) where not even that
        loads (damaged); a collective, as the load that failed was on every rank."""
        probe = {"train": self._train(0, 0)}
        try:
            step, _ = self.backend.load(probe)
        except (CheckpointError, StorageError):
            return -1, None
        return step, probe["train"]

    def _refuse_another_run_if_it_is(self, step: int, train: dict[str, Any] | None) -> None:
        """ResumeError naming what differs where step ``step``'s ``train`` entry was saved by
        a run of another seed, model or data (None: nothing known, nothing refused)."""
        if train is None:
            return
        # our engine loads ``train`` whole: a checkpoint saved before seeds were stored
        # comes back without one (its seed is not known, so not checked)
        saved_seed = train.get("seed", self.seed)
        if int(saved_seed) != self.seed:
            raise ResumeError(f"step {step} was trained with --seed {saved_seed}, "
                              f"this run has --seed {self.seed}: its batches would differ from "
                              "the checkpoint's run (resume with that seed, or start a run "
                              "with a fresh --ckpt-url)")
        # saved before the model's settings were stored: not known, so not checked
        saved_shape = train.get("model") or {}
        for name, value in self.shape.items():
            if name in saved_shape and int(saved_shape[name]) != value:
                option = "--" + name.replace("_", "-")
                raise ResumeError(f"step {step} was trained with {option} {saved_shape[name]}, "
                                  f"this run has {option} {value}: the checkpoint is of another "
                                  "model (resume with that setting, or start a run with a "
                                  "fresh --ckpt-url)")
        differs = _data_differs(train.get("data"), self.data)
        if differs is not None:
            raise ResumeError(f"step {step} was trained on {differs}: its batches would differ "
                              "from the checkpoint's run (resume with the same data, or start "
                              "a run with a fresh --ckpt-url)")

    def save(self, step: int, cursor: int, *, blocking: bool) -> bool:
        """Checkpoint; ``blocking`` (the final step) first waits for the save in flight.
        True once staged; False when the save was refused (busy, or failed before staging).

        ``stall_s`` is what the loop waited: the state dicts and the whole backend call (our
        engine's includes its collectives, which wait for the slowest rank, beside its staging
        copy). A backend that cannot overlap two saves (DCP, torchsnapshot) first waits for the
        previous one; that wait is loop stall too."""
        waited_s = 0.0
        if blocking or not self.backend.overlaps_saves:
            t0 = time.perf_counter()
            self.finish()
            waited_s = 0.0 if self.backend.overlaps_saves else time.perf_counter() - t0
        self.poll()
        called = time.perf_counter()
        try:
            handle = self.backend.save(step, self._state(step, cursor))
        except CheckpointError as exc:
            self.events.emit("ckpt_failed", step=step, error=str(exc))
            return False
        if handle.done() and handle.exception() is not None:  # skipped: previous one busy
            self.events.emit("ckpt_failed", step=step, error=str(handle.exception()))
            return False
        stall_s = time.perf_counter() - called + waited_s
        # accepted: the previous save was done when the engine looked, maybe only since the
        # poll above (it can commit while the state dicts are taken): report it before its
        # handle is replaced
        self.poll()
        self.events.emit("ckpt_staged", step=step, stall_s=stall_s)
        self._pending = self._unreported = handle
        handle.add_done_callback(lambda: self._report(handle))  # after ckpt_staged, always
        if blocking:  # the loop also waits for the write: that is stall too
            t0 = time.perf_counter()
            self.finish()
            self.events.emit("ckpt_blocked", step=step, seconds=time.perf_counter() - t0)
        return True

    def save_final(self, step: int, cursor: int, *,
                   patience_s: float = FINAL_SAVE_PATIENCE_S) -> bool:
        """The last step's checkpoint: blocking, and retried while it fails (storage down or
        refusing, an outage) for up to ``patience_s``, backing off 1, 2, 4 ... 15 s. A periodic
        save that fails is superseded by the next one; nothing supersedes the last, and without
        it the run's tail since the previous checkpoint is lost. The ranks retry or stop
        together (a save is collective): they agree on each outcome. True once committed.
        (A COMMIT that storage applied but whose answer was lost fails the save on rank 0;
        the retry finds the step committed with exactly this state and succeeds without
        writing: the engine's ``_resave.same_as_committed``.)"""
        deadline = time.monotonic() + patience_s
        delay = 1.0
        device = next(self.model.parameters()).device
        while True:
            self.save(step, cursor, blocking=True)
            failed, out_of_time = _any_rank(device, self.committed_step != step,
                                            time.monotonic() + delay > deadline)
            if not failed:
                return True
            if out_of_time:
                return False
            self.events.emit("ckpt_retry", step=step, in_s=delay)
            time.sleep(delay)
            delay = min(2 * delay, FINAL_SAVE_MAX_DELAY_S)

    def poll(self) -> None:
        """Report a finished background save (committed or failed), unless its thread already
        did, and a failed retention once."""
        handle = self._pending
        if handle is not None and handle.done():
            self._pending = None
            self._report(handle)
        with self._lock:
            retained = [h for h in self._retaining if h.retention_done()]
            for done in retained:
                self._retaining.remove(done)
        for done in retained:
            if done.retention_error:  # committed all the same; retried at the next save
                self.events.emit("ckpt_retention_failed", step=done.step,
                                 error=done.retention_error)

    def _report(self, handle: PendingSave) -> None:
        """Report the outcome of ``handle``, done, once: whichever of its thread and the
        loop's poll comes first."""
        with self._lock:
            # by the other reporter, or abandoned (a name of its own: mypy, comparing
            # ``handle`` with an Optional inline, would narrow it to None below)
            reported = self._unreported is not handle
            if reported:
                return
            error = handle.exception()
            # failed once its generation did (in-process recovery): the abort shuts the
            # connections a peer's save runs its collectives on before abandon() is reached;
            # that failure is the abort's, left unreported as an abandoned save's
            if error is not None and self.interrupted is not None and self.interrupted():
                return
            self._unreported = None
            if error is None:
                self.committed_step = handle.step
                self.events.emit("ckpt_committed", step=handle.step,
                                 bytes=handle.committed_nbytes or handle.nbytes,
                                 rank_bytes=handle.nbytes, persist_s=handle.persist_s)
                if hasattr(handle, "retention_error"):
                    self._retaining.append(handle)
            else:
                self.events.emit("ckpt_failed", step=handle.step, error=str(error))

    def finish(self) -> None:
        """Wait for the save in flight (and the retentions that follow commits) and report.
        SaveInterrupted once ``interrupted()`` says the generation failed meanwhile."""
        with self._lock:
            waited = [*self._retaining, self._pending]
        for handle in waited:
            if handle is not None:
                while self.interrupted is not None and not handle.done():
                    if self.interrupted():
                        raise SaveInterrupted(f"step {handle.step}: the generation failed "
                                              "while this rank waited for its save")
                    time.sleep(_INTERRUPT_POLL_S)
                with contextlib.suppress(CheckpointError):
                    handle.wait()
        self.poll()

    def abandon(self) -> None:
        """Give up the save in flight with its failed generation (in-process recovery),
        unreported as before: the abort fails it on this rank, which is no outcome of the
        save (the report takes a staged step that a later generation restored for committed,
        unless it failed)."""
        with self._lock:
            self._unreported = None
        self.backend.abandon()

    def close(self) -> None:
        self.finish()
        self.backend.close()
