"""The engine's per-save work at many ranks, driven with synthetic inventories, plans and
records on an in-memory storage (no processes): what rank 0 reads to commit, what every other
rank reads and how often it asks while it waits, what every rank computes to plan; and what
every rank computes to plan its reads of a load."""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
import weakref
from typing import Any
from unittest import mock

import pytest
import torch

from antifragile.engine import _format
from antifragile.engine import commit as commit_module
from antifragile.engine._format import Manifest
from antifragile.engine._paths import record_key, step_dir
from antifragile.engine._ranks import PerRank
from antifragile.engine._state import FlatState
from antifragile.engine.commit import (
    coordinate,
    metadata_owners,
    read_commit,
    read_marker,
    wait_for_commit,
)
from antifragile.engine.errors import (
    CheckpointCommittedError,
    CheckpointCorruptError,
    CheckpointError,
    CommitTimeoutError,
)
from antifragile.engine.load import StepReader
from antifragile.engine.persist import group_layout, rank_record
from antifragile.engine.plan import GlobalPlan, HeldBox, build_plan
from bench.load_metadata import MemoryStorage  # the benchmark's: a dict of objects


def sharded_plan(world: int, tensors: int = 4) -> GlobalPlan:
    """``tensors`` tensors of ``world`` x 8 rows, each rank holding one row block of each."""
    inventories = [{"tensors": {f"model/t{i}": {"dtype": "float32", "shape": [world * 8, 8],
                                                "boxes": [[[r * 8, 0], [8, 8], [0, 0]]]}
                                for i in range(tensors)},
                    "values": ["step"]} for r in range(world)]
    return build_plan(inventories)


def write_records(storage: MemoryStorage, plan: GlobalPlan, step: int, nonce: int,
                  docs: set[str]) -> None:
    owners = metadata_owners(plan, docs)
    for rank in range(plan.world_size):
        manifest = Manifest(nonce)
        for write in plan.writes[rank]:
            manifest.add(write.key, write.nbytes + 16, [1, 2])
        for key in sorted(k for k, o in owners.items() if o == rank):
            manifest.add_document(key, b"{}")
        storage.write(record_key(step, rank), [_format.seal(rank_record(
            step=step, rank=rank, plan_id=plan.plan_id, nonce=nonce, manifest=manifest,
            values={"step": step}))])


class RecordBarrier(MemoryStorage):
    """Holds each read of a rank's record until ``width`` of them are in flight together: a
    coordinator that reads the records one at a time never brings a second one, so the
    barrier breaks (after its timeout) and ``serial`` says so."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(width, timeout=5)
        self.serial = False
        self.record_reads = 0

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if "/.ranks/" in key:
            with self.lock:
                self.record_reads += 1
                held = self.record_reads <= self.barrier.parties
            if held and not self.serial:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    self.serial = True
        return super().read(key, start, end)


def test_the_coordinator_reads_the_records_concurrently() -> None:
    """Rank 0 reads every rank's record: one at a time, 16,384 GETs of ~20 ms on S3 took
    over 5 minutes, longer than any commit deadline."""
    plan = sharded_plan(64)
    storage = RecordBarrier(8)
    write_records(storage, plan, 1, 7, set())
    coordinate(storage, plan=plan, step=1, nonce=7, deadline=time.monotonic() + 60,
               group_attrs={}, owners={})
    assert storage.record_reads == 64, storage.record_reads  # each record read once
    assert not storage.serial, "the coordinator read the ranks' records one at a time"
    assert f"{step_dir(1)}/COMMIT" in storage.objects


class Tracked(dict[str, Any]):
    """A record's manifest maps, which a test can see go (a plain dict has no weak reference)."""


