"""Reading one shard object's cell into a load target, every byte checked (``StepReader``'s
data path).

The engine writes a shard object as its inner chunks one after the other, each followed by its
crc32c, then the shard index; such an object is read with one scatter read straight into the
target where the rows line up (no intermediate buffer, no zero-fill) and into a scratch buffer
copied once where they do not (resharding). An object laid out otherwise (another zarr
writer's) is read the general way: its index, then the span of the chunks wanted. Every
chunk is checked against its own crc32c and against the part CRC the COMMIT manifest records
for it, so a stale, foreign or swapped object is refused (see ``_format``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import _format
from ._dtypes import as_bytes, torch_dtype
from .errors import CheckpointCorruptError
from .plan import ArraySpec, HeldBox
from .storage._base import read_into

if TYPE_CHECKING:
    from .load import StepReader


def read_cell(reader: StepReader, spec: ArraySpec, cell: tuple[int, ...], lo: Sequence[int],
              hi: Sequence[int], box: HeldBox, out: torch.Tensor) -> None:
    """Fill the part of ``out`` (the local region of ``box``) that cell ``cell`` of ``spec``
    holds within [``lo``, ``hi``), every byte checked."""
    key = spec.cell_key(cell)
    where = reader.where(key)
    dtype = torch_dtype(spec.dtype, where=where)
    start = [a + i * c for a, i, c in zip(spec.offset, cell, spec.shard_shape)]
    # intersection of the wanted region with this cell, in global coordinates
    c_lo = [max(lo_, s) for lo_, s in zip(lo, start)]
    c_hi = [min(h, s + c) for h, s, c in zip(hi, start, spec.shard_shape)]
    if key not in reader.manifest.objects:
        raise CheckpointCorruptError(f"{where}: shard not in the COMMIT manifest "
                                     f"(array {spec.name!r}, chunk {list(cell)})")
    where = f"{where} (array {spec.name!r})"
    crcs = reader.part_crcs(spec, cell, where)
    if not spec.shape:
        payload = _format.check_chunk(memoryview(reader.read_object(key)),
                                      expected_crc=crcs[0], where=where)
        if len(payload) != dtype.itemsize:
            raise CheckpointCorruptError(f"{where}: scalar chunk has the wrong size")
        out.copy_(torch.frombuffer(bytearray(payload), dtype=dtype).reshape(()))
        return
    k = spec.inner_rows
    row_elems = math.prod(spec.shard_shape[1:])
    first, last = (c_lo[0] - start[0]) // k, math.ceil((c_hi[0] - start[0]) / k)
    if _scatter_read(reader, spec, key, first, last, crcs, start, c_lo, c_hi, box, out, where):
        return
    data, index = _fetch(reader, spec, key, first, last, crcs[-1], where)
    for i in range(first, last):
        span = index[i]
        if span is None:
            raise CheckpointCorruptError(f"{where}: inner chunk {i} is empty")
        payload = _format.check_chunk(data[span[0]:span[0] + span[1]],
                                      expected_crc=crcs[i], where=f"{where}, inner chunk {i}")
        if len(payload) != k * row_elems * dtype.itemsize:
            raise CheckpointCorruptError(f"{where}: inner chunk {i} has the wrong size")
        chunk = torch.frombuffer(payload, dtype=dtype).reshape(k, *spec.shard_shape[1:])
        r_lo = max(c_lo[0], start[0] + i * k)
        r_hi = min(c_hi[0], start[0] + (i + 1) * k)
        src = chunk[(slice(r_lo - start[0] - i * k, r_hi - start[0] - i * k),
                     *(slice(a - s, b - s) for a, b, s in zip(c_lo[1:], c_hi[1:], start[1:])))]
        dst = out[(slice(r_lo - box.offset[0], r_hi - box.offset[0]),
                   *(slice(a - o, b - o) for a, b, o in zip(c_lo[1:], c_hi[1:],
                                                           box.offset[1:])))]
        dst.copy_(src)


def _scatter_read(reader: StepReader, spec: ArraySpec, key: str, first: int, last: int,
                  crcs: list[int], start: Sequence[int], c_lo: Sequence[int], c_hi: Sequence[int],
                  box: HeldBox, out: torch.Tensor, where: str) -> bool:
    """Read inner chunks [first, last) of a cell with one scatter read laid out as the
    engine writes objects (chunk i at i * (chunk + 4)): a chunk whose wanted rows are whole
    rows at its start, into a contiguous part of ``out``, is read straight into ``out``
    (no intermediate buffer, no zero-fill); any other is read into its own buffer and
    copied once. Every chunk is checked against its crc32c and the manifest's, the index
    against the manifest's (read with the chunks when the whole object is read, else
    first). False, having read nothing into ``out``, when the object's index is not laid
    out that way: the caller then reads it the general way."""
    dtype = out.dtype
    row_nbytes = math.prod(spec.shard_shape[1:]) * dtype.itemsize
    chunk_nbytes = spec.inner_rows * row_nbytes
    stored = _format.stored_chunks(spec, tuple(
        (s - a) // c for s, a, c in zip(start, spec.offset, spec.shard_shape)))
    nbytes = reader.entry(key)[0]
    tail = _format.index_nbytes(spec)
    if nbytes != stored * (chunk_nbytes + 4) + tail or len(crcs) != stored + 1:
        return False
    path = f"{reader.base}/{key}"
    whole = first == 0 and last == stored
    try:
        if not whole:
            trailer = reader.storage.read(path, nbytes - tail, nbytes)
            if not _sequential(spec, trailer, nbytes, stored, chunk_nbytes, crcs[-1],
                                    where):
                return False
        k = spec.inner_rows
        buffers: list[Any] = []
        plan: list[tuple[int, torch.Tensor | None, Any, Any, bytearray]] = []
        inner_whole = all(a == s and b == s + n for a, b, s, n in zip(
            c_lo[1:], c_hi[1:], start[1:], spec.shard_shape[1:]))
        for i in range(first, last):
            r_lo = max(c_lo[0], start[0] + i * k)
            r_hi = min(c_hi[0], start[0] + (i + 1) * k)
            dst = out[(slice(r_lo - box.offset[0], r_hi - box.offset[0]),
                       *(slice(a - o, b - o) for a, b, o in zip(c_lo[1:], c_hi[1:],
                                                               box.offset[1:])))]
            slot = bytearray(4)
            if (inner_whole and r_lo == start[0] + i * k and dst.is_contiguous()
                    and dst.device.type == "cpu"  # read straight into host memory only,
                    and not dst.is_conj() and not dst.is_neg()):  # as the bytes it shows
                head = as_bytes(dst).numpy()
                pad = np.empty(chunk_nbytes - len(head), dtype=np.uint8)  # rows not wanted
                buffers += [head, pad, slot]
                plan.append((i, None, head, pad, slot))
            else:
                scratch = torch.empty(chunk_nbytes, dtype=torch.uint8)
                buffers += [scratch.numpy(), slot]
                plan.append((i, dst, scratch, None, slot))
        trailer_buf = bytearray(tail + 1) if whole else bytearray(0)  # +1: too long?
        buffers.append(trailer_buf)
        begin = first * (chunk_nbytes + 4)
        got = read_into(reader.storage, path, begin, buffers)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: object is missing") from None
    expected = (last - first) * (chunk_nbytes + 4) + (tail if whole else 0)
    if got != expected:
        raise CheckpointCorruptError(
            f"{where}: {'more' if got > expected else 'fewer'} bytes than the manifest says "
            f"({nbytes})" if whole else f"{where}: truncated object")
    if whole and not _sequential(spec, bytes(trailer_buf[:tail]), nbytes, stored,
                                      chunk_nbytes, crcs[-1], where):
        raise CheckpointCorruptError(f"{where}: shard index does not match the object")
    for i, dst_or_none, data, pad, slot in plan:
        chunk_where = f"{where}, inner chunk {i}"
        if dst_or_none is None:
            value = _format.crc(pad, _format.crc(data))
        else:
            value = _format.crc(data.numpy())
        stored_crc = int.from_bytes(slot, "little")
        if value != stored_crc:
            raise CheckpointCorruptError(f"{chunk_where}: chunk fails its crc32c")
        if stored_crc != crcs[i]:
            raise CheckpointCorruptError(f"{chunk_where}: chunk holds other data than this "
                                         f"save wrote ({_format._SUBSTITUTED})")
        if dst_or_none is not None:
            r0 = max(c_lo[0], start[0] + i * k) - start[0] - i * k
            chunk = data.view(dtype).reshape(k, *spec.shard_shape[1:])
            src = chunk[(slice(r0, r0 + dst_or_none.shape[0]),
                         *(slice(a - s, b - s) for a, b, s in zip(c_lo[1:], c_hi[1:],
                                                                 start[1:])))]
            dst_or_none.copy_(src)
    return True


def _sequential(spec: ArraySpec, trailer: bytes | bytearray, nbytes: int, stored: int,
                chunk_nbytes: int, index_crc: int, where: str) -> bool:
    """Check the shard index (crc32c, manifest) and whether it lays the stored chunks out
    one after the other, as the engine writes them."""
    index = _format.decode_index(spec, bytes(trailer), nbytes, expected_crc=index_crc,
                                 where=where)
    return all(span == ((i * (chunk_nbytes + 4), chunk_nbytes + 4) if i < stored else None)
               for i, span in enumerate(index))


def _fetch(reader: StepReader, spec: ArraySpec, key: str, first: int, last: int,
           index_crc: int, where: str) -> tuple[memoryview, list[tuple[int, int] | None]]:
    """Bytes covering inner chunks [first, last) (offsets relative to the view) and index.
    Only the whole-object case reads everything; a partial read fetches the index, then
    the span of the wanted chunks."""
    nbytes = reader.entry(key)[0]
    path = f"{reader.base}/{key}"
    tail = _format.index_nbytes(spec)
    if nbytes < tail:
        raise CheckpointCorruptError(f"{where}: object smaller than its index")
    if first == 0 and last == _format.inner_count(spec):
        data = memoryview(_writable(reader.read_object(key)))
        return data, _format.decode_index(spec, bytes(data[-tail:]), nbytes,
                                          expected_crc=index_crc, where=where)
    try:
        trailer = reader.storage.read(path, nbytes - tail, nbytes)
        index = _format.decode_index(spec, trailer, nbytes, expected_crc=index_crc,
                                     where=where)
        spans = [s for s in index[first:last] if s is not None]
        if not spans:
            return memoryview(b""), index
        lo, hi = min(s[0] for s in spans), max(s[0] + s[1] for s in spans)
        data = memoryview(_writable(reader.storage.read(path, lo, hi)))
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: object is missing") from None
    if len(data) != hi - lo:
        raise CheckpointCorruptError(f"{where}: truncated object")
    shifted = [None if s is None else (s[0] - lo, s[1]) for s in index]
    return data, shifted


def _writable(data: bytes | bytearray) -> bytearray:
    """``data`` as the writable buffer torch.frombuffer needs, copied only when it is not one."""
    return data if isinstance(data, bytearray) else bytearray(data)
