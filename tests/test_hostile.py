"""Hand-crafted hostile checkpoints on local storage.

An attacker (or a buggy writer) controls every byte of a checkpoint and keeps the COMMIT
manifest consistent with what they wrote (sizes, part CRCs, digests, the marker's seal: see
``_forge``), so checksums alone catch nothing. Whatever the
metadata says, ``load`` raises CheckpointError, ``verify`` reports the step as not ok, nothing
outside the checkpoint folder is written, no absurd amount of memory is allocated, and nothing
is ever unpickled.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from _forge import edit_commit, part_crcs, set_entry

from antifragile.engine import (
    CheckpointCorruptError,
    CheckpointEngine,
    CheckpointError,
    PlanOptions,
)
from antifragile.engine.commit import read_marker
from antifragile.engine.storage import open_storage

# model/w: 8 x 4 float32 in 2 shard objects of 4 rows, each of 2 inner chunks of 2 rows
PLAN = PlanOptions(max_object_bytes=64, inner_chunk_bytes=32)
SHARD = "model/w/c.1.0"
SCALAR = "model/s/c"
EMPTY = 2**64 - 1


def crc(data: bytes) -> int:
    return int(crc32c.crc32c(data))


class Hostile:
    """Step 1 of a local checkpoint, rewritten the way an attacker would: every object it
    changes gets a matching size and crc32c in the COMMIT manifest."""

    def __init__(self, root: Path, step: int = 1) -> None:
        self.dir = root / f"step_{step:09d}"

    def read(self, key: str) -> bytes:
        return (self.dir / key).read_bytes()

    def read_json(self, key: str) -> Any:
        return json.loads(self.read(key))

    def write(self, key: str, data: bytes, inner_chunks: int | None = None) -> None:
        """Replace an object (a document unless ``inner_chunks`` says it is a shard of that
        many inner chunks, 0 for a scalar) and give it a consistent manifest entry."""
        (self.dir / key).write_bytes(data)
        self.edit_commit(lambda c: set_entry(c, key, len(data), part_crcs(data, inner_chunks)))

    def edit_json(self, key: str, edit: Callable[[Any], None]) -> None:
        doc = self.read_json(key)
        edit(doc)
        self.write(key, json.dumps(doc).encode())

    def edit_commit(self, edit: Callable[[dict[str, Any]], None]) -> None:
        edit_commit(self.dir / "COMMIT", edit)

    def edit_index(self, edit: Callable[[dict[str, Any]], None]) -> None:
        """Edit the group's tensor index entry of ``model/w``."""
        self.edit_json(
            "zarr.json", lambda g: edit(g["attributes"]["antifragile"]["tensors"]["model/w"])
        )

    def edit_array(self, edit: Callable[[dict[str, Any]], None], name: str = "model/w") -> None:
        """Edit an array's zarr.json and, as a consistent forger would, the layout the group's
        index records for it (what a load reads)."""
        self.edit_json(f"{name}/zarr.json", edit)
        doc = self.read_json(f"{name}/zarr.json")
        grid = doc["chunk_grid"]["configuration"]["chunk_shape"]
        try:
            inner = doc["codecs"][0]["configuration"]["chunk_shape"][0]
        except (KeyError, TypeError, IndexError):
            inner = grid[0] if grid else 1
        layout = {"offset": doc["attributes"]["antifragile"]["offset"], "shape": doc["shape"],
                  "chunk_shape": grid, "inner_rows": inner}

        def mirror(group: dict[str, Any]) -> None:
            for entry in group["attributes"]["antifragile"]["tensors"].values():
                if name in entry["arrays"]:
                    entry["array_layout"][name] = layout

        self.edit_json("zarr.json", mirror)

    def edit_shard_index(self, edit: Callable[[np.ndarray], None], key: str = SHARD) -> None:
        data = self.read(key)
        body = np.frombuffer(data[-36:-4], dtype="<u8").reshape(-1, 2).copy()
        edit(body)
        raw = body.tobytes()
        self.write(key, data[:-36] + raw + struct.pack("<I", crc(raw)), inner_chunks=2)


def make_checkpoint(root: Path) -> Hostile:
    with CheckpointEngine(str(root), plan_options=PLAN) as engine:
        engine.save(1, source_state(), blocking=True)
    hostile = Hostile(root)
    assert {SHARD, SCALAR, "model/w/c.0.0"} <= set(hostile.read_json("COMMIT")["manifest"]["keys"])
    return hostile


