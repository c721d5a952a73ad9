"""The bytes on storage: zarr v3 metadata documents, ``sharding_indexed`` shard objects, the
manifest that binds them to one save, and sealed JSON (records, COMMIT).

Each storage object is one zarr shard: inner chunks split along dim 0 (so each is a contiguous
run of the staged buffer and is written without a copy), each followed by its crc32c, then the
shard index (offset, nbytes per inner chunk, little-endian uint64) and the index's crc32c.
This is exactly what zarr-python writes for the codecs named in :func:`array_metadata`, so any
zarr v3 reader can open a checkpoint; the engine encodes and decodes it itself to avoid
zarr-python's per-chunk copies (it wrote ~0.26 GiB/s here, the disk takes ~0.5 GiB/s).

The manifest (format 2). Those crc32c values catch bit rot inside an object, never a whole
object that is valid but not the one this save wrote: step 10's object copied into step 20,
a foreign object of the same size, two objects swapped. So every object a save writes is listed
with its size, the crc32c of each of its parts (``crcs``: each inner chunk's payload in index
order, then the shard index; one value for a scalar chunk or a metadata document) and a
``digest``: crc32c over the save's nonce, the object key, the size and those part CRCs.
The part CRCs are the very values the encoder computes and stores after each chunk (no extra
pass over the data), so a reader checks an inner chunk against the manifest with the 4 bytes it
reads anyway: a partial (resharded) read of some inner chunks reads the index and those chunks,
never the whole object. The digest binds the entry to its key and to the save: an entry moved
to another key or copied from another save does not match. Records and COMMIT are JSON
sealed by a crc32c of their own bytes (:func:`seal`), checked before anything in them is used.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import crc32c
import numpy as np

from ._dtypes import fill_value, torch_dtype, zarr_data_type
from ._paths import FORMAT_VERSION
from .errors import CheckpointCorruptError
from .plan import ArraySpec

EMPTY = 2**64 - 1
_CRC = struct.Struct("<I")
_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC32C = {"name": "crc32c"}


def crc(data: Any, value: int = 0) -> int:
    return int(crc32c.crc32c(data, value))


def array_metadata(spec: ArraySpec) -> dict[str, Any]:
    """The ``zarr.json`` of an array, with the engine's own facts under ``antifragile``."""
    dtype = torch_dtype(spec.dtype, where=spec.name)
    attrs = {"antifragile": {"dtype": spec.dtype, "tensor": spec.tensor,
                             "offset": list(spec.offset)}}
    if spec.shape:
        codecs: list[dict[str, Any]] = [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": [spec.inner_rows, *spec.shard_shape[1:]],
                "codecs": [_BYTES, _CRC32C],
                "index_codecs": [_BYTES, _CRC32C],
                "index_location": "end",
            },
        }]
    else:
        codecs = [_BYTES, _CRC32C]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(spec.shape),
        "data_type": zarr_data_type(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.shard_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": spec.separator}},
        "fill_value": fill_value(dtype),
        "codecs": codecs,
        "attributes": attrs,
        "storage_transformers": [],
    }


def group_metadata(attributes: dict[str, Any] | None = None, version: int = FORMAT_VERSION
                   ) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group",
            "attributes": {"antifragile": {"format": version, **(attributes or {})}}}


def dumps(doc: Any) -> bytes:
    """A document's bytes: keys in the order the document holds them (a JSON value of the
    state keeps its dict order: a loader that resumes by iterating a dict resumes the same).
    Compact: with an ``indent`` json encodes in Python, 7x slower (a step's group document
    lists every array's layout; ``chaos ckpt inspect`` shows documents readably).
    Strict JSON (RFC 8259), as zarr requires of its metadata: a non-finite float is a bug
    here (``_state.stored_values`` writes the state's as str; ``metadata`` refuses them)."""
    return json.dumps(doc, allow_nan=False).encode()


def inner_count(spec: ArraySpec) -> int:
    return spec.shard_shape[0] // spec.inner_rows if spec.shape else 1


def stored_chunks(spec: ArraySpec, cell: Sequence[int]) -> int:
    """How many inner chunks the object of ``cell`` stores (the rest, past the array's end
    on dim 0, are EMPTY in its index)."""
    if not spec.shape:
        return 1
    valid_rows = min(spec.shard_shape[0], spec.shape[0] - cell[0] * spec.shard_shape[0])
    return max(math.ceil(valid_rows / spec.inner_rows), 1)