def test_the_coordinator_keeps_no_record_once_it_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 kept every parsed record (each rank's objects and CRCs as JSON maps) and every
    rank's manifest beside the merged one until the COMMIT (28 MB of 139 MB at 4,096 ranks).
    What the commit needs of a record once it is checked is its values and requests."""
    parse = commit_module.parse_record
    alive: list[weakref.ref[Tracked]] = []

    def tracked(data: bytes, *, where: str) -> dict[str, Any]:
        record = parse(data, where=where)
        for name in ("objects", "crcs"):
            record[name] = Tracked(record[name])
            alive.append(weakref.ref(record[name]))
        return record

    monkeypatch.setattr(commit_module, "parse_record", tracked)
    plan = sharded_plan(32)
    storage = MemoryStorage()
    write_records(storage, plan, 1, 7, set())
    held: list[int] = []

    def before_commit() -> None:
        gc.collect()
        held.append(sum(ref() is not None for ref in alive))

    coordinate(storage, plan=plan, step=1, nonce=7, deadline=time.monotonic() + 60,
               group_attrs={}, owners={}, before_commit=before_commit)
    assert len(alive) == 2 * 32
    assert held[0] <= 2, f"{held[0] // 2} of 32 records kept until the COMMIT"  # the last read
    marker, manifest = read_marker(storage, 1)
    assert marker["requests"] == {str(r): 0 for r in range(32)}
    assert len(manifest.objects) == 1 + sum(len(plan.keys_of(r)) for r in range(32))  # + zarr.json
    group = json.loads(storage.objects[f"{step_dir(1)}/zarr.json"])
    assert group["attributes"]["antifragile"]["values"] == {"step": 1}


def committed(world: int, tensors: int) -> tuple[MemoryStorage, GlobalPlan]:
    plan = sharded_plan(world, tensors)
    storage = MemoryStorage()
    write_records(storage, plan, 1, 7, set())
    coordinate(storage, plan=plan, step=1, nonce=7, deadline=time.monotonic() + 60,
               group_attrs={}, owners={})
    return storage, plan


def test_a_waiting_rank_reads_a_bounded_head_of_a_large_commit_marker() -> None:
    """The marker lists every object of the step: at 16,384 ranks ~100 MB, which every other
    rank read whole (and checked every entry of) at every save just to see its nonce."""
    storage, _ = committed(64, 120)  # 7,680 objects
    marker_key = f"{step_dir(1)}/COMMIT"
    size = len(storage.objects[marker_key])
    assert size > 4 * 2**16, size  # ~350 KB
    counter = MemoryStorage()  # counts the bytes read of each key
    counter.objects = dict(storage.objects)
    nbytes = wait_for_commit(counter, step=1, nonce=7, deadline=time.monotonic() + 60,
                             world_size=64)
    assert nbytes == read_commit(storage, 1)["nbytes"] > 0
    assert counter.bytes_read[marker_key] <= 2**16, (counter.bytes_read, size)


@pytest.mark.parametrize("tensors", [1, 40], ids=["small-marker", "large-marker"])
def test_a_waiting_rank_takes_no_marker_of_another_save_and_says_so_at_once(
        tensors: int) -> None:
    """Another save's COMMIT of the step (two jobs at one URL) ends this save: the
    coordinator's create of its own is refused (CheckpointCommittedError) and it writes no
    ABORT into a committed step, so the waiting ranks waited out the commit deadline (600 s
    by default) and then blamed the coordinator ("no COMMIT from the coordinator"). They
    refuse at once now, as the coordinator does; the COMMIT is not taken as theirs."""
    storage, _ = committed(64, tensors)
    began = time.monotonic()
    with pytest.raises(CheckpointCommittedError, match="step 1 was committed by another save"):
        wait_for_commit(storage, step=1, nonce=8, deadline=time.monotonic() + 30,
                        world_size=64)
    assert time.monotonic() - began < 15
    with pytest.raises(CommitTimeoutError):  # one that says it is another step's: damage
        wait_for_commit(storage, step=2, nonce=7, deadline=time.monotonic() + 0.2,
                        world_size=64)


def test_renaming_the_per_rank_paths_copies_no_other_entry() -> None:
    """``PerRank.plan_inventories`` deep-copied every rank's inventory to rename a few paths:
    4.8 s at 1,024 ranks of 63 tensors, more than the plan built from them, on every rank."""
    world = 16
    inventories = [{"tensors": {
        "model/w": {"dtype": "float32", "shape": [world, 4],
                    "boxes": [[[r, 0], [1, 4], [0, 0]]]},
        "rng": {"dtype": "uint8", "shape": [8], "boxes": [[[0], [8], [0]]]}},
        "values": ["step"], "plain": ["rng"]} for r in range(world)]
    per_rank = PerRank(inventories, 0, sticky=["rng"])
    renamed = per_rank.plan_inventories()
    for r, (inv, out) in enumerate(zip(inventories, renamed)):
        assert set(out["tensors"]) == {"model/w", f"rng/rank_{r}"}
        assert out["tensors"]["model/w"] is inv["tensors"]["model/w"]  # shared, not copied
        assert out["tensors"][f"rng/rank_{r}"] is inv["tensors"]["rng"]
        assert set(inv["tensors"]) == {"model/w", "rng"}  # the gathered ones stay as they were
    plan = build_plan(renamed)
    assert sorted(k for ws in plan.writes.values() for k in (w.array.name for w in ws)
                  if k.startswith("rng")) == sorted(f"rng/rank_{r}" for r in range(world))


class CountedNames(dict[str, Any]):
    """A rank's tensors, counting the passes over their names."""

    passes = 0

    def __iter__(self) -> Any:
        self.passes += 1
        return super().__iter__()


def test_the_per_rank_paths_are_checked_in_one_pass_over_each_ranks_names() -> None:
    """``PerRank._check_names`` went over every rank's names once per per-rank path (0.17 s
    at 4,096 ranks with a single one, on every rank at each replan)."""
    world, sticky = 8, [f"rng{i}" for i in range(6)]
    inventories = [{"tensors": CountedNames(
        {"model/w": {"dtype": "float32", "shape": [world, 4], "boxes": [[[r, 0], [1, 4], [0, 0]]]}}
        | {p: {"dtype": "uint8", "shape": [8], "boxes": [[[0], [8], [0]]]} for p in sticky}),
        "values": ["step", "loader/offset"], "plain": sticky} for r in range(world)]
    per_rank = PerRank(inventories, 0, sticky=sticky)
    assert per_rank.paths == set(sticky)
    for inv in inventories:
        inv["tensors"].passes = 0
    per_rank._check_names()
    assert [inv["tensors"].passes for inv in inventories] == [1] * world
    inventories[3]["values"].append("rng4/seed")  # a name under a per-rank path still clashes
    with pytest.raises(CheckpointError, match="'rng4/seed'"):
        per_rank._check_names()
    inventories[3]["values"][-1] = "rng4.seed"  # and one that only begins the same does not
    per_rank._check_names()


def polls_per_second(world: int, seconds: int = 120) -> list[int]:
    """The whole job's polls of the step folder in each second, every rank beginning to wait
    at once (their writes ended together), their jitter spread evenly over the ranks."""
    counts = [0] * seconds
    step = max(1, world // 256)  # a sample of the ranks, each counted for ``step``
    for rank in range(0, world, step):
        quantile = (rank + 0.5) / world
        with mock.patch.object(commit_module.random, "uniform",
                               lambda a, b, q=quantile: a + (b - a) * q):
            delays = commit_module._poll_delays(world)
            t = next(delays)  # wait_for_commit pauses before its first look
            while t < seconds:
                counts[int(t)] += step
                t += next(delays)
    return counts


def test_the_waiting_ranks_poll_under_the_request_rate_of_one_s3_prefix() -> None:
    """S3 serves ~5,500 GET/s per prefix (and the coordinator's requests go to the same one):
    every rank starting at 10 ms sent 16,384 ranks' ~160,000 polls in their first second, and a
    5 s cap left them at ~3,300 a second for as long as they waited."""
    for world in (64, 1024, 4096, 16384):
        counts = polls_per_second(world)
        assert max(counts) <= 2200, (world, max(counts))
        assert sum(counts[-60:]) / 60 <= 600, (world, sum(counts[-60:]) / 60)
    assert polls_per_second(2)[0] >= 40, "a small job still polls every few tens of ms"


class CountedOffset(tuple[int, ...]):
    """An array's offset, counting the looks at it (``reads[0]``)."""

    reads = [0]

    def __iter__(self) -> Any:
        self.reads[0] += 1
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        self.reads[0] += 1
        return super().__getitem__(index)


def test_planning_a_read_looks_at_each_piece_of_an_uneven_tensor_a_bounded_number_of_times(
        ) -> None:
    """A layout without a regular grid (FSDP inside vocab-parallel TP, a prime number of rows
    per shard) is stored as one array per box: 512 of them for each of an embedding's three
    tensors at 4,096 ranks of tp 8 and pp 8. ``arrays_of`` compared every pair of them for
    overlap, on every read planned of such a tensor: O(boxes^2), 0.18 s a call at 512 pieces,
    7.4 s at 4,096 (one tensor over 4,096 ranks without pp), on every rank holding it."""
    world = 300
    rows = [97 if r % 2 else 101 for r in range(world)]  # no common divisor: no regular grid
    starts = [sum(rows[:r]) for r in range(world)]
    inventories = [{"tensors": {"model/emb": {
        "dtype": "float32", "shape": [sum(rows), 4],
        "boxes": [[[starts[r], 0], [rows[r], 4], [0, 0]]]}}, "values": []}
        for r in range(world)]
    plan = build_plan(inventories)
    assert len(plan.tensors["model/emb"].arrays) == world
    storage = MemoryStorage()
    write_records(storage, plan, 1, 7, set())
    layout = group_layout(plan, FlatState({}, {}), world, {})
    coordinate(storage, plan=plan, step=1, nonce=7, deadline=time.monotonic() + 60,
               group_attrs={"tensors": layout["tensors"]}, owners={})
    reader = StepReader(storage, 1)
    stored = reader.tensors["model/emb"]
    for name in stored.arrays:
        spec = reader.array(name, stored)
        reader._arrays[name] = dataclasses.replace(spec, offset=CountedOffset(spec.offset))
    CountedOffset.reads[0] = 0
    rank = world // 2
    out = torch.empty(rows[rank], 4)
    reads = reader.read_box(stored, HeldBox((starts[rank], 0), (rows[rank], 4), (0, 0)), out)
    assert len(reads) == 1
    assert CountedOffset.reads[0] <= 10 * world, CountedOffset.reads[0]
    overlapping = dataclasses.replace(reader._arrays[stored.arrays[-1]],
                                      offset=(starts[5] + 1, 0))  # one row into the 6th piece
    reader._arrays[stored.arrays[-1]] = overlapping
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        reader.read_box(stored, HeldBox((starts[rank], 0), (rows[rank], 4), (0, 0)), out)
