"""The writes an engine has in storage, so that ``abandon`` can end them before it returns.

``abandon`` cancels the writes still queued, but a write already in storage (a shard object,
a record, a COMMIT, a deletion of retention) goes on on its thread. The next generation
saves the same steps again in the same process, right after: such a write landed over its
objects, or a COMMIT of the abandoned save landed and its retention deleted the next
generation's save in flight. Every mutating request of a save goes through ``GatedStorage``:
once the gate is closed none begins, and closing it waits (bounded) for those running.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

from .errors import CheckpointError
from .storage import Storage
from .storage._base import Late, create, read_into


class WriteGate:
    """Counts the mutating requests in storage; ``close`` refuses new ones and waits for
    those running. Thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running: collections.Counter[str] = collections.Counter()
        self._closed = False

    def enter(self, what: str) -> None:
        with self._changed:
            if self._closed:
                raise CheckpointError(f"{what}: not done, the engine was abandoned (its process "
                                      "group failed)")
            self._running[what] += 1

    def leave(self, what: str) -> None:
        with self._changed:
            self._running[what] -= 1
            if not self._running[what]:
                del self._running[what]
            self._changed.notify_all()

    def close(self, timeout_s: float) -> list[str]:
        """Refuse every request from now on; wait up to ``timeout_s`` for those running and
        return those still running then (storage that does not answer: they may land later)."""
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: not self._running, timeout_s)
            return sorted(self._running)


class GatedStorage:
    """``inner`` with its writes and deletions passed through ``gate``; reads as they are."""

    def __init__(self, inner: Storage, gate: WriteGate) -> None:
        self.inner, self.url, self._gate = inner, inner.url, gate

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        self._gate.enter(f"write {key}")
        try:
            self.inner.write(key, parts, durable=durable, late=late)
        finally:
            self._gate.leave(f"write {key}")

    def create(self, key: str, parts: Sequence[Any]) -> None:
        self._gate.enter(f"write {key}")
        try:
            create(self.inner, key, parts)
        finally:
            self._gate.leave(f"write {key}")

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        return self.inner.read(key, start, end)

    def read_into(self, key: str, start: int, buffers: Sequence[Any]) -> int:
        return read_into(self.inner, key, start, buffers)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list_dir(self, prefix: str) -> list[str]:
        return self.inner.list_dir(prefix)

    def delete(self, key: str) -> None:
        self._gate.enter(f"delete {key}")
        try:
            self.inner.delete(key)
        finally:
            self._gate.leave(f"delete {key}")

    def delete_tree(self, prefix: str) -> bool:
        self._gate.enter(f"delete {prefix}")
        try:
            return self.inner.delete_tree(prefix)
        finally:
            self._gate.leave(f"delete {prefix}")

    def delete_link(self, prefix: str) -> bool:
        inner = getattr(self.inner, "delete_link", None)
        if inner is None:
            return False
        self._gate.enter(f"delete {prefix}")
        try:
            return bool(inner(prefix))
        finally:
            self._gate.leave(f"delete {prefix}")

    def sync(self) -> None:
        self.inner.sync()
