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
writers in an order that rotates each repetition and the loads in one that cycles (none always
first, or always right after the same other method), the
page cache is dropped before every timed run when the process may write
``/proc/sys/vm/drop_caches``, and medians are reported with their spread; a target gets its
PASS/MISS only from at least 3 samples a side (``n/a`` with ``--quick``). The stall target uses
per-repetition pairs (each save right after its memcpy): memory bandwidth on a shared VM drifts.
The CPU other processes used during the run is reported, so a number taken on a busy machine
says so. A peer that fails (torchsnapshot not importable; O_DIRECT refused by the file system,
as on tmpfs) is reported as skipped with the reason: no figure, and no verdict against it.
Every file is deleted at the end.

Beside this module: ``_state`` (the state), ``_peers`` (the baselines), ``_machine`` (page cache,
CPU and memory readings), ``scale`` (``--sweep``: how a save grows with the state).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch

from antifragile.engine import CheckpointEngine
from antifragile.engine._paths import step_dir
from bench._args import at_least, finite
from bench._machine import CpuTimes, default_parent, drop_page_cache, filesystem_type, remove, timed
from bench._peers import (
    DirectWriter,
    dcp_async_save,
    dcp_save_sync,
    engine_load,
    fsync_tree,
    save_two_rank_checkpoint,
    single_rank_group,
    torch_save_fsync,
    torchsnapshot_take_sync,
)
from bench._state import gpt_like_state, map_tensors, model_dim, state_nbytes, tensors_of
from bench.scale import render_scale, scale_json, scale_point

GIB = 2**30

# key -> (section, what was measured, shown as throughput of the payload)
ROWS: dict[str, tuple[str, str, bool]] = {
    "memcpy": ("stall", "memcpy: copy_ of the state into preallocated tensors", False),
    "stall": ("stall", "engine save(): wall time until it returned", False),
    "staging": ("stall", "engine handle.stall_s (its staging copy alone)", False),
    "dcp_stall": ("stall", "DCP async_save: wall time until it returned", False),
    "persist": ("persist", "engine: save() call until committed (fsync'd)", True),
    "direct": ("persist", "O_DIRECT sequential write, 64 MiB blocks, fsync", True),
    "torch_save": ("persist", "torch.save to one file + fsync of it and its folder", True),
    "dcp_save": ("persist", "DCP save (fsyncs its files) + fsync of its folders", True),
    "dcp_async_total": ("persist", "DCP async_save call until its future is done + fsyncs", True),
    "torchsnapshot": ("persist", "torchsnapshot Snapshot.take + fsync of each file/folder", True),
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


MIN_SAMPLES = 3  # a target's verdict rests on a median of at least this many samples a side


@dataclass(frozen=True, slots=True)
class Ratio:
    """Row ``ours`` against row ``theirs``: throughput over throughput, or for stalls seconds
    over seconds. ``paired``: the median of per-repetition ratios (the rows' samples were taken
    side by side), else the ratio of the medians. ``at_most`` / ``at_least`` make it a target,
    which gets a verdict only from at least ``MIN_SAMPLES`` samples a side (``n``: the fewer)."""

    what: str
    ours: str
    theirs: str
    at_most: float | None = None
    at_least: float | None = None
    paired: bool = False
    value: float = math.nan
    n: int = 0
    skipped: str = ""  # why a side was not measured: then no figure and no verdict

    @property
    def target(self) -> str:
        if self.at_most is not None:
            return f"target <= {self.at_most}x"
        return f"target >= {self.at_least}x" if self.at_least is not None else ""

    @property
    def verdict(self) -> str:
        if self.skipped:
            return "skipped"
        if (self.at_most is not None or self.at_least is not None) and self.n < MIN_SAMPLES:
            return "n/a"  # a median of one or two samples: no spread to judge it by
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
    skipped: dict[str, str] = field(default_factory=dict)  # row key -> why it was not measured

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)


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
            warm_peers: dict[str, float] = {}
            for name, write in list(peers.items()):
                try:
                    warm_peers[name] = self._warm_up(name, write)
                except Exception as exc:  # a peer that cannot run is skipped, with the reason
                    self.skip(name, "its first (warm-up) call failed: "
                              f"{type(exc).__name__}: {exc}")
                    del peers[name]
            for rep in range(self.reps):
                # the writers' order rotates each repetition, as the loads' cycles: none
                # always first or always right after the same other writer
                writers = ["engine", "dcp_async", *peers]
                shift = rep % len(writers)
                for name in writers[shift:] + writers[:shift]:
                    if name == "engine":  # its memcpy right before it: a paired ratio
                        self.cold()
                        samples["memcpy"].append(timed(memcpy))
                        for key, value in zip(
                            ("stall", "persist", "staging"), self._engine_save(ckpt, rep + 1)
                        ):
                            samples[key].append(value)
                    elif name == "dcp_async":
                        self.cold()
                        for key, value in zip(("dcp_stall", "dcp_async_total"),
                                              self._dcp_async(str(rep))):
                            samples[key].append(value)
                    else:
                        self._time_peer(name, peers, samples, rep)
            self.report.notes.append(direct_io_note(ckpt))
            self.report.notes.append(
                "write order per repetition rotates through engine (its memcpy right before "
                "it) -> dcp_async -> " + " -> ".join(peers) + ", starting one later each time")
        finally:
            direct.close()
            ckpt.close()
        self.add_rows(
            samples,
            {
                "stall": f"warm-up save excluded (plan + staging allocation): {warm[0]:.3f} s",
                "dcp_stall": f"warm-up call excluded: {warm_dcp[0]:.3f} s",
                "persist": f"warm-up save: {self.nbytes / GIB / warm[1]:.3f} GiB/s",
            }
            | {name: f"warm-up call excluded: {s:.3f} s" for name, s in warm_peers.items()},
        )

    def _time_peer(self, name: str, peers: dict[str, Callable[[str], None]],
                   samples: dict[str, list[float]], rep: int) -> None:
        """One timed call of peer ``name``; a failure drops it (and its samples) from ``peers``
        and says why."""
        if sum(samples[name]) > self.peer_budget_s:
            return  # a slow peer gets fewer repetitions, never invented ones
        out = self.path(f"{name}-{rep}")
        self.cold()
        try:
            samples[name].append(timed(partial(peers[name], out)))
        except Exception as exc:  # no figure from the calls that did not fail
            self.skip(name, f"repetition {rep + 1} failed: {type(exc).__name__}: {exc}")
            del peers[name], samples[name]
            remove(out)
            return
        if name == "dcp_save":
            self._keep_dcp(out)
        else:
            remove(out)

    def skip(self, key: str, reason: str) -> None:
        """Row ``key`` is not measured: said in the notes, and its ratios get no verdict."""
        self.report.skipped[key] = reason
        self.report.notes.append(f"{key} SKIPPED: {reason}")

    def _warm_up(self, name: str, write: Callable[[str], None]) -> float:
        """One untimed call of a peer, as the engine's first save and DCP's first async_save
        are: its first call pays imports, planners and thread pools; its seconds."""
        out = self.path(f"{name}-warm-up")
        self.cold()
        try:
            return timed(partial(write, out))
        finally:
            remove(out)

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
        """(s until async_save returned, s until its future was done and its files and
        folders fsynced)."""
        out = self.path(f"dcp-async-{tag}")
        start = time.perf_counter()
        future = dcp_async_save(self.state, out)
        stall = time.perf_counter() - start
        future.result()
        fsync_tree(out)
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
        if not self.dcp_ckpt:
            del loaders["dcp_load"]
            self.skip("dcp_load", "no DCP checkpoint to read: DCP save was skipped")
        samples: dict[str, list[float]] = {k: [] for k in loaders}
        for rep in range(self.reps):
            for name in (k for k in LOAD_ORDERS[rep % len(LOAD_ORDERS)] if k in loaders):
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
    measured = {r.key for r in report.rows}
    for spec in RATIOS:
        missing = [k for k in (spec.ours, spec.theirs) if k not in measured]
        if missing:
            report.ratios.append(replace(spec, skipped="; ".join(
                f"{k}: {report.skipped.get(k, 'not measured')}" for k in missing)))
            continue
        ours, theirs = report.row(spec.ours), report.row(spec.theirs)
        value = ratio_value(ours, theirs, paired=spec.paired)
        n = min(len(ours.samples), len(theirs.samples))
        report.ratios.append(replace(spec, value=value, n=n))


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
        if r.verdict == "n/a":
            how += f"; n={r.n}: at least {MIN_SAMPLES} samples a side for a verdict"
        if r.skipped:
            lines.append(f"  ratio {r.what:<44}    -     {r.target:<16} skipped  ({r.skipped})")
            continue
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


