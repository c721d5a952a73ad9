"""``build_plan`` gives the same plan as the straightforward one it replaced.

Every rank builds the plan and ranks compare it by ``plan_id``; a committed step is checked
against it on a resave, and the objects a rank writes are the cells it assigns. So a faster
``build_plan`` must keep its result exactly: the owner of every cell, every ``CellWrite``
field, each rank's keys, the arrays and ``plan_id``. ``reference_plan`` below is the
per-cell implementation (a ``min`` over the holders for every cell), kept here as the
definition the fast path is checked against, on the synthetic dp x tp x pp inventories of
``bench.load_metadata`` and on small layouts (uneven shards, replicas, 0-d tensors, pieces).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
from collections.abc import Sequence
from itertools import product

import pytest
import torch
from hypothesis import given, settings
from torch.distributed.tensor import Replicate, Shard

from antifragile.engine._ranks import PerRank
from antifragile.engine.commit import metadata_owners
from antifragile.engine.errors import CheckpointError
from antifragile.engine.plan import (
    ArraySpec,
    CellWrite,
    GlobalPlan,
    PlanOptions,
    TensorSpec,
    _arrays_for,
    _check_coverage,
    _lattice,
    _regular_grid,
    build_plan,
)
from bench.load_metadata import inventories as synthetic_inventories
from tests.test_placements import TINY, Layout, State, plan_options, states
from tests.test_placements import inventories as layout_inventories

DEFAULT = PlanOptions()


def reference_plan(inventories: Sequence[dict], options: PlanOptions = DEFAULT
                   ) -> tuple[dict[str, TensorSpec], dict[str, list[int]],
                              dict[int, list[CellWrite]], str]:
    """The plan's tensors, values, writes per rank and id, one cell at a time."""
    world = len(inventories)
    held: dict[str, dict[tuple, list[tuple[int, tuple[int, ...]]]]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    values: dict[str, list[int]] = {}
    for rank, inv in enumerate(inventories):
        for path in inv["values"]:
            values.setdefault(path, []).append(rank)
        for path, entry in inv["tensors"].items():
            meta.setdefault(path, (entry["dtype"], tuple(entry["shape"])))
            for offset, box_shape, local_offset in entry["boxes"]:
                held.setdefault(path, {}).setdefault((tuple(offset), tuple(box_shape)), []).append(
                    (rank, tuple(local_offset)))
    tensors: dict[str, TensorSpec] = {}
    writes: dict[int, list[CellWrite]] = {r: [] for r in range(world)}
    written = [0] * world
    for path in sorted(meta):
        dtype, shape = meta[path]
        itemsize = getattr(torch, dtype).itemsize
        boxes = held.get(path, {})
        _check_coverage(path, shape, boxes)
        arrays = _arrays_for(path, dtype, shape, itemsize, boxes, options)
        tensors[path] = TensorSpec(path, dtype, shape, tuple(a for a, _ in arrays))
        for array, array_boxes in arrays:
            _reference_assign(writes, array, itemsize, array_boxes, written)
    plan_id = hashlib.sha256(json.dumps(list(inventories), sort_keys=True).encode()).hexdigest()
    return tensors, values, writes, plan_id[:16]


def _reference_assign(writes: dict[int, list[CellWrite]], array: ArraySpec, itemsize: int,
                      boxes: dict, written: list[int]) -> None:
    shard = array.shard_shape
    for (offset, box_shape), holders in sorted(boxes.items()):
        rel = tuple(o - a for o, a in zip(offset, array.offset))
        ranges = [range(r // c, math.ceil((r + s) / c)) for r, s, c in zip(rel, box_shape, shard)]
        for cell in product(*ranges):
            start = tuple(i * c for i, c in zip(cell, shard))
            valid = tuple(min(c, n - s) for c, n, s in zip(shard, array.shape, start))
            nbytes = math.prod(valid) * itemsize
            rank, local = min(holders, key=lambda h: (written[h[0]], h[0]))
            written[rank] += max(nbytes, 1)
            writes[rank].append(CellWrite(
                array=array,
                cell=tuple(cell),
                key=f"{array.name}/c" + "".join(f"{array.separator}{i}" for i in cell),
                valid_shape=valid,
                local_offset=tuple(lo + s - r for lo, s, r in zip(local, start, rel)),
                nbytes=nbytes,
            ))


def assert_same_plan(inventories: Sequence[dict], options: PlanOptions = DEFAULT) -> None:
    tensors, values, writes, plan_id = reference_plan(inventories, options)
    plan = build_plan(inventories, options)
    assert plan.world_size == len(inventories)
    assert plan.plan_id == plan_id
    assert plan.tensors == tensors
    assert plan.values == values
    assert sorted(plan.writes) == sorted(writes)
    # keys and counts first, as the coordinator and ``metadata_owners`` ask, before any write
    for rank, expected in writes.items():
        assert plan.keys_of(rank) == {w.key for w in expected}, rank
    owners = metadata_owners(plan, {f"doc{i}" for i in range(len(inventories) + 3)})
    by_count = [(len(writes[r]), r) for r in range(len(inventories))]
    for key in sorted(owners):
        count, rank = min(by_count)
        assert owners[key] == rank, key
        by_count[rank] = (count + 1, rank)
    for rank, expected in writes.items():
        assert plan.writes[rank] == expected, rank
    assert dict(plan.writes.items()) == writes


@pytest.mark.parametrize(("world", "params"), [(4, 2), (8, 3), (64, 5), (512, 2)])
def test_synthetic_layouts_plan_as_the_reference(world: int, params: int) -> None:
    """dp x tp x pp blocks, replicated 0-d steps per stage, an uneven embedding stored as
    pieces, per-rank (renamed) generator states."""
    per_rank = PerRank(synthetic_inventories(world, params), 0, sticky=["rng"])
    assert_same_plan(per_rank.plan_inventories())


@pytest.mark.parametrize("options", [PlanOptions(), TINY,
                                     PlanOptions(max_object_bytes=8, min_split_bytes=1)])
def test_small_layouts_plan_as_the_reference(options: PlanOptions) -> None:
    state: State = {
        "uneven": Layout((7, 5), (4,), (Shard(0),), torch.float32),
        "cols": Layout((5, 7), (4,), (Shard(1),), torch.float32),
        "replicated": Layout((64, 16), (4,), (Replicate(),), torch.float32),
        "hybrid": Layout((2 * 101, 4), (2, 2), (Replicate(), Shard(0))),
        "pieces": Layout((102, 3), (2, 2), (Shard(0), Shard(0)), torch.bfloat16),
        "scalar": Layout((), (4,), (Replicate(),)),
        "lone": Layout((), (1,), (Replicate(),)),
        "empty": Layout((0, 3), (4,), (Shard(0),)),
        "short": Layout((5, 3), (4,), (Shard(0),), torch.uint8),
    }
    invs = layout_inventories(state, 4)
    for rank, inv in enumerate(invs):
        inv["values"] = ["train/step"] + (["loader/offset"] if rank % 2 else [])
    assert_same_plan(invs, options)


def test_a_rank_listed_twice_for_one_box_plans_as_the_reference() -> None:
    """A holder list with one rank twice (two local copies of one box) and replicas that
    differ in how much they have written already: owners still match the reference's."""
    whole = [[0, 0], [16, 4], [0, 0]]
    invs = [{"tensors": {"a": {"dtype": "float32", "shape": [16, 4], "boxes": [whole]},
                         "b": {"dtype": "float32", "shape": [16, 4],
                               "boxes": [whole, [[0, 0], [16, 4], [16, 0]]] if r == 1
                               else [whole]}},
             "values": []} for r in range(3)]
    invs[2]["tensors"]["c"] = {"dtype": "int64", "shape": [3], "boxes": [[[0], [3], [0]]]}
    assert_same_plan(invs, PlanOptions(max_object_bytes=16, min_split_bytes=1))


@settings(max_examples=100, deadline=None)
@given(states(), plan_options)
def test_random_layouts_plan_as_the_reference(state: State, options: PlanOptions) -> None:
    world = max(layout.world_size for layout in state.values())
    assert_same_plan(layout_inventories(state, world), options)


def test_plan_is_a_global_plan() -> None:
    plan = build_plan(layout_inventories({"w": Layout((4,), (2,), (Shard(0),))}, 2))
    assert isinstance(plan, GlobalPlan)
    assert plan.writes.get(5, []) == [] and 5 not in plan.writes


@pytest.mark.parametrize("enabled", [True, False])
def test_build_plan_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    """``build_plan`` pauses the collector while it runs, and gives it back as it was, also
    when it refuses the inventories."""
    good = layout_inventories({"w": Layout((4,), (2,), (Shard(0),))}, 2)
    bad = [{"tensors": {"w": {"dtype": dtype, "shape": [4], "boxes": [[[0], [4], [0]]]}},
            "values": []} for dtype in ("float32", "int64")]
    try:
        (gc.enable if enabled else gc.disable)()
        build_plan(good)
        assert gc.isenabled() == enabled
        with pytest.raises(CheckpointError, match="rank 1 holds int64"):
            build_plan(bad)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_a_lattice_of_boxes_is_seen_and_anything_else_is_checked_the_long_way() -> None:
    """``_lattice`` (which skips the overlap grid and ``_regular_grid``) takes even shards and
    short edge shards, and refuses shards of different layouts, misaligned or out of bounds."""
    shape = (10, 8)
    even = {((r, c), (min(4, 10 - r), 4)): [] for r in (0, 4, 8) for c in (0, 4)}
    assert _lattice(shape, even) == (4, 4) == _regular_grid(shape, even)
    assert _lattice((), {((), ()): []}) == ()
    two_layouts = {((0, 0), (5, 8)): [], ((5, 0), (5, 8)): [], ((0, 0), (10, 4)): []}
    misaligned = {((0, 0), (4, 8)): [], ((3, 0), (4, 8)): [], ((7, 0), (3, 8)): []}
    outside = {**even, ((12, 0), (4, 4)): []}
    for boxes in (two_layouts, misaligned, outside, {}):
        assert _lattice(shape, boxes) is None
    with pytest.raises(CheckpointError, match="overlap"):
        _check_coverage("w", shape, two_layouts)
