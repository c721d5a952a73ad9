"""The end of a process's log, for error messages (a CI log shows the message, not the file)."""

from __future__ import annotations

from pathlib import Path


def tail(path: Path, lines: int = 8) -> str:
    """The last ``lines`` lines of ``path``, indented for a message that names the file."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n    ".join(text[-lines:]) or "(empty log)"
