"""The end of a process's log, for error messages (a CI log shows the message, not the file)."""

from __future__ import annotations

import os
from pathlib import Path

#: how much of a log's end is read: a log grows for the whole run (a chatty script's output
#: for an hour), and only its last lines are shown
TAIL_BYTES = 64 * 1024


def _last_lines(path: Path) -> list[str] | None:
    """The lines of ``path``'s last :data:`TAIL_BYTES`; None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - TAIL_BYTES, 0))
            return f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None


def tail(path: Path, lines: int = 8) -> str:
    """The last ``lines`` lines of ``path`` (of its last :data:`TAIL_BYTES`), indented for a
    message that names the file."""
    text = _last_lines(path)
    if text is None:
        return "(no log)"
    return "\n    ".join(text[-lines:]) or "(empty log)"


#: the last line of torchrun's own report of a failed job (its traceback, then a table)
_JOB_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def job_tail(path: Path, lines: int = 12) -> str:
    """The end of a torchrun log before torchrun's own report of the failed job (its
    traceback and table: ~40 lines that name exit codes, not the error), where the ranks'
    own output ends: what the script said as it failed."""
    text = _last_lines(path)
    if text is None:
        return "(no log)"
    failed = max((i for i, line in enumerate(text) if line.startswith(_JOB_FAILED)),
                 default=None)
    if failed is not None:
        report = max((i for i, line in enumerate(text[:failed])
                      if line.startswith("Traceback (most recent call last):")), default=None)
        text = text[:report] if report else text
    return "\n    ".join(text[-lines:]) or "(empty log)"
