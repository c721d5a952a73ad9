"""Checkpoint benchmark: the engine against memcpy, O_DIRECT, torch.save, DCP and torchsnapshot.

    python -m bench.engine [--size-gib 2.0] [--dir DIR] [--quick] [--reps N] [--json PATH]

One run measures, on a GPT-like fp32 state (model weights + Adam moments, 30 tensors of mixed
shapes) on local disk:

1. stall: wall time until ``save()`` returns, against a plain ``copy_`` of the state into
   preallocated tensors and DCP ``async_save``;
2. persist throughput (payload bytes / seconds until durable, fsync included) against an
   O_DIRECT sequential write of the same bytes, ``torch.save`` + fsync, DCP ``save`` and
   torchsnapshot ``Snapshot.take``;
3. load throughput against DCP ``load``, and a resharded load (a checkpoint written by two gloo
   processes holding ``Shard(0)`` DTensor halves, read into plain tensors) against a same-layout
   load.

Methods run round-robin within each repetition (so slow drift of the disk hits all alike), the
page cache is dropped before every timed run when the process may write
``/proc/sys/vm/drop_caches``, and medians are reported with their spread. The stall target uses
per-repetition pairs (each save right after its memcpy): memory bandwidth on a shared VM drifts.
The CPU other processes used during the run is reported, so a number taken on a busy machine
says so. Every file is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from antifragile.engine import CheckpointEngine
from antifragile.engine._paths import step_dir

GIB = 2**30
DIRECT_BLOCK_BYTES = 64 * 2**20
_OPTIM_MOMENTS = ("exp_avg", "exp_avg_sq")

# key -> (section, what was measured, shown as throughput of the payload)
ROWS: dict[str, tuple[str, str, bool]] = {
    "memcpy": ("stall", "memcpy: copy_ of the state into preallocated tensors", False),
    "stall": ("stall", "engine save(): wall time until it returned", False),
    "staging": ("stall", "engine handle.stall_s (its staging copy alone)", False),
    "dcp_stall": ("stall", "DCP async_save: wall time until it returned", False),
    "persist": ("persist", "engine: save() call until committed (fsync'd)", True),
    "direct": ("persist", "O_DIRECT sequential write, 64 MiB blocks, fsync", True),
    "torch_save": ("persist", "torch.save to one file + fsync", True),
    "dcp_save": ("persist", "DCP save (fsyncs its files) + os.sync", True),
    "dcp_async_total": ("persist", "DCP async_save call until its future is done + os.sync", True),
    "torchsnapshot": ("persist", "torchsnapshot Snapshot.take + os.sync", True),
    "load": ("load", "engine load(), same layout (saved by this process)", True),
    "dcp_load": ("load", "DCP load into the same plain tensors", True),
    "resharded": ("load", "engine load(), resharded (saved by 2 ranks as Shard(0))", True),
}


@dataclass(kw_only=True, slots=True)
class Row:
    """One measured figure: the median of ``samples`` (seconds), shown as time or GiB/s."""

    key: str
    section: str
    what: str
    samples: list[float]
    nbytes: int = 0  # when set, the row is a throughput: nbytes / median seconds
    note: str = ""

    @property
    def seconds(self) -> float:
        return statistics.median(self.samples)

    @property
    def gib_s(self) -> float:
        return self.nbytes / GIB / self.seconds


@dataclass(frozen=True, slots=True)
class Ratio:
    """Row ``ours`` against row ``theirs``: throughput over throughput, or for stalls seconds
    over seconds. ``paired``: the median of per-repetition ratios (the rows' samples were taken
    side by side), else the ratio of the medians. ``at_most`` / ``at_least`` make it a target."""

    what: str
    ours: str
    theirs: str
    at_most: float | None = None
    at_least: float | None = None
    paired: bool = False
    value: float = math.nan

    @property
    def target(self) -> str:
        if self.at_most is not None:
            return f"target <= {self.at_most}x"
        return f"target >= {self.at_least}x" if self.at_least is not None else ""

    @property
    def verdict(self) -> str:
        if self.at_most is not None:
            return "PASS" if self.value <= self.at_most else "MISS"
        if self.at_least is not None:
            return "PASS" if self.value >= self.at_least else "MISS"
        return "info"


RATIOS = [
    Ratio("stall: engine save() / memcpy", "stall", "memcpy", at_most=1.1, paired=True),
    Ratio("stall: engine save() / DCP async_save", "stall", "dcp_stall"),
    Ratio("persist: engine / O_DIRECT sequential write", "persist", "direct", at_least=0.9),
    Ratio("persist: engine / DCP save", "persist", "dcp_save", at_least=1.5),
    Ratio("persist: engine / torch.save", "persist", "torch_save"),
    Ratio("persist: engine / torchsnapshot", "persist", "torchsnapshot"),
    Ratio("load: engine / DCP load", "load", "dcp_load", at_least=1.2),
    Ratio("load: engine resharded / same layout", "resharded", "load", at_least=0.9,
          paired=True),
]

# The loads of one repetition, in turn: the two engine loads side by side (their ratio is
# paired), each one first, and each one right after the DCP load, as often as the other.
LOAD_ORDERS = (
    ("load", "resharded", "dcp_load"),
    ("dcp_load", "resharded", "load"),
    ("resharded", "load", "dcp_load"),
    ("dcp_load", "load", "resharded"),
)


@dataclass(kw_only=True, slots=True)
class Report:
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)


# --- the state -------------------------------------------------------------------------------


def model_dim(size_bytes: float) -> int:
    """The width ``d`` whose state (see :func:`param_shapes`) is about ``size_bytes``."""
    d = math.sqrt(size_bytes / (3 * 4 * 40))  # 3 copies (param + 2 moments), fp32, 40 d^2 params
    return max(64, round(d / 64) * 64)


def param_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    """A 2-block GPT: a 16d-token embedding, fused qkv, output and MLP matrices, a final norm."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (16 * d, d))]
    for i in range(2):
        shapes += [
            (f"layers.{i}.attn.wqkv.weight", (3 * d, d)),
            (f"layers.{i}.attn.wo.weight", (d, d)),
            (f"layers.{i}.mlp.w1.weight", (4 * d, d)),
            (f"layers.{i}.mlp.w2.weight", (d, 4 * d)),
        ]
    return [*shapes, ("norm.weight", (d,))]


