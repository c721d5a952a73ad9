"""Planning without processes: which elements a DTensor holds, and who writes which object.

``placement_boxes`` is checked against torch's own sharding code: ``distribute_tensor`` of an
``arange`` on a single-rank view of the mesh (``DeviceMesh(..., _rank=r)``, no process group,
``src_data_rank=None`` so torch only splits locally) shows exactly which global elements rank
``r`` holds and in which local order. ``build_plan`` is checked by replaying every planned write
against those local tensors: every element of every tensor must be written exactly once, with
the right value, by a rank that holds it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from antifragile.engine.errors import CheckpointError
from antifragile.engine.plan import GlobalPlan, PlanOptions, build_plan, placement_boxes

TINY = PlanOptions(max_object_bytes=64, min_split_bytes=16, inner_chunk_bytes=16)


@dataclass(frozen=True)
class Layout:
    """A global tensor of ``shape`` sharded over a mesh of ``mesh_shape`` (ranks in C order)."""

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    dtype: torch.dtype = torch.int64

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)


def global_tensor(layout: Layout) -> torch.Tensor:
    """``arange`` of the layout's shape: every element's value is its flat global index."""
    return torch.arange(math.prod(layout.shape), dtype=torch.int64).reshape(layout.shape)


@functools.lru_cache(maxsize=4096)
def torch_local(layout: Layout, rank: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor torch gives ``rank`` of ``global_tensor(layout)``, and its coordinate."""
    mesh = DeviceMesh(
        "cpu",
        torch.arange(layout.world_size).reshape(layout.mesh_shape),
        _init_backend=False,
        _rank=rank,
    )
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = distribute_tensor(
        global_tensor(layout), mesh, list(layout.placements), src_data_rank=None
    ).to_local()
    return local, tuple(coordinate)


def region(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


# --- strategies -----------------------------------------------------------------------------


def placement_for(ndim: int) -> st.SearchStrategy[Placement]:
    if ndim == 0:
        return st.just(Replicate())
    dims = st.integers(0, ndim - 1)
    return st.one_of(
        st.just(Replicate()),
        dims.map(Shard),
        st.tuples(dims, st.integers(2, 4)).map(lambda d: _StridedShard(d[0], split_factor=d[1])),
    )


@st.composite
def layouts(
    draw: st.DrawFn,
    mesh_shape: tuple[int, ...] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.int64,),
) -> Layout:
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=0, max_size=3)))
    if mesh_shape is None:
        mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = tuple(draw(placement_for(len(shape))) for _ in mesh_shape)
    return Layout(shape, mesh_shape, placements, draw(st.sampled_from(dtypes)))


# --- placement_boxes agrees with torch ------------------------------------------------------


def assert_boxes_match_torch(layout: Layout, rank: int) -> None:
    local, coordinate = torch_local(layout, rank)
    boxes = placement_boxes(layout.shape, layout.mesh_shape, coordinate, layout.placements)
    full = global_tensor(layout)
    rebuilt = torch.full(local.shape, -1, dtype=torch.int64)
    hits = torch.zeros(local.shape, dtype=torch.int64)
    for box in boxes:
        assert all(o + n <= s for o, n, s in zip(box.offset, box.shape, layout.shape)), box
        assert all(o + n <= s for o, n, s in zip(box.local_offset, box.shape, local.shape)), box
        rebuilt[region(box.local_offset, box.shape)] = full[region(box.offset, box.shape)]
        hits[region(box.local_offset, box.shape)] += 1
    where = f"{layout} rank {rank}: boxes {boxes}"
    assert bool((hits == 1).all()), f"{where} cover the local tensor unevenly: {hits.tolist()}"
    assert torch.equal(rebuilt, local), f"{where} give {rebuilt.tolist()}, torch {local.tolist()}"


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_placement_boxes_agree_with_torch(layout: Layout) -> None:
    for rank in range(layout.world_size):
        assert_boxes_match_torch(layout, rank)


