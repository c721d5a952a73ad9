"""Reading a committed step: validated metadata, checked chunks, any target layout.

Every rank reads only the part of each global array that its target tensors hold, whatever
layout wrote it: that is resharding. Nothing read from storage is trusted: metadata is parsed
as JSON and validated (names, shapes, dtypes, codecs) before any allocation, every object is
looked up in the COMMIT manifest, every inner chunk and shard index is checked against its
crc32c and against the part CRC the manifest records for it (so a stale, foreign or swapped
object is refused on full and partial reads alike: see ``_format``), and a missing object is an
error, never a silent fill value. The bytes of each cell are read and checked by ``_cells``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from . import _format
from ._cells import read_cell
from ._dtypes import dtype_name, torch_dtype, zarr_data_type
from ._paths import COMMIT, QUARANTINE, check_array_name, chunk_separator, is_index, step_dir
from .commit import marker_head, parse_marker, read_marker_bytes
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .plan import ArraySpec, HeldBox

_MAX_CELLS = 10**8


@dataclass(frozen=True, slots=True)
class StoredTensor:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    arrays: tuple[str, ...]
    layouts: dict[str, Any] | None = None  # per array: offset, shape, chunk_shape, inner_rows


def _int_list(value: object, *, where: str, positive: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and (x > 0 if positive else x >= 0)
            and x < 2**62 for x in value):
        raise CheckpointCorruptError(f"{where}: expected a list of {'positive' if positive else ''}"
                                     f" ints, got {str(value)[:80]}")
    return tuple(value)


def split_cell_key(key: str) -> tuple[str, tuple[int, ...]] | None:
    """``(array name, cell)`` of a shard object key (``model/w/c.1.0``; ``model/w/c/1/0`` in
    format 2), None for others. Names may contain ``c`` components (``model/c/w``,
    ``model/c.5``): the last ``/c.`` (or ``/c/``) followed by numbers only is the separator."""
    for sep in (".", "/"):
        head, found, tail = key.rpartition(f"/c{sep}")
        if found and all(is_index(p) for p in tail.split(sep)):
            return head, tuple(int(p) for p in tail.split(sep))
    return (key.removesuffix("/c"), ()) if key.endswith("/c") else None


@contextlib.contextmanager
def _blame(key: str) -> Iterator[None]:
    """Name ``key`` as the damaged object of a CheckpointCorruptError raised inside."""
    try:
        yield
    except CheckpointCorruptError as exc:
        if exc.key is None:
            exc.key = key
        raise


def gone(storage: Any, step: int, nonce: int | None) -> CheckpointNotFoundError | None:
    """Why ``step``, which a reader opened (read its COMMIT: of save ``nonce``, when known),
    is no longer that save, asked once its read failed: its COMMIT deleted (retention, after
    a save of the job writing this root beside the reader), set aside (quarantined:
    superseded by a rollback's save, or found damaged by another reader) or another save's
    (saved again); None while it is still the save read (or storage cannot say: the failure
    stands). A missing or replaced object of a step that went away meanwhile is not damage:
    reported as damage, a reader beside a training job called healthy steps damaged and
    tried to quarantine them."""
    base = step_dir(step)
    try:
        try:
            head = marker_head(storage, step)
        except FileNotFoundError:
            if storage.exists(f"{base}/{QUARANTINE}"):
                return CheckpointNotFoundError(
                    f"step {step} was quarantined while it was read (its COMMIT set aside: "
                    "superseded by a save after a rollback, or found damaged by another "
                    f"reader; `chaos ckpt ls {storage.url}` says why)")
            return CheckpointNotFoundError(
                f"step {step} was deleted while it was read (by retention after a newer save, "
                "in the job writing this root?)")
    except CheckpointError:
        return None
    if nonce is not None and head is not None and head[0] != nonce:
        return CheckpointNotFoundError(f"step {step} was saved again while it was read (the "
                                       "save read is gone)")
    return None


def read_documents(storage: Any, step: int) -> tuple[bytes | bytearray, bytes | bytearray]:
    """The COMMIT marker and the group document of ``step`` as stored, unchecked: what a
    ``StepReader(marker=..., group=...)`` checks and opens the step from."""
    marker = read_marker_bytes(storage, step)
    try:
        return marker, storage.read(f"{step_dir(step)}/zarr.json")
    except FileNotFoundError:
        raise gone(storage, step, None) or CheckpointCorruptError(
            f"step {step}, object zarr.json: object is missing", key="zarr.json") from None


class StepReader:
    """A committed step, opened for reading. Thread-safe after construction.

    ``marker``: read the step against these COMMIT bytes instead of its COMMIT object (a
    quarantined step's manifest, moved aside, or another rank's read of it); ``group``: the
    bytes of the step's group document, read by another rank (checked here as if read; see
    ``read_documents``)."""

    def __init__(self, storage: Any, step: int, marker: bytes | bytearray | None = None,
                 group: bytes | bytearray | None = None) -> None:
        self.storage = storage
        self.step = step
        self.base = step_dir(step)
        with _blame(COMMIT):
            read_here = marker is None  # its COMMIT: ``gone`` can tell whether it went away
            marker = read_marker_bytes(storage, step) if marker is None else marker
            self.commit, self.manifest = parse_marker(marker, step, lazy=True)
        self.separator = chunk_separator(self.commit["format"])
        with _blame("zarr.json"), (self.unless_gone() if read_here else contextlib.nullcontext()):
            group = self._parse_document("zarr.json", self.read_object("zarr.json")
                                         if group is None else self._sized("zarr.json", group))
        group_attrs = group.get("attributes") if isinstance(group, dict) else None
        attrs = group_attrs.get("antifragile") if isinstance(group_attrs, dict) else None
        if not isinstance(attrs, dict) or not isinstance(attrs.get("tensors"), dict):
            raise CheckpointCorruptError(f"step {step}: group metadata lacks the tensor index")
        self.attrs = attrs
        self.values: dict[str, Any] = attrs.get("values") or {}
        self.values_by_rank: dict[str, dict[str, Any]] = attrs.get("values_by_rank") or {}
        if not isinstance(self.values, dict) or not isinstance(self.values_by_rank, dict) or any(
                not isinstance(v, dict) for v in self.values_by_rank.values()):
            raise CheckpointCorruptError(f"step {step}: malformed values in the group metadata")
        self.tensors = {path: self._parse_tensor(path, e) for path, e in attrs["tensors"].items()}
        self._arrays: dict[str, ArraySpec] = {}

    def gone(self) -> CheckpointNotFoundError | None:
        """Why this step is no longer the save opened (see ``gone``), None while it is: asked
        once a read of it failed. Of a reader opened on the step's COMMIT (not on the one a
        quarantine set aside)."""
        return gone(self.storage, self.step, int(self.commit["nonce"]))

    @contextlib.contextmanager
    def unless_gone(self) -> Iterator[None]:
        """A read of this step: its damage (CheckpointCorruptError) raised as it is, unless the
        step is no longer the save opened (``gone``): then why, as CheckpointNotFoundError."""
        try:
            yield
        except CheckpointCorruptError as exc:
            went = self.gone()
            if went is None:
                raise
            raise went from exc

    # -- whole objects -------------------------------------------------------------------------

    def where(self, key: str) -> str:
        return f"step {self.step}, object {key}"

    def entry(self, key: str) -> tuple[int, list[int]]:
        """The size and part CRCs the COMMIT manifest records for ``key`` (its entry checked
        against its digest at its first use)."""
        return self.manifest.entry(key, where=self.where(key))

    def read_object(self, key: str) -> bytes | bytearray:
        """Read a whole object (one request) and check its size against the manifest."""
        try:
            data = self.storage.read(f"{self.base}/{key}", 0, self.entry(key)[0] + 1)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{self.where(key)}: object is missing") from None
        return self._sized(key, data)

    def _sized(self, key: str, data: bytes | bytearray) -> bytes | bytearray:
        """``data``, the object ``key``, once its size is the manifest's."""
        nbytes = self.entry(key)[0]
        if len(data) != nbytes:
            raise CheckpointCorruptError(
                f"{self.where(key)}: {len(data)} bytes, the manifest says {nbytes}")
        return data

    def check_document(self, key: str, data: bytes | bytearray) -> None:
        """A metadata document must be the one this save wrote (its crc32c, in the manifest)."""
        if self.entry(key)[1] != [_format.crc(data)]:
            raise CheckpointCorruptError(f"{self.where(key)}: does not match the COMMIT "
                                         "manifest (damaged, stale or foreign)")

    def read_json(self, key: str) -> Any:
        with _blame(key):
            return self._parse_document(key, self.read_object(key))

    def _parse_document(self, key: str, data: bytes | bytearray) -> Any:
        with _blame(key):
            self.check_document(key, data)
            try:
                return json.loads(data)
            except _format.NOT_JSON as exc:
                raise CheckpointCorruptError(f"{self.where(key)}: not JSON ({exc})") from None

    def recheck(self, key: str) -> None:
        """Read ``key`` again, whole, and check it as ``verify`` does: the second look that
        confirms damage a reader reported (CheckpointCorruptError if it is damaged)."""
        with _blame(key):
            if key == COMMIT:
                return  # read and checked again by this reader's construction
            if key == "zarr.json":
                # the group's index: intact bytes can still hold a layout a load refuses,
                # so its layouts are checked again as the load read them
                self.check_document(key, self.read_object(key))
                for indexed in self.tensors.values():
                    if indexed.layouts is not None:
                        self.arrays_of(indexed)
                return
            document_of = next((t for t in self.tensors.values()
                                for name in t.arrays if key == f"{name}/zarr.json"), None)
            if document_of is not None:  # an array's layout (earlier versions): intact bytes
                # can describe an array a load refuses, so it is checked as the load read it
                self.array_document(key.removesuffix("/zarr.json"), document_of)
                return
            cell = split_cell_key(key)
            tensor = next((t for t in self.tensors.values()
                           if cell is not None and cell[0] in t.arrays), None)
            if cell is None or tensor is None:
                self.check_document(key, self.read_object(key))
                return
            self.check_cell(self.array(cell[0], tensor), cell[1], self.read_object(key))

    # -- metadata ------------------------------------------------------------------------------

    def _parse_tensor(self, path: str, entry: object) -> StoredTensor:
        where = f"step {self.step}, tensor {path!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("arrays"), list):
            raise CheckpointCorruptError(f"{where}: malformed index entry")
        arrays = tuple(check_array_name(a, step=self.step) for a in entry["arrays"])
        layouts = entry.get("array_layout")
        if layouts is not None and (not isinstance(layouts, dict) or set(layouts) != set(arrays)):
            raise CheckpointCorruptError(f"{where}: malformed index entry (array_layout)")
        return StoredTensor(path, torch_dtype(entry.get("dtype"), where=where),
                            _int_list(entry.get("shape"), where=where), arrays, layouts)

    def array(self, name: str, tensor: StoredTensor) -> ArraySpec:
        """The layout of array ``name``: from the group's index where the save recorded it
        there (no request), else from the array's ``zarr.json`` (checkpoints of earlier
        versions). ``verify`` checks that the two agree (``array_document``)."""
        if name not in self._arrays:
            if tensor.layouts is None:
                self._arrays[name] = self.array_document(name, tensor)
            else:
                self._arrays[name] = self._index_array(name, tensor)
        return self._arrays[name]

    def _index_array(self, name: str, tensor: StoredTensor) -> ArraySpec:
        where = f"step {self.step}, array {name!r} in the group's index"
        assert tensor.layouts is not None
        entry = tensor.layouts[name]
        with _blame("zarr.json"):
            try:
                offset, shape = entry["offset"], entry["shape"]
                grid, inner = entry["chunk_shape"], entry["inner_rows"]
            except (KeyError, TypeError) as exc:
                raise CheckpointCorruptError(f"{where}: malformed ({exc})") from None
            grid = _int_list(grid, where=where, positive=True)
            if not isinstance(inner, int) or isinstance(inner, bool) or inner < 1 or (
                    grid and grid[0] % inner):
                raise CheckpointCorruptError(f"{where}: bad inner_rows {str(inner)[:40]}")
            return self._checked(ArraySpec(name, tensor.path, _int_list(offset, where=where),
                                           _int_list(shape, where=where),
                                           dtype_name(tensor.dtype), grid,
                                           inner if grid else 1, self.separator), tensor, where)

    def array_document(self, name: str, tensor: StoredTensor) -> ArraySpec:
        """The layout of array ``name`` as its ``zarr.json`` (read and checked) describes it."""
        where = f"step {self.step}, array {name!r}"
        with _blame(f"{name}/zarr.json"):
            doc = self.read_json(f"{name}/zarr.json")
            try:
                attrs = doc["attributes"]["antifragile"]
                shape = _int_list(doc["shape"], where=where)
                offset = _int_list(attrs["offset"], where=where)
                grid = _int_list(doc["chunk_grid"]["configuration"]["chunk_shape"], where=where,
                                 positive=True)
                codecs = doc["codecs"]
                keys = doc["chunk_key_encoding"]
            except (KeyError, TypeError) as exc:
                raise CheckpointCorruptError(f"{where}: malformed zarr.json ({exc})") from None
            if keys != {"name": "default", "configuration": {"separator": self.separator}}:
                raise CheckpointCorruptError(f"{where}: chunk keys {str(keys)[:80]}, the format "
                                             f"of the step has {self.separator!r} separators")
            if (torch_dtype(attrs.get("dtype"), where=where) != tensor.dtype
                    or doc.get("data_type") != zarr_data_type(tensor.dtype)):
                raise CheckpointCorruptError(f"{where}: dtype disagrees with the tensor index")
            inner = grid[0] if grid else 1
            if shape:
                try:
                    conf = codecs[0]["configuration"]
                    ok = (len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed"
                          and conf["index_location"] == "end"
                          and [c["name"] for c in conf["codecs"]] == ["bytes", "crc32c"]
                          and [c["name"] for c in conf["index_codecs"]] == ["bytes", "crc32c"])
                    inner_shape = _int_list(conf["chunk_shape"], where=where, positive=True)
                except (KeyError, TypeError, IndexError):
                    ok = False
                if (not ok or len(inner_shape) != len(grid) or inner_shape[1:] != grid[1:]
                        or grid[0] % inner_shape[0]):
                    raise CheckpointCorruptError(f"{where}: unsupported codec pipeline")
                inner = inner_shape[0]
            elif not isinstance(codecs, list) or [
                    c.get("name") for c in codecs if isinstance(c, dict)] != ["bytes", "crc32c"]:
                raise CheckpointCorruptError(f"{where}: unsupported codec pipeline")
            return self._checked(ArraySpec(name, tensor.path, offset, shape, attrs["dtype"], grid,
                                           inner, self.separator), tensor, where)

    def _checked(self, spec: ArraySpec, tensor: StoredTensor, where: str) -> ArraySpec:
        """``spec`` if it fits its tensor and its chunk grid is plausible (before anything is
        allocated from it)."""
        shape, offset, grid = spec.shape, spec.offset, spec.shard_shape
        if (len(shape) != len(tensor.shape) or len(offset) != len(shape) or len(grid) != len(shape)
                or any(o + n > t for o, n, t in zip(offset, shape, tensor.shape))):
            raise CheckpointCorruptError(f"{where}: shape {list(shape)} at {list(offset)} does not "
                                         f"fit the tensor's {list(tensor.shape)}")
        cells = math.prod(math.ceil(n / c) for n, c in zip(shape, grid))
        # every shard is listed in the manifest
        if cells > min(_MAX_CELLS, len(self.manifest.objects)):
            raise CheckpointCorruptError(f"{where}: absurd chunk grid ({cells} shards)")
        return spec

    def part_crcs(self, spec: ArraySpec, cell: tuple[int, ...], where: str) -> list[int]:
        """The manifest's part CRCs of a cell: one per stored inner chunk, then the index's."""
        crcs = self.entry(spec.cell_key(cell))[1]
        expected = _format.stored_chunks(spec, cell) + (1 if spec.shape else 0)
        if len(crcs) != expected:
            raise CheckpointCorruptError(f"{where}: the manifest lists {len(crcs)} part "
                                         f"checksums, the array's layout has {expected} parts")
        return crcs

    def check_cell(self, spec: ArraySpec, cell: tuple[int, ...], data: bytes | bytearray) -> None:
        """Decode a whole shard object: index crc and bounds, every in-bounds inner chunk
        present, of the right size, and matching its crc32c and the manifest's
        (``verify``'s deep check)."""
        where = f"{self.where(spec.cell_key(cell))} (array {spec.name!r})"
        itemsize = torch_dtype(spec.dtype, where=where).itemsize
        crcs = self.part_crcs(spec, cell, where)
        view = memoryview(data)
        if not spec.shape:
            if len(_format.check_chunk(view, expected_crc=crcs[0], where=where)) != itemsize:
                raise CheckpointCorruptError(f"{where}: scalar payload has the wrong size")
            return
        k = spec.inner_rows
        chunk_nbytes = k * math.prod(spec.shard_shape[1:]) * itemsize + 4
        tail = _format.index_nbytes(spec)
        if len(data) < tail:
            raise CheckpointCorruptError(f"{where}: object smaller than its index")
        index = _format.decode_index(spec, bytes(view[-tail:]), len(data),
                                     expected_crc=crcs[-1], where=where)
        for i, span in enumerate(index[:len(crcs) - 1]):
            if span is None or span[1] != chunk_nbytes:
                raise CheckpointCorruptError(f"{where}: inner chunk {i} is missing or has the "
                                             "wrong size")
            _format.check_chunk(view[span[0]:span[0] + span[1]], expected_crc=crcs[i],
                                where=f"{where}, inner chunk {i}")

    # -- data ----------------------------------------------------------------------------------

    def load_arrays(self, tensors: Sequence[StoredTensor], pool: Executor) -> None:
        """Read and validate the metadata documents of every array of ``tensors`` whose layout
        the group's index does not record (earlier versions) at once, on ``pool`` (a checkpoint
        of 1,000 tensors is 1,000 documents: one round trip, not 1,000)."""
        todo = [(name, t) for t in tensors if t.layouts is None for name in t.arrays
                if name not in self._arrays]
        for _ in pool.map(lambda job: self.array(*job), todo):
            pass

    def arrays_of(self, tensor: StoredTensor) -> list[ArraySpec]:
        """The arrays of ``tensor``, checked to be pairwise disjoint: with that, counting the
        elements they cover proves coverage (overlapping pieces could hide a gap)."""
        specs = [self.array(name, tensor) for name in tensor.arrays]
        pair = _overlapping(specs)
        if pair is not None:
            raise CheckpointCorruptError(f"step {self.step}, tensor {tensor.path!r}: arrays "
                                         f"{pair[0].name!r} and {pair[1].name!r} overlap")
        return specs

    def read_box(self, tensor: StoredTensor, box: HeldBox, out: torch.Tensor
                 ) -> list[Callable[[], None]]:
        """The reads that fill ``out`` (the local region of ``box``), to run on a pool. Every
        check that needs no data (metadata, coverage) is done here, before any read runs."""
        reads: list[Callable[[], None]] = []
        covered = 0
        inference = torch.is_inference_mode_enabled()  # the caller's: ``out`` may need it
        for spec in self.arrays_of(tensor):
            lo = [max(b, a) for b, a in zip(box.offset, spec.offset)]
            hi = [min(b + s, a + n) for b, s, a, n in zip(box.offset, box.shape, spec.offset,
                                                          spec.shape)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            covered += math.prod(h - lo_ for lo_, h in zip(lo, hi))
            ranges = [range((l_ - a) // c, math.ceil((h - a) / c))
                      for l_, h, a, c in zip(lo, hi, spec.offset, spec.shard_shape)]
            reads += [functools.partial(self._read_cell, spec, cell, lo, hi, box, out, inference)
                      for cell in _product(ranges)]
        if covered != math.prod(box.shape):  # never leave part of the target silently unfilled
            raise CheckpointCorruptError(f"step {self.step}, tensor {tensor.path!r}: its arrays "
                                         f"cover {covered} of {math.prod(box.shape)} elements")
        return reads

    def _read_cell(self, spec: ArraySpec, cell: tuple[int, ...], lo: Sequence[int],
                   hi: Sequence[int], box: HeldBox, out: torch.Tensor, inference: bool) -> None:
        # on a pool thread, where grad mode is on and inference mode off: ``out`` may be a
        # view of a parameter, or an inference tensor
        with _blame(spec.cell_key(cell)), torch.inference_mode(inference), torch.no_grad():
            read_cell(self, spec, cell, lo, hi, box, out)


def _overlapping(specs: Sequence[ArraySpec]) -> tuple[ArraySpec, ArraySpec] | None:
    """Two of ``specs`` (the arrays of one tensor, all of its rank) that share an element, in
    their order in ``specs``, or None. A sweep along the dim where their offsets differ most:
    each array is compared only with those whose span on that dim it meets. Compared pairwise
    (a layout without a regular grid is one array per box, thousands at thousands of ranks),
    the arrays of one tensor took seconds on every rank, at every read planned of it."""
    if len(specs) < 2:
        return None
    if not specs[0].shape:
        return specs[0], specs[1]  # two scalars: the same element
    dim = max(range(len(specs[0].shape)), key=lambda d: len({s.offset[d] for s in specs}))
    order = sorted(range(len(specs)), key=lambda i: specs[i].offset[dim])
    active: list[tuple[int, ArraySpec, int]] = []  # (index, array, end on dim) met so far
    for i in order:
        a = specs[i]
        start, offset, shape = a.offset[dim], tuple(a.offset), a.shape
        active = [entry for entry in active if entry[2] > start]
        for j, b, _ in active:
            if all(max(x, y) < min(x + n, y + m) for x, n, y, m
                   in zip(offset, shape, b.offset, b.shape)):
                return (b, a) if j < i else (a, b)
        active.append((i, a, start + shape[dim]))
    return None


def _product(ranges: Sequence[range]) -> list[tuple[int, ...]]:
    from itertools import product

    return list(product(*ranges))
