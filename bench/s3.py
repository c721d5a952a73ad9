"""S3 benchmark: the engine's persist and load on a SeaweedFS cluster against raw concurrent
transfers (s3fs, and obstore: the engine's own client).

    python -m bench.s3 [--reps N] [--io-threads N] [--json PATH] [--quick] [--ranks N]
                       [--mesh DP,TP,PP] [--only-ranks]

Starts a SeaweedFS cluster on loopback (``chaos/infra/seaweedfs.py``: master, 2 volume servers,
filer, S3 gateway) and, for two states in one process,

- ``quickstart``: the quickstart trainer's model and Adam moments (2 layers, d_model 64,
  vocab 256; 75 fp32 tensors, ~1.6 MiB),
- ``large``: the same GPT at 8 layers, d_model 96, vocab 768 (255 tensors, ~12 MiB),

measures

- engine persist: ``save()`` call to the COMMIT marker written (``handle.wait()`` returned),
- engine load: ``load()`` of that step into a fresh state of the same shapes,

against a raw baseline measured in the same run: the objects the engine's save left on S3
(their bytes, read back untimed: shards, metadata, rank records, COMMIT) uploaded with ``s3fs``
``pipe_file`` from a pool of ``--io-threads`` threads (the engine's ``io_threads``), then
downloaded the same way with one ranged ``cat_file`` (one GET) per object; and the same
transfers with obstore (``put`` / ``get_range``), the client the engine itself uses, which
costs far less CPU per request than s3fs: against it the ratio is the engine's own overhead
(protocol, checksums, staging). Every method runs once in each repetition, in turn (slow drift
of the machine hits all alike); medians are printed
with the ratios (issue 12's targets: persist and load <= 1.5x raw s3fs; a verdict from at
least 3 repetitions, else n/a).

``--ranks N`` (N > 1) adds ``quickstart xN``: N gloo processes on this machine save the
quickstart state as data-parallel replicas (each rank writes its share of the objects; rank 0
commits); persist is the slowest rank's ``save()`` call to its ``handle.wait()`` (the COMMIT
visible to every rank), load the slowest rank's ``load()``; the raw baseline moves the same
objects from one process with ``N x --io-threads`` threads (for the load, every object N times:
each replica reads the whole state).

``--mesh DP,TP,PP`` (e.g. ``2,2,2``) adds ``quickstart DPxTPxPP``: DP x TP x PP gloo processes
build the trainer's own state for that layout, as the trainer does (``trainer.train.Trainer``
on the quickstart model: pipeline stages, tensor-parallel DTensors, FSDP2 over dp; one
training step, so that AdamW's moments exist) and save what the trainer checkpoints (its
``get_state_dict`` model and flattened optimizer state, and its ``train`` record): each rank
writes its own shards, rank 0 commits. Persist and load are timed as for ``--ranks`` (the load
into a fresh state of the same layout: ``empty_like`` of every DTensor), and the raw baseline
moves the objects the save left from one process with ``world x --io-threads`` threads, each
object once both ways (each rank reads its own shards, and rank 0 the shared documents:
nothing is a whole replica). The ranks share the machine's cores with the SeaweedFS cluster.

Requests: each operation is repeated once, untimed, through a counting TCP proxy
(``chaos/infra/proxy.py``), which gives the HTTP requests a save and a load make; the
engine's own count is printed when it reports one (``handle.requests``; else ``n/a``). With
``--ranks`` or ``--mesh`` the rows give what each rank's engine reports instead (no proxy).
Everything is deleted with the cluster at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.chaos.infra.seaweedfs import SeaweedCluster
from antifragile.engine import CheckpointEngine
from antifragile.engine.storage._s3 import store_config
from antifragile.trainer.model import GPT, ModelConfig
from bench._args import at_least

if TYPE_CHECKING:
    from antifragile.trainer.parallel.dims import ParallelDims

STATES = {
    "quickstart": ModelConfig(layers=2, d_model=64, heads=4, vocab=256, seq_len=32),
    "large": ModelConfig(layers=8, d_model=96, heads=4, vocab=768, seq_len=64),
}
RAW = ("raw_put", "raw_put_obstore", "raw_get", "raw_get_obstore")
TARGET = 1.5  # issue 12: persist and load within 1.5x the raw concurrent transfer
MIN_SAMPLES = 3  # a verdict rests on a median of at least this many samples a side


def gpt_state(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """What a trainer checkpoints: model weights and Adam's two moments per weight."""
    torch.manual_seed(seed)
    model = {k: v.detach().clone() for k, v in GPT(cfg).state_dict().items()}
    optim = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
             for k, v in model.items()}
    return {"model": model, "optim": optim, "step": 0}


