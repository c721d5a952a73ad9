"""The last committed save, still in host memory: what in-process recovery restores from.

After a save commits, its staging buffers hold exactly what this rank wrote of that step, and
they stay untouched while the next save persists (the engine keeps two sets of buffers and
stages into the one the copy does not hold) until the save after it starts staging. With
``keep_in_memory`` the staging area also keeps a copy of every local tensor this rank does not
own in full (replicas whose cells another rank writes), so the buffers cover this rank's whole
local state. A survivor of a failed process group then restores its tensors from memory, with
no storage reads for them; JSON values, bytes and the step's metadata still come from the
committed step (small), which is also what binds the memory copy to it: the copy is used only
for the step and nonce that committed, and only while no later save has staged over its
buffers; each owned region is checked against the COMMIT manifest's chunk CRCs. A shadow (a
replica another rank writes) has no object of its own in the manifest: its CRC is taken when
the save commits, on the save's thread, and checked at the restore, so a bit that flipped in
memory since is not loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._dtypes import torch_dtype
from ._state import iter_local
from .plan import HeldBox, local_boxes
from .stage import StagingArea

Region = tuple[slice, ...]


@dataclass(slots=True)
class MemoryCopy:
    """Regions of one rank's local tensors at a committed step, by stored tensor path."""

    step: int
    nonce: int
    regions: dict[str, list[tuple[Region, torch.Tensor]]] = field(default_factory=dict)
    local_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    local_boxes: dict[str, list[HeldBox]] = field(default_factory=dict)
    # owned cells to check against the manifest: (object key, tensor path, index in staging)
    cells: list[tuple[str, str, int]] = field(default_factory=list)
    staging: StagingArea | None = None
    epoch: int = 0  # the staging area's epoch this copy is of
    shadow_crcs: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, step: int, nonce: int, staging: StagingArea) -> MemoryCopy:
        copy = cls(step, nonce, local_shapes=dict(staging.local_shapes),
                   local_boxes=dict(staging.local_boxes), staging=staging,
                   epoch=staging.epoch,
                   shadow_crcs={p: staging.shadow_crc(p) for p in staging.shadows})
        for index, cell in enumerate(staging.cells):
            write = cell.write
            path = write.array.tensor
            if path in staging.shadows:
                continue  # the whole local tensor is in its shadow buffer
            copy.cells.append((write.key, path, index))
            regions = copy.regions.setdefault(path, [])
            if not write.array.shape:
                regions.append(((), cell.chunks[0].view))
                continue
            dtype = torch_dtype(write.array.dtype, where=write.key)
            for chunk in cell.chunks:  # each inner chunk is a run of rows of the cell
                region = (slice(write.local_offset[0] + chunk.first_row,
                                write.local_offset[0] + chunk.first_row + chunk.rows),
                          *(slice(o, o + n) for o, n in zip(write.local_offset[1:],
                                                            write.valid_shape[1:])))
                # a raw chunk's view is its bytes (the last dim counts bytes): read as the
                # dtype at the restore, from the buffer the check covers, not from a clone
                take = [slice(0, chunk.rows), *(slice(0, n) for n in write.valid_shape[1:])]
                if chunk.raw:
                    take[-1] = slice(0, take[-1].stop * dtype.itemsize)
                regions.append((region, chunk.view[tuple(take)]))
        for path, shadow in staging.shadows.items():
            copy.regions[path] = [(tuple(slice(0, n) for n in shadow.shape), shadow)]
        return copy

    def covers(self, path: str, tensor: torch.Tensor) -> bool:
        """Whether this copy holds the whole local data of ``tensor`` (same layout: the same
        boxes of the global tensor at the same local offsets, not only the same local shape)."""
        if self.local_boxes.get(path) != local_boxes(tensor, path=path):
            return False
        local = iter_local(tensor)
        if self.local_shapes.get(path) != tuple(local.shape) or path not in self.regions:
            return not local.numel() and self.local_shapes.get(path) == tuple(local.shape)
        return sum(math.prod(s.stop - s.start for s in region)
                   for region, _ in self.regions[path]) == local.numel()

    def fill(self, path: str, tensor: torch.Tensor) -> int:
        """Copy the regions into ``tensor``'s local data; returns the bytes copied."""
        local = iter_local(tensor)
        copied = 0
        with torch.no_grad():
            for region, buf in self.regions.get(path, []):
                if buf.dtype != local.dtype:  # a raw chunk's bytes, checked just before
                    buf = buf.clone().view(local.dtype)  # (clone: aligned for the dtype)
                local[region].copy_(buf)
                copied += buf.numel() * buf.element_size()
        return copied

    def check(self, crcs: Mapping[str, list[int]], paths: set[str]) -> str | None:
        """Why the copy of ``paths`` cannot be used (a later save staged over its buffers, or
        the first region whose bytes do not match the CRCs the COMMIT manifest lists for its
        object, or its shadow's CRC), or None when all match."""
        staging = self.staging
        if staging is None:
            return None if not self.cells and not self.shadow_crcs else "no staging buffers"
        if staging.epoch != self.epoch:
            return "a later save has staged over its buffers"
        for key, path, index in self.cells:
            if path in paths and list(crcs.get(key) or []) != staging.chunk_crcs(index):
                return f"{key} does not match its COMMIT manifest"
        for path, crc in self.shadow_crcs.items():
            if path in paths and staging.shadow_crc(path) != crc:
                return f"the replica of {path!r} changed since the commit"
        return None
