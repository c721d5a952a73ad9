"""Planning: which rank writes which storage object of which global array.

Pure functions of the state's layout, cached by the engine while the layout is unchanged.

Every tensor becomes a global array. Each rank describes the boxes (hyper-rectangles of the
global tensor) it holds; the plan picks a regular chunk grid whose cells never straddle a box
boundary, so each storage object (one zarr shard) is filled by one rank from its own memory: no
gather. Cells held by several ranks (replicas) get one owner each, chosen to balance bytes
written per rank. A layout whose boxes do not fit a reasonable regular grid (e.g. two nested
uneven ``Shard`` of one dim) is stored as one array per box with recorded offsets: it still
saves and loads correctly, it is just not one zarr array.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import math
import operator
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import product, repeat

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ._dtypes import check_dtype, dtype_name
from ._state import storage_short
from .errors import CheckpointError, CheckpointMismatchError

try:  # private in torch; FSDP2 + TP produce it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()  # type: ignore[assignment,misc]

Runs = list[tuple[int, int]]  # half-open [start, stop) intervals, ascending


@dataclass(frozen=True, slots=True)
class HeldBox:
    """A box of the global tensor that one rank holds, and where it sits in its local tensor."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One zarr array of the checkpoint: a whole tensor, or one piece of an irregular layout."""

    name: str  # "model/layers.0.attn.wq.weight" or ".../piece_3"
    tensor: str  # state path of the tensor it stores
    offset: tuple[int, ...]  # where the array starts in the global tensor
    shape: tuple[int, ...]
    dtype: str  # torch dtype name
    shard_shape: tuple[int, ...]  # the chunk grid: one storage object per cell
    inner_rows: int  # rows (dim 0) per inner chunk inside a shard
    separator: str = "."  # of chunk keys: "/" in checkpoints of format 2 (``_paths``)

    def cell_key(self, cell: Sequence[int]) -> str:
        return self.key_prefix() + "".join(map(self.key_part, cell))

    def key_prefix(self) -> str:
        """What every cell's key begins with; each index of the cell adds its ``key_part``."""
        return f"{self.name}/c"

    def key_part(self, index: int) -> str:
        return f"{self.separator}{index}"

    def grid_shape(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / c) if n else 0 for n, c in zip(self.shape, self.shard_shape))


@dataclass(frozen=True, slots=True)
class CellWrite:
    """One storage object a rank writes: a cell of an array filled from its local tensor."""

    array: ArraySpec
    cell: tuple[int, ...]
    key: str  # object key relative to the step folder
    valid_shape: tuple[int, ...]  # in-bounds part of the cell (edge cells are short)
    local_offset: tuple[int, ...]  # where the cell's data starts in the local tensor
    nbytes: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    path: str
    dtype: str
    shape: tuple[int, ...]
    arrays: tuple[ArraySpec, ...]


@dataclass(slots=True)
class GlobalPlan:
    """The same on every rank: derived deterministically from the gathered inventories."""

    world_size: int
    tensors: dict[str, TensorSpec]
    values: dict[str, list[int]]  # JSON path -> ranks holding it
    writes: CellWrites = field(default_factory=lambda: CellWrites(0))
    plan_id: str = ""

    def keys_of(self, rank: int) -> set[str]:
        return self.writes.keys_of(rank)

    def count_of(self, rank: int) -> int:
        """How many objects of the plan ``rank`` writes: ``len(keys_of(rank))``."""
        return self.writes.count(rank)

    def arrays(self) -> Iterable[ArraySpec]:
        for spec in self.tensors.values():
            yield from spec.arrays


# --- which boxes a DTensor holds -----------------------------------------------------------


def _take(runs: Runs, start: int, stop: int) -> Runs:
    """Positions [start, stop) of the sequence that ``runs`` concatenate."""
    out: Runs = []
    pos = 0
    for a, b in runs:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def _chunk(runs: Runs, num_chunks: int, index: int) -> Runs:
    """``torch.chunk`` semantics: chunk size ceil(n / k); trailing chunks may be short or empty."""
    length = sum(b - a for a, b in runs)
    size = math.ceil(length / num_chunks) if length else 0
    return _take(runs, index * size, min((index + 1) * size, length)) if size else []