def trainer_state(dims: ParallelDims, cfg: ModelConfig) -> dict[str, Any]:
    """This rank's share of what the trainer checkpoints at ``dims`` (the default process
    group already joined): ``trainer.train.Trainer`` builds the model as a training run does,
    one step on the scenarios' batch (8, 2 micro-batches) fills AdamW's state, and the state
    dict is the trainer's own (``trainer.checkpoint.checkpoint_state``)."""
    import types

    import torch.distributed as dist

    from antifragile.trainer.checkpoint import checkpoint_state
    from antifragile.trainer.config import TrainConfig
    from antifragile.trainer.train import Trainer

    ctx = types.SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                device=torch.device("cpu"))
    trainer = Trainer(TrainConfig(parallel=dims, model=cfg, batch_size=8, micro_batches=2),
                      ctx, types.SimpleNamespace(bump=lambda: None))
    trainer.train_step(0)
    return checkpoint_state(trainer.model, trainer.optimizer,
                            {"step": 1, "data_cursor": 8, "seed": 0})


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor in ``state``, a DTensor as this rank's local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return [state.to_local()]
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


def check_loaded(state: Any, target: Any, step: int, loaded: int) -> None:
    """A timed load is a figure only of the right data: ``target`` holds ``state``'s values
    and the load returned ``step``. Raises ``RuntimeError`` (not an ``assert``: kept under
    ``python -O``)."""
    if loaded != step:
        raise RuntimeError(f"load returned step {loaded}, not {step}")
    if not all(torch.equal(a, b) for a, b in zip(_tensors(target), _tensors(state),
                                                  strict=True)):
        raise RuntimeError(f"load returned different values from those saved at step {step}")


def _empty_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    return state


@dataclass(slots=True)
class Figures:
    """One state's medians (seconds), request counts and sizes."""

    state: str
    tensors: int
    payload_bytes: int
    objects: int = 0
    object_bytes: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)
    requests: dict[str, int | None] = field(default_factory=dict)

    def median(self, key: str) -> float:
        return statistics.median(self.samples[key])

    def ratio(self, engine: str, raw: str) -> float:
        return self.median(engine) / self.median(raw)

    def verdict(self, engine: str, raw: str) -> str:
        """PASS when the engine took at most ``TARGET`` times the raw transfer (a NaN: MISS);
        n/a from fewer than ``MIN_SAMPLES`` samples a side (no spread to judge by)."""
        if min(len(self.samples[engine]), len(self.samples[raw])) < MIN_SAMPLES:
            return "n/a"
        return "PASS" if self.ratio(engine, raw) <= TARGET else "MISS"