@pytest.mark.parametrize(
    "layout",
    [
        Layout((9, 2), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 + TP, uneven
        Layout((8, 6), (2, 2), (_StridedShard(1, split_factor=2), Shard(1))),
        Layout((10,), (2, 2), (Shard(0), Shard(0))),  # nested uneven: 3, 2, 3, 2
        Layout((5, 3), (4,), (Shard(0),)),  # torch.chunk leaves the last rank empty
        Layout(
            (13, 7), (2, 3), (_StridedShard(0, split_factor=3), _StridedShard(0, split_factor=2))
        ),
        Layout((), (2, 2), (Replicate(), Replicate())),
        Layout((0, 4), (3,), (Shard(0),)),
    ],
    ids=repr,
)
def test_placement_boxes_known_layouts(layout: Layout) -> None:
    for rank in range(layout.world_size):
        assert_boxes_match_torch(layout, rank)


def test_strided_shard_is_the_fsdp2_tp_order() -> None:
    """FSDP2 on dp over TP on tp puts rows 0-2 | 5-6 on dp=0 and 3-4 | 7-8 on dp=1."""
    layout = Layout((9, 2), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    rows = {
        c: [
            (b.offset[0], b.offset[0] + b.shape[0])
            for b in placement_boxes(layout.shape, layout.mesh_shape, c, layout.placements)
        ]
        for c in [(0, 0), (0, 1), (1, 0), (1, 1)]
    }
    assert rows == {(0, 0): [(0, 3)], (0, 1): [(5, 7)], (1, 0): [(3, 5)], (1, 1): [(7, 9)]}


def test_partial_placement_is_refused() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(CheckpointError, match="Partial"):
        placement_boxes((4,), (2,), (0,), (Partial(),))


# --- build_plan -----------------------------------------------------------------------------


State = dict[str, Layout]


def inventories(state: State, world_size: int) -> list[dict]:
    """Each rank's inventory, as the engine builds it, from torch's own local tensors."""
    invs: list[dict] = [{"tensors": {}, "values": []} for _ in range(world_size)]
    for path, layout in state.items():
        for rank in range(layout.world_size):
            _, coordinate = torch_local(layout, rank)
            boxes = placement_boxes(layout.shape, layout.mesh_shape, coordinate, layout.placements)
            invs[rank]["tensors"][path] = {
                "dtype": str(layout.dtype).removeprefix("torch."),
                "shape": list(layout.shape),
                "boxes": [[list(b.offset), list(b.shape), list(b.local_offset)] for b in boxes],
            }
    return invs


def plan_for(state: State, options: PlanOptions | None = None) -> GlobalPlan:
    world = max(layout.world_size for layout in state.values())
    return build_plan(inventories(state, world), options or PlanOptions())


def replay_writes(plan: GlobalPlan, state: State) -> dict[int, int]:
    """Replay every planned write from torch's local tensors; returns bytes written per rank.

    Asserts that each write copies the right global elements, that every element of every
    tensor is written exactly once, and that object keys are unique.
    """
    hits = {path: torch.zeros(layout.shape, dtype=torch.int64) for path, layout in state.items()}
    keys: set[str] = set()
    per_rank = dict.fromkeys(range(plan.world_size), 0)
    for rank, writes in plan.writes.items():
        for write in writes:
            spec = write.array
            layout = state[spec.tensor]
            assert write.key not in keys, f"object {write.key} planned twice"
            keys.add(write.key)
            if spec.shape:
                assert spec.shard_shape[0] % spec.inner_rows == 0, spec
            start = [a + i * c for a, i, c in zip(spec.offset, write.cell, spec.shard_shape)]
            assert all(
                s + n <= a + m
                for s, n, a, m in zip(start, write.valid_shape, spec.offset, spec.shape)
            ), write
            assert write.nbytes == math.prod(write.valid_shape) * layout.dtype.itemsize
            local, _ = torch_local(layout, rank)
            src = local[region(write.local_offset, write.valid_shape)]
            assert tuple(src.shape) == write.valid_shape, f"rank {rank}: {write} outside local"
            expected = global_tensor(layout)[region(start, write.valid_shape)]
            assert torch.equal(src, expected), f"rank {rank} would write wrong data: {write}"
            hits[spec.tensor][region(start, write.valid_shape)] += 1
            per_rank[rank] += write.nbytes
    for path, count in hits.items():
        assert bool((count == 1).all()), f"{path}: elements written {count.tolist()} times"
    return per_rank


@st.composite
def states(draw: st.DrawFn) -> State:
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    dtypes = (torch.int64, torch.float32, torch.bfloat16, torch.uint8)
    count = draw(st.integers(1, 3))
    return {f"t{i}": draw(layouts(mesh_shape, dtypes)) for i in range(count)}


plan_options = st.builds(
    PlanOptions,
    max_object_bytes=st.sampled_from([8, 64, 64 * 2**20]),
    min_split_bytes=st.sampled_from([1, 16, 4 * 2**20]),
    inner_chunk_bytes=st.sampled_from([1, 16, 4 * 2**20]),
    max_cells_per_box=st.integers(1, 4),
)


@settings(max_examples=150, deadline=None)
@given(states(), plan_options)
def test_plan_writes_every_element_once(state: State, options: PlanOptions) -> None:
    replay_writes(plan_for(state, options), state)


@st.composite
def replicated_states(draw: st.DrawFn) -> State:
    world = draw(st.integers(2, 4))
    count = draw(st.integers(1, 6))
    return {
        f"t{i}": Layout(
            tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=2))),
            (world,),
            (Replicate(),),
            draw(st.sampled_from([torch.float32, torch.bfloat16])),
        )
        for i in range(count)
    }


