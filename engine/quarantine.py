"""Quarantine: a damaged committed step hidden, its evidence kept.

A load that finds a committed step damaged (and a second rank's re-read confirms it: see
``_loader``) moves the step's COMMIT aside into a sealed QUARANTINE note, so the step is no
longer visible, can be saved again, and ``verify`` / ``chaos ckpt verify`` can still read it
against its manifest and explain the damage. Every note is also kept in a log outside the
step folders.
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any

from . import _format
from ._paths import COMMIT, QUARANTINE, QUARANTINE_LOG, parse_step_dir, step_dir
from .commit import all_step_dirs
from .errors import CheckpointCorruptError
from .storage import Storage

# a note's name in the log: its step folder and the time it was written (``quarantine``); a
# local write's temporary file beside it (``<name>.<pid>-<token>-<thread>.tmp``) is not one
_LOG_NAME = re.compile(r"^(step_\d+)\.\d+$")


def quarantine(storage: Storage, step: int, reason: str, *, reports: dict[int, str],
               confirmed_by: int, nonce: int | None = None) -> bool:
    """Hide a damaged committed step, keeping the evidence: its COMMIT moves (bytes unchanged)
    into a sealed QUARANTINE note with the reason, what every rank reported, and which rank
    confirmed it, so that ``verify`` can still read the step against its manifest. The step
    can be saved again, which clears its folder: the note is also kept in the quarantine log
    (``QUARANTINE_LOG``, outside the step folders; ``quarantine_log``), which neither a new
    save nor retention touches. The note is written (durably) before COMMIT is deleted: a
    crash in between leaves the step committed, and the next load finds the damage again. A
    COMMIT that is no longer the one read (the step saved again meanwhile) is not deleted.
    ``nonce``: the save whose damage was confirmed, when known: a COMMIT of another save (the
    step saved again since) is left alone. Whether this call hid the step: not where it was
    gone already, or went meanwhile (retention in the job writing this root deleted it: the
    note written into its folder is taken back, or it made the folder again, as a quarantined
    step of one note; the log keeps it), or was saved again."""
    base = step_dir(step)
    try:
        marker = storage.read(f"{base}/{COMMIT}")
    except FileNotFoundError:
        return False  # hidden already (another process quarantined it, or retention ran)
    if nonce is not None and _nonce_of(marker, step) != nonce:
        return False  # saved again since the damage was confirmed: not the damaged save
    note = {"step": step, "reason": reason, "reports": {str(r): m for r, m in reports.items()},
            "confirmed_by": confirmed_by, "time": time.time(),
            "commit_b64": base64.b64encode(bytes(marker)).decode()}
    sealed = _format.seal(note)
    storage.write(f"{QUARANTINE_LOG}/{base}.{time.time_ns()}", [sealed], durable=True)
    storage.write(f"{base}/{QUARANTINE}", [sealed], durable=True)
    storage.sync()
    try:  # a save of the step that committed meanwhile is not the damaged one: left visible
        if storage.read(f"{base}/{COMMIT}") != marker:
            return False
    except FileNotFoundError:
        # another process quarantined it (its data is there), or retention deleted it
        if not storage.exists(f"{base}/zarr.json"):
            _take_back(storage, f"{base}/{QUARANTINE}", sealed)
        return False
    storage.delete(f"{base}/{COMMIT}")
    storage.sync()
    return True


def _take_back(storage: Storage, key: str, note: bytes) -> None:
    """Delete the note ``key`` if it is still ``note`` (this call's, not another process's)."""
    try:
        if storage.read(key) != note:
            return
    except FileNotFoundError:
        return
    storage.delete(key)
    storage.sync()


def supersede(storage: Storage, newer: list[int], went_back_to: int) -> None:
    """Hide the committed steps ``newer`` than ``went_back_to``, the step a load went back to,
    before the run saves again: they are of the run it abandoned (a rollback), and a load
    would otherwise resume from them, undoing it. Each is quarantined (its COMMIT kept in the
    note, so ``verify`` still reads it; saved anew when the run reaches it); a folder without
    a COMMIT is left as it is. A crash midway leaves ``went_back_to`` the newest."""
    for old in newer:
        quarantine(storage, old, f"superseded: the run went back to step {went_back_to} (a "
                   "load of it, then a save), and this step is of the run it abandoned",
                   reports={}, confirmed_by=0)


def _nonce_of(marker: bytes | bytearray, step: int) -> object:
    """The nonce a COMMIT names, None when it does not unseal."""
    try:
        return _format.unseal(marker, where=f"step {step}: COMMIT marker").get("nonce")
    except CheckpointCorruptError:
        return None


def read_quarantine(storage: Storage, step: int) -> tuple[dict[str, Any], bytes] | None:
    """A quarantined step's note and its moved-aside COMMIT bytes; None when there is none.
    A damaged note raises CheckpointCorruptError whose ``key`` is the note (what ``verify``
    reports as damaged: the COMMIT is not there)."""
    try:
        data = storage.read(f"{step_dir(step)}/{QUARANTINE}")
    except FileNotFoundError:
        return None
    try:
        note = _checked(_format.unseal(data, where=f"step {step}: QUARANTINE note"),
                        where=f"step {step}: QUARANTINE note")
        try:
            marker = base64.b64decode(note["commit_b64"], validate=True)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"step {step}: QUARANTINE note lacks the COMMIT it "
                                         f"moved aside ({exc})") from None
    except CheckpointCorruptError as exc:
        exc.key = exc.key or QUARANTINE
        raise
    return note, marker


def quarantine_log(storage: Storage
                   ) -> tuple[list[tuple[int, dict[str, Any]]], list[CheckpointCorruptError]]:
    """Every quarantine note ever written under this root, (step, note) oldest first: also
    those of steps saved again or retired since; and, apart, a CheckpointCorruptError naming
    each damaged note (one damaged note hides none of the others)."""
    notes, damaged = [], []
    for name in storage.list_dir(QUARANTINE_LOG):
        match = _LOG_NAME.match(name)
        step = parse_step_dir(match[1]) if match else None
        if step is not None:
            data = storage.read(f"{QUARANTINE_LOG}/{name}")
            where = f"{QUARANTINE_LOG}/{name}"
            try:
                notes.append((step, _checked(_format.unseal(data, where=where), where=where)))
            except CheckpointCorruptError as exc:
                damaged.append(exc)
    return sorted(notes, key=lambda found: found[1]["time"]), damaged


def _checked(note: dict[str, Any], *, where: str) -> dict[str, Any]:
    """``note``, whose ``time`` is sorted on and shown as a date: a number of seconds since
    the epoch that a date can be made of, or the note is damaged."""
    when = note.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when <= 1e11:
        raise CheckpointCorruptError(f"{where}: malformed (time {when!r})")
    return note


def quarantined_steps(storage: Storage) -> list[int]:
    """Steps hidden by quarantine (a QUARANTINE note and no COMMIT), ascending."""
    return [step for step in all_step_dirs(storage)
            if storage.exists(f"{step_dir(step)}/{QUARANTINE}")
            and not storage.exists(f"{step_dir(step)}/{COMMIT}")]