def source_state() -> dict[str, Any]:
    return {
        "model": {
            "w": torch.arange(32, dtype=torch.float32).reshape(8, 4),
            "v": -torch.arange(32, dtype=torch.float32).reshape(8, 4),
            "s": torch.tensor(2.5),
        },
        "step": 1,
    }


def target_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(8, 4), "s": torch.tensor(0.0)}, "step": 0}


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.__setitem__(key, value)


def _renonce(nonce: int) -> Callable[[dict[str, Any]], None]:
    """Another nonce, every manifest entry's digest bound to it (a consistent forgery)."""
    def edit(commit: dict[str, Any]) -> None:
        commit["nonce"] = nonce
        for key, (nbytes, _) in list(commit["objects"].items()):
            set_entry(commit, key, nbytes, commit["crcs"][key])
    return edit


def _sharding(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda doc: edit(doc["codecs"][0]["configuration"])


def _attrs(edit: Callable[[dict[str, Any]], None]) -> Callable[[Hostile], None]:
    return lambda h: h.edit_json("zarr.json", lambda g: edit(g["attributes"]["antifragile"]))


def _names(*names: str) -> Callable[[Hostile], None]:
    return lambda h: h.edit_index(_set("arrays", list(names)))


def _outside(h: Hostile) -> None:
    h.edit_index(_set("arrays", [str(h.dir.parent.parent / "outside" / "w")]))


def _scalar_payload(h: Hostile) -> None:
    payload = struct.pack("<ff", 1.0, 2.0)
    h.write(SCALAR, payload + struct.pack("<I", crc(payload)), inner_chunks=0)


def _empty_inner(body: np.ndarray) -> None:
    body[1] = (EMPTY, EMPTY)


def _outside_index(body: np.ndarray) -> None:
    body[1, 0] = 10**6


def _uncovered(h: Hostile) -> None:
    h.edit_array(_set("shape", [4, 4]))


def _overlap_and_gap(h: Hostile) -> None:
    """model/w made of two arrays, rows [2, 6) and [4, 8): as many elements as the tensor, but
    rows 4-5 twice and rows 0-1 never (they would keep whatever the target held)."""

    def place(offset: list[int]) -> Callable[[dict[str, Any]], None]:
        return lambda a: (a.__setitem__("shape", [4, 4]),
                          a["attributes"]["antifragile"].__setitem__("offset", offset))

    h.edit_index(_set("arrays", ["model/w", "model/v"]))
    h.edit_array(place([2, 0]))
    h.edit_array(place([4, 0]), name="model/v")


def _nested_too_deep(h: Hostile) -> None:
    """A value nested deeper than json.loads (or any walk of it) recurses."""
    doc = h.read_json("zarr.json")
    doc["attributes"]["antifragile"]["values"]["step"] = "DEEP"
    h.write("zarr.json", json.dumps(doc).encode().replace(
        b'"DEEP"', b"[" * 100_000 + b"]" * 100_000))


HOSTILE: dict[str, Callable[[Hostile], None]] = {
    "array-name-dotdot": _names("../../outside/w"),
    "array-name-absolute": _outside,
    "array-name-double-slash": _names("model//w"),
    "array-name-dot": _names("model/./w"),
    "array-name-backslash": _names("model\\..\\..\\w"),
    "array-name-nul": _names("model/w\x00"),
    "array-name-reserved": _names("model/w/zarr.json"),
    "manifest-key-dotdot": lambda h: h.edit_commit(
        lambda c: set_entry(c, "../../outside/x", 4, [0])
    ),
    "manifest-key-absolute": lambda h: h.edit_commit(lambda c: set_entry(c, "/etc/passwd", 4, [0])),
    "manifest-size-negative": lambda h: h.edit_commit(
        lambda c: set_entry(c, SHARD, -8, c["crcs"][SHARD])
    ),
    "manifest-size-huge": lambda h: h.edit_commit(
        lambda c: set_entry(c, SHARD, 2**64, c["crcs"][SHARD])
    ),
    "manifest-size-wrong": lambda h: h.edit_commit(
        lambda c: set_entry(c, SHARD, 2**40, c["crcs"][SHARD])
    ),
    # no writer makes a nonce of 2**62 or more; one of 2**63 overflowed the int64 all-reduce by
    # which the ranks of a load agree on the save (a torch error, not a CheckpointCorruptError)
    "manifest-nonce-huge": lambda h: h.edit_commit(_renonce(2**63)),
    "manifest-entry-of-another-key": lambda h: h.edit_commit(
        lambda c: (
            c["objects"].__setitem__(SHARD, c["objects"]["model/w/c.0.0"]),
            c["crcs"].__setitem__(SHARD, c["crcs"]["model/w/c.0.0"]),
        )
    ),
    "absurd-shape-many-shards": lambda h: (
        h.edit_index(_set("shape", [10**15, 4])),
        h.edit_array(_set("shape", [10**15, 4])),
    ),
    "absurd-shape-one-shard": lambda h: (
        h.edit_index(_set("shape", [10**15, 4])),
        h.edit_array(
            lambda a: (
                a.__setitem__("shape", [10**15, 4]),
                a["chunk_grid"]["configuration"].__setitem__("chunk_shape", [10**15, 4]),
            )
        ),
    ),
    "shape-negative": lambda h: h.edit_index(_set("shape", [-8, 4])),
    "shape-float": lambda h: h.edit_array(_set("shape", [8.0, 4])),
    "shape-rank": lambda h: h.edit_array(_set("shape", [8, 4, 1])),
    "dtype-unknown-in-index": lambda h: h.edit_index(_set("dtype", "float128")),
    "dtype-unknown-in-array": lambda h: h.edit_array(
        lambda a: a["attributes"]["antifragile"].__setitem__("dtype", "torch.evil")
    ),
    "data-type-disagrees": lambda h: h.edit_array(_set("data_type", "int32")),
    "codec-gzip": lambda h: h.edit_array(
        _sharding(
            _set(
                "codecs",
                [
                    {"name": "bytes", "configuration": {"endian": "little"}},
                    {"name": "gzip", "configuration": {"level": 1}},
                    {"name": "crc32c"},
                ],
            )
        )
    ),
    "codec-no-crc": lambda h: h.edit_array(
        _sharding(_set("codecs", [{"name": "bytes", "configuration": {"endian": "little"}}]))
    ),
    "codec-not-sharded": lambda h: h.edit_array(
        _set(
            "codecs", [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        )
    ),
    "codec-index-at-start": lambda h: h.edit_array(_sharding(_set("index_location", "start"))),
    "codec-scalar-not-a-list": lambda h: h.edit_array(_set("codecs", 5), name="model/s"),
    "inner-chunk-shape": lambda h: h.edit_array(_sharding(_set("chunk_shape", [3, 4]))),
    "shard-index-outside-object": lambda h: h.edit_shard_index(_outside_index),
    "shard-index-empty-chunk": lambda h: h.edit_shard_index(_empty_inner),
    "scalar-payload-size": _scalar_payload,
    "arrays-do-not-cover-tensor": _uncovered,
    "arrays-overlap-leaving-a-gap": _overlap_and_gap,
    "group-attributes-not-a-dict": lambda h: h.edit_json(
        "zarr.json", _set("attributes", ["antifragile"])
    ),
    "group-values-not-a-dict": _attrs(_set("values", ["step"])),
    "group-values-by-rank-not-a-dict": _attrs(_set("values_by_rank", {"step": [1]})),
    # what a load reads of the group's attributes for any target, so verify checks it too
    "per-rank-index-not-a-dict": _attrs(_set("per_rank", ["model/w"])),
    "per-rank-array-not-in-the-index": _attrs(_set("per_rank", {"model/w": [0]})),
    "per-rank-value-of-no-rank": _attrs(_set("values_by_rank", {"step": {"first": 1}})),
    "type-record-not-a-dict": _attrs(lambda a: a["values"].__setitem__(".types", [])),
    "type-record-does-not-fit-its-value": _attrs(
        lambda a: a["values"][".types"]["values"].__setitem__("step", ["d", [], {}])
    ),
    "tensor-entry-not-a-dict": lambda h: h.edit_json(
        "zarr.json",
        lambda g: g["attributes"]["antifragile"]["tensors"].__setitem__("model/w", "model/w"),
    ),
    "group-value-nested-too-deep": _nested_too_deep,
    "commit-not-json": lambda h: (h.dir / "COMMIT").write_bytes(b"\x80\x04\x95pickle"),
    "commit-for-another-step": lambda h: h.edit_commit(_set("step", 2)),
}

# verify checks each object against its manifest entry and that every shard is listed; it
# does not decode shard objects, so these consistent-but-hostile objects pass it.
def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def hostile_root(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "canary").write_bytes(b"must stay")
    return tmp_path / "ckpt"


# What only other zarr readers use (codecs, zarr data types): the engine reads its own format,
# with the layout from the group's index, so a load returns the saved data (every chunk is
# still checked against the manifest) and verify reports the document that lies.
DOCUMENT_ONLY = {"dtype-unknown-in-array", "data-type-disagrees", "codec-gzip", "codec-no-crc",
                 "codec-index-at-start", "codec-scalar-not-a-list"}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_load_raises_and_writes_nothing_outside(hostile_root: Path, case: str) -> None:
    hostile = make_checkpoint(hostile_root)
    HOSTILE[case](hostile)
    if not case.startswith(("commit-", "manifest-")):  # the forgery is consistent: the
        read_marker(open_storage(str(hostile_root)), 1)  # check under test decides
    outside = hostile_root.parent / "outside"
    before = tree(outside)
    engine = CheckpointEngine(str(hostile_root))
    try:
        if case in DOCUMENT_ONLY:
            target = target_state()
            assert engine.load(target, step=1) == 1
            assert torch.equal(target["model"]["w"], source_state()["model"]["w"])
            assert torch.equal(target["model"]["s"], source_state()["model"]["s"])
        else:
            with pytest.raises(CheckpointError):
                engine.load(target_state(), step=1)
            with pytest.raises(CheckpointError):
                engine.load(target_state())  # the only step: nothing older to fall back to
    finally:
        engine.close()
    assert tree(outside) == before
    assert sorted(p.name for p in hostile_root.parent.iterdir()) == ["ckpt", "outside"]


@pytest.mark.parametrize(
    "case",
    HOSTILE,
)
def test_hostile_verify_reports_not_ok(hostile_root: Path, case: str) -> None:
    hostile = make_checkpoint(hostile_root)
    HOSTILE[case](hostile)
    with CheckpointEngine(str(hostile_root)) as engine:
        report = engine.verify(1)
    assert not report.ok
    assert report.problems


@pytest.mark.parametrize("case", ["shape-float", "shape-rank", "inner-chunk-shape"])
def test_a_layout_the_group_index_gets_wrong_is_confirmed_and_quarantined(
    hostile_root: Path, case: str
) -> None:
    """An array layout in the group's index that cannot be read names zarr.json; the
    confirming re-read only checked that document's bytes against the manifest, found them
    intact, and said the damage was not confirmed: the step was skipped at every load and
    never quarantined. The re-read now checks the layouts too, as the load did."""
    hostile = make_checkpoint(hostile_root)
    HOSTILE[case](hostile)
    with CheckpointEngine(str(hostile_root)) as engine:
        with pytest.raises(CheckpointCorruptError, match="group's index"):
            engine.load(target_state())
        assert engine.steps() == []
    assert (hostile.dir / "QUARANTINE").exists()


def test_non_ascii_digits_in_names_are_damage_not_a_value_error(hostile_root: Path) -> None:
    """``str.isdigit()`` takes '²' (a digit to Unicode), which ``int()`` refuses: a manifest
    key ``.../c.1.²`` made verify raise ValueError (a traceback from ``chaos ckpt verify``),
    and a per-rank value under rank '²' failed a load with a wrapped ValueError, not as
    damage."""
    hostile = make_checkpoint(hostile_root)
    hostile.edit_commit(lambda c: set_entry(c, "model/w/c.1.²", 4, [0]))
    with CheckpointEngine(str(hostile_root)) as engine:
        report = engine.verify(1)
    assert not report.ok and [p.key for p in report.problems] == ["model/w/c.1.²"]
    _attrs(_set("values_by_rank", {"step": {"²": 1}}))(hostile)
    with CheckpointEngine(str(hostile_root)) as engine, \
            pytest.raises(CheckpointCorruptError, match="per-rank values"):
        engine.load(target_state(), step=1)


def test_quarantine_does_not_follow_a_planted_symlink(hostile_root: Path) -> None:
    """A damaged step whose QUARANTINE note is a symlink: quarantining it must not write
    through."""
    victim = hostile_root.parent / "outside" / "canary"
    with CheckpointEngine(str(hostile_root), keep_last=None, plan_options=PLAN) as engine:
        engine.save(1, source_state(), blocking=True)
        engine.save(2, source_state(), blocking=True)
        shard = hostile_root / "step_000000002" / SHARD
        data = bytearray(shard.read_bytes())
        data[0] ^= 1
        shard.write_bytes(bytes(data))
        (hostile_root / "step_000000002" / "QUARANTINE").symlink_to(victim)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(target_state()) == 1
        assert engine.steps() == [1]
    assert victim.read_bytes() == b"must stay"
    assert not (hostile_root / "step_000000002" / "QUARANTINE").is_symlink()


def _forbid(*_: Any, **__: Any) -> Any:
    raise AssertionError("something on storage was unpickled")


def test_nothing_is_ever_unpickled(hostile_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_checkpoint(hostile_root)
    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, _forbid)
    monkeypatch.setattr(torch, "load", _forbid)
    monkeypatch.setattr(np, "load", _forbid)
    target = target_state()
    with CheckpointEngine(str(hostile_root)) as engine:
        assert engine.verify(1).ok
        assert engine.load(target) == 1
        HOSTILE["commit-not-json"](Hostile(hostile_root))
        with pytest.raises(CheckpointError):
            engine.load(target_state(), step=1)
    assert torch.equal(target["model"]["w"], source_state()["model"]["w"])
    assert target["step"] == 1


# -- resource bombs, run in a child process under an address-space limit ---------------------


def _index_bomb(h: Hostile) -> None:
    """A shard whose index would be 16 GB: 10**9 inner chunks of one row; manifest says 1 TiB."""
    h.edit_array(
        lambda a: (
            a["chunk_grid"]["configuration"].__setitem__("chunk_shape", [10**9, 4]),
            _sharding(_set("chunk_shape", [1, 4]))(a),
        )
    )
    h.edit_commit(lambda c: set_entry(c, "model/w/c.0.0", 2**40, c["crcs"]["model/w/c.0.0"]))


def _verify_grid_bomb(h: Hostile) -> None:
    """10**8 shards (under the engine's cap), none of them in the manifest."""
    h.edit_index(_set("shape", [10**15, 4]))
    h.edit_array(
        lambda a: (
            a.__setitem__("shape", [10**15, 4]),
            a["chunk_grid"]["configuration"].__setitem__("chunk_shape", [10**7, 4]),
        )
    )


def _load_grid_bomb(h: Hostile) -> None:
    """A 2 * 10**6-row tensor declared as 2 * 10**6 one-row shards, two of them present."""
    h.edit_index(_set("shape", [2 * 10**6, 4]))
    h.edit_array(
        lambda a: (
            a.__setitem__("shape", [2 * 10**6, 4]),
            a["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1, 4]),
            _sharding(_set("chunk_shape", [1, 4]))(a),
        )
    )


# storage did not fail: the checkpoint is refused (a StorageError here would be a MemoryError
# retried by the storage layer, i.e. the huge allocation was attempted)
REFUSED = {"CheckpointCorruptError", "CheckpointMismatchError"}

BOMBS: dict[str, tuple[Callable[[Hostile], None], list[int]]] = {
    "index-bomb": (_index_bomb, [8, 4]),
    "verify-grid-bomb": (_verify_grid_bomb, [8, 4]),
    "load-grid-bomb": (_load_grid_bomb, [2 * 10**6, 4]),
}

_CHILD = textwrap.dedent("""
    import json, resource, sys, time, warnings
    import torch
    from antifragile.engine import CheckpointEngine
    vm_kib = int(next(line for line in open("/proc/self/status")
                      if line.startswith("VmSize")).split()[1])
    limit = vm_kib * 1024 + 3 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    results = {}
    for name, root, shape in json.loads(sys.argv[1]):
        out = {}
        with CheckpointEngine(root) as engine:
            start = time.monotonic()
            try:
                engine.load({"model": {"w": torch.zeros(shape), "s": torch.tensor(0.0)},
                             "step": 0}, step=1)
                out["load"] = "no error"
            except BaseException as exc:
                out["load"] = f"{type(exc).__name__}: {exc}"[:200]
            out["load_s"] = time.monotonic() - start
            start = time.monotonic()
            try:
                out["verify_ok"] = engine.verify(1).ok
            except BaseException as exc:
                out["verify_ok"] = f"{type(exc).__name__}: {exc}"[:200]
            out["verify_s"] = time.monotonic() - start
        results[name] = out
    print(json.dumps(results))
""")


def test_resource_bombs_fail_fast_within_a_memory_limit(tmp_path: Path) -> None:
    cases = []
    for name, (bomb, shape) in BOMBS.items():
        root = tmp_path / name
        bomb(make_checkpoint(root))
        cases.append([name, str(root), shape])
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.splitlines()[-1])
    for name, out in results.items():
        assert out["load"].split(":")[0] in REFUSED, (name, out)
        assert out["verify_ok"] is False, (name, out)
        assert out["load_s"] < 10 and out["verify_s"] < 10, (name, out)


def test_an_array_document_a_load_refuses_is_confirmed_and_quarantined(
        hostile_root: Path) -> None:
    """A checkpoint of an earlier version records no layouts in the group's index: a load
    reads each array's zarr.json, and one whose intact bytes describe an array the load
    refuses (here a dtype that disagrees with the tensor index) names that document. The
    confirming re-read only checked the document's bytes against the manifest, found them
    intact, and the step was skipped at every load and never quarantined."""
    hostile = make_checkpoint(hostile_root)

    def earlier_version(group: dict[str, Any]) -> None:
        for entry in group["attributes"]["antifragile"]["tensors"].values():
            del entry["array_layout"]

    hostile.edit_json("zarr.json", earlier_version)
    hostile.edit_json("model/w/zarr.json",
                      lambda a: a["attributes"]["antifragile"].__setitem__("dtype", "float64"))
    with CheckpointEngine(str(hostile_root)) as engine:
        with pytest.raises(CheckpointCorruptError, match="dtype disagrees"):
            engine.load(target_state())
        assert engine.steps() == []
    assert (hostile.dir / "QUARANTINE").exists()


def _columns_of(**change: Any) -> dict[str, Any]:
    from antifragile.engine import _format

    manifest = _format.Manifest(7)
    manifest.add("a/c.0", 12, [1, 2])
    manifest.add("b/c", 8, [3])
    return {"nonce": 7, "manifest": {**manifest.columns(), **change}}


@pytest.mark.parametrize("change", [
    {"keys": ["a/c.0", 5]}, {"keys": ["a/c.0", "a/c.0"]}, {"keys": ["a/c.0"]},
    {"parts": [2, 1.0]}, {"parts": [3, -1]}, {"parts": [2, True]}, {"parts": [2, 2]},
    {"crcs": {"a": 1}}, {"sizes": None},
], ids=["key-not-str", "key-twice", "keys-short", "part-count-float", "part-count-negative",
        "part-count-bool", "parts-past-crcs", "crcs-not-list", "sizes-missing"])
def test_a_malformed_columnar_manifest_is_refused_as_damage(change: dict[str, Any]) -> None:
    """A COMMIT of format 5 lists its manifest as columns: columns that do not fit together
    are damage, refused with the document's name, never a TypeError or a wrong entry."""
    from antifragile.engine import _format

    assert _format.parse_manifest(_columns_of(), where="COMMIT").entry(
        "a/c.0", where="a") == (12, [1, 2])
    with pytest.raises(CheckpointCorruptError, match="COMMIT: malformed manifest"):
        _format.parse_manifest(_columns_of(**change), where="COMMIT", lazy=True)


def test_a_columnar_entry_is_checked_against_its_digest_where_it_is_used() -> None:
    from antifragile.engine import _format

    doc = _columns_of()
    doc["manifest"]["sizes"][0] += 1  # a's entry no longer matches its digest; b's still does
    manifest = _format.parse_manifest(doc, where="COMMIT", lazy=True)
    assert manifest.entry("b/c", where="b") == (8, [3])
    with pytest.raises(CheckpointCorruptError, match="does not match its digest"):
        manifest.entry("a/c.0", where="a")
    with pytest.raises(CheckpointCorruptError, match="does not match its digest"):
        _format.parse_manifest(doc, where="COMMIT")


@pytest.mark.parametrize("data", [
    b'{"a": 1,"crc32c":123}', b'{"a": 1,"crc32c":123}\n \t\r\x0b\x0c',
    b'{"a": 1,"crc32c":123} x', b'{"a": 1,"crc32c":12345678901}', b'{"crc32c":1}',
    b'{"a": "x,\\"crc32c\\":1}","b": 2}', b'', b' ' * 100, b'{"a": 1,"crc32c":9}' + b' ' * 40,
    b'{"a": 1,"crc32c":4294967295}'])
def test_the_seal_is_looked_for_at_the_end_as_the_whole_search_finds_it(data: bytes) -> None:
    """The seal's search reads the document's last bytes only (it scanned a whole COMMIT, 96 MB
    at 4,096 ranks); it finds what a search from the start finds."""
    from antifragile.engine import _format

    whole = _format._SEAL.search(data)
    tail = _format._find_seal(data)
    assert (whole and (whole.span(), whole.group(1))) == (tail and (tail.span(), tail.group(1)))