@settings(max_examples=100, deadline=None)
@given(replicated_states())
def test_replicas_write_once_and_share_the_bytes(state: State) -> None:
    """No rank writes more than its share of the bytes plus one object."""
    plan = plan_for(state, TINY)
    per_rank = replay_writes(plan, state)
    largest = max((w.nbytes for ws in plan.writes.values() for w in ws), default=0)
    share = sum(per_rank.values()) / plan.world_size
    assert max(per_rank.values()) <= share + largest, per_rank


def test_one_large_replicated_tensor_is_split_among_replicas() -> None:
    state = {"w": Layout((64, 16), (4,), (Replicate(),), torch.float32)}
    plan = plan_for(state, PlanOptions(min_split_bytes=256))
    per_rank = replay_writes(plan, state)
    assert per_rank == dict.fromkeys(range(4), 64 * 16 * 4 // 4)


@pytest.mark.parametrize("world", [1, 4])
def test_prime_row_count_keeps_objects_few(world: int) -> None:
    """A 78 MiB tensor of 10007 rows (prime) must not become one object per row."""
    rows, cols = 10007, 2048
    whole = {"dtype": "float32", "shape": [rows, cols], "boxes": [[[0, 0], [rows, cols], [0, 0]]]}
    plan = build_plan([{"tensors": {"w": whole}, "values": []} for _ in range(world)])
    writes = [w for ws in plan.writes.values() for w in ws]
    assert len(writes) <= max(world, math.ceil(rows * cols * 4 / PlanOptions().max_object_bytes))
    assert sum(w.valid_shape[0] for w in writes) == rows
    assert all(w.nbytes <= PlanOptions().max_object_bytes for w in writes)
    assert all(len(ws) == 1 for ws in plan.writes.values()) or world == 1


@pytest.mark.parametrize(
    ("layout", "options", "most"),
    [  # int64: 32 bytes a row, 3,232 a shard
        (Layout((2 * 101, 4), (2,), (Shard(0),)), PlanOptions(max_object_bytes=512), 2 * 7),
        (Layout((2 * 101, 4), (2, 2), (Replicate(), Shard(0))), PlanOptions(min_split_bytes=64),
         2 * 2),
    ],
    ids=["object-cap", "replicas"],
)
def test_prime_row_count_per_shard_keeps_objects_few(layout: Layout, options: PlanOptions,
                                                    most: int) -> None:
    """Shards of 101 rows (prime) split to the object cap, or among their replicas: 101 has no
    divisor near the cell size wanted, and a regular grid then had one object per row (202,
    as 80,018 rows of 1024 float32 over two ranks became 80,018 objects of 4 KiB)."""
    state = {"w": layout}
    plan = plan_for(state, options)
    writes = [w for ws in plan.writes.values() for w in ws]
    assert len(writes) <= most, len(writes)
    assert all(w.nbytes <= options.max_object_bytes for w in writes)
    per_rank = replay_writes(plan, state)
    assert min(per_rank.values()) > 0, per_rank  # the replicas still share the writes


def test_uneven_shard_maps_to_a_regular_grid_with_a_short_last_chunk() -> None:
    state = {
        "w": Layout((7, 5), (4,), (Shard(0),), torch.float32),
        "v": Layout((5, 7), (4,), (Shard(1),), torch.float32),
    }
    plan = plan_for(state)
    replay_writes(plan, state)
    (w,), (v,) = plan.tensors["w"].arrays, plan.tensors["v"].arrays
    assert (w.name, w.offset, w.shape, w.shard_shape, w.grid_shape()) == (
        "w",
        (0, 0),
        (7, 5),
        (2, 5),
        (4, 1),
    )
    assert (v.shard_shape, v.grid_shape()) == ((5, 2), (1, 4))
    last = [x for x in plan.writes[3] if x.array.tensor == "w"]
    assert [(x.cell, x.valid_shape) for x in last] == [((3, 0), (1, 5))]


def test_shard_leaving_a_rank_empty() -> None:
    state = {"w": Layout((5, 3), (4,), (Shard(0),), torch.float32)}
    plan = plan_for(state)
    replay_writes(plan, state)
    assert plan.writes[3] == []


@pytest.mark.parametrize(
    ("rows", "options"),
    [
        (10, PlanOptions(max_cells_per_box=1)),
        (102, PlanOptions()),  # boxes of 26, 25, 26, 25 rows: gcd 1 is too fine a grid
    ],
)
def test_nested_uneven_shard_falls_back_to_pieces(rows: int, options: PlanOptions) -> None:
    state = {"w": Layout((rows, 3), (2, 2), (Shard(0), Shard(0)), torch.float32)}
    plan = plan_for(state, options)
    replay_writes(plan, state)
    arrays = plan.tensors["w"].arrays
    assert [a.name for a in arrays] == [f"w/piece_{i}" for i in range(4)]
    bounds = [(a.offset[0], a.offset[0] + a.shape[0]) for a in arrays]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_scalar_is_written_once() -> None:
    state = {"step": Layout((), (4,), (Replicate(),)), "lr": Layout((), (1,), (Replicate(),))}
    plan = plan_for(state)
    replay_writes(plan, state)
    writes = [w for ws in plan.writes.values() for w in ws]
    assert sorted((w.key, w.valid_shape) for w in writes) == [("lr/c", ()), ("step/c", ())]


@pytest.mark.parametrize(
    "layout",
    [
        Layout((0, 3), (4,), (Shard(0),)),
        Layout((4, 0), (2, 2), (Shard(0), Replicate())),
        Layout((0,), (2,), (Replicate(),)),
    ],
    ids=repr,
)
def test_zero_size_tensor_has_an_array_and_no_objects(layout: Layout) -> None:
    plan = plan_for({"e": layout})
    replay_writes(plan, {"e": layout})
    (array,) = plan.tensors["e"].arrays
    assert array.shape == layout.shape
    assert not any(plan.writes.values())


def test_pipeline_stages_hold_different_tensors() -> None:
    invs = [
        {
            "tensors": {
                f"layers.{r}.w": {
                    "dtype": "float32",
                    "shape": [4, 4],
                    "boxes": [[[0, 0], [4, 4], [0, 0]]],
                }
            },
            "values": [],
        }
        for r in range(2)
    ]
    plan = build_plan(invs)
    assert {r: [w.key for w in ws] for r, ws in plan.writes.items()} == {
        0: ["layers.0.w/c.0.0"],
        1: ["layers.1.w/c.0.0"],
    }


def test_missing_shard_is_refused() -> None:
    state = {"w": Layout((8, 2), (4,), (Shard(0),))}
    invs = inventories(state, 4)
    del invs[2]["tensors"]["w"]
    with pytest.raises(CheckpointError, match=r"'w'.*cover 12 of 16"):
        build_plan(invs)


@pytest.mark.parametrize("rows", [[(0, 4), (2, 4), (6, 2)], [(0, 4), (2, 4)]])
def test_shards_of_two_layouts_that_overlap_are_refused(rows: list[tuple[int, int]]) -> None:
    """Ranks holding one path under two layouts (rows 0-3 and 2-5): their shards overlap, and
    the coverage check added their volumes, so rows 0-3 and 2-5 of an 8-row tensor passed as
    covering 16 of 16 elements while rows 6-7 had no holder (never written), and the overlap's
    cells went to two owners. Distinct shards that overlap are refused, naming the path."""
    invs = [{"tensors": {"w": {"dtype": "float32", "shape": [8, 2],
                               "boxes": [[[start, 0], [n, 2], [0, 0]]]}}, "values": []}
            for start, n in rows]
    with pytest.raises(CheckpointError, match=r"'w'.*overlap"):
        build_plan(invs)


def test_disagreeing_shapes_name_both_ranks() -> None:
    invs = inventories({"w": Layout((8, 2), (2,), (Shard(0),))}, 2)
    invs[1]["tensors"]["w"]["shape"] = [8, 3]
    with pytest.raises(CheckpointError, match=r"rank 0 .*\[8, 2\].*rank 1 .*\[8, 3\]"):
        build_plan(invs)


@pytest.mark.parametrize("shape", [[], [2]])
def test_a_tensor_on_one_rank_and_a_container_of_tensors_on_another_is_refused(
        shape: list[int]) -> None:
    """``{"b": tensor}`` on rank 0, ``{"b": {"c": tensor}}`` on rank 1: the array ``b/c`` went
    inside the array ``b``. A 0-d ``b`` stores its one object as ``b/c``, where ``b/c/`` is a
    folder: the save failed on local storage with an ``IsADirectoryError`` as if the disk
    were at fault; a 1-d one committed an array nested in an array, which zarr's listing
    hides. Refused like a tensor on one rank and a value on another, naming the path."""
    invs = [{"tensors": {path: {"dtype": "float32", "shape": shape,
                                "boxes": [[[0] * len(shape), shape, [0] * len(shape)]]}},
             "values": []} for path in ("b", "b/c")]
    with pytest.raises(CheckpointError,
                       match=r"'b' is a tensor on rank 0 and a container on rank 1 .*'b/c'"):
        build_plan(invs)


@settings(max_examples=150, deadline=None)
@given(states(), plan_options)
def test_objects_never_exceed_max_object_bytes(state: State, options: PlanOptions) -> None:
    """Even when one row (or one column slab) is larger than the cap: split along other dims.
    Only an object of a single element may exceed it."""
    plan = plan_for(state, options)
    for writes in plan.writes.values():
        for write in writes:
            itemsize = state[write.array.tensor].dtype.itemsize
            assert write.nbytes <= max(options.max_object_bytes, itemsize), write


def test_a_row_larger_than_max_object_bytes_is_split_along_columns() -> None:
    """3 rows of 1000 float32 (4000 bytes a row), objects of at most 1000 bytes."""
    whole = {"dtype": "float32", "shape": [3, 1000], "boxes": [[[0, 0], [3, 1000], [0, 0]]]}
    options = PlanOptions(max_object_bytes=1000)
    plan = build_plan([{"tensors": {"w": whole}, "values": []}], options)
    writes = plan.writes[0]
    assert all(w.nbytes <= 1000 for w in writes), [w.nbytes for w in writes]
    assert sum(w.nbytes for w in writes) == 3 * 1000 * 4
    state = {"w": Layout((3, 1000), (1,), (Replicate(),), torch.float32)}
    replay_writes(plan_for(state, options), state)
