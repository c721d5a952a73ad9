"""The end of a process's log, for error messages (a CI log shows the message, not the file)."""

from __future__ import annotations

import os
from pathlib import Path

#: how much of a log's end is read: a log grows for the whole run (a chatty script's output
#: for an hour), and only its last lines are shown
TAIL_BYTES = 64 * 1024


def tail(path: Path, lines: int = 8) -> str:
    """The last ``lines`` lines of ``path`` (of its last :data:`TAIL_BYTES`), indented for a
    message that names the file."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - TAIL_BYTES, 0))
            text = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n    ".join(text[-lines:]) or "(empty log)"