def encode_cell(spec: ArraySpec, valid_rows: int, data: memoryview
                ) -> tuple[list[Any], int, list[int]]:
    """Parts of one shard object (zero-copy views of ``data``), its size, and its part CRCs
    (each stored inner chunk's, then the index's: what the manifest records).

    ``data`` holds the cell's rows in C order, padded to whole inner chunks; rows at or past
    ``valid_rows`` that fill a whole inner chunk are not stored (index entry EMPTY).
    """
    if not spec.shape:
        payload_crc = crc(data)
        return [data, _CRC.pack(payload_crc)], len(data) + 4, [payload_crc]
    count = inner_count(spec)
    chunk_bytes = len(data) // max(math.ceil(valid_rows / spec.inner_rows), 1)
    parts: list[Any] = []
    crcs: list[int] = []
    index = np.full((count, 2), EMPTY, dtype="<u8")
    offset = 0
    for i in range(count):
        if i * spec.inner_rows >= valid_rows:
            break
        chunk = data[i * chunk_bytes:(i + 1) * chunk_bytes]
        crcs.append(crc(chunk))
        parts += [chunk, _CRC.pack(crcs[-1])]
        index[i] = (offset, len(chunk) + 4)
        offset += len(chunk) + 4
    index_bytes = index.tobytes()
    crcs.append(crc(index_bytes))
    trailer = index_bytes + _CRC.pack(crcs[-1])
    parts.append(trailer)
    return parts, offset + len(trailer), crcs


def index_nbytes(spec: ArraySpec) -> int:
    return 16 * inner_count(spec) + 4


def decode_index(spec: ArraySpec, trailer: bytes, object_nbytes: int, *, expected_crc: int,
                 where: str) -> list[tuple[int, int] | None]:
    """Parse and check a shard index against its crc32c and the manifest's; every entry must
    lie inside the object."""
    if len(trailer) != index_nbytes(spec):
        raise CheckpointCorruptError(f"{where}: truncated shard index")
    body, stored = trailer[:-4], _CRC.unpack(trailer[-4:])[0]
    if crc(body) != stored:
        raise CheckpointCorruptError(f"{where}: shard index fails its crc32c")
    if stored != expected_crc:
        raise CheckpointCorruptError(f"{where}: shard index is not the one this save wrote "
                                     f"({_SUBSTITUTED})")
    entries: list[tuple[int, int] | None] = []
    data_end = object_nbytes - len(trailer)
    for offset, nbytes in np.frombuffer(body, dtype="<u8").reshape(-1, 2).tolist():
        if offset == EMPTY and nbytes == EMPTY:
            entries.append(None)
        elif offset + nbytes > data_end or nbytes < 4:
            raise CheckpointCorruptError(f"{where}: shard index points outside the object")
        else:
            entries.append((offset, nbytes))
    return entries


def check_chunk(chunk: memoryview, *, expected_crc: int, where: str) -> memoryview:
    """The payload of an encoded inner chunk, after checking its crc32c and that it is the
    chunk the manifest records."""
    if len(chunk) < 4:
        raise CheckpointCorruptError(f"{where}: truncated chunk")
    payload = chunk[:-4]
    stored = _CRC.unpack(chunk[-4:])[0]
    if crc(payload) != stored:
        raise CheckpointCorruptError(f"{where}: chunk fails its crc32c")
    if stored != expected_crc:
        raise CheckpointCorruptError(f"{where}: chunk holds other data than this save wrote "
                                     f"({_SUBSTITUTED})")
    return payload


_SUBSTITUTED = "a stale, foreign or swapped object"


# -- the manifest --------------------------------------------------------------------------------


def object_digest(nonce: int, key: str, nbytes: int, crcs: Sequence[int]) -> int:
    """crc32c over the save's nonce, the object key, its size and its part CRCs."""
    head = f"{nonce}:{key}:{nbytes}:".encode()
    return crc(struct.pack(f"<{len(crcs)}I", *crcs), crc(head))


