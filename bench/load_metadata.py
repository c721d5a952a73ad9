"""What a load costs in metadata at many ranks: the step's COMMIT and group ``zarr.json``,
which every rank parses whole before its first data read (rank 0 reads them; the others get
their bytes from it and read only the COMMIT's head, for the save's nonce).

    python -m bench.load_metadata [--worlds 8,512,4096] [--objects 50,300] [--json PATH]

Driven in one process, as ``tests/test_commit_scale.py`` drives the save: synthetic
inventories of a dp x tp x pp run (tp and pp 2 below 64 ranks, else 8; every rank holds one
(dp, tp) block of each parameter of its stage, and of its AdamW moments; each parameter's step
is a scalar its stage holds replicated; the first stage holds an embedding split along its
rows by tp, then by dp, unevenly (no regular grid: one array per box, as FSDP inside
vocab-parallel TP stores one); one per-rank uint8 tensor and one per-rank value, as a
generator state and a data cursor are), records written and committed by the engine's own
``coordinate`` on an in-memory storage, so the COMMIT and ``zarr.json`` are byte for byte what
a save writes. ``--objects``: the objects each rank writes, about (3 per parameter of its stage).

For each size, one rank's load metadata is timed as ``_fill.fill_step`` does it before any
data read: ``StepReader`` (read the COMMIT, check its seal and every object key; each manifest
entry's digest is checked where a read uses it, not here; read the group ``zarr.json``, check
it against the manifest, parse the tensor index), then ``Sources`` (what fills each target
entry) and the planning of this rank's reads (``read_box``: layouts checked, coverage
proved). Median of ``--reps``, of rank 0 and of the
last rank. Bytes read: what the job reads of the two objects (rank 0 both, whole; every other
rank the COMMIT's head), beside what it read when every rank read both whole. No data is read,
nothing is written to disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from typing import Any

import torch

from antifragile.engine import _format
from antifragile.engine._format import Manifest
from antifragile.engine._paths import record_key, step_dir
from antifragile.engine._ranks import PerRank
from antifragile.engine._restore import Sources
from antifragile.engine._state import FlatState, ValueSlot
from antifragile.engine.commit import (
    MARKER_HEAD,
    coordinate,
    metadata_owners,
    parse_marker,
    read_marker_bytes,
)
from antifragile.engine.load import StepReader
from antifragile.engine.persist import group_layout, rank_record
from antifragile.engine.plan import GlobalPlan, HeldBox, build_plan
from bench._args import at_least

_ROWS = 8  # of each rank's block, per dim: the data is never read, only its layout matters


class MemoryStorage:
    """A dict of objects with the calls ``coordinate`` and ``StepReader`` make; counts the
    bytes read of each key."""

    url = "memory://"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.bytes_read: dict[str, int] = {}
        self.lock = threading.Lock()

    def write(self, key: str, parts: Any, *, durable: bool = False, late: Any = None) -> None:
        with self.lock:
            self.objects[key] = b"".join(bytes(p) for p in parts)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with self.lock:
            if key not in self.objects:
                raise FileNotFoundError(key)
            data = self.objects[key][start:end]
            self.bytes_read[key] = self.bytes_read.get(key, 0) + len(data)
            return data

    def exists(self, key: str) -> bool:
        return key in self.objects

    def list_dir(self, prefix: str) -> list[str]:
        head = prefix.rstrip("/") + "/"
        with self.lock:
            return sorted({k[len(head):].split("/")[0] for k in self.objects
                           if k.startswith(head)})

    def sync(self) -> None:
        pass


def mesh(world: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of ``world`` ranks."""
    tp = pp = 2 if world < 64 else 8
    if world % (tp * pp):
        raise ValueError(f"{world} ranks are no multiple of tp x pp = {tp * pp}")
    return world // (tp * pp), tp, pp


