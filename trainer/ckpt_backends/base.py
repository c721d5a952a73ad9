"""What every checkpoint backend offers the trainer, and the local-folder bookkeeping the two
peer engines (DCP, torchsnapshot) share.

Both peers write one folder per checkpoint, ``<url>/step_<9 digits>/``, and write a marker file
last (DCP ``.metadata``, torchsnapshot ``.snapshot_metadata``): a folder is a committed
checkpoint exactly when its marker exists. Everything else (retention, leftovers of a crashed
save) is plain file work done by rank 0 on local storage.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from antifragile.engine import CheckpointError
from antifragile.engine._paths import COMMIT

_STEP_RE = re.compile(r"^step_(\d{9,})$")
#: the file each engine writes last into a step folder of local storage: its commit
MARKERS = {"antifragile": COMMIT, "dcp": ".metadata", "torchsnapshot": ".snapshot_metadata"}


class PendingSave(Protocol):
    """A save in flight, as the trainer sees it (``engine.SaveHandle`` satisfies it)."""

    step: int
    stall_s: float
    persist_s: float
    nbytes: int
    committed_nbytes: int

    def done(self) -> bool: ...

    def exception(self) -> BaseException | None: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once ``done()``, from the thread that ended the save (at once, here, if
        it is done already)."""
        ...


class Backend(Protocol):
    """A checkpoint engine under test. ``save`` and ``load`` are collective over all ranks."""

    name: str
    #: False: a new save must wait for the previous one (the wait is loop stall)
    overlaps_saves: bool
    #: a save waits on the default process group's store from a thread of its own (which
    #: the abort of a failed generation does not interrupt)
    saves_wait_on_default_store: bool

    def candidates(self) -> list[int]:
        """Committed steps, newest first, as every rank agrees on them (collective)."""
        ...

    def save(self, step: int, state: dict[str, Any]) -> PendingSave: ...

    def load(self, state: dict[str, Any], memory: Any = None) -> tuple[int, list[str]]:
        """Fill ``state`` from the newest step that loads: (step, reasons older ones were
        tried). Raises ``CheckpointError`` when none loads. ``memory``: a previous backend's
        ``memory_copy()`` of this rank (in-process recovery), used where the engine can."""
        ...

    def load_sources(self) -> dict[str, int]:
        """Bytes the last load took from host memory and from storage (empty: not known)."""
        ...

    def memory_copy(self) -> Any:
        """This rank's last committed save still in host memory, or None."""
        ...

    def abandon(self) -> None:
        """Drop this backend without waiting for a save in flight (its group failed)."""
        ...

    def close(self) -> None: ...


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def local_root(url: str) -> Path:
    """The folder of a local URL; the peer engines run on local storage only."""
    if "://" in url and not url.startswith("file://"):
        raise CheckpointError(f"{url}: the dcp and torchsnapshot backends need local storage")
    return Path(url.removeprefix("file://"))