def _merge(runs: Runs) -> Runs:
    out: Runs = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def placement_boxes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
) -> list[HeldBox]:
    """The boxes of the global tensor held at ``coordinate`` of a mesh, in local order.

    ``Shard`` follows ``torch.chunk``; ``_StridedShard(split_factor=s)`` first splits the
    current index list into ``s`` pieces and takes this coordinate's chunk of each (the layout
    FSDP2 produces on top of tensor parallelism). An empty list means the rank holds nothing.
    """
    per_dim: list[Runs] = [[(0, n)] if n else [] for n in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Partial):
            raise CheckpointError("a DTensor with a Partial placement must be reduced first")
        if not isinstance(placement, (Shard, _StridedShard)):  # not a Shard subclass in torch 2.13
            raise CheckpointError(f"unsupported placement {placement!r}")
        dim, k, n = placement.dim, coordinate[mesh_dim], mesh_shape[mesh_dim]
        if isinstance(placement, _StridedShard):
            total = sum(b - a for a, b in per_dim[dim])
            size = math.ceil(total / placement.split_factor) if total else 0
            pieces = [_take(per_dim[dim], i * size, min((i + 1) * size, total))
                      for i in range(placement.split_factor)] if size else []
            per_dim[dim] = [r for piece in pieces for r in _chunk(piece, n, k)]
        else:
            per_dim[dim] = _chunk(per_dim[dim], n, k)
    per_dim = [_merge(runs) for runs in per_dim]
    if any(not runs for runs in per_dim) and len(global_shape) > 0:
        return []
    boxes = []
    local_starts = [[sum(b - a for a, b in runs[:i]) for i in range(len(runs))] for runs in per_dim]
    for combo in product(*(range(len(runs)) for runs in per_dim)):
        runs = [per_dim[d][i] for d, i in enumerate(combo)]
        boxes.append(HeldBox(
            offset=tuple(a for a, _ in runs),
            shape=tuple(b - a for a, b in runs),
            local_offset=tuple(local_starts[d][i] for d, i in enumerate(combo)),
        ))
    return boxes


def local_boxes(tensor: torch.Tensor, *, path: str, target: bool = False) -> list[HeldBox]:
    """The boxes this process holds of ``tensor`` (a plain tensor holds all of itself);
    ``target``: it is a load's (an error then says so)."""
    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape)
        return [HeldBox((0,) * len(shape), shape, (0,) * len(shape))]
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    try:
        boxes = placement_boxes(tensor.shape, mesh.shape, coordinate, tensor.placements)
    except CheckpointError as exc:
        raise CheckpointError(f"state path {path!r}: {exc}") from None
    local_shape = tuple(tensor.to_local().shape)
    expected = tuple(
        max((b.local_offset[d] + b.shape[d] for b in boxes), default=0)
        for d in range(len(local_shape))
    )
    if (boxes and expected != local_shape) or (not boxes and math.prod(local_shape) != 0):
        raise CheckpointError(
            f"state path {path!r}: placements {tensor.placements} give local shape {expected}, "
            f"the DTensor holds {local_shape}; refusing to "
            f"{'load into' if target else 'save'} a layout the engine cannot map"
        )
    return boxes


# --- inventories and the global plan ---------------------------------------------------------