def gpt_like_state(d: int, *, seed: int = 0) -> dict[str, Any]:
    """``{"model": {...}, "optim": {"exp_avg": {...}, "exp_avg_sq": {...}, "step": 0}}``,
    every tensor ``randn`` from its own seeded generator (the same values on every call)."""
    groups = ("model", *_OPTIM_MOMENTS)
    out: dict[str, dict[str, Any]] = {g: {} for g in groups}
    index = 0
    for group in groups:
        for name, shape in param_shapes(d):
            generator = torch.Generator().manual_seed(seed + index)
            out[group][name] = torch.randn(shape, generator=generator)
            index += 1
    optim = {m: out[m] for m in _OPTIM_MOMENTS}
    return {"model": out["model"], "optim": {**optim, "step": 0}}


def map_tensors(state: dict[str, Any], fn: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """A copy of the nested dict ``state`` with ``fn`` applied to every tensor."""
    return {
        k: map_tensors(v, fn)
        if isinstance(v, dict)
        else fn(v)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in state.items()
    }


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found += tensors_of(value)
    return found


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


# --- environment -----------------------------------------------------------------------------


def _write_proc(path: str, text: str) -> bool:
    """Write ``text`` to a /proc control file; False when this process may not."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        return False
    return True


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False when this process may not."""
    os.sync()
    return _write_proc("/proc/sys/vm/drop_caches", "3\n")


def filesystem_type(path: str) -> str:
    """The type of the mount holding ``path`` (``ext4``, ``tmpfs``...), from /proc/mounts."""
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind, *_ = line.split()
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                    best
                ):
                    best, fstype = mount, kind
    except OSError:
        pass
    return fstype


