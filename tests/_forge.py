"""Rewriting a COMMIT manifest the way a writer that knows the format would: every object it
changes gets a consistent manifest entry (size, part CRCs, digest) and the marker is resealed.

Tests use it to feed the reader objects that are consistent with their manifest, so that the
check under test (hostile metadata, data rewritten by zarr-python) is what decides, not the
manifest.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from antifragile.engine import _format

EMPTY = 2**64 - 1


def part_crcs(data: bytes, inner_chunks: int | None) -> list[int]:
    """The part CRCs of an object as the encoder records them: ``None`` for a document (the
    crc32c of its bytes), 0 for a scalar chunk, else a shard of ``inner_chunks`` index entries
    (the crc32c stored after each inner chunk, then the index's)."""
    if inner_chunks is None:
        return [_format.crc(data)]
    if inner_chunks == 0:
        return [struct.unpack("<I", data[-4:])[0]]
    tail = 16 * inner_chunks + 4
    index = np.frombuffer(data[-tail:-4], dtype="<u8").reshape(-1, 2).tolist()
    crcs = []
    for offset, nbytes in index:
        end = offset + nbytes
        if offset == EMPTY or end > len(data) or nbytes < 4:
            crcs.append(0)
        else:
            crcs.append(struct.unpack("<I", data[end - 4:end])[0])
    return [*crcs, struct.unpack("<I", data[-4:])[0]]


def set_entry(commit: dict[str, Any], key: str, nbytes: int, crcs: list[int]) -> None:
    """A manifest entry for ``key`` whose digest matches (bound to the marker's nonce)."""
    commit["objects"][key] = [nbytes, _format.object_digest(commit["nonce"], key, nbytes, crcs)]
    commit["crcs"][key] = crcs


def edit_commit(path: Path | Callable[[], bytes], edit: Callable[[dict[str, Any]], None],
                write: Callable[[bytes], None] | None = None) -> None:
    """Unseal the marker, ``edit`` it, seal it again. ``edit`` sees the manifest as two maps
    (``objects``, ``crcs``) whatever the format; a COMMIT stored as columns is stored so again
    (where the edit left two maps with the same keys: a malformed manifest stays as it is)."""
    raw = path.read_bytes() if isinstance(path, Path) else path()
    doc = json.loads(raw)
    doc.pop("crc32c")
    columnar = "manifest" in doc
    if columnar:
        manifest = _format.parse_manifest(doc, where="forge", lazy=True)
        doc["objects"], doc["crcs"] = dict(manifest.objects), dict(manifest.crcs)
        del doc["manifest"]
    edit(doc)
    objects, crcs = doc.get("objects"), doc.get("crcs")
    if (columnar and isinstance(objects, dict) and isinstance(crcs, dict)
            and objects.keys() == crcs.keys()):
        del doc["objects"], doc["crcs"]
        doc["manifest"] = _format.Manifest(doc["nonce"], objects, crcs).columns()
    sealed = _format.seal(doc)
    if write is not None:
        write(sealed)
    else:
        assert isinstance(path, Path)
        path.write_bytes(sealed)
