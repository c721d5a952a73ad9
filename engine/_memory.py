"""The last committed save, still in host memory: what in-process recovery restores from.

After a save commits, its staging buffers hold exactly what this rank wrote of that step, and
they stay untouched until the next save starts staging. With ``keep_in_memory`` the staging
area also keeps a copy of every local tensor this rank does not own in full (replicas whose
cells another rank writes), so the buffers cover this rank's whole local state. A survivor of
a failed process group then restores its tensors from memory, with no storage reads for them;
JSON values, bytes and the step's metadata still come from the committed step (small), which
is also what binds the memory copy to it: the copy is used only for the step and nonce that
committed, and each owned region is checked against the COMMIT manifest's chunk CRCs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _format
from ._state import iter_local
from .stage import StagingArea

Region = tuple[slice, ...]


@dataclass(slots=True)
class MemoryCopy:
    """Regions of one rank's local tensors at a committed step, by stored tensor path."""

    step: int
    nonce: int
    regions: dict[str, list[tuple[Region, torch.Tensor]]] = field(default_factory=dict)
    local_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # owned cells to check against the manifest: (object key, buffer, valid rows, spec)
    cells: list[tuple[str, torch.Tensor, int, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, step: int, nonce: int, staging: StagingArea) -> MemoryCopy:
        copy = cls(step, nonce, local_shapes=dict(staging.local_shapes))
        for write, buf in zip(staging.writes, staging.buffers):
            path = write.array.tensor
            if path in staging.shadows:
                continue  # the whole local tensor is in its shadow buffer
            region = tuple(slice(o, o + n) for o, n in zip(write.local_offset, write.valid_shape))
            copy.regions.setdefault(path, []).append(
                (region, buf[tuple(slice(0, n) for n in write.valid_shape)]))
            rows = write.valid_shape[0] if write.valid_shape else 1
            copy.cells.append((write.key, buf, rows, write.array))
        for path, shadow in staging.shadows.items():
            copy.regions[path] = [(tuple(slice(0, n) for n in shadow.shape), shadow)]
        return copy

    def covers(self, path: str, tensor: torch.Tensor) -> bool:
        """Whether this copy holds the whole local data of ``tensor`` (same layout)."""
        local = iter_local(tensor)
        if self.local_shapes.get(path) != tuple(local.shape) or path not in self.regions:
            return not local.numel() and self.local_shapes.get(path) == tuple(local.shape)
        return sum(math.prod(b.shape) for _, b in self.regions[path]) == local.numel()

    def fill(self, path: str, tensor: torch.Tensor) -> int:
        """Copy the regions into ``tensor``'s local data; returns the bytes copied."""
        local = iter_local(tensor)
        copied = 0
        with torch.no_grad():
            for region, buf in self.regions.get(path, []):
                local[region].copy_(buf)
                copied += buf.numel() * buf.element_size()
        return copied

    def check(self, crcs: dict[str, list[int]], paths: set[str]) -> str | None:
        """The first owned region of ``paths`` whose bytes do not match the CRCs the COMMIT
        manifest lists for its object, or None when all match."""
        for key, buf, rows, spec in self.cells:
            if spec.tensor not in paths:
                continue
            view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            _, _, now = _format.encode_cell(spec, rows, view)
            if list(crcs.get(key) or []) != now:
                return key
        return None