class Bench:
    def __init__(self, cluster: SeaweedCluster, io_threads: int) -> None:
        import s3fs

        self.cluster = cluster
        self.io_threads = io_threads
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        cluster.client().create_bucket(Bucket=self.bucket)
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                    **cluster.storage_options)
        self.store = _obstore(self.bucket, cluster.storage_options)
        self.pool = ThreadPoolExecutor(io_threads)
        self._step = 0

    def next_step(self) -> int:
        self._step += 1
        return self._step

    def engine(self, prefix: str, options: dict[str, Any] | None = None) -> CheckpointEngine:
        return CheckpointEngine(f"s3://{self.bucket}/{prefix}", keep_last=None,
                                io_threads=self.io_threads,
                                storage_options=options or self.cluster.storage_options)

    def save(self, engine: CheckpointEngine, state: dict[str, Any]) -> tuple[float, Any, int]:
        step = self.next_step()
        start = time.perf_counter()
        handle = engine.save(step, state)
        handle.wait()
        return time.perf_counter() - start, handle, step

    def load(self, engine: CheckpointEngine, state: dict[str, Any], step: int) -> float:
        target = _empty_like(state)
        start = time.perf_counter()
        loaded = engine.load(target, step=step)
        seconds = time.perf_counter() - start
        check_loaded(state, target, step, loaded)
        return seconds

    def objects(self, prefix: str, step: int) -> dict[str, int]:
        """Key -> size of every object the save of ``step`` left."""
        root = f"{self.bucket}/{prefix}/step_{step:09d}"
        return {k: int(v["size"]) for k, v in self.fs.find(root, detail=True).items()}

    def contents(self, objects: dict[str, int]) -> list[bytes]:
        """The bytes of ``objects`` (key -> size, see :meth:`objects`), smallest first: what
        the raw baselines upload, so that both sides move the same bytes (zero-filled buffers
        of the same sizes compress, the engine's fp32 shards do not)."""
        return [bytes(self.fs.cat_file(key)) for key in sorted(objects, key=objects.__getitem__)]

    def raw_put(self, prefix: str, blobs: list[bytes]) -> float:
        start = time.perf_counter()
        list(self.pool.map(lambda item: self.fs.pipe_file(
            f"{self.bucket}/{prefix}/{item[0]}", item[1]), enumerate(blobs)))
        return time.perf_counter() - start

    def raw_get(self, prefix: str, sizes: list[int], fs: Any = None, times: int = 1) -> float:
        """One ranged GET per object (a plain ``cat_file`` would HEAD each object first), each
        object ``times`` times."""
        fs = fs or self.fs
        start = time.perf_counter()
        list(self.pool.map(lambda item: fs.cat_file(f"{self.bucket}/{prefix}/{item[0]}",
                                                     start=0, end=item[1]),
                           list(enumerate(sizes)) * times))
        return time.perf_counter() - start

    def raw_put_obstore(self, prefix: str, blobs: list[bytes]) -> float:
        import obstore

        start = time.perf_counter()
        list(self.pool.map(lambda item: obstore.put(
            self.store, f"{prefix}/{item[0]}", item[1]), enumerate(blobs)))
        return time.perf_counter() - start

    def raw_get_obstore(self, prefix: str, sizes: list[int], times: int = 1) -> float:
        import obstore

        start = time.perf_counter()
        list(self.pool.map(lambda item: obstore.get_range(
            self.store, f"{prefix}/{item[0]}", start=0, end=item[1]),
            list(enumerate(sizes)) * times))
        return time.perf_counter() - start

    @contextlib.contextmanager
    def through_proxy(self) -> Iterator[tuple[dict[str, Any], Any, FaultProxy]]:
        """s3fs options and a filesystem whose every request crosses a counting proxy."""
        import s3fs

        with FaultProxy.in_front_of(self.cluster.endpoint_url) as proxy:
            options = {**self.cluster.storage_options, "endpoint_url": proxy.endpoint_url}
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
            yield options, fs, proxy


def _obstore(bucket: str, storage_options: dict[str, Any]) -> Any:
    from obstore.store import S3Store

    return S3Store(bucket, **store_config(storage_options))


def measure(bench: Bench, name: str, cfg: ModelConfig, reps: int) -> Figures:
    state = gpt_state(cfg)
    tensors = _tensors(state)
    fig = Figures(name, len(tensors), sum(t.numel() * t.element_size() for t in tensors))
    prefix = f"{name}/engine"
    engine = bench.engine(prefix)
    _, _, warm = bench.save(engine, state)  # plans, allocates staging: not what is measured
    blobs = bench.contents(bench.objects(prefix, warm))  # the engine's own bytes
    sizes = [len(b) for b in blobs]
    fig.objects, fig.object_bytes = len(sizes), sum(sizes)
    raw = f"{name}/raw"
    for key in RAW + ("persist", "load"):
        fig.samples[key] = []
    for _ in range(reps):
        seconds, _, step = bench.save(engine, state)
        fig.samples["persist"].append(seconds)
        fig.samples["raw_put"].append(bench.raw_put(raw, blobs))
        fig.samples["raw_put_obstore"].append(bench.raw_put_obstore(raw, blobs))
        with bench.engine(prefix) as fresh:  # a new engine per load: nothing cached
            fig.samples["load"].append(bench.load(fresh, state, step))
        fig.samples["raw_get"].append(bench.raw_get(raw, sizes))
        fig.samples["raw_get_obstore"].append(bench.raw_get_obstore(raw, sizes))
    engine.close()

    with bench.through_proxy() as (options, fs, proxy):
        with bench.engine(prefix, options) as e:
            bench.save(e, state)  # plans and allocates staging: not counted
            before = proxy.snapshot()
            _, handle, step = bench.save(e, state)
            fig.requests["save"] = proxy.snapshot().since(before).requests
            fig.requests["save_engine_reported"] = handle.requests.get("total")
        with bench.engine(prefix, options) as e:
            before = proxy.snapshot()
            bench.load(e, state, step)
            fig.requests["load"] = proxy.snapshot().since(before).requests
            fig.requests["load_engine_reported"] = e.last_load_requests.get("total")
        before = proxy.snapshot()
        for i, blob in enumerate(blobs):
            fs.pipe_file(f"{bench.bucket}/{raw}/{i}", blob)
        fig.requests["raw_put"] = proxy.snapshot().since(before).requests
        before = proxy.snapshot()
        bench.raw_get(raw, sizes, fs)
        fig.requests["raw_get"] = proxy.snapshot().since(before).requests
    return fig


