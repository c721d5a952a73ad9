"""Staging: copy every cell this rank owns into host memory laid out as the objects it writes.

This is the only part of a save the training loop waits for. Each cell is staged straight into
the *image* of its shard object (``_format``: inner chunks, each followed by a 4-byte crc32c
slot, then the shard index), in one page-aligned arena allocated once per plan and reused by
every later save of the same plan, so a save allocates nothing and the persist step writes
each object from one aligned buffer (O_DIRECT where the file system takes it: no page-cache
copy). The shard index depends only on the layout and is written once, with its crc32c; the
chunk crc32c values are filled in by :meth:`StagingArea.finish` on the writer's thread, in
parallel with other objects' writes (never as a pass of its own before them), and only once
the copy has ended (``persist``).

Writers may start before staging ends: :meth:`StagingArea.wait_staged` returns as soon as the
object's cell is staged, so the disk works while later cells are still being copied.
The arena is pinned when CUDA is present so device-to-host copies run asynchronously.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from . import _format
from ._dtypes import as_bytes, torch_dtype
from ._state import iter_local
from .errors import CheckpointError
from .plan import CellWrite, local_boxes

ALIGN_BYTES = 4096  # O_DIRECT wants buffer, offset and length aligned to the logical block
_CRC = struct.Struct("<I")
_POOL_MIN_BYTES = 1 << 20  # cells this large are copied on the staging threads


@dataclass(slots=True)
class Chunk:
    """One stored inner chunk of a cell: ``rows`` rows of the cell starting at ``first_row``,
    its payload at ``start`` (bytes into the object image) and ``view`` over it: a tensor of
    the array's dtype, or of its raw bytes (``raw``) where the offset is not a multiple of the
    element size (8-byte dtypes: the 4-byte crc slots shift every other chunk)."""

    first_row: int
    rows: int
    start: int
    nbytes: int
    view: torch.Tensor
    raw: bool


@dataclass(slots=True)
class CellImage:
    """Where the object of one :class:`CellWrite` lives in the arena."""

    write: CellWrite
    offset: int  # page-aligned, into the arena
    nbytes: int  # the object's size
    chunks: list[Chunk]
    index_crc: int | None  # None for a scalar (no shard index)
    # every full chunk as one strided tensor (chunks, rows, ...), so that staging a cell is
    # one copy, not one per chunk (each copy is a parallel region: costly on a busy machine);
    # None where a chunk is raw
    full: torch.Tensor | None = None


def layout(write: CellWrite) -> tuple[int, int, int]:
    """``(stored chunks, payload bytes per chunk, object bytes)`` of a cell, as
    ``_format.encode_cell`` lays it out."""
    spec = write.array
    itemsize = torch_dtype(spec.dtype, where=spec.name).itemsize
    if not spec.shape:
        return 1, itemsize, itemsize + 4
    k = spec.inner_rows
    valid_rows = write.valid_shape[0]
    stored = min(_format.inner_count(spec), math.ceil(valid_rows / k))
    chunk_nbytes = k * math.prod(spec.shard_shape[1:]) * itemsize if stored else 0
    return stored, chunk_nbytes, stored * (chunk_nbytes + 4) + _format.index_nbytes(spec)


def _index_bytes(write: CellWrite, stored: int, chunk_nbytes: int) -> tuple[bytes, int]:
    """The shard index (and its crc32c) of a cell: it depends on the layout only."""
    index = np.full((_format.inner_count(write.array), 2), _format.EMPTY, dtype="<u8")
    for i in range(stored):
        index[i] = (i * (chunk_nbytes + 4), chunk_nbytes + 4)
    body = index.tobytes()
    index_crc = _format.crc(body)
    return body + _CRC.pack(index_crc), index_crc


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """A zeroed, page-aligned byte arena (anonymous memory, faulted in now)."""
    nbytes = max(nbytes, ALIGN_BYTES)
    if pin:
        arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        if arena.data_ptr() % ALIGN_BYTES == 0:
            return arena
    # 4 KiB pages, faulted in now (not in the first save's copy). Transparent huge pages were
    # measured: a save's kernel CPU fell ~40% (an O_DIRECT write pins 32 pages per 64 MiB, not
    # 16384), its wall time did not move, and faulting the arena in took 3.3-5.2 s for 2 GiB
    # against 0.6-2.4 s on this VM (docs/performance-log.md, thirteenth session)
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(
        mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive


class StagingArea:
    """Host memory for one plan's cells on this rank. One save at a time: ``begin``, then
    ``stage`` on one thread while writers call ``wait_staged`` / ``finish`` on others.

    With ``keep_in_memory``, every local tensor whose data this rank's cells do not cover in
    full (a replica another rank writes) also gets a *shadow* buffer staged with it, so the
    staged memory holds the rank's whole local state (``engine._memory``)."""

    def __init__(self, writes: Sequence[CellWrite], tensors: dict[str, torch.Tensor], *,
                 keep_in_memory: bool = False) -> None:
        pin = torch.cuda.is_available()
        self.writes = list(writes)
        layouts = [layout(w) for w in self.writes]
        offsets, total = [], 0
        for _, _, nbytes in layouts:
            offsets.append(total)
            total += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.arena = _allocate(total, pin)
        self._bytes = self.arena.numpy()
        self.cells = [self._image(w, off, *lay) for w, off, lay in zip(self.writes, offsets,
                                                                       layouts)]
        self.local_shapes = {p: tuple(iter_local(t).shape) for p, t in tensors.items()}
        # which part of the global tensor each local tensor holds: a memory copy restores
        # only into the same layout (the same local shape may hold other rows)
        self.local_boxes = {p: local_boxes(t, path=p) for p, t in tensors.items()}
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
        self.nbytes = total + sum(s.numel() * s.element_size() for s in self.shadows.values())
        self._cond = threading.Condition()
        self._staged = [True] * len(self.cells)  # which cells the save in progress staged
        self._complete = True  # shadows too
        self._error: BaseException | None = None
        self.epoch = 0  # bumped by every save that stages here: a memory copy's staleness

    def _image(self, write: CellWrite, offset: int, stored: int, chunk_nbytes: int,
               nbytes: int) -> CellImage:
        spec = write.array
        dtype = torch_dtype(spec.dtype, where=spec.name)
        if not spec.shape:
            view = self.arena[offset:offset + dtype.itemsize].view(dtype).reshape(())
            return CellImage(write, offset, nbytes, [Chunk(0, 1, 0, dtype.itemsize, view, False)],
                             None)
        k, inner = spec.inner_rows, tuple(spec.shard_shape[1:])
        chunks = []
        for i in range(stored):
            start = i * (chunk_nbytes + 4)
            raw_bytes = self.arena[offset + start:offset + start + chunk_nbytes]
            raw = (offset + start) % dtype.itemsize != 0
            if raw:
                shape = (k, *inner[:-1], inner[-1] * dtype.itemsize) if inner else (
                    k * dtype.itemsize,)
                view = raw_bytes.reshape(shape)
            else:
                view = raw_bytes.view(dtype).reshape(k, *inner)
            rows = min(k, write.valid_shape[0] - i * k)
            chunks.append(Chunk(i * k, rows, start, chunk_nbytes, view, raw))
        trailer, index_crc = _index_bytes(write, stored, chunk_nbytes)
        end = offset + stored * (chunk_nbytes + 4)
        self._bytes[end:end + len(trailer)] = np.frombuffer(trailer, dtype=np.uint8)
        full = None
        n_full = sum(1 for c in chunks if c.rows == k)
        step, rest = divmod(chunk_nbytes + 4, dtype.itemsize)
        if n_full > 1 and not rest and not any(c.raw for c in chunks):
            strides = (step, *(math.prod(inner[i:]) for i in range(len(inner) + 1)))
            full = self.arena.view(dtype).as_strided((n_full, k, *inner), strides,
                                                     offset // dtype.itemsize)
        return CellImage(write, offset, nbytes, chunks, index_crc, full)

    # -- one save ------------------------------------------------------------------------------

    def begin(self) -> None:
        """A save starts: no cell counts as staged until :meth:`stage` copies it again."""
        with self._cond:
            self._staged = [False] * len(self.cells)
            self._complete, self._error = False, None
            self.epoch += 1

    def fail(self, error: BaseException) -> None:
        """Staging failed: writers waiting for a cell raise instead of waiting forever."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def stage(self, tensors: dict[str, torch.Tensor]) -> float:
        """Copy the owned cells of ``tensors`` (and the shadows); returns the seconds it took
        (the stall). Each cell becomes available to writers as soon as it is copied (on CPU;
        from a device, after the final synchronize). From CPU memory, cells are copied on a
        few threads with plain ``memmove`` of their rows where they are contiguous (one call
        per inner chunk, the GIL released): a torch copy is a parallel region, and many of
        them stall on a busy machine. (One torch copy per cell on torch's intra-op threads
        was tried: ~15% faster alone, but its static split of each copy between two threads
        stalled more while writers ran beside it, 1.17-1.24x a memcpy against 1.07-1.19x.)"""
        start = time.perf_counter()
        try:
            # a conjugate or negative view keeps its values behind a bit that a byte copy
            # would drop: resolved into a copy (a no-op for every other tensor)
            sources = [iter_local(tensors[c.write.array.tensor]).detach().resolve_conj()
                       .resolve_neg() for c in self.cells]
            devices = {t.device for t in sources} | {
                iter_local(tensors[p]).device for p in self.shadows}
            on_device = any(d.type != "cpu" for d in devices)
            if on_device:
                for cell, src in zip(self.cells, sources):
                    _copy_cell(cell, src, self.arena.data_ptr(), on_device=True)
            else:
                self._stage_on_host(sources)
            for path, shadow in self.shadows.items():
                shadow.copy_(iter_local(tensors[path]).detach(), non_blocking=True)
            for device in devices:  # each device's copies: ``torch.cuda.synchronize()``
                if device.type != "cpu":  # waits for the current device's alone
                    torch.get_device_module(device.type).synchronize(device)
        except BaseException as exc:
            self.fail(exc)
            raise
        with self._cond:
            self._staged = [True] * len(self.cells)
            self._complete = True
            self._cond.notify_all()
        return time.perf_counter() - start

    def _stage_on_host(self, sources: list[torch.Tensor]) -> None:
        """Large cells on the copy threads, the small ones here, released to the writers a
        batch at a time: a future, or a writer woken, per small cell costs more than its copy
        (each hand-over of the GIL can wait a switch interval, 5 ms, on a busy machine)."""
        arena = self.arena.data_ptr()
        futures = [_copiers().submit(self._stage_cell, i, src)
                   for i, src in enumerate(sources) if self.cells[i].nbytes >= _POOL_MIN_BYTES]
        batch: list[int] = []
        batch_bytes = 0
        try:
            for i, src in enumerate(sources):
                cell = self.cells[i]
                if cell.nbytes >= _POOL_MIN_BYTES:
                    continue
                _copy_cell(cell, src, arena, on_device=False)
                batch.append(i)
                batch_bytes += cell.nbytes
                if batch_bytes >= _POOL_MIN_BYTES:
                    self._release(batch)
                    batch, batch_bytes = [], 0
            self._release(batch)
        finally:  # a failed copy here: no copy of the pool goes on into the buffers after it
            wait(futures)
        for future in futures:
            future.result()

    def _stage_cell(self, index: int, src: torch.Tensor) -> None:
        _copy_cell(self.cells[index], src, self.arena.data_ptr(), on_device=False)
        self._release([index])

    def _release(self, indices: list[int]) -> None:
        """Cells ``indices`` are staged: writers waiting for them may go."""
        if not indices:
            return
        with self._cond:
            for i in indices:
                self._staged[i] = True
            self._cond.notify_all()

    @property
    def copied(self) -> bool:
        """Whether the save in progress finished staging (successfully or not)."""
        with self._cond:
            return self._complete or self._error is not None

    def wait_staged(self, index: int | None = None) -> None:
        """Block until cell ``index`` (None: everything, shadows included) is staged; raise
        CheckpointError when staging failed first."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (
                self._complete if index is None else self._staged[index]))
            if self._error is not None:
                raise CheckpointError(f"staging failed: {type(self._error).__name__}: "
                                      f"{self._error}")

    def _array(self, index: int) -> np.ndarray:
        cell = self.cells[index]
        return self._bytes[cell.offset:cell.offset + cell.nbytes]

    def image(self, index: int) -> memoryview:
        """The staged object of cell ``index`` as it is (its chunk CRC slots filled by
        :meth:`finish`)."""
        return memoryview(self._array(index))  # type: ignore[arg-type]

    def crc_slots(self, index: int) -> list[tuple[int, int]]:
        """The byte ranges of the chunk CRC slots in the object of cell ``index``."""
        return [(c.start + c.nbytes, c.start + c.nbytes + 4) for c in self.cells[index].chunks]

    def finish(self, index: int) -> tuple[memoryview, list[int]]:
        """The staged object of cell ``index``, ready to write, and its part CRCs (each stored
        chunk's, then the index's). Computes the chunk crc32c values into their slots: call it
        on the writer's thread, once the cell is staged."""
        image = self._array(index)
        crcs = self.chunk_crcs(index)
        for value, (start, end) in zip(crcs, self.crc_slots(index)):  # the index has no slot
            image[start:end] = np.frombuffer(_CRC.pack(value), dtype=np.uint8)
        return memoryview(image), crcs  # type: ignore[arg-type]

    def shadow_crc(self, path: str) -> int:
        """The CRC of the shadow of ``path`` as its bytes are now."""
        return _format.crc(as_bytes(self.shadows[path]).numpy())

    def chunk_crcs(self, index: int) -> list[int]:
        """The part CRCs of cell ``index`` as its staged bytes are now (a memory copy's check)."""
        cell, image = self.cells[index], self._array(index)
        crcs = [_format.crc(image[c.start:c.start + c.nbytes]) for c in cell.chunks]
        return crcs + ([] if cell.index_crc is None else [cell.index_crc])


