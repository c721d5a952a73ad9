"""Resharding across real gloo ranks: save under one DTensor layout, load under another.

One group of four CPU gloo ranks serves the whole module (starting one costs seconds); a
layout on fewer ranks uses the first (or last) ranks of it and a process group of just those,
which is also how the engine runs beside other work. Plain-tensor loads run in the test process
itself, with no process group at all. Every comparison is bit-for-bit against the global tensor:
globals are random bytes (NaN payloads included), targets start as their bitwise complement, so
an element the load does not fill can never pass by accident.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import RankGroup
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from antifragile.engine import CheckpointEngine, CheckpointMismatchError, PlanOptions

pytestmark = pytest.mark.multiproc

WORLD = 4

# Where a mesh lies: (first rank, mesh shape); its ranks are consecutive, in C order.
MeshAt = tuple[int, tuple[int, ...]]
# A tensor of a case: (name, global shape, dtype name, seed, placements on mesh A, on mesh B);
# placement codes are "R", "S<dim>" and "SS<dim>x<split_factor>" (_StridedShard).
TensorCase = tuple[str, tuple[int, ...], str, int, tuple[str, ...], tuple[str, ...]]


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankGroup]:
    with RankGroup(WORLD, timeout_s=180) as group:
        yield group


# --- run on every rank ------------------------------------------------------------------------

_GROUPS: dict[tuple[int, ...], Any] = {}
_MESHES: dict[MeshAt, DeviceMesh] = {}


def group_of(members: Sequence[int]) -> Any:
    """The process group of ``members`` (None: the world). Every rank must call it."""
    key = tuple(members)
    if len(key) == dist.get_world_size():
        return None
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


def mesh_of(start: int, shape: tuple[int, ...]) -> DeviceMesh:
    """A CPU mesh over ranks ``start, start+1, ...`` in C order. Every rank must call it."""
    key = (start, shape)
    if key not in _MESHES:
        ranks_ = torch.arange(start, start + math.prod(shape)).reshape(shape)
        _MESHES[key] = DeviceMesh("cpu", ranks_)
    return _MESHES[key]


def mesh_members(start: int, shape: tuple[int, ...]) -> list[int]:
    return list(range(start, start + math.prod(shape)))


def placement(code: str) -> Placement:
    if code == "R":
        return Replicate()
    if code.startswith("SS"):
        dim, split = code[2:].split("x")
        return _StridedShard(int(dim), split_factor=int(split))
    return Shard(int(code[1:]))


def global_tensor(shape: tuple[int, ...], dtype_name: str, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: every bit pattern, NaN payloads included."""
    dtype = getattr(torch, dtype_name)
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def complement(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every bit flipped: differs from ``t`` in every element."""
    return (~t.reshape(-1).view(torch.uint8)).view(t.dtype).reshape(t.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


def expected_local(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """What ``like``'s rank should hold of ``full``, by torch's own sharding code."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def mismatches(state: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> list[str]:
    """Names whose (local part of the) tensor differs from the global one, bit for bit."""
    bad = []
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            got, want = tensor.to_local(), expected_local(full[name], tensor)
        else:
            got, want = tensor, full[name]
        if not same_bits(got, want):
            bad.append(f"rank {dist.get_rank() if dist.is_initialized() else '-'}: {name}")
    return bad


def sharded(
    tensors: Sequence[TensorCase], layout: MeshAt, side: int, fill: bool
) -> dict[str, torch.Tensor]:
    """The case's tensors as DTensors on ``layout`` (side 0: layout A's codes, 1: B's); the
    global values when ``fill``, else their complement."""
    mesh = mesh_of(*layout)
    out = {}
    for name, shape, dtype_name, seed, *codes in tensors:
        full = global_tensor(shape, dtype_name, seed)
        out[name] = distribute_tensor(
            full if fill else complement(full),
            mesh,
            [placement(c) for c in codes[side]],
            src_data_rank=None,
        )
    return out


def save_case(
    url: str,
    layout: MeshAt,
    tensors: Sequence[TensorCase],
    plan_options: PlanOptions | None = None,
) -> None:
    members = mesh_members(*layout)
    mesh_of(*layout)
    pg = group_of(members)
    if dist.get_rank() not in members:
        return
    with CheckpointEngine(url, process_group=pg, plan_options=plan_options) as engine:
        engine.save(1, {"t": sharded(tensors, layout, 0, fill=True)}, blocking=True)


def load_case(url: str, layout: MeshAt, tensors: Sequence[TensorCase]) -> list[str]:
    members = mesh_members(*layout)
    mesh_of(*layout)
    pg = group_of(members)
    if dist.get_rank() not in members:
        return []
    state = {"t": sharded(tensors, layout, 1, fill=False)}
    with CheckpointEngine(url, process_group=pg) as engine:
        assert engine.load(state) == 1
    full = {name: global_tensor(shape, dt, seed) for name, shape, dt, seed, *_ in tensors}
    return mismatches(state["t"], full)


def load_plain(url: str, tensors: Sequence[TensorCase]) -> list[str]:
    """Load into plain tensors in this process (no process group); names that differ."""
    full = {name: global_tensor(shape, dt, seed) for name, shape, dt, seed, *_ in tensors}
    state = {"t": {name: complement(t) for name, t in full.items()}}
    with CheckpointEngine(url) as engine:
        assert engine.load(state) == 1
    return mismatches(state["t"], full)


def flat(results: list[list[str]]) -> list[str]:
    return [m for per_rank in results for m in per_rank]


# --- one checkpoint, several target layouts ---------------------------------------------------

MESH_2X2 = (0, (2, 2))
TENSORS_2X2: list[TensorCase] = [
    ("w", (8, 6), "float32", 1, ("S0", "S1"), ("R",)),
    ("u", (7, 5), "float32", 2, ("S0", "S1"), ("S1",)),  # uneven on both dims
    ("h", (9,), "bfloat16", 3, ("S0", "R"), ("S0",)),
    ("i", (5, 3), "int64", 4, ("R", "S0"), ("R",)),
    ("f", (6, 4), "float16", 5, ("SS0x2", "S0"), ("S1",)),
    ("s", (), "float32", 6, ("R", "R"), ("R",)),
    ("e", (0, 3), "float32", 7, ("S0", "S1"), ("S0",)),
]


@pytest.fixture(scope="module")
def saved_2x2(ranks: RankGroup, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("dtensor") / "ckpt_2x2")
    ranks.run(save_case, url, MESH_2X2, TENSORS_2X2)
    return url


@pytest.mark.parametrize("layout", [(0, (2,)), (2, (2,))], ids=["ranks01", "ranks23"])
def test_2x2_loads_on_two_ranks(ranks: RankGroup, saved_2x2: str, layout: MeshAt) -> None:
    assert flat(ranks.run(load_case, saved_2x2, layout, TENSORS_2X2)) == []


def test_2x2_loads_on_four_ranks_transposed(ranks: RankGroup, saved_2x2: str) -> None:
    transposed = {0: ("R", "R"), 1: ("R", "S0"), 2: ("S1", "SS0x2")}
    tensors = [(n, s, d, seed, a, transposed[len(s)]) for n, s, d, seed, a, _ in TENSORS_2X2]
    assert flat(ranks.run(load_case, saved_2x2, MESH_2X2, tensors)) == []


def test_2x2_loads_into_plain_tensors_in_one_process(saved_2x2: str) -> None:
    assert not dist.is_initialized()
    assert load_plain(saved_2x2, TENSORS_2X2) == []


def test_target_of_another_dtype_is_refused(saved_2x2: str) -> None:
    with (
        CheckpointEngine(saved_2x2) as engine,
        pytest.raises(CheckpointMismatchError, match="dtype"),
    ):
        engine.load({"t": {"h": torch.zeros(9, dtype=torch.float32)}})


def test_uneven_7x5_over_four_ranks(ranks: RankGroup, tmp_path: Path) -> None:
    tensors: list[TensorCase] = [
        ("u", (7, 5), "float32", 11, ("S0",), ("S1",)),
        ("v", (5, 7), "bfloat16", 12, ("S1",), ("S0",)),
    ]
    url = str(tmp_path / "ckpt")
    ranks.run(save_case, url, (0, (4,)), tensors)
    assert flat(ranks.run(load_case, url, (0, (4,)), tensors)) == []
    assert load_plain(url, tensors) == []


# --- replicated data is written once ----------------------------------------------------------


def test_replicated_tensors_are_written_once_and_spread(ranks: RankGroup, tmp_path: Path) -> None:
    tensors: list[TensorCase] = [
        (f"p{i}", (16, 8), "float32", 20 + i, ("R",), ("R",)) for i in range(6)
    ]
    tensors.append(("big", (64, 16), "float32", 30, ("R",), ("R",)))
    url = str(tmp_path / "ckpt")
    ranks.run(save_case, url, (0, (WORLD,)), tensors, PlanOptions(min_split_bytes=1024))
    step = tmp_path / "ckpt" / "step_000000001"
    records = {r: json.loads((step / ".ranks" / f"{r}.json").read_text()) for r in range(WORLD)}
    data = {
        r: {k: n for k, (n, _) in rec["objects"].items() if "/c" in k} for r, rec in records.items()
    }
    all_keys = [k for objs in data.values() for k in objs]
    assert len(all_keys) == len(set(all_keys)), "an object is written by two ranks"
    for name, *_ in tensors:
        assert any(k.startswith(f"t/{name}/c.") for k in all_keys), name
    tensor_bytes = sum(math.prod(s) * 4 for _, s, *_ in tensors)
    per_rank = {r: sum(objs.values()) for r, objs in data.items()}
    assert sum(per_rank.values()) < 1.1 * tensor_bytes, "replicas were written more than once"
    largest = max(n for objs in data.values() for n in objs.values())
    assert max(per_rank.values()) <= sum(per_rank.values()) / WORLD + largest, per_rank
    assert load_plain(url, tensors) == []


# --- pipeline stages: each rank holds different tensors ---------------------------------------


def stage_state(stages: dict[int, list[int]], fill: bool) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's layers as plain tensors (``stages`` maps a rank to the layers it holds)."""
    layers = (
        stages.get(dist.get_rank(), [])
        if dist.is_initialized()
        else sorted(layer for held in stages.values() for layer in held)
    )
    state: dict[str, torch.Tensor] = {}
    for layer in layers:
        for name, shape, dt in (("w", (6, 4), "float32"), ("b", (6,), "bfloat16")):
            full = global_tensor(shape, dt, 100 * layer + len(name))
            state[f"layers.{layer}.{name}"] = full if fill else complement(full)
    return {"model": state}


def save_stages(url: str, stages: dict[int, list[int]]) -> None:
    members = sorted(stages)
    pg = group_of(members)
    if dist.get_rank() in members:
        with CheckpointEngine(url, process_group=pg) as engine:
            engine.save(1, stage_state(stages, fill=True), blocking=True)


def load_stages(url: str, stages: dict[int, list[int]]) -> list[str]:
    members = sorted(stages)
    pg = group_of(members) if dist.is_initialized() else None
    if dist.is_initialized() and dist.get_rank() not in members:
        return []
    state = stage_state(stages, fill=False)
    with CheckpointEngine(url, process_group=pg) as engine:
        engine.load(state)
    full = stage_state(stages, fill=True)["model"]
    return mismatches(state["model"], full)


def test_pipeline_stages_load_into_one_full_model(ranks: RankGroup, tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ranks.run(save_stages, url, {r: [r] for r in range(WORLD)})
    assert flat(ranks.run(load_stages, url, {0: [0, 1], 1: [2, 3]})) == []
    assert load_stages(url, {0: [0, 1, 2, 3]}) == []


# --- pipeline x TP: each stage's tensors live on that stage's own mesh -------------------------

Placed = tuple[TensorCase, MeshAt, MeshAt]
PP_TP: list[Placed] = [  # two stages of tp=2 (ranks 0-1, 2-3) -> one stage of tp=4
    (("layers.0.w", (7, 6), "bfloat16", 40, ("S0",), ("S1",)), (0, (2,)), (0, (4,))),
    (("layers.0.norm", (6,), "float32", 41, ("R",), ("R",)), (0, (2,)), (0, (4,))),
    (("layers.1.w", (6, 7), "bfloat16", 42, ("S1",), ("S0",)), (2, (2,)), (0, (4,))),
    (("layers.1.norm", (6,), "float32", 43, ("R",), ("S0",)), (2, (2,)), (0, (4,))),
]


def placed_state(placed: Sequence[Placed], side: int, fill: bool) -> dict[str, torch.Tensor]:
    """This rank's DTensors of ``placed`` on their layout A (side 0) or B (side 1)."""
    state = {}
    for tensor, *layouts in placed:
        layout = layouts[side]
        mesh_of(*layout)
        if dist.get_rank() in mesh_members(*layout):
            state.update(sharded([tensor], layout, side, fill))
    return state


def save_placed(url: str, placed: Sequence[Placed]) -> None:
    with CheckpointEngine(url) as engine:
        engine.save(1, {"t": placed_state(placed, 0, fill=True)}, blocking=True)


def load_placed(url: str, placed: Sequence[Placed]) -> list[str]:
    state = {"t": placed_state(placed, 1, fill=False)}
    with CheckpointEngine(url) as engine:
        engine.load(state)
    full = {name: global_tensor(shape, dt, seed) for (name, shape, dt, seed, *_), *_ in placed}
    return mismatches(state["t"], full)


def test_pipeline_of_tp_stages_reshards(ranks: RankGroup, tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ranks.run(save_placed, url, PP_TP)
    assert flat(ranks.run(load_placed, url, PP_TP)) == []
    assert load_plain(url, [tensor for tensor, *_ in PP_TP]) == []


# --- FSDP2 + TP: strided shards ---------------------------------------------------------------


def make_model(seed: int, dtype_name: str) -> nn.Module:
    """Odd sizes so that TP and FSDP shards are uneven."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(10, 14), nn.ReLU(), nn.Linear(14, 6), nn.ReLU(), nn.Linear(6, 9)
    )
    return model.to(getattr(torch, dtype_name))


def parallel_mesh(dp: int, tp: int) -> DeviceMesh:
    """A (dp, tp) mesh over ranks ``0..dp*tp``. Every rank must call it."""
    return DeviceMesh("cpu", torch.arange(dp * tp).reshape(dp, tp), mesh_dim_names=("dp", "tp"))


def parallel_model(seed: int, dtype_name: str, mesh: DeviceMesh, fsdp: bool) -> nn.Module:
    """TP (col, row, col) on ``tp``; on ``dp`` FSDP2, or plain replicas (DDP-like) if not
    ``fsdp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = make_model(seed, dtype_name)
    if mesh["tp"].size() > 1:
        parallelize_module(
            model,
            mesh["tp"],
            {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel()},
        )
    if fsdp and mesh["dp"].size() > 1:
        for index in ("0", "2", "4"):
            fully_shard(model.get_submodule(index), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def model_mismatches(model: nn.Module, dtype_name: str) -> list[str]:
    return mismatches(model.state_dict(), make_model(0, dtype_name).state_dict())


def save_parallel(url: str, dtype_name: str, dp: int, tp: int, fsdp: bool = True) -> list[str]:
    """Save the seed-0 model from ranks ``0..dp*tp``; returns the placements seen."""
    mesh, pg = parallel_mesh(dp, tp), group_of(range(dp * tp))
    if dist.get_rank() >= dp * tp:
        return []
    model = parallel_model(0, dtype_name, mesh, fsdp)
    with CheckpointEngine(url, process_group=pg) as engine:
        engine.save(1, {"model": model}, blocking=True)
    return sorted(
        {str(t.placements) for t in model.state_dict().values() if isinstance(t, DTensor)}
    )


def load_parallel(url: str, dtype_name: str, dp: int, tp: int) -> list[str]:
    """Load into a seed-1 model on ranks ``0..dp*tp``; returns the mismatching names."""
    mesh, pg = parallel_mesh(dp, tp), group_of(range(dp * tp))
    if dist.get_rank() >= dp * tp:
        return []
    model = parallel_model(1, dtype_name, mesh, fsdp=True)
    assert model_mismatches(model, dtype_name), "the target must start out different"
    with CheckpointEngine(url, process_group=pg) as engine:
        engine.load({"model": model})
    return model_mismatches(model, dtype_name)


def load_single(url: str, dtype_name: str) -> list[str]:
    model = make_model(1, dtype_name)
    with CheckpointEngine(url) as engine:
        engine.load({"model": model})
    return model_mismatches(model, dtype_name)


@pytest.fixture(scope="module")
def saved_fsdp_tp(ranks: RankGroup, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A bf16 model saved from FSDP2 (dp=2) over TP (tp=2): strided shards."""
    url = str(tmp_path_factory.mktemp("fsdp_tp") / "ckpt")
    seen = ranks.run(save_parallel, url, "bfloat16", 2, 2)
    assert any("_StridedShard" in p for p in seen[0]), seen[0]
    return url


def test_fsdp_tp_loads_into_a_plain_model(saved_fsdp_tp: str) -> None:
    assert load_single(saved_fsdp_tp, "bfloat16") == []


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (4, 1), (2, 2)], ids=["tp2", "dp4", "same"])
def test_fsdp_tp_loads_into_another_layout(
    ranks: RankGroup, saved_fsdp_tp: str, dp: int, tp: int
) -> None:
    assert flat(ranks.run(load_parallel, saved_fsdp_tp, "bfloat16", dp, tp)) == []


def test_tp_with_replicated_dp_is_written_once(ranks: RankGroup, tmp_path: Path) -> None:
    """DDP over TP: DTensors on each dp row's own ``tp`` sub-mesh; the rows are replicas."""
    url = str(tmp_path / "ckpt")
    ranks.run(save_parallel, url, "float32", 2, 2, False)
    step = tmp_path / "ckpt" / "step_000000001"
    written = [
        k
        for r in range(WORLD)
        for k in json.loads((step / ".ranks" / f"{r}.json").read_text())["objects"]
        if "/c" in k
    ]
    assert len(written) == len(set(written))
    assert {k.split("/c")[0] for k in written} == {
        f"model/{k}" for k in make_model(0, "float32").state_dict()
    }
    assert load_single(url, "float32") == []


def test_two_rank_save_loads_on_four_ranks(ranks: RankGroup, tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ranks.run(save_parallel, url, "float32", 2, 1)
    assert flat(ranks.run(load_parallel, url, "float32", 2, 2)) == []
    assert load_single(url, "float32") == []


# --- property: random layouts, one rank group for all cases -----------------------------------

DTYPES = ("float32", "bfloat16", "int64", "float16")
MESH_SHAPES = [(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4)]


def codes_for(ndim: int) -> st.SearchStrategy[str]:
    if ndim == 0:
        return st.just("R")
    dims = st.integers(0, ndim - 1)
    return st.one_of(
        st.just("R"),
        dims.map(lambda d: f"S{d}"),
        st.tuples(dims, st.integers(2, 3)).map(lambda t: f"SS{t[0]}x{t[1]}"),
    )


@st.composite
def layouts(draw: st.DrawFn) -> MeshAt:
    shape = draw(st.sampled_from(MESH_SHAPES))
    return draw(st.integers(0, WORLD - math.prod(shape))), shape


plan_options = st.builds(  # small objects and inner chunks: split cells, partial reads, pieces
    PlanOptions,
    max_object_bytes=st.sampled_from([16, 64, 64 * 2**20]),
    min_split_bytes=st.sampled_from([8, 4 * 2**20]),
    inner_chunk_bytes=st.sampled_from([8, 32, 4 * 2**20]),
    max_cells_per_box=st.sampled_from([1, 4]),
)


Case = tuple[MeshAt, MeshAt | None, list[TensorCase], PlanOptions]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Layout A, layout B (None: plain tensors in one process), 1-3 tensors, plan options."""
    mesh_a = draw(layouts())
    mesh_b = draw(st.one_of(st.none(), layouts()))
    tensors = []
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 13), min_size=0, max_size=3)))
        codes_a = tuple(draw(codes_for(len(shape))) for _ in mesh_a[1])
        codes_b = tuple(draw(codes_for(len(shape))) for _ in (mesh_b or mesh_a)[1])
        tensors.append((f"x{i}", shape, draw(st.sampled_from(DTYPES)), i, codes_a, codes_b))
    return mesh_a, mesh_b, tensors, draw(plan_options)


def check_case(group: RankGroup, root: Path, case: Case) -> None:
    mesh_a, mesh_b, tensors, options = case
    url = str(root / "ckpt")
    group.run(save_case, url, mesh_a, tensors, options)
    if mesh_b is not None:
        assert flat(group.run(load_case, url, mesh_b, tensors)) == []
    assert load_plain(url, tensors) == []


NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]  # each shrink step costs collectives


@settings(
    max_examples=8, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=cases())
def test_any_layout_reshards_bit_exactly(
    ranks: RankGroup, tmp_path_factory: pytest.TempPathFactory, case: Case
) -> None:
    check_case(ranks, tmp_path_factory.mktemp("prop"), case)


@pytest.mark.slow
@settings(
    max_examples=150, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=cases())
def test_any_layout_reshards_bit_exactly_many(
    ranks: RankGroup, tmp_path_factory: pytest.TempPathFactory, case: Case
) -> None:
    check_case(ranks, tmp_path_factory.mktemp("prop"), case)


def _load_into_a_mismatched_local(url: str) -> str:
    """Load ``t/w`` (4 x 4, Shard(0) on 4 ranks) into DTensors whose local tensors do not hold
    what their placements give (rank 0 holds 2 rows where the placements give 1)."""
    mesh = mesh_of(0, (4,))
    rows = 2 if dist.get_rank() == 0 else 1
    target = DTensor.from_local(torch.zeros(rows, 4), mesh, [Shard(0)], run_check=False,
                                shape=(4, 4), stride=(4, 1))
    with CheckpointEngine(url) as engine:
        try:
            engine.load({"t": {"w": target}})
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_target_whose_local_shape_disagrees_with_its_placements_is_refused_as_a_target(
        ranks: RankGroup, tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ranks.run(save_case, url, (0, (4,)), [("w", (4, 4), "float32", 1, ("S0",), ("S0",))])
    for message in ranks.run(_load_into_a_mismatched_local, url):
        assert "'t/w'" in message and "load into" in message, message
        assert "save" not in message, message