def check_tensor(tensor: torch.Tensor, *, path: str, target: bool = False) -> None:
    """Refuse, at the call, a tensor whose bytes the engine cannot copy out (or, a load
    ``target``, in): no data (the meta device), not one strided block of memory (sparse,
    nested), a dtype zarr cannot hold, an inference tensor outside inference mode (torch
    refuses to update it), or a target whose elements share memory (a broadcast view: the
    load is a CheckpointMismatchError, whatever the step)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    why = None
    if local.is_nested:
        why = "a nested tensor (save its components: unbind())"
    elif local.layout != torch.strided:
        why = f"a {str(local.layout).removeprefix('torch.')} tensor (convert it: to_dense())"
    elif local.is_meta:
        why = "a tensor on the meta device holds no data (materialize it first)"
    elif storage_short(local):
        why = (f"its shape and strides reach past the end of its storage "
               f"({local.untyped_storage().nbytes()} bytes: freed or shrunk under it, as FSDP "
               "frees a resharded parameter's)")
    if why is not None:
        raise CheckpointError(f"state path {path!r}: {why}; only strided tensors holding data "
                              f"can be {'loaded into' if target else 'saved'}")
    check_dtype(tensor.dtype, path=path)
    shared = [d for d, (n, stride) in enumerate(zip(local.shape, local.stride()))
              if stride == 0 and n > 1]
    if target and shared:
        raise CheckpointMismatchError(
            f"state path {path!r}: dim {shared[0]} has stride 0 (a broadcast view such as "
            "expand(): its elements share memory), so it cannot be loaded into; load into a "
            "tensor that owns its elements (clone() it)")
    if target and local.is_inference() and not torch.is_inference_mode_enabled():
        raise CheckpointError(
            f"state path {path!r} is an inference tensor (made under torch.inference_mode()), "
            "which torch updates in place only inside inference mode: call load() inside "
            "torch.inference_mode(), or load into a normal tensor")
    if target and _overlaps_itself(local):
        raise CheckpointMismatchError(
            f"state path {path!r}: strides {list(local.stride())} for shape "
            f"{list(local.shape)} make its elements share memory (as_strided()), so it cannot "
            "be loaded into; load into a tensor that owns its elements (clone() it)")


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` lie at one memory address. Every view that slicing,
    permuting or stepping makes of dense memory passes the quick test (each stride, in
    ascending order, steps past all the elements the smaller ones reach); only a layout that
    fails it (``as_strided``) has its element offsets computed and counted."""
    dims = sorted((stride, n) for n, stride in zip(tensor.shape, tensor.stride()) if n > 1)
    reach = 0
    for stride, n in dims:
        if stride <= reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride)
    return bool(torch.unique(offsets).numel() != offsets.numel())


def inventory(tensors: dict[str, torch.Tensor], values: Iterable[str]) -> dict[str, object]:
    """What this rank holds, as JSON: gathered from every rank to build the global plan."""
    entries: dict[str, object] = {}
    for path, tensor in tensors.items():
        check_tensor(tensor, path=path)
        entries[path] = {
            "dtype": dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "boxes": [[list(b.offset), list(b.shape), list(b.local_offset)]
                      for b in local_boxes(tensor, path=path)],
        }
    return {"tensors": entries, "values": sorted(values)}


@dataclass(frozen=True, slots=True)
class PlanOptions:
    max_object_bytes: int = 64 * 2**20  # split big cells so objects stay small and writes parallel
    min_split_bytes: int = 4 * 2**20  # replicated boxes larger than this are split among replicas
    inner_chunk_bytes: int = 4 * 2**20  # partial reads (resharding) fetch at most this much extra
    max_cells_per_box: int = 4  # a finer grid than this falls back to one array per box


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= limit:
                    best = c
    return best


def _regular_grid(shape: Sequence[int], boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]
                  ) -> tuple[int, ...]:
    cuts: list[set[int]] = [set() for _ in shape]
    for offset, box_shape in boxes:
        for d, (o, s) in enumerate(zip(offset, box_shape)):
            cuts[d].update(x for x in (o, o + s) if 0 < x < shape[d])
    return tuple(math.gcd(*c) if c else max(n, 1) for c, n in zip(cuts, shape))


def _fit(n: int, step: int, limit: int) -> int:
    """A cell size of at most ``limit`` along a dim of ``n`` whose box grid step is ``step``:
    any size when one step spans the dim (the last cell may be short, even for a prime ``n``),
    else a divisor of ``step`` (a cell must never straddle a box boundary)."""
    return min(step, limit) if step >= n else _largest_divisor_at_most(step, limit)


