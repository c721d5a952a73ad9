"""Nothing chaos starts outlives it.

A ``chaos`` command starts process trees of its own (a torchrun job and its ranks, a SeaweedFS
cluster, crashcheck's checkers), each in a session of its own so that a fault can signal a
whole rank's group. So none of them hears the terminal's signals, and when chaos ends without
its ``finally`` blocks (SIGTERM from a CI timeout or ``timeout``, SIGKILL) they would run on:
an in-process-recovery job with nobody to end it re-forms forever. Two lines of defence:

- :func:`die_with_parent`: the child is sent a signal by the kernel when the thread that
  started it ends (``PR_SET_PDEATHSIG``), even after a SIGKILL of chaos;
- :func:`stop_once`: SIGTERM, and SIGHUP (the terminal closed), end chaos the way Ctrl-C
  does, through its ``finally`` blocks (a job is stopped, emulated hosts are taken down, a
  cluster's folder is deleted), and a second signal does not cut those short.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
import sys
from collections.abc import Callable
from types import FrameType

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent ``sig`` when its parent's spawning thread
    ends; None where there is no ``prctl`` (not Linux). ``parent``: ``os.getpid()`` of the
    caller, to catch a parent that died before the signal was armed."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _off_the_terminal() -> None:
    """Point the standard streams that are a terminal at ``/dev/null``: a hung-up terminal
    answers every write with EIO, and the cleanup's first line of output raised it and ended
    the cleanup there (exit 1). A terminal is told by its file type, a character device:
    ``isatty`` is already false for a hung-up one, and a pipe or a file is no device."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            with contextlib.suppress(OSError):
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
    finally:
        os.close(null)


def stop_once() -> None:
    """Make SIGTERM raise ``SystemExit(143)``, SIGHUP ``SystemExit(129)`` and Ctrl-C
    ``KeyboardInterrupt`` in the main thread, once: cleanup then runs undisturbed by a second
    signal of any of them (a second Ctrl-C raised inside the ``finally`` blocks and ended them
    partway), which only says that it goes on. SIGHUP's default ended chaos at once, as a
    SIGKILL does, leaving a tmpfs mounted and emulated hosts up when its terminal closed.
    SIGKILL still ends it, and :func:`die_with_parent` takes the children with it."""

    def again(signum: int, _: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            _off_the_terminal()
        with contextlib.suppress(OSError):
            print("chaos: still stopping what it started (SIGKILL ends chaos at once, "
                  "leaving it to the next run to clear)", file=sys.stderr, flush=True)

    def stop(signum: int, _: FrameType | None) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, again)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGHUP:
            _off_the_terminal()
        what = "hung up (SIGHUP)" if signum == signal.SIGHUP else "terminated (SIGTERM)"
        with contextlib.suppress(OSError):  # stderr a closed pipe: the cleanup still runs
            print(f"chaos: {what}; stopping what it started", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