def _coords(rank: int, world: int) -> tuple[int, int, int]:
    """(dp, tp, pp) index of ``rank``: tp fastest, then dp, pp slowest."""
    dp, tp, _ = mesh(world)
    return (rank // tp) % dp, rank % tp, rank // (dp * tp)


def _param(stage: int, index: int) -> str:
    return f"layers.{stage}_{index // 4}.{('attn.wq', 'attn.wo', 'mlp.w1', 'mlp.w2')[index % 4]}" \
           ".weight"


_EMBEDDING = ("model/tok_embeddings.weight", "optim/state.tok_embeddings.weight.exp_avg",
              "optim/state.tok_embeddings.weight.exp_avg_sq")


def _embedding_rows(world: int) -> list[int]:
    """The rows of the embedding each first-stage rank holds, by ``t * dp + d``: uneven,
    without a common divisor."""
    dp, tp, _ = mesh(world)
    return [97 if i % 2 else 101 for i in range(dp * tp)]


def _embedding_box(world: int, d: int, t: int) -> HeldBox:
    dp, _, _ = mesh(world)
    rows = _embedding_rows(world)
    i = t * dp + d
    return HeldBox((sum(rows[:i]), 0), (rows[i], _ROWS), (0, 0))


def inventories(world: int, params: int) -> list[dict[str, Any]]:
    """Every rank's inventory (``plan.inventory``'s form): ``params`` parameters per stage."""
    dp, tp, _ = mesh(world)
    out = []
    for rank in range(world):
        d, t, stage = _coords(rank, world)
        block = [[[d * _ROWS, t * _ROWS], [_ROWS, _ROWS], [0, 0]]]
        tensors: dict[str, Any] = {
            "rng": {"dtype": "uint8", "shape": [16], "boxes": [[[0], [16], [0]]]}}
        if stage == 0:
            box = _embedding_box(world, d, t)
            for path in _EMBEDDING:
                tensors[path] = {"dtype": "float32",
                                 "shape": [sum(_embedding_rows(world)), _ROWS],
                                 "boxes": [[list(box.offset), list(box.shape), [0, 0]]]}
        for i in range(params):
            name = _param(stage, i)
            for path in (f"model/{name}", f"optim/state.{name}.exp_avg",
                         f"optim/state.{name}.exp_avg_sq"):
                tensors[path] = {"dtype": "float32", "shape": [dp * _ROWS, tp * _ROWS],
                                 "boxes": block}
            tensors[f"optim/state.{name}.step"] = {"dtype": "float32", "shape": [],
                                                   "boxes": [[[], [], []]]}
        out.append({"tensors": tensors, "plain": ["rng"] + [
            p for p in tensors if p.endswith(".step")],
            "values": ["train/step", "train/data_cursor", "train/seed", "loader/offset"]})
    return out


def committed(world: int, params: int) -> tuple[MemoryStorage, GlobalPlan]:
    """A step committed by ``coordinate`` from every rank's record, as a save leaves it."""

    step, nonce = 1, 7
    per_rank = PerRank(inventories(world, params), 0, sticky=["rng"])
    plan = build_plan(per_rank.plan_inventories())
    storage = MemoryStorage()
    owners = metadata_owners(plan, set())
    for rank in range(world):
        manifest = Manifest(nonce)
        for write in plan.writes[rank]:
            manifest.add(write.key, write.nbytes + 16 * (1 if write.array.shape else 0),
                         [1, 2] if write.array.shape else [1])
        values = {"train/step": step, "train/data_cursor": 4096 * step, "train/seed": 0,
                  "loader/offset": 1000 * rank}
        storage.write(record_key(step, rank), [_format.seal(rank_record(
            step=step, rank=rank, plan_id=plan.plan_id, nonce=nonce, manifest=manifest,
            values=values))])
    layout = group_layout(plan, FlatState({}, {}), world, per_rank.index())
    attrs = {"step": step, "layout": layout["layout"], "metadata": {},
             "tensors": layout["tensors"], "per_rank": layout["per_rank"]}
    coordinate(storage, plan=plan, step=step, nonce=nonce, deadline=time.monotonic() + 3600,
               group_attrs=attrs, owners=owners)
    return storage, plan


def load_metadata(storage: MemoryStorage, world: int, params: int, rank: int
                  ) -> dict[str, float]:
    """One rank's metadata work before its first data read (``_fill.fill_step``'s), timed by
    phase: ``StepReader``, ``Sources`` and the read planning; and, apart, the part of
    ``StepReader`` that reads and checks the COMMIT."""
    d, t, stage = _coords(rank, world)
    paths = [f"{kind}{_param(stage, i)}{suffix}" for i in range(params)
             for kind, suffix in (("model/", ""), ("optim/state.", ".exp_avg"),
                                  ("optim/state.", ".exp_avg_sq"))]
    scalars = [f"optim/state.{_param(stage, i)}.step" for i in range(params)]
    target = FlatState({p: torch.empty(0) for p in (*paths, *scalars, "rng", *(
                            _EMBEDDING if stage == 0 else ()))},
                       {p: ValueSlot(None, lambda _: None) for p in (
                           "train/step", "train/data_cursor", "train/seed", "loader/offset")})
    boxes = {path: HeldBox((d * _ROWS, t * _ROWS), (_ROWS, _ROWS), (0, 0)) for path in paths}
    if stage == 0:
        paths += _EMBEDDING
        boxes.update((path, _embedding_box(world, d, t)) for path in _EMBEDDING)
    t0 = time.perf_counter()
    parse_marker(read_marker_bytes(storage, 1), 1, lazy=True)  # as StepReader does
    t1 = time.perf_counter()
    storage.bytes_read.clear()
    reader = StepReader(storage, 1)
    t2 = time.perf_counter()
    sources = Sources(reader, target, rank)
    t3 = time.perf_counter()
    reads = 0
    for path in paths:
        out = torch.empty(boxes[path].shape)
        reads += len(reader.read_box(reader.tensors[sources.fill[path]], boxes[path], out))
    t4 = time.perf_counter()
    assert reads == len(paths), reads
    return {"commit_s": t1 - t0, "reader_s": t2 - t1, "sources_s": t3 - t2, "plan_s": t4 - t3,
            "bytes_read": sum(storage.bytes_read.values())}


def run(world: int, objects: int, reps: int) -> dict[str, Any]:
    params = max(1, round(objects / 3))
    t0 = time.perf_counter()
    storage, plan = committed(world, params)
    setup_s = time.perf_counter() - t0
    written = sum(len(w) for w in plan.writes.values())
    del plan
    gc.collect()  # what a collection walks while a rank parses is that rank's, not the setup's
    commit = storage.objects[f"{step_dir(1)}/COMMIT"]
    group = storage.objects[f"{step_dir(1)}/zarr.json"]
    timings: dict[int, list[dict[str, float]]] = {}
    for rank in (0, world - 1):
        timings[rank] = [load_metadata(storage, world, params, rank) for _ in range(reps)]
    per_rank = {rank: {k: statistics.median(s[k] for s in samples) for k in samples[0]}
                for rank, samples in timings.items()}
    slowest = max(per_rank.values(), key=lambda m: m["reader_s"] + m["sources_s"] + m["plan_s"])
    bytes_read = int(slowest["bytes_read"])  # of both objects, whole
    head = min(len(commit), MARKER_HEAD)
    return {"world": world, "mesh_dp_tp_pp": list(mesh(world)),
            "objects_per_rank": round(written / world, 1),
            "commit_bytes": len(commit), "group_zarr_json_bytes": len(group),
            "rank_load_metadata_s": slowest["reader_s"] + slowest["sources_s"]
            + slowest["plan_s"],
            "phases_s": {k: slowest[k] for k in ("commit_s", "reader_s", "sources_s", "plan_s")},
            "job_bytes_read": bytes_read + (world - 1) * head,
            "job_bytes_read_every_rank_whole": bytes_read * world,
            "setup_s": setup_s}


def _list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"give whole numbers >= 1 separated by commas, "
                                         f"got {text!r}")
    return values