def default_parent() -> str:
    """/var/tmp when it is on a real disk (it usually is), else /tmp."""
    return "/var/tmp" if filesystem_type("/var/tmp") != "tmpfs" else "/tmp"


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Machine-wide busy and steal seconds (/proc/stat) and this process tree's CPU seconds."""

    busy_s: float
    steal_s: float
    own_s: float
    wall_s: float

    @staticmethod
    def now() -> CpuTimes:
        hz = os.sysconf("SC_CLK_TCK")
        try:
            with open("/proc/stat") as f:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                    int, f.readline().split()[1:9]
                )
        except (OSError, ValueError):
            user = nice = system = irq = softirq = steal = 0
        own = sum(
            u.ru_utime + u.ru_stime
            for u in (
                resource.getrusage(resource.RUSAGE_SELF),
                resource.getrusage(resource.RUSAGE_CHILDREN),
            )
        )
        busy = (user + nice + system + irq + softirq) / hz
        return CpuTimes(busy, steal / hz, own, time.monotonic())

    def since(self, start: CpuTimes) -> str:
        """What else used the machine between ``start`` and this snapshot."""
        capacity = (self.wall_s - start.wall_s) * (os.cpu_count() or 1)
        foreign = max(0.0, self.busy_s - start.busy_s - (self.own_s - start.own_s))
        steal = self.steal_s - start.steal_s
        line = (
            f"other processes (incl. kernel writeback) used {foreign:.0f} CPU-s of "
            f"{capacity:.0f} ({100 * foreign / capacity:.0f}%); hypervisor steal "
            f"{100 * steal / capacity:.0f}%"
        )
        if foreign > 0.1 * capacity or steal > 0.05 * capacity:
            line += ": the machine was shared, treat the figures with caution"
        return line


