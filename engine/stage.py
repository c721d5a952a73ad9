"""Staging: copy every cell this rank owns into host buffers allocated once per plan.

This is the only part of a save the training loop waits for. Buffers are pinned when CUDA is
present so device-to-host copies run asynchronously; they are reused by every later save of the
same plan, so a save allocates nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from ._state import iter_local
from .plan import CellWrite


def _buffer_shape(write: CellWrite) -> tuple[int, ...]:
    spec = write.array
    if not spec.shape:
        return ()
    rows = math.ceil(write.valid_shape[0] / spec.inner_rows) * spec.inner_rows
    return (rows, *spec.shard_shape[1:])


class StagingArea:
    """Host buffers for one plan's cells on this rank. Not thread-safe: one save at a time.

    With ``keep_in_memory``, every local tensor whose data this rank's cells do not cover in
    full (a replica another rank writes) also gets a *shadow* buffer staged with it, so the
    buffers hold the rank's whole local state (``engine._memory``)."""

    def __init__(self, writes: Sequence[CellWrite], tensors: dict[str, torch.Tensor], *,
                 keep_in_memory: bool = False) -> None:
        pin = torch.cuda.is_available()
        self.writes = list(writes)
        self.buffers = [
            torch.zeros(_buffer_shape(w), dtype=tensors[w.array.tensor].dtype, pin_memory=pin)
            for w in self.writes
        ]
        self.local_shapes = {p: tuple(iter_local(t).shape) for p, t in tensors.items()}
        self.shadows: dict[str, torch.Tensor] = {}
        if keep_in_memory:
            owned: dict[str, int] = {}
            for w in self.writes:
                owned[w.array.tensor] = owned.get(w.array.tensor, 0) + math.prod(w.valid_shape)
            for path, tensor in tensors.items():
                local = iter_local(tensor)
                if local.numel() and owned.get(path, 0) != local.numel():
                    self.shadows[path] = torch.empty(local.shape, dtype=local.dtype,
                                                     pin_memory=pin)
        self.nbytes = sum(b.numel() * b.element_size()
                          for b in (*self.buffers, *self.shadows.values()))

    def stage(self, tensors: dict[str, torch.Tensor]) -> float:
        """Copy the owned cells of ``tensors`` (and the shadows); returns the seconds it took
        (the stall)."""
        start = time.perf_counter()
        on_device = False
        for write, buf in zip(self.writes, self.buffers):
            src = iter_local(tensors[write.array.tensor]).detach()
            on_device |= src.device.type != "cpu"
            region = tuple(slice(o, o + n) for o, n in zip(write.local_offset, write.valid_shape))
            dst = buf[tuple(slice(0, n) for n in write.valid_shape)]
            dst.copy_(src[region], non_blocking=True)
        for path, shadow in self.shadows.items():
            shadow.copy_(iter_local(tensors[path]).detach(), non_blocking=True)
        if on_device:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def views(self) -> list[memoryview]:
        """The raw bytes of each buffer, in the order of ``writes``."""
        return [memoryview(b.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                for b in self.buffers]