@dataclass(slots=True)
class Manifest:
    """Objects of one save: ``objects[key] = [nbytes, digest]``, ``crcs[key]`` = part CRCs.
    Kept as two maps so that ``objects`` reads as before: every key with its size.
    ``unchecked``: whether entries are checked against their digest only as they are used (a
    lazy parse, :func:`parse_manifest`): :meth:`entry` checks one then, ``checked`` holds
    those done."""

    nonce: int
    objects: Mapping[str, list[int]] = field(default_factory=dict)
    crcs: Mapping[str, list[int]] = field(default_factory=dict)
    unchecked: bool = False
    checked: set[str] = field(default_factory=set)

    def add(self, key: str, nbytes: int, crcs: list[int]) -> None:
        assert isinstance(self.objects, dict) and isinstance(self.crcs, dict)  # a writer's
        self.objects[key] = [nbytes, object_digest(self.nonce, key, nbytes, crcs)]
        self.crcs[key] = crcs

    def add_document(self, key: str, data: bytes) -> None:
        self.add(key, len(data), [crc(data)])

    def update(self, other: Manifest) -> None:
        """Add ``other``'s entries (a rank's record, checked: the writer's merge)."""
        assert isinstance(self.objects, dict) and isinstance(self.crcs, dict)
        assert not other.unchecked
        self.objects.update(other.objects)
        self.crcs.update(other.crcs)

    @property
    def nbytes(self) -> int:
        return sum(n for n, _ in self.objects.values())

    def entry(self, key: str, *, where: str) -> tuple[int, list[int]]:
        """The size and part CRCs recorded for ``key``, its entry checked against its digest;
        CheckpointCorruptError when it has none or a bad one."""
        entry = self.objects.get(key)
        if entry is None:
            raise CheckpointCorruptError(f"{where}: not in the COMMIT manifest")
        if self.unchecked and key not in self.checked:
            _check_entry(self.nonce, key, entry, self.crcs.get(key), where=where)
            self.checked.add(key)
        return entry[0], self.crcs[key]

    def check_all(self, *, where: str) -> None:
        """Check every entry not checked yet (what a lazy parse left)."""
        if self.unchecked:
            for key in sorted(set(self.objects) - self.checked):
                _check_entry(self.nonce, key, self.objects[key], self.crcs.get(key),
                             where=where)
            self.unchecked = False

    def columns(self) -> dict[str, list[Any]]:
        """The manifest as a COMMIT of format 5 stores it: one list per field, in the order
        the entries were added, each object's part CRCs one after another in ``crcs``
        (``parts`` of them). A COMMIT lists every object of the step (a million at thousands
        of ranks), and every loading rank parses it: lists of numbers decode several times
        faster than a dict of small lists (``bench.load_metadata``)."""
        keys = list(self.objects)
        parts = [self.crcs[k] for k in keys]
        sizes, digests = zip(*self.objects.values()) if keys else ((), ())
        return {"keys": keys, "sizes": list(sizes), "digests": list(digests),
                "parts": list(map(len, parts)), "crcs": list(itertools.chain.from_iterable(parts))}