@contextmanager
def single_rank_group(root: str) -> Iterator[None]:
    """A 1-rank gloo process group (DCP's async_save requires one), on a FileStore."""
    store = dist.FileStore(os.path.join(root, "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


# --- baselines -------------------------------------------------------------------------------


class DirectWriter:
    """Sequential O_DIRECT writes of ``nbytes`` from a page-aligned buffer in 64 MiB requests.

    The buffer is the engine's staging arena after its first save (the same bytes, laid out as
    the objects it writes), so the baseline needs no memory of its own and no copy inside the
    timing: the figure is what the disk takes for one sequential stream of this size, fsync
    included.
    """

    def __init__(self, buffer: memoryview, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer = buffer

    @staticmethod
    def of(ckpt: CheckpointEngine) -> DirectWriter:
        arena = ckpt._staging.arena if ckpt._staging is not None else None
        if arena is None:
            raise RuntimeError("the engine has not staged yet")
        buffer = memoryview(arena.numpy())  # type: ignore[arg-type]
        return DirectWriter(buffer, len(buffer))

    def write(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            done = 0
            while done < self.nbytes:
                done += os.write(fd, self.buffer[done : done + DIRECT_BLOCK_BYTES])
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.buffer.release()


def torch_save_fsync(state: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def dcp_save_sync(state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)  # FileSystemWriter fsyncs each file (sync_files=True)
    os.sync()  # and the directory entries


def torchsnapshot_take_sync(state: dict[str, Any], path: str) -> None:
    from torchsnapshot import Snapshot, StateDict

    Snapshot.take(path, {k: StateDict(**v) for k, v in state.items()})
    os.sync()  # torchsnapshot's fs plugin does not fsync


def engine_load(url: str, target: dict[str, Any]) -> None:
    with CheckpointEngine(url, keep_last=None) as ckpt:
        ckpt.load(target)


def dcp_async_save(state: dict[str, Any], path: str) -> Future[Any]:
    import torch.distributed.checkpoint as dcp

    response = dcp.async_save(state, checkpoint_id=path)
    return response if isinstance(response, Future) else response.upload_completion


# --- resharding: a checkpoint written by two processes ---------------------------------------


def _sharded_save_worker(rank: int, url: str, store_path: str, state: dict[str, Any]) -> None:
    """Rank ``rank`` of 2: hold the Shard(0) half of every tensor of ``state`` (shared memory,
    not copied) as a DTensor on a 1-D mesh of 2, and save it as step 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def shard(t: torch.Tensor) -> torch.Tensor:
            local = torch.chunk(t, 2, dim=0)[rank]
            return DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
            )

        with CheckpointEngine(url, keep_last=None) as ckpt:
            ckpt.save(1, map_tensors(state, shard), blocking=True)
    finally:
        dist.destroy_process_group()


def save_two_rank_checkpoint(url: str, store_path: str, state: dict[str, Any]) -> float:
    """Spawn a 2-process gloo group on this host that saves ``state`` sharded; its seconds."""
    import torch.multiprocessing as tmp

    shared = map_tensors(state, lambda t: t.clone().share_memory_())
    return timed(
        lambda: tmp.start_processes(
            _sharded_save_worker, args=(url, store_path, shared), nprocs=2, start_method="spawn"
        )
    )


# --- the benchmark ---------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Bench:
    """Runs the measurements into ``report``; ``root`` is a scratch folder it owns."""

    root: str
    reps: int
    peer_budget_s: float
    report: Report
    state: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    dropped: bool = False
    dcp_ckpt: str = ""

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def cold(self) -> None:
        self.dropped = drop_page_cache()

    def write_phase(self) -> None:
        """Stall and persist figures. Each engine save is paired with a memcpy just before it
        (memory bandwidth here drifts by several x within seconds, see the spread)."""
        src, dst = tensors_of(self.state), tensors_of(self.target)

        def memcpy() -> None:
            for a, b in zip(src, dst):
                b.copy_(a)

        memcpy()  # first touch of the destination pages
        samples: dict[str, list[float]] = defaultdict(list)
        ckpt = CheckpointEngine(self.path("engine"), keep_last=None)
        self.cold()
        warm = self._engine_save(ckpt, 0)
        direct = DirectWriter.of(ckpt)
        peers: dict[str, Callable[[str], None]] = {
            "direct": direct.write,
            "torch_save": partial(torch_save_fsync, self.state),
            "dcp_save": partial(dcp_save_sync, self.state),
            "torchsnapshot": partial(torchsnapshot_take_sync, self.state),
        }
        try:
            self.cold()
            warm_dcp = self._dcp_async("warm-up")
            for rep in range(self.reps):
                self.cold()
                samples["memcpy"].append(timed(memcpy))
                for key, value in zip(
                    ("stall", "persist", "staging"), self._engine_save(ckpt, rep + 1)
                ):
                    samples[key].append(value)
                self.cold()
                for key, value in zip(("dcp_stall", "dcp_async_total"), self._dcp_async(str(rep))):
                    samples[key].append(value)
                for name, write in peers.items():
                    if sum(samples[name]) > self.peer_budget_s:
                        continue  # a slow peer gets fewer repetitions, never invented ones
                    out = self.path(f"{name}-{rep}")
                    self.cold()
                    samples[name].append(timed(partial(write, out)))
                    if name == "dcp_save":
                        self._keep_dcp(out)
                    else:
                        remove(out)
            self.report.notes.append(direct_io_note(ckpt))
        finally:
            direct.close()
            ckpt.close()
        self.add_rows(
            samples,
            {
                "stall": f"warm-up save excluded (plan + staging allocation): {warm[0]:.3f} s",
                "dcp_stall": f"warm-up call excluded: {warm_dcp[0]:.3f} s",
                "persist": f"warm-up save: {self.nbytes / GIB / warm[1]:.3f} GiB/s",
            },
        )

    def _keep_dcp(self, path: str) -> None:
        """Keep the newest DCP checkpoint (the load phase reads it), delete the one before."""
        if self.dcp_ckpt:
            remove(self.dcp_ckpt)
        self.dcp_ckpt = path

    def _engine_save(self, ckpt: CheckpointEngine, step: int) -> tuple[float, float, float]:
        """(s until save() returned, s until committed, handle.stall_s); keeps only this step."""
        start = time.perf_counter()
        handle = ckpt.save(step, self.state)
        stall = time.perf_counter() - start
        handle.wait()
        total = time.perf_counter() - start
        if step > 0:
            remove(os.path.join(ckpt.url, step_dir(step - 1)))
        return stall, total, handle.stall_s

    def _dcp_async(self, tag: str) -> tuple[float, float]:
        """(s until async_save returned, s until its future was done + os.sync)."""
        out = self.path(f"dcp-async-{tag}")
        start = time.perf_counter()
        future = dcp_async_save(self.state, out)
        stall = time.perf_counter() - start
        future.result()
        os.sync()
        total = time.perf_counter() - start
        remove(out)
        return stall, total

    def add_rows(
        self, samples: dict[str, list[float]], notes: dict[str, str] | None = None
    ) -> None:
        for key in (k for k in ROWS if k in samples):
            section, what, throughput = ROWS[key]
            values = samples[key]
            self.report.rows.append(
                Row(
                    key=key,
                    section=section,
                    what=what,
                    samples=values,
                    nbytes=self.nbytes if throughput else 0,
                    note=(notes or {}).get(key, ""),
                )
            )

    def load_phase(self) -> None:
        resharded_url = self.path("engine-2rank")
        setup_s = save_two_rank_checkpoint(resharded_url, self.path("store-2rank"), self.state)
        self.report.notes.append(
            f"resharding: {resharded_url} was saved by 2 spawned gloo processes, each holding the "
            f"Shard(0) half of every tensor as a DTensor on a 1-D mesh of 2 ({setup_s:.1f} s incl."
            " spawn); it is loaded here into plain tensors (2 ranks -> 1). Same-layout: the "
            "checkpoint this process saved from the same plain tensors."
        )
        import torch.distributed.checkpoint as dcp

        loaders: dict[str, Callable[[], object]] = {
            "load": partial(engine_load, self.path("engine"), self.target),
            "dcp_load": partial(dcp.load, self.target, checkpoint_id=self.dcp_ckpt),
            "resharded": partial(engine_load, resharded_url, self.target),
        }
        samples: dict[str, list[float]] = {k: [] for k in loaders}
        for rep in range(self.reps):
            for name in LOAD_ORDERS[rep % len(LOAD_ORDERS)]:
                for t in tensors_of(self.target):
                    t.zero_()
                self.cold()
                samples[name].append(timed(loaders[name]))
                self._check_target(name)
        self.add_rows(samples)
        self.report.notes.append(
            "load order per repetition cycles through " + "; ".join(
                " -> ".join(order) for order in LOAD_ORDERS) + " (on a 2-core VM the load "
            "run right after a DCP load took 20-27% longer, whichever checkpoint it read; a "
            "fixed order put the resharded load there every time)")

    def _check_target(self, name: str) -> None:
        for a, b in zip(tensors_of(self.state), tensors_of(self.target)):
            if not torch.equal(a, b):
                raise RuntimeError(f"{name} load returned different values")


def direct_io_note(ckpt: CheckpointEngine) -> str:
    """How the engine's local storage wrote: O_DIRECT or through the page cache."""
    local = getattr(ckpt.storage, "inner", ckpt.storage)
    direct, buffered = getattr(local, "direct_bytes", 0), getattr(local, "buffered_bytes", 0)
    total = max(direct + buffered, 1)
    if getattr(local, "direct_io", None) is False:
        return (f"engine writes were BUFFERED: the file system refused O_DIRECT "
                f"({buffered / GIB:.2f} GiB through the page cache)")
    return (f"engine writes: {100 * direct / total:.2f}% of {total / GIB:.2f} GiB with O_DIRECT, "
            f"the rest (object tails, metadata, records) through the page cache")


def ratio_value(ours: Row, theirs: Row, *, paired: bool) -> float:
    """How many times better-or-worse ``ours`` is: GiB/s over GiB/s, or seconds over seconds."""
    if paired:
        pairs = zip(ours.samples, theirs.samples, strict=True)
        per_rep = [(b / a if ours.nbytes else a / b) for a, b in pairs]
        return statistics.median(per_rep)
    return ours.gib_s / theirs.gib_s if ours.nbytes else ours.seconds / theirs.seconds


def add_ratios(report: Report) -> None:
    for spec in RATIOS:
        value = ratio_value(report.row(spec.ours), report.row(spec.theirs), paired=spec.paired)
        report.ratios.append(replace(spec, value=value))


def render(report: Report) -> str:
    lines = [
        f"checkpoint benchmark: {report.config['payload_gib']:.3f} GiB fp32 payload, "
        f"{report.config['tensors']} tensors (d={report.config['d']}), "
        f"{report.config['reps']} repetition(s), medians; dir {report.config['dir']} "
        f"({report.config['fstype']})"
    ]
    section = ""
    for row in report.rows:
        if row.section != section:
            section = row.section
            lines.append(f"\n[{section}]")
        figure = (
            f"{row.gib_s:7.3f} GiB/s ({row.seconds:7.3f} s)"
            if row.nbytes
            else f"{row.seconds:7.3f} s" + " " * 12
        )
        spread = f"[{min(row.samples):.3f}-{max(row.samples):.3f} s]"
        note = f"  {row.note}" if row.note else ""
        lines.append(f"  {row.what:<56} {figure} n={len(row.samples)} {spread}{note}")
    lines.append("\n[ratios]")
    for r in report.ratios:
        how = "median of per-rep ratios" if r.paired else "ratio of medians"
        lines.append(
            f"  ratio {r.what:<44} {r.value:6.3f}x  {r.target:<16} {r.verdict:<4}  ({how})"
        )
    if report.notes:
        lines.append("\n[notes]")
        lines += [f"  - {note}" for note in report.notes]
    return "\n".join(lines)


def run(size_gib: float, parent: str, reps: int, peer_budget_s: float) -> Report:
    d = model_dim(size_gib * GIB)
    root = tempfile.mkdtemp(prefix="antifragile-bench-", dir=parent)
    report = Report(
        config={
            "size_gib": size_gib,
            "d": d,
            "reps": reps,
            "dir": root,
            "fstype": filesystem_type(root),
        }
    )
    cpu_start = CpuTimes.now()
    try:
        with single_rank_group(root):
            state = gpt_like_state(d)
            bench = Bench(
                root=root,
                reps=reps,
                peer_budget_s=peer_budget_s,
                report=report,
                state=state,
                target=map_tensors(state, torch.empty_like),
                nbytes=state_nbytes(state),
            )
            report.config |= {"payload_gib": bench.nbytes / GIB, "tensors": len(tensors_of(state))}
            bench.write_phase()
            bench.load_phase()
        if not bench.dropped:
            report.notes.append(
                "page cache NOT dropped (no write access to "
                "/proc/sys/vm/drop_caches): loads may be served from memory"
            )
        else:
            report.notes.append(
                "page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) "
                "before every timed run"
            )
        report.notes.append("throughput = payload bytes (tensor data only) / seconds")
        report.notes.append(CpuTimes.now().since(cpu_start))
        add_ratios(report)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report


# --- scale: how a save grows with the state ---------------------------------------------------


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where not possible."""
    return _write_proc("/proc/self/clear_refs", "5\n")


def peak_rss_bytes() -> int:
    return _proc_status_kib("VmHWM") * 1024


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(kw_only=True, slots=True)
class ScalePoint:
    size_gib: float
    nbytes: int
    staging_nbytes: int
    stall_s: list[float]
    persist_s: list[float]
    direct_s: list[float]
    base_rss: int
    peak_rss: int

    @property
    def persist_gib_s(self) -> float:
        return self.nbytes / GIB / statistics.median(self.persist_s)

    @property
    def direct_ratio(self) -> float:
        return statistics.median(self.direct_s) / statistics.median(self.persist_s)

    @property
    def s_per_gib(self) -> float:
        return statistics.median(self.persist_s) / (self.nbytes / GIB)

    @property
    def rss_extra(self) -> float:
        """Peak RSS during the saves beyond the process before the state, the state and the
        staging area, as a fraction of state + staging."""
        held = self.nbytes + self.staging_nbytes
        return (self.peak_rss - self.base_rss - held) / held


def scale_point(size_gib: float, parent: str, reps: int) -> ScalePoint | str:
    """Engine saves of a ``size_gib`` state (blocking staging, committed and fsync'd) and
    O_DIRECT writes of as many bytes from the engine's staging arena, alternating; the peak
    RSS of the timed saves. A string (why) when the machine lacks the memory."""
    need = 2.2 * size_gib * GIB
    if mem_available_bytes() < need:
        return (f"{size_gib:g} GiB skipped: {mem_available_bytes() / GIB:.1f} GiB available, "
                f"needs ~{need / GIB:.1f} (state + staging)")
    root = tempfile.mkdtemp(prefix="antifragile-scale-", dir=parent)
    base = rss_bytes()
    state = gpt_like_state(model_dim(size_gib * GIB))
    nbytes = state_nbytes(state)
    ckpt = CheckpointEngine(os.path.join(root, "engine"), keep_last=None)
    direct: DirectWriter | None = None
    stall, persist, direct_s = [], [], []
    try:
        drop_page_cache()
        ckpt.save(0, state).wait()  # plans and allocates the staging area
        direct = DirectWriter.of(ckpt)
        reset_peak_rss()
        for rep in range(1, reps + 1):
            drop_page_cache()
            start = time.perf_counter()
            handle = ckpt.save(rep, state)
            stall.append(time.perf_counter() - start)
            handle.wait()
            persist.append(time.perf_counter() - start)
            remove(os.path.join(ckpt.url, step_dir(rep - 1)))
            drop_page_cache()
            out = os.path.join(root, "direct")
            direct_s.append(timed(partial(direct.write, out)))
            remove(out)
        peak = peak_rss_bytes()
        staging = ckpt._staging.nbytes if ckpt._staging is not None else 0
    finally:
        if direct is not None:
            direct.close()
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
    return ScalePoint(size_gib=size_gib, nbytes=nbytes, staging_nbytes=staging, stall_s=stall,
                      persist_s=persist, direct_s=direct_s, base_rss=base, peak_rss=peak)


def render_scale(points: list[ScalePoint | str]) -> str:
    lines = ["[scale] engine save() until committed vs state size (blocking staging; O_DIRECT "
             "sequential write of the same bytes from the staging arena; medians)",
             f"  {'size':>8} {'stall':>8} {'persist':>9} {'GiB/s':>7} {'O_DIRECT':>9} "
             f"{'ratio':>6} {'s/GiB':>7}  peak RSS during saves (over process + state + staging)"]
    done = [p for p in points if isinstance(p, ScalePoint)]
    for p in points:
        if isinstance(p, str):
            lines.append(f"  {p}")
            continue
        rss_verdict = "PASS" if p.rss_extra <= 0.10 else "MISS"
        lines.append(
            f"  {p.nbytes / GIB:6.2f}Gi {statistics.median(p.stall_s):7.3f}s "
            f"{statistics.median(p.persist_s):8.3f}s {p.persist_gib_s:7.3f} "
            f"{statistics.median(p.direct_s):8.3f}s {p.direct_ratio:5.2f}x {p.s_per_gib:6.3f}s"
            f"  {p.peak_rss / GIB:6.2f} GiB ({100 * p.rss_extra:+.1f}%, target <= 10% "
            f"{rss_verdict})")
    if len(done) > 1:
        per_gib = [p.s_per_gib for p in done]
        growth = max(per_gib) / min(per_gib)
        verdict = "PASS" if growth <= 1.5 else "MISS"
        lines.append(f"  ratio s/GiB largest / smallest {growth:6.3f}x  target <= 1.5x (linear, "
                     f"no cliff) {verdict}")
    return "\n".join(lines)


def to_json(report: Report) -> dict[str, Any]:
    rows = [
        asdict(r) | {"seconds": r.seconds, "gib_s": r.gib_s if r.nbytes else None}
        for r in report.rows
    ]
    ratios = [asdict(r) | {"verdict": r.verdict} for r in report.ratios]
    return {"config": report.config, "notes": report.notes, "rows": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--size-gib", type=float, help="state size in GiB (default 2.0; 0.25 with --quick)")
    add("--dir", help="parent of the scratch folder (default /var/tmp: a real disk, not tmpfs)")
    add("--quick", action="store_true", help="smoke run: 0.25 GiB, 1 repetition")
    add("--reps", type=int, help="timed repetitions per method (default 3; 1 with --quick)")
    add(
        "--peer-budget-s",
        type=float,
        default=60.0,
        help="seconds after which a slow baseline stops repeating",
    )
    add("--json", help="also write the results to this file")
    add("--sweep", help="instead: engine save vs O_DIRECT at these sizes in GiB (1,2,4,8), "
        "with peak RSS; no other peers (they would not fit in memory at 8 GiB)")
    args = parser.parse_args(argv)
    if args.sweep:
        parent = args.dir or default_parent()
        points = [scale_point(float(x), parent, args.reps or 1) for x in args.sweep.split(",")]
        print(render_scale(points))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([asdict(p) if isinstance(p, ScalePoint) else p for p in points], f,
                          indent=1)
        return 0
    size = args.size_gib if args.size_gib is not None else (0.25 if args.quick else 2.0)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    parent = args.dir or default_parent()
    os.makedirs(parent, exist_ok=True)
    start = time.perf_counter()
    report = run(size, parent, reps, args.peer_budget_s)
    report.notes.append(f"total benchmark time {time.perf_counter() - start:.1f} s")
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