def worlds(text: str) -> list[int]:
    """World sizes (``_list``), each one that ``mesh`` lays out."""
    values = _list(text)
    for world in values:
        try:
            mesh(world)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load_metadata",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=worlds, default=[8, 512, 4096],
                        help="world sizes (multiples of 8, and of 64 from 64 on)")
    parser.add_argument("--objects", type=_list, default=[50, 300],
                        help="objects each rank writes, about")
    parser.add_argument("--reps", type=at_least(1), default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    print(f"{'ranks':>6} {'obj/rank':>8} {'COMMIT':>10} {'zarr.json':>10} {'rank s':>8} "
          f"{'(reader':>8} {'COMMIT':>7} {'sources':>7} {'plan)':>7} {'job reads':>10} "
          f"{'(all whole)':>11}")
    results = []
    for objects in args.objects:
        for world in args.worlds:
            r = run(world, objects, args.reps)
            results.append(r)
            p = r["phases_s"]
            print(f"{r['world']:>6} {r['objects_per_rank']:>8} {_size(r['commit_bytes']):>10} "
                  f"{_size(r['group_zarr_json_bytes']):>10} {r['rank_load_metadata_s']:>8.3f} "
                  f"{p['reader_s']:>8.3f} {p['commit_s']:>7.3f} {p['sources_s']:>7.3f} "
                  f"{p['plan_s']:>7.3f} {_size(r['job_bytes_read']):>10} "
                  f"{_size(r['job_bytes_read_every_rank_whole']):>11}", flush=True)
    print("rank s: one rank's load metadata before its first data read (median of "
          f"{args.reps}, the slower of rank 0 and the last) = reader (StepReader: the COMMIT "
          "and zarr.json) + sources + plan (its reads); COMMIT: the part of reader that "
          "reads and checks the COMMIT; job reads: the job's reads of the two objects (rank 0 "
          "both, the others the COMMIT's head), and what every rank read before (both whole)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError


if __name__ == "__main__":
    sys.exit(main())