class _Column(Mapping[str, list[int]]):
    """One field of a columnar manifest by key: ``values(i)`` of the key's index."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Callable[[int], list[int]]) -> None:
        self._index, self._values = index, values

    def __getitem__(self, key: str) -> list[int]:
        return self._values(self._index[key])

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def parse_manifest(doc: dict[str, Any], *, where: str, lazy: bool = False) -> Manifest:
    """The manifest of a sealed record or COMMIT, every entry checked against its digest; with
    ``lazy``, each entry only when :meth:`Manifest.entry` uses it (a load reads a few of the
    objects a COMMIT lists, and checking them all was most of its parse at thousands of ranks:
    the seal already checked the document's bytes). A COMMIT of format 5 holds the manifest
    as columns (``manifest``: :meth:`Manifest.columns`), a record or an older COMMIT as two
    maps (``objects``, ``crcs``)."""
    nonce = doc.get("nonce")
    # a writer's nonce is below 2**62; the ranks of a load agree on it in an int64 all-reduce
    if not _is_int(nonce, 2**63):
        raise CheckpointCorruptError(f"{where}: malformed manifest")
    if "manifest" in doc:
        objects, crcs = _columns(doc["manifest"], where=where)
    else:
        listed, parts = doc.get("objects"), doc.get("crcs")
        if (not isinstance(listed, dict) or not isinstance(parts, dict)
                or listed.keys() != parts.keys()):
            raise CheckpointCorruptError(f"{where}: malformed manifest")
        objects, crcs = listed, parts
    manifest = Manifest(nonce, objects, crcs, unchecked=True)
    if not lazy:
        manifest.check_all(where=where)
    return manifest


def _columns(columns: object, *, where: str
             ) -> tuple[Mapping[str, list[int]], Mapping[str, list[int]]]:
    """``objects`` and ``crcs`` of a columnar manifest, looked up through one index of its keys
    (each entry's values are checked when the entry is, against its digest)."""
    bad = CheckpointCorruptError(f"{where}: malformed manifest")
    if not isinstance(columns, dict):
        raise bad
    keys, sizes, digests, parts, crcs = (columns.get(name) for name in (
        "keys", "sizes", "digests", "parts", "crcs"))
    if not (isinstance(keys, list) and isinstance(sizes, list) and isinstance(digests, list)
            and isinstance(parts, list) and isinstance(crcs, list)
            and len(keys) == len(sizes) == len(digests) == len(parts)
            and set(map(type, keys)) <= {str} and set(map(type, parts)) <= {int}
            and min(parts, default=0) >= 0 and sum(parts) == len(crcs)):
        raise bad
    index = dict(zip(keys, range(len(keys))))
    if len(index) != len(keys):
        raise CheckpointCorruptError(f"{where}: malformed manifest (a key listed twice)")
    ends = list(itertools.accumulate(parts))
    return (_Column(index, lambda i: [sizes[i], digests[i]]),
            _Column(index, lambda i: crcs[ends[i] - parts[i]:ends[i]]))


def _check_entry(nonce: int, key: str, entry: object, parts: object, *, where: str) -> None:
    if (not isinstance(entry, list) or len(entry) != 2
            or not all(_is_int(x, 2**63) for x in entry)
            or not isinstance(parts, list) or not parts or len(parts) > entry[0] // 4 + 1
            or not all(_is_int(x, 2**32) for x in parts)):
        raise CheckpointCorruptError(f"{where}: bad manifest entry for {key!r}")
    if entry[1] != object_digest(nonce, key, entry[0], parts):
        raise CheckpointCorruptError(f"{where}: the manifest entry of {key!r} does not "
                                     "match its digest (not this save's entry)")


def _is_int(x: object, bound: int) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < bound


# -- sealed JSON (records, COMMIT) ----------------------------------------------------------------

_SEAL = re.compile(rb',"crc32c":(\d{1,10})\}\s*\Z')


def seal(doc: dict[str, Any]) -> bytes:
    """``doc`` as JSON whose last member is the crc32c of the same JSON without it."""
    if not doc or "crc32c" in doc:
        raise ValueError("seal() takes a non-empty dict without a 'crc32c' key")
    # not zarr metadata: read only by this engine. A record's values are those of the group
    # document, with non-finite floats already str (``_state.stored_values``)
    body = json.dumps(doc, allow_nan=True).encode()
    return body[:-1] + b',"crc32c":%d}' % crc(body)


def is_sealed(data: bytes | bytearray) -> bool:
    """Whether ``data`` ends as :func:`seal` ends a document (its checksum not checked)."""
    return _find_seal(data) is not None


def _find_seal(data: bytes | bytearray) -> re.Match[bytes] | None:
    """``_SEAL`` searched for in the document's last bytes only: from the start, the search
    scanned every byte of a COMMIT (96 MB at 4,096 ranks: 0.2 s per search, two per load)."""
    end = len(data)
    while end and data[end - 1] in b" \t\n\r\x0b\x0c":  # what \s matches, as bytes
        end -= 1
    return _SEAL.search(data, max(end - 32, 0))  # the seal is at most 21 bytes


# what json.loads raises for bytes it cannot make a document of (not JSON, not UTF-8, nested
# deeper than it recurses)
NOT_JSON = (ValueError, RecursionError)


def unseal(data: bytes | bytearray, *, where: str) -> dict[str, Any]:
    """The document :func:`seal` wrote; CheckpointCorruptError if its bytes changed."""
    match = _find_seal(data)
    if match is None:
        raise CheckpointCorruptError(f"{where}: no checksum (damaged, or not written by this "
                                     "engine)")
    body = bytes(data[:match.start()]) + b"}"
    if crc(body) != int(match.group(1)):
        raise CheckpointCorruptError(f"{where}: fails its checksum (damaged)")
    try:
        doc = json.loads(body)
    except NOT_JSON as exc:
        raise CheckpointCorruptError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{where}: not a JSON object")
    return doc
