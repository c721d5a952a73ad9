"""SaveHandle: one save in flight, as ``CheckpointEngine.save`` returns it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from .errors import CheckpointError


class SaveHandle:
    """One save in flight. ``staged`` is set once the state may be mutated again.

    ``done()`` is True once the save committed (or failed); on the coordinator the retention
    that follows a commit runs after that, and ``wait()`` waits for it too.

    Figures for this rank: ``stall_s`` (what the caller waited for staging), ``persist_s``
    (background write + commit, up to the COMMIT visible), ``nbytes`` (bytes this rank wrote),
    ``committed_nbytes`` (the whole checkpoint, on the coordinator), ``requests`` (storage
    requests this rank's save made, by kind, and their ``total``: see
    ``storage.CountingStorage``; set when done, updated with retention's on the coordinator).
    ``retention_error``: on the coordinator, why retention after the commit failed (the save is
    committed all the same), else None; final once ``wait()`` returned.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.staged = threading.Event()
        self.stall_s = 0.0
        self.persist_s = 0.0
        self.nbytes = 0
        self.committed_nbytes = 0
        self.retention_error: str | None = None
        self.requests: dict[str, int] = {}
        self._future: Future[None] = Future()
        self._observed = False
        # set once the coordinator's retention after the commit is over (at once elsewhere):
        # the save is done (committed) before, so the next one need not wait for retention
        self._retained = threading.Event()
        #: on the coordinator, why to stop waiting for the ranks' records (another rank told
        #: the next save that its part failed); read by the save's thread at each poll
        self._given_up: str | None = None

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once ``done()``: from the save's thread as it commits or fails (before
        the coordinator's retention), or here at once if it is done already. What ``fn``
        raises is logged, never raised into the save."""
        self._future.add_done_callback(lambda _: fn())

    def _fail(self, error: CheckpointError) -> None:
        """End a save that never ran (skipped, or its thread did not start) with ``error``:
        nothing is staged or retained that anybody need wait for."""
        self._future.set_exception(error)
        self.staged.set()
        self._retained.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block (at most ``timeout`` s in all) until committed, and on the coordinator until
        the retention that follows the commit is over (``retention_error`` is final then;
        ``done()`` is True from the commit on); raise the save's CheckpointError if it failed.
        A ``TimeoutError`` (or an interrupt) leaves a failure that comes later to be raised by
        the next save."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"step {self.step}: not done within {timeout} s") from None
        except CheckpointError:  # the save's own failure: raised here, so observed
            self._observed = True
            raise
        self._observed = True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._retained.wait(left):
            raise TimeoutError(f"step {self.step}: committed; retention still running")

    def retention_done(self) -> bool:
        """True once the save is over, the coordinator's retention after the commit included
        (``retention_error`` is final then)."""
        return self._retained.is_set()

    def exception(self) -> BaseException | None:
        """The failure, once done (None while in flight or on success)."""
        if not self.done():
            return None
        self._observed = True
        return self._future.exception()

    def _failed(self) -> bool:
        """Done and failed, whether or not anybody has read the failure."""
        return self.done() and self._future.exception() is not None

    def _unobserved_failure(self) -> BaseException | None:
        if self.done() and not self._observed:
            return self._future.exception()
        return None