def _rank_worker(rank: int, ranks: int, port: int, url: str, options: dict[str, Any],
                 io_threads: int, reps: int, out: Any,
                 mesh: tuple[int, int, int] | None = None) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        if mesh is None:
            state = gpt_state(STATES["quickstart"])
        else:
            from antifragile.trainer.parallel.dims import ParallelDims

            dp, tp, pp = mesh
            state = trainer_state(ParallelDims(dp=dp, tp=tp, pp=pp), STATES["quickstart"])
        local = _tensors(state)
        persist, load, requests = [], [], {}
        with CheckpointEngine(url, keep_last=None, io_threads=io_threads,
                              storage_options=options) as engine:
            for step in range(1, reps + 2):
                dist.barrier()
                start = time.perf_counter()
                handle = engine.save(step, state)
                handle.wait()
                persist.append(time.perf_counter() - start)
                requests["save"] = handle.requests.get("total")
            for _ in range(reps):
                target = _empty_like(state)
                dist.barrier()
                start = time.perf_counter()
                loaded = engine.load(target, step=reps + 1)
                load.append(time.perf_counter() - start)
                check_loaded(state, target, reps + 1, loaded)
                requests["load"] = engine.last_load_requests.get("total")
        # the first save plans: not measured
        out.put((rank, persist[1:], load, requests,
                 (len(local), sum(t.numel() * t.element_size() for t in local))))
    finally:
        dist.destroy_process_group()


def measure_ranks(bench: Bench, ranks: int, reps: int,
                  mesh: tuple[int, int, int] | None = None) -> Figures:
    """``quickstart xN`` (data-parallel replicas), or with ``mesh`` (dp, tp, pp) the trainer's
    state at that layout on dp x tp x pp ranks: see the module docstring."""
    import socket

    import torch.multiprocessing as mp

    if mesh is not None:
        ranks = mesh[0] * mesh[1] * mesh[2]
    name = (f"quickstart x{ranks} ranks" if mesh is None else
            "quickstart {}x{}x{} (dp x tp x pp, {} ranks)".format(*mesh, ranks))
    prefix = (f"ranks{ranks}" if mesh is None else "mesh{}x{}x{}".format(*mesh)) + "/engine"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_rank_worker, args=(ranks, port, f"s3://{bench.bucket}/{prefix}",
                                           bench.cluster.storage_options, bench.io_threads,
                                           reps, out, mesh), nprocs=ranks, start_method="spawn")
    rows = sorted(out.get() for _ in range(ranks))
    if mesh is None:  # replicas: one rank's state is the payload
        fig = Figures(name, rows[0][4][0], rows[0][4][1])
    else:  # every rank's shards (a DTensor's local part; a replicated scalar on each)
        fig = Figures(name, sum(r[4][0] for r in rows), sum(r[4][1] for r in rows))
    fig.samples["persist"] = [max(r[1][i] for r in rows) for i in range(reps)]
    fig.samples["load"] = [max(r[2][i] for r in rows) for i in range(reps)]
    fig.requests = {f"rank{r}_{k}": v for r, _, _, q, _ in rows for k, v in q.items()}
    blobs = bench.contents(bench.objects(prefix, reps + 1))  # the engine's own bytes
    sizes = [len(b) for b in blobs]
    fig.objects, fig.object_bytes = len(sizes), sum(sizes)
    wide = Bench.__new__(Bench)
    wide.fs, wide.store, wide.bucket = bench.fs, bench.store, bench.bucket
    wide.pool = ThreadPoolExecutor(ranks * bench.io_threads)
    for key in RAW:
        fig.samples[key] = []
    raw = prefix.replace("/engine", "/raw")
    reads = ranks if mesh is None else 1  # replicas each read the whole state; shards once
    for _ in range(reps):
        fig.samples["raw_put"].append(wide.raw_put(raw, blobs))
        fig.samples["raw_put_obstore"].append(wide.raw_put_obstore(raw, blobs))
        fig.samples["raw_get"].append(wide.raw_get(raw, sizes, times=reads))
        fig.samples["raw_get_obstore"].append(wide.raw_get_obstore(raw, sizes, times=reads))
    wide.pool.shutdown()
    return fig