@functools.cache
def _copiers_of(pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)),
                              thread_name_prefix="ckpt-stage")


def _copiers() -> ThreadPoolExecutor:
    """The staging copy threads of this process (a forked child gets its own: the parent's
    threads do not exist in it)."""
    return _copiers_of(os.getpid())


def _copy_cell(cell: CellImage, src: torch.Tensor, arena_ptr: int, *, on_device: bool) -> None:
    write = cell.write
    region = tuple(slice(o, o + n) for o, n in zip(write.local_offset, write.valid_shape))
    block = src[region]
    if not write.array.shape:
        cell.chunks[0].view.copy_(block, non_blocking=True)
        return
    dtype = torch_dtype(write.array.dtype, where=write.key)
    if (not on_device and block.is_contiguous() and block.dtype == dtype
            and tuple(block.shape[1:]) == tuple(write.array.shard_shape[1:])):
        row_nbytes = math.prod(block.shape[1:]) * block.element_size()
        base = block.data_ptr()
        for chunk in cell.chunks:  # rows are contiguous in both: plain byte copies
            ctypes.memmove(arena_ptr + cell.offset + chunk.start,
                           base + chunk.first_row * row_nbytes, chunk.rows * row_nbytes)
        return
    chunks = cell.chunks
    if cell.full is not None:
        n_full, k = cell.full.shape[:2]
        cell.full[(slice(None), slice(None), *(slice(0, n) for n in block.shape[1:]))].copy_(
            block[:n_full * k].unflatten(0, (n_full, k)), non_blocking=True)
        chunks = chunks[n_full:]
    for chunk in chunks:
        piece = block[chunk.first_row:chunk.first_row + chunk.rows]
        if chunk.raw:  # as bytes: the last dim (rows, for 1-D) counts bytes
            if piece.stride(-1) != 1:  # contiguous() keeps a size-1 last dim's stride
                piece = piece.clone(memory_format=torch.contiguous_format)
            piece = piece.view(torch.uint8)
        chunk.view[tuple(slice(0, n) for n in piece.shape)].copy_(piece, non_blocking=True)
