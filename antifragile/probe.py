"""What a training script tells ``chaos run``, and nothing at all otherwise.

::

    from antifragile import probe

    step = ckpt.load(state) if ckpt.agreed_steps() else 0  # the engine reports it
    for step in range(step + 1, steps + 1):
        loss = train_step()
        probe.step_end(step, loss)          # step times, losses, lost steps; pause points
        ...

Under chaos (``chaos run`` sets ``ANTIFRAGILE_RUN_DIR``) each call appends a JSON line to
``<run_dir>/events/rank<RANK>.jsonl``; the first line a process writes is ``start`` (pid,
world size, torchrun's restart count as ``attempt``). ``step_end`` also holds the rank where
the scenario's plan says (``trainer.pause``: how ``at_step`` faults land exactly), until chaos
releases it. :class:`antifragile.engine.CheckpointEngine` reports its saves and restores by
itself; a script checkpointing with ``torch.distributed.checkpoint`` uses :func:`dcp_save` and
:func:`dcp_load` instead of ``dcp.save`` / ``dcp.load``.

Not under chaos every function returns at once (the DCP helpers just save or load): no file
is opened, no thread started, nothing imported, and after the first call not even the
environment is read; importing this module imports no torch.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from antifragile.engine._events import Channel
    from antifragile.trainer.pause import PausePoints

__all__ = ["dcp_load", "dcp_save", "restored", "step_end"]

RUN_DIR_ENV = "ANTIFRAGILE_RUN_DIR"


class _Probe:
    def __init__(self, channel: Channel, pauses: PausePoints) -> None:
        self.channel = channel
        self.pauses = pauses
        #: when the restore that ``dcp_load`` began and has not ended began: a script tries
        #: its steps newest first, and the tries are one restore, as the engine's
        self.restore_t: float | None = None


_probe: _Probe | None = None
#: not under chaos, as the first call found: chaos sets ``ANTIFRAGILE_RUN_DIR`` before the
#: process starts, so later calls need not look it up again (an environment lookup of a
#: missing variable encodes the name and raises a KeyError: work on every step for nothing)
_off = False


def _forked() -> None:
    """A child forked from the rank once it reported reports nothing (its reports went in as
    the rank's); forked before that, the child may be the one that reports."""
    global _probe, _off
    if _probe is not None:
        _probe, _off = None, True


os.register_at_fork(after_in_child=_forked)


def _active() -> _Probe | None:
    """The probe under chaos, built on first use; None (and nothing done) otherwise. Every
    probe call comes from the script's training loop: its thread is the loop's."""
    global _probe, _off
    if _probe is not None:
        return _loop(_probe)
    if _off:
        return None
    if not os.environ.get(RUN_DIR_ENV):
        _off = True
        return None
    from antifragile.engine._events import channel
    from antifragile.trainer.pause import PausePoints

    ch = channel()
    if ch is None:  # its event file cannot be opened: nor will it later
        _off = True
        return None
    _probe = _Probe(ch, PausePoints(ch.run_dir, ch.rank, ch.emit, generation=ch.attempt))
    return _loop(_probe)


def _loop(p: _Probe) -> _Probe:
    """``p``, its channel told that the caller is the training thread: the script calls the
    probe from its loop, which need not be the main thread (then only the main thread's
    reports would start the next step's time, and each step would count from the first)."""
    p.channel.loop_thread = threading.current_thread()
    return p


def _step(step: Any, call: str) -> int:
    """``step`` as an int, or a TypeError naming ``call`` and the value: an int, a numpy
    integer or a one-element integer tensor (``operator.index``). ``int()`` took ``1.5`` as
    step 1 and ``"3"`` as 3, so ``step_end(step / 2)`` reported step 1 twice, and the verdict
    named steps the script never passed."""
    try:
        if isinstance(step, bool):  # an int to Python, never a step
            raise TypeError
        return operator.index(step)
    except TypeError:
        raise TypeError(f"probe.{call}: step must be an integer (the global step), not "
                        f"{type(step).__name__} {step!r}") from None


def step_end(step: int, loss: Any = None) -> None:
    """Step ``step`` (the global step: an integer, larger at each call; a TypeError under
    chaos otherwise) is done (its optimizer step taken). ``loss``: a float or a one-element
    tensor (read with ``float()``), or None (also reported for what is not one number). The
    step's time is measured from the previous thing the training thread reported (the last
    step, a checkpoint's staging, a restore), so checkpoint stalls and pauses are not counted
    as step time; when this call is the process's first report (a fresh start: the script
    restored nothing through the engine or :func:`dcp_load`) it is unknown, reported as None
    rather than as the 0 s between the two lines this call writes. Holds here if the scenario
    pauses this rank at this step."""
    called_t = time.time()
    p = _active()
    if p is None:
        return
    step = _step(step, "step_end")
    first = p.channel.started_t >= called_t  # this call opened the event file
    p.channel.emit("step_end", step=step, loss=_number(loss),
                   seconds=None if first else time.time() - p.channel.loop_t)
    p.pauses.step_end(step)


def _number(loss: Any) -> float | None:
    """``loss`` as a float; None when it is none, or not one number (a batch's losses): the
    probe reports the loss, and fails no step that would not fail outside chaos (so whatever
    ``float()`` raises: RuntimeError for a meta tensor, OverflowError for a huge int)."""
    try:
        return None if loss is None else float(loss)
    except Exception:
        return None


def restored(step: int) -> None:
    """The script resumed from its checkpoint of ``step``. Needed only when it does not load
    through :class:`~antifragile.engine.CheckpointEngine` or :func:`dcp_load` (which report
    the restore themselves; then this call adds nothing). Its time is counted from the
    process's first report; when this call is that report (the usual case: a script restores
    before its first step) it is unknown, and reported as None rather than as the 0 s between
    the two lines this call writes."""
    called_t = time.time()
    p = _active()
    if p is None:
        return
    step = _step(step, "restored")
    if p.channel.restored_step is not None:
        return
    first = p.channel.started_t >= called_t  # this call opened the event file
    p.channel.emit("restore_end", step=step,
                   seconds=None if first else called_t - p.channel.started_t)


def dcp_save(state: dict[str, Any], checkpoint_id: str | os.PathLike[str] | None = None, *,
             step: int, **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.save(state, checkpoint_id=..., **kwargs)`` (or with a
    ``storage_writer=`` instead, as ``dcp.save`` takes either), reported to chaos as the save of
    ``step`` (a synchronous save: its whole time is stall). Returns what ``dcp.save`` returns;
    its errors are reported (``ckpt_failed``) and raised."""
    import torch.distributed.checkpoint as dcp

    p = _active()
    if p is None:
        return dcp.save(state, checkpoint_id=checkpoint_id, **kwargs)
    step = _step(step, "dcp_save")  # before the save: a refused step saves nothing
    t0 = time.perf_counter()
    try:
        metadata = dcp.save(state, checkpoint_id=checkpoint_id, **kwargs)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        p.channel.emit("ckpt_failed", step=step, error=f"{type(exc).__name__}: {exc}")
        raise
    seconds = time.perf_counter() - t0
    sizes = [i.length for i in (getattr(metadata, "storage_data", None) or {}).values()]
    mine = [i.length for i in (getattr(metadata, "storage_data", None) or {}).values()
            if i.relative_path.startswith(f"__{p.channel.rank}_")]
    p.channel.emit("ckpt_staged", step=step, stall_s=seconds)
    p.channel.emit("ckpt_committed", step=step, bytes=sum(sizes), rank_bytes=sum(mine),
                   persist_s=seconds)
    return metadata


def dcp_load(state: dict[str, Any], checkpoint_id: str | os.PathLike[str] | None = None, *,
             step: int, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=..., **kwargs)`` (or with a
    ``storage_reader=``), reported to chaos as the restore of ``step``. A failure is reported
    as that step skipped (``restore_skipped``) and raised: the script then tries an older
    step, as DCP users do.
    The tries up to the one that loads are one restore (one ``restore_begin``; the
    ``restore_end``'s seconds count from it), as the engine reports a fallback."""
    import torch.distributed.checkpoint as dcp

    p = _active()
    if p is None:
        dcp.load(state, checkpoint_id=checkpoint_id, **kwargs)
        return
    step = _step(step, "dcp_load")
    if p.restore_t is None:
        p.channel.emit("restore_begin")
        p.restore_t = time.perf_counter()
    try:
        dcp.load(state, checkpoint_id=checkpoint_id, **kwargs)
    except BaseException as exc:
        p.channel.emit("restore_skipped", step=step,
                       reason=f"checkpoint step {step} skipped: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}")
        raise
    p.channel.emit("restore_end", step=step, seconds=time.perf_counter() - p.restore_t)
    p.restore_t = None