def to_json(report: Report) -> dict[str, Any]:
    rows = [
        asdict(r) | {"seconds": r.seconds, "gib_s": r.gib_s if r.nbytes else None}
        for r in report.rows
    ]
    ratios = [asdict(r) | {"verdict": r.verdict} | ({"value": None} if r.skipped else {})
              for r in report.ratios]
    return {"config": report.config, "notes": report.notes, "rows": rows, "ratios": ratios,
            "skipped": report.skipped}


def _sweep_sizes(text: str) -> list[float]:
    """``--sweep``'s sizes in GiB; empty when one is not a finite number > 0."""
    try:
        sizes = [float(x) for x in text.split(",")]
    except ValueError:
        return []
    return sizes if all(math.isfinite(x) and x > 0 for x in sizes) else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--size-gib", type=finite(above=0),
        help="state size in GiB (default 2.0; 0.25 with --quick)")
    add("--dir", help="parent of the scratch folder (default /var/tmp: a real disk, not tmpfs)")
    add("--quick", action="store_true",
        help="smoke run: 0.25 GiB, 1 repetition (too few for a verdict: n/a)")
    add("--reps", type=at_least(1), help="timed repetitions per method (default 3; 1 with --quick)")
    add(
        "--peer-budget-s",
        type=finite(at_least=0),
        default=60.0,
        help="seconds after which a slow baseline stops repeating",
    )
    add("--json", help="also write the results to this file")
    add("--sweep", help="instead: engine save vs O_DIRECT at these sizes in GiB (1,2,4,8), "
        "with peak RSS; no other peers (they would not fit in memory at 8 GiB)")
    args = parser.parse_args(argv)
    if args.sweep:
        sizes = _sweep_sizes(args.sweep)
        if not sizes:
            parser.error("--sweep: give sizes in GiB > 0 separated by commas, "
                         f"got {args.sweep!r}")
        parent = args.dir or default_parent()
        points = [scale_point(size, parent, args.reps or 1) for size in sizes]
        print(render_scale(points))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(scale_json(points), f, indent=1)
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