def _print(fig: Figures) -> None:
    mib = fig.payload_bytes / 2**20
    print(f"\n{fig.state}: {fig.tensors} tensors, {mib:.2f} MiB payload; the save leaves "
          f"{fig.objects} objects, {fig.object_bytes / 2**20:.2f} MiB")
    for key, what in (("persist", "engine persist: save() -> COMMIT"),
                      ("raw_put", "raw s3fs PUT of the same objects"),
                      ("raw_put_obstore", "raw obstore PUT of the same objects"),
                      ("load", "engine load()"),
                      ("raw_get", "raw s3fs GET of the same objects"),  # one GET each
                      ("raw_get_obstore", "raw obstore GET of the same objects")):
        xs = fig.samples[key]
        print(f"  {what:<38} median {fig.median(key):7.3f} s  "
              f"(min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})")
    for engine, raw, what in (("persist", "raw_put", "persist / raw s3fs PUT"),
                              ("load", "raw_get", "load / raw s3fs GET")):
        print(f"  ratio {what:<25} {fig.ratio(engine, raw):5.2f}x  (target <= {TARGET}x: "
              f"{fig.verdict(engine, raw)})")
    for engine, raw, what in (("persist", "raw_put_obstore", "persist / raw obstore PUT"),
                              ("load", "raw_get_obstore", "load / raw obstore GET")):
        print(f"  ratio {what:<25} {fig.ratio(engine, raw):5.2f}x  (the engine's own client: "
              "its overhead over the bare transfers)")
    q = fig.requests
    if "save" not in q:  # several ranks: what each rank's engine reports
        print("  requests (engine reports, per rank): " + ", ".join(
            f"{k} {v}" for k, v in sorted(q.items())))
        return
    print(f"  HTTP requests: save {q['save']} (engine reports {q['save_engine_reported']}), "
          f"load {q['load']} (engine reports {q.get('load_engine_reported')}); raw PUT "
          f"{q['raw_put']}, raw GET {q['raw_get']}")


def _mesh(text: str) -> tuple[int, int, int]:
    """``DP,TP,PP``: three whole numbers >= 1."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"give DP,TP,PP (e.g. 2,2,2), got {text!r}")
    dp, tp, pp = (at_least(1)(part) for part in parts)
    return dp, tp, pp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.s3", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions (default 5)")
    parser.add_argument("--io-threads", type=at_least(1), default=8,
                        help="the engine's io_threads and the raw baseline's pool (default 8)")
    parser.add_argument("--volumes", type=at_least(1), default=2, help="volume servers (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="2 repetitions, quickstart only (too few for a verdict: n/a)")
    parser.add_argument("--ranks", type=at_least(1), default=1,
                        help="also measure the quickstart state saved by N gloo ranks")
    parser.add_argument("--mesh", type=_mesh, metavar="DP,TP,PP",
                        help="also measure the trainer's state at this layout on DP*TP*PP gloo "
                             "ranks (e.g. 2,2,2)")
    parser.add_argument("--only-ranks", action="store_true",
                        help="with --ranks or --mesh: skip the one-process states")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.only_ranks and args.ranks < 2 and args.mesh is None:  # no state left to measure
        parser.error("--only-ranks: give --ranks N with N > 1 or --mesh (the states it keeps)")
    reps = 2 if args.quick else args.reps
    states = {"quickstart": STATES["quickstart"]} if args.quick else STATES
    torch.set_num_threads(1)
    with SeaweedCluster(volumes=args.volumes) as cluster:
        assert cluster.start_s is not None
        print(f"SeaweedFS cluster (master, {args.volumes} volume servers, filer, S3 gateway) "
              f"started and healthy in {cluster.start_s:.2f} s at {cluster.endpoint_url}; "
              f"io_threads {args.io_threads}, {reps} repetitions")
        bench = Bench(cluster, args.io_threads)
        figures = [] if args.only_ranks else [measure(bench, name, cfg, reps)
                                              for name, cfg in states.items()]
        if args.ranks > 1:
            figures.append(measure_ranks(bench, args.ranks, reps))
        if args.mesh is not None:
            figures.append(measure_ranks(bench, 0, reps, args.mesh))
        for fig in figures:
            _print(fig)
        start_s = cluster.start_s
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster_start_s": start_s, "io_threads": args.io_threads,
                       "states": [{**asdict(fig),
                                   "medians": {k: fig.median(k) for k in fig.samples},
                                   "persist_ratio": fig.ratio("persist", "raw_put"),
                                   "persist_verdict": fig.verdict("persist", "raw_put"),
                                   "load_ratio": fig.ratio("load", "raw_get"),
                                   "load_verdict": fig.verdict("load", "raw_get"),
                                   "target": TARGET,
                                   "persist_ratio_obstore": fig.ratio("persist",
                                                                      "raw_put_obstore"),
                                   "load_ratio_obstore": fig.ratio("load", "raw_get_obstore")}
                                  for fig in figures]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
