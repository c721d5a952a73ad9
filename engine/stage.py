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
    """Host buffers for one plan's cells on this rank. Not thread-safe: one save at a time."""

    def __init__(self, writes: Sequence[CellWrite], dtypes: dict[str, torch.dtype]) -> None:
        pin = torch.cuda.is_available()
        self.writes = list(writes)
        self.buffers = [
            torch.zeros(_buffer_shape(w), dtype=dtypes[w.array.tensor], pin_memory=pin)
            for w in self.writes
        ]
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers)

    def stage(self, tensors: dict[str, torch.Tensor]) -> float:
        """Copy the owned cells of ``tensors``; returns the seconds it took (the stall)."""
        start = time.perf_counter()
        on_device = False
        for write, buf in zip(self.writes, self.buffers):
            src = iter_local(tensors[write.array.tensor]).detach()
            on_device |= src.device.type != "cpu"
            region = tuple(slice(o, o + n) for o, n in zip(write.local_offset, write.valid_shape))
            dst = buf[tuple(slice(0, n) for n in write.valid_shape)]
            dst.copy_(src[region], non_blocking=True)
        if on_device:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def views(self) -> list[memoryview]:
        """The raw bytes of each buffer, in the order of ``writes``."""
        return [memoryview(b.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                for b in self.buffers]