def step_folders(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def committed(root: Path, marker: str) -> list[int]:
    """Steps whose marker (written last by the peer engine) exists, ascending."""
    return sorted(s for s, p in step_folders(root).items() if (p / marker).is_file())


def prune(root: Path, marker: str, keep_last: int) -> None:
    """Rank 0 after a commit: keep the newest ``keep_last`` committed steps; remove older
    committed ones and uncommitted folders older than the newest commit (dead saves). Folders
    newer than the newest commit may be a save in flight and are left alone."""
    done = committed(root, marker)
    if not done:
        return
    keep = set(done[-keep_last:])
    for step, path in step_folders(root).items():
        if step < done[-1] and step not in keep:
            shutil.rmtree(path, ignore_errors=True)


def discard_after(root: Path, step: int | None) -> None:
    """Rank 0 at restore: remove every step folder newer than the one restored (a crashed
    save's leftovers, or a damaged checkpoint that was skipped). The trainer saves those steps
    again, and a peer engine must never write into a folder that already has a marker."""
    for s, path in step_folders(root).items():
        if step is None or s > step:
            shutil.rmtree(path, ignore_errors=True)


def folder_nbytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class PeerHandle:
    """A peer engine's save as a :class:`PendingSave`: wraps the engine's own future.

    ``persist_s`` runs from the moment the loop got control back to the moment the future
    resolved; ``sizes`` turns the future's result into (bytes this rank wrote, bytes of the
    whole checkpoint) and runs in the background, when the save is done.
    """

    def __init__(self, step: int, future: Future[Any], *, stall_s: float,
                 sizes: Callable[[Any], tuple[int, int]], started_t: float | None = None) -> None:
        self.step = step
        self.stall_s = stall_s
        self.persist_s = 0.0
        self.nbytes = 0
        self.committed_nbytes = 0
        # a synchronous save persisted while the loop waited: count it from its start
        self._staged_t = time.perf_counter() if started_t is None else started_t
        self._sizes = sizes
        self._outcome: Future[None] = Future()  # resolved once the sizes are known too
        future.add_done_callback(self._resolved)

    def _resolved(self, future: Future[Any]) -> None:
        self.persist_s = time.perf_counter() - self._staged_t
        try:
            self.nbytes, self.committed_nbytes = self._sizes(future.result())
        except BaseException as exc:  # reported through the handle
            self._outcome.set_exception(
                CheckpointError(f"step {self.step}: {type(exc).__name__}: {exc}"))
        else:
            self._outcome.set_result(None)

    def done(self) -> bool:
        return self._outcome.done()

    def exception(self) -> BaseException | None:
        return self._outcome.exception() if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._outcome.result(timeout)
        except TimeoutError:
            raise CheckpointError(
                f"step {self.step}: save still running after {timeout} s") from None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self._outcome.add_done_callback(lambda _: fn())


def done_future(result: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(result)
    return f


def failed_future(exc: BaseException) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_exception(exc)
    return f


class CheckpointGroup:
    """A gloo group of its own for checkpoint collectives.

    DCP's async save runs its collectives from a background thread; sharing the training
    group with the loop would interleave the two and deadlock (torchtitan does the same).
    Created collectively, by every rank at the same point."""

    def __init__(self, timeout_s: float) -> None:
        self.pg: dist.ProcessGroup | None = None
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.pg is None or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def all_ok(self, ok: bool) -> bool:
        """True on every rank only if ``ok`` on every rank (so all ranks take one branch)."""
        if self.pg is None or self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(flag.item())

    def barrier(self) -> None:
        if self.pg is not None and self.world_size > 1:
            dist.barrier(group=self.pg)


class PeerBackend:
    """What the two peer backends share: one folder per step under a local root, a marker
    file that commits it, a checkpoint group of their own, and no overlapping saves."""

    marker = ""  # set by each peer: the file its engine writes last
    overlaps_saves = False
    saves_wait_on_default_store = False

    def __init__(self, url: str, *, keep_last: int, timeout_s: float, async_: bool) -> None:
        self.root = local_root(url)
        self.keep_last = keep_last
        self.async_ = async_
        self.group = CheckpointGroup(timeout_s)

    def candidates(self) -> list[int]:
        """Committed steps, newest first, as rank 0 sees them (every rank gets the same)."""
        return list(self.group.agree(list(reversed(committed(self.root, self.marker)))))

    def load_sources(self) -> dict[str, int]:
        return {}  # the peers read everything from storage

    def memory_copy(self) -> None:
        return None  # the peers keep no copy in memory

    def abandon(self) -> None:
        """Nothing to cancel: a peer's save in flight finishes or fails on its own."""


def load_newest(name: str, root: Path, steps: list[int], group: CheckpointGroup,
                load_one: Callable[[int], None],
                why: Callable[[BaseException], str] | None = None) -> tuple[int, list[str]]:
    """Load the newest of ``steps`` that loads on every rank, falling back past the ones that
    fail anywhere: (the step, one reason per step skipped). ``load_one(step)`` raises on a
    damaged step; the ranks agree on each outcome so all of them take the same branch."""
    skipped: list[str] = []
    for i, step in enumerate(steps):
        error: BaseException | None = None
        try:
            load_one(step)
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            error = exc
        if group.all_ok(error is None):
            if group.rank == 0:
                discard_after(root, step)
            group.barrier()
            return step, skipped
        then = f", trying step {steps[i + 1]}" if i + 1 < len(steps) else ""
        reason = (why or first_line)(error) if error else "it failed to load on another rank"
        skipped.append(f"checkpoint step {step} skipped{then}: {reason}")
    raise CheckpointError(f"no {name} checkpoint under {root} loads (tried {steps}): "
                          f"{skipped[-1] if skipped else 'none committed'}")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """A one-line reason for an event (DCP's errors carry every rank's traceback)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line[:limit]}"


def flat(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"w": t}}`` -> ``{"model/w": t}``, as ``CheckpointEngine.read`` names keys.
    Two entries that would get one name (``{"a/b": x, "a": {"b": y}}``) are refused: one would
    hide the other from a comparison."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        path = f"{prefix}{key}"
        for name, item in (flat(value, f"{path}/") if isinstance(value, dict)
                           else {path: value}).items():
            if name in out:
                raise CheckpointError(f"two entries of the state are both named {name!r} once "
                                      "nested keys are joined with '/'")
            out[name] = item
    return out