@functools.lru_cache(maxsize=1024)  # the boxes of a tensor have a few shapes, often one
def _refine(shape: tuple[int, ...], grid: tuple[int, ...], itemsize: int, replicas: int,
            box_bytes: int, options: PlanOptions) -> tuple[tuple[int, ...], int]:
    """Split cells to at most ``max_object_bytes`` (along dim 0 first, then along the next dims
    when a single row is larger than that) and spread replicas; choose the inner chunk rows."""
    cell = list(grid)
    row_bytes = math.prod(grid[1:]) * itemsize
    limit = max(1, options.max_object_bytes // max(row_bytes, 1))
    if replicas > 1 and box_bytes >= replicas * options.min_split_bytes:
        limit = min(limit, math.ceil(grid[0] / replicas))
    cell[0] = _fit(shape[0], grid[0], limit)
    for d in range(1, len(cell)):
        if math.prod(cell) * itemsize <= options.max_object_bytes:
            break
        other = math.prod(cell[:d]) * math.prod(cell[d + 1:]) * itemsize
        cell[d] = _fit(shape[d], cell[d], max(1, options.max_object_bytes // max(other, 1)))
    row_bytes = math.prod(cell[1:]) * itemsize
    inner = _largest_divisor_at_most(cell[0],
                                     max(1, options.inner_chunk_bytes // max(row_bytes, 1)))
    return tuple(cell), inner


@contextlib.contextmanager
def _collector_paused() -> Generator[None, None, None]:
    """The cyclic garbage collector off meanwhile (back as it was after): ``build_plan`` makes
    objects it keeps, none in a cycle, hundreds of thousands of them at thousands of ranks, and
    each collection that triggers walks every tracked object of the process, the gathered
    inventories' millions included: a fifth of ``build_plan`` at 4,096 ranks."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_plan(inventories: Sequence[dict], options: PlanOptions = PlanOptions()) -> GlobalPlan:
    """The global plan from every rank's inventory (index = rank). Deterministic."""
    with _collector_paused():
        return _build_plan(inventories, options)


def _build_plan(inventories: Sequence[dict], options: PlanOptions) -> GlobalPlan:
    world = len(inventories)
    held: dict[str, dict[tuple, list[tuple[int, tuple[int, ...]]]]] = {}
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    values: dict[str, list[int]] = {}
    for rank, inv in enumerate(inventories):
        for path in inv["values"]:
            values.setdefault(path, []).append(rank)
        for path, entry in inv["tensors"].items():
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            if path in values:
                raise CheckpointError(f"state path {path!r} is a tensor on rank {rank} "
                                      f"and a value on ranks {values[path]}")
            first = meta.setdefault(path, (dtype, shape, rank))
            if first[:2] != (dtype, shape):
                raise CheckpointError(
                    f"state path {path!r}: rank {first[2]} holds {first[0]}{list(first[1])}, "
                    f"rank {rank} holds {dtype}{list(shape)}"
                )
            for offset, box_shape, local_offset in entry["boxes"]:
                held.setdefault(path, {}).setdefault((tuple(offset), tuple(box_shape)), []).append(
                    (rank, tuple(local_offset)))
    for path in values:
        if path in meta:
            raise CheckpointError(f"state path {path!r}: a tensor on some ranks, a value on others")
    for path, (_, _, rank) in meta.items():  # its array would go inside another's
        parent = path.rpartition("/")[0]
        while parent:
            if parent in meta:
                raise CheckpointError(f"state path {parent!r} is a tensor on rank "
                                      f"{meta[parent][2]} and a container on rank {rank} "
                                      f"(holding {path!r})")
            parent = parent.rpartition("/")[0]

    plan = GlobalPlan(world_size=world, tensors={}, values=values, writes=CellWrites(world))
    written = [0] * world
    for path in sorted(meta):
        dtype, shape, _ = meta[path]
        itemsize = getattr(torch, dtype).itemsize
        boxes = held.get(path, {})
        lattice = _lattice(shape, boxes)
        _check_coverage(path, shape, boxes, tiled=lattice is not None)
        arrays = _arrays_for(path, dtype, shape, itemsize, boxes, options, grid=lattice)
        plan.tensors[path] = TensorSpec(path, dtype, shape, tuple(a for a, _ in arrays))
        for array, array_boxes in arrays:
            _assign_cells(plan, array, itemsize, array_boxes, written)
    plan.plan_id = hashlib.sha256(
        json.dumps(list(inventories), sort_keys=True).encode()).hexdigest()[:16]
    return plan


_TILING_CHECK_CELLS = 1 << 22  # the most pieces ``_overlap`` cuts a tensor into


def _lattice(shape: tuple[int, ...], boxes: dict) -> tuple[int, ...] | None:
    """The step of the lattice ``boxes`` are cells of, when they are (each the tensor's part of
    one lattice cell: its offset a multiple of the step, inside the tensor; its shape the
    step, short where the tensor ends), else None. Such boxes never overlap (distinct boxes,
    distinct cells), and once they cover the tensor the step is ``_regular_grid``'s: what the
    regular layouts of ``placement_boxes`` (every ``Shard`` even) give, checked per box in
    0.5 s at 4,096 ranks where ``_overlap``'s grid and ``_regular_grid`` took 3 s."""
    if not boxes:
        return None
    step = tuple(max(box_shape[d] for _, box_shape in boxes) for d in range(len(shape)))
    if not all(step):
        return None
    for d, (c, n) in enumerate(zip(step, shape)):
        if not all(0 <= o[d] < n and o[d] % c == 0 and s[d] == min(c, n - o[d])
                   for o, s in boxes):
            return None
    return step


def _check_coverage(path: str, shape: tuple[int, ...], boxes: dict, *,
                    tiled: bool = False) -> None:
    """The ranks' distinct shards of ``path`` tile its global tensor: no element without a
    holder (it would never be written), none in two different shards (ranks holding it under
    two layouts: its cells would have two owners, and the volumes' sum hide a hole).
    ``tiled``: ``boxes`` are the cells of a lattice (``_lattice``), which cannot overlap."""
    total = math.prod(shape)
    covered = sum(math.prod(box_shape) for _, box_shape in boxes)
    if total and covered < total:
        raise CheckpointError(f"state path {path!r}: the ranks' shards cover {covered} of "
                              f"{total} elements of the global tensor")
    if total and (covered > total or (not tiled and _overlap(shape, boxes))):
        raise CheckpointError(f"state path {path!r}: the ranks' shards overlap (the ranks hold "
                              "it under different layouts): " + ", ".join(
                                  f"{list(o)}+{list(s)}" for o, s in sorted(boxes)[:8]))


def _overlap(shape: tuple[int, ...], boxes: dict) -> bool:
    """Whether two of ``boxes`` (as many elements in all as the tensor) share an element:
    each is laid on the grid of every shard's edges, and a piece of that grid under two shards
    is the answer. Always False where that grid would have over ``_TILING_CHECK_CELLS``
    pieces (shards of misaligned layouts, thousands on each side): not checked there."""
    import numpy as np

    edges = [sorted({0, n, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
             for d, n in enumerate(shape)]
    if math.prod(len(e) - 1 for e in edges) > _TILING_CHECK_CELLS:
        return False
    index = [{x: i for i, x in enumerate(e)} for e in edges]
    count = np.zeros([len(e) - 1 for e in edges], dtype=np.int32)
    for offset, box_shape in boxes:
        count[tuple(slice(ix[o], ix[o + s]) for ix, o, s in zip(index, offset, box_shape))] += 1
    return bool((count > 1).any())


def _cells(shape: Sequence[int], cell: Sequence[int]) -> int:
    return math.prod(math.ceil(n / c) for n, c in zip(shape, cell))


def _arrays_for(path: str, dtype: str, shape: tuple[int, ...], itemsize: int, boxes: dict,
                options: PlanOptions, *, grid: tuple[int, ...] | None = None
                ) -> list[tuple[ArraySpec, dict]]:
    """The arrays ``path`` is stored as, each with its boxes; ``grid``: the boxes' lattice
    step (``_lattice``) where they are one, which is the regular grid they give."""
    name = path
    replicas = max((len(h) for h in boxes.values()), default=1)
    if not shape:
        spec = ArraySpec(name, path, (), (), dtype, (), 1)
        return [(spec, boxes)]
    if grid is None:
        grid = _regular_grid(shape, boxes)
    limit = options.max_cells_per_box * max(len(boxes), 1)
    if _cells(shape, grid) <= limit:
        box_bytes = max((math.prod(s) for _, s in boxes), default=0) * itemsize
        cell, inner = _refine(shape, grid, itemsize, replicas, box_bytes, options)
        regular = [(ArraySpec(name, path, (0,) * len(shape), shape, dtype, cell, inner), boxes)]
        if _cells(shape, cell) <= limit:
            return regular
        # split to the object cap (or among replicas), a box edge with no divisor near the
        # cell size (a prime number of rows per shard) leaves cells of one row: one array per
        # box is then split to that size instead (its last cell short)
        pieces = _pieces(path, dtype, itemsize, boxes, options)
        if _cells(shape, cell) <= options.max_cells_per_box * sum(
                _cells(spec.shape, spec.shard_shape) for spec, _ in pieces):
            return regular
        return pieces
    return _pieces(path, dtype, itemsize, boxes, options)


def _pieces(path: str, dtype: str, itemsize: int, boxes: dict, options: PlanOptions
            ) -> list[tuple[ArraySpec, dict]]:
    """One array per box (``<path>/piece_<i>``), each split on its own."""
    name = path
    out = []
    for i, ((offset, box_shape), holders) in enumerate(sorted(boxes.items())):
        grid, inner = _refine(box_shape, tuple(max(s, 1) for s in box_shape), itemsize,
                              len(holders), math.prod(box_shape) * itemsize, options)
        spec = ArraySpec(f"{name}/piece_{i}", path, offset, box_shape, dtype, grid, inner)
        out.append((spec, {(offset, box_shape): holders}))
    return out


# a box's cells along one dim: indices, key parts, in-bounds sizes, offsets from the box's
# start; and the sizes' sum, -1 when one is not positive (out of bounds)
_Axis = tuple[list[int], list[str], list[int], list[int], int]


@dataclass(frozen=True, slots=True)
class _BoxCells:
    """The cells of one box of ``array`` that one rank writes: their ``CellWrite`` fields
    are the product of ``per_dim`` (indices, key parts, in-bounds sizes, offsets from the
    box's start), made when the rank's writes are first asked for."""

    array: ArraySpec
    per_dim: list[_Axis]
    local: tuple[int, ...]  # where the box starts in the holder's local tensor
    itemsize: int

    def keys(self) -> Iterable[str]:
        prefix = self.array.key_prefix()
        return map(prefix.__add__, map("".join, product(*(a[1] for a in self.per_dim))))

    def writes(self) -> Iterable[CellWrite]:
        valid = list(product(*(a[2] for a in self.per_dim)))
        starts = product(*([lo + x for x in a[3]] for lo, a in zip(self.local, self.per_dim)))
        nbytes = map(functools.partial(math.prod, start=self.itemsize), valid)
        return map(CellWrite, repeat(self.array), product(*(a[0] for a in self.per_dim)),
                   self.keys(), valid, starts, nbytes)


class CellWrites(Mapping[int, list[CellWrite]]):
    """Every rank's writes (rank -> its ``CellWrite`` in plan order), each rank's made when
    first asked for: a saving rank stages only its own, the coordinator checks every rank's
    keys (``keys_of``, kept once made), ``metadata_owners`` counts them (``count``). Making
    all 620,432 at 4,096 ranks took 1.4 s of ``build_plan`` on every rank, for the ~150 it
    stages."""

    def __init__(self, world: int) -> None:
        self._parts: list[list[CellWrite | _BoxCells]] = [[] for _ in range(world)]
        self._counts = [0] * world
        self._made: dict[int, list[CellWrite]] = {}
        self._keys: dict[int, list[str]] = {}  # the coordinator asks at every commit

    def add(self, rank: int, part: CellWrite | _BoxCells, count: int) -> None:
        self._parts[rank].append(part)
        self._counts[rank] += count

    def count(self, rank: int) -> int:
        return self._counts[rank] if 0 <= rank < len(self._counts) else 0

    def keys_of(self, rank: int) -> set[str]:
        keys = self._keys.get(rank)
        if keys is None:
            if rank in self._made or not 0 <= rank < len(self._parts):
                return {w.key for w in self.get(rank, [])}
            keys = []  # published whole: another thread may ask meanwhile
            for part in self._parts[rank]:
                keys.extend(part.keys() if isinstance(part, _BoxCells) else (part.key,))
            self._keys[rank] = keys
        return set(keys)

    def __getitem__(self, rank: int) -> list[CellWrite]:
        made = self._made.get(rank)
        if made is None:
            if not (isinstance(rank, int) and 0 <= rank < len(self._parts)):
                raise KeyError(rank)
            made = []  # published whole: another thread may ask meanwhile
            for part in self._parts[rank]:
                made.extend(part.writes() if isinstance(part, _BoxCells) else (part,))
            self._made[rank] = made
        return made

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._parts)))

    def __len__(self) -> int:
        return len(self._parts)


def _assign_cells(plan: GlobalPlan, array: ArraySpec, itemsize: int, boxes: dict,
                  written: list[int]) -> None:
    """Give every cell of ``array`` one owner among the ranks that hold it (least bytes first).

    A box's cells along each dim (indices, key parts, in-bounds sizes, offsets from the box's
    start) are worked out once per edge pair, shared by the boxes that have it (a dp x tp
    grid of boxes has dp + tp); a box held by one rank is given to it whole, its bytes the
    product of the dims' sums, its ``CellWrite`` made only when asked for (``CellWrites``)."""
    shard, shape, origin = array.shard_shape, array.shape, array.offset
    writes = plan.writes
    axes: dict[tuple[int, int, int], _Axis] = {}

    def axis(d: int, r: int, s: int) -> _Axis:
        got = axes.get((d, r, s))
        if got is None:
            c, n = shard[d], shape[d]
            cells = list(range(r // c, math.ceil((r + s) / c)))
            valid = [min(c, n - i * c) for i in cells]
            got = axes[d, r, s] = (cells, [array.key_part(i) for i in cells], valid,
                                   [i * c - r for i in cells],
                                   sum(valid) if all(v > 0 for v in valid) else -1)
        return got

    for (offset, box_shape), holders in sorted(boxes.items()):
        per_dim = [axis(d, o - a, s)
                   for d, (o, a, s) in enumerate(zip(offset, origin, box_shape))]
        if len(holders) == 1:
            rank, local = holders[0]
            count = math.prod(len(a[0]) for a in per_dim)
            if all(a[4] >= 0 for a in per_dim):  # the sum of the cells' sizes' products
                nbytes = itemsize * math.prod(a[4] for a in per_dim)
            else:  # an empty cell counts as one byte written
                nbytes = sum(max(math.prod(v) * itemsize, 1)
                             for v in product(*(a[2] for a in per_dim)))
            written[rank] += nbytes
            writes.add(rank, _BoxCells(array, per_dim, local, itemsize), count)
            continue
        box = _BoxCells(array, per_dim, (0,) * len(per_dim), itemsize)
        for write in box.writes():
            rank, local = min(holders, key=lambda h: (written[h[0]], h[0]))
            written[rank] += max(write.nbytes, 1)
            writes.add(rank, replace(write, local_offset=tuple(
                map(operator.add, local, write.local_offset))), 1)
